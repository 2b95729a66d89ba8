"""The beam decode-step attention kernel (`attention/beam_decode.py`) against the layer's
reference path: the prompt part through the reference backend, the beams' own slots
(`_own_slots_attention`) and the log-sum-exp merge.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`);
with CUDA the same tests run it compiled, and a `gpu` test runs a compiled whole search with it.
"""

from __future__ import annotations

import pytest
import torch
from beam_cases import case
from hopper import compile_in_child

pytest.importorskip("triton")

from boundgen.attention.backends import ReferenceBackend
from boundgen.attention.beam_decode import beam_decode
from boundgen.attention.cascade import merge_partial
from boundgen.compile.decode import _own_slots_attention

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def reference(q, pk, pv, bk, bv, step, cu_beams, cu_prompt):
    """What `decode_layer` computes without the kernel (float32 on the CPU)."""
    f = lambda x: x.float().cpu()
    max_b = int((cu_beams[1:] - cu_beams[:-1]).max())
    max_p = int((cu_prompt[1:] - cu_prompt[:-1]).max())
    shared, lse = ReferenceBackend().varlen(
        f(q), f(pk), f(pv), cu_beams.cpu(), cu_prompt.cpu(), max_b, max_p, False
    )
    own, own_lse = _own_slots_attention(f(q), f(bk), f(bv), step.cpu())
    return merge_partial(shared, lse, own, own_lse)


