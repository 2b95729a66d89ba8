"""Compiled model runners and backend selection (`eager` | `compile` | `aoti`, each optionally `+graphs`).

`BucketedRunner` is a `ModelRunner` whose packed forwards run through one compiled function per
bucket:
each chunk is packed on the host, padded into the smallest bucket that fits (`pack_chunk`), copied
to the
device and run; a chunk no bucket takes runs eagerly (counted in `stats()`). `make_runner` builds
the runner a backend
name asks for; `"auto"` picks the best that works here and logs which (and why the others did not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from boundgen.compile.aoti import AOTIBucket, PackedForward, SharedWeights, build_package
from boundgen.compile.buckets import Bucket, BucketSet, parse_buckets
from boundgen.compile.cache import (
    ArtifactCache,
    ArtifactError,
    Slot,
    model_fingerprint,
    platform_info,
)
from boundgen.compile.preload import AOTIUnsafe, ensure_loadable
from boundgen.models.decoder import DecoderModel
from boundgen.text.packing import PackedBatch, SequenceGroup, pack
from boundgen.workloads.runner import ModelRunner

log = logging.getLogger("boundgen.compile")

BACKENDS = ("auto", "eager", "compile", "aoti", "eager+graphs", "compile+graphs", "aoti+graphs")
# NOTE: what "auto" tries on CUDA, in order, before plain eager. Only backends that need no compile
# at
# start-up belong here (aoti uses `boundgen compile`'s cached buckets; graph capture takes ~0.1 s a
# bucket). Measured on the H200 (BENCHMARKS.md, bench_backends.py): graphs cut W3 from 3.5 to 1.65
# ms on
# aoti and from 25 to 3.8 ms on eager, W2 from 7.2 to 6.6 / 27 to 11 ms; nothing changes at 8192
# tokens.
AUTO_CUDA = ("aoti+graphs", "eager+graphs")


@dataclass
class CompileOptions:
    """How compiled backends are built (one place, so CLI flags and the engine agree)."""

    buckets: list[Bucket] | str | None = None  # None: aoti uses the cached buckets of this model
    cache_dir: str | Path | None = None
    rebuild: bool | None = None  # None: True for an explicit "aoti", False for "auto"
    quant: str = (
        "none"  # label of the quantization policy (the model fingerprint covers its effect)
    )
    # +graphs: capture buckets up to this many tokens (graphs paid up to W2's 2048-token bucket on
    # the
    # H200 and made no difference at 8192, where the GPU, not the launches, sets the time)
    graph_max_tokens: int = 2048
    warmup: bool = (
        True  # compile/aoti: run every bucket once at start-up instead of in the first request
    )
    allow_reexec: bool = False  # may re-exec the process with LD_PRELOAD (CLI entry points only)
    progress: Callable[[str, dict], None] | None = None  # progress(event, info) per bucket
    build_log: list[dict] = field(default_factory=list)


def _bucket_key(b: Bucket) -> tuple:
    return (b.tokens, b.segments, b.max_seqlen, b.groups, b.prefix_tokens, b.shared_tokens)


def _layout_key(batch: PackedBatch) -> tuple:
    """The same tuple for a batch: equal keys mean the bucket's compiled graph takes it as is."""
    a = batch.attn
    if a.has_shared_prefix:
        if (a.max_prefix, a.max_group_q) != (a.num_prefix_tokens, a.num_shared_tokens):
            return ()
        cascade = (a.cu_prefix.shape[0] - 1, a.num_prefix_tokens, a.num_shared_tokens)
    else:
        cascade = (0, 0, 0)
    return (batch.num_tokens, a.cu_seqlens.shape[0] - 1, a.max_seqlen, *cascade)


@dataclass
class _Budget:
    max_batch_tokens: int


