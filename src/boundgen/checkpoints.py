"""Synthetic HuggingFace checkpoints: real shapes, seeded random weights, a local tokenizer.

`make_model("tiny", out)` writes a directory that `transformers` and `boundgen` load like a hub
checkpoint: `config.json`, `generation_config.json`, `model.safetensors` (or shards +
`model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`. Nothing is downloaded.

- Presets: `tiny` (~0.3M params, for tests) and the real shapes of `qwen2.5-0.5b`, `qwen3-0.6b`,
  `llama3.2-1b`. `arch` (qwen2 | qwen3 | llama) picks the family for any preset.
- Weights are a pure function of (preset, arch, seq_cls, seed, dtype): each tensor has its own
  generator, seeded from the seed and the tensor name, and is drawn in fixed row chunks, so the
  bytes are identical from run to run and big checkpoints stream to disk one chunk at a time.
- The tokenizer is a byte-level BPE trained on `boundgen/data/corpus.txt` (2000 tokens for `tiny`,
  8000 for the real presets). Special tokens follow the BPE vocabulary, as in real Qwen/Llama
  tokenizers; the config keeps the real `vocab_size`, so embedding rows past the tokenizer are
  unused.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from boundgen.config import DTYPES

ARCHS = ("qwen2", "qwen3", "llama")

_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# Family structure; shapes come from the preset.
_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {
        "model_type": "qwen2",
        "prefix": "Qwen2",
        "attention_bias": True,
        "qk_norm": False,
        "tokenizer": "qwen",
    },
    "qwen3": {
        "model_type": "qwen3",
        "prefix": "Qwen3",
        "attention_bias": False,
        "qk_norm": True,
        "tokenizer": "qwen",
    },
    "llama": {
        "model_type": "llama",
        "prefix": "Llama",
        "attention_bias": False,
        "qk_norm": False,
        "tokenizer": "llama",
    },
}

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Preset -> shape and init settings. `arch_overrides[arch]` applies when that family is chosen.
# `vocab_size: None` means "tokenizer size rounded up to a multiple of 64".
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "arch": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": None,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "tokenizer_vocab": 2000,
        "dtype": "float32",
        "init_std": 0.15,
        "norm_noise": 0.1,
        "arch_overrides": {
            # untied head on qwen2, tied on qwen3/llama, so both head kinds get tested
            "qwen2": {"tie_word_embeddings": False},
            # q/k width (4 x 32) differs from hidden (64), as in real Qwen3
            "qwen3": {"head_dim": 32},
            # scaled-down llama3 rope scaling: wavelengths fall in all three bands
            "llama": {
                "rms_norm_eps": 1e-5,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        },
    },
    "qwen2.5-0.5b": {
        "arch": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "tokenizer_vocab": 8000,
        "dtype": "bfloat16",
        "init_std": 0.02,
        "norm_noise": 0.05,
        "arch_overrides": {},
    },
    "qwen3-0.6b": {
        "arch": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "tokenizer_vocab": 8000,
        "dtype": "bfloat16",
        "init_std": 0.02,
        "norm_noise": 0.05,
        "arch_overrides": {},
    },
    "llama3.2-1b": {
        "arch": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "tokenizer_vocab": 8000,
        "dtype": "bfloat16",
        "init_std": 0.02,
        "norm_noise": 0.05,
        "arch_overrides": {"llama": {"rope_scaling": _LLAMA3_ROPE_SCALING}},
    },
}

# Rows are drawn in chunks of at most this many values (changing it changes the bytes).
_CHUNK_ELEMENTS = 1 << 22

# Files this module writes (and removes first with overwrite=True).
_OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def default_model_dir() -> Path:
    """Where generated models are cached: `$BOUNDGEN_CACHE`, else `~/.cache/boundgen`."""
    root = os.environ.get("BOUNDGEN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "boundgen"


# --------------------------------------------------------------------------------------- tokenizer

_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# style -> (special tokens in id order, bos, eos, pad, regex)
_TOKENIZER_STYLES: dict[str, dict[str, Any]] = {
    "qwen": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "split": _QWEN_SPLIT,
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": (
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    },
    "llama": {
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": "<|end_of_text|>",
        "pad": "<|end_of_text|>",
        "split": _LLAMA_SPLIT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
            "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
            "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
        ),
    },
}


def _corpus_lines() -> list[str]:
    path = Path(__file__).parent / "data" / "corpus.txt"
    return path.read_text(encoding="utf-8").splitlines()


@functools.lru_cache(maxsize=8)
def _tokenizer_json(style: str, bpe_vocab: int) -> str:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    spec = _TOKENIZER_STYLES[style]
    tok = Tokenizer(models.BPE())
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_lines(), trainer)
    # Special tokens follow the BPE vocabulary (ids bpe_size, bpe_size + 1, ...), as in Qwen/Llama.
    tok.add_special_tokens(spec["special"])
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if spec["bos"] is None:
        tok.post_processor = byte_level
    else:
        bos = spec["bos"]
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.Sequence(
            [
                byte_level,
                processors.TemplateProcessing(
                    single=f"{bos} $A",
                    pair=f"{bos} $A {bos}:1 $B:1",
                    special_tokens=[(bos, bos_id)],
                ),
            ]
        )
    data = json.loads(tok.to_str())
    if style == "llama":
        data["model"]["ignore_merges"] = True  # as in Llama 3: whole-word vocab hits skip merging
    return json.dumps(data, ensure_ascii=False, indent=2)


def build_tokenizer(arch: str = "qwen2", bpe_vocab: int = 2000):
    """The `tokenizers.Tokenizer` `make_model` writes for this family (cached; a fresh object)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(_FAMILIES[_check_arch(arch)]["tokenizer"], bpe_vocab))


