"""The Triton `segments` packed-prefill kernel against the reference cascade attention.

Without CUDA the kernel runs in Triton's CPU interpreter (`TRITON_INTERPRET=1`, set by conftest.py
before triton is imported), so the sizes stay small; with CUDA the same tests run the compiled
kernel, and the `gpu` tests compare it with flash attention (`varlen`) on W1/W2-like packings,
inside `torch.compile` and through `torch.export` + AOTInductor. Skipped when triton is missing.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from hopper import compile_in_child

pytest.importorskip("triton")

import triton.language as tl

from boundgen.attention import segments
from boundgen.attention.backends import (
    ReferenceBackend,
    SegmentsBackend,
    get_backend,
)
from boundgen.attention.cascade import prefill_attention
from boundgen.compile.buckets import Bucket
from boundgen.text.packing import SequenceGroup, pack

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def kernel(q, k, v, attn):
    """The kernel through the backend's prefill (the path the model takes)."""
    return SegmentsBackend(ReferenceBackend(), "always").prefill(q, k, v, attn)


def reference(q, k, v, attn):
    """The oracle: the reference backend's two calls + merge, in float32 on the CPU."""
    f = lambda x: x.float().cpu()
    return prefill_attention(f(q), f(k), f(v), attn.to("cpu"), ReferenceBackend())


