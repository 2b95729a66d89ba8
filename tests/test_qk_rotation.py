"""`BOUNDGEN_QK_ROTATION` (`models/decoder.py`): q and k rotated by one op over the qkv projection's
view (`together`, the default) or one op each (`apart`). The same arithmetic per element, so on CPU
every workload answers exactly alike; the compiled artifacts are keyed apart."""

from __future__ import annotations

import os

import pytest
import torch

from boundgen.compile.cache import platform_info
from boundgen.models import decoder

QUERY = [5, 9, 2, 33, 7, 12, 40, 3]
ITEMS = [[8, 1, 4], [19], [6, 6, 2, 30, 11], []]


def _answers(engine) -> dict:
    prompt = QUERY + [17, 21]
    return {
        "score": engine.score(QUERY, ITEMS, [3, 11], apply_softmax=True),
        "score_full": engine.score(QUERY, ITEMS[:3], [3]),
        "embed": engine.embed([QUERY, QUERY[:3]], pooling="mean"),
        "beam": engine.beam_search(prompt, beam_width=4, steps=3),
    }


def _rotations(monkeypatch) -> list[tuple[int, ...]]:
    """Count `apply_rope` calls by the shape they rotate."""
    calls = []
    rope = decoder.apply_rope

    def counted(x, cos, sin):
        calls.append(tuple(x.shape[1:]))
        return rope(x, cos, sin)

    monkeypatch.setattr(decoder, "apply_rope", counted)
    return calls


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_together_answers_exactly_as_apart(arch, engine_for, monkeypatch):
    engine = engine_for(arch)
    cfg = engine.config
    calls = _rotations(monkeypatch)
    monkeypatch.setattr(decoder, "QK_ROTATION", "apart")
    apart = _answers(engine)
    per_layer_apart = len(calls) // cfg.num_layers
    calls.clear()
    monkeypatch.setattr(decoder, "QK_ROTATION", "together")
    together = _answers(engine)
    for name in ("score", "score_full", "beam"):
        assert together[name] == apart[name], name
    assert torch.equal(together["embed"], apart["embed"])
    heads = (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    if arch == "qwen3":  # q/k norms: rotated apart either way
        assert heads not in calls
    else:  # the prompt forwards rotate once a layer (beam steps rotate grouped queries apart)
        assert heads in calls and per_layer_apart >= 2


def test_the_default_rotates_together():
    assert os.environ.get("BOUNDGEN_QK_ROTATION", "together") == decoder.QK_ROTATION


def test_the_rotation_is_part_of_the_platform_key_only_when_together(monkeypatch):
    monkeypatch.setattr(decoder, "QK_ROTATION", "apart")
    assert "qk_rotation" not in platform_info("cpu")  # apart: the keys of the packages before it
    monkeypatch.setattr(decoder, "QK_ROTATION", "together")
    assert platform_info("cpu")["qk_rotation"] == "together"


def test_a_bad_value_names_the_variable():
    from boundgen.settings import env_choice

    with pytest.raises(ValueError, match="BOUNDGEN_QK_ROTATION='joint': choose one of apart"):
        env_choice("BOUNDGEN_QK_ROTATION", "joint", decoder.QK_ROTATIONS)
