"""Fidelity gate: does an FP8 policy rank and decode like the bf16 model?

On a fixed, deterministic evaluation set (W1/W2/W4-style inputs from DESIGN §9 plus a held-out set)
the candidate's outputs are compared with the reference's:
- score Spearman (per ranking group, mean per set) ≥ 0.995
- top-10 overlap (per ranking group, mean per set) ≥ 0.95
- beam top-1 agreement (all beam prompts) ≥ 0.98
The gate only needs a few small callables per model (`GateCallables`), so it runs against an
`Engine` (see `engine_callables`) or anything else with the same shape:
    score(query_ids, items_ids, label_token_ids) -> [[label score per label] per item]   (logits)
    beam(prompt_ids, beam_width, steps) -> [(tokens, logprob), ...] best first
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from boundgen.quant.fp8 import fp8_swapped
from boundgen.quant.policy import parse_policy, select_modules

ScoreFn = Callable[[list[int], list[list[int]], list[int]], Sequence[Sequence[float]]]
BeamFn = Callable[[list[int], int, int], Sequence]


@dataclass(frozen=True)
class GateThresholds:
    spearman: float = 0.995
    topk_overlap: float = 0.95
    beam_top1: float = 0.98
    k: int = 10


# -------------------------------------------------------------------------------------------------
# Metrics (numpy only)


def rankdata(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n with ties averaged (as scipy.stats.rankdata 'average')."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    sorted_a = a[order]
    ranks = np.empty(len(a), dtype=np.float64)
    # boundaries of runs of equal values
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    ends = np.r_[starts[1:], len(a)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # mean of ranks s+1..e
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson on average ranks). Two constant vectors correlate 1."""
    if len(a) != len(b):
        raise ValueError(f"spearman: lengths differ ({len(a)} vs {len(b)})")
    if len(a) < 2:
        return 1.0
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    denom = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    if denom == 0.0:
        return 1.0 if np.array_equal(ra, rb) else 0.0
    return float((ra * rb).sum() / denom)


def topk_overlap(ref: Sequence[float], cand: Sequence[float], k: int = 10) -> float:
    """|top-k(ref) ∩ top-k(cand)| / k (k capped at the group size); highest score first."""
    k = min(k, len(ref))
    if k == 0:
        return 1.0
    top_ref = set(np.argsort(-np.asarray(ref, dtype=np.float64), kind="mergesort")[:k].tolist())
    top_cand = set(np.argsort(-np.asarray(cand, dtype=np.float64), kind="mergesort")[:k].tolist())
    return len(top_ref & top_cand) / k


def ranking_score(label_scores: Sequence[float]) -> float:
    """One ranking value per item from its label log-scores (logits, or log-probabilities under the
    full vocabulary: the same value for several labels): log-softmax of the first label over the
    labels (monotonic in P(first label), e.g. P("yes") against "no"); the score itself for a single
    label."""
    s = np.asarray(label_scores, dtype=np.float64)
    if s.size == 1:
        return float(s[0])
    m = s.max()
    return float(s[0] - (m + math.log(np.exp(s - m).sum())))


# -------------------------------------------------------------------------------------------------
# Evaluation set


@dataclass(frozen=True)
class ScoreCase:
    """One ranking group: `query` shared by `items`; an empty query means independent prompts."""

    set_name: str
    query: list[int]
    items: list[list[int]]
    label_token_ids: list[int]


@dataclass(frozen=True)
class BeamCase:
    set_name: str
    prompt: list[int]
    beam_width: int
    steps: int


