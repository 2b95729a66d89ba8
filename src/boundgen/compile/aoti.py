"""AOTInductor: export the packed forward per bucket, package it without weights, load it with
shared weights.

    build_package(model, bucket, path, device)  torch.export → aoti_compile_and_package
                                                (weights not in the .so)
    SharedWeights(model)                        FQN → the live model's tensors (one copy for
                                                every bucket)
    open_package(path)                          the package's runner, without Inductor's device
                                                check (its CPU-ISA probe cost 57 s a process)
    AOTIBucket.load(path, weights)              open_package + load_constants(user_managed=True)

Weights stay out of the `.so` (`aot_inductor.package_constants_in_so: False`), so an artifact
depends only on the graph (config, tensor names/shapes/dtypes, bucket, torch, device) and never
on weight values; every loaded bucket points at the same model tensors (`user_managed=True`: no
copy, the caller keeps them alive).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

from boundgen import grid_dependency
from boundgen.attention.backends import AttentionBackend, SegmentsBackend, get_backend
from boundgen.compile import inductor_fixes, residual
from boundgen.compile.attention import FlashBackend, MaskedBackend
from boundgen.compile.buckets import Bucket
from boundgen.models.decoder import DecoderModel
from boundgen.text.packing import PackedBatch

log = logging.getLogger("boundgen.compile")

# The wrapper (the host code that launches the kernels, `run_impl`) is built at -O0 without line
# tables: its C++ build was 9-13 s of a W5 bucket's ~40 s on the H200 (2026-12-02; 5-6 s at -O0).
# Its host speed shows only where no CUDA graph replays it (`aoti`, and buckets above
# `graph_max_tokens` with +graphs). There it stays ahead of the GPU: W1's uncaptured 8,192-token
# forwards, built at -O0, left the H200 idle 3.9-4.5 ms between kernels of a ~70 ms call, no gap
# over 0.22 ms (BENCHMARKS.md, fifth session). The kernels themselves are Triton (CUDA) or built
# at -O3 (CPU) either way.
INDUCTOR_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "aot_inductor.enable_line_tables": False,
}


def export_attention(model: DecoderModel, device: torch.device) -> AttentionBackend:
    """The attention a compiled bucket traces: `flash` (aten op, C shim) on CUDA, `masked`
    elsewhere. On CUDA, a model whose attention is `segments`/`segments-cascade` (`--attention`)
    keeps the Triton packed-prefill kernel for the same batches (`flash+segments[-cascade]`): it is
    a `triton_op`, so export and AOTInductor compile it into the package.

    `BOUNDGEN_EXPORT_ATTENTION=varlen|flash|masked` overrides the flash part (the name is part of
    the cache key)."""
    device = torch.device(device)
    choice = os.environ.get("BOUNDGEN_EXPORT_ATTENTION") or (
        "flash" if device.type == "cuda" else "masked"
    )
    if choice == "masked":
        return MaskedBackend()
    if device.type != "cuda":
        raise ValueError(f"export attention '{choice}' needs CUDA; use 'masked' on {device.type}")
    if choice == "varlen":
        backend = get_backend("varlen", device)
        backend._lse_layout(device)  # NOTE: probe eagerly, never inside a trace
    elif choice == "flash":
        backend = FlashBackend()
        backend.prepare(device)
    else:
        raise ValueError(
            f"unknown BOUNDGEN_EXPORT_ATTENTION '{choice}'; use varlen, flash or masked"
        )
    model_attention = getattr(model, "backend", None)
    if isinstance(model_attention, SegmentsBackend):
        backend = SegmentsBackend(backend, model_attention.when)
    return backend


class PackedForward(nn.Module):
    """`model(input_ids, positions, attn)` with an export-friendly attention backend.

    A shallow copy of the model: parameters are shared, only the attention backend differs. Constant
    FQNs of compiled artifacts are therefore `model.<name>` of the plain model's parameters and
    buffers.
    """

    def __init__(self, model: DecoderModel, attention: AttentionBackend | None = None) -> None:
        super().__init__()
        self.model = copy.copy(model)
        self.model.backend = attention or export_attention(model, next(model.parameters()).device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return self.model(input_ids, positions, attn)


def flat_inputs(batch: PackedBatch) -> list[torch.Tensor]:
    """The tensors of (input_ids, positions, attn) in the order an exported program takes them."""
    leaves = pytree.tree_flatten(((batch.input_ids, batch.positions, batch.attn), {}))[0]
    return [x for x in leaves if isinstance(x, torch.Tensor)]


@dataclass
class BuildInfo:
    bucket: str
    export_s: float
    compile_s: float
    size_bytes: int
    # where compile_s went: Inductor's own timed phases (lowering, codegen, the C++ build, ...),
    # seconds summed per phase over this build, largest first
    phases_s: dict[str, float]


def _phase_seconds() -> dict[str, float]:
    """Seconds per Inductor/dynamo timed phase so far in this process (`dynamo_timed`)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - layout of another torch
        return {}
    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


