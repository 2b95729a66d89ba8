"""The bucket planner: profiles and traffic files read (and refused) clearly, the predicted padding
is what chunking + `BucketSet.pad` measure on the same shapes, and W1/W2/W3 plans pad little."""

from __future__ import annotations

import json
import random

import pytest

from boundgen.compile.buckets import BucketSet
from boundgen.compile.chunking import chunk
from boundgen.compile.planner import (
    Forward,
    plan,
    predict,
    profile_entries,
    traffic_entries,
)
from boundgen.text.packing import pack

BUDGET = 32768


def synthetic_traffic(seed: int, forwards: int = 120) -> list[str]:
    """Logged-shape records of W1/W2/W3-like forwards, beam prefills, and rows no bucket takes."""
    rng = random.Random(seed)
    lines = []
    for _ in range(forwards):
        kind = rng.choice(["w1", "w2", "w2", "w3", "beam", "item_first"])
        if kind == "w1":
            groups = [[0, [rng.randint(64, 256) for _ in range(rng.choice([16, 64, 256]))]]]
        elif kind == "w2":
            groups = [
                [rng.randint(200, 300), [rng.randint(12, 20) for _ in range(rng.randint(80, 120))]]
                for _ in range(rng.randint(1, 4))
            ]
        elif kind == "w3":
            groups = [[0, [rng.randint(16, 128)]]]
        elif kind == "beam":
            groups = [[0, [128] * rng.randint(1, 8)]]
        else:
            groups = [[0, [rng.randint(20, 40) for _ in range(50)]], [0, [9000]]]
        record = {"groups": groups, "kind": kind, "share_prefix": kind != "beam"}
        lines.append(json.dumps(record))
    return lines


def measure(entries, buckets) -> BucketSet:
    """Chunk every recorded forward, pack each piece and pad it: what a runner would count."""
    measured = BucketSet(buckets)
    for entry in entries:
        for forward, weight in entry.forwards.items():
            groups = forward.sequence_groups()
            for _ in range(weight):
                for piece in chunk(groups, BUDGET, measured, forward.share_prefix):
                    measured.pad(pack(piece.groups, forward.share_prefix))
    return measured


@pytest.mark.parametrize("seed", [0, 1])
def test_predicted_padding_is_measured_padding(seed):
    entries = traffic_entries(synthetic_traffic(seed))
    planned = plan(entries, BUDGET)
    measured = measure(entries, planned.buckets)
    assert measured.stats.as_dict() == planned.overall.as_dict()
    assert planned.overall.misses > 0 and planned.overall.padding_fraction > 0
    assert max(b.tokens for b in planned.buckets) <= 8192  # merges never exceed the largest
    assert sum(b.cascade for b in planned.buckets) <= 8
    assert sum(s.padded_tokens for _, s, _ in planned.entries) == planned.overall.padded_tokens
    assert sum(n for _, _, n in planned.entries) == len(synthetic_traffic(seed))