@dataclass
class EvalSet:
    name: str
    score_cases: list[ScoreCase] = field(default_factory=list)
    beam_cases: list[BeamCase] = field(default_factory=list)

    def extend(self, other: EvalSet) -> EvalSet:
        return EvalSet(
            f"{self.name}+{other.name}",
            self.score_cases + other.score_cases,
            self.beam_cases + other.beam_cases,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "score_cases": [dataclasses.asdict(c) for c in self.score_cases],
                "beam_cases": [dataclasses.asdict(c) for c in self.beam_cases],
            }
        )

    def fit(self, max_len: int | None) -> EvalSet:
        """Trim sequences to a model's length limit (query + item ≤ max_len, prompt + steps ≤
        max_len), keeping the last tokens of queries/prompts; unchanged when everything fits or
        max_len is None."""
        if not max_len:
            return self
        cases = []
        for c in self.score_cases:
            items = [x[:max_len] for x in c.items]
            longest = max((len(x) for x in items), default=0)
            room = max(max_len - longest, 0)
            query = c.query[len(c.query) - room :] if len(c.query) > room else c.query
            cases.append(dataclasses.replace(c, query=list(query), items=items))
        beams = []
        for b in self.beam_cases:
            room = max(max_len - b.steps, 1)
            beams.append(dataclasses.replace(b, prompt=list(b.prompt[-room:])))
        return EvalSet(self.name, cases, beams)

    @classmethod
    def from_json(cls, text: str) -> EvalSet:
        d = json.loads(text)
        return cls(
            d.get("name", "custom"),
            [ScoreCase(**c) for c in d.get("score_cases", [])],
            [BeamCase(**c) for c in d.get("beam_cases", [])],
        )

    @classmethod
    def from_demo_dir(
        cls,
        model_dir: str | Path,
        encode: Callable[[str], list[int]],
        groups: int = 80,
        prompts: int = 100,
        beam_width: int = 10,
    ) -> EvalSet | None:
        """The held-out set shipped with a demo checkpoint (`eval.json` + `demo.json` +
        `catalog.json`, see boundgen.demo): relevance groups scored per query and pooled over all
        (query, item) pairs, and retrieval prompts decoded with `sid_levels` unconstrained beam
        steps. None if absent."""
        model_dir = Path(model_dir)
        files = [model_dir / n for n in ("eval.json", "demo.json", "catalog.json")]
        if not all(f.is_file() for f in files):
            return None
        ev, meta, catalog = (json.loads(f.read_text()) for f in files)
        t = meta["templates"]
        labels = list(meta["label_token_ids"])
        titles = {int(it["item_id"]): it["title"] for it in catalog["items"]}
        cases, pooled = [], []
        for g in ev.get("relevance", [])[:groups]:
            query = encode(t["relevance_query"].format(query=g["query"]))
            items = [
                encode(t["relevance_item"].format(title=titles[int(c["item_id"])]))
                for c in g["candidates"]
            ]
            cases.append(ScoreCase("demo", query, items, labels))
            pooled += [query + item for item in items]
        if pooled:
            cases.append(ScoreCase("demo-pooled", [], pooled, labels))
        beams = [
            BeamCase(
                "demo",
                encode(t["retrieval"].format(query=q["query"])),
                beam_width,
                int(meta.get("sid_levels", 3)),
            )
            for q in ev.get("retrieval", [])[:prompts]
        ]
        return cls(f"demo:{model_dir.name}", cases, beams)

    @classmethod
    def load(cls, path: str | Path) -> EvalSet:
        """A held-out set saved with `to_json` (e.g. a model's real queries, as token ids)."""
        return cls.from_json(Path(path).read_text())


# Sizes per scale: "full" is DESIGN §9's shapes (GPU), "small" keeps CPU runs to seconds on tiny
# models.
_SCALES = {
    "full": dict(
        w1_prompts=256,
        w1_len=(64, 256),
        w2_groups=8,
        w2_prefix=256,
        w2_items=100,
        w2_item_len=16,
        w4_prompts=100,
        w4_len=128,
        w4_width=16,
        w4_steps=4,
        ho_groups=6,
        ho_prefix=(64, 192),
        ho_items=50,
        ho_item_len=(8, 24),
        ho_beams=50,
    ),
    "small": dict(
        w1_prompts=32,
        w1_len=(8, 32),
        w2_groups=3,
        w2_prefix=24,
        w2_items=20,
        w2_item_len=4,
        w4_prompts=12,
        w4_len=16,
        w4_width=4,
        w4_steps=3,
        ho_groups=2,
        ho_prefix=(8, 24),
        ho_items=16,
        ho_item_len=(2, 6),
        ho_beams=6,
    ),
    "ci": dict(
        w1_prompts=8,
        w1_len=(4, 12),
        w2_groups=1,
        w2_prefix=8,
        w2_items=8,
        w2_item_len=3,
        w4_prompts=3,
        w4_len=6,
        w4_width=2,
        w4_steps=2,
        ho_groups=1,
        ho_prefix=(4, 8),
        ho_items=6,
        ho_item_len=(2, 4),
        ho_beams=1,
    ),
}


