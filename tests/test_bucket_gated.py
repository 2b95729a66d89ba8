"""A prefill bucket's gate_up + SiLU·mul as one GEMM with the epilogue (`models/bucket_gated.py`)
against the plain ops it replaces.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`)
under `stream.forced()`; with CUDA the same tests run the compiled kernel, and the `gpu` test runs
a decoder layer's MLP block inside `torch.compile` at bucket rows against the plain one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hopper import compile_in_child
from small_layer import check_gated, randn, small_config, spread_weights
from torch import nn

pytest.importorskip("triton")

from boundgen.models import bucket_gated, stream, stream_gated
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

if not bucket_gated.AVAILABLE:
    pytest.skip("Triton or torch's triton_op missing", allow_module_level=True)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# a tile the interpreter walks quickly: (rows, columns, K, GROUP_M, warps, stages)
SMALL = (32, 16, 32, 2, 4, 2)


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    """Streaming up to 16 rows, the bucket kernel on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 16)
    monkeypatch.setattr(bucket_gated, "GATED", True)


def _tile():
    return SMALL if not CUDA else None


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "i"),
    # one K step; K past a step and not a multiple of it; rows and columns not multiples of the
    # tile (the pointer kernel's loads wrap to the last row and column and its stores are
    # masked; TMA reads zeros past the edges and drops the stores there)
    [(32, 32, 16), (70, 136, 40), (100, 96, 56)],
)
def test_gated_is_silu_of_gate_times_up(m, k, i, persistent):
    check_gated(lambda x, w: bucket_gated.launch_gated(x, w, _tile(), persistent), m, k, i)


def test_the_persistent_kernel_takes_only_rows_tma_can_stride(monkeypatch):
    """TMA wants 16-byte rows: K 36 and I 20 are in float32, not in bf16 — there the pointer
    kernel runs, with the same result."""
    assert bucket_gated._tma_strides(torch.zeros(4, 36), 20)
    assert not bucket_gated._tma_strides(torch.zeros(4, 36, dtype=torch.bfloat16), 8)
    assert not bucket_gated._tma_strides(torch.zeros(4, 32, dtype=torch.bfloat16), 20)
    launched = []
    traceable = bucket_gated.triton_launch.traceable

    def spy(kernel):
        launched.append(getattr(kernel, "fn", kernel).__name__)
        return traceable(kernel)

    monkeypatch.setattr(bucket_gated.triton_launch, "traceable", spy)
    check_gated(lambda x, w: bucket_gated.launch_gated(x, w, _tile(), True), 40, 36, 20)
    assert launched == ["_gated_persistent_kernel", "_gated_kernel"]  # float32, then bf16


@pytest.mark.parametrize("persistent", [False, True])
def test_every_tile_is_written_in_its_grouped_order(persistent):
    """More row tiles than a group (7 of 32 rows, groups of 2: the last group one tile) and 5
    column tiles: the grouped order maps the programs onto every output tile once (the output
    starts as torch.empty: a tile no program wrote would hold garbage); the persistent kernel's
    4 programs (the interpreter's SMs) walk the 35 tiles."""
    g = torch.Generator().manual_seed(7)
    x = randn(g, 7 * 32, 32)
    w = randn(g, 2 * 5 * 16, 32, scale=0.2)
    with stream.forced():
        got = bucket_gated.launch_gated(x, w, _tile(), persistent)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, stream_gated.reference(x, w), rtol=2e-5, atol=2e-5)


def test_which_calls_the_kernel_takes(monkeypatch):
    layer = DecoderLayer(small_config()).to(DEV)
    gate_up = layer.mlp.gate_up_proj
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=torch.bfloat16)
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=torch.bfloat16)
    with stream.forced(), torch.no_grad():
        assert bucket_gated.applies(many, gate_up)
        assert not bucket_gated.applies(few, gate_up)  # few rows stream (`stream_gated`)
        assert not bucket_gated.applies(many, Fp8Linear.from_linear(gate_up, mode="emulate"))
        assert not bucket_gated.applies(many, nn.Linear(64, 128, bias=True).to(DEV))
        assert not bucket_gated.applies(many[None], gate_up)  # 3-D
        with bucket_gated.enabled(False):
            assert not bucket_gated.applies(many, gate_up)
    if not CUDA:  # outside the interpreter's switch, CPU tensors never take it
        assert not bucket_gated.applies(many, gate_up)
    monkeypatch.setattr(bucket_gated, "GATED", False)
    with bucket_gated.enabled(True):
        assert bucket_gated.GATED
    assert not bucket_gated.GATED  # the switch restored


