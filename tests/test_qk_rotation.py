"""q and k rotated by one op over the qkv projection's view (`Attention.rotates_together`: no q/k
norm, q not grouped) against one op each (the layout Qwen3 and grouped queries take): the same
arithmetic per element, so on CPU every workload answers exactly alike."""

from __future__ import annotations

import pytest
import torch

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
    together = _answers(engine)
    rotated_together = list(calls)
    calls.clear()
    with monkeypatch.context() as apart_only:
        apart_only.setattr(decoder.Attention, "rotates_together", lambda self, grouped: False)
        apart = _answers(engine)
    per_layer_apart = len(calls) // cfg.num_layers
    for name in ("score", "score_full", "beam"):
        assert together[name] == apart[name], name
    assert torch.equal(together["embed"], apart["embed"])
    heads = (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    assert heads not in calls  # apart: never the joined heads
    if arch == "qwen3":  # q/k norms: rotated apart either way
        assert heads not in rotated_together
    else:  # the prompt forwards rotate once a layer (beam steps rotate grouped queries apart)
        assert heads in rotated_together and per_layer_apart >= 2
