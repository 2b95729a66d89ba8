"""Cut the groups of one forward into pieces that fill the compiled buckets (host side, sizes only).

Pieces keep row order: the rows of all pieces, concatenated, are the input rows in order. With
buckets, plain rows are the units of a cut and every piece is filled at sequence boundaries up to
the largest bucket that takes it; what is left goes into the smallest bucket that fits. A
shared-prefix group stays whole when a bucket takes it, else it is cut into groups with the same
prefix. A row that no bucket takes is a miss: its own piece (with the misses right after it, up to
the token budget), run eagerly. Without buckets this is the token-budget split of
`ModelRunner.split`: whole groups, a group over the budget cut into same-prefix groups.

Everything is decided on `Footprint`s (lengths, no tensors), so the bucket of each piece is known
before packing and `BucketSet.pad` picks the same one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from boundgen.compile.buckets import Bucket, BucketSet, PaddingStats
from boundgen.text.packing import Footprint, SequenceGroup, shares_prefix


class Buckets(Protocol):
    """What the cut asks of a bucket set (`BucketSet`; the planner's ideal buckets)."""

    @property
    def largest(self) -> int: ...

    def smallest(self, fp: Footprint) -> Bucket | None: ...


@dataclass
class Piece:
    """Groups of one forward (in row order), their footprint, and the smallest bucket that takes
    them (None: no bucket does, or no buckets were given)."""

    groups: list[SequenceGroup]
    footprint: Footprint
    bucket: Bucket | None


def predicted_stats(pieces: list[Piece]) -> PaddingStats:
    """The padding `BucketSet.pad` will count for these pieces (a piece without bucket: a miss)."""
    stats = PaddingStats()
    for piece in pieces:
        if piece.bucket is None:
            stats.misses += 1
            continue
        stats.real_tokens += piece.footprint.tokens
        stats.padded_tokens += piece.bucket.tokens
        stats.batches[piece.bucket.name] = stats.batches.get(piece.bucket.name, 0) + 1
    return stats


def chunk(
    groups: list[SequenceGroup],
    max_tokens: int,
    buckets: Buckets | list[Bucket] | None = None,
    share_prefix: bool = True,
) -> list[Piece]:
    """Pieces of at most `max_tokens` tokens (a single row over it: alone) that each fit a bucket
    where one can; `[]` for no groups."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
    if not groups:
        return []
    if isinstance(buckets, list):
        buckets = BucketSet(buckets)
    unbucketed = buckets is None or not buckets.largest
    fps = (Footprint.of(g, share_prefix) for g in groups)
    fp = sum(fps, next(fps))  # one group (a small request): its own footprint, no sum
    if fp.tokens <= max_tokens:  # the whole forward in one piece: nothing to search
        bucket = None if unbucketed else buckets.smallest(fp)
        if unbucketed or bucket is not None:
            return [Piece(list(groups), fp, bucket)]
    if unbucketed:
        within = lambda fp: fp.tokens <= max_tokens
        units = _Units(groups, share_prefix, within, max_tokens, max_tokens, rows=False)
        return _cut(units, max_tokens, max_tokens, within, lambda fp: None)
    cap = min(max_tokens, buckets.largest)
    fits = lambda fp: fp.tokens <= cap and buckets.smallest(fp) is not None
    units = _Units(groups, share_prefix, fits, cap, max_tokens, rows=True)
    return _cut(units, cap, max_tokens, fits, buckets.smallest)


def _longest(start: int, end: int, bound: int, fits: Callable[[int], bool]) -> int:
    """The largest j in (start, min(end, bound)] with fits(j), assuming fits mostly shrinks to false
    as j grows (binary search keeps a j that fits); start + 1 when even that does not fit."""
    hi = min(end, bound)
    if hi <= start + 1 or fits(hi):
        return max(hi, start + 1)
    lo = start + 1
    if not fits(lo):
        return lo
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class _Units:
    """The units a forward is cut at, in row order, as columns with prefix sums (the footprint of
    any run of units is O(1) plus a max): plain rows (or whole plain groups without buckets), whole
    shared-prefix groups, or same-prefix parts of a group that does not fit whole."""

    def __init__(
        self, groups, share_prefix: bool, fits, cap: int, max_tokens: int, rows: bool
    ) -> None:
        self.groups = groups
        self.group: list[int] = []  # input group of each unit
        self.lo: list[int] = []  # its suffixes [lo, hi)
        self.hi: list[int] = []
        self.first = [0]  # first unit of each group (+ the end)
        self.shared: list[bool] = []  # per group: packed as a shared-prefix group
        tokens: list[int] = []
        prefix: list[int] = []  # shared-prefix tokens
        suffix: list[int] = []  # their suffix tokens
        segments: list[int] = []
        cascade_groups: list[int] = []
        self.longest: list[int] = []
        for gi, g in enumerate(groups):
            shared = shares_prefix(g, share_prefix)
            self.shared.append(shared)
            p, n = len(g.prefix), len(g.suffixes)
            if rows and not shared:  # one unit per row (a group without rows: one empty unit)
                k = max(n, 1)
                self.lo += range(n) if n else [0]
                self.hi += range(1, n + 1) if n else [0]
                lens = [p + len(s) for s in g.suffixes] or [0]
                tokens += lens
                self.longest += lens
                segments += [1] * n or [0]
                prefix += [0] * k
                suffix += [0] * k
                cascade_groups += [0] * k
            else:
                whole = Footprint.of(g, share_prefix)
                parts = (
                    [(0, n)]
                    if fits(whole) or n < 2
                    else _split(g, share_prefix, fits, cap, max_tokens)
                )
                fps = [_part_footprint(g, lo, hi, share_prefix) for lo, hi in parts]
                k = len(parts)
                self.lo += [lo for lo, _ in parts]
                self.hi += [hi for _, hi in parts]
                tokens += [fp.tokens for fp in fps]
                self.longest += [fp.max_seqlen for fp in fps]
                segments += [fp.segments for fp in fps]
                prefix += [fp.prefix_tokens for fp in fps]
                suffix += [fp.shared_tokens for fp in fps]
                cascade_groups += [fp.groups for fp in fps]
            self.group += [gi] * k
            self.first.append(len(self.group))
        cum = lambda xs: list(accumulate(xs, initial=0))
        self.cum_tokens, self.cum_prefix, self.cum_suffix = cum(tokens), cum(prefix), cum(suffix)
        self.cum_segments, self.cum_groups = cum(segments), cum(cascade_groups)

    def __len__(self) -> int:
        return len(self.group)

    def footprint(self, i: int, j: int) -> Footprint:
        p = self.cum_prefix[j] - self.cum_prefix[i]
        q = self.cum_suffix[j] - self.cum_suffix[i]
        return Footprint(
            p,
            q,
            self.cum_tokens[j] - self.cum_tokens[i] - p - q,
            self.cum_segments[j] - self.cum_segments[i],
            self.cum_groups[j] - self.cum_groups[i],
            max(self.longest[i:j], default=0),
        )

    def token_bound(self, i: int, cap: int) -> int:
        """The largest j with tokens(i, j) ≤ cap (i when unit i alone is over it)."""
        return bisect_right(self.cum_tokens, self.cum_tokens[i] + cap, lo=i) - 1

    def materialize(self, i: int, j: int) -> list[SequenceGroup]:
        """Units [i, j) as groups: a plain group's rows in one group, every shared part its own."""
        out = []
        gi = self.group[i] if i < j else 0
        while i < j:
            g, end = self.groups[gi], min(j, self.first[gi + 1])
            spans = (
                [(self.lo[u], self.hi[u]) for u in range(i, end)]
                if self.shared[gi]
                else [(self.lo[i], self.hi[end - 1])]
            )
            for lo, hi in spans:
                whole = lo == 0 and hi == len(g.suffixes)
                out.append(g if whole else SequenceGroup(g.prefix, g.suffixes[lo:hi]))
            i, gi = end, gi + 1
        return out


def _part_footprint(g: SequenceGroup, lo: int, hi: int, share_prefix: bool) -> Footprint:
    return Footprint.of(SequenceGroup(g.prefix, g.suffixes[lo:hi]), share_prefix)


def _split(
    g: SequenceGroup, share_prefix: bool, fits, cap: int, max_tokens: int
) -> list[tuple[int, int]]:
    """Same-prefix parts [lo, hi) of a group too big for a piece, each as many suffixes as fit (at
    least one) in `cap` tokens. When no part of two suffixes fits (their prefix would be computed
    once per suffix), the parts are cut at the budget only: they miss every bucket, as fewer,
    larger forwards."""
    p, n = len(g.prefix), len(g.suffixes)
    sep = not shares_prefix(g, share_prefix)  # plain rows each carry the prefix
    cum = list(accumulate((len(s) + (p if sep else 0) for s in g.suffixes), initial=0))
    if not fits(_part_footprint(g, 0, 2, share_prefix)):
        cap = max_tokens
        fits = lambda fp: fp.tokens <= max_tokens
    parts, lo = [], 0
    while lo < n:
        bound = bisect_right(cum, cap - (0 if sep else p) + cum[lo], lo=lo) - 1
        part_fits = lambda hi, lo=lo: fits(_part_footprint(g, lo, hi, share_prefix))
        hi = _longest(lo, n, bound, part_fits)
        parts.append((lo, hi))
        lo = hi
    return parts


def _cut(units: _Units, cap: int, max_tokens: int, fits, smallest) -> list[Piece]:
    pieces, i, n = [], 0, len(units)
    fits_run = lambda i: lambda j: fits(units.footprint(i, j))
    while i < n:
        j = _longest(i, n, units.token_bound(i, cap), fits_run(i))
        if j == i + 1 and not fits(units.footprint(i, j)):
            # a miss runs eagerly at any size: the misses right after it join it, up to the budget
            while (
                j < n
                and units.cum_tokens[j + 1] - units.cum_tokens[i] <= max_tokens
                and not fits(units.footprint(j, j + 1))
            ):
                j += 1
        fp = units.footprint(i, j)
        pieces.append(Piece(units.materialize(i, j), fp, smallest(fp)))
        i = j
    return pieces