# Inductor's timed phases that do not nest inside each other (the others wrap these), by what
# they are: a build's compile_s is about their sum.
BUILD_PHASES = {
    "create_aot_dispatcher_function": "trace",
    "_recursive_joint_graph_passes": "graph passes",
    "_recursive_post_grad_passes": "graph passes",
    "GraphLowering.run": "lowering",
    "Scheduler.__init__": "fusion",
    "Scheduler.codegen": "codegen",
    "async_compile.wait": "kernel compile",
    "aoti_precompile_header": "C++ header",
    "AotCodeCompiler.compile": "C++ build",
}


def _cpp_build_kind(builder) -> str:
    """What one of Inductor's C++ builder runs is for (the `C++ build` phase split by part)."""
    if getattr(builder, "_preprocessing", False):
        return "C++ header preprocess"
    if getattr(builder, "_precompiling", False):
        return "C++ header precompile"
    if getattr(builder, "_do_link", False):
        return "C++ link"
    return "C++ compile " + ("kernels" if "kernel" in str(builder._name) else "wrapper")


@contextmanager
def _timed_cpp_builds(into: dict[str, float]):
    """Adds the seconds of each C++ builder run to `into`, by `_cpp_build_kind`; a torch without
    that builder is measured as a whole only."""
    try:
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:  # pragma: no cover - layout of another torch
        yield
        return
    original = CppBuilder.build

    def build(self):
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            kind = _cpp_build_kind(self)
            into[kind] = into.get(kind, 0.0) + time.perf_counter() - t0

    CppBuilder.build = build
    try:
        yield
    finally:
        CppBuilder.build = original


