"""Programmatic graph edges (`compile/programmatic.py`) and the kernels that may take them
(`grid_dependency`): which edges a captured graph's rewrite changes, on a fake driver graph; that
every awaiting kernel waits before anything else (the kernels' Hopper compile tests check the
PTX); and, on a GPU with programmatic launch, that a graph rewritten so replays what the plain one
does."""

from __future__ import annotations

import ast
import contextlib
import inspect
import logging
import textwrap

import pytest
import torch
from hopper import run_in_child

from boundgen import grid_dependency
from boundgen.compile import programmatic
from boundgen.compile.programmatic import EdgeData, programmatic_edge

pytest.importorskip("triton")

# the modules whose kernels wait first (importing them registers the kernels)
from boundgen.attention import beam_decode, segments
from boundgen.models import layer_kernel, stream, stream_gated, stream_qkv

AWAITING = {
    "_stream_kernel": stream,
    "_gated_kernel": stream_gated,
    "_qkv_kernel": stream_qkv,
    "_packed_prefill_kernel": segments,
    "_beam_decode_kernel": beam_decode,
    "_layer_kernel": layer_kernel,
}


class FakeGraph:
    """A driver graph: nodes named by kind ("kernel:NAME", "memcpy"), edges with their data."""

    def __init__(self, nodes: dict[int, str], edges: list[tuple[int, int, EdgeData]]) -> None:
        self.nodes, self.edges_ = nodes, list(edges)
        self.fail_add = False

    def edges(self, graph: int) -> list[tuple[int, int, EdgeData]]:
        assert graph == 7
        return list(self.edges_)

    def kernel_name(self, node: int) -> str | None:
        kind = self.nodes[node]
        return kind.split(":", 1)[1] if kind.startswith("kernel:") else None

    def replace(self, graph, edges, old, new) -> None:
        for (a, b), data in zip(edges, old):
            edge = next(e for e in self.edges_ if e[:2] == (a, b))
            assert bytes(edge[2]) == bytes(data)  # the edge's own data, as the driver wants it
            self.edges_.remove(edge)
        if self.fail_add:
            self.edges_ += [(a, b, d) for (a, b), d in zip(edges, old)]
            raise programmatic.DriverError("add failed")
        self.edges_ += [(a, b, d) for (a, b), d in zip(edges, new)]

    def kinds(self) -> dict[tuple[int, int], str]:
        return {(a, b): "plain" if d.plain else "programmatic" for a, b, d in self.edges_}


def _chain(*kinds: str) -> FakeGraph:
    nodes = dict(enumerate(kinds))
    return FakeGraph(nodes, [(i, i + 1, EdgeData()) for i in range(len(kinds) - 1)])


def test_only_edges_from_a_kernel_into_an_awaiting_kernel_are_rewritten():
    g = _chain(
        "memcpy",  # a copy into an awaiting kernel: stays a full dependency
        "kernel:_qkv_kernel",
        "kernel:_packed_prefill_kernel",  # awaiting after awaiting
        "kernel:triton_per_fused_add_mean",  # into Inductor's kernel: stays
        "kernel:_gated_kernel",  # Inductor's into awaiting
        "kernel:nvjet_gemm",  # into cuBLAS: stays
    )
    assert programmatic.rewrite(g, 7, grid_dependency.KERNELS) == 2
    assert g.kinds() == {
        (0, 1): "plain",
        (1, 2): "programmatic",
        (2, 3): "plain",
        (3, 4): "programmatic",
        (4, 5): "plain",
    }
    data = next(d for a, b, d in g.edges_ if (a, b) == (1, 2))
    assert (data.from_port, data.to_port, data.type) == (1, 0, 1)  # port and type: programmatic


def test_a_rewritten_graph_is_left_alone_and_a_failed_add_restores_the_edges():
    g = _chain("kernel:_qkv_kernel", "kernel:_stream_kernel")
    assert programmatic.rewrite(g, 7, grid_dependency.KERNELS) == 1
    assert programmatic.rewrite(g, 7, grid_dependency.KERNELS) == 0  # no plain edge left to change
    g = _chain("kernel:_qkv_kernel", "kernel:_stream_kernel")
    g.fail_add = True
    with pytest.raises(programmatic.DriverError):
        programmatic.rewrite(g, 7, grid_dependency.KERNELS)
    assert g.kinds() == {(0, 1): "plain"}


def test_programmatic_edge_data_is_the_driver_struct():
    assert list(bytes(programmatic_edge())) == [1, 0, 1, 0, 0, 0, 0, 0]
    assert EdgeData().plain and not programmatic_edge().plain


