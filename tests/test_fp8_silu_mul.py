"""The gated MLP's SiLU·mul and the FP8 down projection's input quantize as one Triton kernel
(`boundgen::silu_mul_quant`). Without CUDA the kernel runs in Triton's interpreter (conftest.py),
whose bf16 and e4m3 casts do not round to nearest: there the kernel's arithmetic is checked in
fp32, what only the compiler checks by compiling it for sm_90, and exact e4m3 values on the GPU."""

from __future__ import annotations

import pytest
import torch
from hopper import compile_in_child
from torch import nn

from boundgen.models.layers import GatedMLP
from boundgen.quant import Fp8Linear
from boundgen.quant.rowwise import FP8_MAX, SCALE_EPS, quantize_rowwise

triton_quant = pytest.importorskip("boundgen.quant.triton_quant")
if not triton_quant.AVAILABLE:
    pytest.skip("no triton", allow_module_level=True)


def _eager(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU)")
@pytest.mark.parametrize("chunk", [0, 32])
@pytest.mark.parametrize("width", [96, 100, 448])
def test_kernel_arithmetic_before_the_cast(width, chunk):
    """In fp32 (a q buffer of fp32 makes the final cast a no-op) the kernel computes eager's
    SiLU·mul scaled so each row's max-abs is ±448, and the row's scale; zero rows stay finite;
    widths that are not a power of two are masked. The same with each row whole (chunk 0) and by
    32-wide pieces (several, the last one partly masked)."""
    g = torch.Generator().manual_seed(width)
    m = 9
    gate_up = torch.randn(m, 2 * width, generator=g) * 3
    gate_up[4] = 0
    q = torch.empty(m, width)
    s = torch.empty(m, 1)
    triton_quant._silu_mul_quant_kernel[(m,)](
        gate_up, q, s, width, gate_up.stride(0), q.stride(0),
        BLOCK=chunk or 1 << (width - 1).bit_length(), FP8_MAX_C=FP8_MAX, EPS=SCALE_EPS,
        CHUNKED=bool(chunk), INTERPRET=True,
    )  # fmt: skip
    x = _eager(gate_up)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=SCALE_EPS * FP8_MAX)
    torch.testing.assert_close(s, amax / FP8_MAX, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        q, (x * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX), rtol=1e-5, atol=1e-4
    )
    peaks = q.abs().amax(-1)[torch.arange(m) != 4]
    torch.testing.assert_close(peaks, torch.full_like(peaks, FP8_MAX))
    assert s[4].item() > 0 and q[4].eq(0).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU)")
@pytest.mark.parametrize("width", [100, 320, 448])
def test_a_row_in_power_of_two_pieces_computes_the_same(width):
    """`PIECES`: the row in registers as power-of-two pieces ending at K (100: one piece of 128,
    320: 256 + 64, 448: 256 + 128 + 64), the max over all of them, each piece quantized by it —
    in fp32 the same numbers as the whole row padded to a power of two."""
    g = torch.Generator().manual_seed(width)
    m = 7
    gate_up = torch.randn(m, 2 * width, generator=g) * 3
    gate_up[2] = 0
    parts = triton_quant.pieces(width)
    assert sum(parts) >= width and sum(parts) - width < 64
    out = []
    for chunk in (0, triton_quant.PIECES):
        q, s = torch.empty(m, width), torch.empty(m, 1)
        triton_quant._silu_mul_quant_kernel[(m,)](
            gate_up, q, s, width, gate_up.stride(0), q.stride(0),
            FP8_MAX_C=FP8_MAX, EPS=SCALE_EPS, INTERPRET=True,
            **triton_quant.kernel_constants(width, chunk),
        )  # fmt: skip
        out.append((q, s))
    (q1, s1), (q2, s2) = out
    assert torch.equal(s1, s2) and torch.equal(q1, q2)
    x = _eager(gate_up)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=SCALE_EPS * FP8_MAX)
    torch.testing.assert_close(s2, amax / FP8_MAX, rtol=1e-6, atol=0)


def test_pieces_of_a_width():
    assert triton_quant.pieces(4864) == (4096, 512, 256)
    assert triton_quant.pieces(3072) == (2048, 1024)
    assert triton_quant.pieces(8192) == (8192,)
    assert triton_quant.pieces(100) == (128,)  # rounded up to 64: the last lanes masked
    with pytest.raises(ValueError, match="5 power-of-two pieces"):
        triton_quant.pieces(64 * 31)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (CPU)")
def test_op_returns_e4m3_rows_and_fp32_scales():
    gate_up = torch.randn(5, 2 * 64)
    q, s = torch.ops.boundgen.silu_mul_quant(gate_up)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 64)
    assert s.dtype == torch.float32 and s.shape == (5, 1)
    torch.testing.assert_close(s, quantize_rowwise(_eager(gate_up))[1], rtol=1e-6, atol=0)


def test_down_projection_takes_the_gate_up_rows():
    """`GatedMLP` hands an FP8 down projection its gate_up output; on CPU (and with act_quant
    "torch") that is eager's SiLU·mul into the projection: the same numbers as before."""
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96).to(torch.bfloat16)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    down = Fp8Linear.from_linear(mlp.down_proj, mode="emulate", act_quant="torch")
    want = down(_eager(mlp.gate_up_proj(x)))
    mlp.down_proj = down
    assert torch.equal(mlp(x), want)


