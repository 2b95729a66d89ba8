"""The fused few-row linear layers (`models/skinny.py`) against the eager ops they replace.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets `TRITON_INTERPRET=1`),
under `skinny.forced()`; with CUDA the same tests run the compiled kernels, and the `gpu` tests
run a decoder layer inside `torch.compile` against the unfused layer.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from hopper import compile_in_child
from small_layer import randn, small_config, spread_weights

pytest.importorskip("triton")

from boundgen.models import skinny, skinny_tiles
from boundgen.models.decoder import DecoderLayer
from boundgen.quant.fp8 import Fp8Linear

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """The kernels are off by default (`skinny.MAX_ROWS` 0, until tuned): on for these tests."""
    monkeypatch.setattr(skinny, "MAX_ROWS", 64)


SHAPES = [(1, 64, 48), (7, 96, 80), (16, 128, 64), (40, 48, 200), (64, 80, 32)]


@pytest.mark.parametrize("name", ["norm_linear", "norm_gated", "linear_residual"])
def test_the_ops_schemas_give_no_argument_a_default(name):
    """torch 2.11's dispatcher drops trailing arguments equal to their defaults, then indexes the
    mutated `counts`/`kv` past the end (IndexError on the H200): the schemas have no defaults,
    and `skinny.norm_linear` etc. pass every argument."""
    schema = getattr(torch.ops.boundgen, name).default._schema
    assert [a.name for a in schema.arguments if a.has_default_value()] == []
    assert any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# bf16 through a norm: two units in the last place at outputs of 4-8. The kernels scale each row by
# RMSNorm's 1/rms after the sum (x·norm rounded once before the product) where eager rounds x/rms,
# then its product with the norm, before the GEMM.
NORM_BF16_TOL = 6.25e-2


def _close(got, want, dtype, bf16_tol=3e-2):
    # float32: the summation order only; bf16: a few units in the last place of the output (a
    # product of two rounded GEMM outputs, SiLU·mul, doubles the units: `bf16_tol`)
    tol = {torch.float32: 2e-5, torch.bfloat16: bf16_tol}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_norm_linear_is_rmsnorm_then_the_linear_layer(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * k + n)
    x = randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w, bias = randn(g, n, k, scale=k**-0.5, dtype=dtype), randn(g, n, dtype=dtype)
    with skinny.forced():
        for b in (bias, None):
            got = skinny.norm_linear(x, norm, 1e-6, w, b)
            want = skinny.reference_norm_linear(x, norm, 1e-6, w, b)
            _close(got, want, dtype, bf16_tol=NORM_BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_norm_gated_is_rmsnorm_gate_up_and_silu_mul(m, k, n, dtype):
    g = torch.Generator().manual_seed(m + k * n)
    x = randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w = randn(g, 2 * n, k, scale=k**-0.5, dtype=dtype)
    with skinny.forced():
        got = skinny.norm_gated(x, norm, 1e-6, w)
    _close(got, skinny.reference_norm_gated(x, norm, 1e-6, w), dtype, bf16_tol=NORM_BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_linear_residual_adds_the_residual(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * n + k)
    x, w = randn(g, m, k, dtype=dtype), randn(g, n, k, scale=k**-0.5, dtype=dtype)
    res = randn(g, m, n, scale=4.0, dtype=dtype)
    with skinny.forced():
        got = skinny.linear_residual(x, w, res)
    _close(got, skinny.reference_linear_residual(x, w, res), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "tile"), [(5, (64, 32, 1)), (16, (32, 16, 3)), (70, (16, 32, 2))])
def test_norm_linear_rotates_the_q_and_k_heads(m, tile, dtype, monkeypatch):
    """With cos and sin, `norm_linear` gives the normed qkv with its first `rotate_cols` columns
    (4 q heads and 2 k heads of 16) rotated head by head, as `apply_rope` rotates them, and the
    v columns as they are: for tiles of 2 and 1 whole heads (a 64-column tile narrowed to two: 4
    would straddle the rotated and the plain columns) and a split K."""
    from boundgen.models.layers import apply_rope

    block_n, block_k, split = tile
    monkeypatch.setattr(skinny_tiles, "tile_for", lambda *a: (block_n, block_k, split, 4, 2))
    k, d, heads, kv = 80, 16, 6, 2
    n = (heads + kv) * d
    g = torch.Generator().manual_seed(m)
    x = randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w, bias = randn(g, n, k, scale=k**-0.5, dtype=dtype), randn(g, n, dtype=dtype)
    angle = torch.rand(m, 1, d // 2, generator=g) * 6.3
    cos, sin = angle.cos().to(dtype).to(DEV), angle.sin().to(dtype).to(DEV)
    with skinny.forced():
        got = skinny.norm_linear(
            x, norm, 1e-6, w, bias, None, cos.view(m, -1), sin.view(m, -1), heads * d
        )
    qkv = skinny.reference_norm_linear(x, norm, 1e-6, w, bias)
    qk = apply_rope(qkv[:, : heads * d].float().view(m, heads, d), cos.float(), sin.float())
    want = torch.cat([qk.reshape(m, -1).to(dtype), qkv[:, heads * d :]], 1)
    _close(got, want, dtype, bf16_tol=NORM_BF16_TOL)
    with skinny.forced(), pytest.raises(ValueError, match="whole heads"):
        skinny.norm_linear(
            x, norm, 1e-6, w, bias, None, cos.view(m, -1), sin.view(m, -1), heads * d + 8
        )
    # whole heads a tile, tiling the rotated columns (6 heads: 4 a tile would straddle)
    assert [skinny_tiles.rope_block_n(b, d, heads * d) for b in (64, 32, 16)] == [32, 32, 16]
    assert skinny_tiles.rope_block_n(128, 64, 16 * 64) == 128  # Qwen2.5-0.5B: 14 + 2 heads of 64
    assert skinny_tiles.rope_block_n(32, 128, 24 * 128) == 128  # Qwen3-0.6B: 16 + 8 heads of 128


@pytest.mark.parametrize("group", [1, 2], ids=["heads-in-order", "by-kv-head"])
@pytest.mark.parametrize(("m", "tile"), [(5, (32, 32, 1)), (16, (16, 16, 3))])
def test_norm_linear_writes_k_and_v_into_the_cache_slot(m, tile, group, monkeypatch):
    """A decode step's qkv (4 q heads, 2 k and 2 v heads of 16): q returned, rotated, its heads
    in KV-head order with `group` 2 (as `by_kv_head` orders them); the rotated k and the v
    written into slot `step` of each row's cache, the other slots untouched — for tiles of two
    heads and of one, K whole or split."""
    from boundgen.attention.cascade import by_kv_head
    from boundgen.models.layers import apply_rope

    block_n, block_k, split = tile
    monkeypatch.setattr(skinny_tiles, "tile_for", lambda *a: (block_n, block_k, split, 4, 2))
    dtype = torch.bfloat16 if CUDA else torch.float32
    k, d, heads, kv_heads, slots = 80, 16, 4, 2, 3
    n = (heads + 2 * kv_heads) * d
    g = torch.Generator().manual_seed(m + group)
    x = randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w, bias = randn(g, n, k, scale=k**-0.5, dtype=dtype), randn(g, n, dtype=dtype)
    angle = torch.rand(m, d // 2, generator=g) * 6.3
    cos, sin = angle.cos().to(dtype).to(DEV), angle.sin().to(dtype).to(DEV)
    cache = randn(g, m, slots, 2, kv_heads, d, dtype=dtype)
    before = cache.clone()
    step = torch.tensor([1], device=DEV)
    rotated = (heads + kv_heads) * d
    with skinny.forced():
        q = skinny.norm_linear(x, norm, 1e-6, w, bias, None, cos, sin, rotated, group, cache, step)
    qkv = skinny.reference_norm_linear(x, norm, 1e-6, w, bias)
    qk = apply_rope(qkv[:, :rotated].float().view(m, heads + kv_heads, d), cos[:, None].float(),
                    sin[:, None].float()).to(dtype)  # fmt: skip
    want_q = qk[:, :heads]
    if group > 1:
        want_q = by_kv_head(want_q, group)
    assert q.shape == (m, heads * d)
    _close(q.view(want_q.shape), want_q, dtype, bf16_tol=NORM_BF16_TOL)
    _close(cache[:, 1, 0], qk[:, heads:], dtype, bf16_tol=NORM_BF16_TOL)
    _close(cache[:, 1, 1], qkv[:, rotated:].view(m, kv_heads, d), dtype, bf16_tol=NORM_BF16_TOL)
    assert torch.equal(cache[:, [0, 2]], before[:, [0, 2]])


def test_a_cache_write_needs_the_rotation_and_a_matching_slot():
    x, norm = torch.randn(3, 32, device=DEV), torch.ones(32, device=DEV)
    w = torch.randn(8 * 16, 32, device=DEV)
    cos = sin = torch.ones(3, 8, device=DEV)
    step = torch.zeros(1, dtype=torch.long, device=DEV)
    cache = torch.zeros(3, 2, 2, 2, 16, device=DEV)
    with skinny.forced():
        with pytest.raises(ValueError, match="only with a kv cache"):
            skinny.norm_linear(x, norm, 1e-6, w, None, None, cos, sin, 96, 2)
        with pytest.raises(ValueError, match="rotated q and k"):
            skinny.norm_linear(x, norm, 1e-6, w, None, None, None, None, 0, 1, cache, step)
        with pytest.raises(ValueError, match="contiguous"):
            skinny.norm_linear(x, norm, 1e-6, w, None, None, cos, sin, 96, 1, cache[:, :, :1], step)
        with pytest.raises(ValueError, match="does not divide"):
            skinny.norm_linear(x, norm, 1e-6, w, None, None, cos, sin, 96, 3, cache, step)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_decode_step_s_input_with_the_kernels_equals_it_without(grouped):
    """`DecoderLayer.decode_input`: the fused kernel (rotation, q's order, the cache slot's
    write) against the layer's plain input and `index_copy_` into the slot."""
    torch.manual_seed(1)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = small_config()
    layer = DecoderLayer(cfg).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)
    n, slots = 6, 4
    x = torch.randn(n, cfg.hidden_size, device=DEV, dtype=dtype)
    cos = torch.randn(n, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)
    sin = torch.randn(n, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)
    step = torch.tensor([2], device=DEV)
    start = torch.randn(n, slots, 2, cfg.num_kv_heads, cfg.head_dim, device=DEV, dtype=dtype)
    runs = {}
    with torch.no_grad():
        for fused in (False, True):
            cache = start.clone()
            if fused:
                with skinny.forced():
                    q = layer.decode_input(x, cos, sin, cache, step, grouped)
            else:
                with skinny.rows_up_to(0):
                    q = layer.decode_input(x, cos, sin, cache, step, grouped)
            runs[fused] = (q, cache)
    (q_plain, cache_plain), (q_fused, cache_fused) = runs[False], runs[True]
    assert q_fused.shape == q_plain.shape
    _close(q_fused.contiguous(), q_plain.contiguous(), dtype, bf16_tol=6e-2)
    _close(cache_fused, cache_plain, dtype, bf16_tol=6e-2)
    assert not torch.equal(cache_fused[:, 2], start[:, 2])  # the slot was written


