"""Packing: the vectorized `pack` equals the per-token implementation it replaced (the oracle
below), and `Footprint` predicts the packed layout's sizes without packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from boundgen.attention.metadata import AttnInputs
from boundgen.text import packing
from boundgen.text.packing import Footprint, PackedBatch, SequenceGroup, pack, pack_arrays


def _cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def reference_pack(groups: list[SequenceGroup], share_prefix: bool = True) -> PackedBatch:
    """`pack` as it was before vectorization (one Python step per token): the oracle."""
    shared = [g for g in groups if share_prefix and g.prefix and len(g.suffixes) >= 2]
    shared_ids = {id(g) for g in shared}
    ids: list[int] = []
    pos: list[int] = []
    segments: list[int] = []
    prefix_start: dict[int, int] = {}
    for g in shared:
        prefix_start[id(g)] = len(ids)
        ids += g.prefix
        pos += range(len(g.prefix))
        segments.append(len(g.prefix))
    num_prefix = len(ids)
    group_q: list[int] = []
    row_of: dict[tuple[int, int], tuple[int, int, int]] = {}
    for g in shared:
        p, start_tokens = len(g.prefix), len(ids)
        for j, s in enumerate(g.suffixes):
            if s:
                ids += s
                pos += range(p, p + len(s))
                segments.append(len(s))
                row_of[id(g), j] = (len(ids) - 1, -1, p + len(s))
            else:
                row_of[id(g), j] = (prefix_start[id(g)] + p - 1, -1, p)
        group_q.append(len(ids) - start_tokens)
    num_shared = len(ids) - num_prefix
    for g in groups:
        if id(g) in shared_ids:
            continue
        for j, s in enumerate(g.suffixes):
            seq = g.prefix + s
            if not seq:
                raise ValueError("cannot pack an empty sequence (prefix and suffix both empty)")
            start = len(ids)
            ids += seq
            pos += range(len(seq))
            segments.append(len(seq))
            row_of[id(g), j] = (len(ids) - 1, start, len(seq))
    rows = [row_of[id(g), j] for g in groups for j in range(len(g.suffixes))]
    prefix_lens = [len(g.prefix) for g in shared]
    attn = AttnInputs(
        cu_seqlens=_cu(segments),
        max_seqlen=max(segments),
        cu_prefix=_cu(prefix_lens) if shared and num_shared else None,
        cu_group_q=_cu(group_q) if shared and num_shared else None,
        max_prefix=max(prefix_lens, default=0),
        max_group_q=max(group_q, default=0),
        num_prefix_tokens=num_prefix,
        num_shared_tokens=num_shared,
    )
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        attn=attn,
        last_index=torch.tensor([r[0] for r in rows], dtype=torch.int64),
        seq_start=torch.tensor([r[1] for r in rows], dtype=torch.int64),
        seq_len=torch.tensor([r[2] for r in rows], dtype=torch.int64),
        rows_per_group=[len(g.suffixes) for g in groups],
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
        a, b = getattr(got.attn, name), getattr(want.attn, name)
        assert type(a) is int and a == b, name
    assert got.rows_per_group == want.rows_per_group


tokens = st.lists(st.integers(0, 1000), max_size=6)
groups_st = st.lists(
    st.builds(SequenceGroup, tokens, st.lists(tokens, max_size=5)), min_size=1, max_size=6
)


@settings(max_examples=400)
@given(groups_st, st.booleans())
def test_pack_equals_per_token_oracle(groups, share_prefix):
    try:
        want = reference_pack(groups, share_prefix)
    except ValueError:  # an empty sequence, or nothing to pack
        with pytest.raises(ValueError):
            pack(groups, share_prefix)
        return
    got = pack(groups, share_prefix)
    assert_same_batch(got, want)
    fp = sum((Footprint.of(g, share_prefix) for g in groups), Footprint())
    assert fp.as_packed() == got.footprint and fp.tokens == got.num_tokens


def _with_ids(g: SequenceGroup) -> SequenceGroup:
    """`g` carrying its ids as one array, as a checked request's group does."""
    flat = list(g.prefix) + [t for s in g.suffixes for t in s]
    return SequenceGroup(g.prefix, g.suffixes, np.array(flat, dtype=np.int64))