class BucketedRunner(ModelRunner):
    def __init__(
        self,
        model: DecoderModel,
        device: torch.device,
        max_batch_tokens: int,
        share_prefix: bool,
        buckets: list[Bucket],
        fns: dict[Bucket, Callable],
        name: str,
    ) -> None:
        super().__init__(model, device, max_batch_tokens, share_prefix)
        self.buckets = BucketSet(buckets)
        self.largest = max(b.tokens for b in buckets)
        self._by_layout = {_bucket_key(b): fns[b] for b in buckets if b in fns}
        self.fns = fns
        self.backend_name = name

    def pack_chunk(self, chunk: list[SequenceGroup], share_prefix: bool) -> list[PackedBatch]:
        """Host-side batches of one `split` chunk, each padded into the smallest bucket that fits (a batch
        no bucket takes comes back as is, counted as a miss, and runs eagerly in `forward`). With
        compiled
        buckets a chunk larger than the largest bucket is cut at that size when every piece then
        fits, so
        big requests run compiled instead of eagerly. Eager buckets (eager+graphs) keep big chunks
        whole:
        an uncompiled forward runs any size."""
        if (
            not self.backend_name.startswith("eager")
            and sum(g.num_tokens for g in chunk) > self.largest
        ):
            pieces = [
                pack(part, share_prefix=share_prefix)
                for part in ModelRunner.split(_Budget(self.largest), chunk)
            ]
            # NOTE: only when every piece then has a bucket (a prefix longer than every bucket's P
            # runs
            # eagerly anyway, and then better as one forward than as several)
            if all(self.buckets.choose(p) is not None for p in pieces):
                return [self.buckets.pad(p)[1] for p in pieces]
        return [self.buckets.pad(pack(chunk, share_prefix=share_prefix))[1]]

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Same contract as `ModelRunner.forward`: hidden [T, H] of `batch`'s own tokens. A batch in a
        bucket's exact layout (from `pack_chunk`) runs that bucket directly; another batch that fits
        a
        bucket is padded on the host first; one that fits none runs eagerly."""
        fn = self._by_layout.get(_layout_key(batch))
        if fn is not None:
            return self._call(fn, batch)
        host = batch.to("cpu")
        bucket = self.buckets.choose(host)
        if bucket is None:
            return self.model(batch.input_ids, batch.positions, batch.attn)
        padded = self.buckets.pad(host)[1].to(self.device, non_blocking=True)
        return self._unpad(self._call(self.fns[bucket], padded), batch, padded)

    @staticmethod
    def _call(fn: Callable, batch: PackedBatch) -> torch.Tensor:
        lock = getattr(fn, "lock", None)
        if lock is None:
            return fn(batch)
        with lock:  # a graph's output buffer is reused by the next replay: copy what we need first
            return fn(batch).clone()

    @staticmethod
    def _unpad(hidden: torch.Tensor, batch: PackedBatch, padded: PackedBatch) -> torch.Tensor:
        """Rows of `batch`'s own tokens out of the hidden states of its padded layout, in order."""
        a, pa = batch.attn, padded.attn
        p = a.num_prefix_tokens if a.has_shared_prefix else 0
        q = a.num_shared_tokens if a.has_shared_prefix else 0
        P = pa.num_prefix_tokens if pa.has_shared_prefix else 0
        Q = pa.num_shared_tokens if pa.has_shared_prefix else 0
        tail = batch.num_tokens - p - q
        return torch.cat([hidden[:p], hidden[P : P + q], hidden[P + Q : P + Q + tail]])

    def stats(self) -> dict:
        return {
            "backend": self.backend_name,
            "buckets": [b.name for b in self.buckets],
            **self.buckets.stats.as_dict(),
        }


# -- backends
# ----------------------------------------------------------------------------------------
def _eager_fns(model: DecoderModel, buckets: list[Bucket]) -> dict[Bucket, Callable]:
    fn = lambda b: model(b.input_ids, b.positions, b.attn)
    return dict.fromkeys(buckets, fn)


def _compile_fns(model: DecoderModel, buckets: list[Bucket], device, warmup: bool) -> dict:
    import torch._dynamo

    # NOTE: one compiled function, one specialisation per bucket (shapes and AttnInputs' static
    # ints).
    torch._dynamo.config.cache_size_limit = max(
        torch._dynamo.config.cache_size_limit, 4 * len(buckets)
    )
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 4 * len(buckets)
        )
    compiled = torch.compile(PackedForward(model), fullgraph=True, dynamic=False)
    fn = lambda b: compiled(b.input_ids, b.positions, b.attn)
    if warmup:
        with torch.inference_mode():
            for b in buckets:
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
        if all(
            s.get(k) == getattr(probe, k)
            for k in ("model", "dtype", "quant", "attention", "device")
        ):
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
    """Verified cache entries for every bucket, building the missing/stale/corrupt ones if allowed."""
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
            "path": str(entry.path),
        }
        if status.get("reason"):
            log.info("bucket %s: %s → rebuilt", bucket.name, status["reason"])
        if progress:
            progress("done", info)
        entries.append((bucket, entry, info))
    return entries


