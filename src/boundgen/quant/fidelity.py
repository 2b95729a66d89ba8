"""Fidelity gate: would a user lose anything if an FP8 policy replaced the bf16 model?

A policy is compared with the bf16 reference on a fixed evaluation set (`evalset`), and only
beyond the reference's own noise (`noise`: the same checkpoint in fp32, measured on the same set):
- decided pairs, per set: of the item pairs the reference orders further apart than the set's
  score floor, at most 1 % may come out reversed or tied;
- decided beams, over all beam prompts: of the prompts whose best beam beats the runner-up by more
  than its set's beam floor, at least 98 % keep the reference's best beam;
- task metrics, where the checkpoint ships labels (the demo: held-out AUC, recall@10, hit@1): a
  policy may lose at most 3 noise bands of each, a band being the larger of |bf16 - fp32| and the
  metric's resolution.
Reorders of near-ties (items or beams closer than the floor) are not counted: the reference itself
could produce them by summing in another order. Spearman over all pairs and top-1 agreement over
all prompts (the gate before issue 26) are still reported, for information.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from boundgen.quant.evalset import EvalSet
from boundgen.quant.fp8 import fp8_swapped
from boundgen.quant.noise import NoiseFloor, beam_margin, decided_pairs
from boundgen.quant.outputs import EvalOutputs, TaskMetric, collect_outputs, engine_callables
from boundgen.quant.policy import parse_policy, select_modules


@dataclass(frozen=True)
class GateThresholds:
    quantile: float = 0.99  # the noise floor: the change the fp32 run exceeds on 1 % of pairs
    pair_agreement: float = 0.99  # per set: decided pairs ordered as the reference
    beam_top1: float = 0.98  # all sets: decided beam prompts with the reference's best beam
    task_bands: float = 3.0  # a task metric may lose this many noise bands


# -------------------------------------------------------------------------------------------------
# Spearman (information: the measure of the gate before issue 26), numpy only


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


# -------------------------------------------------------------------------------------------------
# The verdict


@dataclass
class SetReport:
    name: str
    groups: int = 0
    items: int = 0
    floor: float | None = None  # score floor of the set
    decided: int = 0  # item pairs further apart than the floor in the reference
    flipped: int = 0  # ... of which the candidate reverses or ties
    spearman: float | None = None  # mean over groups, all pairs (information)
    beams: int = 0
    beam_floor: float | None = None
    beams_decided: int = 0  # prompts whose best beam beats the runner-up by more than the floor
    beams_changed: int = 0  # ... of which the candidate has another best beam
    beam_top1_all: float | None = None  # agreement over all prompts (information)

    @property
    def agreement(self) -> float:
        return 1.0 - self.flipped / self.decided if self.decided else 1.0


@dataclass
class TaskReport:
    name: str
    reference: float
    candidate: float
    band: float  # max(|reference - exact|, resolution)
    allowed: float  # the loss the gate accepts: task_bands x band

    @property
    def loss(self) -> float:
        return self.reference - self.candidate


@dataclass
class GateReport:
    policy: str
    passed: bool
    thresholds: GateThresholds
    floor: NoiseFloor
    sets: list[SetReport]
    beams_decided: int
    beams_changed: int
    tasks: list[TaskReport]
    failures: list[str]
    headroom: float  # 1 - the largest share of a criterion's allowance used (< 0: failed)
    eval_set: str = ""
    notes: dict = field(default_factory=dict)

    @property
    def beam_top1(self) -> float | None:
        """Agreement on decided beam prompts (None when none was decided or run)."""
        if not self.beams_decided:
            return None
        return 1.0 - self.beams_changed / self.beams_decided

    def to_dict(self) -> dict:
        """The report as JSON-ready data, the derived values (agreement, loss, beam top-1)
        included."""
        out = dataclasses.asdict(self)
        for data, rep in zip(out["sets"], self.sets):
            data["agreement"] = rep.agreement
        for data, rep in zip(out["tasks"], self.tasks):
            data["loss"] = rep.loss
        out["beam_top1"] = self.beam_top1
        return out

    def format(self) -> str:
        t = self.thresholds

        def f(x, spec=".4f"):
            return "-" if x is None else format(x, spec)

        lines = [
            f"FP8 fidelity gate: policy={self.policy} eval={self.eval_set} "
            f"-> {'PASS' if self.passed else 'FAIL'} (headroom {self.headroom:.2f})",
            f"  beyond the bf16 reference's noise (fp32, floor = its q{t.quantile:g} change): "
            f"decided pairs >= {t.pair_agreement} per set, decided beam top-1 >= {t.beam_top1}, "
            f"task loss <= {t.task_bands:g} bands",
            f"  {'set':<12} {'groups':>6} {'items':>5} {'floor':>7} {'decided':>8} "
            f"{'flipped':>7} {'agree':>6} {'spearman':>8} | {'beams':>5} {'floor':>6} "
            f"{'decided':>7} {'changed':>7} {'all-top1':>8}",
        ]
        for s in self.sets:
            lines.append(
                f"  {s.name:<12} {s.groups:>6} {s.items:>5} {f(s.floor):>7} {s.decided:>8} "
                f"{s.flipped:>7} {f(s.agreement if s.decided else None):>6} {f(s.spearman):>8} | "
                f"{s.beams:>5} "
                f"{f(s.beam_floor, '.3f'):>6} {s.beams_decided:>7} {s.beams_changed:>7} "
                f"{f(s.beam_top1_all, '.3f'):>8}"
            )
        lines.append(
            f"  decided beam top-1: {self.beams_decided - self.beams_changed}/"
            f"{self.beams_decided} = {f(self.beam_top1)}"
        )
        if self.tasks:
            lines.append(
                f"  {'task metric':<18} {'bf16':>7} {'policy':>7} {'loss':>8} {'band':>7} "
                f"{'allowed':>7}"
            )
            for m in self.tasks:
                lines.append(
                    f"  {m.name:<18} {m.reference:>7.4f} {m.candidate:>7.4f} {m.loss:>8.4f} "
                    f"{m.band:>7.4f} {m.allowed:>7.4f}"
                )
        for k, v in self.notes.items():
            lines.append(f"  {k}: {v}")
        for msg in self.failures:
            lines.append(f"  FAIL: {msg}")
        return "\n".join(lines)


def _task_reports(
    ref: dict[str, TaskMetric], cand: dict[str, TaskMetric], floor: NoiseFloor, bands: float
) -> list[TaskReport]:
    out = []
    for name, metric in ref.items():
        if name not in cand:
            raise ValueError(f"task metric {name!r} is missing from the candidate's outputs")
        band = max(floor.tasks.get(name, 0.0), metric.resolution)
        out.append(TaskReport(name, metric.value, cand[name].value, band, bands * band))
    return out


def compare_outputs(
    ref: EvalOutputs,
    cand: EvalOutputs,
    eval_set: EvalSet,
    policy: str,
    floor: NoiseFloor,
    thresholds: GateThresholds = GateThresholds(),
) -> GateReport:
    """The verdict on `cand` against the reference `ref`, beyond the reference's noise `floor`
    (`noise.measure_noise_floor` on the same eval set)."""
    t = thresholds
    by_set: dict[str, SetReport] = {}
    rhos: dict[str, list[float]] = {}
    for case, r, c in zip(eval_set.score_cases, ref.scores, cand.scores):
        rep = by_set.setdefault(case.set_name, SetReport(case.set_name))
        rep.floor = floor.scores.get(case.set_name, 0.0)
        rep.groups += 1
        rep.items += len(r)
        decided, flipped = decided_pairs(r, c, rep.floor)
        rep.decided += decided
        rep.flipped += flipped
        rhos.setdefault(case.set_name, []).append(spearman(r, c))
    for name, values in rhos.items():
        by_set[name].spearman = float(np.mean(values))

    agree_all: dict[str, list[bool]] = {}
    for i, case in enumerate(eval_set.beam_cases):
        r, c = ref.top1(i), cand.top1(i)
        if r is None or c is None:
            continue
        rep = by_set.setdefault(case.set_name, SetReport(case.set_name))
        rep.beam_floor = floor.beams.get(case.set_name, 0.0)
        rep.beams += 1
        agree_all.setdefault(case.set_name, []).append(r == c)
        margin = beam_margin(ref.beams[i])
        if margin is not None and margin > rep.beam_floor:
            rep.beams_decided += 1
            rep.beams_changed += r != c
    for name, values in agree_all.items():
        by_set[name].beam_top1_all = float(np.mean(values))
    tasks = _task_reports(ref.tasks, cand.tasks, floor, t.task_bands)

    # Each criterion's allowance and the share of it used: > 1 fails.
    failures, used = [], [0.0]
    for rep in by_set.values():
        if rep.decided:
            share = rep.flipped / ((1.0 - t.pair_agreement) * rep.decided)
            used.append(share)
            if share > 1.0:
                failures.append(
                    f"{rep.name}: {rep.flipped} of {rep.decided} decided pairs reordered "
                    f"(agreement {rep.agreement:.4f} < {t.pair_agreement}; floor {rep.floor:.4g})"
                )
    decided = sum(s.beams_decided for s in by_set.values())
    changed = sum(s.beams_changed for s in by_set.values())
    if decided:
        share = changed / ((1.0 - t.beam_top1) * decided)
        used.append(share)
        if share > 1.0:
            failures.append(
                f"beam top-1 changed on {changed} of {decided} decided prompts "
                f"(agreement {1 - changed / decided:.3f} < {t.beam_top1})"
            )
    for m in tasks:
        used.append(max(m.loss, 0.0) / m.allowed)
        if m.loss > m.allowed:
            failures.append(
                f"{m.name}: {m.candidate:.4f} vs bf16 {m.reference:.4f} loses {m.loss:.4f} > "
                f"{m.allowed:.4f} ({t.task_bands:g} x band {m.band:.4g})"
            )
    notes = {}
    if eval_set.beam_cases and not any(s.beams for s in by_set.values()):
        notes["beam"] = "not checked (no beam_search callable)"
    if not eval_set.score_cases:
        failures.append("no score cases were evaluated")
    return GateReport(
        policy,
        not failures,
        thresholds,
        floor,
        list(by_set.values()),
        decided,
        changed,
        tasks,
        failures,
        1.0 - max(used),
        eval_set.name,
        notes,
    )


def gate_engine(
    engine,
    policies: Sequence[str],
    eval_set: EvalSet,
    *,
    floor: NoiseFloor,
    reference_outputs: EvalOutputs | None = None,
    task: Callable[[object], dict[str, TaskMetric]] | None = None,
    emulate: bool = False,
    act_quant: str = "auto",
    thresholds: GateThresholds = GateThresholds(),
    log: Callable[[str], None] | None = None,
) -> dict[str, GateReport]:
    """Run the gate for each policy on one loaded (bf16) engine, keyed by canonical policy name:
    the reference outputs are collected once (unless given), then each policy is applied in place
    to `engine.model`, measured (`task(engine)` too, when given), and undone.

    The engine must run its model eagerly: captured CUDA graphs or compiled buckets would replay
    the bf16 kernels whatever modules the policy swaps in (ValueError otherwise)."""
    backend = engine.runner.backend_name
    if backend != "eager":
        raise ValueError(
            f"the gate swaps FP8 modules into the engine's model in place, but its runner is "
            f"{backend!r}, which would not run them: load the engine with backend='eager'"
        )
    model = engine.model
    callables = engine_callables(engine, task)
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
        report = compare_outputs(ref, cand, eval_set, name, floor, thresholds)
        report.notes["mode"] = "emulated" if emulate else "scaled_mm"
        report.notes["eval_seconds"] = f"bf16 {ref_s:.1f}, {name} {time.perf_counter() - t0:.1f}"
        reports[name] = report
        if log:
            log(report.format())
    return reports
