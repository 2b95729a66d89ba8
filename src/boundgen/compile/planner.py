"""Plan the buckets to compile from typical traffic, and predict their padding.

Traffic is a list of forwards, each the groups one packed forward takes, as lengths. It comes from a
profile of typical requests (`load_profile`) or from the shapes a server logged (`load_traffic`).
The plan (`plan`):

1. every forward is cut by `compile.chunking` against ideal buckets: plain pieces get the smallest
   `ladder` size that holds them, shared-prefix pieces a cascade bucket sized to them (each span
   rounded up to `align` tokens, one spare group and one spare prefix token for the pad rows);
2. the plain buckets are the ladder sizes from the smallest to the largest one used, their
   segments and longest segment taken from the pieces; the cascade buckets are merged, cheapest
   merge first (padded tokens added, weighted by how often each piece occurs), down to
   `max_cascade_buckets`;
3. every forward is cut again against the final buckets: the predicted padding is what
   `BucketSet.pad` will count for those pieces.

Profile (JSON list; `count`: up to that many such requests are merged into one forward by the
batching node, and every merge level 1..count is planned, each counted once):

    [{"kind": "score", "query_tokens": 256, "items": 100, "item_tokens": 16, "count": 10},
     {"kind": "score", "query_tokens": 64, "items": 20, "item_tokens": 32, "item_first": true},
     {"kind": "embed", "texts": [64, 128]},          # also "classify"
     {"kind": "beam", "prompt_tokens": 128, "width": 16, "steps": 4, "count": 8}]

A beam entry plans its prompt prefill (plain, one row per prompt); its decode steps have fixed
shapes (B·W rows) and need no bucket. Traffic (JSON lines, one record per forward, see
`docs/compile.md` for what the server logs):

    {"groups": [[256, [16, 16, 17]], [0, [120, 88]]], "share_prefix": true, "kind": "score"}
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from boundgen.compile.buckets import Bucket, BucketSet, PaddingStats, ladder
from boundgen.compile.chunking import chunk, predicted_stats
from boundgen.text.packing import Footprint, SequenceGroup


@dataclass(frozen=True)
class Forward:
    """The groups of one packed forward as lengths: (prefix length, suffix lengths) per group."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    share_prefix: bool = True

    def sequence_groups(self) -> list[SequenceGroup]:
        # NOTE: `range(n)` stands in for a token list of length n: the planner only reads lengths
        # (and `pack` accepts it), so big traffic files cost no token lists
        return [SequenceGroup(range(p), [range(n) for n in s]) for p, s in self.groups]


@dataclass
class Entry:
    """One line of the plan's report: a profile entry or one kind of logged traffic."""

    label: str
    forwards: dict[Forward, int] = field(default_factory=dict)  # forward → how often

    def add(self, forward: Forward, weight: int = 1) -> None:
        self.forwards[forward] = self.forwards.get(forward, 0) + weight


# -- inputs
# --------------------------------------------------------------------------------------------
_PROFILE_KEYS = {
    "score": ({"query_tokens", "items", "item_tokens"}, {"count", "item_first"}),
    "embed": ({"texts"}, {"count"}),
    "classify": ({"texts"}, {"count"}),
    # "trie" names a server trie (used by warm-up, see boundgen.warmup; the plan ignores it)
    "beam": ({"prompt_tokens"}, {"count", "width", "steps", "trie"}),
}


