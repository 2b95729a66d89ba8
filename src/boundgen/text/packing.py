"""Pack token sequences into one padding-free batch (the one thing passed from packing to model).

A `SequenceGroup` is a prefix shared by several suffixes (query + candidates). Groups with a prefix
and at least two suffixes are laid out for cascade attention: the prefix is computed once and the
suffixes attend to it (see `boundgen.attention.metadata`). Everything else is a plain causal
sequence. `Footprint` gives the sizes of that layout without packing (what chooses a bucket).

Packing works on lengths with numpy, one vector op per field: Python touches each sequence once
(its length), never each token; the tokens themselves are read from the groups' own arrays
(`SequenceGroup.ids`, a checked request's) or go through one conversion (`int64_array`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from boundgen.attention.metadata import AttnInputs
from boundgen.text.sequences import SequenceGroup, int64_array


def shares_prefix(group: SequenceGroup, share_prefix: bool = True) -> bool:
    """Whether `pack` lays `group` out for cascade attention (a prefix, at least two suffixes)."""
    return share_prefix and bool(group.prefix) and len(group.suffixes) >= 2


@dataclass(frozen=True, slots=True)
class Footprint:
    """Sizes of the layout `pack` gives some groups, known without packing them. Footprints add up:
    consecutive groups packed together have the sum of their footprints (`max_seqlen`: the max)."""

    prefix_tokens: int = 0  # prefixes of shared-prefix groups
    shared_tokens: int = 0  # their suffixes
    plain_tokens: int = 0
    segments: int = 0  # causal segments (cu_seqlens has segments + 1 entries)
    groups: int = 0  # shared-prefix groups
    max_seqlen: int = 0

    @classmethod
    def of(cls, group: SequenceGroup, share_prefix: bool = True) -> Footprint:
        p, lens = len(group.prefix), list(map(len, group.suffixes))  # C loops, not generators
        if shares_prefix(group, share_prefix):
            nonempty = len(lens) - lens.count(0)
            return cls(p, sum(lens), 0, 1 + nonempty, 1, max(p, max(lens)))
        longest = p + max(lens) if lens else 0
        return cls(0, 0, p * len(lens) + sum(lens), len(lens), 0, longest)

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(
            self.prefix_tokens + other.prefix_tokens,
            self.shared_tokens + other.shared_tokens,
            self.plain_tokens + other.plain_tokens,
            self.segments + other.segments,
            self.groups + other.groups,
            max(self.max_seqlen, other.max_seqlen),
        )

    @property
    def tokens(self) -> int:
        return self.prefix_tokens + self.shared_tokens + self.plain_tokens

    @property
    def cascade(self) -> bool:
        """Whether the packed batch carries cascade metadata: `pack` drops it when every shared
        suffix is empty, and the prefixes are then plain causal segments."""
        return self.shared_tokens > 0

    def as_packed(self) -> Footprint:
        """These sizes as `PackedBatch.footprint` reads them (without cascade: prefixes plain)."""
        if self.cascade or not self.groups:
            return self
        return Footprint(0, 0, self.tokens, self.segments, 0, self.max_seqlen)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttnInputs
    last_index: torch.Tensor  # int64 [N]: row of each output sequence's last token, in input order
    seq_start: torch.Tensor  # int64 [N]: first row of a plain sequence (−1 for shared-prefix rows)
    seq_len: torch.Tensor  # int64 [N]
    rows_per_group: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.last_index.shape[0])

    @property
    def footprint(self) -> Footprint:
        """This batch's sizes, read from its metadata (equal to the groups' `Footprint.of` sum)."""
        a = self.attn
        p, q, g = 0, 0, 0
        if a.has_shared_prefix:
            p, q, g = a.num_prefix_tokens, a.num_shared_tokens, int(a.cu_prefix.shape[0]) - 1
        segments = int(a.cu_seqlens.shape[0]) - 1
        return Footprint(p, q, self.num_tokens - p - q, segments, g, a.max_seqlen)

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        mv = lambda t: t.to(device, non_blocking=non_blocking)
        return PackedBatch(
            mv(self.input_ids),
            mv(self.positions),
            self.attn.to(device, non_blocking),
            mv(self.last_index),
            mv(self.seq_start),
            mv(self.seq_len),
            list(self.rows_per_group),
        )


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """[0, l0, l0+l1, ...] (int64 [n+1])."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    out[1:] = lengths.cumsum()  # the method: np.cumsum's wrapper costs ~1.5 µs more a call
    return out


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int32))


