"""Chunks that fill buckets: row order kept, every piece in the bucket `BucketSet.pad` picks,
padding on W1/W2/W3-like traffic, the budget split without buckets, and the edge cases."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from boundgen.compile.buckets import Bucket, BucketSet, default_buckets, parse_buckets
from boundgen.compile.chunking import chunk, predicted_stats
from boundgen.text.packing import SequenceGroup, pack

LADDER = default_buckets(8192)
BUDGET = 32768


def rows(groups: list[SequenceGroup]) -> list[tuple[list[int], list[int]]]:
    return [(list(g.prefix), list(s)) for g in groups for s in g.suffixes]


def check_pieces(groups, pieces, max_tokens, buckets, share_prefix) -> None:
    """Rows in input order; each piece's footprint and bucket are the packed batch's."""
    assert [r for p in pieces for r in rows(p.groups)] == rows(groups)
    bucket_set = BucketSet(buckets or [])
    for p in pieces:
        if not rows(p.groups):
            continue
        batch = pack(p.groups, share_prefix)
        assert p.footprint.as_packed() == batch.footprint
        assert p.bucket == (bucket_set.choose(batch) if buckets else None)
        if p.footprint.tokens > max_tokens:
            assert len(rows(p.groups)) == 1, "only a single row may exceed the budget"


def w1_like(rng: random.Random, n: int, lo: int = 64, hi: int = 256) -> list[SequenceGroup]:
    return [SequenceGroup([], [[7] * rng.randint(lo, hi) for _ in range(n)])]


tokens = st.integers(1, 40).map(lambda n: [3] * n)
groups_st = st.lists(
    st.builds(
        SequenceGroup, st.integers(0, 30).map(lambda n: [5] * n), st.lists(tokens, max_size=6)
    ),
    min_size=1,
    max_size=8,
)
SPECS = [
    "t16",
    "t32-s4-m32",
    "t64",
    "t128-s8-m64",
    "t64-s8-m32-g2-p24-q32",
    "t128-s16-m64-g4-p48-q64",
    "t256-s32-m128-g3-p96-q128",
]


@settings(max_examples=300)
@given(
    groups_st,
    st.sets(st.sampled_from(SPECS)),
    st.integers(8, 300),
    st.booleans(),
)
def test_pieces_keep_rows_and_fit_their_buckets(groups, specs, max_tokens, share_prefix):
    buckets = parse_buckets(sorted(specs)) if specs else None
    pieces = chunk(groups, max_tokens, buckets, share_prefix)
    check_pieces(groups, pieces, max_tokens, buckets, share_prefix)


@settings(max_examples=200)
@given(
    st.lists(
        st.builds(
            SequenceGroup,
            st.integers(0, 30).map(lambda n: [5] * n),
            st.lists(tokens, min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(8, 200),
)
def test_without_buckets_it_is_the_budget_split(groups, max_tokens):
    """Equal to the token-budget split the runner did before buckets were filled (the oracle
    below) for groups with rows (it counts a group's prefix also when the group has no rows; the
    chunker counts what `pack` lays out)."""
    want = _budget_split(groups, max_tokens)
    pieces = chunk(groups, max_tokens)
    got = [p.groups for p in pieces]
    assert [[(g.prefix, g.suffixes) for g in c] for c in got] == [
        [(g.prefix, g.suffixes) for g in c] for c in want
    ]
    check_pieces(groups, pieces, max_tokens, None, True)  # footprints as packed, no bucket


@pytest.mark.parametrize("seed", range(5))
def test_w1_like_traffic_pads_under_5_percent(seed):
    """256 prompts of 64-256 tokens: full pieces of the largest bucket, the rest in a small one
    (the budget split, then cut at 8,192, padded 27 % on the H200)."""
    groups = w1_like(random.Random(seed), 256)
    pieces = chunk(groups, BUDGET, LADDER)
    check_pieces(groups, pieces, BUDGET, LADDER, True)
    stats = predicted_stats(pieces)
    assert stats.misses == 0 and stats.padding_fraction <= 0.05, stats.as_dict()
    assert [p.bucket.tokens for p in pieces[:-1]] == [8192] * (len(pieces) - 1)


def test_w3_like_prompt_is_one_exact_piece():
    groups = [SequenceGroup([], [[9] * 64])]
    (piece,) = chunk(groups, BUDGET, LADDER)
    assert piece.groups == groups and piece.bucket.tokens == 64
    assert predicted_stats([piece]).padding_fraction == 0


def test_w2_like_request_fits_its_cascade_bucket_whole():
    w2 = [SequenceGroup([1] * 256, [[2] * 16 for _ in range(100)])]
    cascade = Bucket.parse("t2048-s128-m512-g2-p320-q1728")
    (piece,) = chunk(w2, BUDGET, [*LADDER, cascade])
    assert piece.groups == w2 and piece.bucket == cascade
    # merged requests: whole groups per piece, never cut into single-suffix rows
    merged = w2 * 9
    pieces = chunk(merged, BUDGET, [*LADDER, cascade])
    check_pieces(merged, pieces, BUDGET, [*LADDER, cascade], True)
    assert [len(p.groups) for p in pieces] == [1] * 9


def test_shared_prefix_without_cascade_bucket_is_one_miss():
    """Cutting a shared group into single suffixes would repeat its prefix per item (27,200
    tokens instead of 1,856 for W2): it runs as one eager forward instead."""
    w2 = [SequenceGroup([1] * 256, [[2] * 16 for _ in range(100)])]
    pieces = chunk(w2, BUDGET, LADDER)
    assert [(p.groups, p.bucket) for p in pieces] == [(w2, None)]
    assert predicted_stats(pieces).misses == 1
    # over the largest bucket too (16,256 tokens): still one eager forward within the budget
    big = [SequenceGroup([1] * 256, [[2] * 16 for _ in range(1000)])]
    assert [(p.groups, p.bucket) for p in chunk(big, BUDGET, LADDER)] == [(big, None)]
    # over the budget: same-prefix parts of at most the budget each
    pieces = chunk(big, 10000, LADDER)
    check_pieces(big, pieces, 10000, LADDER, True)
    assert [len(p.groups[0].suffixes) for p in pieces] == [609, 391]


def test_huge_sequence_is_its_own_miss():
    rng = random.Random(1)
    before, after = w1_like(rng, 40), w1_like(rng, 40)
    huge = [SequenceGroup([], [[4] * 9000])]  # over every bucket
    long_row = [SequenceGroup([], [[4] * 600])]  # over every bucket's max_seqlen (512)
    groups = before + huge + after + long_row
    pieces = chunk(groups, BUDGET, LADDER)
    check_pieces(groups, pieces, BUDGET, LADDER, True)
    misses = [p for p in pieces if p.bucket is None]
    assert [p.groups for p in misses] == [huge, long_row]
    assert predicted_stats(pieces).misses == 2


def test_group_over_every_bucket_is_cut_into_same_prefix_groups():
    big = SequenceGroup([1] * 100, [[2] * 16 for _ in range(2000)])  # 32,100 tokens
    buckets = [*LADDER, Bucket.parse("t8192-s520-m512-g2-p128-q8064")]
    pieces = chunk([big], BUDGET, buckets)
    check_pieces([big], pieces, BUDGET, buckets, True)
    assert all(p.bucket is not None for p in pieces)
    assert all(g.prefix == big.prefix for p in pieces for g in p.groups)
    # 8,064 suffix tokens = 504 items a piece: 504 + 504 + 504 + 488
    assert [sum(len(g.suffixes) for g in p.groups) for p in pieces] == [504, 504, 504, 488]


def test_budget_below_the_largest_bucket_caps_pieces():
    groups = w1_like(random.Random(2), 100)
    pieces = chunk(groups, 2000, LADDER)
    check_pieces(groups, pieces, 2000, LADDER, True)
    assert max(p.footprint.tokens for p in pieces) <= 2000


def test_no_groups_and_bad_budget():
    assert chunk([], BUDGET, LADDER) == []
    with pytest.raises(ValueError, match="max_tokens"):
        chunk([SequenceGroup([], [[1]])], 0)


def _budget_split(groups: list[SequenceGroup], budget: int) -> list[list[SequenceGroup]]:
    """The runner's former split (the oracle): chunks of whole groups within `budget`, a group
    over it cut into groups with the same prefix."""
    chunks: list[list[SequenceGroup]] = [[]]
    used = 0
    for g in groups:
        parts = [g]
        if g.num_tokens > budget and len(g.suffixes) > 1:
            parts, cur, cur_tokens = [], [], len(g.prefix)
            for s in g.suffixes:
                if cur and cur_tokens + len(s) > budget:
                    parts.append(SequenceGroup(g.prefix, cur))
                    cur, cur_tokens = [], len(g.prefix)
                cur.append(s)
                cur_tokens += len(s)
            parts.append(SequenceGroup(g.prefix, cur))
        for part in parts:
            if chunks[-1] and used + part.num_tokens > budget:
                chunks.append([])
                used = 0
            chunks[-1].append(part)
            used += part.num_tokens
    return chunks
