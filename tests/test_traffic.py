"""Forward shapes logged for `boundgen compile --from-traffic`: what the forward and beam nodes
write, and the planner on recorded shapes — the padding it predicts for its buckets is the
padding the runner then measures serving the same traffic through them."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from boundgen.compile import planner
from boundgen.compile.backends import CompiledForwards, _eager_fns
from boundgen.runner import ModelRunner
from boundgen.workloads.traffic import TrafficLog


def traffic_engine(engine, path):
    """`engine` (tiny, CPU) logging its forwards to `path`."""
    from boundgen import Engine

    config = dataclasses.replace(engine.engine_config, traffic_log=str(path))
    return Engine(engine.runner, engine.tokenizer, config, engine.model_path)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_forward_is_one_line_of_lengths(engine_for, tmp_path):
    log = tmp_path / "shapes.jsonl"
    engine = traffic_engine(engine_for(), log)
    engine.score([11] * 6, [[12] * 3, [13] * 4], [1, 2])
    engine.embed([[14] * 5, [15] * 2], pooling="mean")
    engine.beam_search_batch([[16] * 7, [17] * 3], beam_width=2, steps=2)
    engine.close()
    assert records(log) == [
        {"groups": [[6, [3, 4]]], "share_prefix": True},
        {"groups": [[0, [5, 2]]], "share_prefix": True},
        {"groups": [[0, [7, 3]]], "share_prefix": False, "kind": "beam"},
    ]
    assert planner.load_traffic(log)  # the planner reads it back


def test_mean_pooling_of_a_prefix_group_is_logged_unshared(engine_for, tmp_path):
    runner = engine_for().runner
    from boundgen.text.packing import SequenceGroup

    groups = [SequenceGroup([1, 2], [[3], [4]])]
    assert runner.shares_prefix(groups, ["last", "last"])
    assert not runner.shares_prefix(groups, ["mean", "last"])


def test_a_bad_path_fails_when_the_log_opens(tmp_path):
    with pytest.raises(ValueError, match="cannot write the traffic log"):
        TrafficLog(tmp_path / "no-such-dir" / "shapes.jsonl")


def _requests(seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """Varied score requests: a query of 20–60 tokens and 3–12 items of 4–12 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(25):
        query = [rng.randrange(10, 200) for _ in range(rng.randrange(20, 61))]
        items = [
            [rng.randrange(10, 200) for _ in range(rng.randrange(4, 13))]
            for _ in range(rng.randrange(3, 13))
        ]
        out.append((query, items))
    return out


def test_planned_padding_is_the_measured_padding(engine_for, tmp_path):
    """Record the traffic, plan buckets from it, serve the same traffic through them (the plain
    model per bucket, as a compiled backend would run it): the runner counts exactly the real and
    padded tokens, and the misses, that the plan predicted."""
    log = tmp_path / "shapes.jsonl"
    base = engine_for()
    recording = traffic_engine(base, log)
    traffic = _requests(seed=1)
    for query, items in traffic:
        recording.score(query, items, [1, 2])
    recording.close()

    entries = planner.load_traffic(log)
    plan = planner.plan(entries, max_tokens=2048, max_bucket_tokens=1024, max_cascade_buckets=2)
    assert any(b.cascade for b in plan.buckets)
    fns = _eager_fns(base.model, plan.buckets)
    forwards = CompiledForwards("planned", plan.buckets, fns, cut_large_chunks=True)
    runner = ModelRunner(base.model, base.device, forwards, max_batch_tokens=2048)
    serving = base.with_runner(runner)
    for query, items in traffic:
        serving.score(query, items, [1, 2])
    measured = runner.stats()
    assert measured["real_tokens"] == plan.overall.real_tokens
    assert measured["padded_tokens"] == plan.overall.padded_tokens
    assert measured["misses"] == plan.overall.misses
    assert 0 < plan.overall.padding_fraction < 0.5
