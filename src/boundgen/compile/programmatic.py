"""A captured CUDA graph's edges into boundgen's own kernels made programmatic (Hopper's
programmatic dependent launch), before the graph is instantiated.

Why after capture: none of the launchers in a bucket's or a search's graph sets the launch
attribute that capture would turn into a programmatic edge — not AOTInductor's (the W1–W3 buckets),
not Inductor's for a user kernel (the compiled beam layers), not the eager path's. The graph keeps
every kernel as a node whatever launched it, so the edges are rewritten there instead: an edge from
a kernel node to a kernel of `grid_dependency.KERNELS` (which wait for their inputs as their first
step) becomes {from_port: programmatic, type: programmatic}; every other edge — into Inductor's
kernels, cuBLAS, copies, or from a node that is not a kernel — stays a full dependency.
`grid_dependency` says what a programmatic edge changes and why the kernels are safe on one.

`grid_dependency.active()` (`BOUNDGEN_PDL`: "0" none; "small", the default, the graphs of the
prefill buckets of at most 128 tokens; "buckets" every prefill bucket's graph; "1" every graph) is
read as a graph is captured (`capture`), as the kernels read it when traced or launched. Where the
driver lacks the edge API (CUDA < 12.3) or the GPU has no programmatic launch (before sm_90) the
graph is left as captured, said once in the log.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from boundgen import grid_dependency

log = logging.getLogger(__name__)

# cuda.h: CUgraphNodeType, CUgraphDependencyType, the kernel node's output ports
NODE_KERNEL = 0
DEPENDENCY_PROGRAMMATIC = 1
PORT_PROGRAMMATIC = 1


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData: all zero is a full dependency."""

    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]

    @property
    def plain(self) -> bool:
        return self.from_port == 0 and self.to_port == 0 and self.type == 0


def programmatic_edge() -> EdgeData:
    return EdgeData(from_port=PORT_PROGRAMMATIC, to_port=0, type=DEPENDENCY_PROGRAMMATIC)


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (what cuGraphKernelNodeGetParams_v2 fills)."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


class GraphApi(Protocol):
    """What the rewrite asks of the driver (`Driver`; the tests' fake graph)."""

    def edges(self, graph: int) -> list[tuple[int, int, EdgeData]]: ...
    def kernel_name(self, node: int) -> str | None: ...
    def replace(
        self, graph: int, edges: list[tuple[int, int]], old: list[EdgeData], new: list[EdgeData]
    ) -> None: ...


class DriverError(RuntimeError):
    pass