@dataclass(slots=True)
class HostLayout:
    """`pack`'s layout of some groups as host numpy arrays (int64 unless noted), before any tensor:
    what `pack` wraps and what a bucket's staged inputs are written from (`compile.buckets`)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    seg_len: np.ndarray  # [S]: causal segments in layout order
    last: np.ndarray  # [N]: row of each output sequence's last token, in input order
    start: np.ndarray  # [N]: first row of a plain sequence (−1 for shared-prefix rows)
    length: np.ndarray  # [N]
    prefix_lens: list[int]  # [G] shared-prefix groups
    group_q: list[int]  # [G]: their suffix tokens
    # segments in the prefix span and in the shared-suffix span (the rest are plain); (0, 0)
    # without cascade, where shared prefixes are plain segments
    span_segments: tuple[int, int]

    @property
    def cascade(self) -> bool:
        """Some shared suffix is non-empty: prefixes and suffixes are spans of their own."""
        return self.span_segments != (0, 0)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens of the prefix span (0 without cascade)."""
        return sum(self.prefix_lens) if self.cascade else 0

    @property
    def num_shared_tokens(self) -> int:
        """Tokens of the shared-suffix span (0 without cascade)."""
        return sum(self.group_q) if self.cascade else 0


def pack_arrays(groups: list[SequenceGroup], share_prefix: bool = True) -> HostLayout:
    """`pack`'s token layout as host arrays (see `pack`)."""
    if len(groups) == 1:
        g = groups[0]
        if len(g.suffixes) == 1:  # never shared: one plain sequence
            return _one_sequence(g.prefix, g.suffixes[0], g.ids)
        if shares_prefix(g, share_prefix):
            lens = list(map(len, g.suffixes))
            if 0 not in lens:  # a query and its items (W2)
                return _one_group(g, lens)
    return _pack_groups(groups, share_prefix)


def _one_sequence(prefix: list[int], suffix: list[int], ids: np.ndarray | None) -> HostLayout:
    """`_pack_groups` of one plain sequence (a small request, W3's one prompt) in five numpy calls
    where the general path makes about twenty: W3's pieces were 54.7 µs of host time before the
    replay on the H100 (BENCHMARKS.md, forty-second session)."""
    n = len(prefix) + len(suffix)
    if not n:
        raise ValueError("cannot pack an empty sequence (prefix and suffix both empty)")
    one = lambda x: np.array([x], dtype=np.int64)
    return HostLayout(
        # np.fromiter, not `int64_array`: a short prompt's ids from a chain of two lists come
        # 0.2-0.5 µs faster so (W3's 64 ids, interleaved, 2-core dev CPU)
        np.fromiter(chain(prefix, suffix), np.int64, n) if ids is None else ids,
        np.arange(n, dtype=np.int64),
        one(n),  # seg_len
        one(n - 1),  # last
        one(0),  # start
        one(n),  # length
        [],
        [],
        (0, 0),
    )


def _one_group(g: SequenceGroup, lens: list[int]) -> HostLayout:
    """`_pack_groups` of one shared-prefix group whose suffixes (of `lens` tokens) are all
    non-empty (a scoring request: its query and items) in nine numpy calls, where the general path
    makes about twenty-five and loops over the suffixes four times: W2's pack_arrays 27.5-31.0 →
    11.8-12.2 µs on the 2-core dev CPU (its ids read from the group's array)."""
    p = len(g.prefix)
    seg_len = np.array([p, *lens], dtype=np.int64)
    ends = seg_len.cumsum()  # the method: np.cumsum's wrapper costs ~1.5 µs more a call
    total = int(ends[-1])
    # each segment's positions start at its first row; a suffix's continue after the prefix
    first = ends - seg_len
    first[1:] -= p
    positions = np.arange(total, dtype=np.int64) - np.repeat(first, seg_len)
    ids = g.ids
    if ids is None:
        ids = int64_array(chain(g.prefix, chain.from_iterable(g.suffixes)), total)
    start = np.empty(len(lens), dtype=np.int64)
    start.fill(-1)  # shared rows have no plain start (np.full's wrapper: ~2 µs more)
    s_len = seg_len[1:]
    return HostLayout(
        ids, positions, seg_len, ends[1:] - 1, start, s_len + p, [p], [total - p], (1, len(lens))
    )


