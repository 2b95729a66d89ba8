"""A prefill bucket's gate_up + SiLU·mul and qkv + q/k rotation as TMA-fed GEMMs
(`models/bucket_tma.py`) against the plain ops they replace.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`, their tensor descriptors included; with CUDA the same tests run the
compiled kernels, and the `gpu` test runs a decoder layer inside `torch.compile` at bucket rows
against the plain layer.
"""

from __future__ import annotations

import pytest
import torch
from hopper import compile_in_child
from small_layer import randn, small_config
from torch import nn

pytest.importorskip("triton")

from boundgen.models import bucket_tma, stream, stream_gated, stream_qkv
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

if not bucket_tma.AVAILABLE:
    pytest.skip("Triton without host-side tensor descriptors", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# tiles the interpreter walks quickly, several a program: (rows, columns, K, GROUP_M, warps,
# stages); qkv's columns a head's half of 16
SMALL = (32, 16, 32, 2, 4, 2)


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """Streaming up to 16 rows, both bucket kernels on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 16)
    monkeypatch.setattr(bucket_tma, "GATED", True)
    monkeypatch.setattr(bucket_tma, "ROTATED", True)


def _angles(m: int, half: int, dtype, device=DEV):
    """cos, sin [m, 1, D/2] of m positions' angles (|·| ≤ 1, as a RoPE table's)."""
    theta = torch.arange(m, dtype=torch.float32)[:, None, None] * torch.linspace(0.05, 1.3, half)
    return theta.cos().to(dtype).to(device), theta.sin().to(dtype).to(device)


def _tile():
    return SMALL if not CUDA else None


@pytest.mark.parametrize(
    ("m", "k", "i"),
    # one K step; K past a step and not a multiple of it; rows and columns not multiples of the
    # tile (TMA fills past the edges with zeros and clips the stores)
    [(32, 32, 16), (70, 136, 40), (100, 96, 56)],
)
def test_gated_is_silu_of_gate_times_up(m, k, i):
    g = torch.Generator().manual_seed(m * k + i)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(g, m, k, dtype=dtype)
        w = randn(g, 2 * i, k, dtype=dtype, scale=k**-0.5)
        with stream.forced():
            got = bucket_tma.launch_gated(x, w, _tile())
        want = stream_gated.reference(x, w)
        assert got.dtype == dtype and got.shape == (m, i)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)


def test_every_tile_is_walked_by_some_program():
    """Fewer programs than tiles (the interpreter's three; an SM each on a GPU): each program
    walks every PROGRAMS-th tile, GROUP_M row tiles together, and no output tile is left
    unwritten (the output starts as torch.empty: a skipped tile would hold garbage)."""
    g = torch.Generator().manual_seed(7)
    x = randn(g, 7 * 32, 32)
    w = randn(g, 2 * 5 * 16, 32, scale=0.2)
    with stream.forced():
        got = bucket_tma.launch_gated(x, w, _tile())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, stream_gated.reference(x, w), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("m", "k"), [(40, 64), (70, 96)])
def test_rotated_is_qkv_with_q_and_k_rotated(m, k, bias):
    """Heads of 32 (halves of 16: one tile a half), 3 q + 1 k heads rotated, 1 v head as
    computed; rows past the tile; bias or not; against `stream_qkv.reference` (the projection
    rounded, then rotated in float32 and rounded once)."""
    g = torch.Generator().manual_seed(m + k + bias)
    d, heads = 32, 5
    rot = 4 * d
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(g, m, k, dtype=dtype)
        w = randn(g, heads * d, k, dtype=dtype, scale=k**-0.5)
        b = randn(g, heads * d, dtype=dtype) if bias else None
        cos, sin = _angles(m, d // 2, dtype)
        with stream.forced():
            got = bucket_tma.launch_qkv(x, w, b, cos, sin, rot, _tile())
        want = stream_qkv.reference(x, w, b, cos, sin, rot)
        assert got.dtype == dtype and got.shape == (m, heads * d)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)


def test_which_calls_the_kernels_take(monkeypatch):
    layer = DecoderLayer(small_config(head_dim=32)).to(DEV)  # halves of 16: a tile each
    gate_up, qkv = layer.mlp.gate_up_proj, layer.self_attn.qkv_proj
    d = layer.self_attn.head_dim
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=torch.bfloat16)
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=torch.bfloat16)
    with stream.forced(), torch.no_grad():
        assert bucket_tma.applies(many, gate_up) and bucket_tma.rotates(many, qkv, d)
        # few rows stream (`stream_gated`, `stream_qkv`)
        assert not bucket_tma.applies(few, gate_up) and not bucket_tma.rotates(few, qkv, d)
        fp8 = Fp8Linear.from_linear(gate_up, mode="emulate")
        assert not bucket_tma.applies(many, fp8)
        odd = torch.zeros(stream.MAX_ROWS + 1, 60, device=DEV, dtype=torch.bfloat16)
        assert not bucket_tma.applies(odd, nn.Linear(60, 128, bias=False))  # 120-byte rows
        assert not bucket_tma.applies(many, nn.Linear(64, 128, bias=True).to(DEV))
        assert bucket_tma.rotates(many, nn.Linear(64, 128, bias=True).to(DEV), 32)
        assert not bucket_tma.rotates(many, qkv, 16)  # halves of 8: under tl.dot's 16
        with bucket_tma.enabled(False, False):
            assert not bucket_tma.applies(many, gate_up)
            assert not bucket_tma.rotates(many, qkv, d)
        with bucket_tma.enabled(True, False):
            assert bucket_tma.applies(many, gate_up) and not bucket_tma.rotates(many, qkv, d)
    if not CUDA:  # outside the interpreter's switch, CPU tensors never take them
        assert not bucket_tma.applies(many, gate_up) and not bucket_tma.rotates(many, qkv, d)
    monkeypatch.setattr(bucket_tma, "GATED", False)
    with bucket_tma.enabled(True, True):
        assert bucket_tma.GATED and bucket_tma.ROTATED
    assert not bucket_tma.GATED and bucket_tma.ROTATED  # the switches restored


def test_a_decoder_layer_with_the_kernels_equals_it_without(monkeypatch):
    """A whole layer (norm, qkv + rotation, attention, o_proj, MLP) at more rows than stream,
    with both kernels against the same layer without them. Float32 on the CPU (the
    interpreter), bf16 on CUDA."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = small_config(intermediate_size=200, head_dim=32, qkv_bias=True)
    layer = DecoderLayer(cfg).to(DEV, dtype)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.1)
    t = 40
    x = torch.randn(t, cfg.hidden_size, device=DEV, dtype=dtype)
    cos, sin = _angles(t, cfg.head_dim // 2, dtype)
    calls = []
    for name in ("gated", "rotated"):
        original = getattr(bucket_tma, name)

        def spy(*args, name=name, original=original):
            calls.append(name)
            return original(*args)

        monkeypatch.setattr(bucket_tma, name, spy)
    if not CUDA:  # the interpreter walks the default tiles slowly: small ones
        monkeypatch.setattr(bucket_tma, "GATED_TILE", SMALL)
        monkeypatch.setattr(bucket_tma, "QKV_TILE", SMALL)
    with torch.no_grad(), stream.forced():
        with bucket_tma.enabled(False, False):
            plain = layer.mlp_block(x), layer.attention_input(x, cos, sin)
        assert calls == []
        got = layer.mlp_block(x), layer.attention_input(x, cos, sin)
    assert sorted(calls) == ["gated", "rotated"]
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, plain):
        a, b = (a,) if torch.is_tensor(a) else a, (b,) if torch.is_tensor(b) else b
        for u, v in zip(a, b):
            assert u.dtype == v.dtype and u.shape == v.shape
            torch.testing.assert_close(u.float(), v.float(), rtol=tol, atol=tol)