def qkv(t, hq, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(t, h, d, generator=g).to(dtype).to(DEV)
    return mk(hq), mk(hkv), mk(hkv)


def random_groups(seed: int, n: int, shared: bool, longest: int = 24) -> list[SequenceGroup]:
    """n groups of random sizes: with `shared`, most have a prefix and ≥ 2 suffixes (cascade);
    some are plain (no prefix, or a single suffix); empty and 1-token suffixes included."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        prefix = [1] * rnd.randint(1 if shared else 0, longest)
        count = rnd.choice([2, 3, 5]) if shared and rnd.random() < 0.75 else 1
        suffixes = [[2] * rnd.choice([0, 1, 1, 3, rnd.randint(1, longest)]) for _ in range(count)]
        if not prefix:  # plain sequences (prefix + suffix) must not be empty
            suffixes = [x or [3] for x in suffixes]
        out.append(SequenceGroup(prefix, suffixes))
    return out


def check(batch, hq, hkv, d, dtype, atol, seed=0):
    batch = batch.to(DEV)
    q, k, v = qkv(batch.num_tokens, hq, hkv, d, dtype, seed)
    out = kernel(q, k, v, batch.attn)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(q, k, v, batch.attn)
    err = (out.float().cpu() - ref).abs().max().item()
    assert err <= atol, err


LAYOUTS = {
    # name: (groups, share_prefix)
    "plain": (lambda: [SequenceGroup([], [[1] * n]) for n in (1, 5, 37, 2, 20, 1)], True),
    "shared": (lambda: random_groups(1, 4, shared=True), True),
    "mixed": (lambda: random_groups(2, 6, shared=True), True),
    "not-shared": (lambda: random_groups(3, 4, shared=True), False),
    "one-token": (
        lambda: [SequenceGroup([1], [[2], [3], [4]]), SequenceGroup([], [[5]] * 9)],
        True,
    ),
    "long": (
        lambda: [SequenceGroup([1] * 90, [[2] * 70, [3] * 3]), SequenceGroup([], [[4] * 75])],
        True,
    ),
}


HEADS = {"mha": (4, 4, 64), "qwen": (14, 2, 64), "gqa8-d128": (8, 1, 128)}


@pytest.mark.parametrize(
    ("layout", "heads"),
    [(layout, "qwen") for layout in sorted(LAYOUTS)]
    + [(layout, h) for layout in ("mixed", "long") for h in ("mha", "gqa8-d128")],
)
def test_kernel_matches_reference_fp32(layout, heads):
    hq, hkv, d = HEADS[heads]
    groups, share = LAYOUTS[layout]
    check(pack(groups(), share_prefix=share), hq, hkv, d, torch.float32, 2e-5)


@pytest.mark.parametrize("block_pointers", [True, False])
def test_both_ways_of_loading_keys(monkeypatch, block_pointers):
    """Block pointers where Triton has them (removed in 3.9), masked pointer loads otherwise: both
    give the reference's result (the interpreter reads the switch at call time)."""
    if block_pointers and not segments.BLOCK_POINTERS:
        pytest.skip("this Triton has no block pointers")
    monkeypatch.setattr(segments, "BLOCK_POINTERS", tl.constexpr(block_pointers))
    groups, share = LAYOUTS["mixed"]
    check(pack(groups(), share_prefix=share), 14, 2, 64, torch.float32, 2e-5)


def rotated_inputs(batch, hq, hkv, d, dtype, seed=0):
    """q, k, v as the model hands them to attention (strided views of one qkv projection) and
    cos/sin [T, 1, D/2] of random angles."""
    g = torch.Generator().manual_seed(seed)
    t = batch.num_tokens
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    angles = torch.randn(t, 1, d // 2, generator=g) * 3
    return q, k, v, angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)


@pytest.mark.parametrize("layout", ["plain", "mixed", "one-token", "long"])
@pytest.mark.parametrize("block_pointers", [True, False])
def test_the_kernel_rotates_q_and_k_as_it_loads_them(layout, block_pointers, monkeypatch):
    """`packed_prefill_rope` (q and k unrotated, cos/sin beside them) equals the kernel over q and
    k rotated first (HF's rotate-half, `apply_rope`) — exactly in float32 — and the reference."""
    from boundgen.models.layers import apply_rope

    if block_pointers and not segments.BLOCK_POINTERS:
        pytest.skip("this Triton has no block pointers")
    monkeypatch.setattr(segments, "BLOCK_POINTERS", tl.constexpr(block_pointers))
    groups, share = LAYOUTS[layout]
    batch = pack(groups(), share_prefix=share).to(DEV)
    q, k, v, cos, sin = rotated_inputs(batch, 14, 2, 64, torch.float32)
    backend = SegmentsBackend(ReferenceBackend(), "always")
    assert backend.takes_rope(batch.attn)
    out = backend.prefill_rope(q, k, v, batch.attn, cos, sin)
    first = kernel(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, batch.attn)
    assert torch.equal(out, first)
    ref = reference(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, batch.attn)
    assert (out.cpu() - ref).abs().max().item() <= 2e-5


def to_bf16_as_the_kernel(x: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 as the kernel's `.to` rounds: to nearest even on a GPU, toward zero in
    Triton's CPU interpreter (3.9 truncates the low 16 bits)."""
    if CUDA:
        return x.to(torch.bfloat16)
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (16, 2, 128)])
def test_the_kernel_rotates_bf16_as_a_compiled_rotation_rounds(hq, hkv, d):
    """In bf16 the kernel rotates in float32 and rounds q and k once, as Inductor's compiled
    rotation does (eager `apply_rope` rounds after each op): the kernel over q and k rotated in
    float32 and rounded so gives the same answer (exactly in the interpreter; on a GPU the
    rotation may fuse a multiply-add, so within a bf16 ulp of the inputs)."""
    from boundgen.models.layers import apply_rope

    batch = pack(random_groups(4, 5, shared=True)).to(DEV)
    q, k, v, cos, sin = rotated_inputs(batch, hq, hkv, d, torch.bfloat16, seed=1)
    rot = lambda x: to_bf16_as_the_kernel(apply_rope(x.float(), cos.float(), sin.float()))
    out = SegmentsBackend(ReferenceBackend(), "always").prefill_rope(q, k, v, batch.attn, cos, sin)
    assert out.dtype == torch.bfloat16
    first = kernel(rot(q), rot(k), v, batch.attn)
    if CUDA:
        assert (out.float() - first.float()).abs().max().item() <= 2e-2
    else:
        assert torch.equal(out, first)
    ref = reference(rot(q), rot(k), v, batch.attn)
    assert (out.float().cpu() - ref).abs().max().item() <= 2e-2


