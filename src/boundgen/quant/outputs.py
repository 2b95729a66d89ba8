"""What one model configuration (bf16, fp32, an FP8 policy) produces on the gate's evaluation set:
a ranking value per scored item, the beams of every beam prompt, and task metrics against ground
truth where the checkpoint ships labels.

The gate only needs a few callables per configuration (`GateCallables`), so it runs against an
`Engine` (`engine_callables`) or anything else with the same shape:
    score(query_ids, items_ids, label_token_ids) -> [[log-score per label] per item]
    beam(prompt_ids, beam_width, steps) -> [(tokens, logprob), ...] best first
    task() -> {metric name: TaskMetric}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from boundgen.quant.evalset import EvalSet

ScoreFn = Callable[[list[int], list[list[int]], list[int]], Sequence[Sequence[float]]]
BeamFn = Callable[[list[int], int, int], Sequence]
Beams = list[tuple[list[int], float]]  # (tokens, log-prob), best first


@dataclass(frozen=True)
class TaskMetric:
    """A task metric against ground truth (higher is better), e.g. held-out AUC or recall@10.

    `resolution` is the smallest change one decision makes (one positive/negative pair reordered,
    one relevant item found or lost): a difference below it is not a difference."""

    value: float
    resolution: float


@dataclass
class GateCallables:
    """The callables the gate needs from one model configuration (bf16 or an FP8 policy)."""

    score: ScoreFn
    beam: BeamFn | None = None
    # (prompts, beam_width, steps) -> one beam list per prompt; used instead of `beam` when given
    beam_batch: Callable[[list[list[int]], int, int], Sequence] | None = None
    # task metrics against the checkpoint's held-out labels (None: the checkpoint ships none)
    task: Callable[[], dict[str, TaskMetric]] | None = None


def engine_callables(engine, task: Callable[[object], dict] | None = None) -> GateCallables:
    """`Engine.score(query, items, label_token_ids)` and `Engine.beam_search_batch(prompts,
    beam_width, steps)` as the gate's callables; `task(engine)` gives the task metrics."""

    def score(query, items, labels):
        # Engine.score gives each label's probability under the full vocabulary; its log is the
        # label logit minus the row's log-sum-exp, so `ranking_score` ranks as on the logits
        # (a probability that underflows float32 becomes the smallest normal's log, not -inf)
        probs = engine.score(query, items, label_token_ids=labels)
        tiny = np.finfo(np.float32).tiny
        return np.log(np.maximum(np.asarray(probs, dtype=np.float64), tiny)).tolist()

    def beam_batch(prompts, width, steps):
        return engine.beam_search_batch(prompts, beam_width=width, steps=steps)

    return GateCallables(
        score, beam_batch=beam_batch, task=(lambda: task(engine)) if task is not None else None
    )


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


@dataclass
class EvalOutputs:
    scores: list[list[float]]  # per score case: one ranking value per item
    beams: list[Beams | None]  # per beam case: its beams (None when there is no beam callable)
    tasks: dict[str, TaskMetric]  # task metrics against ground truth ({} without labels)

    def top1(self, i: int) -> list[int] | None:
        """Tokens of beam case `i`'s best beam ([] when it has none, None when not run)."""
        beams = self.beams[i]
        if beams is None:
            return None
        return list(beams[0][0]) if beams else []


def _as_beams(result: Sequence) -> Beams:
    return [([int(t) for t in tokens], float(lp)) for tokens, lp in result]


def collect_outputs(
    model: GateCallables, eval_set: EvalSet, beam_batch_size: int = 16
) -> EvalOutputs:
    scores = []
    for case in eval_set.score_cases:
        out = model.score(case.query, case.items, case.label_token_ids)
        if len(out) != len(case.items):
            raise RuntimeError(f"score returned {len(out)} rows for {len(case.items)} items")
        scores.append([ranking_score(row) for row in out])
    beams: list[Beams | None] = [None] * len(eval_set.beam_cases)
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
                    beams[i] = _as_beams(result)
    elif model.beam is not None:
        for i, case in enumerate(eval_set.beam_cases):
            beams[i] = _as_beams(model.beam(case.prompt, case.beam_width, case.steps))
    tasks = model.task() if model.task is not None else {}
    return EvalOutputs(scores, beams, tasks)