def _aoti_fns(
    model, device, buckets, opts: CompileOptions, graphs: bool
) -> tuple[list[Bucket], dict]:
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
    entries = build_aoti(model, device, buckets, cache, opts.quant, rebuild, opts.progress)
    opts.build_log.extend(info for _, _, info in entries)
    ensure_loadable(entries[0][1].path, cache.root, allow_reexec=opts.allow_reexec)
    weights = SharedWeights(model)
    fns = {}
    for bucket, entry, _ in entries:
        single = graphs and bucket.tokens <= opts.graph_max_tokens
        fns[bucket] = AOTIBucket.load(entry.path, bucket, weights, device, single_threaded=single)
        if opts.warmup and not single:  # graph capture warms the others
            # NOTE: a bucket's first run loads its kernels (tens of ms on CUDA): not in a request
            with torch.inference_mode():
                fns[bucket](bucket.example(device))
    return buckets, fns


def _make(
    model, device, max_batch_tokens, share_prefix, backend: str, opts: CompileOptions
) -> ModelRunner:
    base, _, extra = backend.partition("+")
    graphs = extra == "graphs"
    if extra and not graphs:
        raise ValueError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    if graphs and device.type != "cuda":
        raise ValueError(f"backend '{backend}' needs CUDA (CUDA graphs)")
    if base == "eager" and not graphs:
        return ModelRunner(model, device, max_batch_tokens, share_prefix)
    buckets = parse_buckets(opts.buckets, max_batch_tokens)
    if base == "eager":
        # an uncaptured eager bucket would only add padding: larger batches run eagerly as they are
        buckets = [b for b in buckets if b.tokens <= opts.graph_max_tokens]
        if not buckets:
            raise ValueError(
                f"backend '{backend}': no bucket of at most {opts.graph_max_tokens} tokens "
                f"to capture"
            )
        fns = _eager_fns(model, buckets)
    elif base == "compile":
        fns = _compile_fns(model, buckets, device, opts.warmup)
    elif base == "aoti":
        buckets, fns = _aoti_fns(model, device, buckets, opts, graphs)
    else:
        raise ValueError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}")
    if graphs:
        from boundgen.compile.graphs import capture_buckets

        with torch.inference_mode():
            fns = capture_buckets(fns, device, opts.graph_max_tokens)
    runner = BucketedRunner(model, device, max_batch_tokens, share_prefix, buckets, fns, backend)
    if graphs:  # beam decode steps: persistent per-bucket KV + one graph per step (workloads.beam)
        from boundgen.compile.decode import DecodeGraphs

        runner.decode_graphs = DecodeGraphs(model, device)
    return runner


def eager_overrides() -> dict:
    """`Engine.from_pretrained` keyword that forces the eager runner (when `EngineConfig` has `backend`):
    for processes that only need the plain model (builders, baselines)."""
    import dataclasses

    from boundgen.config import EngineConfig

    return (
        {"backend": "eager"}
        if "backend" in {f.name for f in dataclasses.fields(EngineConfig)}
        else {}
    )


def make_runner(
    model: DecoderModel,
    device: torch.device | str,
    max_batch_tokens: int = 32768,
    share_prefix: bool = True,
    backend: str = "auto",
    options: CompileOptions | None = None,
) -> ModelRunner:
    """The model node for `backend`. `"auto"` on CUDA: AOTInductor + CUDA graphs when this model's
    artifacts are cached and load safely here, else eager + CUDA graphs, else eager; on CPU eager.
    The
    choice and the reason are logged and kept in `runner.backend_name`."""
    device = torch.device(device)
    opts = options or CompileOptions()
    if backend != "auto":
        runner = _make(model, device, max_batch_tokens, share_prefix, backend, opts)
        runner.backend_name = backend
        log.info("model backend: %s", backend)
        return runner
    if device.type == "cuda":
        auto = CompileOptions(**{**opts.__dict__, "rebuild": bool(opts.rebuild)})
        for choice in AUTO_CUDA:
            try:
                runner = _make(model, device, max_batch_tokens, share_prefix, choice, auto)
                runner.backend_name = choice
                log.info("model backend: %s (auto; %d buckets)", choice, len(runner.buckets))
                return runner
            except (ArtifactError, AOTIUnsafe, RuntimeError) as exc:
                log.warning("model backend: %s not used (auto): %s", choice, exc)
        log.warning("model backend: eager (auto)")
    else:
        log.info(
            "model backend: eager (auto; compiled CPU forwards are not faster for these shapes)"
        )
    runner = ModelRunner(model, device, max_batch_tokens, share_prefix)
    runner.backend_name = "eager"
    return runner