@pytest.mark.skipif(CUDA, reason="the CPU engine in the interpreter; on CUDA: test_compile_gpu")
def test_a_search_with_the_kernels_equals_it_without(engine_for):
    """The tiny model's searches through the search's decode layers (`SearchGraphs` without
    graphs), every prefill and decode step on the fused kernels (each step's input one kernel
    that writes the cache slot, q by KV head for the grouped attention) against the plain
    layers: the same beams, scores within float32 rounding."""
    from boundgen.compile.decode import SearchGraphs
    from boundgen.workloads.trie import Trie

    engine = engine_for("qwen2")
    model = engine.model
    assert model.config.num_heads > model.config.num_kv_heads  # grouped decode steps
    g = torch.Generator().manual_seed(3)
    items = torch.randint(0, 60, (150, 3), generator=g).unique(dim=0).tolist()
    prompts = [engine.tokenizer.encode(p) for p in ("the first prompt", "a second, longer one")]
    runs = []
    with torch.inference_mode():
        for fused in (False, True):
            sg = SearchGraphs(model, engine.device, model.backend, use_graphs=False)
            with skinny.forced() if fused else contextlib.nullcontext():
                runs.append([sg.run(prompts, 4, 3, t) for t in (None, Trie.from_sequences(items))])
    for (tokens, scores), (tokens_fused, scores_fused) in zip(*runs, strict=True):
        assert torch.equal(tokens_fused, tokens)
        torch.testing.assert_close(scores_fused, scores, rtol=0, atol=1e-4)