@pytest.mark.parametrize(
    ("widths", "prompts", "hq", "hkv", "d", "slots"),
    [
        ([4], [7], 4, 2, 16, 3),  # one prompt
        ([3, 3, 3], [5, 70, 1], 4, 1, 16, 4),  # a prompt over one key tile, a 1-token prompt
        ([16], [128], 14, 2, 64, 4),  # W4's shape (Qwen2.5-0.5B heads, 128-token prompt)
        ([20, 20], [9, 33], 14, 2, 64, 2),  # more rows than one program's BLOCK_M (20 x 7 = 140)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_m", "warps"),
    [(16, 1), (16, 4), (128, 4)],  # 16 rows: a beam's GQA heads split over two programs
)
def test_kernel_equals_the_reference_path_at_every_step(
    widths, prompts, hq, hkv, d, slots, dtype, block_m, warps
):
    q, pk, pv, bk, bv, cu_b, cu_p = case(widths, prompts, hq, hkv, d, slots, dtype)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for step in range(slots):  # slots past the step hold values the kernel must not see
        s = torch.tensor([step], dtype=torch.int64, device=DEV)
        got = beam_decode(q, pk, pv, bk, bv, s, cu_b, cu_p, max(widths), block_m, warps)
        want = reference(q, pk, pv, bk, bv, s, cu_b, cu_p)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


HOPPER = """
from boundgen.attention import beam_decode as m

gqa, d, scale_type, block_m, warps = (
    int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
)
fn = m._beam_decode_kernel
const = dict(
    SLOTS_P2=4, GQA=gqa, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m, BLOCK_N=m.BLOCK_N, IEEE=False,
    INTERPRET=False, PDL=True,
)
sig = {n: "i32" for n in fn.arg_names}
sig.update({n: "*bf16" for n in ("Q", "PK", "PV", "BK", "BV", "Out")})
sig.update({"STEP": "*i64", "CU_BEAMS": "*i32", "CU_PROMPT": "*i32"})
constexprs_with_scale(sig, const, scale_type, 0.125)
aligned = [n for n in fn.arg_names if sig[n].startswith("*")]
stages = 2
"""


@pytest.mark.parametrize(
    ("gqa", "d", "scale_type", "block_m", "warps"),
    [
        (7, 64, "fp32", 128, 4),
        (4, 128, "fp64", 128, 4),
        (7, 64, "constexpr", 128, 4),
        (7, 64, "fp32", 16, 1),  # one warp's 16 rows
        (7, 64, "fp32", 16, 4),  # 16 rows over four warps (the default)
        (7, 64, "fp32", 32, 2),
    ],
)
def test_kernel_compiles_for_hopper(gqa, d, scale_type, block_m, warps):
    """The interpreter runs the kernel as Python; this compiles it for sm_90 (the while loop to a
    runtime bound, the scale as Inductor's fp64 or a constexpr, 16 to 128 rows a program on one
    to four warps)."""
    out = compile_in_child(HOPPER, str(gqa), str(d), scale_type, str(block_m), str(warps))
    assert "waits first True" in out  # programmatic launch: nothing read before the wait


@pytest.mark.parametrize(
    ("mode", "backend", "fused"),
    [
        ("auto", "varlen", True),  # the kernel beats flash + the own-slot part, eager or compiled
        ("auto", "segments", True),
        ("auto", "flash", True),  # compiled layers' attention (`export_attention`)
        ("auto", "reference", False),  # exact math asked for by name keeps its own
        ("fused", "reference", True),
        ("flash", "varlen", False),
    ],
)
def test_decode_attention_choice(monkeypatch, engine_for, mode, backend, fused):
    """`beam_decode.chosen` picks the kernel where it measured faster, and the beam layers
    (`ModelSteps`) take what it picks."""
    from types import SimpleNamespace

    from boundgen.attention import beam_decode as module
    from boundgen.compile.decode import ModelSteps

    monkeypatch.setattr(module, "MODE", mode)
    assert module.chosen(backend) is fused
    steps = ModelSteps(engine_for("qwen2").model, SimpleNamespace(name=backend), False)
    assert steps.fused_attention is fused
    monkeypatch.setattr(module, "MODE", "fast")
    with pytest.raises(ValueError, match="BOUNDGEN_BEAM_ATTENTION='fast'.*auto, fused, flash"):
        module.chosen(backend)


def test_k_and_v_halves_of_one_buffer_or_apart_give_the_same_attention():
    """`BeamKV` hands the kernel k and v as the two halves of one buffer (equal strides); apart
    with other strides (a k laid out as a slice of a wider buffer) the kernel still reads both
    right."""
    q, pk, pv, bk, bv, cu_b, cu_p = case([4, 4], [9, 5], 4, 2, 16, 3, torch.float32)
    s = torch.tensor([2], dtype=torch.int64, device=DEV)
    want = beam_decode(q, pk, pv, bk, bv, s, cu_b, cu_p, 4, 16, 1)
    halves = torch.stack((bk, bv), 2)  # [N, S, 2, Hkv, D]
    got = beam_decode(q, pk, pv, halves[:, :, 0], halves[:, :, 1], s, cu_b, cu_p, 4, 16, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    wide_k = torch.cat((bk, torch.zeros_like(bk)), 2)[:, :, : bk.shape[2]]  # other strides than bv
    got = beam_decode(q, pk, pv, wide_k, bv, s, cu_b, cu_p, 4, 16, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tile_sets_the_kernel_s_tile_for_what_runs_inside_and_restores_it():
    """`tile` (a benchmark's variants side by side): the decode layers read `BLOCK_M` and
    `NUM_WARPS` as they trace; tiles the kernel has no build for are refused, and the default
    comes back."""
    from boundgen.attention import beam_decode as module

    before = (module.BLOCK_M, module.NUM_WARPS)
    with module.tile(16):
        assert (module.BLOCK_M, module.NUM_WARPS) == (16, module.DEFAULT_WARPS) == (16, 4)
    with module.tile(16, 1):
        assert (module.BLOCK_M, module.NUM_WARPS) == (16, 1)
    assert before == (module.BLOCK_M, module.NUM_WARPS)
    for bad in [(48, None), (16, 3)]:
        with (
            pytest.raises(ValueError, match="expected rows in 16, 32, 64, 128 and warps in 1, 2"),
            module.tile(*bad),
        ):
            pass
    assert before == (module.BLOCK_M, module.NUM_WARPS)


def test_the_environment_s_tile_is_checked_at_import():
    """`BOUNDGEN_BEAM_DECODE_ROWS` / `_WARPS` outside the kernel's builds fail at import, naming
    the variable, its value and the choices, as every `BOUNDGEN_*` switch does (a child process:
    the module is imported once per process)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, BOUNDGEN_BEAM_DECODE_ROWS="16")
    code = "from boundgen.attention import beam_decode as m; print(m.BLOCK_M, m.NUM_WARPS)"

    def run(warps: str) -> subprocess.CompletedProcess:
        env["BOUNDGEN_BEAM_DECODE_WARPS"] = warps
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    for warps in ("3", "four"):
        res = run(warps)
        assert res.returncode != 0
        want = f"BOUNDGEN_BEAM_DECODE_WARPS='{warps}': choose one of 1, 2, 4, 8"
        assert want in res.stderr
    res = run("4")
    assert res.stdout.split() == ["16", "4"], res.stderr[-2000:]
