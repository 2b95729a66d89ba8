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


ep = torch.export.export(Attn(), (mk(14), mk(2), mk(2), batch.attn), strict=False)
print([(str(n.target), n.args[-2:]) for n in ep.graph.nodes if n.op == "call_function"])
"""


def test_export_traces_the_op_with_its_static_ints():
    """`torch.export` keeps `boundgen::packed_prefill` as one node taking the layout's ints (the
    fake kernel runs, nothing launches). In a child without the interpreter: interpreted kernels
    cannot be traced."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", EXPORT], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[('boundgen.packed_prefill.default', (10, 7))]" in res.stdout, res.stdout


HOPPER = """
from boundgen.attention import segments

d, gqa, scale_type = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
fn = segments._packed_prefill_kernel
block_m, block_n, warps, stages = segments.config_for(d)
const = dict(
    SEG_ITERS=8, GROUP_ITERS=4, GQA=gqa, HEAD_DIM=d, BLOCK_D=d, BLOCK_T=block_m // gqa,
    BLOCK_M=block_m, BLOCK_N=block_n, HAS_PREFIX=True, IEEE=False, INTERPRET=False, PDL=True,
)
sig = {n: "i32" for n in fn.arg_names}
sig.update({n: "*bf16" for n in ("Q", "K", "V", "Out")})
sig.update({n: "*i32" for n in ("CU", "CU_PREFIX", "CU_GROUP_Q")})
constexprs_with_scale(sig, const, scale_type, 0.18033688011112042)
aligned = [n for n in fn.arg_names if n.startswith("stride") or sig[n].startswith("*")]
"""


@pytest.mark.parametrize(
    ("d", "gqa", "scale_type"),
    [(64, 7, "fp32"), (128, 8, "fp32"), (64, 7, "fp64"), (64, 7, "constexpr")],
)
def test_kernel_compiles_for_hopper(d, gqa, scale_type):
    """The interpreter runs the kernel as Python; this compiles it for sm_90 (Triton's bundled
    ptxas, no GPU needed), so what only the compiler checks (loop-carried types, layouts, shared
    memory) fails here too. The float scale comes typed fp32 from Triton's own launcher and fp64
    from Inductor's (torch.compile, AOTInductor: what failed on the H200 before the kernel cast
    it), and as a constexpr Python float in torch 2.11's analysis of which tensors a user kernel
    mutates (`generate_ttir`: on the H200 the analysis failed on `.to` of a float, and Inductor
    then assumed that the kernel writes every input)."""
    out = compile_in_child(HOPPER, str(d), str(gqa), scale_type)
    assert "waits first True" in out  # programmatic launch: nothing read before the wait


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
