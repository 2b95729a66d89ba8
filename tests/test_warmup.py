"""Warm-up: every request a profile describes runs once through the engine's public calls, a beam
entry at every batch size its searches pad to; a bad profile is refused before anything runs."""

from __future__ import annotations

import pytest

from boundgen import Trie
from boundgen.warmup import default_profile, warm_up


class Recorder:
    """The engine's calls, counted (wrapping a real engine: the requests must be valid)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.config = engine.config

    def __getattr__(self, name):
        fn = getattr(self.engine, name)

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return call


def test_default_profile_runs_each_workload_and_each_trie(engine_for):
    trie = Trie.from_sequences([[11, 12, 13], [11, 14, 15]])
    engine = Recorder(engine_for("qwen2"))
    rows = warm_up(engine, default_profile(engine, {"items": trie}), {"items": trie})
    names = [name for name, _, _ in engine.calls]
    # each beam entry at every batch size a default server merges into one graph: 1, 2, 4, 8
    assert names == ["score", "embed"] + ["beam_search_batch"] * 8
    assert [len(args[0]) for _, args, _ in engine.calls[2:]] == [1, 2, 4, 8] * 2
    _, args, kwargs = engine.calls[-1]
    assert kwargs["trie"] is trie and args[1:] == (16, 3)  # steps: the trie's depth
    assert [r["what"] for r in rows][-1] == "beam 8x64 W16 S3 trie items"
    assert all(r["seconds"] >= 0 for r in rows)


def test_a_classifier_warms_classify(engine_for):
    engine = Recorder(engine_for("qwen2", seq_cls=3))
    warm_up(engine, default_profile(engine))
    assert [name for name, _, _ in engine.calls] == ["classify"]


def test_beam_warms_every_padded_batch_size_up_to_count(engine_for):
    engine = Recorder(engine_for("qwen2"))
    profile = [{"kind": "beam", "prompt_tokens": 8, "width": 2, "steps": 2, "count": 3}]
    warm_up(engine, profile)
    batches = [len(args[0]) for _, args, _ in engine.calls]
    assert batches == [1, 2, 4]  # 3 concurrent prompts run padded to 4
    assert all(len(p) == 8 for _, args, _ in engine.calls for p in args[0])


def test_same_requests_every_start(engine_for):
    profile = [{"kind": "score", "query_tokens": 5, "items": 2, "item_tokens": 3}]
    first, second = Recorder(engine_for("qwen2")), Recorder(engine_for("qwen2"))
    warm_up(first, profile)
    warm_up(second, profile)
    assert first.calls == second.calls


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ([{"kind": "beam", "prompt_tokens": 8, "trie": "nope"}], "unknown trie 'nope'"),
        ([{"kind": "rerank", "texts": [3]}], "'kind' must be one of"),
        ([{"kind": "embed", "texts": [0]}], "must be an integer ≥ 1"),
        ({"kind": "embed"}, "non-empty JSON list"),
    ],
)
def test_bad_profile_is_refused_before_anything_runs(engine_for, profile, message):
    engine = Recorder(engine_for("qwen2"))
    with pytest.raises(ValueError, match=message):
        warm_up(engine, profile)
    assert engine.calls == []


def test_progress_callback_gets_every_row(engine_for):
    seen = []
    rows = warm_up(engine_for("qwen2"), [{"kind": "embed", "texts": [4, 5]}], progress=seen.append)
    assert seen == rows and rows[0]["what"] == "embed 2 texts"
