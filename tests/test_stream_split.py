"""K split in the streamed epilogue kernels (`stream.SPLIT_K`): gate_up + SiLU·mul
(`stream_gated`) and qkv + the q/k rotation (`stream_qkv`) with K cut over several programs a
tile, the last of which sums the partials and runs the epilogue — against the same kernels with
all of K in one program, and a decoder layer with the split against it without.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `stream.forced()`; with CUDA the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch
from small_layer import qwen_layer_on_cuda, small_config
from torch import nn

pytest.importorskip("triton")

from boundgen.models import stream, stream_gated, stream_qkv
from boundgen.models.decoder import DecoderLayer, kernel_counters
from boundgen.models.layers import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """Streaming on (64 rows), both epilogue kernels on, the split off unless a test turns it on."""
    monkeypatch.setattr(stream, "MAX_ROWS", 64)
    monkeypatch.setattr(stream_gated, "GATED", True)
    monkeypatch.setattr(stream_qkv, "ROTATED", True)
    monkeypatch.setattr(stream, "SPLIT_K", False)


def _randn(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DTYPE).to(DEV)


@pytest.mark.parametrize(("m", "k", "split"), [(5, 300, 2), (17, 256, 4), (40, 200, 3)])
def test_gated_split_sums_to_the_unsplit_output_and_leaves_the_counters_at_zero(m, k, split):
    """Two calls on one counter buffer (a forward's calls share it): each equals the unsplit
    kernel (float32 sums in another grouping: within rounding), the counters back at zero."""
    g = torch.Generator().manual_seed(m + k)
    i = 40
    x = _randn(g, m, k)
    counts = stream.split_counters(x, i)
    tile = (16, 64, 4, 3)
    with stream.forced():
        w = _randn(g, 2 * i, k, scale=k**-0.5)
        whole = stream_gated.launch(x, w, (*tile, 1))
        for _ in range(2):
            got = stream_gated.launch(x, w, (*tile, split), counts)
            tol = 1e-2 if CUDA else 1e-5
            torch.testing.assert_close(got.float(), whole.float(), rtol=tol, atol=tol)
            assert int(counts.abs().sum()) == 0
    want = stream_gated.reference(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("slot", [False, True])
@pytest.mark.parametrize(("m", "k", "split"), [(3, 300, 2), (20, 256, 4)])
def test_qkv_split_sums_to_the_unsplit_output(m, k, split, slot):
    """The rotated projection (or, at a beam step, q with k and v in the cache's slot) with K
    split equals it unsplit; the counters are left at zero."""
    g = torch.Generator().manual_seed(m * k)
    heads, kv_heads, d = 4, 2, 32
    n = (heads + 2 * kv_heads) * d
    rot = (heads + kv_heads) * d
    x, w, b = _randn(g, m, k), _randn(g, n, k, scale=k**-0.5), _randn(g, n)
    theta = torch.rand(m, 1, d // 2, generator=g) * 6.3
    cos, sin = theta.cos().to(DTYPE).to(DEV), theta.sin().to(DTYPE).to(DEV)
    counts = stream.split_counters(x, n)
    tile = (16, 16, 64, 4, 3)
    outs = []
    with stream.forced():
        for s in (1, split):
            kv = torch.zeros(m, 2, 2, kv_heads, d, device=DEV, dtype=DTYPE) if slot else None
            step = torch.tensor([1], device=DEV) if slot else None
            out = stream_qkv.launch(x, w, b, cos, sin, rot, (*tile, s), kv, step, counts)
            outs.append((out, kv) if slot else (out,))
            assert int(counts.abs().sum()) == 0
    tol = 2e-2 if CUDA else 1e-5
    for a, c in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(a.float(), c.float(), rtol=tol, atol=tol)


def test_how_many_splits_a_call_takes(monkeypatch):
    """Off: one. On: about one wave of programs (132), at most `MAX_SPLIT` and K's steps; rows
    unknown when traced (a symbolic count of row tiles) as one row tile."""
    assert stream.split_for(36, 1, 896, 64) == 1  # off
    monkeypatch.setattr(stream, "SPLIT_K", True)
    assert stream.split_for(36, 1, 896, 64) == 4  # qkv's 36 tiles at one row tile
    assert stream.split_for(36, 2, 896, 64) == 2  # two row tiles
    assert stream.split_for(76, 1, 896, 128) == 2  # gate_up + SiLU·mul at one row tile
    assert stream.split_for(76, 2, 896, 128) == 1  # a wave already
    assert stream.split_for(8, 1, 128, 64) == 2  # K's two steps
    assert stream.split_for(36, object(), 896, 64) == 4  # symbolic rows: one row tile


def _layer(rows: int):
    torch.manual_seed(0)
    config = small_config(hidden_size=256, intermediate_size=160, head_dim=32)
    layer = DecoderLayer(config).to(DEV, DTYPE)
    for p in layer.parameters():
        nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.05)
    cos, sin = RotaryEmbedding(config).to(DEV)(torch.arange(rows, device=DEV) * 3, DTYPE)
    return layer, torch.randn(rows, 256, device=DEV, dtype=DTYPE), cos, sin


def test_a_decoder_layer_with_the_split_equals_it_without(monkeypatch):
    """A layer's prefill parts and a beam step's, with the forward's counters
    (`kernel_counters`), against the same layer unsplit: the split kernels ran (their partials
    were made) and left the counters at zero."""
    layer, x, cos, sin = _layer(12)
    made = []
    buffers = stream.KSplit.buffers
    monkeypatch.setattr(
        stream.KSplit, "buffers", lambda self, *a: made.append(self.splits) or buffers(self, *a)
    )
    out = {}
    for on in (False, True):
        with torch.no_grad(), stream.forced(), stream.splitting(on):
            counts = kernel_counters(x, layer)
            assert (counts is not None) is on
            q, k, v = layer.attention_input(x, cos, sin, counts=counts)
            kv = torch.zeros(12, 3, 2, 2, 32, device=DEV, dtype=DTYPE)
            step = torch.tensor([2], device=DEV)
            q_step = layer.decode_input(x, cos, sin, kv, step, counts=counts)
            mlp = layer.mlp_block(x, counts)
            if on:
                assert int(counts.abs().sum()) == 0
        out[on] = (q, k, v, q_step, kv, mlp)
    assert made and max(made) > 1  # the qkv and gate_up calls split (one row tile: few tiles)
    tol = 3e-2 if CUDA else 1e-5
    for a, b in zip(out[True], out[False], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_no_counters_where_nothing_splits(monkeypatch):
    """Split on but the streamed kernels off (more rows than `stream.MAX_ROWS`): no buffer, no
    zero fill in the forward."""
    layer, x, _, _ = _layer(12)
    monkeypatch.setattr(stream, "SPLIT_K", True)
    with torch.no_grad(), stream.forced():
        assert kernel_counters(x, layer) is not None
        with stream.rows_up_to(8):
            assert kernel_counters(x, layer) is None


@pytest.mark.gpu
def test_a_compiled_layer_with_the_split_equals_the_plain_one():
    """Inside `torch.compile` (the ops traced with the forward's counters, which they mutate), at
    16, 64 and 128 rows marked dynamic as the compiled beam layers' are (a symbolic row count
    splits as one row tile): qkv's q, k, v and the MLP block against the plain layer's."""
    layer, cfg = qwen_layer_on_cuda()
    rope = RotaryEmbedding(cfg).to("cuda")

    def parts(x, cos, sin, counts):
        return (*layer.attention_input(x, cos, sin, counts=counts), layer.mlp_block(x, counts))

    compiled = torch.compile(parts)
    for rows in (16, 64, 128):
        x = torch.randn(rows, 896, device="cuda", dtype=torch.bfloat16)
        cos, sin = rope(torch.randint(0, 4096, (rows,), device="cuda"), torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            with stream.rows_up_to(128), stream.splitting(True):
                counts = kernel_counters(x, layer)
                got = compiled(x, cos, sin, counts)
            assert int(counts.abs().sum()) == 0
            with stream.rows_up_to(0), stream_qkv.enabled(False):
                want = parts(x, cos, sin, None)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