def _phases_since(before: dict[str, float], cpp: dict[str, float]) -> dict[str, float]:
    after = _phase_seconds()
    out: dict[str, float] = {k: round(v, 2) for k, v in cpp.items() if v >= 0.05}
    for name, what in BUILD_PHASES.items():
        spent = after.get(name, 0.0) - before.get(name, 0.0)
        if spent >= 0.05:
            out[what] = round(out.get(what, 0.0) + spent, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# Inductor keeps a reduction's row in registers (one read) only up to 1,024 elements; wider rows are
# read twice (a looped pass for the reduction, a second for the result). An FP8 projection's input
# quantize is such a reduction — the rowwise amax over SiLU·mul's 4,864-wide rows, fused with it —
# and ran at 120 µs a call against 57 µs for the plain SiLU·mul in W1 (H200, 2026-12-02), giving
# back half of what the FP8 GEMMs gain. Rows up to this width are reduced in one read instead.
WIDE_ROW_MAX = 8192


def _wide_row_choices():
    """Inductor's heuristics with persistent reductions up to `WIDE_ROW_MAX` (None: this torch
    has no such hook)."""
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - layout of another torch
        return None

    class WideRowChoices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            if cooperative_reduction or features.get_reduction_hint() != ReductionHint.INNER:
                return False
            return V.graph.sizevars.statically_known_leq(features.reduction_numel, WIDE_ROW_MAX)

    return WideRowChoices()


def _recipe(model: nn.Module) -> str:
    """How this model asks to be compiled: "wide-row-reductions" when it holds FP8 projections
    (`Fp8Linear.COMPILE_RECIPE`, part of the cache key), "" for the defaults."""
    recipes = {getattr(type(m), "COMPILE_RECIPE", "") for m in model.modules()}
    return "wide-row-reductions" if "wide-row-reductions" in recipes else ""


@contextmanager
def _heuristics(recipe: str):
    """Inductor's heuristics for a build of `recipe`."""
    choices = _wide_row_choices() if recipe == "wide-row-reductions" else None
    if choices is None:
        yield
        return
    from torch._inductor.virtualized import V

    with V.set_choices_handler(choices):
        yield


def build_package(
    model: DecoderModel, bucket: Bucket, path: str | Path, device: torch.device | str | None = None
) -> BuildInfo:
    """Export `model`'s packed forward at `bucket`'s shapes and write an AOTInductor package to
    `path` (its kernels carrying the grid dependency wait as the bucket's size says:
    `grid_dependency.for_bucket`)."""
    with grid_dependency.for_bucket(bucket.tokens):
        return _build_package(model, bucket, path, device)


def _build_package(
    model: DecoderModel, bucket: Bucket, path: str | Path, device: torch.device | str | None
) -> BuildInfo:
    device = torch.device(device or next(model.parameters()).device)
    fwd = PackedForward(model).eval()
    ex = bucket.example(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(fwd, (ex.input_ids, ex.positions, ex.attn), strict=False)
    t1 = time.perf_counter()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    before, cpp = _phase_seconds(), {}
    known = torch._inductor.config.get_config_copy()  # an older torch lacks some of them
    recipe, configs = _recipe(model), {k: v for k, v in INDUCTOR_CONFIGS.items() if k in known}
    # the recipe is recorded in the package, and a key of Inductor's own caches (which the
    # heuristics hook is not). NOTE: always a dict of our own: Inductor writes its device keys
    # into this dict, and without one it wrote them into the process's global config, a part of
    # every later `torch.compile` cache key — `boundgen compile`'s beam layers, compiled after
    # a bucket in the same process, were then never found by a server (H200, 2026-12-04)
    configs["aot_inductor.metadata"] = {"boundgen_recipe": recipe} if recipe else {}
    configs.update(residual.inductor_options())
    inductor_fixes.keep_int_array_targets_alive()
    with _timed_cpp_builds(cpp), _heuristics(recipe):
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(path), inductor_configs=configs
        )
    t2 = time.perf_counter()
    return BuildInfo(bucket.name, t1 - t0, t2 - t1, path.stat().st_size, _phases_since(before, cpp))


# Model instances of a package run from the host each call (not replayed as a CUDA graph). A call
# takes a free instance; with none free it blocks until the oldest one's last run has finished on
# the device (`AOTInductorModelContainer::get_available_model`) — holding the GIL, which torch's
# binding does not release. With one instance every call waited for the previous call's kernels:
# a server's forward node, which queues a batch while the one before it still runs
# (`device_depth` 2), froze the whole process for the rest of that batch's GPU time. Two instances
# (they share the constants) leave a call waiting only for the batch before last, which the node's
# pacing has already waited for.
UNCAPTURED_INSTANCES = 2


def open_package(
    path: str | Path,
    single_threaded: bool = False,
    device_index: int = -1,
    instances: int = UNCAPTURED_INSTANCES,
):
    """The package's model runner (`AOTICompiledModel`), loaded in this process: one model
    instance when `single_threaded` (a bucket replayed as a CUDA graph), else `instances` (at least
    the batches the forward node keeps queued on the device, `EngineConfig.batch_device_depth`).

    `aoti_load_package` first compares the package's recorded device information with this
    machine's, only to log a warning, and that comparison runs Inductor's CPU vector-ISA probe:
    in torch 2.11 up to 11 child processes that each import torch, 57 s of every process's first
    load on the H200 image (`compile/isa.py`). The artifact cache's platform key already
    vouches for torch, CUDA and the GPU, so the runner is made directly."""
    instances = 1 if single_threaded else instances
    try:
        from torch._inductor.package.package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader(
            str(path), "model", single_threaded, instances, device_index
        )
        return AOTICompiledModel(loader)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch's API
        kwargs = {"run_single_threaded": single_threaded}
        if device_index > 0:
            kwargs["device_index"] = device_index
        return torch._inductor.aoti_load_package(str(path), **kwargs)


class SharedWeights:
    """FQN → tensor of the live model, built once; every loaded bucket is pointed at these
    tensors."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = (
            model  # NOTE: keeps the tensors alive while any bucket uses them (user_managed).
        )
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            self.tensors[f"model.{name}"] = t.detach()

    def for_fqns(self, fqns: list[str]) -> dict[str, torch.Tensor]:
        missing = [f for f in fqns if f not in self.tensors]
        if missing:
            raise RuntimeError(
                "compiled artifact needs constants the model does not have: "
                f"{', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} (artifact built for another model or "
                "quantization)"
            )
        return {f: self.tensors[f] for f in fqns}


class AOTIBucket:
    """One loaded AOTInductor package: `__call__(padded_batch_on_device) -> hidden [T, H]`."""

    def __init__(self, compiled, bucket: Bucket, path: Path) -> None:
        self.compiled = compiled
        self.bucket = bucket
        self.path = path
        loader = compiled.loader
        # NOTE: calling the loader directly skips AOTICompiledModel's per-call treespec parsing.
        self._run = getattr(loader, "boxed_run", None) or loader.run

    @classmethod
    def load(
        cls,
        path: str | Path,
        bucket: Bucket,
        weights: SharedWeights,
        device: torch.device,
        single_threaded: bool = False,
        instances: int = UNCAPTURED_INSTANCES,
    ) -> AOTIBucket:
        dev = torch.device(device)
        index = dev.index if dev.type == "cuda" and dev.index is not None else -1
        if dev.type == "cuda" and index < 0:
            index = torch.cuda.current_device()
        # NOTE: -1 is the runner's default CUDA device; only a non-default one is named
        compiled = open_package(path, single_threaded, index if index > 0 else -1, instances)
        fqns = list(compiled.get_constant_fqns())
        compiled.load_constants(weights.for_fqns(fqns), check_full_update=True, user_managed=True)
        return cls(compiled, bucket, Path(path))

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        return self._run(flat_inputs(batch))[0]
