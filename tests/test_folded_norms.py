"""The residual stream's RMSNorms folded into the streamed GEMMs (`stream.NORMS`,
`decoder.FoldedNorms`): o_proj and `down` writing x whole with its rows' sums of squares
(`stream.linear_residual_squares`), qkv and gate_up norming x as they load it (`stream.NormedBy`),
against the kernels and layers they replace.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`)
under `stream.forced()`, in float32: the interpreter rounds float32 to bf16 by truncation, so only
float32 compares exactly there; with CUDA the same tests run the compiled kernels in bf16, and the
`gpu` test runs a compiled model.
"""

from __future__ import annotations

import pytest
import torch
from small_layer import small_config
from torch import nn

pytest.importorskip("triton")

from boundgen.attention import AttnInputs
from boundgen.models import stream, stream_gated, stream_qkv
from boundgen.models.decoder import DecoderModel, FoldedNorms

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 3e-2 if CUDA else 2e-5


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """Streaming on (64 rows), qkv and gate_up's kernels on, whatever the environment says."""
    monkeypatch.setattr(stream, "MAX_ROWS", 64)
    monkeypatch.setattr(stream_qkv, "ROTATED", True)
    monkeypatch.setattr(stream_gated, "GATED", True)


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DTYPE).to(DEV)


def _rms_norm(x, weight, eps):
    """The plain RMSNorm's arithmetic (`layers.RMSNorm`)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    # K in one slice (summed in the program), split unevenly, past a BLOCK_K step; rows from 1
    # to past a 64-row block; columns not a multiple of BLOCK_N (a short last column tile)
    [(1, 96, 48), (5, 300, 130), (16, 640, 64), (17, 1000, 70), (64, 256, 200), (70, 512, 96)],
)
def test_the_finishing_kernel_is_linear_residual_with_its_squares(m, k, n):
    """The sum its last programs make is `linear_residual`'s bits (the same float32 adds in the
    same order), the squares are the output's by column tile, and the counters are left zero
    for the next call."""
    g = torch.Generator().manual_seed(m * k + n)
    x, w, r = _randn(g, m, k), _randn(g, n, k, scale=k**-0.5), _randn(g, m, n)
    counts = stream.counters(x, n)
    with stream.forced(), torch.no_grad():
        got, squares = stream.linear_residual_squares(x, w, r, counts)
        want = stream.linear_residual(x, w, r)
    assert got.dtype == DTYPE and torch.equal(got, want)
    assert squares.shape == (-(-n // stream.BLOCK_N), m)
    torch.testing.assert_close(squares, stream.row_squares(got), rtol=1e-5, atol=1e-5)
    assert not counts.any()


def test_row_squares_are_by_column_tile():
    y = torch.arange(2 * 130, dtype=torch.float32).view(2, 130)
    sq = stream.row_squares(y)
    assert sq.shape == (3, 2)
    assert sq[2, 1].item() == sum(float(v) ** 2 for v in y[1, 128:])
    assert torch.allclose(sq.sum(0), y.pow(2).sum(1))


@pytest.mark.parametrize(("m", "k", "i"), [(1, 64, 64), (9, 192, 80), (40, 300, 128)])
def test_gated_with_the_norm_is_gated_of_the_normed_input(m, k, i):
    g = torch.Generator().manual_seed(m + k + i)
    x, w = _randn(g, m, k), _randn(g, 2 * i, k, scale=k**-0.5)
    norm = (1 + 0.3 * torch.randn(k, generator=g)).to(DTYPE).to(DEV)
    with stream.forced(), torch.no_grad():
        got = stream_gated.gated(x, w, stream.NormedBy(norm, stream.row_squares(x), 1e-6))
        want = stream_gated.gated(_rms_norm(x, norm, 1e-6), w)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("slot", [False, True])
def test_qkv_with_the_norm_is_qkv_of_the_normed_input(slot):
    """Rows past a 32-row tile, K past a step; with the slot, k and v go into the cache."""
    g = torch.Generator().manual_seed(7)
    m, k, heads, kv_heads, d = 37, 200, 4, 2, 32
    n, rotated = (heads + 2 * kv_heads) * d, (heads + kv_heads) * d
    x, w, b = _randn(g, m, k), _randn(g, n, k, scale=k**-0.5), _randn(g, n, scale=0.1)
    norm = (1 + 0.3 * torch.randn(k, generator=g)).to(DTYPE).to(DEV)
    theta = torch.rand(m, 1, d // 2, generator=g) * 6.3
    cos, sin = theta.cos().to(DTYPE).to(DEV), theta.sin().to(DTYPE).to(DEV)
    by = stream.NormedBy(norm, stream.row_squares(x), 1e-6)
    step = torch.tensor([1], device=DEV)
    outs = []
    for inp, normed_by in ((x, by), (_rms_norm(x, norm, 1e-6), None)):
        with stream.forced(), torch.no_grad():
            if slot:
                kv = torch.zeros(m, 2, 2, kv_heads, d, device=DEV, dtype=DTYPE)
                q = stream_qkv.rotated_into_slot(inp, w, b, cos, sin, rotated, kv, step, normed_by)
                outs.append((q, kv))
            else:
                outs.append((stream_qkv.rotated(inp, w, b, cos, sin, rotated, normed_by),))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=TOL, atol=TOL)


def _model(num_layers=3, **cfg):
    torch.manual_seed(1)
    model = DecoderModel(small_config(num_layers=num_layers, **cfg)).to(DEV, DTYPE)
    for p in model.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.1)
    return model


def _forward(model, rows=12):
    ids = torch.arange(rows, device=DEV) * 7 % model.config.vocab_size
    positions = torch.arange(rows, device=DEV)
    attn = AttnInputs(
        cu_seqlens=torch.tensor([0, 5, rows], dtype=torch.int32, device=DEV), max_seqlen=rows - 5
    )
    return model(ids, positions, attn)


@pytest.mark.parametrize("cfg", [{}, {"qkv_bias": False}, {"qk_norm": True, "qkv_bias": False}])
def test_a_forward_with_the_norms_folded_equals_it_without(cfg, monkeypatch):
    """Three layers (their producers sharing one counter buffer): with the norms folded, the
    forward's hidden states are the plain streamed forward's; Qwen3's q/k norms keep qkv on the
    plain path, which norms x itself while the MLP still folds. The two residual-add + norm
    kernels a layer are gone: `linear_residual` is never called, the squares' kernel is."""
    model = _model(**cfg)
    calls = []
    finishing, plain_sum = stream.linear_residual_squares, stream.linear_residual
    monkeypatch.setattr(
        stream, "linear_residual_squares", lambda *a: calls.append("squares") or finishing(*a)
    )
    monkeypatch.setattr(stream, "linear_residual", lambda *a: calls.append("sum") or plain_sum(*a))
    with stream.forced(), torch.no_grad():
        with stream.norms_folded(False):
            want = _forward(model)
        assert calls == ["sum"] * 6
        calls.clear()
        with stream.norms_folded(True):
            got = _forward(model)
    assert calls == ["squares"] * 6
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL, atol=TOL)