# (BLOCK_N, BLOCK_K, SPLIT_K): K = 80 in 16- or 32-wide steps split 2, 3 or 5 ways (a split of
# 3 × 32 covers 96: its last steps are masked), N = 48 in 32-column tiles (the last half masked)
SPLITS = [(32, 16, 2), (32, 32, 3), (16, 16, 5), (64, 16, 1)]


@pytest.fixture
def tile(request, monkeypatch):
    """Every shape of the test takes the tile `request.param` (BLOCK_N, BLOCK_K, SPLIT_K)."""
    block_n, block_k, split = request.param
    monkeypatch.setattr(skinny_tiles, "tile_for", lambda *a: (block_n, block_k, split, 4, 2))
    return request.param


@pytest.mark.parametrize("tile", SPLITS, indirect=True, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [5, 16, 40, 70])
def test_a_split_k_sums_every_split_once(tile, dtype, m):
    """K split over programs, the last to arrive summing the partials and finishing the tile: the
    three ops give what their eager layers give, for rows in one or two 16-/32-/64-row blocks
    (70: two of 64), and a second call the same bits (its counters start at zero again)."""
    k, n = 80, 48
    g = torch.Generator().manual_seed(m + tile[2])
    x = randn(g, m, k, scale=3.0, dtype=dtype)
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEV)
    w, bias = randn(g, n, k, scale=k**-0.5, dtype=dtype), randn(g, n, dtype=dtype)
    w2 = randn(g, 2 * n, k, scale=k**-0.5, dtype=dtype)
    res = randn(g, m, n, scale=4.0, dtype=dtype)
    with skinny.forced():
        got = [
            skinny.norm_linear(x, norm, 1e-6, w, bias),
            skinny.norm_gated(x, norm, 1e-6, w2),
            skinny.linear_residual(x, w, res),
        ]
        again = skinny.norm_linear(x, norm, 1e-6, w, bias)
    assert torch.equal(again, got[0])
    wants = [
        skinny.reference_norm_linear(x, norm, 1e-6, w, bias),
        skinny.reference_norm_gated(x, norm, 1e-6, w2),
        skinny.reference_linear_residual(x, w, res),
    ]
    for out, want in zip(got, wants, strict=True):
        # bf16: two units in the last place of the largest output (a residual of scale 4 puts
        # outputs past 8, where a unit is 0.0625)
        ulp = 2.0 ** (torch.floor(torch.log2(want.float().abs().max())).item() - 7)
        _close(out, want, dtype, bf16_tol=2 * ulp)