def default_label_ids(vocab_size: int) -> list[int]:
    """Two fixed label tokens (stand-ins for "yes"/"no") when the caller has none."""
    return [vocab_size // 3, (2 * vocab_size) // 3]


def make_eval_set(
    vocab_size: int,
    label_token_ids: Sequence[int] | None = None,
    scale: str = "full",
    seed: int = 0,
) -> EvalSet:
    """W1 (independent prompts), W2 (shared prefix + candidates), W4 (beam) inputs and a held-out
    set.

    Deterministic in (vocab_size, labels, scale, seed). W1-W4 draw token ids uniformly; the
    held-out set uses a different seed, Zipf-like token ids and other shapes, so a policy is not
    tuned to one shape.
    """
    if scale not in _SCALES:
        raise ValueError(f"unknown eval scale {scale!r}; choose from {list(_SCALES)}")
    p = _SCALES[scale]
    labels = list(label_token_ids) if label_token_ids else default_label_ids(vocab_size)
    rng = np.random.default_rng(seed)

    def uniform(n: int) -> list[int]:
        return rng.integers(0, vocab_size, size=n).tolist()

    cases: list[ScoreCase] = []
    lo, hi = p["w1_len"]
    w1_items = [uniform(int(rng.integers(lo, hi + 1))) for _ in range(p["w1_prompts"])]
    cases.append(ScoreCase("W1", [], w1_items, labels))
    for _ in range(p["w2_groups"]):
        cases.append(
            ScoreCase(
                "W2",
                uniform(p["w2_prefix"]),
                [uniform(p["w2_item_len"]) for _ in range(p["w2_items"])],
                labels,
            )
        )
    beams = [
        BeamCase("W4", uniform(p["w4_len"]), p["w4_width"], p["w4_steps"])
        for _ in range(p["w4_prompts"])
    ]

    held = np.random.default_rng(seed + 1_000_003)
    weights = 1.0 / np.arange(1, vocab_size + 1) ** 1.1
    weights /= weights.sum()
    perm = held.permutation(vocab_size)

    def zipf(n: int) -> list[int]:
        return perm[held.choice(vocab_size, size=n, p=weights)].tolist()

    for _ in range(p["ho_groups"]):
        plo, phi = p["ho_prefix"]
        ilo, ihi = p["ho_item_len"]
        cases.append(
            ScoreCase(
                "heldout",
                zipf(int(held.integers(plo, phi + 1))),
                [zipf(int(held.integers(ilo, ihi + 1))) for _ in range(p["ho_items"])],
                labels,
            )
        )
    for _ in range(p["ho_beams"]):
        beams.append(
            BeamCase(
                "heldout",
                zipf(int(held.integers(p["w4_len"] // 2, p["w4_len"] + 1))),
                p["w4_width"],
                p["w4_steps"],
            )
        )
    return EvalSet(f"{scale}-seed{seed}", cases, beams)


# -------------------------------------------------------------------------------------------------
# Running


@dataclass
class GateCallables:
    """The callables the gate needs from one model configuration (bf16 or an FP8 policy)."""

    score: ScoreFn
    beam: BeamFn | None = None
    # (prompts, beam_width, steps) -> one beam list per prompt; used instead of `beam` when given
    beam_batch: Callable[[list[list[int]], int, int], Sequence] | None = None


def engine_callables(engine) -> GateCallables:
    """`Engine.score(query, items, label_token_ids)` and `Engine.beam_search_batch(prompts,
    beam_width, steps)` as the gate's callables."""

    def score(query, items, labels):
        # Engine.score gives each label's probability under the full vocabulary; its log is the
        # label logit minus the row's log-sum-exp, so `ranking_score` ranks as on the logits
        # (a probability that underflows float32 becomes the smallest normal's log, not -inf)
        probs = engine.score(query, items, label_token_ids=labels)
        tiny = np.finfo(np.float32).tiny
        return np.log(np.maximum(np.asarray(probs, dtype=np.float64), tiny)).tolist()

    def beam_batch(prompts, width, steps):
        return engine.beam_search_batch(prompts, beam_width=width, steps=steps)

    return GateCallables(score, beam_batch=beam_batch)


def _top1_tokens(beams: Sequence) -> list[int]:
    """Token ids of the best beam of one result ([] when there is none)."""
    return [int(t) for t in beams[0][0]] if len(beams) else []


@dataclass
class EvalOutputs:
    scores: list[list[float]]  # per score case: one ranking value per item
    beams: list[list[int] | None]  # per beam case: top-1 tokens (None when no beam callable)


def collect_outputs(
    model: GateCallables, eval_set: EvalSet, beam_batch_size: int = 16
) -> EvalOutputs:
    scores = []
    for case in eval_set.score_cases:
        out = model.score(case.query, case.items, case.label_token_ids)
        if len(out) != len(case.items):
            raise RuntimeError(f"score returned {len(out)} rows for {len(case.items)} items")
        scores.append([ranking_score(row) for row in out])
    beams: list[list[int] | None] = [None] * len(eval_set.beam_cases)
    if model.beam_batch is not None:
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, case in enumerate(eval_set.beam_cases):
            shapes.setdefault((case.beam_width, case.steps), []).append(i)
        for (width, steps), idx in shapes.items():
            for start in range(0, len(idx), beam_batch_size):
                chunk = idx[start : start + beam_batch_size]
                results = model.beam_batch(
                    [eval_set.beam_cases[i].prompt for i in chunk], width, steps
                )
                for i, result in zip(chunk, results):
                    beams[i] = _top1_tokens(result)
    elif model.beam is not None:
        for i, case in enumerate(eval_set.beam_cases):
            beams[i] = _top1_tokens(model.beam(case.prompt, case.beam_width, case.steps))
    return EvalOutputs(scores, beams)


@dataclass
class SetReport:
    name: str
    groups: int = 0
    items: int = 0
    spearman_mean: float | None = None
    spearman_min: float | None = None
    topk_mean: float | None = None
    topk_min: float | None = None
    max_abs_diff: float | None = None
    beams: int = 0
    beam_top1: float | None = None


@dataclass
class GateReport:
    policy: str
    passed: bool
    thresholds: GateThresholds
    sets: list[SetReport]
    beam_top1: float | None
    failures: list[str]
    eval_set: str = ""
    notes: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        t = self.thresholds
        lines = [
            f"FP8 fidelity gate: policy={self.policy} eval={self.eval_set} "
            f"-> {'PASS' if self.passed else 'FAIL'}",
            f"  thresholds: spearman >= {t.spearman}, top-{t.k} overlap >= {t.topk_overlap}, "
            f"beam top-1 >= {t.beam_top1}",
            f"  {'set':<10} {'groups':>6} {'items':>6} {'spearman':>17} {'top-k overlap':>17} "
            f"{'max|d|':>8} {'beams':>5} {'top-1':>6}",
        ]

        def f(x, spec=".4f"):
            return "-" if x is None else format(x, spec)

        for s in self.sets:
            lines.append(
                f"  {s.name:<10} {s.groups:>6} {s.items:>6} "
                f"{f(s.spearman_mean) + ' (min ' + f(s.spearman_min, '.3f') + ')':>17} "
                f"{f(s.topk_mean) + ' (min ' + f(s.topk_min, '.2f') + ')':>17} "
                f"{f(s.max_abs_diff, '.3g'):>8} {s.beams:>5} {f(s.beam_top1, '.3f'):>6}"
            )
        lines.append(f"  beam top-1 agreement (all): {f(self.beam_top1)}")
        for k, v in self.notes.items():
            lines.append(f"  {k}: {v}")
        for msg in self.failures:
            lines.append(f"  FAIL: {msg}")
        return "\n".join(lines)


def compare_outputs(
    ref: EvalOutputs,
    cand: EvalOutputs,
    eval_set: EvalSet,
    policy: str,
    thresholds: GateThresholds = GateThresholds(),
) -> GateReport:
    by_set: dict[str, SetReport] = {}
    per_set: dict[str, dict[str, list[float]]] = {}
    for case, r, c in zip(eval_set.score_cases, ref.scores, cand.scores):
        rep = by_set.setdefault(case.set_name, SetReport(case.set_name))
        acc = per_set.setdefault(case.set_name, {"rho": [], "top": [], "diff": []})
        rep.groups += 1
        rep.items += len(r)
        acc["rho"].append(spearman(r, c))
        acc["top"].append(topk_overlap(r, c, thresholds.k))
        acc["diff"].append(float(np.max(np.abs(np.subtract(r, c)))) if r else 0.0)
    failures = []
    for name, acc in per_set.items():
        rep = by_set[name]
        rep.spearman_mean, rep.spearman_min = float(np.mean(acc["rho"])), float(np.min(acc["rho"]))
        rep.topk_mean, rep.topk_min = float(np.mean(acc["top"])), float(np.min(acc["top"]))
        rep.max_abs_diff = float(np.max(acc["diff"]))
        if rep.spearman_mean < thresholds.spearman:
            failures.append(
                f"{name}: score Spearman {rep.spearman_mean:.4f} < {thresholds.spearman}"
            )
        if rep.topk_mean < thresholds.topk_overlap:
            failures.append(
                f"{name}: top-{thresholds.k} overlap {rep.topk_mean:.3f} < "
                f"{thresholds.topk_overlap}"
            )

    agree_all: list[bool] = []
    for case, r, c in zip(eval_set.beam_cases, ref.beams, cand.beams):
        if r is None or c is None:
            continue
        rep = by_set.setdefault(case.set_name, SetReport(case.set_name))
        rep.beams += 1
        rep.beam_top1 = (rep.beam_top1 or 0.0) + float(r == c)
        agree_all.append(r == c)
    for rep in by_set.values():
        if rep.beams:
            rep.beam_top1 /= rep.beams
    beam_top1 = float(np.mean(agree_all)) if agree_all else None
    notes = {}
    if eval_set.beam_cases and beam_top1 is None:
        notes["beam"] = "not checked (no beam_search callable)"
    if beam_top1 is not None and beam_top1 < thresholds.beam_top1:
        failures.append(
            f"beam top-1 agreement {beam_top1:.3f} < {thresholds.beam_top1} "
            f"({sum(agree_all)}/{len(agree_all)} prompts)"
        )
    if not per_set:
        failures.append("no score cases were evaluated")
    return GateReport(
        policy,
        not failures,
        thresholds,
        list(by_set.values()),
        beam_top1,
        failures,
        eval_set.name,
        notes,
    )


def gate_engine(
    engine,
    policies: Sequence[str],
    eval_set: EvalSet,
    *,
    emulate: bool = False,
    act_quant: str = "auto",
    thresholds: GateThresholds = GateThresholds(),
    log: Callable[[str], None] | None = None,
    reference_outputs: EvalOutputs | None = None,
) -> dict[str, GateReport]:
    """Run the gate for each policy on one loaded (bf16) engine, keyed by canonical policy name:
    the reference outputs are collected once, then each policy is applied in place to
    `engine.model`, measured, and undone (original modules restored).

    The engine must run its model eagerly: captured CUDA graphs or compiled buckets would replay
    the bf16 kernels whatever modules the policy swaps in (ValueError otherwise)."""
    backend = engine.runner.backend_name
    if backend != "eager":
        raise ValueError(
            f"the gate swaps FP8 modules into the engine's model in place, but its runner is "
            f"{backend!r}, which would not run them: load the engine with backend='eager'"
        )
    model = engine.model
    callables = engine_callables(engine)
    t0 = time.perf_counter()
    ref = (
        reference_outputs if reference_outputs is not None else collect_outputs(callables, eval_set)
    )
    ref_s = time.perf_counter() - t0
    if log:
        log(
            f"reference outputs: {len(eval_set.score_cases)} score groups, "
            f"{len(eval_set.beam_cases)} beam prompts in {ref_s:.1f}s"
        )
    reports = {}
    for policy in policies:
        name = parse_policy(policy).name
        with fp8_swapped(model, select_modules(model, name), emulate=emulate, act_quant=act_quant):
            t0 = time.perf_counter()
            cand = collect_outputs(callables, eval_set)
        report = compare_outputs(ref, cand, eval_set, name, thresholds)
        report.notes["mode"] = "emulated" if emulate else "scaled_mm"
        report.notes["eval_seconds"] = f"bf16 {ref_s:.1f}, {name} {time.perf_counter() - t0:.1f}"
        reports[name] = report
        if log:
            log(report.format())
    return reports


def gate_eval_set(
    engine,
    model_dir: str | Path,
    *,
    scale: str | None = None,
    seed: int = 0,
    labels: Sequence[int] | None = None,
    extra: Sequence[str | Path] = (),
    demo: bool = True,
) -> EvalSet:
    """The eval set `boundgen quant-check` gates a loaded engine on: W1/W2/W4 and held-out inputs at
    `scale` (default: "full" on CUDA, "small" elsewhere), the `extra` sets (`EvalSet.to_json`
    files), and the held-out set a demo checkpoint ships (unless `demo=False`), fitted to the
    model's context."""
    scale = scale or ("full" if engine.device.type == "cuda" else "small")
    eval_set = make_eval_set(engine.config.vocab_size, labels, scale=scale, seed=seed)
    for path in extra:
        eval_set = eval_set.extend(EvalSet.load(path))
    shipped = EvalSet.from_demo_dir(model_dir, engine.tokenizer.encode) if demo else None
    if shipped is not None:
        eval_set = eval_set.extend(shipped)
    return eval_set.fit(engine.limits.max_seq_len)
