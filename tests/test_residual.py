"""`compile/residual.py`: the post-grad pass that keeps a layer's residual add out of `addmm`
(`BOUNDGEN_RESIDUAL=add`, the default), in Inductor on the CPU, where its `addmm` pattern
forms too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from boundgen.compile import residual


def run_compiled(fn, pass_, *args):
    """`fn(*args)` compiled afresh with `pass_` (no cache hit, which would skip the pass)."""
    import torch._functorch.config as functorch

    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": pass_, "fx_graph_cache": False}
    with functorch.patch(enable_autograd_cache=False):
        return torch.compile(fn, fullgraph=True, options=options)(*args)


def test_a_residual_add_is_taken_out_of_addmm_and_matches_eager_exactly():
    """`x + linear(h)` in bf16: Inductor makes it an addmm (the product accumulated onto x before
    rounding); undone, the compiled result is eager's bit for bit (product rounded, then added)."""
    g = torch.Generator().manual_seed(0)
    x, h = (torch.randn(8, 64, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(64, 64, generator=g).bfloat16()
    fn = lambda x, h, w: x + F.linear(h, w)
    pass_ = residual.UnfusedResidual()
    got = run_compiled(fn, pass_, x, h, w)
    assert pass_.rewritten == 1
    assert torch.equal(got, fn(x, h, w))


def test_a_bias_vector_stays_in_the_gemm():
    """A 1-D bias rides cuBLASLt's epilogue (no copy): the pass leaves that addmm alone."""
    g = torch.Generator().manual_seed(1)
    h, w, b = torch.randn(8, 32, generator=g), torch.randn(16, 32, generator=g), torch.randn(16)
    pass_ = residual.UnfusedResidual()
    got = run_compiled(lambda h, w, b: F.linear(h, w, b), pass_, h, w, b)
    assert pass_.rewritten == 0
    torch.testing.assert_close(got, F.linear(h, w, b))


def test_the_mode_picks_the_options_and_is_part_of_the_platform_key(monkeypatch):
    from boundgen.compile.cache import platform_info

    assert isinstance(  # default: the pass
        residual.inductor_options()["post_grad_custom_post_pass"], residual.UnfusedResidual
    )
    assert platform_info("cpu")["residual"] == "add"
    monkeypatch.setattr(residual, "MODE", "addmm")
    assert residual.inductor_options() == {}  # Inductor's own graph and cache keys
    assert platform_info("cpu")["residual"] == "addmm"
    monkeypatch.setattr(residual, "MODE", "fused")
    with pytest.raises(ValueError, match="BOUNDGEN_RESIDUAL='fused': choose one of addmm, add"):
        residual.mode()


def test_a_package_build_takes_the_pass_in_add_mode(package_builds, monkeypatch):
    seen = []
    for mode in ("addmm", "add"):
        monkeypatch.setattr(residual, "MODE", mode)
        seen.append(package_builds().get("post_grad_custom_post_pass"))
    assert seen[0] is None and isinstance(seen[1], residual.UnfusedResidual)


def test_the_beam_layers_compile_with_the_pass_in_add_mode(engine_for, monkeypatch):
    """The beam search's compiled layers (`ModelSteps`) take the same options as a package build:
    Inductor's own config under `addmm`, the pass under `add`."""
    from boundgen.compile import aoti
    from boundgen.compile.decode import ModelSteps

    seen = []

    def fake_compile(fn, fullgraph=False, options=None):
        seen.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = engine_for("qwen2").model
    for mode in ("addmm", "add"):
        monkeypatch.setattr(residual, "MODE", mode)
        ModelSteps(model, aoti.export_attention(model, "cpu"), compile_layers=True)
    # the first layer's inputs, the prefill and the decode layers: Inductor's own config
    assert seen[:3] == [None, None, None]
    assert len(seen) == 6
    assert all(
        isinstance(o["post_grad_custom_post_pass"], residual.UnfusedResidual) for o in seen[3:]
    )


def test_a_compiled_prefill_layer_has_both_residual_adds_taken_out(engine_for):
    """The beam search's compiled prefill layer (`compile.decode.prefill_layer`): after o_proj
    and after down_proj, two rewrites; the layer still computes what eager does."""
    from boundgen.compile.aoti import export_attention
    from boundgen.compile.decode import prefill_layer

    model = engine_for("qwen2").model
    layer, cfg = model.layers[0], model.config
    dt = model.embed_tokens.weight.dtype
    t = 12
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dt)
    cos, sin = model.rotary(torch.arange(t), dt)
    cu = torch.tensor([0, 5, t], dtype=torch.int32)
    kv = lambda: torch.zeros(t, cfg.num_kv_heads, cfg.head_dim, dtype=dt)
    backend = export_attention(model, "cpu")
    pass_ = residual.UnfusedResidual()
    with torch.no_grad():
        normed, nxt = layer.input_layernorm(x), model.layers[1].input_layernorm
        args = (layer, x, normed, cos, sin, cu, 7)
        got = run_compiled(prefill_layer, pass_, *args, kv(), kv(), backend, nxt)
        want = prefill_layer(*args, kv(), kv(), backend, nxt)
    assert pass_.rewritten == 2
    tol = 2e-5 if dt == torch.float32 else 1e-1
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
