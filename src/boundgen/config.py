"""Model configuration read from a HuggingFace `config.json`, as one frozen dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boundgen.settings import option

# The dtypes a checkpoint may be written in or run with, by their config/CLI names; `DTYPES` maps
# them to torch's, imported on first use: an HTTP frontend process (`serve --frontends`) reads
# the configs without torch.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The HuggingFace architectures a checkpoint may name (its config.json's `architectures`) → (model
# family, task).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen2ForSequenceClassification": ("qwen2", "seq_cls"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "Qwen3ForSequenceClassification": ("qwen3", "seq_cls"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "seq_cls"),
}


def lookup_architecture(name: str) -> tuple[str, str]:
    try:
        return SUPPORTED_ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"unsupported architecture '{name}'; supported: {supported}") from None


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # "qwen2" | "qwen3" | "llama"
    task: str  # "causal_lm" | "seq_cls"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def num_params(self, include_embeddings: bool = True) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * i + 2 * h
        total = self.num_layers * layer + h
        if include_embeddings:
            total += self.vocab_size * h
            if self.task == "seq_cls":
                total += self.num_labels * h
            elif not self.tie_word_embeddings:
                total += self.vocab_size * h
        return total

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(
                "config.json has no 'architectures' entry; cannot tell which model it is"
            )
        arch = archs[0]
        family, task = lookup_architecture(arch)

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json for {arch} is missing '{key}'")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or None)
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
        rope = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "llama3":
                rope = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(
                        scaling["original_max_position_embeddings"]
                    ),
                )
            elif kind not in ("default", None):
                raise ValueError(f"rope_scaling type '{kind}' is not supported (supported: llama3)")
        id2label = cfg.get("id2label") or {}
        num_labels = 0
        if task == "seq_cls":
            num_labels = int(cfg.get("num_labels") or len(id2label) or 2)
        labels = tuple(
            str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)
        )
        pad = cfg.get("pad_token_id")
        return cls(
            architecture=arch,
            family=family,
            task=task,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=rope,
            num_labels=num_labels,
            id2label=labels,
            pad_token_id=int(pad) if isinstance(pad, int) else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            extra={
                k: v
                for k, v in cfg.items()
                if k in ("bos_token_id", "eos_token_id", "_name_or_path")
            },
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf(json.loads(p.read_text()))


@dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` runs a checkpoint. Fields are flags of every engine command and keys of
    the `engine:` section of a config file (`boundgen.settings`); `flag=False` ones are
    config-file only."""

    device: str = option(
        "cpu", "cpu, cuda or cuda:N (default: cpu; `boundgen serve`: cuda when there is one)"
    )
    dtype: str | None = option(
        None,
        "float32 | bfloat16 | float16 (default: float32 on CPU, the checkpoint's dtype on CUDA)",
    )
    attention: str = option(
        "auto",
        "attention backend: auto | reference | varlen | segments | segments-cascade (auto: "
        "segments on CUDA with Triton, else varlen; reference on CPU; segments[-cascade]: the "
        "Triton packed-prefill kernel for every prefill [for shared-prefix batches], flash for "
        "decode; varlen: flash only)",
    )
    backend: str = option(
        "auto",
        "model backend: auto | eager | compile | aoti; on CUDA also eager+graphs | "
        "compile+graphs | "
        "aoti+graphs (auto on CUDA: aoti+graphs when its buckets are cached and load safely, else "
        "eager+graphs; on CPU eager)",
        choices=(
            "auto",
            "eager",
            "compile",
            "aoti",
            "eager+graphs",
            "compile+graphs",
            "aoti+graphs",
        ),
    )
    compile_buckets: str | None = option(
        None, "buckets for compile/aoti, e.g. 't64,t8192-s256-m512' (aoti default: the cached ones)"
    )
    compile_cache: str | None = option(
        None, "compiled-artifact cache (default: $BOUNDGEN_CACHE/compiled)", flag=False
    )
    graph_max_tokens: int | None = option(
        None,
        "+graphs backends: buckets of at most this many tokens replay as CUDA graphs (one launch "
        "a forward); larger ones launch each kernel from the host (default: 16384 for compiled "
        "buckets, 2048 for eager+graphs)",
    )
    max_seq_len: int | None = option(
        None, "longest sequence accepted (default: the model's maximum)"
    )
    max_batch_tokens: int = option(
        32768, "most tokens in one packed forward; larger requests are split"
    )
    max_items: int = option(4096, "most items/texts in one request")
    max_beam_width: int = option(64, "largest beam width accepted", flag=False)
    max_beam_steps: int = option(16, "most decode steps accepted", flag=False)
    share_prefix: bool = option(
        True,
        "compute a prefix shared by all candidates once (cascade attention)",
        flag=False,
    )
    fp8: str = option(
        "none",
        "FP8 projections: none | selective (the recommended policy: mlp+qkv_proj:skip=0) | mlp | "
        "mlp+attn-proj | PROJ[+PROJ][:layers=LIST][:skip=LIST] (docs/fp8.md; refused unless the "
        "policy passed `boundgen quant-check` for this checkpoint)",
    )
    fp8_force: bool = option(
        False, "use the FP8 policy even if its fidelity gate failed or never ran", flag=False
    )
    fp8_emulate: bool = option(
        False, "emulate FP8 numerics (quantize→dequantize) on devices without FP8", flag=False
    )
    batch_token_budget: int | None = option(
        None,
        "most tokens merged from concurrent requests into one forward (default: max_batch_tokens)",
    )
    batch_max_wait_ms: float = option(
        0.0, "how long a forming batch may wait for more requests (0: never wait)"
    )
    batch_device_depth: int = option(
        2,
        "merged forwards a batching node keeps queued on the device: it forms its next batch once "
        "all but depth-1 of them have run (2: the device always has the next one queued; 3 gives "
        "the host a whole forward more to pack the next one, and a request may wait one batch "
        "more under load)",
    )
    traffic_log: str | None = option(
        None,
        "append the shape of every model forward (lengths only) to this JSON-lines file, for "
        "`boundgen compile --from-traffic`",
    )
    batch_latency_target_ms: float | None = option(
        None,
        "adapt the batch token budget so a batch runs at most half this long by the measured cost "
        "(a request that arrives meanwhile waits for it, then runs in the next); default: always "
        "the full budget",
    )
    batch_late_merge: bool = option(
        False,
        "the model node forms its next forward shortly before the running one is predicted to "
        "end (at 0.8 of its predicted time, less a launch margin), so what arrives while a "
        "forward runs merges into the next one, not the one after it (off: as soon as the "
        "running one starts; beam search always merges late)",
    )
    batch_merge: str = option(
        "tail",
        "how the model node splits waiting requests into forwards: tail (the default: merge only "
        "where a forward's fixed cost saved outweighs the wait added to the requests already "
        "merged, by the measured cost — long prefills merge little, short ones all; p99 lower or "
        "the same under load) | all (everything waiting that fits the budget); beam search always "
        "merges all (its fixed cost dominates)",
        choices=("tail", "all"),
    )
    cpu_workers: int | None = option(
        None, "threads for CPU pipeline nodes (default: 2 per usable core, at most 8)", flag=False
    )