def _pack_groups(groups: list[SequenceGroup], share_prefix: bool) -> HostLayout:
    """`pack_arrays` of any groups."""
    shared_mask = [shares_prefix(g, share_prefix) for g in groups]
    shared = [g for g, s in zip(groups, shared_mask) if s]
    plain = [g for g, s in zip(groups, shared_mask) if not s]
    prefix_lens = [len(g.prefix) for g in shared]  # [G]
    suffix_lens = [n for g in shared for n in map(len, g.suffixes)]  # one per shared row
    plain_lens = [len(g.prefix) + len(s) for g in plain for s in g.suffixes]  # one per plain row
    if 0 in plain_lens:
        raise ValueError("cannot pack an empty sequence (prefix and suffix both empty)")
    shared_segs = [n for n in suffix_lens if n] if 0 in suffix_lens else suffix_lens
    seg_len = np.array(prefix_lens + shared_segs + plain_lens, dtype=np.int64)
    if not len(seg_len):
        raise ValueError("cannot pack a batch without sequences")
    cu = _offsets(seg_len)
    total = int(cu[-1])
    # position of every token = its row minus the row where its segment's positions would start
    # (a shared suffix continues after its group's prefix)
    pos0_row = cu[:-1]
    if shared_segs:
        first, n = len(shared), len(shared_segs)
        nonempty = [sum(map(bool, g.suffixes)) for g in shared]
        pos0_row = pos0_row.copy()
        pos0_row[first : first + n] -= np.repeat(seg_len[:first], nonempty)
    positions = np.arange(total, dtype=np.int64) - np.repeat(pos0_row, seg_len)

    input_ids = _token_ids(shared, plain, total)

    # output rows: plain ones are the last segments; shared ones end at their suffix (an empty
    # suffix scores its prefix's last token)
    n_plain = len(plain_lens)
    plain_len = seg_len[len(seg_len) - n_plain :]
    plain_end = cu[len(cu) - n_plain :]
    last, start, length = plain_end - 1, plain_end - plain_len, plain_len
    num_prefix = sum(prefix_lens)
    group_q = [sum(map(len, g.suffixes)) for g in shared]  # [G]
    if shared:
        counts = [len(g.suffixes) for g in shared]
        s_len = np.array(suffix_lens, dtype=np.int64)
        s_end = num_prefix + s_len.cumsum()
        if len(shared_segs) < len(suffix_lens):
            prefix_end = np.repeat(cu[1 : len(shared) + 1], counts)
            s_end = np.where(s_len > 0, s_end, prefix_end)
        s_rows = (
            s_end - 1,
            np.full(len(s_len), -1, dtype=np.int64),
            s_len + np.repeat(seg_len[: len(shared)], counts),
        )
        if not n_plain:
            last, start, length = s_rows
        else:  # interleave both kinds back into input order
            row_shared = np.repeat(np.array(shared_mask), [len(g.suffixes) for g in groups])
            merged = []
            for s_arr, p_arr in zip(s_rows, (last, start, length)):
                out = np.empty(len(row_shared), dtype=np.int64)
                out[row_shared], out[~row_shared] = s_arr, p_arr
                merged.append(out)
            last, start, length = merged

    spans = (len(shared), len(shared_segs)) if shared_segs else (0, 0)
    return HostLayout(
        input_ids, positions, seg_len, last, start, length, prefix_lens, group_q, spans
    )


def _token_ids(shared: list[SequenceGroup], plain: list[SequenceGroup], total: int) -> np.ndarray:
    """The layout's token ids: [ shared prefixes | their suffixes | plain sequences ]. From the
    groups' own arrays where every group has one (`SequenceGroup.ids`: slices joined, no Python
    int converted) and no plain group repeats a prefix, else from their lists."""
    if all(g.ids is not None for g in shared) and all(
        g.ids is not None and not g.prefix for g in plain
    ):
        if len(shared) + len(plain) == 1:  # a lone group (W2): its array is the layout
            return (shared or plain)[0].ids
        cut = [len(g.prefix) for g in shared]
        return np.concatenate(
            [g.ids[:p] for g, p in zip(shared, cut)]
            + [g.ids[p:] for g, p in zip(shared, cut)]
            + [g.ids for g in plain]
        )
    parts: list[list[int]] = [g.prefix for g in shared]
    for g in shared:
        parts += g.suffixes
    for g in plain:
        parts += [x for s in g.suffixes for x in (g.prefix, s)] if g.prefix else g.suffixes
    return int64_array(chain.from_iterable(parts), total)


def pack(groups: list[SequenceGroup], share_prefix: bool = True) -> PackedBatch:
    """Token layout: [ shared prefixes | their non-empty suffixes | plain sequences ], each
    prefix, suffix and plain sequence (prefix + suffix of a group without sharing) one causal
    segment; output rows (one per suffix) stay in input order."""
    return batch_of(pack_arrays(groups, share_prefix), groups)


def batch_of(lay: HostLayout, groups: list[SequenceGroup]) -> PackedBatch:
    """The packed batch of `groups` from their host layout (`pack_arrays`): its arrays as tensors
    (shared, not copied) and the attention metadata."""
    cascade = lay.cascade
    attn = AttnInputs(
        cu_seqlens=_int32(_offsets(lay.seg_len)),
        max_seqlen=int(lay.seg_len.max()),
        cu_prefix=_int32(_offsets(np.array(lay.prefix_lens))) if cascade else None,
        cu_group_q=_int32(_offsets(np.array(lay.group_q))) if cascade else None,
        max_prefix=max(lay.prefix_lens, default=0),
        max_group_q=max(lay.group_q, default=0),
        num_prefix_tokens=sum(lay.prefix_lens),
        num_shared_tokens=sum(lay.group_q),
    )
    return PackedBatch(
        input_ids=torch.from_numpy(lay.input_ids),
        positions=torch.from_numpy(lay.positions),
        attn=attn,
        last_index=torch.from_numpy(lay.last),
        seq_start=torch.from_numpy(lay.start),
        seq_len=torch.from_numpy(lay.length),
        rows_per_group=[len(g.suffixes) for g in groups],
    )
