"""The own-slot + merge kernel (`attention/own_slots.py`) against the decode layer's Inductor path:
the prompt part through the reference backend as grouped rows, `_own_slots_attention` and the
log-sum-exp merge.

Without CUDA the kernel runs in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`);
with CUDA the same tests run it compiled. `test_kernel_compiles_for_hopper` compiles it for sm_90
without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from beam_cases import case
from hopper import compile_in_child

pytest.importorskip("triton")

from boundgen.attention.backends import ReferenceBackend
from boundgen.attention.cascade import (
    by_kv_head,
    grouped_rows_attention,
    grouped_rows_partial,
    merge_partial,
)
from boundgen.attention.own_slots import own_slots_merge
from boundgen.compile.decode import _own_slots_attention

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def prompt_part(q, pk, pv, cu_beams, cu_prompt, group):
    """The prompt attention as `decode_layer` runs it: query heads of a KV head as rows."""
    backend = ReferenceBackend()
    max_b = int((cu_beams[1:] - cu_beams[:-1]).max())
    max_p = int((cu_prompt[1:] - cu_prompt[:-1]).max())
    args = (q, pk, pv, cu_beams * group, cu_prompt, max_b * group, max_p, group, backend)
    return grouped_rows_partial(*args), grouped_rows_attention(*args)


@pytest.mark.parametrize(
    ("widths", "prompts", "hq", "hkv", "d", "slots"),
    [
        ([4], [7], 4, 2, 16, 3),  # one prompt
        ([3, 3, 3], [5, 70, 1], 4, 1, 16, 4),  # all heads on one KV head, a 1-token prompt
        ([16], [128], 14, 2, 64, 4),  # W4's shape (Qwen2.5-0.5B heads, 128-token prompt)
        ([16, 16], [9, 33], 14, 2, 64, 2),  # two prompts
        ([2], [5], 4, 4, 32, 3),  # no GQA: G = 1
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_own_slots_and_merge_at_every_step(widths, prompts, hq, hkv, d, slots, dtype):
    q, pk, pv, bk, bv, cu_b, cu_p = case(widths, prompts, hq, hkv, d, slots, dtype)
    group = hq // hkv
    qg = by_kv_head(q, group)  # as `Attention.heads(grouped=True)` hands it over
    (shared_g, lse_g), (shared, lse) = prompt_part(qg, pk, pv, cu_b, cu_p, group)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for step in range(slots):  # slots past the step hold values the kernel must not see
        s = torch.tensor([step], dtype=torch.int64, device=DEV)
        got = own_slots_merge(qg, bk, bv, s, shared_g, lse_g)
        own, own_lse = _own_slots_attention(qg, bk, bv, s)
        want = merge_partial(shared, lse, own, own_lse)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_grouped_partial_is_the_attention_before_head_order():
    """`grouped_rows_partial` is `grouped_rows_attention`'s output, grouped: query head j·G + g of
    row n at [n, g, j]."""
    q, pk, pv, _, _, cu_b, cu_p = case([5, 3], [11, 4], 14, 2, 16, 1, torch.float32)
    (out_g, lse_g), (out, lse) = prompt_part(q, pk, pv, cu_b, cu_p, 7)
    assert out_g.shape == (8, 7, 2, 16) and lse_g.shape == (8, 7, 2)
    torch.testing.assert_close(by_kv_head(out, 7), out_g)
    torch.testing.assert_close(lse.view(8, 2, 7).transpose(1, 2), lse_g)


@pytest.mark.skipif(CUDA, reason="a CPU layer in Triton's interpreter (CUDA: test_compile_gpu)")
def test_decode_layer_takes_the_kernel_when_chosen(monkeypatch, engine_for):
    """A compiled layer's decode layer (`own_kernel`) with the kernel chosen returns what it
    returns without it (one layer of a Qwen2-shaped model, grouped rows, every step); an eager
    one never takes it."""
    from boundgen.attention import own_slots
    from boundgen.compile import decode

    engine = engine_for("qwen2")
    model = engine.model
    layer, cfg = model.layers[0], model.config
    group = cfg.num_heads // cfg.num_kv_heads
    assert group > 1
    widths, prompt = [3, 2], [6, 4]
    n, t, slots = sum(widths), sum(prompt), 3
    g = torch.Generator().manual_seed(1)
    dt = model.embed_tokens.weight.dtype
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dt)
    x = mk(n, cfg.hidden_size)
    normed = layer.input_layernorm(x)
    cos, sin = model.rotary(torch.full((n,), 7), dt)
    pk, pv = mk(t, cfg.num_kv_heads, cfg.head_dim), mk(t, cfg.num_kv_heads, cfg.head_dim)
    cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)
    cu_b, cu_p = cu(widths), cu(prompt)
    calls = []
    real = torch.ops.boundgen.own_slots_merge

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch.ops.boundgen, "own_slots_merge", counting, raising=False)
    for step in range(slots):
        s = torch.tensor([step])
        # slots before the step written by earlier steps; the step's own written by the layer
        bkv0 = mk(n, slots, 2, cfg.num_kv_heads, cfg.head_dim)
        outs = []
        for use in (False, True):
            monkeypatch.setattr(own_slots, "chosen", lambda device, use=use: use)
            rows = (cu_b * group, max(widths) * group)
            kvs = (pk, pv, bkv0.clone())
            args = (layer, x, normed, cos, sin, *kvs, s, cu_b, cu_p, max(widths), max(prompt))
            backend = (group, ReferenceBackend(), model.norm)
            outs.append(decode.decode_layer(*args, *rows, *backend, own_kernel=True))
        # an eager layer (own_kernel False) keeps the plain search's arithmetic, chosen or not
        eager = decode.decode_layer(*args, *rows, *backend)
        torch.testing.assert_close(eager, outs[0], rtol=0, atol=0)
        tol = 2e-5 if dt == torch.float32 else 3e-2
        torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    assert len(calls) == slots  # only the chosen runs of compiled layers took it


HOPPER = """
from boundgen.attention import own_slots as m

group, d, scale_type = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fn = m._own_slots_merge_kernel
const = dict(SLOTS=4, GROUP=group, HEAD_DIM=d, BLOCK_G=max(2, triton.next_power_of_2(group)),
             BLOCK_D=d, INTERPRET=False)
sig = {n: "i32" for n in fn.arg_names}
sig.update({n: "*bf16" for n in ("Q", "BK", "BV", "SO", "Out")})
sig.update({"SLSE": "*fp32", "STEP": "*i64"})
constexprs_with_scale(sig, const, scale_type, 0.125)
aligned = [n for n in fn.arg_names if sig[n].startswith("*")]
warps, stages = m.NUM_WARPS, 2
"""


@pytest.mark.parametrize(
    ("group", "d", "scale_type"), [(7, 64, "fp32"), (4, 128, "fp64"), (7, 64, "constexpr")]
)
def test_kernel_compiles_for_hopper(group, d, scale_type):
    """The interpreter runs the kernel as Python; this compiles it for sm_90 (the scale as
    Inductor's fp64 or a constexpr)."""
    compile_in_child(HOPPER, str(group), str(d), scale_type)