# ------------------------------------------------------------------------------------------ config


def _check_preset(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[preset]


def _check_arch(arch: str) -> str:
    if arch not in _FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS)}")
    return arch


def _check_dtype(dtype: str) -> str:
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")
    return name


def _check_seq_cls(seq_cls: int | None) -> None:
    if seq_cls is None:
        return
    if isinstance(seq_cls, bool) or not isinstance(seq_cls, int) or seq_cls < 1:
        raise ValueError(f"seq_cls must be a number of labels (an int >= 1), got {seq_cls!r}")


@dataclasses.dataclass(frozen=True)
class _Resolved:
    preset: str
    arch: str
    settings: dict[str, Any]  # preset dict with arch overrides applied
    dtype: str


def _resolve(preset: str, arch: str | None, dtype: str | None) -> _Resolved:
    base = _check_preset(preset)
    arch = _check_arch(arch or base["arch"])
    settings = {k: copy.deepcopy(v) for k, v in base.items() if k != "arch_overrides"}
    settings.update(copy.deepcopy(base["arch_overrides"].get(arch, {})))
    return _Resolved(preset, arch, settings, _check_dtype(dtype or settings["dtype"]))


def hf_config(
    preset: str, arch: str | None = None, seq_cls: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The `config.json` dict `make_model` writes (uses the cached tokenizer for special ids)."""
    _check_seq_cls(seq_cls)
    r = _resolve(preset, arch, dtype)
    s, fam = r.settings, _FAMILIES[r.arch]
    style = _TOKENIZER_STYLES[fam["tokenizer"]]
    tok = build_tokenizer(r.arch, s["tokenizer_vocab"])
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = s["vocab_size"] or 64 * math.ceil(n_tok / 64)
    if vocab_size < n_tok:
        raise ValueError(f"preset {preset!r}: vocab_size {vocab_size} < tokenizer size {n_tok}")
    eos_id = tok.token_to_id(style["eos"])
    bos_id = tok.token_to_id(style["bos"]) if style["bos"] else eos_id  # Qwen: bos = <|endoftext|>
    pad_id = tok.token_to_id(style["pad"])

    task = "ForSequenceClassification" if seq_cls else "ForCausalLM"
    cfg: dict[str, Any] = {
        "architectures": [fam["prefix"] + task],
        "model_type": fam["model_type"],
        "vocab_size": vocab_size,
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"],
    }
    # Qwen2 configs omit head_dim (hidden / heads); HF Qwen2 still reads it when present.
    if r.arch != "qwen2" or s["head_dim"] * s["num_attention_heads"] != s["hidden_size"]:
        cfg["head_dim"] = s["head_dim"]
    cfg.update(
        {
            "hidden_act": "silu",
            "max_position_embeddings": s["max_position_embeddings"],
            "rms_norm_eps": s["rms_norm_eps"],
            "rope_theta": s["rope_theta"],
            "rope_scaling": s["rope_scaling"],
            "tie_word_embeddings": s["tie_word_embeddings"],
            "attention_dropout": 0.0,
            "initializer_range": s["init_std"],
            "use_cache": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "torch_dtype": r.dtype,
            "dtype": r.dtype,
        }
    )
    if r.arch == "qwen2":
        cfg.update(
            {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": s["num_hidden_layers"],
            }
        )
    elif r.arch == "qwen3":
        cfg.update(
            {
                "attention_bias": False,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": s["num_hidden_layers"],
            }
        )
    else:
        cfg.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    if seq_cls:
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(seq_cls)}
        cfg["label2id"] = {f"LABEL_{i}": i for i in range(seq_cls)}
    return cfg


# ----------------------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" (normal), "bias" (small normal), "norm" (1 + noise)


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """HF tensor names and shapes for a config written by `hf_config`, in file order."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // n_heads
    model_type = config["model_type"]
    bias = model_type == "qwen2"
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], h), "weight")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "norm"))
        qkv_rows = (("q", n_heads * head_dim), ("k", n_kv * head_dim), ("v", n_kv * head_dim))
        for proj, rows in qkv_rows:
            specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.weight", (rows, h), "weight"))
            if bias:
                specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.bias", (rows,), "bias"))
        specs.append(TensorSpec(p + "self_attn.o_proj.weight", (h, n_heads * head_dim), "weight"))
        if model_type == "qwen3":
            specs.append(TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), "norm"))
            specs.append(TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), "norm"))
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "norm"))
        specs.append(TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "weight"))
        specs.append(TensorSpec(p + "mlp.up_proj.weight", (inter, h), "weight"))
        specs.append(TensorSpec(p + "mlp.down_proj.weight", (h, inter), "weight"))
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    if config["architectures"][0].endswith("ForSequenceClassification"):
        specs.append(TensorSpec("score.weight", (len(config["id2label"]), h), "weight"))
    elif not config["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], h), "weight"))
    return specs


def param_count(config: dict[str, Any]) -> int:
    """Parameters of the model (a tied LM head counted once, like `model.parameters()`)."""
    return sum(math.prod(s.shape) for s in tensor_specs(config))


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tensor_chunks(
    spec: TensorSpec, seed: int, std: float, norm_noise: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The tensor's values in row chunks, already in `dtype`."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    rows, row_elems = spec.shape[0], math.prod(spec.shape[1:])
    step = max(1, _CHUNK_ELEMENTS // row_elems)
    for start in range(0, rows, step):
        shape = (min(step, rows - start), *spec.shape[1:])
        values = torch.empty(shape, dtype=torch.float32)
        if spec.kind == "norm":
            values.normal_(1.0, norm_noise, generator=gen)
        else:
            values.normal_(0.0, std if spec.kind == "weight" else std / 2, generator=gen)
        yield values.to(dtype)


def _write_safetensors(
    path: Path, specs: list[TensorSpec], chunks, dtype: torch.dtype, bar
) -> None:
    """Stream tensors into one safetensors file, never holding more than one chunk in memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = math.prod(spec.shape) * itemsize
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for spec in specs:
            for chunk in chunks(spec):
                data = chunk.contiguous().view(-1).view(torch.uint8).numpy()
                f.write(data.data)
                if bar is not None:
                    bar.update(data.nbytes)
    os.replace(tmp, path)


def _shard(specs: list[TensorSpec], itemsize: int, max_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        size = math.prod(spec.shape) * itemsize
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


# ----------------------------------------------------------------------------------------- writing


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"output directory {out} exists and is not empty "
                "(pass overwrite=True / --overwrite to replace the model in it)"
            )
        for entry in out.iterdir():
            if entry.is_file() and (
                entry.name in _OUTPUT_FILES
                or _SHARD_RE.fullmatch(entry.name)
                or entry.name.endswith(".partial")
            ):
                entry.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _write_tokenizer(out: Path, arch: str, bpe_vocab: int, max_len: int) -> None:
    style = _TOKENIZER_STYLES[_FAMILIES[arch]["tokenizer"]]
    text = _tokenizer_json(_FAMILIES[arch]["tokenizer"], bpe_vocab)
    _write_text(out / "tokenizer.json", text + "\n")
    vocab = json.loads(text)["added_tokens"]
    special = {t["content"]: t["id"] for t in vocab}
    added_decoder = {
        str(i): {
            "content": c,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for c, i in special.items()
    }
    named = {"bos_token": style["bos"], "eos_token": style["eos"], "pad_token": style["pad"]}
    extra = [t for t in style["special"] if t not in named.values()]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": style["tokenizer_class"],
            **named,
            "unk_token": None,
            "additional_special_tokens": extra,
            "added_tokens_decoder": added_decoder,
            "add_bos_token": style["bos"] is not None,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": max_len,
            "split_special_tokens": False,
            "chat_template": style["chat_template"],
        },
    )
    special_map: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    special_map["additional_special_tokens"] = extra
    _write_json(out / "special_tokens_map.json", special_map)


def make_model(
    preset: str,
    out: str | Path,
    arch: str | None = None,
    seq_cls: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic HF checkpoint directory and return its path.

    Same arguments give the same bytes. `max_shard_bytes` splits the weights into
    `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` (a tensor larger than the
    limit gets a shard of its own). Raises ValueError for a bad preset/arch/dtype/seq_cls and
    FileExistsError for a non-empty `out` unless `overwrite` (which replaces only the files this
    function writes; other files in `out` are kept).
    """
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive byte count, got {max_shard_bytes!r}")
    config = hf_config(preset, arch, seq_cls, dtype)
    r = _resolve(preset, arch, dtype)
    s = r.settings
    out = Path(out).expanduser()
    _prepare_out_dir(out, overwrite)

    torch_dtype = DTYPES[r.dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    specs = tensor_specs(config)
    total = sum(math.prod(sp.shape) for sp in specs) * itemsize

    def chunks(spec: TensorSpec) -> Iterator[torch.Tensor]:
        return _tensor_chunks(spec, seed, s["init_std"], s["norm_noise"], torch_dtype)

    _write_tokenizer(out, r.arch, s["tokenizer_vocab"], s["max_position_embeddings"])
    bar = None
    if progress and total >= 32 << 20:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{preset} ({r.arch})",
            leave=False,
        )
    try:
        if max_shard_bytes is None:
            _write_safetensors(out / "model.safetensors", specs, chunks, torch_dtype, bar)
        else:
            shards = _shard(specs, itemsize, max_shard_bytes)
            weight_map = {}
            for k, shard in enumerate(shards, start=1):
                name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(out / name, shard, chunks, torch_dtype, bar)
                weight_map.update({sp.name: name for sp in shard})
            _write_json(
                out / "model.safetensors.index.json",
                {
                    "metadata": {"total_size": total, "total_parameters": total // itemsize},
                    "weight_map": dict(sorted(weight_map.items())),
                },
            )
    finally:
        if bar is not None:
            bar.close()
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
            "do_sample": False,
        },
    )
    _write_json(out / "config.json", config)  # last: its presence marks a complete directory
    return out


def model_name(
    preset: str,
    arch: str | None = None,
    seq_cls: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
) -> str:
    """Directory name for these arguments under `default_model_dir()`: `tiny-qwen2-s0-float32`."""
    _check_seq_cls(seq_cls)
    r = _resolve(preset, arch, dtype)
    cls = f"-cls{seq_cls}" if seq_cls else ""
    return f"{preset}-{r.arch}{cls}-s{seed}-{r.dtype}"


def ensure_model(
    preset: str,
    arch: str | None = None,
    seq_cls: int | None = None,
    seed: int = 0,
    dtype: str | None = None,
    root: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """The cached model directory for these arguments, generated on first use."""
    out = Path(root) if root is not None else default_model_dir()
    out = out / model_name(preset, arch, seq_cls, seed, dtype)
    if not (out / "config.json").is_file():
        make_model(preset, out, arch, seq_cls, seed, dtype, progress=progress, overwrite=True)
    return out