def test_the_form_switch_sets_both_flags_and_refuses_an_unknown_form(monkeypatch):
    monkeypatch.setattr(bucket_gated, "PERSISTENT", False)
    bucket_gated.set_form("persist")
    assert bucket_gated.GATED and bucket_gated.PERSISTENT
    bucket_gated.set_form("0")
    assert not bucket_gated.GATED and not bucket_gated.PERSISTENT
    bucket_gated.set_form("1")
    assert bucket_gated.GATED and not bucket_gated.PERSISTENT
    with pytest.raises(ValueError, match="BOUNDGEN_BUCKET_GATED='tma'.*persist"):
        bucket_gated.set_form("tma")


@pytest.mark.parametrize(("form", "flags"), [("persist", "True True"), ("0", "False False")])
def test_the_environment_picks_the_form(form, flags):
    code = "from boundgen.models import bucket_gated as b; print(b.GATED, b.PERSISTENT)"
    env = {**os.environ, "BOUNDGEN_BUCKET_GATED": form}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.stdout.split("\n")[-2] == flags, res.stderr[-2000:]


def test_the_packages_key_names_the_kernel(monkeypatch):
    """Packages built with the pointer kernel keep their key ("1"); the persistent kernel's are
    keyed apart, and none is recorded with the kernel off."""
    from boundgen.compile.cache import platform_info

    for form, key in (("0", None), ("1", "1"), ("persist", "persist")):
        monkeypatch.setattr(bucket_gated, "GATED", form != "0")
        monkeypatch.setattr(bucket_gated, "PERSISTENT", form == "persist")
        assert platform_info("cpu").get("bucket_gated") == key


def test_a_decoder_layers_mlp_with_the_kernel_equals_it_without(monkeypatch):
    """A layer's MLP block (norm, gate_up + SiLU·mul, down, residual) at more rows than stream,
    with the kernel against the same block without it. Float32 on the CPU (the interpreter), bf16
    on CUDA."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = small_config(intermediate_size=200)
    layer = DecoderLayer(cfg).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)
    x = torch.randn(40, cfg.hidden_size, device=DEV, dtype=dtype)
    calls = []
    original = bucket_gated.gated
    monkeypatch.setattr(bucket_gated, "gated", lambda *a: calls.append(1) or original(*a))
    if not CUDA:  # the interpreter walks the default tile slowly: a small one
        monkeypatch.setattr(bucket_gated, "GATED_TILE", SMALL)
    with torch.no_grad(), stream.forced():
        with bucket_gated.enabled(False):
            plain = layer.mlp_block(x)
        assert calls == []
        got = layer.mlp_block(x)
    assert calls == [1]
    assert got.dtype == plain.dtype and got.shape == plain.shape
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), plain.float(), rtol=tol, atol=tol)


HOPPER = """
from boundgen.models import bucket_gated

block_m, block_n, block_k, group_m, warps, stages = bucket_gated.GATED_TILE
const = dict(INTER=4864, K=int(sys.argv[1]), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
             GROUP_M=group_m, PRECISION="tf32", INTERPRET=False)
if sys.argv[2] == "persistent":
    fn = bucket_gated._gated_persistent_kernel
    const["PROGRAMS"] = 132
else:
    fn = bucket_gated._gated_kernel
sig = {"X": "*bf16", "W": "*bf16", "Out": "*bf16", "M": "i32"}
sig.update(dict.fromkeys(const, "constexpr"))
aligned = ["X", "W", "Out"]
"""


@pytest.mark.parametrize(
    ("k", "kernel"), [(896, "tile"), (900, "tile"), (896, "persistent"), (904, "persistent")]
)
def test_the_kernel_compiles_for_hopper(k, kernel):
    """Compiled for sm_90 by Triton's bundled ptxas (no GPU needed) with its default tile at
    Qwen2.5-0.5B's gate_up (K 896, I 4,864), and with a K that is not a multiple of the step (the
    masked last step; the persistent kernel's TMA reads zeros past it, its rows 16-byte
    multiples); either kernel."""
    assert "cubin" in compile_in_child(HOPPER, str(k), kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("rows", [1920, 300])
def test_a_compiled_layer_with_the_kernel_equals_the_plain_one(rows, persistent, monkeypatch):
    """Inside `torch.compile` (the op traced) at W2's 1,920 rows and a bucket's rows past the
    tile, Qwen2.5-0.5B's shapes, the MLP block against the plain layer's; either kernel (the
    persistent one's descriptors' scratch from Inductor's launcher)."""
    monkeypatch.setattr(bucket_gated, "PERSISTENT", persistent)
    torch.manual_seed(0)
    cfg = small_config(hidden_size=896, intermediate_size=4864, num_heads=14, head_dim=64)
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16).requires_grad_(False)
    spread_weights(layer, 0.02)
    x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(layer.mlp_block)
    with torch.no_grad():
        got = compiled(x)
        with bucket_gated.enabled(False):
            want = layer.mlp_block(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
