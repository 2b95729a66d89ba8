"""Buckets: whether a batch fits (decided on its `Footprint`) and the padded batch (built with
numpy) equal the torch implementation they replaced (the oracle below); the default ladder."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from boundgen.attention.metadata import AttnInputs
from boundgen.compile import buckets as buckets_module
from boundgen.compile.buckets import Bucket, BucketSet, default_buckets, ladder, write_padded
from boundgen.compile.staging import StagedInputs
from boundgen.text.packing import Footprint, PackedBatch, SequenceGroup, pack, pack_arrays


def _spans(batch: PackedBatch):
    """(p, q, tail, [prefix segs], [shared segs], [tail segs], cu_prefix, cu_group_q)."""
    a = batch.attn
    cu = a.cu_seqlens.tolist()
    p = a.num_prefix_tokens if a.has_shared_prefix else 0
    q = a.num_shared_tokens if a.has_shared_prefix else 0
    segs = ([], [], [])
    for start, end in itertools.pairwise(cu):
        segs[0 if start < p else 1 if start < p + q else 2].append(end - start)
    cp = a.cu_prefix.tolist() if a.has_shared_prefix else [0]
    cq = a.cu_group_q.tolist() if a.has_shared_prefix else [0]
    return p, q, batch.num_tokens - p - q, *segs, cp, cq


def reference_fits(b: Bucket, batch: PackedBatch) -> bool:
    p, q, tail, pre, sh, tl, cp, _ = _spans(batch)
    m = b.max_seqlen
    if batch.attn.max_seqlen > m:
        return False
    if not b.cascade:
        pad = b.tokens - tail
        return not (p or q) and pad >= 0 and len(tl) + math.ceil(pad / m) <= b.segments
    g = len(cp) - 1
    pads = (
        b.prefix_tokens - p,
        b.shared_tokens - q,
        b.tokens - b.prefix_tokens - b.shared_tokens - tail,
    )
    if min(pads) < 0 or g > b.groups or (pads[1] and (not pads[0] or g + 1 > b.groups)):
        return False
    return len(pre) + len(sh) + len(tl) + sum(math.ceil(x / m) for x in pads) <= b.segments


def reference_pad(b: Bucket, batch: PackedBatch) -> PackedBatch:
    """`_build` before numpy: the padded layout, in torch ops."""
    p, q, tail, pre, sh, tl, cp, cq = _spans(batch)
    m = b.max_seqlen
    P, Q = (b.prefix_tokens, b.shared_tokens) if b.cascade else (0, 0)
    pad = lambda n: [] if n <= 0 else [m] * (n // m) + ([n % m] if n % m else [])
    segs = pre + pad(P - p) + sh + pad(Q - q) + tl + pad(b.tokens - P - Q - tail)
    segs += [0] * (b.segments - len(segs))
    ids = torch.zeros(b.tokens, dtype=torch.int64)
    pos = torch.zeros(b.tokens, dtype=torch.int64)
    for src, dst, n in [(0, 0, p), (p, P, q), (p + q, P + Q, tail)]:
        ids[dst : dst + n] = batch.input_ids[src : src + n]
        pos[dst : dst + n] = batch.positions[src : src + n]
    cu = torch.tensor([0, *torch.tensor(segs).cumsum(0).tolist()], dtype=torch.int32)
    cu_prefix = cu_group_q = None
    if b.cascade:
        cu_prefix = torch.tensor(cp + [P] * (b.groups + 1 - len(cp)), dtype=torch.int32)
        cu_group_q = torch.tensor(cq + [Q] * (b.groups + 1 - len(cq)), dtype=torch.int32)
    attn = AttnInputs(cu, m, cu_prefix, cu_group_q, P, Q, P, Q)

    def remap(idx):
        shift = torch.where(idx >= p, P - p, 0) + torch.where(idx >= p + q, Q - q, 0)
        return torch.where(idx >= 0, idx + shift, idx)

    return PackedBatch(
        ids,
        pos,
        attn,
        remap(batch.last_index),
        remap(batch.seq_start),
        batch.seq_len.clone(),
        list(batch.rows_per_group),
    )


def assert_same_batch(got: PackedBatch, want: PackedBatch) -> None:
    for name in ("input_ids", "positions", "last_index", "seq_start", "seq_len"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("cu_seqlens", "cu_prefix", "cu_group_q"):
        a, b = getattr(got.attn, name), getattr(want.attn, name)
        assert (a is None) == (b is None), name
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), name
    for name in (
        "max_seqlen",
        "max_prefix",
        "max_group_q",
        "num_prefix_tokens",
        "num_shared_tokens",
    ):
        assert getattr(got.attn, name) == getattr(want.attn, name), name
    assert got.rows_per_group == want.rows_per_group


BUCKETS = [
    Bucket.parse(s)
    for s in (
        "t16",
        "t32-s4-m32",
        "t64-s8-m16",
        "t128-s4-m64",
        "t64-s8-m32-g2-p24-q32",
        "t128-s16-m64-g4-p48-q64",
        "t96-s16-m64-g1-p40-q56",
    )
]
tokens = st.integers(1, 40).map(lambda n: list(range(1, n + 1)))
groups_st = st.lists(
    st.builds(
        SequenceGroup,
        st.integers(0, 30).map(lambda n: list(range(100, 100 + n))),
        st.lists(tokens | st.just([]), min_size=1, max_size=5),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=300)
@given(groups_st, st.booleans())
def test_fit_and_padding_equal_the_torch_oracle(groups, share_prefix):
    try:
        batch = pack(groups, share_prefix)
    except ValueError:  # an empty sequence
        return
    fp = sum((Footprint.of(g, share_prefix) for g in groups), Footprint())
    for b in BUCKETS:
        assert b.fits(batch.footprint) == b.fits(fp) == reference_fits(b, batch), b.name
        if reference_fits(b, batch):
            bucket, padded = BucketSet([b]).pad(batch)
            assert bucket == b
            assert_same_batch(padded, reference_pad(b, batch))
    fitting = [b for b in BUCKETS if reference_fits(b, batch)]
    assert BucketSet(BUCKETS).choose(batch) == (min(fitting) if fitting else None)


SHARED_SET = BucketSet(BUCKETS)  # one set across examples: its remembered answers are reused


@settings(max_examples=300)
@given(groups_st, st.booleans())
def test_smallest_remembered_is_the_first_that_fits(groups, share_prefix):
    fp = sum((Footprint.of(g, share_prefix) for g in groups), Footprint())
    fitting = [b for b in BUCKETS if b.fits(fp)]
    want = min(fitting) if fitting else None
    assert SHARED_SET.smallest(fp) == want
    assert SHARED_SET.smallest(fp) == want  # now remembered


def test_smallest_forgets_past_its_bound(monkeypatch):
    monkeypatch.setattr(buckets_module, "_REMEMBERED", 2)
    bs = BucketSet(BUCKETS)
    fps = [Footprint(0, 0, n, 1, 0, n) for n in (10, 20, 30)]
    want = [Bucket.parse(s) for s in ("t16", "t32-s4-m32", "t32-s4-m32")]
    assert [bs.smallest(fp) for fp in fps] == want
    assert len(bs._smallest) == 1  # cleared when full, then the third remembered
    assert [bs.smallest(fp) for fp in fps] == want


def _stale_host_arrays(b: Bucket) -> dict:
    """A bucket's staged host arrays, filled with garbage an earlier request could have left."""
    arrays = StagedInputs(b, "cpu", rows=64)._np
    for a in arrays.values():
        a[:] = 7
    return arrays