def _positive(where: str, name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: '{name}' must be an integer ≥ 1, got {value!r}")
    return value


def profile_entries(profile: list[dict]) -> list[Entry]:
    """Entries of a profile (see the module docstring), with their forwards at every merge level."""
    if not isinstance(profile, list) or not profile:
        raise ValueError("a profile is a non-empty JSON list of request shapes")
    entries = []
    for i, item in enumerate(profile):
        where = f"profile entry {i}"
        kind = item.get("kind") if isinstance(item, dict) else None
        if kind not in _PROFILE_KEYS:
            raise ValueError(f"{where}: 'kind' must be one of {', '.join(_PROFILE_KEYS)}")
        required, optional = _PROFILE_KEYS[kind]
        keys = set(item) - {"kind"}
        if required - keys or keys - required - optional:
            raise ValueError(
                f"{where} ({kind}): needs {sorted(required)}, may have {sorted(optional)}; "
                f"got {sorted(keys)}"
            )
        count = _positive(where, "count", item.get("count", 1))
        if kind == "score":
            q = _positive(where, "query_tokens", item["query_tokens"])
            n = _positive(where, "items", item["items"])
            t = _positive(where, "item_tokens", item["item_tokens"])
            if item.get("item_first", False):
                group, label = (0, (t + q,) * n), f"score {n}x({t}+{q})"
            else:
                group, label = (q, (t,) * n), f"score {q}+{n}x{t}"
            share = True
        elif kind in ("embed", "classify"):
            texts = item["texts"]
            if not isinstance(texts, list) or not texts:
                raise ValueError(f"{where}: 'texts' must be a non-empty list of token counts")
            lens = tuple(_positive(where, "texts", n) for n in texts)
            group, label, share = (0, lens), f"{kind} {len(lens)} texts, {sum(lens)} tokens", True
        else:
            for name in ("width", "steps"):
                _positive(where, name, item.get(name, 1))
            p = _positive(where, "prompt_tokens", item["prompt_tokens"])
            group, label, share = (0, (p,)), f"beam prompt {p}", False
        entry = Entry(label + (f" (merged 1..{count})" if count > 1 else ""))
        for k in range(1, count + 1):
            if kind == "beam":  # k prompts are one group of k rows
                entry.add(Forward(((0, group[1] * k),), share))
            else:
                entry.add(Forward((group,) * k, share))
        entries.append(entry)
    return entries


def load_profile(path: str | Path) -> list[Entry]:
    return profile_entries(json.loads(Path(path).read_text()))


def traffic_entries(lines) -> list[Entry]:
    """Entries of logged traffic (JSON lines, see the module docstring), one per `kind`."""
    by_kind: dict[str, Entry] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"traffic line {number}"
        try:
            record = json.loads(line)
            groups = tuple(
                (int(p), tuple(int(n) for n in suffixes)) for p, suffixes in record["groups"]
            )
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(
                f'{where}: expected {{"groups": [[prefix_len, [suffix_len, ...]], ...]}} ({exc})'
            ) from None
        if not groups or any(p < 0 or min(s, default=1) < 0 for p, s in groups):
            raise ValueError(f"{where}: needs at least one group and lengths ≥ 0")
        kind = str(record.get("kind", "traffic"))
        share = bool(record.get("share_prefix", True))
        by_kind.setdefault(kind, Entry(kind)).add(Forward(groups, share))
    if not by_kind:
        raise ValueError("the traffic file has no records")
    return list(by_kind.values())


def load_traffic(path: str | Path) -> list[Entry]:
    with open(path) as f:
        return traffic_entries(f)


# -- deriving buckets
# ----------------------------------------------------------------------------------
def _up(n: int, step: int) -> int:
    return -(-n // step) * step


def _segments_padded(fp: Footprint, spans: tuple[int, int, int], m: int) -> int:
    """Segments a piece of footprint `fp` takes in a bucket of spans (P, Q, tail) and max len m."""
    p, q = (fp.prefix_tokens, fp.shared_tokens) if fp.cascade else (0, 0)
    pads = (spans[0] - p, spans[1] - q, spans[2] - (fp.tokens - p - q))
    return fp.segments + sum(math.ceil(x / m) for x in pads)


@dataclass
class _Shape:
    """A cascade bucket in the making: its spans and the pieces (footprint, weight) it takes."""

    prefix: int
    shared: int
    tail: int
    groups: int
    max_seqlen: int
    members: list[tuple[Footprint, int]]

    @property
    def tokens(self) -> int:
        return self.prefix + self.shared + self.tail

    @property
    def cost(self) -> int:
        return self.tokens * sum(w for _, w in self.members)

    def merged(self, other: _Shape) -> _Shape:
        return _Shape(
            max(self.prefix, other.prefix),
            max(self.shared, other.shared),
            max(self.tail, other.tail),
            max(self.groups, other.groups),
            max(self.max_seqlen, other.max_seqlen),
            self.members + other.members,
        )

    def bucket(self) -> Bucket:
        spans = (self.prefix, self.shared, self.tail)
        segments = max(_segments_padded(fp, spans, self.max_seqlen) for fp, _ in self.members)
        return Bucket(
            self.tokens, _up(segments, 8), self.max_seqlen, self.groups, self.prefix, self.shared
        )


def _longest_segment(longest: int, tokens: int, align: int) -> int:
    """A bucket's max_seqlen: as `Bucket.parse` (512, at most the bucket) or the longest seen."""
    return min(tokens, max(512, _up(longest, align)))


def _cascade_shape(fp: Footprint, align: int) -> _Shape:
    # one spare prefix token and group: the pad suffix rows of a bucket attend to a pad prefix
    p, q, tail = (_up(n, align) for n in (fp.prefix_tokens + 1, fp.shared_tokens, fp.plain_tokens))
    m = _longest_segment(fp.max_seqlen, p + q + tail, align)
    return _Shape(p, q, tail, fp.groups + 1, m, [])


@dataclass
class _Ideal:
    """Buckets made to measure (chunking's `Buckets`): the ladder size for a plain piece, a cascade
    bucket sized to a shared-prefix piece; None above `largest` tokens."""

    sizes: list[int]
    largest: int
    align: int

    def smallest(self, fp: Footprint) -> Bucket | None:
        if fp.cascade:
            b = _cascade_shape(fp, self.align)
            if b.tokens > self.largest:
                return None
            return Bucket(b.tokens, b.tokens, b.tokens, b.groups, b.prefix, b.shared)
        t = next((t for t in self.sizes if t >= fp.tokens), None)
        return None if t is None else Bucket(t, t, t)


def _merge(shapes: list[_Shape], limit: int, largest: int) -> list[_Shape]:
    """Merge shapes, cheapest first (padded tokens added × weight), until at most `limit` remain;
    a merge over `largest` tokens is never made: when none is left, the least used shape goes
    (its pieces are then cut to fit the others)."""
    alive = dict(enumerate(shapes))
    heap = []

    def push(i: int, j: int) -> None:
        a, b = alive[i], alive[j]
        merged = a.merged(b)
        if merged.tokens <= largest:
            heapq.heappush(heap, (merged.cost - a.cost - b.cost, i, j))

    for i in alive:
        for j in alive:
            if i < j:
                push(i, j)
    next_id = len(shapes)
    while len(alive) > limit:
        if not heap:
            del alive[min(alive, key=lambda k: alive[k].cost)]
            continue
        _, i, j = heapq.heappop(heap)
        if i not in alive or j not in alive:
            continue
        alive[next_id] = alive.pop(i).merged(alive.pop(j))
        for k in list(alive)[:-1]:
            push(k, next_id)
        next_id += 1
    return list(alive.values())


@dataclass
class Plan:
    buckets: list[Bucket]
    entries: list[tuple[str, PaddingStats, int]]  # label, predicted padding, forwards
    overall: PaddingStats

    def report(self) -> str:
        rows = [("traffic", "forwards", "real tokens", "padded", "padding", "misses")]
        for label, s, n in [*self.entries, ("overall", self.overall, self.forwards)]:
            rows.append(
                (
                    label,
                    str(n),
                    str(s.real_tokens),
                    str(s.padded_tokens),
                    f"{100 * s.padding_fraction:.1f} %",
                    str(s.misses),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(len(lines) - 1, lines[1])
        per_bucket = ", ".join(f"{b}: {n}" for b, n in self.overall.batches.items())
        lines += [
            f"pieces per bucket: {per_bucket}",
            f"{len(self.buckets)} buckets: --buckets {','.join(b.name for b in self.buckets)}",
        ]
        return "\n".join(lines)

    @property
    def forwards(self) -> int:
        return sum(n for _, _, n in self.entries)


def predict(entries: list[Entry], buckets: list[Bucket], max_tokens: int) -> Plan:
    """The padding `BucketSet.pad` will count when each entry's forwards are chunked into these
    buckets (weighted by how often each forward occurs)."""
    bucket_set = BucketSet(buckets)
    rows, overall = [], PaddingStats()
    for entry in entries:
        stats = PaddingStats()
        for forward, weight in entry.forwards.items():
            pieces = chunk(forward.sequence_groups(), max_tokens, bucket_set, forward.share_prefix)
            s = predicted_stats(pieces)
            for total in (stats, overall):
                total.real_tokens += weight * s.real_tokens
                total.padded_tokens += weight * s.padded_tokens
                total.misses += weight * s.misses
                for name, n in s.batches.items():
                    total.batches[name] = total.batches.get(name, 0) + weight * n
        rows.append((entry.label, stats, sum(entry.forwards.values())))
    return Plan(list(bucket_set), rows, overall)


def plan(
    entries: list[Entry],
    max_tokens: int,
    max_bucket_tokens: int = 8192,
    max_cascade_buckets: int = 8,
    align: int = 64,
) -> Plan:
    """Buckets for this traffic (see the module docstring) and the padding they give it.
    `max_tokens`: the engine's batch token budget; `max_bucket_tokens`: the largest bucket."""
    if max_bucket_tokens < align:
        raise ValueError(f"max_bucket_tokens ({max_bucket_tokens}) must be ≥ align ({align})")
    if max_cascade_buckets < 0:
        raise ValueError(f"max_cascade_buckets must be ≥ 0, got {max_cascade_buckets}")
    sizes = ladder(max_bucket_tokens)
    ideal = _Ideal(sizes, max_bucket_tokens, align)
    plain: dict[int, list[Footprint]] = {}  # ladder size → its pieces
    cascade: dict[tuple, _Shape] = {}
    for entry in entries:
        for forward, weight in entry.forwards.items():
            groups = forward.sequence_groups()
            for piece in chunk(groups, max_tokens, ideal, forward.share_prefix):
                fp = piece.footprint
                if piece.bucket is None:
                    continue
                if not fp.cascade:
                    plain.setdefault(piece.bucket.tokens, []).append(fp)
                    continue
                shape = _cascade_shape(fp, align)
                key = (shape.prefix, shape.shared, shape.tail, shape.groups, shape.max_seqlen)
                cascade.setdefault(key, shape).members.append((fp, weight))
    buckets = []
    if plain:
        longest = max(fp.max_seqlen for fps in plain.values() for fp in fps)
        for t in (t for t in sizes if min(plain) <= t <= max(plain)):
            m = _longest_segment(longest, t, align)
            need = [_segments_padded(fp, (0, 0, t), m) for fp in plain.get(t, [])]
            buckets.append(Bucket(t, _up(max([max(4, t // 32), *need]), 8), m))
    merged = _merge(list(cascade.values()), max_cascade_buckets, max_bucket_tokens)
    buckets += [s.bucket() for s in merged]
    return predict(entries, buckets, max_tokens)