def test_cascade_only_backend_takes_rope_for_shared_prefix_batches():
    """`segments-cascade` runs the kernel only for shared-prefix batches, so only those are
    handed over unrotated."""
    backend = SegmentsBackend(ReferenceBackend(), "cascade")
    assert backend.takes_rope(pack(random_groups(1, 4, shared=True)).attn)
    assert not backend.takes_rope(pack([SequenceGroup([], [[1] * 5, [2] * 3])]).attn)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (16, 2, 128)])
def test_kernel_matches_reference_bf16(hq, hkv, d):
    # bf16 inputs, fp32 accumulation, probabilities rounded to bf16 for the PV product (as flash)
    check(pack(random_groups(4, 5, shared=True)), hq, hkv, d, torch.bfloat16, 2e-2)


@pytest.mark.parametrize("seed", range(4))
def test_kernel_over_random_packings(seed):
    rnd = random.Random(seed)
    hkv = rnd.choice([1, 2])
    hq = hkv * rnd.choice([1, 7, 8])
    groups = random_groups(10 + seed, rnd.randint(2, 7), shared=rnd.random() < 0.8)
    check(pack(groups), hq, hkv, 64, torch.float32, 2e-5, seed=seed)


@pytest.mark.parametrize("spec", ["t96-s12-m40-g3-p30-q40", "t64-s9-m16"])
def test_kernel_on_padded_buckets(spec):
    """A real batch padded into a bucket: pad segments, zero-length trailing segments, the pad
    group and unused groups (empty prefixes) stay exact, and so do the real rows."""
    from boundgen.compile.buckets import BucketSet

    bucket = Bucket.parse(spec)
    groups = [SequenceGroup([1] * 7, [[2] * 3, [3] * 5, [4]]), SequenceGroup([], [[5] * 6])]
    if not bucket.cascade:
        groups = [SequenceGroup([], [[5] * 6, [6] * 11])]
    chosen, padded = BucketSet([bucket]).pad(pack(groups))
    assert chosen == bucket
    check(padded, 14, 2, 64, torch.float32, 2e-5)
    check(bucket.example(), 14, 2, 64, torch.float32, 2e-5)


def test_prefill_attention_dispatch():
    """`segments-cascade` leaves plain batches to `varlen` (prefill returns None); `segments`
    takes every batch; both equal the reference."""
    plain = pack([SequenceGroup([], [[1] * 5, [2] * 9])]).to(DEV)
    shared = pack([SequenceGroup([1] * 6, [[2] * 3, [3] * 4])]).to(DEV)
    q, k, v = qkv(plain.num_tokens, 4, 2, 64)
    cascade = SegmentsBackend(ReferenceBackend(), "cascade")
    assert cascade.prefill(q, k, v, plain.attn) is None
    out = prefill_attention(q, k, v, plain.attn, cascade)
    assert torch.allclose(out.cpu(), reference(q, k, v, plain.attn), atol=2e-5)
    q, k, v = qkv(shared.num_tokens, 4, 2, 64)
    for when in ("cascade", "always"):
        out = prefill_attention(q, k, v, shared.attn, SegmentsBackend(ReferenceBackend(), when))
        assert torch.allclose(out.cpu(), reference(q, k, v, shared.attn), atol=2e-5)


