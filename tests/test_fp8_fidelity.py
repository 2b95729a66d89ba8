"""Fidelity gate: metrics, pass/fail on crafted outputs, the gate cache and the engine's refusal."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from fp8_toy import ToyDecoder, toy_callables

from boundgen.quant import Fp8PolicyError, apply_fp8, check_policy_allowed
from boundgen.quant.fidelity import (
    BeamCase,
    EvalOutputs,
    EvalSet,
    GateThresholds,
    ScoreCase,
    collect_outputs,
    compare_outputs,
    make_eval_set,
    rankdata,
    ranking_score,
    spearman,
    topk_overlap,
)
from boundgen.quant.gate_cache import checkpoint_hash, lookup_gate_result, record_gate_result


@pytest.fixture(autouse=True)
def gate_cache(tmp_path, monkeypatch):
    path = tmp_path / "gate.json"
    monkeypatch.setenv("BOUNDGEN_FP8_GATE_CACHE", str(path))
    return path


def _reference_spearman(a, b):
    # textbook formula without ties
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    n = len(a)
    return 1 - 6 * float(((ra - rb) ** 2).sum()) / (n * (n * n - 1))


def test_spearman_and_ranks():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert spearman(a, b) == pytest.approx(_reference_spearman(a, b), abs=1e-12)
    assert spearman(a, a * 3 + 1) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 1, 1], [1, 1, 1]) == 1.0 and spearman([1, 1, 1], [1, 2, 3]) == 0.0
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


def test_topk_overlap_and_ranking_score():
    ref = list(range(20))
    assert topk_overlap(ref, ref, 10) == 1.0
    swapped = ref.copy()
    swapped[9], swapped[10] = swapped[10], swapped[9]  # one item leaves the top 10
    assert topk_overlap(ref, swapped, 10) == 0.9
    assert topk_overlap([1, 2, 3], [3, 2, 1], 10) == 1.0  # k capped at group size
    assert ranking_score([2.0]) == 2.0
    # log P(label 0) over labels: monotonic in the logit gap
    assert ranking_score([3.0, 1.0]) > ranking_score([2.0, 1.0])
    assert ranking_score([0.0, 0.0]) == pytest.approx(np.log(0.5))


def _crafted(n_items=100, n_beams=100, noise=0.0, swaps=0, beam_misses=0, seed=0):
    rng = np.random.default_rng(seed)
    cases = [ScoreCase("W2", [1], [[i] for i in range(n_items)], [0])]
    beams = [BeamCase("W4", [1], 4, 2) for _ in range(n_beams)]
    ev = EvalSet("crafted", cases, beams)
    ref_scores = rng.normal(size=n_items).tolist()
    cand = (np.asarray(ref_scores) + rng.normal(size=n_items) * noise).tolist()
    order = np.argsort(ref_scores)[::-1]
    for s in range(swaps):  # swap the top items pairwise with items far down the list
        i, j = order[s], order[-1 - s]
        cand[i], cand[j] = cand[j], cand[i]
    ref_beams = [[i, i + 1] for i in range(n_beams)]
    cand_beams = [b if k >= beam_misses else [0, 0] for k, b in enumerate(ref_beams)]
    return ev, EvalOutputs([ref_scores], ref_beams), EvalOutputs([cand], cand_beams)


def test_gate_passes_on_small_noise():
    ev, ref, cand = _crafted(noise=1e-3, beam_misses=1)
    report = compare_outputs(ref, cand, ev, "mlp")
    assert report.passed, report.format()
    assert report.beam_top1 == pytest.approx(0.99)
    assert "PASS" in report.format()


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(noise=0.3), "Spearman"),
        (dict(swaps=1), "top-10 overlap"),
        (dict(beam_misses=3), "beam top-1 agreement 0.970"),
    ],
)
def test_gate_fails_with_reason(kwargs, reason):
    ev, ref, cand = _crafted(**kwargs)
    report = compare_outputs(ref, cand, ev, "mlp+attn-proj")
    assert not report.passed
    assert any(reason in f for f in report.failures), report.failures
    assert "FAIL" in report.format()


def test_thresholds_are_the_design_values():
    t = GateThresholds()
    assert (t.spearman, t.topk_overlap, t.beam_top1, t.k) == (0.995, 0.95, 0.98, 10)


def test_eval_set_is_deterministic_and_shaped():
    a = make_eval_set(151936, scale="full")
    b = make_eval_set(151936, scale="full")
    assert a.to_json() == b.to_json()
    assert (
        make_eval_set(151936, seed=1, scale="small").to_json()
        != make_eval_set(151936, scale="small").to_json()
    )
    w1 = [c for c in a.score_cases if c.set_name == "W1"]
    assert len(w1) == 1 and len(w1[0].items) == 256 and w1[0].query == []
    assert all(64 <= len(x) <= 256 for x in w1[0].items)
    w2 = [c for c in a.score_cases if c.set_name == "W2"]
    assert all(
        len(c.query) == 256 and len(c.items) == 100 and all(len(x) == 16 for x in c.items)
        for c in w2
    )
    w4 = [c for c in a.beam_cases if c.set_name == "W4"]
    assert all(len(c.prompt) == 128 and (c.beam_width, c.steps) == (16, 4) for c in w4)
    assert any(c.set_name == "heldout" for c in a.score_cases) and any(
        c.set_name == "heldout" for c in a.beam_cases
    )
    assert EvalSet.from_json(a.to_json()).to_json() == a.to_json()


def test_toy_model_gate_runs_emulated():
    ref_model = ToyDecoder(layers=2)
    ev = make_eval_set(ref_model.vocab, scale="ci")
    ref = collect_outputs(toy_callables(ref_model), ev)
    same = compare_outputs(
        ref, collect_outputs(toy_callables(copy.deepcopy(ref_model)), ev), ev, "none"
    )
    assert same.passed and same.beam_top1 == 1.0
    q = toy_callables(apply_fp8(copy.deepcopy(ref_model), "mlp", emulate=True))
    report = compare_outputs(ref, collect_outputs(q, ev), ev, "mlp")
    # groups of 6-8 items: one swapped pair already costs ~0.05 Spearman, so only "close" is checked
    # here
    rhos = [s.spearman_mean for s in report.sets if s.spearman_mean is not None]
    assert len(rhos) == 3 and np.mean(rhos) > 0.85, report.format()


def _fake_checkpoint(path, payload=b"weights"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (path / "model.safetensors").write_bytes(payload)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_checkpoint_hash_tracks_content(tmp_path):
    a = _fake_checkpoint(tmp_path / "a")
    h1 = checkpoint_hash(a)
    assert h1 == checkpoint_hash(a) and len(h1) == 64
    (a / "tokenizer.json").write_text('{"x": 1}')  # tokenizer does not change numerics
    assert checkpoint_hash(a) == h1
    (a / "model.safetensors").write_bytes(b"weightz")
    assert checkpoint_hash(a) != h1
    with pytest.raises(FileNotFoundError, match="no weight files"):
        (tmp_path / "empty").mkdir()
        checkpoint_hash(tmp_path / "empty")


def test_check_policy_allowed(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "m")
    assert check_policy_allowed(ckpt, "none") is None
    with pytest.raises(Fp8PolicyError, match=r"has not passed the fidelity gate.*quant-check"):
        check_policy_allowed(ckpt, "mlp")
    assert check_policy_allowed(ckpt, "mlp", force=True) is None

    ev, ref, cand = _crafted(noise=1e-3)
    record_gate_result(ckpt, "mlp", compare_outputs(ref, cand, ev, "mlp").to_dict())
    assert check_policy_allowed(ckpt, "mlp")["passed"]

    ev, ref, bad = _crafted(noise=0.3)
    record_gate_result(
        ckpt, "mlp+attn-proj", compare_outputs(ref, bad, ev, "mlp+attn-proj").to_dict()
    )
    with pytest.raises(Fp8PolicyError, match=r"failed the fidelity gate.*Spearman"):
        check_policy_allowed(ckpt, "mlp+attn-proj")
    assert not check_policy_allowed(ckpt, "mlp+attn-proj", force=True)["passed"]
    # a changed checkpoint is a different model: the verdict does not carry over
    (ckpt / "model.safetensors").write_bytes(b"other weights")
    assert lookup_gate_result(ckpt, "mlp") is None
    with pytest.raises(ValueError, match="unknown FP8 policy"):
        check_policy_allowed(ckpt, "fp4")


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model):
    return tiny_model()  # conftest: the session's tiny qwen2 checkpoint


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_real_tiny_model_policies_and_emulated_scores(tiny_model, arch):
    engine_mod = pytest.importorskip("boundgen.engine")
    engine = engine_mod.Engine.from_pretrained(tiny_model(arch), device="cpu", dtype="bfloat16")
    model = engine.model
    n = model.config.num_layers
    from boundgen.quant import fp8_modules, select_modules

    assert set(select_modules(model, "mlp+attn-proj")) == {
        f"layers.{i}.{s}"
        for i in range(n)
        for s in ("mlp.gate_up_proj", "mlp.down_proj", "self_attn.qkv_proj", "self_attn.o_proj")
    }
    query, items, labels = list(range(5, 30)), [[40 + i, 7, 9 + i] for i in range(12)], [11, 12]
    ref = np.asarray(engine.score(query, items, labels))
    apply_fp8(model, "mlp", emulate=True)
    assert len(fp8_modules(model)) == 2 * n
    out = np.asarray(engine.score(query, items, labels))
    assert out.shape == ref.shape
    spread = ref.max() - ref.min()
    assert np.abs(out - ref).max() < 0.1 * spread + 0.05
    assert spearman(ref[:, 0] - ref[:, 1], out[:, 0] - out[:, 1]) > 0.9


def test_quant_check_cli(tiny_model_dir, gate_cache, capsys):
    from boundgen.cli import main

    rc = main(
        [
            "quant-check",
            "--model",
            str(tiny_model_dir),
            "--fp8",
            "mlp",
            "--emulate",
            "--device",
            "cpu",
            "--scale",
            "ci",
        ]
    )
    out = capsys.readouterr().out
    assert rc in (0, 3) and "FP8 fidelity gate: policy=mlp" in out
    record = lookup_gate_result(tiny_model_dir, "mlp")
    assert record is not None and record["passed"] == (rc == 0)
    # asking for real FP8 on CPU is one clear error line, not a traceback
    rc = main(["quant-check", "--model", str(tiny_model_dir), "--fp8", "mlp", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "real FP8 is not available" in err and "--emulate" in err


def test_gate_needs_an_eager_runner():
    """Swapped FP8 modules are invisible to captured graphs: such an engine is refused, not
    measured as bf16 against bf16."""
    from types import SimpleNamespace

    from boundgen.quant.fidelity import gate_engine

    engine = SimpleNamespace(
        model=ToyDecoder(), runner=SimpleNamespace(backend_name="eager+graphs")
    )
    with pytest.raises(ValueError, match=r"'eager\+graphs'.*backend='eager'"):
        gate_engine(engine, ["mlp"], make_eval_set(96, scale="ci"), emulate=True)


def test_quant_check_cli_selective_policy(tiny_model_dir, gate_cache, capsys):
    from boundgen.cli import main

    argv = ["quant-check", "--model", str(tiny_model_dir), "--emulate", "--device", "cpu"]
    rc = main([*argv, "--scale", "ci", "--fp8", "Down_Proj:layers=-1"])
    out = capsys.readouterr().out
    assert rc in (0, 3) and "FP8 fidelity gate: policy=down_proj:layers=-1" in out
    assert lookup_gate_result(tiny_model_dir, "down_proj:layers=-1") is not None
    with pytest.raises(SystemExit) as exc:  # argparse: a usage error, before loading anything
        main([*argv, "--fp8", "mlp:layers=x"])
    assert exc.value.code == 2 and "'x' is not N, -N or A-B" in capsys.readouterr().err


def test_enable_fp8_is_the_engine_seam(tmp_path):
    from boundgen.quant import Fp8NotSupportedError, enable_fp8, fp8_modules

    ckpt = _fake_checkpoint(tmp_path / "m")
    model = ToyDecoder()
    assert enable_fp8(model, ckpt, None) == "none" and fp8_modules(model) == []
    with pytest.raises(Fp8PolicyError, match="has not passed"):
        enable_fp8(model, ckpt, "mlp", emulate=True)
    assert fp8_modules(model) == []  # refused before touching the model
    with pytest.raises(Fp8NotSupportedError):
        enable_fp8(model, ckpt, "mlp", force=True)  # CPU, not emulated
    ev, ref, cand = _crafted(noise=1e-3)
    record_gate_result(ckpt, "mlp", compare_outputs(ref, cand, ev, "mlp").to_dict())
    assert enable_fp8(model, ckpt, "MLP", emulate=True) == "mlp"
    assert len(fp8_modules(model)) == 4


def test_enable_fp8_finds_the_verdict_under_any_spelling(tmp_path):
    from boundgen.quant import enable_fp8, fp8_modules

    ckpt = _fake_checkpoint(tmp_path / "m")
    ev, ref, cand = _crafted(noise=1e-3)
    record_gate_result(ckpt, "mlp:skip=0,-1", compare_outputs(ref, cand, ev, "x").to_dict())
    model = ToyDecoder(layers=4)
    assert enable_fp8(model, ckpt, "gate_up_proj+down_proj:skip=-1,0", emulate=True) == (
        "mlp:skip=0,-1"
    )
    assert fp8_modules(model) == [
        f"layers.{i}.mlp.{p}" for i in (1, 2) for p in ("gate_up_proj", "down_proj")
    ]
    with pytest.raises(Fp8PolicyError, match="has not passed"):
        enable_fp8(ToyDecoder(layers=4), ckpt, "mlp:skip=0", emulate=True)


def test_demo_heldout_set_from_checkpoint_files(tmp_path):
    assert EvalSet.from_demo_dir(tmp_path, lambda s: [1]) is None
    (tmp_path / "catalog.json").write_text(
        json.dumps({"items": [{"item_id": i, "title": f"item {i}"} for i in range(4)]})
    )
    (tmp_path / "demo.json").write_text(
        json.dumps(
            {
                "templates": {
                    "relevance_query": "Q: {query}\n",
                    "relevance_item": "I: {title}\nR:",
                    "retrieval": "Q: {query}\nID:",
                },
                "label_token_ids": [5, 6],
                "sid_levels": 3,
            }
        )
    )
    (tmp_path / "eval.json").write_text(
        json.dumps(
            {
                "relevance": [
                    {
                        "query": "a",
                        "candidates": [{"item_id": 0, "label": 1}, {"item_id": 2, "label": 0}],
                    },
                    {
                        "query": "b",
                        "candidates": [{"item_id": 1, "label": 1}, {"item_id": 3, "label": 0}],
                    },
                ],
                "retrieval": [{"query": "c", "relevant": [1]}],
            }
        )
    )
    encode = lambda text: [ord(ch) for ch in text]
    ev = EvalSet.from_demo_dir(tmp_path, encode)
    assert [c.set_name for c in ev.score_cases] == ["demo", "demo", "demo-pooled"]
    assert ev.score_cases[0].query == encode("Q: a\n") and ev.score_cases[0].items[1] == encode(
        "I: item 2\nR:"
    )
    assert ev.score_cases[2].query == [] and len(ev.score_cases[2].items) == 4
    assert ev.score_cases[0].label_token_ids == [5, 6]
    (beam,) = ev.beam_cases
    assert beam.prompt == encode("Q: c\nID:") and (beam.beam_width, beam.steps) == (10, 3)


def test_real_tiny_model_exports_with_scaled_mm(tiny_model_dir, monkeypatch):
    """The compiled backends' export path sees plain tensors and `_scaled_mm`."""
    aoti = pytest.importorskip("boundgen.compile.aoti")
    buckets = pytest.importorskip("boundgen.compile.buckets")
    from boundgen.quant import fp8 as fp8_mod

    engine = pytest.importorskip("boundgen.engine").Engine.from_pretrained(
        tiny_model_dir, device="cpu", dtype="bfloat16"
    )
    # CPU torch has a reference _scaled_mm: build the real-kernel module graph here, as on Hopper
    monkeypatch.setattr(fp8_mod, "resolve_mode", lambda device, emulate: "scaled_mm")
    apply_fp8(engine.model, "mlp+attn-proj")
    fwd = aoti.PackedForward(engine.model).eval()
    ex = buckets.Bucket.parse("t32-s4-m16").example("cpu")
    try:
        expected = fwd(ex.input_ids, ex.positions, ex.attn)
    except RuntimeError as exc:  # pragma: no cover - torch build without CPU _scaled_mm
        pytest.skip(f"no CPU _scaled_mm: {exc}")
    with torch.no_grad():
        ep = torch.export.export(fwd, (ex.input_ids, ex.positions, ex.attn), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    n_layers = engine.model.config.num_layers
    assert sum("_scaled_mm" in t for t in targets) == 4 * n_layers
    got = ep.module()(ex.input_ids, ex.positions, ex.attn)
    torch.testing.assert_close(got, expected)


def test_eval_set_fits_a_short_context():
    ev = make_eval_set(1000, scale="full").fit(128)
    for c in ev.score_cases:
        assert all(len(c.query) + len(x) <= 128 for x in c.items)
    assert all(len(b.prompt) + b.steps <= 128 for b in ev.beam_cases)
    w2 = next(c for c in ev.score_cases if c.set_name == "W2")
    full = next(c for c in make_eval_set(1000, scale="full").score_cases if c.set_name == "W2")
    assert w2.query == full.query[-len(w2.query) :]  # the end of the prefix is kept
    small = make_eval_set(1000, scale="ci")
    assert small.fit(4096).to_json() == small.to_json() and small.fit(None) is small