def test_the_awaiting_kernels_are_registered_and_wait_first():
    """Every kernel `grid_dependency.awaits` marks starts with `await_inputs(PDL)` (nothing
    before the wait may read or write), and the six the graphs run are marked."""
    assert set(AWAITING) <= grid_dependency.KERNELS
    for name in grid_dependency.KERNELS:
        module = AWAITING.get(name)
        assert module is not None, f"{name}: a kernel marked awaiting that this test does not know"
        fn = getattr(module, name)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        assert first == "await_inputs(PDL)", f"{name} starts with {first!r}"


class FakeCudaGraph:
    """torch.cuda.CUDAGraph as `capture` uses it: kept, its handle, instantiated once."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.kept, self.instantiated = keep_graph, 0

    def raw_cuda_graph(self) -> int:
        return 7

    def instantiate(self) -> None:
        self.instantiated += 1


@pytest.fixture
def fake_capture(monkeypatch):
    """`capture` around fakes of torch's graph and of the driver (a chain qkv → stream)."""
    monkeypatch.setattr(programmatic, "applies", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCudaGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    api = _chain("kernel:_qkv_kernel", "kernel:_stream_kernel")
    monkeypatch.setattr(programmatic, "driver", lambda: api)
    return api


def test_capture_rewrites_the_kept_graph_then_instantiates_it(fake_capture):
    with programmatic.capture() as graph:
        pass
    assert graph.kept and graph.instantiated == 1 and graph.programmatic_edges == 1
    assert fake_capture.kinds() == {(0, 1): "programmatic"}


def test_a_refused_rewrite_leaves_the_graph_as_captured(fake_capture, caplog):
    fake_capture.fail_add = True
    with caplog.at_level(logging.WARNING), programmatic.capture() as graph:
        pass
    assert graph.instantiated == 1 and graph.programmatic_edges == 0
    assert fake_capture.kinds() == {(0, 1): "plain"}
    assert "left as captured" in caplog.text


def test_kernels_wait_only_on_hopper_cuda():
    assert not grid_dependency.waits(torch.zeros(1))  # CPU (the interpreter lacks the wait)


def test_packages_record_the_switch(monkeypatch):
    """Kernels built with the switch on carry the wait: their packages are other packages."""
    from boundgen.compile.cache import platform_info

    monkeypatch.setattr(grid_dependency, "MAX_TOKENS", None)  # every bucket ("buckets", "1")
    with grid_dependency.enabled(False):
        assert "pdl" not in platform_info("cpu")
    with grid_dependency.enabled(True):
        assert platform_info("cpu")["pdl"] == "1"


def test_the_compiled_layers_blob_is_kept_apart_with_the_switch(tmp_path):
    """The beam layers' torch.compile blob (`compile/torch_cache.py`): the switch is a constexpr
    of the kernels, not an op of the graph, so a blob made with it off is not loaded with it on."""
    from boundgen.compile import torch_cache

    with grid_dependency.enabled(False):
        off = torch_cache.path_for(tmp_path)
    with grid_dependency.enabled(True):
        assert torch_cache.path_for(tmp_path) != off


def test_capture_is_off_without_the_switch(monkeypatch):
    monkeypatch.setattr(grid_dependency, "ON", False)
    assert not programmatic.applies()


@pytest.mark.parametrize("value", ["0", "small", "buckets", "1"])
def test_the_modes_are_taken(value):
    assert grid_dependency.mode_of(value) == value


@pytest.mark.parametrize("value", ["", "2", "on", "Buckets", "searches", "small:128"])
def test_an_unknown_mode_is_refused_by_name(value):
    with pytest.raises(ValueError, match="BOUNDGEN_PDL=.*buckets"):
        grid_dependency.mode_of(value)


def buckets_mode(monkeypatch):
    """`BOUNDGEN_PDL=buckets` in this process: on, but not for the searches."""
    monkeypatch.setattr(grid_dependency, "ON", True)
    monkeypatch.setattr(grid_dependency, "SEARCHES", False)
    monkeypatch.setattr(grid_dependency, "MAX_TOKENS", None)


def test_buckets_mode_leaves_the_searches_without_it_on_their_thread_only(monkeypatch):
    import threading

    buckets_mode(monkeypatch)
    assert grid_dependency.active()
    seen = []
    with grid_dependency.for_searches():
        assert not grid_dependency.active()
        other = threading.Thread(target=lambda: seen.append(grid_dependency.active()))
        other.start()
        other.join()
        with grid_dependency.for_searches():  # nested: still the searches'
            assert not grid_dependency.active()
        assert not grid_dependency.active()
    assert seen == [True]  # a bucket's capture on another thread meanwhile takes it
    assert grid_dependency.active()


def test_every_graph_mode_takes_it_in_the_searches_too(monkeypatch):
    monkeypatch.setattr(grid_dependency, "ON", True)
    monkeypatch.setattr(grid_dependency, "SEARCHES", True)
    monkeypatch.setattr(grid_dependency, "MAX_TOKENS", None)
    with grid_dependency.for_searches():
        assert grid_dependency.active()


def test_the_switch_turns_the_searches_on_and_off_with_the_rest(monkeypatch):
    buckets_mode(monkeypatch)
    with grid_dependency.enabled(True), grid_dependency.for_searches():
        assert grid_dependency.active()
    with grid_dependency.enabled(False):
        assert not grid_dependency.active()
    assert grid_dependency.ON and not grid_dependency.SEARCHES  # restored


def test_a_search_is_traced_and_captured_as_a_search(monkeypatch):
    """`ModelRunner.beam_search` (the plain path) and `SearchGraphs.run` (unsealed, where a
    bucket's layers are traced and its graph captured; sealed, where without graphs its kernels
    launch live) run inside `for_searches`: with "buckets", a search's kernels carry no wait and
    its graphs get no edges."""
    from boundgen import runner as runner_module
    from boundgen.compile.decode import SearchGraphs

    buckets_mode(monkeypatch)
    seen = []

    def record(*args, **kwargs):
        seen.append(grid_dependency.active())
        raise StopIteration  # what the search would do next does not matter here

    monkeypatch.setattr(runner_module, "plain_session", record)
    plain = runner_module.ModelRunner.__new__(runner_module.ModelRunner)
    plain.forwards, plain._on_device = None, lambda trie: trie
    plain.model, plain.device = None, torch.device("cpu")
    with pytest.raises(StopIteration):
        runner_module.ModelRunner.beam_search(plain, [[1, 2]], 2, 1)
    graphs = SearchGraphs.__new__(SearchGraphs)
    graphs.sealed = False
    monkeypatch.setattr(SearchGraphs, "_run_new", record)
    with pytest.raises(StopIteration):
        graphs.run([[1, 2]], 2, 1)
    graphs.sealed = True
    monkeypatch.setattr(SearchGraphs, "_run_sealed", record)
    with pytest.raises(StopIteration):
        graphs.run([[1, 2]], 2, 1)
    assert seen == [False, False, False]
    assert grid_dependency.active()  # and outside a search, the buckets' rule again


def test_buckets_mode_keys_packages_as_on_and_the_searches_blob_as_off(monkeypatch, tmp_path):
    """Packages (the buckets') record what their kernels carry; the searches' compiled layers
    carry no wait under "buckets", so their blob is the one made with the switch off."""
    from boundgen.compile import torch_cache
    from boundgen.compile.cache import platform_info

    with grid_dependency.enabled(False):
        off_blob, off_package = torch_cache.path_for(tmp_path), platform_info("cpu")
    buckets_mode(monkeypatch)
    assert platform_info("cpu")["pdl"] == "1"
    with grid_dependency.for_searches():
        assert platform_info("cpu") == off_package
    assert torch_cache.path_for(tmp_path) == off_blob


def small_mode(monkeypatch):
    """`BOUNDGEN_PDL=small` in this process: on for the buckets of at most `SMALL_TOKENS`."""
    buckets_mode(monkeypatch)
    monkeypatch.setattr(grid_dependency, "MAX_TOKENS", grid_dependency.SMALL_TOKENS)


def test_small_mode_takes_it_only_inside_a_small_bucket(monkeypatch):
    small_mode(monkeypatch)
    small, large = grid_dependency.SMALL_TOKENS, grid_dependency.SMALL_TOKENS + 1
    assert not grid_dependency.active()  # no bucket: a live call, a warm-up outside one
    with grid_dependency.for_bucket(small):
        assert grid_dependency.active()
        with grid_dependency.for_bucket(large):  # nested: the inner bucket's size
            assert not grid_dependency.active()
        assert grid_dependency.active()
        with grid_dependency.for_searches():  # the searches stay without it
            assert not grid_dependency.active()
    with grid_dependency.for_bucket(large):
        assert not grid_dependency.active()
    assert not grid_dependency.active()
    with grid_dependency.enabled(False), grid_dependency.for_bucket(small):
        assert not grid_dependency.active()  # the A/B's switch still turns it off


def test_small_mode_keys_every_package_by_the_mode_and_the_searches_blob_as_off(
    monkeypatch, tmp_path
):
    """Under "small" each package carries what its bucket's size says; the key records the mode
    (and its limit), inside a bucket or not, so no package of another mode is taken for one."""
    from boundgen.compile import torch_cache
    from boundgen.compile.cache import platform_info

    with grid_dependency.enabled(False):
        off_blob, off_package = torch_cache.path_for(tmp_path), platform_info("cpu")
    small_mode(monkeypatch)
    key = f"small:{grid_dependency.SMALL_TOKENS}"
    assert platform_info("cpu")["pdl"] == key
    with grid_dependency.for_bucket(10_000):
        assert platform_info("cpu")["pdl"] == key
    with grid_dependency.for_searches():
        assert platform_info("cpu") == off_package
    assert torch_cache.path_for(tmp_path) == off_blob
    buckets_mode(monkeypatch)
    assert platform_info("cpu")["pdl"] == "1"  # "buckets"' packages are other packages


class _Bucket:
    def __init__(self, tokens: int) -> None:
        self.tokens, self.name = tokens, f"t{tokens}"


def test_a_bucket_is_exported_and_captured_as_its_size_says(monkeypatch):
    """Where a bucket's kernels are traced (`build_package`'s export, the compiled backend's
    warm-up) and its graph captured (`capture_buckets`), `active()` follows the bucket's size:
    the kernels that wait and the graphs whose edges go into them are the same buckets'."""
    from boundgen.compile import aoti, backends, graphs

    small_mode(monkeypatch)
    small, large = _Bucket(grid_dependency.SMALL_TOKENS), _Bucket(4096)
    built = {}

    def build(model, bucket, path, device):
        built[bucket.tokens] = grid_dependency.active()

    monkeypatch.setattr(aoti, "_build_package", build)
    for b in (small, large):
        aoti.build_package(None, b, "unused", "cpu")
    assert built == {small.tokens: True, large.tokens: False}

    captured = {}
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)

    def make(fn, bucket, device, pool=None):
        captured[bucket.tokens] = grid_dependency.active()
        return fn

    fns = {small: "s", large: "l"}
    out = graphs.capture_buckets(fns, torch.device("cpu"), max_tokens=10_000, make=make)
    assert out == fns and captured == {small.tokens: True, large.tokens: False}

    traced = []
    monkeypatch.setattr(backends, "PackedForward", lambda model: None)
    monkeypatch.setattr(
        torch, "compile", lambda *a, **k: lambda *x: traced.append(grid_dependency.active())
    )
    for b in (small, large):
        b.example = lambda device: type("Ex", (), dict(input_ids=0, positions=0, attn=0))
    backends._compile_fns(None, [large, small], torch.device("cpu"), warmup=True)
    assert traced == [False, True]
    assert not grid_dependency.active()


