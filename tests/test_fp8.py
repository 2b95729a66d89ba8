"""FP8 numerics, Fp8Linear, policy selection and device gating (CPU, emulated FP8)."""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import pytest
import torch
from fp8_toy import ToyDecoder
from torch import nn

from boundgen.quant import (
    Fp8Linear,
    Fp8NotSupportedError,
    Fp8PolicyError,
    apply_fp8,
    fp8_modules,
    fp8_supported,
    fp8_swapped,
    parse_policy,
    quantize_rowwise,
    quantize_weight,
    select_modules,
)
from boundgen.quant.rowwise import FP8_MAX

E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa


def test_quantize_rowwise_round_trip_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    q, scale = quantize_rowwise(x)
    assert (
        q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.float32
    )
    back = q.float() * scale
    # per-row max maps to ±448 exactly, so the row max survives the round trip
    amax = x.abs().amax(-1)
    assert torch.equal(q.float().abs().amax(-1), torch.full((64,), FP8_MAX))
    torch.testing.assert_close(back.abs().amax(-1), amax, rtol=1e-6, atol=0)
    # normal e4m3 values: relative error ≤ 2^-4; subnormals (below 2^-6 * scale): absolute ≤ 2^-10 *
    # scale
    normal = (x / scale).abs() >= 2.0**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= E4M3_REL + 1e-6
    assert ((back - x).abs()[~normal] <= scale.expand_as(x)[~normal] * 2.0**-10 + 1e-12).all()