HOPPER = """
from boundgen.models import bucket_tma

kind = sys.argv[1]
block_m, block_n, block_k, group_m, warps, stages = (
    bucket_tma.GATED_TILE if kind == "gated" else bucket_tma.qkv_tile(64)
)
const = dict(K=896, PROGRAMS=132, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=group_m,
             PRECISION="tf32", INTERPRET=False)
weight = f"tensordesc<bf16[{block_n},{block_k}]>"
sig = {"x_desc": f"tensordesc<bf16[{block_m},{block_k}]>", "w_desc": weight,
       "o_desc": f"tensordesc<bf16[{block_m},{block_n}]>"}
if kind == "gated":
    fn = bucket_tma._gated_kernel
    sig["M"] = "i32"
    const.update(INTER=4864, BLOCK_N=block_n)
else:
    fn = bucket_tma._qkv_kernel
    sig.update(Bias="*bf16", Cos="*bf16", Sin="*bf16", M="i32", stride_rope="i32")
    const.update(N=1152, HEAD_D=64, ROT_COLS=1024, HAS_BIAS=True, BLOCK_H=block_n)
sig.update(dict.fromkeys(const, "constexpr"))
aligned = []
"""


@pytest.mark.parametrize("kind", ["gated", "qkv"])
def test_the_kernels_compile_for_hopper(kind):
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed) with their default tiles at
    Qwen2.5-0.5B's shapes (gate_up K 896, I 4,864; qkv N 1,152 with bias, heads of 64): the
    tensor descriptors' loads and stores, the persistent tile walk and the epilogues."""
    assert "cubin" in compile_in_child(HOPPER, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1920, 300])
def test_a_compiled_layer_with_the_kernels_equals_the_plain_one(rows):
    """Inside `torch.compile` (the ops traced with their tensor descriptors) at W2's 1,920 rows
    and a bucket's rows past the tile, Qwen2.5-0.5B's shapes, the MLP block and the attention's
    input against the plain layer."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    torch.manual_seed(0)
    cfg = small_config(
        hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
        qkv_bias=True,
    )  # fmt: skip
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.02)
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    cos, sin = _angles(rows, 32, torch.bfloat16, "cuda")
    torch._dynamo.reset()
    mlp, qkv = torch.compile(layer.mlp_block), torch.compile(layer.attention_input)
    with torch.no_grad():
        got = [mlp(x), *qkv(x, cos, sin)]
        with bucket_tma.enabled(False, False):
            want = [layer.mlp_block(x), *layer.attention_input(x, cos, sin)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
