"""The fidelity gate on the trained demo model, with `boundgen quant-check`'s eval set, task metrics
and noise floor: the controls (not FP8) pass with room, `selective` passes, and a damaging
perturbation fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from boundgen.commands.quant_check import (
    EXACT,
    collect_variant,
    control_reports,
    demo_task,
    load_reference_engine,
)
from boundgen.demo import ASSETS
from boundgen.quant.evalset import gate_eval_set
from boundgen.quant.fidelity import GateThresholds, compare_outputs, gate_engine
from boundgen.quant.noise import measure_noise_floor
from boundgen.quant.outputs import collect_outputs, engine_callables

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ASSETS / "model.safetensors").is_file(),
        reason="demo model not built (boundgen train-demo --out src/boundgen/demo/assets)",
    ),
]


@pytest.fixture(scope="module")
def demo():
    """What `quant-check` measures before any policy: the bf16 reference and the noise floor."""
    engine = load_reference_engine(ASSETS, "cpu")
    eval_set = gate_eval_set(engine, ASSETS)
    task = demo_task(ASSETS)
    with torch.inference_mode():
        ref = collect_outputs(engine_callables(engine, task), eval_set)
        dtype, overrides = EXACT
        exact = collect_variant(ASSETS, "cpu", eval_set, task, dtype, **overrides)
    floor = measure_noise_floor(ref, exact, eval_set)
    yield SimpleNamespace(
        engine=engine, eval_set=eval_set, task=task, ref=ref, exact=exact, floor=floor
    )
    engine.close()


def test_controls_pass_with_room(demo):
    """fp32 and bf16 with share_prefix off (the same math in another order) are not FP8: the gate
    passes both, using at most half of any allowance."""
    with torch.inference_mode():
        reports = control_reports(
            ASSETS,
            "cpu",
            demo.eval_set,
            demo.task,
            demo.ref,
            demo.exact,
            demo.floor,
            GateThresholds(),
            "bfloat16",
        )
    assert len(reports) == 2
    for report in reports.values():
        assert report.passed and report.headroom >= 0.5, report.format()
        assert {m.name for m in report.tasks} == {
            "relevance AUC",
            "recall@10 query",
            "recall@10 history",
            "hit@1 query",
            "hit@1 history",
        }


def test_selective_passes(demo):
    with torch.inference_mode():
        (report,) = gate_engine(
            demo.engine,
            ["selective"],
            demo.eval_set,
            floor=demo.floor,
            reference_outputs=demo.ref,
            task=demo.task,
            emulate=True,
        ).values()
    assert report.passed, report.format()


def test_a_damaging_perturbation_fails(demo):
    """Every projection's weights moved by 10 % of their spread (deterministic noise): rankings
    beyond the noise floor, beams and the held-out AUC all suffer."""
    model = demo.engine.model
    g = torch.Generator().manual_seed(0)
    saved = {}
    with torch.inference_mode():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                w = module.weight
                saved[name] = w.clone()
                w.add_((torch.randn(w.shape, generator=g) * w.float().std() * 0.1).to(w.dtype))
        try:
            cand = collect_outputs(engine_callables(demo.engine, demo.task), demo.eval_set)
        finally:
            for name, w in saved.items():
                model.get_submodule(name).weight.copy_(w)
    report = compare_outputs(demo.ref, cand, demo.eval_set, "noise", demo.floor)
    assert not report.passed and report.headroom < 0
    reasons = " | ".join(report.failures)
    assert "decided pairs reordered" in reasons and "relevance AUC" in reasons, reasons
