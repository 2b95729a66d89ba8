"""FP8 through `Engine.from_pretrained(fp8=...)`: refused without FP8 hardware or a passed gate,
emulated on CPU."""

from __future__ import annotations

import pytest

from boundgen import Engine
from boundgen.quant.fp8 import Fp8Linear, Fp8NotSupportedError
from boundgen.quant.policy import Fp8PolicyError


def test_real_fp8_on_cpu_is_a_clear_error(tiny_model):
    with pytest.raises(Fp8NotSupportedError, match="emulate"):
        Engine.from_pretrained(tiny_model("qwen2"), fp8="mlp")


def test_unchecked_policy_is_refused_unless_forced(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("BOUNDGEN_FP8_GATE_CACHE", str(tmp_path / "gate.json"))
    with pytest.raises(Fp8PolicyError, match="quant-check"):
        Engine.from_pretrained(tiny_model("qwen2"), fp8="mlp", fp8_emulate=True)
    engine = Engine.from_pretrained(
        tiny_model("qwen2"), fp8="mlp", fp8_emulate=True, fp8_force=True
    )
    layer = engine.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and isinstance(
        layer.mlp.down_proj, Fp8Linear
    )
    assert not isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    scores = engine.score("red shoes", ["trail runner", "mug"], [514, 371])
    assert len(scores) == 2 and all(len(r) == 2 for r in scores)


def test_unknown_policy(tiny_model):
    with pytest.raises(ValueError, match="unknown FP8 policy"):
        Engine.from_pretrained(tiny_model("qwen2"), fp8="all-of-it", fp8_emulate=True)


def test_policy_grammar_reaches_the_engine(tiny_model, tmp_path, monkeypatch):
    """Any policy `parse_policy` takes is accepted (not just the presets), spelt any way."""
    monkeypatch.setenv("BOUNDGEN_FP8_GATE_CACHE", str(tmp_path / "gate.json"))
    engine = Engine.from_pretrained(
        tiny_model("qwen2"), fp8="Down_Proj:layers=0", fp8_emulate=True, fp8_force=True
    )
    first, second = engine.model.layers[0], engine.model.layers[1]
    assert isinstance(first.mlp.down_proj, Fp8Linear)
    assert not isinstance(first.mlp.gate_up_proj, Fp8Linear)
    assert not isinstance(second.mlp.down_proj, Fp8Linear)


def test_bad_policy_fails_before_the_weights_are_read(tmp_path):
    """An empty directory: the policy error comes first, not a missing-checkpoint one."""
    with pytest.raises(ValueError, match="unknown FP8 policy"):
        Engine.from_pretrained(tmp_path, fp8="mlp:layers=x")
