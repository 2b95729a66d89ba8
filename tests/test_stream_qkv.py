"""qkv (+ bias) and the q/k rotation as one weight-streaming GEMM (`models/stream_qkv.py`) against
the plain projection and the rotation it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`; with CUDA the same tests run the compiled kernel, and the `gpu` test runs
a decoder layer's attention input inside `torch.compile` against the plain layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hopper import compile_in_child
from small_layer import small_config, spread_weights

pytest.importorskip("triton")

from boundgen.models import stream, stream_qkv
from boundgen.models.decoder import DecoderLayer
from boundgen.models.layers import RotaryEmbedding, apply_rope
from boundgen.quant.fp8 import Fp8Linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Streaming on (64 rows) and the qkv kernel on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 64)
    monkeypatch.setattr(stream_qkv, "ROTATED", True)


def _angles(g, m: int, half: int, dtype):
    """cos, sin [m, 1, D/2] of random positions' angles (|·| ≤ 1, as a RoPE table's)."""
    theta = torch.rand(m, 1, half, generator=g) * 6.3
    return theta.cos().to(dtype).to(DEV), theta.sin().to(dtype).to(DEV)


@pytest.mark.parametrize(
    ("m", "k", "heads", "kv_heads", "d", "bias"),
    # one K step, K past a step and not a multiple of it, rows from 1 to past a 16-row block,
    # head dims 32 and 64, 128 (two pair tiles a half), with and without a bias
    [
        (1, 96, 2, 1, 32, True),
        (5, 300, 4, 2, 64, True),
        (17, 130, 2, 2, 32, False),
        (64, 256, 4, 1, 64, True),
        (70, 128, 2, 1, 128, True),
    ],
)
def test_the_kernel_is_the_projection_with_q_and_k_rotated(m, k, heads, kv_heads, d, bias):
    g = torch.Generator().manual_seed(m * k + d)
    n, rotated = (heads + 2 * kv_heads) * d, (heads + kv_heads) * d
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(m, k, generator=g)).to(dtype).to(DEV)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEV)
        b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEV) if bias else None
        cos, sin = _angles(g, m, d // 2, dtype)
        with stream.forced():
            got = stream_qkv.rotated(x, w, b, cos, sin, rotated)
        want = stream_qkv.reference(x, w, b, cos, sin, rotated)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=tol, atol=tol)
    # the oracle itself: q and k heads rotated by the model's rotation, v as projected
    x, w, cos, sin = x.float(), w.float(), cos.float(), sin.float()
    y = F.linear(x, w, b.float() if bias else None)
    qk = apply_rope(y[:, :rotated].view(m, heads + kv_heads, d), cos, sin).reshape(m, rotated)
    want = torch.cat((qk, y[:, rotated:]), dim=1)
    got = stream_qkv.reference(x, w, b.float() if bias else None, cos, sin, rotated)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_the_kernel_wants_whole_heads_of_x_s_width():
    x = torch.zeros(4, 100, device=DEV)
    cos = torch.zeros(4, 1, 16, device=DEV)
    with stream.forced(), pytest.raises(RuntimeError):  # K 100 against the weight's 96
        stream_qkv.rotated(x, torch.zeros(128, 96, device=DEV), None, cos, cos, 64)
    with stream.forced(), pytest.raises(RuntimeError):  # 112 columns: not whole 32-wide heads
        stream_qkv.rotated(x, torch.zeros(112, 100, device=DEV), None, cos, cos, 64)


def test_which_calls_the_kernel_takes(monkeypatch):
    layer = DecoderLayer(small_config(head_dim=32)).to(DEV)
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=torch.bfloat16)
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=torch.bfloat16)
    qkv = layer.self_attn.qkv_proj
    with stream.forced(), torch.no_grad():
        assert stream_qkv.applies(few, qkv, 32)
        assert not stream_qkv.applies(few, qkv, 16)  # half a head: 8 pairs, less than a tile
        assert not stream_qkv.applies(many, qkv, 32)  # more rows than stream.MAX_ROWS
        assert not stream_qkv.applies(few, Fp8Linear.from_linear(qkv, mode="emulate"), 32)
        with stream.rows_up_to(0):  # streaming off: this kernel too
            assert not stream_qkv.applies(few, qkv, 32)
        with stream_qkv.enabled(False):
            assert not stream_qkv.applies(few, qkv, 32)
    assert not stream_qkv.applies(few, qkv, 32)  # outside forced(): never the interpreter
    monkeypatch.setattr(stream_qkv, "ROTATED", False)
    with stream_qkv.enabled(True):
        assert stream_qkv.ROTATED
    assert not stream_qkv.ROTATED  # the switch restored


def _layer_and_input(rows: int, **cfg):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    config = small_config(head_dim=32, **cfg)
    layer = DecoderLayer(config).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)
    rope = RotaryEmbedding(config).to(DEV)
    cos, sin = rope(torch.arange(rows, device=DEV) * 3, dtype)
    return layer, torch.randn(rows, 64, device=DEV, dtype=dtype), cos, sin, dtype


@pytest.mark.parametrize("grouped", [False, True])
def test_a_decoder_layer_s_attention_input_with_the_kernel_equals_it_without(grouped, monkeypatch):
    """q, k and v of a layer with the kernel against the same layer without it (float32 on the
    CPU, the interpreter; bf16 on CUDA); grouped queries (`cascade.grouped_rows_attention`)
    rotate apart, so the kernel leaves them to the plain path."""
    layer, x, cos, sin, dtype = _layer_and_input(12)
    calls, rotated = [], stream_qkv.rotated

    def spy(*args):
        calls.append(tuple(args[1].shape))
        return rotated(*args)

    monkeypatch.setattr(stream_qkv, "rotated", spy)
    with torch.no_grad(), stream.forced():
        with stream_qkv.enabled(False):
            plain = layer.attention_input(x, cos, sin, grouped=grouped)
        assert calls == []
        got = layer.attention_input(x, cos, sin, grouped=grouped)
    assert calls == ([] if grouped else [(256, 64)])  # (4 + 2 · 2) heads of 32
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(got, plain, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_a_decode_step_with_the_kernel_stores_the_same_slot(monkeypatch):
    """`decode_input` (a beam step: q out, k and v into the cache's slot) with the kernel, which
    writes the slot itself (`rotated_into_slot`), gives the plain path's q and slot."""
    layer, x, cos, sin, dtype = _layer_and_input(6)
    out, calls, into_slot = {}, [], stream_qkv.rotated_into_slot
    monkeypatch.setattr(stream_qkv, "rotated", lambda *a: pytest.fail("the copying path taken"))
    monkeypatch.setattr(
        stream_qkv, "rotated_into_slot", lambda *a: calls.append(1) or into_slot(*a)
    )
    for on in (False, True):
        kv = torch.zeros(6, 3, 2, 2, 32, device=DEV, dtype=dtype)
        with torch.no_grad(), stream.forced(), stream_qkv.enabled(on):
            q = layer.decode_input(x, cos, sin, kv, torch.tensor([1], device=DEV))
        out[on] = (q, kv)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    assert out[True][1][:, [0, 2]].abs().max() == 0  # only slot 1 written
    assert calls == [1]


def test_qwen3_s_normed_heads_keep_the_plain_path(monkeypatch):
    """q/k norms (Qwen3) rotate apart: the kernel never takes them."""
    layer, x, cos, sin, _ = _layer_and_input(4, qk_norm=True, qkv_bias=False)
    monkeypatch.setattr(stream_qkv, "rotated", lambda *a: pytest.fail("kernel taken"))
    with torch.no_grad(), stream.forced():
        layer.attention_input(x, cos, sin)


HOPPER = """
from boundgen.models import stream_qkv

fn = stream_qkv._qkv_kernel
k, n, d, block_m, slot = (int(a) for a in sys.argv[1:6])
const = dict(K=k, N=n, HEAD_D=d, ROT_COLS=n - 128, Q_COLS=n - 2 * 128, KV_COLS=128,
             SLOT=bool(slot), HAS_BIAS=True, BLOCK_M=block_m, BLOCK_H=stream_qkv.BLOCK_H,
             BLOCK_K=stream_qkv.BLOCK_K, PRECISION="tf32", INTERPRET=False, PDL=True)
sig = {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "Cos": "*bf16", "Sin": "*bf16", "Out": "*bf16",
       "KV": "*bf16", "Step": "*i64", "M": "i32", "stride_xm": "i32", "stride_rope": "i32",
       "stride_out": "i32", "stride_kv_row": "i32", "stride_kv_slot": "i32",
       "stride_kv_kind": "i32"}
sig.update(dict.fromkeys(const, "constexpr"))
aligned = ["X", "W", "Bias", "Cos", "Sin", "Out", "KV", "stride_xm", "stride_rope", "stride_out",
           "stride_kv_row", "stride_kv_slot", "stride_kv_kind"]
warps, stages = stream_qkv.NUM_WARPS, stream_qkv.NUM_STAGES
"""


@pytest.mark.parametrize(("block_m", "slot"), [(16, 0), (64, 0), (16, 1)])
def test_the_kernel_compiles_for_hopper(block_m, slot):
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed): Qwen2.5-0.5B's qkv (K 896,
    14 + 2 + 2 heads of 64) at a 16-row tile and a 64-row one, and at 16 rows writing k and v into
    a beam step's cache slot."""
    out = compile_in_child(HOPPER, "896", "1152", "64", str(block_m), str(slot))
    assert "waits first True" in out  # programmatic launch: nothing read before the wait


@pytest.mark.gpu
def test_a_compiled_layer_with_the_kernel_equals_the_plain_one():
    """Inside `torch.compile` (the op traced) at 16, 64 and 128 rows, the rows marked dynamic as
    the compiled beam layers' are: q, k and v against the plain layer's."""
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2,
                       head_dim=64, max_position_embeddings=4096)  # fmt: skip
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    spread_weights(layer, 0.02)
    rope = RotaryEmbedding(cfg).to("cuda")
    compiled = torch.compile(layer.attention_input)
    for rows in (16, 64, 128):
        x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope(torch.randint(0, 4096, (rows,), device="cuda"), torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            with stream.rows_up_to(128):
                got = compiled(x, cos, sin)
            with stream_qkv.enabled(False):
                want = layer.attention_input(x, cos, sin)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
