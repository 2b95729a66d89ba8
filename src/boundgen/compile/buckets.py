"""Shape buckets for compiled forwards: fixed packed layouts; per batch, the smallest that fits.

A compiled graph is specialised on every shape and on the static ints of `AttnInputs`, so a bucket
fixes them all. Two kinds:

- plain   `t{T}-s{S}-m{M}`: T tokens in S causal segments (cu_seqlens has S+1 entries), each ≤ M
  tokens.
- cascade `t{T}-s{S}-m{M}-g{G}-p{P}-q{Q}`: the shared-prefix layout of `text.packing`: P prefix
  tokens (G groups), then Q suffix tokens that also attend to their group's prefix, then T-P-Q
  plain tokens. A batch without shared prefixes fits it too (all P + Q tokens are then padding).

Whether a batch fits is decided on its `Footprint` (sizes only), so a batch can be placed before
it is packed (`compile.chunking`). Padding a real batch into a bucket (`BucketSet.pad`), in token
order:

    [ real prefixes | pad | real suffixes | pad | real plain | pad | ... zero-length segments ]

Pad tokens (id 0, position 0) form their own causal segments (≤ M each), so they never touch a real
token. In a cascade bucket the pad suffix tokens form one extra group whose keys are the pad prefix
tokens, so every row stays finite on every backend. Real rows keep their values exactly;
`last_index` and `seq_start` are remapped, so the padded batch is a valid `PackedBatch` of its own.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import accumulate

import numpy as np
import torch

from boundgen.attention.metadata import AttnInputs
from boundgen.text.packing import Footprint, HostLayout, PackedBatch

_PART = re.compile(r"([tsmgpq])(\d+)")


@dataclass(frozen=True, order=True)
class Bucket:
    tokens: int
    segments: int
    max_seqlen: int
    groups: int = 0
    prefix_tokens: int = 0
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.segments < 1 or self.max_seqlen < 1:
            raise ValueError(f"bucket {self.name}: tokens, segments and max_seqlen must be ≥ 1")
        if self.cascade and (
            self.prefix_tokens < 1
            or self.shared_tokens < 1
            or self.prefix_tokens + self.shared_tokens > self.tokens
        ):
            raise ValueError(
                f"bucket {self.name}: a cascade bucket needs p ≥ 1, q ≥ 1 and p + q ≤ t"
            )
        if not self.cascade and (self.prefix_tokens or self.shared_tokens):
            raise ValueError(f"bucket {self.name}: p and q need g ≥ 1")

    @property
    def cascade(self) -> bool:
        return self.groups > 0

    @cached_property  # frozen: built once, not on each `BucketSet.count` (3.7 µs of W3's pieces)
    def name(self) -> str:
        base = f"t{self.tokens}-s{self.segments}-m{self.max_seqlen}"
        if self.cascade:
            base += f"-g{self.groups}-p{self.prefix_tokens}-q{self.shared_tokens}"
        return base

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, spec: str) -> Bucket:
        """`t256` (defaults: s = max(4, t/32), m = min(t, 512)), `t2048-s64-m256`,
        `t2048-g4-p512-q1536`."""
        spec = spec.strip()
        parts = {k: int(v) for k, v in _PART.findall(spec)}
        if not parts or _PART.sub("", spec).strip("-") or "t" not in parts:
            raise ValueError(
                f"bad bucket spec '{spec}': use t<T>[-s<S>][-m<M>][-g<G>-p<P>-q<Q>], e.g. t256"
            )
        t = parts["t"]
        return cls(
            tokens=t,
            segments=parts.get("s", max(4, t // 32)),
            max_seqlen=parts.get("m", min(t, 512)),
            groups=parts.get("g", 0),
            prefix_tokens=parts.get("p", 0),
            shared_tokens=parts.get("q", 0),
        )

    def fits(self, fp: Footprint) -> bool:
        """Whether a packed batch of footprint `fp` pads into this bucket (`PackedBatch.footprint`,
        or `Footprint.of` summed over groups before packing)."""
        m = self.max_seqlen
        if fp.max_seqlen > m:
            return False
        p, q, g = (fp.prefix_tokens, fp.shared_tokens, fp.groups) if fp.cascade else (0, 0, 0)
        tail = fp.tokens - p - q
        if not self.cascade:
            pad = self.tokens - tail
            return not (p or q) and pad >= 0 and fp.segments + math.ceil(pad / m) <= self.segments
        pad_p = self.prefix_tokens - p
        pad_q = self.shared_tokens - q
        pad_t = self.tokens - self.prefix_tokens - self.shared_tokens - tail
        if min(pad_p, pad_q, pad_t) < 0 or g > self.groups:
            return False
        if pad_q and (not pad_p or g + 1 > self.groups):  # pad suffix rows need a pad group's keys
            return False
        pad_segments = sum(math.ceil(x / m) for x in (pad_p, pad_q, pad_t))
        return fp.segments + pad_segments <= self.segments

    def example(self, device: torch.device | str = "cpu") -> PackedBatch:
        """A padded batch of this exact layout (all padding): the shapes `torch.export` traces."""
        return _build(self, None, None).to(device)


_NONE = np.zeros(0, dtype=np.int64)


def _layout(batch: PackedBatch) -> HostLayout:
    """A host batch's layout (what `pack_arrays` gives for its groups), read from its metadata."""
    a = batch.attn
    cu = a.cu_seqlens.numpy().astype(np.int64)
    prefix_lens, group_q, spans = [], [], (0, 0)
    if a.has_shared_prefix:
        p, q = a.num_prefix_tokens, a.num_shared_tokens
        i, j = np.searchsorted(cu[:-1], (p, p + q))  # segments are in span order
        prefix_lens = np.diff(a.cu_prefix.numpy()).tolist()
        group_q = np.diff(a.cu_group_q.numpy()).tolist()
        spans = (int(i), int(j - i))
    return HostLayout(
        batch.input_ids.numpy(),
        batch.positions.numpy(),
        np.diff(cu),
        batch.last_index.numpy(),
        batch.seq_start.numpy(),
        batch.seq_len.numpy(),
        prefix_lens,
        group_q,
        spans,
    )