def test_w1_w2_w3_profile_pads_under_5_percent():
    lens = [random.Random(0).randint(64, 256) for _ in range(256)]
    profile = [
        {"kind": "classify", "texts": lens},  # W1
        {"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, "count": 10},
        {"kind": "embed", "texts": [64]},  # W3
    ]
    planned = plan(profile_entries(profile), BUDGET)
    for label, stats, _ in planned.entries:
        assert stats.misses == 0 and stats.padding_fraction <= 0.05, (label, stats.as_dict())
    assert any(b.cascade for b in planned.buckets)
    assert max(b.tokens for b in planned.buckets) <= 8192
    measured = measure(profile_entries(profile), planned.buckets)
    assert measured.stats.as_dict() == planned.overall.as_dict()


def test_traffic_plan_fits_varied_requests_better_than_the_nominal_profile():
    """Buckets planned for the one nominal W2 shape pad requests that vary around it far more
    than buckets planned from the varied traffic itself."""
    rng = random.Random(3)
    lines = []
    for _ in range(150):
        groups = [
            [rng.randint(200, 300), [rng.randint(12, 20) for _ in range(rng.randint(80, 120))]]
            for _ in range(rng.randint(1, 4))
        ]
        lines.append(json.dumps({"groups": groups}))
    varied = traffic_entries(lines)
    nominal = [{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, "count": 4}]
    from_profile = predict(varied, plan(profile_entries(nominal), BUDGET).buckets, BUDGET)
    from_traffic = plan(varied, BUDGET, max_cascade_buckets=16)
    assert from_traffic.overall.misses == 0
    assert from_traffic.overall.padding_fraction < from_profile.overall.padding_fraction / 2


def test_profile_entries_are_forwards_at_every_merge_level():
    (score, first, embed, beam) = profile_entries(
        [
            {"kind": "score", "query_tokens": 8, "items": 3, "item_tokens": 2, "count": 2},
            {"kind": "score", "query_tokens": 8, "items": 3, "item_tokens": 2, "item_first": True},
            {"kind": "embed", "texts": [5, 7]},
            {"kind": "beam", "prompt_tokens": 6, "width": 4, "steps": 3, "count": 2},
        ]
    )
    one = (8, (2, 2, 2))
    assert score.forwards == {Forward((one,)): 1, Forward((one, one)): 1}
    assert first.forwards == {Forward(((0, (10, 10, 10)),)): 1}
    assert embed.forwards == {Forward(((0, (5, 7)),)): 1}
    assert beam.forwards == {
        Forward(((0, (6,)),), share_prefix=False): 1,
        Forward(((0, (6, 6)),), share_prefix=False): 1,
    }


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ([], "non-empty JSON list"),
        ([{"kind": "rerank"}], "'kind' must be one of"),
        ([{"kind": "embed"}], "needs \\['texts'\\]"),
        ([{"kind": "embed", "texts": [4], "extra": 1}], "got \\['extra', 'texts'\\]"),
        ([{"kind": "embed", "texts": [4, 0]}], "'texts' must be an integer ≥ 1"),
        ([{"kind": "embed", "texts": []}], "non-empty list"),
        ([{"kind": "beam", "prompt_tokens": 4, "count": 1.5}], "'count' must be an integer"),
    ],
)
def test_bad_profiles_are_refused(profile, message):
    with pytest.raises(ValueError, match=message):
        profile_entries(profile)


def test_traffic_records_by_kind_and_bad_lines():
    lines = [
        '{"groups": [[4, [2, 3]]], "kind": "score"}',
        "",
        '{"groups": [[4, [2, 3]]], "kind": "score"}',
        '{"groups": [[0, [9]]], "share_prefix": false}',
    ]
    score, other = traffic_entries(lines)
    assert (score.label, score.forwards) == ("score", {Forward(((4, (2, 3)),)): 2})
    assert (other.label, other.forwards) == ("traffic", {Forward(((0, (9,)),), False): 1})
    for bad in ('{"groups": 3}', "not json", '{"groups": []}', '{"groups": [[-1, [2]]]}'):
        with pytest.raises(ValueError, match="traffic line 1"):
            traffic_entries([bad])
    with pytest.raises(ValueError, match="no records"):
        traffic_entries(["", " "])


def test_compile_plan_only_cli(tmp_path, capsys):
    from boundgen.cli import main

    profile = tmp_path / "profile.json"
    profile.write_text(
        json.dumps([{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16}])
    )
    assert main(["compile", "--profile", str(profile), "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "overall" in out and "--buckets t1920-s104-m512-g2-p320-q1600" in out
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("\n".join(synthetic_traffic(0, forwards=10)))
    assert main(["compile", "--from-traffic", str(traffic), "--plan-only"]) == 0
    assert "pieces per bucket" in capsys.readouterr().out
    for argv, message in [
        (["--plan-only"], "needs --profile or --from-traffic"),
        (["--profile", str(profile), "--plan-only", "--max-cascade-buckets", "-1"], "≥ 0"),
        (["--profile", str(profile), "--plan-only", "--max-bucket-tokens", "32"], "≥ align"),
        (["--profile", str(profile), "--buckets", "t64"], "not both"),
        (["--profile", str(profile)], "--model is required"),
    ]:
        assert main(["compile", *argv]) == 1
        assert message in capsys.readouterr().err