class Driver:
    """The CUDA driver's graph edge API through ctypes (libcuda, CUDA 12.3 and later)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._get_edges = lib.cuGraphGetEdges_v2
        self._remove = lib.cuGraphRemoveDependencies_v2
        self._add = lib.cuGraphAddDependencies_v2
        self._node_type = lib.cuGraphNodeGetType
        self._params = lib.cuGraphKernelNodeGetParams_v2
        self._func_name = lib.cuFuncGetName
        self._kernel_name = getattr(lib, "cuKernelGetName", None)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise DriverError(f"{what}: CUresult {rc}")

    def edges(self, graph: int) -> list[tuple[int, int, EdgeData]]:
        n = ctypes.c_size_t(0)
        self._check(
            self._get_edges(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)),
            "cuGraphGetEdges_v2",
        )
        count = n.value
        src, dst = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
        data = (EdgeData * count)()
        self._check(
            self._get_edges(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(n)),
            "cuGraphGetEdges_v2",
        )
        return [(src[i] or 0, dst[i] or 0, data[i]) for i in range(n.value)]

    def kernel_name(self, node: int) -> str | None:
        """The kernel's name where `node` is a kernel node, else None."""
        kind = ctypes.c_int(-1)
        self._check(
            self._node_type(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType"
        )
        if kind.value != NODE_KERNEL:
            return None
        params = _KernelNodeParams()
        self._check(
            self._params(ctypes.c_void_p(node), ctypes.byref(params)),
            "cuGraphKernelNodeGetParams_v2",
        )
        name = ctypes.c_char_p()
        if params.func:
            self._check(
                self._func_name(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName"
            )
        elif params.kern and self._kernel_name is not None:
            self._check(
                self._kernel_name(ctypes.byref(name), ctypes.c_void_p(params.kern)),
                "cuKernelGetName",
            )
        return name.value.decode() if name.value else ""

    def replace(self, graph: int, edges, old, new) -> None:
        n = len(edges)
        src = (ctypes.c_void_p * n)(*[a for a, _ in edges])
        dst = (ctypes.c_void_p * n)(*[b for _, b in edges])
        old_data, new_data = (EdgeData * n)(*old), (EdgeData * n)(*new)
        self._check(
            self._remove(ctypes.c_void_p(graph), src, dst, old_data, ctypes.c_size_t(n)),
            "cuGraphRemoveDependencies_v2",
        )
        rc = self._add(ctypes.c_void_p(graph), src, dst, new_data, ctypes.c_size_t(n))
        if rc != 0:  # put the edges back as they were: the graph stays a correct one
            self._add(ctypes.c_void_p(graph), src, dst, old_data, ctypes.c_size_t(n))
            raise DriverError(f"cuGraphAddDependencies_v2: CUresult {rc}")


def rewrite(api: GraphApi, graph: int, awaiting: Iterable[str]) -> int:
    """Every plain edge of `graph` from a kernel node to a kernel named in `awaiting` made
    programmatic: the count of edges rewritten."""
    awaiting = frozenset(awaiting)
    names: dict[int, str | None] = {}

    def name(node: int) -> str | None:
        if node not in names:
            names[node] = api.kernel_name(node)
        return names[node]

    chosen = [
        (a, b, data)
        for a, b, data in api.edges(graph)
        if data.plain and name(b) in awaiting and name(a) is not None
    ]
    if chosen:
        api.replace(
            graph,
            [(a, b) for a, b, _ in chosen],
            [data for _, _, data in chosen],
            [programmatic_edge() for _ in chosen],
        )
    return len(chosen)


@functools.cache
def driver() -> Driver | None:
    """The driver's edge API, or None (said once) where it is missing."""
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))  # the driver's name, as `cuda_waits` loads it
    except (OSError, AttributeError) as e:
        log.warning("programmatic graph edges off: the CUDA driver lacks the edge API (%s)", e)
        return None


def applies() -> bool:
    """Whether graphs captured now (on the current device) get programmatic edges:
    `grid_dependency.active()` (on this thread: not a beam search's capture unless the searches
    take it too), a GPU with programmatic launch (sm_90+) and the driver's edge API."""
    if not (grid_dependency.active() and torch.cuda.is_available()):
        return False
    return grid_dependency.device_waits(torch.cuda.current_device()) and driver() is not None


@contextlib.contextmanager
def capture(
    pool=None, stream=None, capture_error_mode: str = "global"
) -> Iterator[torch.cuda.CUDAGraph]:
    """`torch.cuda.graph` into a new graph (`pool`, `stream`, `capture_error_mode` as there), its
    edges into the awaiting kernels made programmatic after the capture (where `applies`), then
    instantiated. The graph's `programmatic_edges` says how many edges were rewritten (0 where
    off, or where the driver refused the rewrite: said in the log, the graph left as captured)."""
    rewrites = applies()
    # kept uninstantiated after the capture only where its edges are rewritten
    captured = torch.cuda.CUDAGraph(keep_graph=True) if rewrites else torch.cuda.CUDAGraph()
    with torch.cuda.graph(
        captured, pool=pool, stream=stream, capture_error_mode=capture_error_mode
    ):
        yield captured
    captured.programmatic_edges = 0
    if rewrites:
        try:
            captured.programmatic_edges = rewrite(
                driver(), captured.raw_cuda_graph(), grid_dependency.KERNELS
            )
        except DriverError as e:  # `Driver.replace` put the edges back: a plain graph
            log.warning("programmatic graph edges not made, the graph left as captured: %s", e)
        captured.instantiate()