@pytest.mark.gpu
def test_a_graph_with_programmatic_edges_replays_what_the_plain_one_does(monkeypatch):
    """A W3-sized chain of the streamed kernels (qkv with the rotation, o_proj, gate_up + SiLU·mul,
    down) over eight layers, with torch's ops between, captured with and without programmatic
    edges: the same output, bit for bit, replay after replay."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic launch needs sm_90+")
    monkeypatch.setattr(stream, "MAX_ROWS", 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt, m, h, inter = "cuda", torch.bfloat16, 64, 896, 4864

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * shape[-1] ** -0.5).to(dt)

    layers = [(w(1152, h), w(h, h), w(2 * inter, h), w(h, inter)) for _ in range(8)]
    cos = torch.randn(m, 32, generator=g, device=dev).to(dt)
    sin = torch.randn(m, 32, generator=g, device=dev).to(dt)
    x0 = torch.randn(m, h, generator=g, device=dev).to(dt)

    def forward(x):
        for qkv, o, gate_up, down in layers:
            y = stream_qkv.rotated(torch.nn.functional.rms_norm(x, (h,)), qkv, None, cos, sin, 1024)
            x = stream.linear_residual(y[:, :h].contiguous(), o, x)
            act = stream_gated.gated(torch.nn.functional.rms_norm(x, (h,)), gate_up)
            x = stream.linear_residual(act, down, x)
        return x

    # every graph and its output live to the end: rebinding `graph` in the second capture freed
    # the first while that capture ran, which invalidated it (the H200, forty-third session; the
    # worker's CUDA generator then stayed "capturing" and failed every test after it)
    outs, edges, graphs = [], [], []
    for on in (False, True):
        monkeypatch.setattr(grid_dependency, "ON", on)  # the kernels' wait and the edges
        static = x0.clone()
        side = torch.cuda.Stream()  # warmed up as `StaticGraph` does: on a side stream
        side.wait_stream(torch.cuda.current_stream())
        # traced and captured as a bucket of `m` tokens is (one that takes the edges in every
        # mode that is on, "small" too: a W3 prompt's)
        with torch.cuda.stream(side), grid_dependency.for_bucket(m):
            forward(static)  # compile the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        # thread-local: a thread an earlier test left (an engine's) cannot spoil this capture
        with (
            grid_dependency.for_bucket(m),
            programmatic.capture(capture_error_mode="thread_local") as graph,
        ):
            out = forward(static)
        graphs.append((graph, out))
        edges.append(graph.programmatic_edges)
        if on:  # the driver holds the edges the rewrite counted (the graph is kept after capture)
            kept = programmatic.driver().edges(graph.raw_cuda_graph())
            assert sum(not d.plain for _, _, d in kept) == graph.programmatic_edges
        runs = []
        for _ in range(3):
            graph.replay()
            runs.append(out.clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, runs[0]) for r in runs)
        outs.append(runs[0])
    assert edges[0] == 0 and edges[1] >= 8 * 3  # at least qkv, o_proj's and down's edges a layer
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], forward(x0.clone()))


def test_operandless_inline_asm_is_no_write_for_torchs_analysis():
    # Triton 3.6's griddepcontrol instructions are impure inline assembly without operands:
    # torch's analysis of what a kernel writes must pass over them (it took every argument as
    # written on the H200), and keep refusing assembly that takes a pointer
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    Op, Param, Intermediate = wrap.Op, wrap.Param, wrap.Intermediate
    wait = Op("tt.elementwise_inline_asm", None, [], Intermediate(-1))
    with_operand = Op("tt.elementwise_inline_asm", None, [Param(0)], Intermediate(2))
    store = Op("tt.store", None, [Param(1), Intermediate(2)], Intermediate(-2))
    functions = {"k": {Intermediate(-1): [wait], Intermediate(2): [with_operand, store]}}
    out = grid_dependency.without_operandless_asm(functions)
    assert [op.name for op in out["k"][Intermediate(-1)]] == ["boundgen.operandless_inline_asm"]
    assert out["k"][Intermediate(2)] == [with_operand, store]
    # installed as the kernels were defined, once
    assert getattr(wrap.ttir_to_functions, "_boundgen_operandless_asm", False)
    installed = wrap.ttir_to_functions
    grid_dependency._operandless_asm_writes_nothing()
    assert wrap.ttir_to_functions is installed


# torch's own analysis, on a kernel that starts as Triton 3.6's `gdc_wait` does (impure inline
# assembly without operands), for an sm_90 target on a machine without a GPU; in a child without
# TRITON_INTERPRET (the interpreter's kernels are not the JIT functions torch analyses). Prints the
# arguments taken as written by torch's parser as it came, then with the mend.
_ANALYSIS = """
import sys
from unittest import mock
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
import torch._higher_order_ops.triton_kernel_wrap as wrap
from boundgen import grid_dependency  # installs the mend

@triton.jit
def copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    tl.inline_asm_elementwise(
        "griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

class Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

def written():
    kwargs = {"x_ptr": torch.zeros(16), "y_ptr": torch.zeros(16), "n": 16, "BLOCK": 16}
    if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.12 and later
        acc = wrap.identify_accessed_tensors(copy, kwargs, {})
        return sorted(d.name for d in acc.read_writes.writes)
    return sorted(wrap.identify_mutated_tensors(copy, kwargs, {}))  # torch 2.11

with mock.patch.object(triton.runtime.driver, "_active", Sm90(), create=True):
    mended = wrap.ttir_to_functions
    wrap.ttir_to_functions = mended.__wrapped__
    print("as it came", written())
    wrap.ttir_to_functions = mended
    print("mended", written())
"""


def test_torchs_analysis_takes_only_the_stored_argument_as_written_with_the_mend():
    out = run_in_child(_ANALYSIS)
    lines = out.splitlines()
    assert "as it came ['x_ptr', 'y_ptr']" in lines  # the failure the H200 saw: every argument
    assert "mended ['y_ptr']" in lines
