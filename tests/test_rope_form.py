"""`BOUNDGEN_ROPE_FORM` (`models/layers.py`): HF's rotate-half written with `torch.cat` ("cat", the
default) or as x·cos + flip(x)·(∓sin) over x's two halves ("flip", no `cat` for Inductor to lower
two ways). The same products and sums per element, so eager answers bit for bit alike; the
compiled artifacts are keyed apart (the default, the key and a bad value: `test_switches.py`)."""

from __future__ import annotations

import pytest
import torch

from boundgen.models import layers
from boundgen.models.layers import apply_rope

QUERY = [5, 9, 2, 33, 7, 12, 40, 3]
ITEMS = [[8, 1, 4], [19], [6, 6, 2, 30, 11], []]


def _tables(t: int, d: int, dtype, seed: int):
    """cos, sin [t, D/2] of `t` random positions, as `rope_tables` makes them (|·| ≤ 1)."""
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("grouped", [False, True])
def test_flip_rotates_bit_for_bit_as_cat(dtype, grouped, monkeypatch):
    """x [T, H, D] with cos/sin [T, 1, D/2], and the grouped layout's x [T, G, Hkv, D] with
    [T, 1, 1, D/2] (`Attention.heads`)."""
    t, d = 37, 64
    g = torch.Generator().manual_seed(3)
    shape = (t, 3, 2, d) if grouped else (t, 6, d)
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    cos, sin = _tables(t, d, dtype, seed=4)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if grouped:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    monkeypatch.setattr(layers, "ROPE_FORM", "cat")
    want = apply_rope(x, cos, sin)
    monkeypatch.setattr(layers, "ROPE_FORM", "flip")
    got = apply_rope(x, cos, sin)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


def test_flip_keeps_signed_zeros_and_the_halves_order(monkeypatch):
    """The first half is x1·cos − x2·sin, the second x2·cos + x1·sin, zeros' signs included
    (a + (−b) and a − b are the same IEEE result)."""
    monkeypatch.setattr(layers, "ROPE_FORM", "flip")
    x = torch.tensor([[[-0.0, 0.0, 2.0, 0.0]]])  # x1 = (-0, 0), x2 = (2, 0)
    cos = torch.tensor([[[1.0, -0.0]]])
    sin = torch.tensor([[[0.0, 1.0]]])
    got = apply_rope(x, cos, sin)
    monkeypatch.setattr(layers, "ROPE_FORM", "cat")
    want = apply_rope(x, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_every_workload_answers_exactly_alike(arch, engine_for, monkeypatch):
    engine = engine_for(arch)
    prompt = QUERY + [17, 21]
    answers = {}
    for form in layers.ROPE_FORMS:
        monkeypatch.setattr(layers, "ROPE_FORM", form)
        answers[form] = {
            "score": engine.score(QUERY, ITEMS, [3, 11], apply_softmax=True),
            "embed": engine.embed([QUERY, QUERY[:3]], pooling="mean"),
            "beam": engine.beam_search(prompt, beam_width=4, steps=3),
        }
    cat, flip = answers["cat"], answers["flip"]
    assert flip["score"] == cat["score"] and flip["beam"] == cat["beam"]
    assert torch.equal(flip["embed"], cat["embed"])


def test_flip_exports_without_a_lifted_constant(engine_for, monkeypatch):
    """The sign comes from an op: a package built without its constants
    (`package_constants_in_so=False`) finds every tensor it reads among the model's."""
    from boundgen.compile import aoti
    from boundgen.compile.buckets import Bucket

    fwd = aoti.PackedForward(engine_for("qwen2").model).eval()
    ex = Bucket.parse("t16-s2-m8").example("cpu")
    constants = {}
    for form in layers.ROPE_FORMS:
        monkeypatch.setattr(layers, "ROPE_FORM", form)
        with torch.no_grad():
            ep = torch.export.export(fwd, (ex.input_ids, ex.positions, ex.attn), strict=False)
        assert not ep.graph_signature.lifted_tensor_constants, form
        constants[form] = set(ep.constants)  # the model's non-persistent buffers (RoPE tables)
    assert constants["flip"] == constants["cat"]
    assert constants["flip"] <= {name for name, _ in fwd.named_buffers()}


def test_compiled_flip_computes_what_compiled_cat_does(monkeypatch):
    """Inductor's kernels for the two forms (CPU here) give the same values, bit for bit, and
    eager's within one bf16 rounding (compiled, the products and sums stay in float32)."""
    t, d = 29, 64
    x = torch.randn(t, 6, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cos, sin = (c.unsqueeze(1) for c in _tables(t, d, torch.bfloat16, seed=6))
    out = {}
    for form in layers.ROPE_FORMS:
        monkeypatch.setattr(layers, "ROPE_FORM", form)
        torch._dynamo.reset()  # the form is read while tracing: a graph of its own
        out[form] = torch.compile(apply_rope, fullgraph=True)(x, cos, sin)
    assert torch.equal(out["flip"], out["cat"])
    torch.testing.assert_close(out["flip"], apply_rope(x, cos, sin), rtol=0, atol=0.016)