@lru_cache(maxsize=1024)  # a staged fill's padding: no list to convert on each call
def _pad_segments(n: int, m: int) -> np.ndarray:
    segs = np.array([] if n <= 0 else [m] * (n // m) + ([n % m] if n % m else []), np.int64)
    segs.flags.writeable = False  # shared by every call that pads as much
    return segs


def _build(b: Bucket, lay: HostLayout | None, batch: PackedBatch | None) -> PackedBatch:
    """`lay` (of `batch`; None: all padding) padded into `b` as a host batch (`write_padded`)."""
    arrays = {
        "input_ids": np.empty(b.tokens, dtype=np.int64),
        "positions": np.empty(b.tokens, dtype=np.int64),
        "cu_seqlens": np.empty(b.segments + 1, dtype=np.int32),
        "rows": np.empty(0 if lay is None else len(lay.last), dtype=np.int64),
    }
    if b.cascade:
        arrays["cu_prefix"] = np.empty(b.groups + 1, dtype=np.int32)
        arrays["cu_group_q"] = np.empty(b.groups + 1, dtype=np.int32)
    write_padded(b, lay, arrays)
    P, Q = b.prefix_tokens, b.shared_tokens  # (0, 0) in a plain bucket
    tensor = lambda name: torch.from_numpy(arrays[name]) if name in arrays else None
    attn = AttnInputs(
        cu_seqlens=tensor("cu_seqlens"),
        max_seqlen=b.max_seqlen,
        cu_prefix=tensor("cu_prefix"),
        cu_group_q=tensor("cu_group_q"),
        max_prefix=P,
        max_group_q=Q,
        num_prefix_tokens=P,
        num_shared_tokens=Q,
    )
    ids, pos = tensor("input_ids"), tensor("positions")
    if lay is None:
        empty = torch.zeros(0, dtype=torch.int64)
        return PackedBatch(ids, pos, attn, empty, empty, empty, [])
    start = lay.start  # a plain row's first token moves like its last; −1 (shared rows) stays
    moved = _moved(start, lay, b)
    return PackedBatch(
        ids,
        pos,
        attn,
        tensor("rows"),
        torch.from_numpy(np.where(start >= 0, moved, start)),
        batch.seq_len.clone(),
        list(batch.rows_per_group),
    )


def _moved(idx: np.ndarray, lay: HostLayout, b: Bucket) -> np.ndarray:
    """Rows of `lay`'s layout at their place in `b`'s: each moves by the padding before its
    span."""
    p, q = lay.num_prefix_tokens, lay.num_shared_tokens
    P, Q = b.prefix_tokens, b.shared_tokens  # (0, 0) in a plain bucket
    moved = idx  # no term for a span without padding (none in every plain batch; W2's suffixes
    if p != P:  # fill theirs, only its prefix span is padded)
        moved = moved + (idx >= p) * (P - p)
    if q != Q:
        moved = moved + (idx >= p + q) * (Q - q)
    return moved


def write_padded(b: Bucket, lay: HostLayout | None, out: dict[str, np.ndarray]) -> int:
    """Write `lay` padded into bucket `b` straight into `b`-sized host arrays `out` ("input_ids",
    "positions", "cu_seqlens", "rows", and in a cascade bucket "cu_prefix", "cu_group_q"): the
    values `BucketSet.pad(pack(...))` gives, without its tensors (a staged bucket's fill, issue 25:
    the host time before a small request's replay). `lay` None: all padding. Returns the number
    of rows k written to `out["rows"][:k]` (the rest is the caller's)."""
    m = b.max_seqlen
    P, Q = b.prefix_tokens, b.shared_tokens  # (0, 0) in a plain bucket
    if lay is None:
        p = q = tail = sp = sq = 0
        segs, ids_in, pos_in = _NONE, _NONE, _NONE
    else:
        sp, sq = lay.span_segments
        p, q, segs = lay.num_prefix_tokens, lay.num_shared_tokens, lay.seg_len
        ids_in, pos_in = lay.input_ids, lay.positions
        tail = len(ids_in) - p - q
    parts = [
        segs[:sp],
        _pad_segments(P - p, m),
        segs[sp : sp + sq],
        _pad_segments(Q - q, m),
        segs[sp + sq :],
        _pad_segments(b.tokens - P - Q - tail, m),
    ]
    parts = [x for x in parts if len(x)]
    segs = parts[0] if len(parts) == 1 else np.concatenate(parts)  # one: a bucket's exact fit
    cu = out["cu_seqlens"]
    cu[0] = 0
    cu[1 : len(segs) + 1] = segs.cumsum()  # the method: np.cumsum's wrapper, 1.5 µs more a fill
    cu[len(segs) + 1 :] = b.tokens
    ids, pos = out["input_ids"], out["positions"]
    start = 0  # of the span in `lay`
    for dst, n, room in ((0, p, P), (P, q, Q), (P + Q, tail, b.tokens - P - Q)):
        if room:  # none in a plain bucket's first two spans: 8 numpy calls fewer a fill there
            ids[dst : dst + n] = ids_in[start : start + n]
            pos[dst : dst + n] = pos_in[start : start + n]
            ids[dst + n : dst + room] = 0
            pos[dst + n : dst + room] = 0
        start += n
    if b.cascade:  # the pad group (and any unused group) gets the pad prefix tokens as keys
        real = lay is not None and lay.cascade
        for name, lens, fill in (("cu_prefix", "prefix_lens", P), ("cu_group_q", "group_q", Q)):
            offsets = list(accumulate(getattr(lay, lens), initial=0)) if real else [0]
            arr = out[name]
            arr[: len(offsets)] = offsets  # a few groups: cheaper in Python than through numpy
            arr[len(offsets) :] = fill
    if lay is None:
        return 0
    k = len(lay.last)
    out["rows"][:k] = _moved(lay.last, lay, b)
    return k


@dataclass
class PaddingStats:
    """Real vs padded tokens per bucket, and batches no bucket could take."""

    real_tokens: int = 0
    padded_tokens: int = 0
    batches: dict[str, int] = field(default_factory=dict)
    misses: int = 0

    @property
    def padding_fraction(self) -> float:
        return 0.0 if not self.padded_tokens else 1.0 - self.real_tokens / self.padded_tokens

    def as_dict(self) -> dict:
        return {
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_fraction": round(self.padding_fraction, 4),
            "batches": dict(self.batches),
            "misses": self.misses,
        }


_UNKNOWN = object()  # a footprint `BucketSet.smallest` has not seen
_REMEMBERED = 4096  # footprints it keeps the answer of (under a MB)


class BucketSet:
    """The buckets a runner has; `pad` picks the smallest that fits (host-side, before the copy)."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self.buckets = sorted(
            set(buckets), key=lambda b: (b.tokens, b.segments, b.max_seqlen, b.groups)
        )
        self._tokens = [b.tokens for b in self.buckets]
        self._smallest: dict[Footprint, Bucket | None] = {}  # `smallest`'s answers
        self.stats = PaddingStats()

    def __iter__(self):
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def largest(self) -> int:
        """Most tokens any bucket takes (0 for an empty set)."""
        return self._tokens[-1] if self.buckets else 0

    def smallest(self, fp: Footprint) -> Bucket | None:
        """The first bucket (tokens, then segments) that a batch of footprint `fp` fits, or None."""
        # remembered per footprint (immutable, hashable): a small request's staged path asks once
        # a call (W3's pieces 54.7 µs on the H100 host, BENCHMARKS.md forty-second session), the
        # cut of a large one many times; bounded, as a server's footprints are many
        bucket = self._smallest.get(fp, _UNKNOWN)
        if bucket is _UNKNOWN:
            first = bisect.bisect_left(self._tokens, fp.tokens)
            bucket = next((b for b in self.buckets[first:] if b.fits(fp)), None)
            if len(self._smallest) >= _REMEMBERED:
                self._smallest.clear()
            self._smallest[fp] = bucket
        return bucket

    def choose(self, batch: PackedBatch) -> Bucket | None:
        return self.smallest(batch.footprint)

    def pad(
        self, batch: PackedBatch, lay: HostLayout | None = None
    ) -> tuple[Bucket | None, PackedBatch]:
        """(bucket, padded CPU batch), or (None, batch) when no bucket fits (caller runs eager).
        `lay`: the batch's host layout where the caller has it (`pack_arrays`, `batch_of`), else
        it is read back from the batch."""
        bucket = self.smallest(batch.footprint)
        if bucket is None:
            self.stats.misses += 1
            return None, batch
        self.count(bucket, batch.num_tokens)
        return bucket, _build(bucket, lay if lay is not None else _layout(batch), batch)

    def count(self, bucket: Bucket, tokens: int) -> None:
        """Count a batch of `tokens` real tokens padded into `bucket` (`pad`, or a caller that
        wrote the padded layout itself: `write_padded`)."""
        self.stats.real_tokens += tokens
        self.stats.padded_tokens += bucket.tokens
        self.stats.batches[bucket.name] = self.stats.batches.get(bucket.name, 0) + 1


def ladder(max_batch_tokens: int = 8192, smallest: int = 64) -> list[int]:
    """Bucket sizes: powers of two from `smallest` to 1024, then 1.5x rungs (1536, 2048, 3072,
    4096, 6144, ...), and `max_batch_tokens` itself. A forward's GPU time has a floor (64 tokens:
    1.0 ms, 8,192 tokens: ~14 ms on the H200, DESIGN §12), so padding a small bucket costs little;
    in large ones it costs its share, and the half-rungs halve a remainder's padding there."""
    out, t = [], smallest
    while t < max_batch_tokens:
        out.append(t)
        if t >= 1024 and t * 3 // 2 < max_batch_tokens:
            out.append(t * 3 // 2)
        t *= 2
    return out + [max_batch_tokens]


def default_buckets(max_batch_tokens: int = 8192, smallest: int = 64) -> list[Bucket]:
    """Plain buckets at the `ladder` sizes (`t{T}`: T/32 segments of ≤ 512 tokens)."""
    return [Bucket.parse(f"t{t}") for t in ladder(max_batch_tokens, smallest)]


def parse_buckets(specs: str | list[str] | None, max_batch_tokens: int = 8192) -> list[Bucket]:
    if specs is None:
        return default_buckets(max_batch_tokens)
    if isinstance(specs, str):
        specs = [s for s in re.split(r"[,\s]+", specs) if s]
    return [s if isinstance(s, Bucket) else Bucket.parse(s) for s in specs]
