"""Synthetic checkpoints: they load in transformers, are deterministic, and have the real shapes."""

from __future__ import annotations

import json

import pytest
import torch

from boundgen import checkpoints
from boundgen.checkpoints import (
    PRESETS,
    default_model_dir,
    ensure_model,
    hf_config,
    make_model,
    param_count,
    tensor_specs,
)

FILES = [
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
EXPECTED_CLASS = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama"}
# Parameter counts of the real models (tied heads counted once).
REAL_PARAMS = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama3.2-1b": 1_235_814_400}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_model("tiny", root / arch, arch=arch, progress=False)
        for arch in ("qwen2", "qwen3", "llama")
    }


def _load_causal(path):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def _assert_clean(info):
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_loads_in_transformers(tiny_dirs, arch):
    transformers = pytest.importorskip("transformers")
    path = tiny_dirs[arch]
    for name in FILES + ["model.safetensors"]:
        assert (path / name).is_file(), name
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == [f"{EXPECTED_CLASS[arch]}ForCausalLM"]
    model, info = _load_causal(path)
    assert type(model).__name__ == f"{EXPECTED_CLASS[arch]}ForCausalLM"
    _assert_clean(info)
    assert model.dtype == torch.float32
    # tiny qwen2 has an untied head, qwen3/llama tie it to the embedding
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch != "qwen2")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(
        ["Is the jacket waterproof? Answer:", "cheap blue backpack"],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[-1] == config.vocab_size
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.3  # large init std: scores are far from uniform


def test_tiny_family_structure(tiny_dirs):
    from safetensors import safe_open

    names = {}
    for arch, path in tiny_dirs.items():
        with safe_open(path / "model.safetensors", "pt") as f:
            names[arch] = set(f.keys())
            norm = f.get_tensor("model.layers.0.input_layernorm.weight")
            assert not torch.allclose(norm, torch.ones_like(norm))  # a bug ignoring norms shows
            assert (norm - 1).abs().max() < 0.6
    assert "model.layers.1.self_attn.q_proj.bias" in names["qwen2"]
    assert "lm_head.weight" in names["qwen2"]
    assert not any(".bias" in n for n in names["qwen3"] | names["llama"])
    assert "model.layers.1.self_attn.q_norm.weight" in names["qwen3"]
    assert not any("q_norm" in n for n in names["qwen2"] | names["llama"])
    assert "lm_head.weight" not in names["qwen3"] | names["llama"]
    cfg = {arch: json.loads((p / "config.json").read_text()) for arch, p in tiny_dirs.items()}
    q3 = cfg["qwen3"]
    assert q3["head_dim"] * q3["num_attention_heads"] != q3["hidden_size"]  # as in real Qwen3
    assert cfg["llama"]["rope_scaling"]["rope_type"] == "llama3"
    for c in cfg.values():
        assert c["vocab_size"] % 64 == 0 and c["torch_dtype"] == c["dtype"] == "float32"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_seq_cls_loads_in_transformers(tmp_path, arch):
    transformers = pytest.importorskip("transformers")
    path = make_model("tiny", tmp_path / "cls", arch=arch, seq_cls=3, progress=False)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [f"{EXPECTED_CLASS[arch]}ForSequenceClassification"]
    assert config["pad_token_id"] is not None and len(config["id2label"]) == 3
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, output_loading_info=True
    )
    _assert_clean(info)
    assert type(model).__name__ == f"{EXPECTED_CLASS[arch]}ForSequenceClassification"
    assert model.score.weight.shape == (3, config["hidden_size"])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(["wireless headphones for running", "yes"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tokenizer(tiny_dirs, arch):
    from tokenizers import Tokenizer

    path = tiny_dirs[arch]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    words = [" yes", " no", "yes", "no", " Yes", " No"]
    ids = [raw.encode(w, add_special_tokens=False).ids for w in words]
    assert all(len(i) == 1 for i in ids), ids
    assert len({i[0] for i in ids}) == len(words)
    for text in [
        "Is the Acme kettle 1.7 L waterproof? Answer: yes",
        "  naïve café — 日本語 🙂\n\ttabs & <html> 12345.67",
        "<|im_start|>user\nhi<|im_end|>" if arch != "llama" else "<|eot_id|> ok",
    ]:
        enc = raw.encode(text, add_special_tokens=False)
        assert raw.decode(enc.ids, skip_special_tokens=False) == text
    config = json.loads((path / "config.json").read_text())
    n_bpe = PRESETS["tiny"]["tokenizer_vocab"]
    eos = "<|end_of_text|>" if arch == "llama" else "<|endoftext|>"
    assert config["eos_token_id"] == raw.token_to_id(eos) >= n_bpe  # specials follow the BPE vocab
    assert config["pad_token_id"] == raw.token_to_id(eos)
    assert raw.get_vocab_size() <= config["vocab_size"]
    bos = raw.token_to_id("<|begin_of_text|>")
    first = raw.encode("hello").ids[0]
    assert (first == bos) if arch == "llama" else (first != config["bos_token_id"])

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.eos_token == eos and hf.pad_token_id == config["pad_token_id"]
    corpus = checkpoints._corpus_lines()[::25]
    assert [hf(line)["input_ids"] for line in corpus] == [e.ids for e in raw.encode_batch(corpus)]
    chat = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "assistant" in chat


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = make_model("tiny", tmp_path / "a", arch="qwen3", seed=1, progress=False)
    b = make_model("tiny", tmp_path / "b", arch="qwen3", seed=1, progress=False)
    c = make_model("tiny", tmp_path / "c", arch="qwen3", seed=2, progress=False)
    for name in FILES + ["model.safetensors"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_matches_single_file(tmp_path, tiny_dirs):
    pytest.importorskip("transformers")
    path = make_model(
        "tiny", tmp_path / "sharded", arch="llama", max_shard_bytes=200_000, progress=False
    )
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    config = json.loads((path / "config.json").read_text())
    assert set(index["weight_map"]) == {s.name for s in tensor_specs(config)}
    assert index["metadata"]["total_size"] == param_count(config) * 4
    assert sum(s.stat().st_size for s in shards) > index["metadata"]["total_size"]

    sharded, info = _load_causal(path)
    _assert_clean(info)
    single, _ = _load_causal(tiny_dirs["llama"])
    ids = torch.tensor([[5, 17, 300, 1000, 42]])
    with torch.no_grad():
        assert torch.equal(sharded(ids).logits, single(ids).logits)


def test_dtype_override(tmp_path):
    from safetensors import safe_open

    path = make_model("tiny", tmp_path / "bf16", dtype="bfloat16", progress=False)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert (path / "model.safetensors").stat().st_size < param_count(config) * 2 + 8192


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b"])
def test_real_preset_shapes(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    config = hf_config(preset)
    assert config["torch_dtype"] == "bfloat16"
    assert param_count(config) == REAL_PARAMS[preset]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(model).__name__ == config["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == REAL_PARAMS[preset]
    hf_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    hf_shapes.pop("lm_head.weight")  # tied
    assert hf_shapes == {s.name: s.shape for s in tensor_specs(config)}
    assert config["tie_word_embeddings"] is True


def test_real_preset_values():
    q2, q3, ll = hf_config("qwen2.5-0.5b"), hf_config("qwen3-0.6b"), hf_config("llama3.2-1b")
    assert (q2["hidden_size"], q2["intermediate_size"], q2["num_hidden_layers"]) == (896, 4864, 24)
    assert (q2["num_attention_heads"], q2["num_key_value_heads"]) == (14, 2)
    assert q2["vocab_size"] == 151936 and q2["max_position_embeddings"] == 32768
    assert q2["rope_theta"] == 1e6 and q2["rms_norm_eps"] == 1e-6 and "head_dim" not in q2
    assert (q3["hidden_size"], q3["intermediate_size"], q3["num_hidden_layers"]) == (1024, 3072, 28)
    assert (q3["num_attention_heads"], q3["num_key_value_heads"], q3["head_dim"]) == (16, 8, 128)
    assert q3["max_position_embeddings"] == 40960 and q3["attention_bias"] is False
    assert (ll["hidden_size"], ll["intermediate_size"], ll["num_hidden_layers"]) == (2048, 8192, 16)
    assert (ll["num_attention_heads"], ll["num_key_value_heads"], ll["head_dim"]) == (32, 8, 64)
    assert ll["vocab_size"] == 128256 and ll["rope_theta"] == 500000.0
    assert ll["rms_norm_eps"] == 1e-5
    assert ll["max_position_embeddings"] == 131072
    assert ll["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    # arch picks the family, the preset keeps its shapes
    other = hf_config("qwen2.5-0.5b", arch="llama", seq_cls=2)
    assert other["architectures"] == ["LlamaForSequenceClassification"]
    assert other["hidden_size"] == 896 and other["rope_scaling"] is None
    assert tensor_specs(other)[-1].name == "score.weight"
    assert param_count(other) == param_count(q2) - 24 * (896 + 2 * 128) + 2 * 896  # no qkv bias


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="valid presets: tiny, qwen2.5-0.5b"):
        make_model("qwen-7b", tmp_path / "x")
    with pytest.raises(ValueError, match="valid archs: qwen2, qwen3, llama"):
        make_model("tiny", tmp_path / "x", arch="mistral")
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="seq_cls"):
            make_model("tiny", tmp_path / "x", seq_cls=bad)
    with pytest.raises(ValueError, match="valid dtypes"):
        make_model("tiny", tmp_path / "x", dtype="int8")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        make_model("tiny", tmp_path / "x", max_shard_bytes=0)
    assert not (tmp_path / "x").exists()  # nothing written on a bad argument

    out = make_model("tiny", tmp_path / "m", max_shard_bytes=100_000, progress=False)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        make_model("tiny", out, progress=False)
    make_model("tiny", out, overwrite=True, progress=False)
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        make_model("tiny", tmp_path / "file", overwrite=True)


def test_cli(tmp_path, capsys):
    from boundgen.cli import main

    out = tmp_path / "cli"
    assert (
        main(
            [
                "make-model",
                "--preset",
                "tiny",
                "--arch",
                "qwen3",
                "--out",
                str(out),
                "--max-shard-size",
                "0.2MB",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(out) and "Qwen3ForCausalLM" in printed[1] and "float32" in printed[1]
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--no-progress"]) == 1
    assert "not empty" in capsys.readouterr().err
    bad = ["make-model", "--preset", "tiny", "--seq-cls", "0", "--out", str(tmp_path / "y")]
    assert main(bad) == 1


def test_cache_dir_and_ensure_model(tmp_path, monkeypatch):
    monkeypatch.setenv("BOUNDGEN_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache"
    monkeypatch.delenv("BOUNDGEN_CACHE")
    assert default_model_dir().parts[-2:] == (".cache", "boundgen")
    path = ensure_model("tiny", arch="llama", seq_cls=2, root=tmp_path, progress=False)
    assert path == tmp_path / "tiny-llama-cls2-s0-float32"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model("tiny", arch="llama", seq_cls=2, root=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_presets_are_consistent():
    for name, preset in PRESETS.items():
        assert preset["arch"] in checkpoints.ARCHS
        for arch in checkpoints.ARCHS:
            config = hf_config(name, arch=arch)
            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
            assert head_dim % 2 == 0 and param_count(config) > 0