def test_quantize_zero_rows_and_weight_layout():
    x = torch.zeros(3, 32)
    q, scale = quantize_rowwise(x)
    assert torch.isfinite(scale).all() and (q.float() == 0).all()
    w8, ws = quantize_weight(torch.randn(48, 32))
    assert w8.shape == (48, 32) and ws.shape == (1, 48) and w8.is_contiguous()


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_emulated_close_to_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=bias).to(torch.bfloat16)
    x = torch.randn(4, 7, 256, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(lin, mode="emulate")
    ref, out = lin(x).float(), fp8(x).float()
    assert out.shape == (4, 7, 128) and fp8(x).dtype == torch.bfloat16
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.05, rel  # two e4m3 roundings: ~3% relative error in norm
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.998


def test_scaled_mm_mode_matches_emulation():
    # torch's CPU build has a reference _scaled_mm, so both code paths are testable here.
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(10, 64, dtype=torch.bfloat16)
    emu = Fp8Linear.from_linear(lin, mode="emulate")
    try:
        real = Fp8Linear.from_linear(lin, mode="scaled_mm")
        out = real(x)
    except RuntimeError as exc:  # pragma: no cover - CPU _scaled_mm missing in this build
        pytest.skip(f"no CPU _scaled_mm: {exc}")
    torch.testing.assert_close(out.float(), emu(x).float(), rtol=2e-2, atol=2e-2)


def test_scaled_mm_needs_multiples_of_16():
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_linear(nn.Linear(40, 48), mode="scaled_mm")
    Fp8Linear.from_linear(nn.Linear(40, 48), mode="emulate")  # emulation does not care


@pytest.mark.parametrize(
    "policy, suffixes",
    [
        ("mlp", {"mlp.gate_up_proj", "mlp.down_proj"}),
        (
            "mlp+attn-proj",
            {"mlp.gate_up_proj", "mlp.down_proj", "self_attn.qkv_proj", "self_attn.o_proj"},
        ),
    ],
)
def test_policy_swaps_exactly_the_named_modules(policy, suffixes):
    model = ToyDecoder(layers=3)
    expected = {f"layers.{i}.{s}" for i in range(3) for s in suffixes}
    assert set(select_modules(model, policy)) == expected
    apply_fp8(model, policy, emulate=True)
    assert set(fp8_modules(model)) == expected
    # everything else untouched and in its original type
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert name not in expected
    if "self_attn.qkv_proj" in suffixes:
        assert (
            model.layers[0].self_attn.qkv_proj.bias is not None
        )  # bias kept (added after the GEMM)


def test_policy_none_and_errors():
    model = ToyDecoder()
    assert apply_fp8(model, "none") is model and fp8_modules(model) == []
    assert parse_policy(" MLP ").name == "mlp" and parse_policy(None).name == "none"
    with pytest.raises(ValueError, match=r"unknown FP8 policy 'attn'.*none, mlp, mlp\+attn-proj"):
        parse_policy("attn")
    with pytest.raises(Fp8PolicyError, match="matched no modules"):
        select_modules(nn.Sequential(nn.Linear(4, 4)), "mlp")
    apply_fp8(model, "mlp", emulate=True)
    with pytest.raises(Fp8PolicyError, match="already quantized"):
        apply_fp8(model, "mlp", emulate=True)


@pytest.mark.parametrize(
    "spelling, canonical",
    [
        ("gate_up_proj+down_proj", "mlp"),
        ("attn-proj + MLP", "mlp+attn-proj"),
        ("o_proj+mlp", "mlp+o_proj"),
        ("mlp:layers=2,1", "mlp:layers=1,2"),
        ("mlp:layers=3,0-2", "mlp:layers=0-3"),
        ("mlp:skip=-1,0", "mlp:skip=0,-1"),
        ("down_proj:skip=1:layers=0-1", "down_proj:layers=0,1:skip=1"),
    ],
)
def test_policy_spellings_have_one_name(spelling, canonical):
    assert parse_policy(spelling).name == canonical
    assert parse_policy(canonical).name == canonical


@pytest.mark.parametrize(
    "policy, why",
    [
        ("fp4", "no projection or group named 'fp4'"),
        ("mlp+", "no projection or group named ''"),
        ("mlp:layers=2-1", "range 2-1 is empty"),
        ("mlp:layers=a", "'a' is not N, -N or A-B"),
        ("mlp:layers=", "is not layers=LIST or skip=LIST"),
        ("mlp:depth=1", "'depth=1' is not layers=LIST or skip=LIST"),
        ("mlp:skip=0:skip=1", "skip is given twice"),
    ],
)
def test_policy_syntax_errors_say_what_is_wrong(policy, why):
    with pytest.raises(ValueError, match=re.escape(why) + r".*PROJ\[\+PROJ\]"):
        parse_policy(policy)


@pytest.mark.parametrize(
    "policy, expected",
    [
        (
            "mlp:layers=1-2",
            [f"layers.{i}.mlp.{p}" for i in (1, 2) for p in ("gate_up_proj", "down_proj")],
        ),
        (
            "mlp:skip=0,-1",
            [f"layers.{i}.mlp.{p}" for i in (1, 2) for p in ("gate_up_proj", "down_proj")],
        ),
        ("down_proj:layers=-1", ["layers.3.mlp.down_proj"]),
        (
            "gate_up_proj+o_proj:layers=0",
            ["layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj"],
        ),
    ],
)
def test_selective_policy_selects_those_layers(policy, expected):
    model = ToyDecoder(layers=4)
    assert select_modules(model, policy) == expected
    apply_fp8(model, policy, emulate=True)
    assert fp8_modules(model) == expected


def test_selective_policy_must_fit_the_model():
    model = ToyDecoder(layers=4)
    with pytest.raises(Fp8PolicyError, match="names layer 4, but the model has 4 layers"):
        select_modules(model, "mlp:layers=2-4")
    with pytest.raises(Fp8PolicyError, match="names layer -5"):
        select_modules(model, "mlp:skip=-5")
    with pytest.raises(Fp8PolicyError, match="leaves none of 4 layers in FP8"):
        select_modules(model, "mlp:layers=1:skip=1")


def test_fp8_swapped_puts_the_bf16_modules_back():
    model = ToyDecoder(layers=2)
    ids = torch.randint(0, model.vocab, (9,))
    names = select_modules(model, "mlp+attn-proj")
    with torch.no_grad():
        before = model(ids)
        with fp8_swapped(model, names, emulate=True):
            assert fp8_modules(model) == names
            assert not torch.equal(model(ids), before)
        assert fp8_modules(model) == []
        assert torch.equal(model(ids), before)


def test_quant_imports_only_go_down():
    """rowwise <- triton_quant <- fp8 <- policy <- fidelity and evalset <- outputs <- noise <-
    fidelity (gate_cache is a leaf): no module imports one above it or beside it, at the top or
    inside a function."""
    order = ["rowwise", "gate_cache", "evalset", "outputs", "noise", "triton_quant", "fp8"]
    order += ["policy", "fidelity"]
    allowed = {"triton_quant": {"rowwise"}, "fp8": {"rowwise", "triton_quant"}}
    allowed["policy"] = allowed["fp8"] | {"fp8", "gate_cache"}
    allowed["outputs"] = {"evalset"}
    allowed["noise"] = {"evalset", "outputs"}
    allowed["fidelity"] = allowed["policy"] | allowed["noise"] | {"policy", "noise"}
    folder = Path(fp8_modules.__code__.co_filename).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(order)
    for module in order:
        imported = set()
        for node in ast.walk(ast.parse((folder / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "boundgen.quant":
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "boundgen.quant."
            ):
                imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                imported.update(
                    a.name.split(".")[2] for a in node.names if a.name.startswith("boundgen.quant.")
                )
        assert imported <= allowed.get(module, set()), (module, imported)


def test_real_fp8_on_cpu_is_a_clear_error():
    ok, reason = fp8_supported("cpu")
    assert not ok and "emulate" in reason
    with pytest.raises(Fp8NotSupportedError, match=r"real FP8 is not available.*sm_89"):
        apply_fp8(ToyDecoder(), "mlp")


def test_emulated_model_close_to_reference():
    torch.manual_seed(0)
    ref = ToyDecoder(layers=2).to(torch.bfloat16)
    ids = torch.randint(0, ref.vocab, (24,))
    for policy in ("mlp", "mlp+attn-proj"):
        q = apply_fp8(copy.deepcopy(ref), policy, emulate=True)
        with torch.no_grad():
            a, b = ref(ids).float(), q(ids).float()
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.mean() > 0.99 and cos.min() > 0.97, (policy, cos.mean(), cos.min())


def test_export_sees_plain_tensor_ops():
    model = apply_fp8(ToyDecoder(layers=1), "mlp+attn-proj", emulate=True).eval()
    ids = torch.randint(0, model.vocab, (9,))
    ep = torch.export.export(model, (ids,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("triton" in t or "custom" in t for t in targets)
    torch.testing.assert_close(ep.module()(ids), model(ids))


def test_export_scaled_mm_path():
    lin = Fp8Linear.from_linear(nn.Linear(32, 48, bias=True).to(torch.bfloat16), mode="scaled_mm")
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    try:
        lin(x)
    except RuntimeError as exc:  # pragma: no cover
        pytest.skip(f"no CPU _scaled_mm: {exc}")
    ep = torch.export.export(lin, (x,))
    assert any("_scaled_mm" in str(n.target) for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x), lin(x))


# -------------------------------------------------------------------------------------------------
# CUDA (skipped without an FP8-capable GPU)

_fp8_gpu = pytest.mark.skipif(
    not fp8_supported("cuda")[0] if torch.cuda.is_available() else True,
    reason="needs a CUDA GPU with rowwise FP8 (sm_89+)",
)


@pytest.mark.gpu
@_fp8_gpu
@pytest.mark.parametrize("act_quant", ["torch", "triton"])
def test_gpu_scaled_mm_matches_emulation(act_quant):
    from boundgen.quant.fp8 import _triton_available

    if act_quant == "triton" and not _triton_available(torch.device("cuda")):
        pytest.skip("triton quantizer unavailable")
    torch.manual_seed(0)
    lin = nn.Linear(896, 1152, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(300, 896, device="cuda", dtype=torch.bfloat16)
    real = Fp8Linear.from_linear(lin, mode="scaled_mm", act_quant=act_quant)
    emu = Fp8Linear.from_linear(lin, mode="emulate")
    torch.testing.assert_close(real(x).float(), emu(x).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@_fp8_gpu
def test_gpu_triton_quantizer_matches_torch():
    from boundgen.quant import triton_quant

    if not triton_quant.AVAILABLE:
        pytest.skip("no triton")
    assert triton_quant.self_test(0) is None
    x = torch.randn(513, 4864, device="cuda", dtype=torch.bfloat16)
    q1, s1 = triton_quant.quantize_rowwise_triton(x)
    q2, s2 = quantize_rowwise(x)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=0)
    assert (q1.float() != q2.float()).float().mean() < 1e-3


@pytest.mark.gpu
@_fp8_gpu
def test_gpu_compile_uses_plain_quantizer():
    lin = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    from boundgen.quant import triton_quant

    layer = Fp8Linear.from_linear(lin, act_quant="triton" if triton_quant.AVAILABLE else "torch")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x).float(), layer(x).float(), rtol=2e-2, atol=2e-2)


def test_model_casts_keep_fp8_weights_and_scales():
    model = apply_fp8(ToyDecoder(layers=1), "mlp", emulate=True)
    layer = model.layers[0].mlp.down_proj
    w, s = layer.weight.clone(), layer.weight_scale.clone()
    model.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.weight.float(), w.float()) and torch.equal(layer.weight_scale, s)
    ids = torch.randint(0, model.vocab, (7,))
    with torch.no_grad():
        assert model(ids).dtype == torch.bfloat16
        model.float()
        assert layer.weight.dtype == torch.float8_e4m3fn and model(ids).dtype == torch.float32