def test_the_default_tile_splits_k_until_the_device_is_busy():
    """A Qwen2.5-0.5B layer at 16 rows: `down` and o_proj (896 columns: 14 tiles of 64) split K
    toward `TARGET_PROGRAMS` programs (`down`'s 38 steps of 128 in 13 splits of 3), gate_up (76
    tiles) 3 ways; every split is whole BLOCK_K steps and none lies past K."""
    programs = {}
    for name, (k, n, gated) in {
        "qkv": (896, 1152, False),
        "o_proj": (896, 896, False),
        "gate_up": (896, 4864, True),
        "down": (4864, 896, False),
    }.items():
        block_m = skinny_tiles.block_m_for(16)
        block_n, block_k, split, _, _ = skinny_tiles.default_tile(k, n, gated, block_m)
        per, split = skinny_tiles.k_split(k, block_k, split)
        assert per % block_k == 0 and (split - 1) * per < k <= split * per
        programs[name] = -(-n // block_n) * split
    assert programs == {"qkv": 126, "o_proj": 98, "gate_up": 228, "down": 182}
    assert skinny_tiles.k_split(896, 256, 7) == (256, 4)  # no split left without K
    blocks = [skinny_tiles.block_m_for(m) for m in (1, 16, 17, 32, 33, 64)]
    assert blocks == [16, 16, 32, 32, 64, 64]


def test_swept_tiles_load_from_a_file_and_key_the_packages(tmp_path, monkeypatch):
    """`bench_skinny.py --tiles-out` writes what `BOUNDGEN_SKINNY_TILES` loads; the kernels take
    a listed shape's tile, and compiled packages record the table (a new sweep rebuilds them,
    no table keeps the old keys)."""
    from boundgen.compile.cache import platform_info

    path = tmp_path / "tiles.json"
    path.write_text('[{"key": [80, 48, false, 16], "tile": [32, 16, 3, 4, 2]}]')
    monkeypatch.setattr(skinny_tiles, "TILES", {})
    assert "skinny_tiles" not in platform_info("cpu")
    skinny_tiles.TILES.update(skinny_tiles.load_tiles(path))
    assert skinny_tiles.tile_for(80, 48, False, 16) == (32, 16, 3, 4, 2)
    assert skinny_tiles.tile_for(80, 48, True, 16) == skinny_tiles.default_tile(80, 48, True, 16)
    assert platform_info("cpu")["skinny_tiles"] == skinny_tiles.tiles_digest() != ""
    path.write_text('[{"key": [80, 48, false, 16], "tile": [32, 16, 3]}]')
    with pytest.raises(ValueError, match="not a skinny tile"):
        skinny_tiles.load_tiles(path)


def test_strided_rows_are_read_by_their_stride():
    """A view whose rows are not packed (a slice of wider rows) gives what its copy gives."""
    g = torch.Generator().manual_seed(3)
    wide = randn(g, 9, 2 * 64)
    x, w, res = wide[:, :64], randn(g, 32, 64, scale=0.125), randn(g, 9, 32)
    with skinny.forced():
        got = skinny.linear_residual(x, w, res)
    _close(got, skinny.reference_linear_residual(x.contiguous(), w, res), torch.float32)


def test_rows_up_to_sets_the_row_limit_inside_only():
    with skinny.rows_up_to(0):
        assert skinny.MAX_ROWS == 0
        with pytest.raises(RuntimeError), skinny.rows_up_to(128):
            assert skinny.MAX_ROWS == 128
            raise RuntimeError
        assert skinny.MAX_ROWS == 0
    assert skinny.MAX_ROWS == 64  # (the autouse fixture's)


def test_which_calls_the_kernels_take():
    layer = DecoderLayer(small_config()).to(DEV)
    few, many = torch.zeros(skinny.MAX_ROWS, 64, device=DEV), torch.zeros(65, 64, device=DEV)
    lin = layer.self_attn.qkv_proj
    with skinny.forced(), torch.no_grad():
        assert skinny.applies(few, lin) == (CUDA is False)  # float32 on CUDA: cuBLAS
        assert skinny.applies(few.to(torch.bfloat16), lin)
        assert not skinny.applies(many.to(torch.bfloat16), lin)  # more rows than MAX_ROWS
        fp8 = Fp8Linear.from_linear(lin, mode="emulate")
        assert not skinny.applies(few.to(torch.bfloat16), fp8)  # FP8 layers keep their path
    if not CUDA:
        with torch.no_grad():
            assert not skinny.applies(few, lin)  # outside forced(): never the interpreter


def test_training_keeps_the_plain_ops():
    """The kernels have no backward: with grad on and weights that want it, the layer does not
    take them (the demo trainer trains through these layers)."""
    layer = DecoderLayer(small_config()).to(DEV, torch.bfloat16)
    x = torch.zeros(4, 64, device=DEV, dtype=torch.bfloat16)
    with skinny.forced():
        assert not skinny.applies(x, layer.self_attn.qkv_proj)
        with torch.no_grad():
            assert skinny.applies(x, layer.self_attn.qkv_proj)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_decoder_layer_with_the_kernels_equals_it_without(qk_norm):
    """The layer's three fused parts against the same layer unfused (float32 on the CPU: the
    interpreter; bf16 on CUDA) — every weight path used: qkv bias, Qwen3's q/k norms."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    family = "qwen3" if qk_norm else "qwen2"
    cfg = small_config(family=family, qk_norm=qk_norm, qkv_bias=not qk_norm)
    layer = DecoderLayer(cfg).to(DEV, dtype)
    spread_weights(layer, 0.1, norm_std=0.3)  # norms away from 1, so a dropped norm weight shows
    x = torch.randn(12, 64, device=DEV, dtype=dtype)
    o = torch.randn(12, cfg.num_heads * cfg.head_dim, device=DEV, dtype=dtype)
    cos = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)
    sin = torch.randn(12, 1, cfg.head_dim // 2, device=DEV, dtype=dtype)

    def parts():
        return (
            *layer.attention_input(x, cos, sin),
            layer.attention_output(x, o),
            layer.mlp_block(x),
        )

    torch.set_grad_enabled(False)  # (inference, as the engine runs; restored below)
    try:
        plain = parts() if not CUDA else None
        with skinny.forced():
            fused = parts()
    finally:
        torch.set_grad_enabled(True)
    if CUDA:
        with skinny.rows_up_to(0), torch.no_grad():  # the unfused path on CUDA
            plain = parts()
    for got, want in zip(fused, plain, strict=True):
        _close(got, want, dtype, bf16_tol=6e-2)


@pytest.mark.parametrize("tile", [(32, 16, 3)], indirect=True, ids=str)
def test_a_forward_s_calls_share_one_counter_buffer(tile):
    """A whole model's forward with every GEMM's K split 3 ways: its calls share the counters of
    `skinny.counters` (one zero fill a forward), each leaving them at zero for the next — a call
    that left a count behind would never finish a tile of the next. The forward equals the
    unfused model's, and the buffer is zero after the layers' parts ran on it."""
    from boundgen.attention import AttnInputs
    from boundgen.models.decoder import DecoderModel

    torch.manual_seed(1)
    dtype = torch.bfloat16 if CUDA else torch.float32
    cfg = small_config(num_layers=3)
    model = DecoderModel(cfg).to(DEV, dtype)
    spread_weights(model, 0.1, norm_std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (12,), device=DEV)
    positions = torch.arange(12, device=DEV)
    attn = AttnInputs(
        cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV), max_seqlen=7
    )
    with torch.no_grad():
        with skinny.rows_up_to(0):  # the unfused path (on the CPU: outside forced() too)
            plain = model(ids, positions, attn)
        with skinny.forced():
            fused = model(ids, positions, attn)
            x = torch.randn(12, 64, device=DEV, dtype=dtype)
            counts = skinny.counters(x, model.layers[0])
            assert counts is not None and not counts.any()
            for layer in model.layers:
                layer.mlp_block(layer.attention_output(x, x, counts), counts)
            assert not counts.any()
    if dtype == torch.float32:
        _close(fused, plain, dtype)
    else:  # bf16 through three layers: ~1 % rms apart (the interpreter in bf16: 1.0 %); a
        # partial sum lost in a split of 3 would be tens of %
        rms = lambda t: t.float().pow(2).mean().sqrt()
        assert rms(fused.float() - plain.float()) / rms(plain) < 0.03
    # outside no_grad (and forced() on the CPU) the weights that want grads keep the plain ops
    assert skinny.counters(x, model.layers[0]) is None
    layer = model.layers[0]
    for name in ("qkv_proj", "o_proj"):  # FP8 attention: the MLP still takes the kernels
        lin = getattr(layer.self_attn, name)
        setattr(layer.self_attn, name, Fp8Linear.from_linear(lin, mode="emulate"))
    with skinny.forced(), torch.no_grad():
        assert skinny.counters(x, layer) is not None
        for name in ("gate_up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            setattr(layer.mlp, name, Fp8Linear.from_linear(lin, mode="emulate"))
        assert skinny.counters(x, layer) is None  # nothing takes them


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_kernels_inside_torch_compile_with_dynamic_rows():
    """A Qwen2.5-0.5B-shaped layer (the default tiles split K: 98-228 programs a GEMM): compiled
    with the rows dynamic (as the beam layers are), the fused parts give the eager fused parts'
    bits where both take 64-row blocks; the q/k/v within bf16 noise (RoPE is fused by Inductor
    there)."""
    torch.manual_seed(0)
    cfg = small_config(
        hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64
    )
    layer = DecoderLayer(cfg).to("cuda", torch.bfloat16)
    spread_weights(layer, 0.02, norm_std=0.3)
    compiled = {
        name: torch.compile(getattr(layer, name), fullgraph=True)
        for name in ("attention_input", "attention_output", "mlp_block")
    }
    torch.set_grad_enabled(False)  # (restored when the test ends, by pytest's fixtures' order)
    for m in (16, 40, 64):
        x = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
        cos = torch.rand(m, 1, 32, device="cuda", dtype=torch.bfloat16)
        sin = (1 - cos.float() ** 2).sqrt().to(torch.bfloat16)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        torch._dynamo.maybe_mark_dynamic(o, 0)
        pairs = [
            (compiled["mlp_block"](x), layer.mlp_block(x)),
            (compiled["attention_output"](x, o), layer.attention_output(x, o)),
        ]
        for got, want in pairs:
            if skinny_tiles.block_m_for(m) == 64:  # symbolic rows take 64-row blocks: the same tile
                assert torch.equal(got, want)
            else:  # 16 rows eagerly take a 16-row block: another MMA shape
                _close(got, want, torch.bfloat16, bf16_tol=6e-2)
        for got, want in zip(
            compiled["attention_input"](x, cos, sin),
            layer.attention_input(x, cos, sin),
            strict=True,
        ):
            _close(got, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [16, 64])
def test_split_k_on_the_device_gives_the_same_bits_every_call(m):
    """The split-K reduction across multiprocessors (partials stored, a device-scope release and
    acquire on the tile's counter, the last program summing in split order): 200 eager calls
    and 100 replays of a CUDA graph of `down` + residual (4,864 → 896, 13-19 splits) and of
    norm + gate_up + SiLU·mul give one result, bit for bit, near the eager layers'. A program
    that read another's partial before it landed would show as a changed bit."""
    torch.manual_seed(m)
    x = torch.randn(m, 4864, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) * 4864**-0.5
    res = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
    xg = torch.randn(m, 896, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(896, device="cuda", dtype=torch.bfloat16) + 0.5
    wg = torch.randn(2 * 4864, 896, device="cuda", dtype=torch.bfloat16) * 896**-0.5
    calls = {
        "down": lambda: skinny.linear_residual(x, w, res),
        "gate_up": lambda: skinny.norm_gated(xg, norm, 1e-6, wg),
    }
    wants = {
        "down": skinny.reference_linear_residual(x, w, res),
        "gate_up": skinny.reference_norm_gated(xg, norm, 1e-6, wg),
    }
    for name, call in calls.items():
        first = call()
        _close(first, wants[name], torch.bfloat16, bf16_tol=NORM_BF16_TOL)
        for _ in range(200):
            assert torch.equal(call(), first), name
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()  # (warm-up outside the capture)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = call()
        for _ in range(100):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, first), name


EXPORT = """
import torch
from boundgen.models import skinny
from boundgen.models.decoder import DecoderLayer
import sys
sys.path.insert(0, sys.argv[1])
from small_layer import small_config

skinny.applies = lambda *a, **k: True  # (CPU tensors: traced with fake tensors, never run)
layer = DecoderLayer(small_config()).to(torch.bfloat16)


class Parts(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, o):
        counts = skinny.counters(x, self.layer)
        cos, sin = x[:, :8].unsqueeze(1), x[:, 8:16].unsqueeze(1)
        q, k, v = self.layer.attention_input(x, cos, sin, counts=counts)
        return self.layer.mlp_block(self.layer.attention_output(x, o, counts), counts), q, k, v


class Step(torch.nn.Module):  # a decode step's input: q by KV head, k and v into the cache
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cache, step):
        counts = skinny.counters(x, self.layer)
        cos, sin = x[:, :8].unsqueeze(1), x[:, 8:16].unsqueeze(1)
        return self.layer.decode_input(x, cos, sin, cache, step, True, counts)


x, o = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
auto = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
with torch.inference_mode():
    if sys.argv[2] == "decode":
        cache = torch.zeros(16, 4, 2, 2, 16, dtype=torch.bfloat16)
        step = torch.tensor([1])
        rows = {0: torch.export.Dim.AUTO}
        ep = torch.export.export(Step(layer), (x, cache, step), dynamic_shapes=(auto, rows, None))
        ep = ep.run_decompositions({})  # functional: the cache's write as a graph output
    else:
        ep = torch.export.export(Parts(layer), (x, o), dynamic_shapes=(auto, auto))
ops = [
    f"{n.target}({n.args[0]})" if "auto_functionalized" in str(n.target) else str(n.target)
    for n in ep.graph.nodes
    if n.op == "call_function"
]
print(" ".join(o for o in ops if o.startswith("boundgen") or "auto_functionalized" in o))
print("zeros:", ops.count("aten.zeros.default"))  # the counters: one fill for the four calls
print("symbols:", len(ep.range_constraints))  # the rows: x and o share them
print("mutated:", " ".join(sorted(ep.graph_signature.user_inputs_to_mutate.values())))
print("copies:", sum("index_copy" in o or "stack" in o for o in ops))
"""


def _export(what: str) -> list[str]:
    """The EXPORT script's report of `what` ("parts" or "decode"), in a child without
    `TRITON_INTERPRET` (the interpreter's kernels are not traceable)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = os.path.dirname(os.path.abspath(__file__))
    res = subprocess.run(
        [sys.executable, "-c", EXPORT, tests, what],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.splitlines()


def test_the_layer_traces_with_symbolic_rows():
    """torch.export (fake tensors, no kernel run) of the layer's fused parts with every activation
    dim left to export (`Dim.AUTO`, as dynamo's automatic dynamic shapes leave them for the beam
    layers): the kernels specialise on the weights' sizes only, so the rows stay symbolic. On
    the H200 a K read from the activation was a SymInt the tile table could not hash. The four
    calls share one counter buffer, sized by the symbolic rows."""
    lines = _export("parts")
    assert lines[0].split() == [
        "boundgen.norm_linear.default",
        "boundgen.linear_residual.default",
        "boundgen.norm_gated.default",
        "boundgen.linear_residual.default",
    ]
    assert lines[1] == "zeros: 1"
    assert lines[2] == "symbols: 1"


def test_a_decode_step_s_input_traces_as_one_call_that_writes_the_cache():
    """The same for `decode_input` (q by KV head, the cache slot written by the kernel): one
    `norm_linear` call, the cache an input the graph mutates, no stack or `index_copy` of k and
    v, the rows symbolic."""
    lines = _export("decode")
    assert lines[0].split() == ["auto_functionalized_v2(boundgen.norm_linear.default)"]
    assert lines[2] == "symbols: 1"
    assert lines[3] == "mutated: cache"
    assert lines[4] == "copies: 0"


HOPPER = """
from boundgen.models import skinny, skinny_tiles

norm, bias, gated, residual, rope = (a == "1" for a in sys.argv[1:6])
eps_type, split, group = sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
fn = skinny._skinny_kernel
k, n = (4864, 896) if residual else (896, 4864 if gated else 1152)
block_n, block_k, _, warps, stages = skinny_tiles.default_tile(k, n, gated, 16)
per, split = skinny_tiles.k_split(k, block_k, split)
rot_cols, head_d = (1024, 64) if rope else (0, 0)  # Qwen2.5-0.5B: 14 + 2 heads rotated
const = dict(
    K=k, N=n, NORM=norm, BIAS=bias, GATED=gated, RESIDUAL=residual, ROT_COLS=rot_cols,
    HEAD_D=head_d, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, K_SPLIT=per, SPLIT_K=split,
    PRECISION="tf32", INTERPRET=False,
    # a decode step's cache write (group > 0): q (896 columns, 14 heads) out in KV-head order
    KV=group > 0, Q_COLS=896 if group else n, GROUP=max(group, 1),
)
sig = {n: "i32" for n in fn.arg_names}
pointers = (
    "x_ptr", "w_ptr", "out_ptr", "bias_ptr", "norm_ptr", "res_ptr", "cos_ptr", "sin_ptr", "kv_ptr"
)
sig.update({n: "*bf16" for n in pointers})
sig.update(part_ptr="*fp32", count_ptr="*i32", step_ptr="*i64")
sig["eps"] = eps_type
if eps_type == "constexpr":  # how torch 2.11's mutation analysis hands scalars over
    const["eps"] = 1e-6
sig.update(dict.fromkeys(const, "constexpr"))
aligned = [n for n in fn.arg_names if sig[n].startswith("*")]
"""


@pytest.mark.parametrize(
    ("norm", "bias", "gated", "residual", "rope", "eps_type", "split", "group"),
    [
        ("1", "1", "0", "0", "0", "fp32", "1", "0"),  # norm + qkv, K whole
        ("1", "1", "0", "0", "0", "fp32", "7", "0"),  # norm + qkv, K split
        ("1", "1", "0", "0", "1", "fp32", "7", "0"),  # norm + qkv + the q/k rotation
        ("1", "1", "0", "0", "1", "fp32", "7", "7"),  # + q by KV head, k and v to the cache
        ("1", "1", "0", "0", "1", "fp32", "1", "1"),  # + k and v to the cache, K whole
        ("1", "0", "1", "0", "0", "fp32", "3", "0"),  # norm + gate_up + SiLU·mul
        ("0", "0", "0", "1", "0", "fp32", "13", "0"),  # down + residual
        ("0", "0", "0", "1", "0", "fp32", "1", "0"),
        ("1", "1", "0", "0", "1", "fp64", "7", "0"),  # Inductor's launcher types the float fp64
        ("1", "0", "1", "0", "0", "constexpr", "3", "0"),  # torch 2.11's mutation analysis
    ],
)
def test_kernel_compiles_for_hopper(norm, bias, gated, residual, rope, eps_type, split, group):
    """The interpreter runs the kernel as Python; this compiles each variant for sm_90 (Triton's
    bundled ptxas, no GPU), so what only the compiler checks (types carried through the K loop
    and into the last program's sum, the atomic count, the rotation's reshapes, the eps as fp64
    or a constexpr, the cache slot's store) fails here too."""
    compile_in_child(HOPPER, norm, bias, gated, residual, rope, eps_type, split, group)


def test_the_sweep_times_distinct_tiles_that_cover_k():
    """`bench_skinny.py --sweep`'s two stages (pure tile arithmetic, no GPU): every tile is
    distinct, its splits whole BLOCK_K steps with none past K, and the first stage spans K
    whole to 264 programs or more (or as many as 32-column tiles and 128-wide steps allow)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_skinny

    for k, n, m in [(896, 1152, 16), (4864, 896, 16), (896, 4864, 64), (896, 896, 64)]:
        block_m = skinny_tiles.block_m_for(m)
        first = bench_skinny.first_stage(k, n, m, block_m)
        assert len(set(first)) == len(first) and any(t[2] == 1 for t in first)
        programs = [-(-n // t[0]) * t[2] for t in first]
        assert max(programs) >= min(264, -(-n // 32) * -(-k // 128))  # (qkv: 36 tiles × 7)
        for tile in first + bench_skinny.second_stage(first[-1], k):
            per, split = skinny_tiles.k_split(k, tile[1], tile[2])
            assert split == tile[2] and (split - 1) * per < k <= split * per, tile
        second = bench_skinny.second_stage(first[-1], k)
        assert first[-1] not in second and len(set(second)) == len(second)


def test_the_sweep_finds_a_tile_per_gemm_and_restores_the_table(monkeypatch):
    """`bench_skinny.sweep` on the tiny preset in the interpreter, its GPU timer replaced by a
    call that runs the kernels and reads the tile's BLOCK_N back as its 'time' (over 2 layers):
    each GEMM's fastest is a 32-column tile, every tile ran, and the table is as it was
    before."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_skinny

    def fake_us(fn, iters):
        fn()
        return float(skinny_tiles.TILES[next(iter(skinny_tiles.TILES))][0])

    monkeypatch.setattr(bench_skinny, "graph_us", fake_us)
    monkeypatch.setattr(skinny_tiles, "TILES", {})
    layers = bench_skinny.make_layers("tiny", 2, DEV)
    with skinny.forced(), torch.no_grad():
        rows = bench_skinny.sweep(layers, 16, 1, DEV)
    assert [r["gemm"] for r in rows] == ["qkv", "o_proj", "gate_up", "down"]
    for r in rows:
        assert r["errors"] == 0 and r["best_tile"][0] == 32 and r["best_us"] == 16.0
        assert r["key"][3] == 16 and r["tiles_timed"] >= 6 and r["default_us"] == 32.0
    assert skinny_tiles.TILES == {}


def test_the_sweep_rejects_a_tile_off_the_eager_layer(monkeypatch):
    """A tile whose output is off the eager layer by more than rounding (a lost partial sum)
    is an error row, never the fastest."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_skinny

    monkeypatch.setattr(bench_skinny, "graph_us", lambda fn, iters: 1.0)
    monkeypatch.setattr(skinny_tiles, "TILES", {})
    want = torch.randn(16, 64)
    weight = torch.zeros(64, 64)
    rounded = want.to(torch.bfloat16).float()
    key, tile = (64, 64, False, 16), (32, 64, 2, 4, 3)
    ok = bench_skinny.time_tile(lambda: rounded, want, key, tile, 1, 1.0, weight)
    assert ok["us"] == 1.0 and ok["off"] < 0.01
    lost = bench_skinny.time_tile(lambda: want * 0.8, want, key, tile, 1, 1.0, weight)
    assert "us" not in lost and "off the eager layer" in lost["error"]
