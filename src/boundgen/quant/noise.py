"""The reference's own noise: how far an exact-math variant of the bf16 reference (the same
checkpoint in fp32) moves its outputs on the gate's evaluation set, and which of the reference's
decisions stand clear of that noise.

Per set of the eval set, the *floor* is the `quantile` (0.99) of how much fp32 changes
- the gap between two items of a ranking group (scores), and
- the log-prob margin of a beam prompt's best beam over its runner-up (beams);
per task metric, it is |metric(bf16) - metric(fp32)|. A pair of items is *decided* by the reference
when their gap exceeds the score floor, and a beam prompt's top-1 when its margin exceeds the beam
floor: anything closer could come out either way in the reference itself. The gate (`fidelity`)
counts a candidate's disagreements only on decided pairs and prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from boundgen.quant.evalset import EvalSet
from boundgen.quant.outputs import Beams, EvalOutputs


@dataclass(frozen=True)
class NoiseFloor:
    quantile: float
    scores: dict[str, float]  # per set: the quantile of |change of a pair's gap|
    beams: dict[str, float]  # per set: the quantile of |change of the top-1/top-2 margin|
    tasks: dict[str, float]  # per task metric: |reference - exact|

    def format(self) -> str:
        def join(values: dict[str, float]) -> str:
            return ", ".join(f"{k} {v:.4g}" for k, v in values.items()) or "-"

        return (
            f"noise floor (bf16 vs fp32, q{self.quantile:g} of the change): pair gaps "
            f"{join(self.scores)}; beam margins {join(self.beams)}; task metrics "
            f"{join(self.tasks)}"
        )


def _pair_index(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, 1)


def decided_pairs(ref: list[float], cand: list[float], floor: float) -> tuple[int, int]:
    """(pairs of items whose reference gap exceeds `floor`, how many of them `cand` does not order
    as the reference does: reversed or tied)."""
    r, c = np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    i, j = _pair_index(len(r))
    gap = r[i] - r[j]
    decided = np.abs(gap) > floor
    kept = np.sign(c[i] - c[j])[decided] == np.sign(gap[decided])
    return int(decided.sum()), int((~kept).sum())


def beam_margin(beams: Beams | None) -> float | None:
    """How far the best beam's log-prob is above the runner-up's (None with fewer than two)."""
    if not beams or len(beams) < 2:
        return None
    return beams[0][1] - beams[1][1]


def _margin_change(ref: Beams | None, exact: Beams | None) -> float | None:
    """|change of the reference's top-1/top-2 margin| in `exact` (None where `exact` lost either
    sequence from its beam, or there is no runner-up)."""
    if beam_margin(ref) is None or not exact:
        return None
    logprob = {tuple(tokens): lp for tokens, lp in exact}
    first, second = tuple(ref[0][0]), tuple(ref[1][0])
    if first not in logprob or second not in logprob:
        return None
    return abs(beam_margin(ref) - (logprob[first] - logprob[second]))


def _quantile(values: list[float], q: float) -> float:
    # no measurable change (or nothing to measure): every non-tie counts as decided
    return float(np.quantile(values, q)) if values else 0.0


def measure_noise_floor(
    ref: EvalOutputs, exact: EvalOutputs, eval_set: EvalSet, quantile: float = 0.99
) -> NoiseFloor:
    """The floor of each set of `eval_set` from the reference's and the exact variant's outputs."""
    gap_changes: dict[str, list[float]] = {}
    for case, r, e in zip(eval_set.score_cases, ref.scores, exact.scores):
        d = np.subtract(r, e, dtype=np.float64)
        i, j = _pair_index(len(d))
        gap_changes.setdefault(case.set_name, []).extend(np.abs(d[i] - d[j]).tolist())
    margin_changes: dict[str, list[float]] = {}
    for case, r, e in zip(eval_set.beam_cases, ref.beams, exact.beams):
        change = _margin_change(r, e)
        values = margin_changes.setdefault(case.set_name, [])
        if change is not None:
            values.append(change)
    return NoiseFloor(
        quantile,
        {name: _quantile(v, quantile) for name, v in gap_changes.items()},
        {name: _quantile(v, quantile) for name, v in margin_changes.items()},
        {
            name: abs(metric.value - exact.tasks[name].value)
            for name, metric in ref.tasks.items()
            if name in exact.tasks
        },
    )