def test_backend_names_and_device_checks():
    assert SegmentsBackend(ReferenceBackend(), "always").name == "reference+segments"
    assert get_backend("auto", "cpu").name == "reference"
    for name in ("segments", "segments-cascade"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            get_backend(name, "cpu")
    with pytest.raises(ValueError, match="'always' or 'cascade'"):
        SegmentsBackend(ReferenceBackend(), "sometimes")


EXPORT = """
import torch
from boundgen.attention.backends import ReferenceBackend, SegmentsBackend
from boundgen.attention.cascade import prefill_attention
from boundgen.text.packing import SequenceGroup, pack

batch = pack([SequenceGroup([1] * 10, [[2] * 3, [3] * 4]), SequenceGroup([], [[4] * 5])])
backend = SegmentsBackend(ReferenceBackend(), "cascade")
mk = lambda h: torch.randn(batch.num_tokens, h, 64)


class Attn(torch.nn.Module):
    def forward(self, q, k, v, attn):
        return prefill_attention(q, k, v, attn, backend)


class AttnRope(torch.nn.Module):
    def forward(self, q, k, v, cos, sin, attn):
        return backend.prefill_rope(q, k, v, attn, cos, sin)


for module, extra in ((Attn(), ()), (AttnRope(), (mk(1)[..., :32], mk(1)[..., :32]))):
    args = (mk(14), mk(2), mk(2), *extra, batch.attn)
    ep = torch.export.export(module, args, strict=False)
    print([(str(n.target), n.args[-2:]) for n in ep.graph.nodes if n.op == "call_function"])
"""


def test_export_traces_the_op_with_its_static_ints():
    """`torch.export` keeps `boundgen::packed_prefill` (and `packed_prefill_rope`) as one node
    taking the layout's ints (the fake kernel runs, nothing launches). In a child without the
    interpreter: interpreted kernels cannot be traced."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", EXPORT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[('boundgen.packed_prefill.default', (10, 7))]" in res.stdout, res.stdout
    # q and k unrotated, cos/sin beside them (`BOUNDGEN_QK_ROTATION=attention`): one node too
    assert "[('boundgen.packed_prefill_rope.default', (10, 7))]" in res.stdout, res.stdout


HOPPER = """
from boundgen.attention import segments

d, gqa, scale_type, rope = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "rope"
fn = segments._packed_prefill_kernel
block_m, block_n, warps, stages = segments.config_for(d)
const = dict(
    SEG_ITERS=8, GROUP_ITERS=4, GQA=gqa, HEAD_DIM=d, BLOCK_D=d, BLOCK_T=block_m // gqa,
    BLOCK_M=block_m, BLOCK_N=block_n, HAS_PREFIX=True, IEEE=False, INTERPRET=False, ROPE=rope,
)
sig = {n: "i32" for n in fn.arg_names}
sig.update({n: "*bf16" for n in ("Q", "K", "V", "Out", "C", "S")})
sig.update({n: "*i32" for n in ("CU", "CU_PREFIX", "CU_GROUP_Q")})
constexprs_with_scale(sig, const, scale_type, 0.18033688011112042)
aligned = [n for n in fn.arg_names if n.startswith("stride") or sig[n].startswith("*")]
"""


@pytest.mark.parametrize(
    ("d", "gqa", "scale_type", "rope"),
    [
        (64, 7, "fp32", "no"),
        (128, 8, "fp32", "no"),
        (64, 7, "fp64", "no"),
        (64, 7, "constexpr", "no"),
        (64, 7, "fp64", "rope"),
        (128, 8, "fp32", "rope"),
    ],
)
def test_kernel_compiles_for_hopper(d, gqa, scale_type, rope):
    """The interpreter runs the kernel as Python; this compiles it for sm_90 (Triton's bundled
    ptxas, no GPU needed), so what only the compiler checks (loop-carried types, layouts, shared
    memory) fails here too. The float scale comes typed fp32 from Triton's own launcher and fp64
    from Inductor's (torch.compile, AOTInductor: what failed on the H200 before the kernel cast
    it), and as a constexpr Python float in torch 2.11's analysis of which tensors a user kernel
    mutates (`generate_ttir`: on the H200 the analysis failed on `.to` of a float, and Inductor
    then assumed that the kernel writes every input). With "rope" the kernel rotates q and k as
    it loads them (`packed_prefill_rope`)."""
    compile_in_child(HOPPER, str(d), str(gqa), scale_type, rope)


# -- GPU: against flash attention, compiled, exported ---------------------------------------------
def w2_batch(candidates: int = 100) -> object:
    """W2: one query prefix of 256 tokens and 100 candidates of 16 tokens (one cascade group)."""
    return pack([SequenceGroup([1] * 256, [[2] * 16 for _ in range(candidates)])])


def w1_batch(tokens: int = 8192, seed: int = 0) -> object:
    """W1: plain sequences of 64–256 tokens packed up to `tokens`."""
    rnd, lens = random.Random(seed), []
    while sum(lens) < tokens:
        lens.append(min(rnd.randint(64, 256), tokens - sum(lens)))
    return pack([SequenceGroup([], [[1] * n for n in lens])])


@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["w2", "w1"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (32, 8, 64), (16, 8, 128)])
def test_kernel_matches_flash_on_cuda(workload, hq, hkv, d):
    batch = (w2_batch() if workload == "w2" else w1_batch()).to("cuda")
    q, k, v = qkv(batch.num_tokens, hq, hkv, d, torch.bfloat16)
    flash = prefill_attention(q, k, v, batch.attn, get_backend("varlen", "cuda"))
    ours = prefill_attention(q, k, v, batch.attn, get_backend("segments", "cuda"))
    assert torch.isfinite(ours).all()
    assert (ours.float() - flash.float()).abs().max().item() <= 2e-2
    # and both against the float32 reference on a subset of rows (the reference is slow on W1)
    if workload == "w2":
        ref = reference(q, k, v, batch.attn)
        assert (ours.float().cpu() - ref).abs().max().item() <= 2e-2


@pytest.mark.gpu
def test_kernel_inside_torch_compile():
    batch = w2_batch(20).to("cuda")
    q, k, v = qkv(batch.num_tokens, 14, 2, 64, torch.bfloat16)
    backend = get_backend("segments-cascade", "cuda")
    fn = torch.compile(lambda q, k, v, a: prefill_attention(q, k, v, a, backend), fullgraph=True)
    eager = prefill_attention(q, k, v, batch.attn, backend)
    compiled = fn(q, k, v, batch.attn)
    assert torch.allclose(compiled.float(), eager.float(), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["w2", "w1"])
def test_rotating_kernel_matches_flash_over_rotated_inputs_on_cuda(workload):
    """`packed_prefill_rope` compiled for the GPU (and inside `torch.compile`) against flash over
    q and k rotated first, on W1/W2-like packings."""
    from boundgen.models.layers import apply_rope

    batch = (w2_batch() if workload == "w2" else w1_batch()).to("cuda")
    q, k, v, cos, sin = rotated_inputs(batch, 14, 2, 64, torch.bfloat16)
    flash = prefill_attention(
        apply_rope(q, cos, sin),
        apply_rope(k, cos, sin),
        v,
        batch.attn,
        get_backend("varlen", "cuda"),
    )
    backend = get_backend("segments", "cuda")
    ours = backend.prefill_rope(q, k, v, batch.attn, cos, sin)
    assert torch.isfinite(ours).all()
    assert (ours.float() - flash.float()).abs().max().item() <= 3e-2
    fn = torch.compile(lambda *a: backend.prefill_rope(*a), fullgraph=True)
    compiled = fn(q, k, v, batch.attn, cos, sin)
    assert torch.allclose(compiled.float(), ours.float(), atol=1e-3)


@pytest.mark.gpu
def test_kernel_through_export_and_aoti(tmp_path):
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    from boundgen.compile.preload import AOTIUnsafe, ensure_loadable

    batch = w2_batch(20).to("cuda")
    q, k, v = qkv(batch.num_tokens, 14, 2, 64, torch.bfloat16)
    backend = get_backend("segments-cascade", "cuda")

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, attn):
            return prefill_attention(q, k, v, attn, backend) * 1.0

    ep = torch.export.export(Attn(), (q, k, v, batch.attn), strict=False)
    assert any("packed_prefill" in str(n.target) for n in ep.graph.nodes)
    path = aoti_compile_and_package(ep, package_path=str(tmp_path / "attn.pt2"))
    try:  # the engine's guard: in a process without the preload the load would segfault
        ensure_loadable(path, cache_root=tmp_path, allow_reexec=False)
    except AOTIUnsafe as exc:
        pytest.skip(f"AOTInductor load needs a preload in this process: {exc}")
    runner = aoti_load_package(path)
    a = batch.attn
    got = runner(q, k, v, a)
    want = prefill_attention(q, k, v, a, backend)
    assert torch.allclose(got.float(), want.float(), atol=1e-3)


@pytest.mark.gpu
def test_segments_engine_equals_varlen_engine(tiny_model):
    from boundgen import Engine

    path = tiny_model("qwen2")
    query, items = "a query of some length", [f"item {i} with words" for i in range(12)]
    out = {}
    for attention in ("varlen", "segments", "segments-cascade"):
        engine = Engine.from_pretrained(
            path, device="cuda", dtype="bfloat16", attention=attention, backend="eager"
        )
        assert engine.model.backend.name == attention
        out[attention] = torch.tensor(engine.score(query, items, [514, 371]))
    for name in ("segments", "segments-cascade"):
        assert torch.allclose(out[name], out["varlen"], atol=2e-2), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "eager+graphs", "compile"])
def test_rotation_inside_the_kernel_scores_as_rotating_first(tiny_model, monkeypatch, backend):
    """`BOUNDGEN_QK_ROTATION=attention` on CUDA: an engine whose prompt forwards hand q and k to
    the `segments` kernel unrotated scores as the default rotation does, within bf16 noise (eager,
    graphed, and through `torch.compile`). The graphed and compiled engines are given the
    request's own cascade bucket and must run it: a shared-prefix request fits no plain default
    bucket, and would run eagerly whatever the backend."""
    from boundgen import Engine
    from boundgen.models import decoder

    path = tiny_model("qwen2")
    query, items = "a query of some length", [f"item {i} with words" for i in range(12)]
    # the request's whole cascade group: a 13-token prefix, 50 suffix tokens in 12 segments (a
    # smaller bucket has the compiled engine cut the group, the graphed one run it eagerly)
    bucket = "t128-s24-m32-g2-p32-q96"
    out = {}
    for mode in ("together", "attention"):
        monkeypatch.setattr(decoder, "QK_ROTATION", mode)
        engine = Engine.from_pretrained(
            path,
            device="cuda",
            dtype="bfloat16",
            attention="segments",
            backend=backend,
            compile_buckets=bucket,
        )
        out[mode] = torch.tensor(engine.score(query, items, [514, 371]))
        if backend != "eager":  # the request's one piece ran in the bucket (staged or padded)
            stats = engine.runner.buckets.stats
            assert (stats.batches, stats.misses) == ({bucket: 1}, 0), mode
    assert torch.allclose(out["attention"], out["together"], atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend", ["eager+graphs", "compile", pytest.param("aoti+graphs", marks=pytest.mark.slow)]
)
def test_segments_in_compiled_buckets(tiny_model, tmp_path, backend):
    """The model's real graph (q/k/v as views of the qkv projection) with the kernel in a cascade
    bucket, captured, compiled by Inductor or AOTInductor: the scores of flash eager."""
    from boundgen import Engine
    from boundgen.compile.backends import CompileOptions
    from boundgen.compile.preload import AOTIUnsafe
    from boundgen.runner import make_runner

    path = tiny_model("qwen2")
    load = lambda attention: Engine.from_pretrained(
        path, device="cuda", dtype="bfloat16", attention=attention, backend="eager"
    )
    flash, seg = load("varlen"), load("segments-cascade")
    opts = CompileOptions(
        buckets=[Bucket.parse("t64-s12-m32-g3-p24-q24")],
        cache_dir=tmp_path,
        graph_max_tokens=128,
        compile_decode=False,
    )
    try:
        runner = make_runner(seg.model, seg.device, 4096, True, backend, opts)
    except AOTIUnsafe as exc:
        pytest.skip(f"AOTInductor load needs a preload in this process: {exc}")
    e = seg.with_runner(runner)
    score = lambda engine: torch.tensor(
        engine.score("the quick brown fox", ["jumps over", "a lazy dog", "x"], [5, 17])
    )
    for _ in range(2):
        torch.testing.assert_close(score(e), score(flash), atol=2e-2, rtol=0)
    assert e.runner.stats()["misses"] == 0
