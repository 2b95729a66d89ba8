"""Model backends: the packed forward per shape bucket (`eager` | `compile` | `aoti`, each
optionally `+graphs`), and the choice `"auto"` makes.

A backend is a `CompiledForwards`: the buckets it serves and one function per bucket (`fn(padded
batch on the device) -> hidden [T, H]`), plus, with CUDA graphs, persistent decode buckets for
beam search. Plain eager has none (`select_forwards` returns None): the runner then runs the
model as is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from boundgen import grid_dependency
from boundgen.compile.aoti import (
    UNCAPTURED_INSTANCES,
    AOTIBucket,
    PackedForward,
    SharedWeights,
    build_package,
)
from boundgen.compile.buckets import Bucket, parse_buckets
from boundgen.compile.cache import (
    ArtifactCache,
    ArtifactError,
    Slot,
    model_fingerprint,
    platform_info,
)
from boundgen.compile.decode import SearchGraphs
from boundgen.compile.isa import remember_isa_checks
from boundgen.compile.preload import AOTIUnsafe, ensure_loadable
from boundgen.compile.search_streams import SearchStreams, search_graphs
from boundgen.models.decoder import DecoderModel

log = logging.getLogger("boundgen.compile")

BACKENDS = ("auto", "eager", "compile", "aoti", "eager+graphs", "compile+graphs", "aoti+graphs")
# NOTE: what "auto" tries on CUDA, in order, before plain eager. Only backends that need no compile
# at start-up belong here (aoti uses `boundgen compile`'s cached buckets; graph capture takes ~0.1 s
# a bucket). Measured on the H200 (BENCHMARKS.md, bench_backends.py): graphs cut W3 from 3.5 to
# 1.65 ms on aoti and from 25 to 3.8 ms on eager, W2 from 7.2 to 6.6 / 27 to 11 ms; nothing changes
# at 8192 tokens.
AUTO_CUDA = ("aoti+graphs", "eager+graphs")
# +graphs: the largest bucket captured by default. Eager graphs paid up to W2's 2,048-token bucket
# in process on the H200 and made no difference at 8,192, where the GPU sets the time. A compiled
# bucket above the limit runs its package from the host, and torch's binding holds the GIL through
# the whole launch (1.35-4.62 ms a W5 forward, 18.8 % of a W5 server's GIL at 4 connections); a
# replay gives the GIL up. W5 with every merged forward replayed (buckets of 1,920-14,912), two
# alternated pairs: 4 connections 231-234 against 161-202 req/s, an open loop of 200 req/s kept
# (p99 86-202 ms) where the host launches fell behind (p99 0.9-1.6 s). BENCHMARKS.md, H200,
# twenty-third session. The graphs share one memory pool the size of the largest bucket's work.
EAGER_GRAPH_MAX_TOKENS = 2048
COMPILED_GRAPH_MAX_TOKENS = 16384


@dataclass
class CompileOptions:
    """How compiled backends are built (one place, so CLI flags and the engine agree)."""

    buckets: list[Bucket] | str | None = None  # None: aoti uses the cached buckets of this model
    cache_dir: str | Path | None = None
    rebuild: bool | None = None  # None: True for an explicit "aoti", False for "auto"
    quant: str = (
        "none"  # label of the quantization policy (the model fingerprint covers its effect)
    )
    # +graphs: capture buckets up to this many tokens; None: `graph_limit`'s default per backend
    graph_max_tokens: int | None = None
    # +graphs: each captured bucket reads its inputs from one staged buffer (one H2D copy per call)
    # and gathers its output rows in the graph (`compile.staging`); False: the older graphs that
    # copy each input in and leave the gather to the runner (bench "before" runs)
    staged_inputs: bool = True
    warmup: bool = True  # compile/aoti: run every bucket once at start-up, not in the first request
    allow_reexec: bool = False  # may re-exec the process with LD_PRELOAD (CLI entry points only)
    # +graphs: the beam search's prefill and decode layers through torch.compile (one compiled
    # graph for all layers); None: for the compile and aoti backends, not for eager
    compile_decode: bool | None = None
    # the batches a node keeps queued on the device (`EngineConfig.batch_device_depth`): an aoti
    # bucket run from the host gets a model instance for each (`compile.aoti.UNCAPTURED_INSTANCES`)
    device_depth: int = 2
    progress: Callable[[str, dict], None] | None = None  # progress(event, info) per bucket
    build_log: list[dict] = field(default_factory=list)

    def graph_limit(self, base: str) -> int:
        """The most tokens a captured bucket of backend `base` ("eager", "compile", "aoti") has:
        `graph_max_tokens` when given, else the default for `base`."""
        if self.graph_max_tokens is not None:
            return self.graph_max_tokens
        return EAGER_GRAPH_MAX_TOKENS if base == "eager" else COMPILED_GRAPH_MAX_TOKENS


@dataclass
class CompiledForwards:
    """What a non-eager backend gives the runner."""

    name: str  # the backend, e.g. "aoti+graphs"
    buckets: list[Bucket]
    fns: dict[Bucket, Callable]  # bucket → fn(padded batch on the device) -> hidden [T, H]
    # compiled buckets also take big chunks (cut into bucket-sized pieces); eager buckets (graphs of
    # the plain model) only the small ones: an uncompiled forward runs any size as it is
    cut_large_chunks: bool
    # whole beam searches as CUDA graphs (with +graphs), one replica per concurrent stream
    search: SearchGraphs | SearchStreams | None = None


# -- backends ------------------------------------------------------------------------------------
def _eager_fns(model: DecoderModel, buckets: list[Bucket]) -> dict[Bucket, Callable]:
    fn = lambda b: model(b.input_ids, b.positions, b.attn)
    return dict.fromkeys(buckets, fn)


def allow_recompiles(count: int) -> None:
    """Dynamo's recompile limit (`recompile_limit`; `cache_size_limit`, its older name, where this
    torch has it) raised to at least `count` compiles of one function: past the limit (8 by
    default) a function runs eagerly, with a warning only."""
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), count))


def _compile_fns(model: DecoderModel, buckets: list[Bucket], device, warmup: bool) -> dict:
    # NOTE: one compiled function, one specialisation per bucket (shapes and AttnInputs' static
    # ints).
    allow_recompiles(4 * len(buckets))
    compiled = torch.compile(PackedForward(model), fullgraph=True, dynamic=False)
    fn = lambda b: compiled(b.input_ids, b.positions, b.attn)
    if warmup:
        with torch.inference_mode():
            for b in buckets:
                # traced as its graph will be captured (`grid_dependency`'s "small" mode)
                with grid_dependency.for_bucket(b.tokens):
                    fn(b.example(device))
    return dict.fromkeys(buckets, fn)


def aoti_slots(
    model: DecoderModel, device: torch.device, buckets: list[Bucket], quant: str
) -> list[Slot]:
    fp = model_fingerprint(model)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    attention = PackedForward(model).model.backend.name
    return [Slot(fp, dtype, quant, attention, b.name, device.type) for b in buckets]


def cached_buckets(
    model: DecoderModel, device: torch.device, cache: ArtifactCache, quant: str
) -> list[Bucket]:
    """Buckets the cache holds for this exact model, dtype, quantization and device type."""
    probe = aoti_slots(model, device, [Bucket.parse("t1")], quant)[0]
    out = []
    for meta in cache.entries():
        s = meta.get("slot", {})
        keys = ("model", "dtype", "quant", "attention", "device")
        if all(s.get(k) == getattr(probe, k) for k in keys):
            out.append(Bucket.parse(s["bucket"]))
    return sorted(set(out))


def build_aoti(
    model: DecoderModel,
    device: torch.device,
    buckets: list[Bucket],
    cache: ArtifactCache,
    quant: str = "none",
    rebuild: bool = True,
    progress=None,
) -> list:
    """Verified cache entries for every bucket, building the missing/stale/corrupt ones if
    allowed."""
    remember_isa_checks(cache.root)  # a build asks Inductor for the CPU ISA: once per machine
    plat = platform_info(device)
    entries = []
    for bucket, slot in zip(buckets, aoti_slots(model, device, buckets, quant)):
        t0 = time.perf_counter()
        status = {"event": "hit"}

        def on_event(kind, why, status=status, bucket=bucket):
            if kind == "hit":
                return
            status.update(event="built" if kind == "missing" else f"rebuilt ({kind})", reason=why)
            if progress:
                progress("building", {"bucket": bucket.name, "reason": kind})

        def build(path: Path, bucket=bucket) -> dict:
            return build_package(model, bucket, path, device).__dict__

        entry = cache.get_or_build(slot, plat, build, rebuild=rebuild, on_event=on_event)
        info = {
            "bucket": bucket.name,
            "event": status["event"],
            "seconds": time.perf_counter() - t0,
            "export_s": entry.meta.get("export_s"),
            "compile_s": entry.meta.get("compile_s"),
            "size_bytes": entry.meta.get("size_bytes"),
            "phases_s": entry.meta.get("phases_s"),
            "path": str(entry.path),
        }
        if status.get("reason"):
            log.info("bucket %s: %s → rebuilt", bucket.name, status["reason"])
        if progress:
            progress("done", info)
        entries.append((bucket, entry, info))
    return entries


def _aoti_fns(model, device, buckets, opts: CompileOptions, graph_limit: int) -> tuple[list, dict]:
    """The cached (or built) packages of `buckets`, loaded; those of at most `graph_limit` tokens
    (0: none) load single-threaded for graph capture."""
    cache = ArtifactCache(opts.cache_dir)
    rebuild = True if opts.rebuild is None else opts.rebuild
    if opts.buckets is None:
        buckets = cached_buckets(model, device, cache, opts.quant)
        if not buckets:
            raise ArtifactError(
                "missing",
                f"no compiled buckets for this model in {cache.root}; run "
                f"`boundgen compile --model DIR --device {device.type}` first",
            )
    t0 = time.perf_counter()
    entries = build_aoti(model, device, buckets, cache, opts.quant, rebuild, opts.progress)
    opts.build_log.extend(info for _, _, info in entries)
    ensure_loadable(entries[0][1].path, cache.root, allow_reexec=opts.allow_reexec)
    log.info("aoti: %d cached buckets checked in %.2f s", len(entries), time.perf_counter() - t0)
    weights = SharedWeights(model)
    instances = max(UNCAPTURED_INSTANCES, opts.device_depth)
    fns = {}
    for bucket, entry, _ in entries:
        single = bucket.tokens <= graph_limit
        t0 = time.perf_counter()
        fns[bucket] = AOTIBucket.load(entry.path, bucket, weights, device, single, instances)
        t_load = time.perf_counter() - t0
        if opts.warmup and not single:  # graph capture warms the others
            # NOTE: a bucket's first run loads its kernels (tens of ms on CUDA): not in a request
            with torch.inference_mode():
                fns[bucket](bucket.example(device))
        # start-up is mostly these loads on CUDA: say where it goes
        log.info(
            "aoti: bucket %s loaded in %.2f s, first run %.2f s",
            bucket.name,
            t_load,
            time.perf_counter() - t0 - t_load,
        )
    return buckets, fns


def _build(
    model, device, max_batch_tokens, backend: str, opts: CompileOptions
) -> CompiledForwards | None:
    base, _, extra = backend.partition("+")
    graphs = extra == "graphs"
    if (extra and not graphs) or base not in ("eager", "compile", "aoti"):
        raise ValueError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    limit = opts.graph_limit(base) if graphs else 0
    if graphs and limit < 1:
        raise ValueError(f"graph_max_tokens must be at least 1, got {limit}")
    if graphs and device.type != "cuda":
        raise ValueError(f"backend '{backend}' needs CUDA (CUDA graphs)")
    if base == "eager" and not graphs:
        return None
    buckets = parse_buckets(opts.buckets, max_batch_tokens)
    if base == "eager":
        # an uncaptured eager bucket would only add padding: larger batches run eagerly as they are
        buckets = [b for b in buckets if b.tokens <= limit]
        if not buckets:
            raise ValueError(f"backend '{backend}': no bucket of at most {limit} tokens to capture")
        fns = _eager_fns(model, buckets)
    elif base == "compile":
        fns = _compile_fns(model, buckets, device, opts.warmup)
    else:
        buckets, fns = _aoti_fns(model, device, buckets, opts, limit)
    search = None
    if graphs:
        from boundgen.compile.aoti import export_attention
        from boundgen.compile.graphs import GraphedBucket, capture_buckets
        from boundgen.compile.staging import StagedBucket

        t0 = time.perf_counter()
        with torch.inference_mode():
            make = StagedBucket if opts.staged_inputs else GraphedBucket
            fns = capture_buckets(fns, device, limit, make)
        t1 = time.perf_counter()
        compile_decode = base != "eager" if opts.compile_decode is None else opts.compile_decode
        attention = export_attention(model, device) if compile_decode else model.backend
        search = search_graphs(model, device, attention, compile_layers=compile_decode)
        log.info(
            "CUDA graphs captured in %.2f s; beam search set up in %.2f s",
            t1 - t0,
            time.perf_counter() - t1,
        )
    return CompiledForwards(backend, buckets, fns, base != "eager", search)


def select_forwards(
    model: DecoderModel,
    device: torch.device | str,
    max_batch_tokens: int = 32768,
    backend: str = "auto",
    options: CompileOptions | None = None,
) -> CompiledForwards | None:
    """The forwards `backend` asks for (None: plain eager). `"auto"` on CUDA: AOTInductor + CUDA
    graphs when this model's artifacts are cached and load safely here, else eager + CUDA graphs,
    else eager; on CPU eager. The choice and the reason are logged."""
    device = torch.device(device)
    opts = options or CompileOptions()
    if backend != "auto":
        log.info("model backend: %s", backend)
        return _build(model, device, max_batch_tokens, backend, opts)
    if device.type != "cuda":
        log.info(
            "model backend: eager (auto; compiled CPU forwards are not faster for these shapes)"
        )
        return None
    auto = CompileOptions(**{**opts.__dict__, "rebuild": bool(opts.rebuild)})
    for choice in AUTO_CUDA:
        try:
            forwards = _build(model, device, max_batch_tokens, choice, auto)
            log.info("model backend: %s (auto; %d buckets)", choice, len(forwards.buckets))
            return forwards
        except (ArtifactError, AOTIUnsafe, RuntimeError) as exc:
            log.warning("model backend: %s not used (auto): %s", choice, exc)
    log.warning("model backend: eager (auto)")
    return None