@settings(max_examples=300)
@given(groups_st, st.booleans(), st.data())
def test_groups_ids_arrays_give_the_layout_of_their_lists(groups, share_prefix, data):
    """Groups that carry their ids as arrays (`SequenceGroup.ids`, all or some) pack to the layout
    of the same groups' lists."""
    with_ids = [_with_ids(g) if data.draw(st.booleans()) else g for g in groups]
    try:
        want = pack_arrays(groups, share_prefix)
    except ValueError:
        with pytest.raises(ValueError):
            pack_arrays(with_ids, share_prefix)
        return
    assert_same_layout(pack_arrays(with_ids, share_prefix), want)


def assert_same_layout(got, want) -> None:
    """Two `HostLayout`s hold the same arrays (dtype and values) and the same cascade sizes."""
    for name in ("input_ids", "positions", "seg_len", "last", "start", "length"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert (got.prefix_lens, got.group_q, got.span_segments) == (
        want.prefix_lens,
        want.group_q,
        want.span_segments,
    )


def test_pack_big_mixed_batch_equals_oracle():
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, 50000, (n,), generator=g).tolist()
    lens = lambda k, lo, hi: torch.randint(lo, hi + 1, (k,), generator=g).tolist()
    groups = [
        SequenceGroup([], [ids(n) for n in lens(64, 64, 256)]),  # W1-like
        SequenceGroup(ids(256), [ids(n) for n in lens(100, 8, 24)]),  # W2-like
        SequenceGroup(ids(7), [ids(5)]),  # one suffix: plain
        SequenceGroup(ids(30), [ids(3), [], ids(9)]),  # an empty suffix scores the prefix
    ]
    for share in (True, False):
        assert_same_batch(pack(groups, share), reference_pack(groups, share))


def test_empty_inputs_are_rejected():
    with pytest.raises(ValueError, match="empty sequence"):
        pack([SequenceGroup([], [[]])])
    with pytest.raises(ValueError, match="without sequences"):
        pack([SequenceGroup([1, 2], [])])


@pytest.mark.parametrize(
    "prefix, suffix", [([], [5, 6, 7]), ([1, 2], [5, 6, 7]), ([1, 2], []), ([9], [])]
)
@pytest.mark.parametrize("share_prefix", [True, False])
def test_one_sequence_fast_path_equals_the_general_layout(prefix, suffix, share_prefix):
    """A single plain sequence takes `pack_arrays`' short path: the layout of the general one."""
    groups = [SequenceGroup(prefix, [suffix])]
    got, want = pack_arrays(groups, share_prefix), packing._pack_groups(groups, share_prefix)
    assert_same_layout(got, want)
    assert (want.prefix_lens, want.group_q, want.span_segments) == ([], [], (0, 0))


@settings(max_examples=300)
@given(
    st.lists(st.integers(0, 1000), max_size=6),
    st.lists(st.lists(st.integers(0, 1000), max_size=5), min_size=2, max_size=6),
    st.booleans(),
    st.booleans(),
)
@example([1, 2, 3], [[4], [5, 6], [7]], True, True)  # the short path, its array read as is
@example([1, 2, 3], [[4], [5, 6], [7]], True, False)
def test_one_group_fast_path_equals_the_general_layout(prefix, suffixes, share_prefix, ids):
    """One group (a query and its items) takes `pack_arrays`' short path where it is shared and
    no suffix is empty, with or without its ids array: the layout of the general path."""
    g = SequenceGroup(prefix, suffixes)
    if ids:
        g = _with_ids(g)
    try:
        want = packing._pack_groups([g], share_prefix)
    except ValueError:
        with pytest.raises(ValueError):
            pack_arrays([g], share_prefix)
        return
    assert_same_layout(pack_arrays([g], share_prefix), want)


def test_one_empty_sequence_is_rejected_as_in_the_general_path():
    for pack_fn in (pack_arrays, packing._pack_groups):
        with pytest.raises(ValueError, match="empty sequence"):
            pack_fn([SequenceGroup([], [[]])], True)