def test_which_forwards_fold(monkeypatch):
    """On, in the kernels' reach (rows, dtype, no grad), o_proj and `down` streamed: a forward
    past `stream.MAX_ROWS` rows, or with FP8's `down`, keeps the norms' kernels."""
    from boundgen.quant.fp8 import Fp8Linear

    monkeypatch.setattr(stream, "NORMS", False)
    model = _model(num_layers=1)
    layer = model.layers[0]
    few = torch.zeros(stream.MAX_ROWS, 64, device=DEV, dtype=DTYPE)
    many = torch.zeros(stream.MAX_ROWS + 1, 64, device=DEV, dtype=DTYPE)
    with stream.forced(), torch.no_grad():
        with stream.norms_folded(True):
            assert layer.folds_norms(few) and not layer.folds_norms(many)
            folded = FoldedNorms(stream.counters(few, 64), stream.row_squares(few))
            assert folded.by(layer.input_layernorm).weight is layer.input_layernorm.weight
            layer.mlp.down_proj = Fp8Linear.from_linear(layer.mlp.down_proj, mode="emulate")
            assert not layer.folds_norms(few)
        assert not stream.NORMS  # the switch restored
        assert not _model(num_layers=1).layers[0].folds_norms(few)


@pytest.mark.skipif(CUDA, reason="the CPU engine in the interpreter; on CUDA: test_compile_gpu")
def test_a_search_with_the_norms_folded_equals_it_without(engine_for, monkeypatch):
    """The tiny model's searches through the search's layer functions (`SearchGraphs` without
    graphs): the prefill and every decode step on the streamed kernels, with the norms folded
    (the layers hand each other x's squares, the final norm after the last) against the same
    kernels with the norms' own kernels: the same beams, scores within float32 rounding."""
    import contextlib

    from boundgen.compile.decode import SearchGraphs
    from boundgen.workloads.trie import Trie

    engine = engine_for("qwen2")
    model = engine.model
    monkeypatch.setattr(stream, "MAX_ROWS", 128)  # the prompts' tokens and the beams' rows
    finishing, calls = stream.linear_residual_squares, []
    monkeypatch.setattr(
        stream, "linear_residual_squares", lambda *a: calls.append(a[0].shape[0]) or finishing(*a)
    )
    g = torch.Generator().manual_seed(3)
    items = torch.randint(0, 60, (150, 3), generator=g).unique(dim=0).tolist()
    prompts = [engine.tokenizer.encode(p) for p in ("the first prompt", "a second, longer one")]
    runs = []
    with torch.inference_mode(), stream.forced():
        for folded in (False, True):
            sg = SearchGraphs(model, engine.device, model.backend, use_graphs=False)
            with stream.norms_folded(folded) if folded else contextlib.nullcontext():
                runs.append([sg.run(prompts, 4, 3, t) for t in (None, Trie.from_sequences(items))])
    # two producers a layer, in the prefill (its padded tokens) and the two decode steps after
    # it (2 prompts × width 4 rows), for both searches
    producers = 2 * model.config.num_layers
    prefill = calls[0]
    assert prefill > 8 and calls == 2 * ([prefill] * producers + [8] * producers * 2)
    for (tokens, scores), (tokens_folded, scores_folded) in zip(*runs, strict=True):
        assert torch.equal(tokens_folded, tokens)
        torch.testing.assert_close(scores_folded, scores, rtol=0, atol=1e-4)