def _padded_fields(batch: PackedBatch) -> dict:
    a = batch.attn
    out = {"input_ids": batch.input_ids, "positions": batch.positions, "cu_seqlens": a.cu_seqlens}
    if a.cu_prefix is not None:
        out.update(cu_prefix=a.cu_prefix, cu_group_q=a.cu_group_q)
    return {k: v.tolist() for k, v in out.items()}


@settings(max_examples=300)
@given(groups_st, st.booleans())
def test_write_padded_writes_what_pad_builds(groups, share_prefix):
    """The staged path's direct write (`pack_arrays` → `write_padded` into a bucket's host arrays,
    over stale values) gives every field `BucketSet.pad(pack(...))` gives, in every bucket that
    fits, rows included; so does `pad` handed the layout instead of reading it back."""
    try:
        batch = pack(groups, share_prefix)
    except ValueError:  # an empty sequence
        return
    lay = pack_arrays(groups, share_prefix)
    for b in BUCKETS:
        if not b.fits(batch.footprint):
            continue
        _, padded = BucketSet([b]).pad(batch)
        arrays = _stale_host_arrays(b)
        k = write_padded(b, lay, arrays)
        assert k == padded.num_rows
        got = {name: arrays[name].tolist() for name in _padded_fields(padded)}
        assert got == _padded_fields(padded), b.name
        assert arrays["rows"][:k].tolist() == padded.last_index.tolist()
        # the runner's general path hands `pad` the layout it packed from: the same batch
        _, given = BucketSet([b]).pad(batch, lay)
        assert _padded_fields(given) == _padded_fields(padded), b.name
        for name in ("last_index", "seq_start", "seq_len"):
            assert getattr(given, name).tolist() == getattr(padded, name).tolist(), name


def test_write_padded_without_a_batch_is_the_example():
    for b in BUCKETS:
        arrays = _stale_host_arrays(b)
        assert write_padded(b, None, arrays) == 0
        got = {name: arrays[name].tolist() for name in _padded_fields(b.example())}
        assert got == _padded_fields(b.example()), b.name


def test_example_batch_is_all_padding():
    for b in BUCKETS:
        ex = b.example()
        assert ex.num_tokens == b.tokens and ex.attn.cu_seqlens.shape[0] == b.segments + 1
        assert int(ex.attn.cu_seqlens[-1]) == b.tokens and not ex.input_ids.any()


def test_ladder_adds_half_rungs_from_1024():
    assert ladder(8192) == [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert ladder(5000) == [64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 5000]
    assert ladder(1024) == [64, 128, 256, 512, 1024] and ladder(32) == [32]
    assert [b.name for b in default_buckets(2048)][-3:] == [
        "t1024-s32-m512",
        "t1536-s48-m512",
        "t2048-s64-m512",
    ]