def test_the_fused_quantize_is_part_of_the_compile_key():
    """A bucket compiled with the fused op is not the one compiled with Inductor's quantize, nor
    one compiled with other tiles for it."""
    from boundgen.compile.cache import model_fingerprint

    def model(act_quant):
        torch.manual_seed(0)
        mlp = GatedMLP(64, 96)
        mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj, mode="emulate", act_quant=act_quant)
        return mlp

    assert model_fingerprint(model("torch")) != model_fingerprint(model("triton"))
    assert model_fingerprint(model("torch")) == model_fingerprint(model("torch"))
    untiled = model_fingerprint(model("triton"))
    triton_quant.TILES[96] = (32, 2)  # a tile for this K: another kernel in the graph
    try:
        assert model_fingerprint(model("triton")) != untiled
    finally:
        del triton_quant.TILES[96]
    assert model_fingerprint(model("triton")) == untiled


HOPPER = """
from boundgen.quant import triton_quant

width, name, chunk = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
fn = getattr(triton_quant, name)
if "CHUNKED" in fn.arg_names:
    const = dict(triton_quant.kernel_constants(width, chunk), INTERPRET=False)
else:
    const = dict(BLOCK=chunk or triton.next_power_of_2(width))
block = const["BLOCK"]
const.update(FP8_MAX_C=448.0, EPS=1e-12)
sig = {n: "i32" for n in fn.arg_names}
sig.update({fn.arg_names[0]: "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"})
sig.update(dict.fromkeys(const, "constexpr"))
aligned = []  # (no divisibility hints)
warps, stages = triton_quant.default_warps(block), 3
"""


@pytest.mark.parametrize(
    ("width", "kernel", "chunk"),
    [
        (4864, "_silu_mul_quant_kernel", 0),
        (8192, "_silu_mul_quant_kernel", 0),
        (4864, "_silu_mul_quant_kernel", 1024),
        (4864, "_silu_mul_quant_kernel", triton_quant.PIECES),
        (3072, "_silu_mul_quant_kernel", triton_quant.PIECES),
        (896, "_quant_rows_kernel", 0),
    ],
)
def test_kernel_compiles_for_hopper(width, kernel, chunk):
    """The interpreter runs the kernels as Python; this compiles them for sm_90 (Triton's bundled
    ptxas, no GPU needed): the fused one at the MLP widths of Qwen2.5-0.5B and Llama-3.2-1B, whole
    rows and by pieces (its loop-carried max included), and whole rows as power-of-two pieces at
    Qwen2.5-0.5B's and Qwen3-0.6B's (three and two pieces), the rowwise one at a hidden size."""
    compile_in_child(HOPPER, str(width), kernel, str(chunk))


# -- GPU -------------------------------------------------------------------------------------------
_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 (sm_89+)",
)


@pytest.mark.gpu
@_fp8_gpu
@pytest.mark.parametrize("width", [4864, 896])
def test_gpu_op_matches_eager_silu_mul_and_quantize(width):
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(513, 2 * width, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    gate_up[7] = 0
    q1, s1 = torch.ops.boundgen.silu_mul_quant(gate_up)
    q2, s2 = triton_quant.silu_mul_quant_reference(gate_up)
    torch.testing.assert_close(s1, s2, rtol=1e-2, atol=0)
    assert (q1.float() != q2.float()).float().mean().item() < 1e-2


@pytest.mark.gpu
@_fp8_gpu
@pytest.mark.parametrize(
    ("chunk", "warps"),
    [(0, 16), (512, 4), (1024, 4), (2048, 8), (triton_quant.PIECES, 8), (triton_quant.PIECES, 16)],
)
def test_gpu_tiles_give_the_same_bits(chunk, warps):
    """Every tile choice `bench_fp8.py` sweeps computes the same e4m3 values and scales (the same
    expressions; the row max is exact): a tile is a speed choice only."""
    g = torch.Generator(device="cuda").manual_seed(1)
    gate_up = torch.randn(300, 2 * 4864, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    q1, s1 = triton_quant.launch_silu_mul_quant(gate_up)
    q2, s2 = triton_quant.launch_silu_mul_quant(gate_up, chunk, warps)
    assert torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.gpu
@_fp8_gpu
def test_gpu_compiled_and_exported_mlp_keep_the_op():
    """torch.compile and torch.export take the op as one node; the compiled MLP equals eager."""
    torch.manual_seed(0)
    # inference only, as the engine loads models: `_scaled_mm` has no derivative, so a module
    # that still requires grad fails to compile (H200, 2026-12-02)
    mlp = GatedMLP(896, 4864).to("cuda", torch.bfloat16).requires_grad_(False)
    mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj, act_quant="triton")
    x = torch.randn(300, 896, device="cuda", dtype=torch.bfloat16)
    eager = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True)(x)
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
    ep = torch.export.export(mlp, (x,))
    assert any("silu_mul_quant" in str(n.target) for n in ep.graph.nodes), ep.graph
