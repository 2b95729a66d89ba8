"""Build many buckets at once: one process per job, each with its own copy of the model.

AOTInductor compiles are long (41–82 s per graph on the GPU machine, DESIGN §10) and mostly
single-threaded host work (lowering, C++ compile), so N buckets on a machine with many cores take
about N/jobs compile times. Each worker loads the checkpoint once (same device, dtype, attention
and FP8 policy as the parent, hence the same model fingerprint) and writes through the shared,
lock-protected `ArtifactCache`.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

_WORKER: dict = {}


def _init(
    model_dir: str, device: str, dtype: str | None, attention: str, quant: str, emulate: bool
) -> None:
    import logging

    import torch

    from boundgen.models.loading import load_model
    from boundgen.quant.policy import apply_fp8

    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    model = load_model(model_dir, device, dtype, attention)
    if quant != "none":  # the parent already passed (or forced) the fidelity gate
        apply_fp8(model, quant, emulate=emulate)
    _WORKER["model"], _WORKER["device"] = model, next(model.parameters()).device


def _build_one(bucket_name: str, cache_dir: str | None, quant: str, rebuild: bool) -> dict:
    from boundgen.compile.backends import build_aoti
    from boundgen.compile.buckets import Bucket
    from boundgen.compile.cache import ArtifactCache

    entries = build_aoti(
        _WORKER["model"],
        _WORKER["device"],
        [Bucket.parse(bucket_name)],
        ArtifactCache(cache_dir),
        quant,
        rebuild,
    )
    return entries[0][2]


def build_parallel(
    model_dir: str | Path,
    device: str,
    dtype: str | None,
    attention: str,
    buckets: list,
    cache_dir: str | Path | None,
    quant: str = "none",
    rebuild: bool = True,
    jobs: int = 2,
    on_done: Callable[[dict], None] | None = None,
    timeout_s: float | None = None,
    fp8_emulate: bool = False,
) -> list[dict]:
    """Build (or verify) every bucket in `jobs` worker processes; returns one info dict per bucket.
    `quant` is the FP8 policy's canonical name: each worker swaps the same projections as the
    parent's model, so the artifacts are the ones that model looks up.
    A bucket that fails (or is still building after `timeout_s`) gives {"bucket", "event": "error",
    "error"} instead of stopping the rest; workers still running at the timeout are terminated."""
    ctx = mp.get_context("spawn")
    results: dict[str, dict] = {}
    pool = ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=ctx,
        initializer=_init,
        initargs=(str(model_dir), device, dtype, attention, quant, fp8_emulate),
    )
    futs = {
        pool.submit(
            _build_one, b.name, None if cache_dir is None else str(cache_dir), quant, rebuild
        ): b.name
        for b in buckets
    }
    try:
        for fut in as_completed(futs, timeout=timeout_s):
            name = futs[fut]
            try:
                info = fut.result()
            except Exception as exc:
                info = {
                    "bucket": name,
                    "event": "error",
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            results[name] = info
            if on_done:
                on_done(info)
    except FuturesTimeout:
        for name in set(futs.values()) - set(results):
            results[name] = {
                "bucket": name,
                "event": "error",
                "error": f"not built within {timeout_s:.0f}s",
            }
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # our own workers: stop the compiles still running
            p.terminate()
    else:
        pool.shutdown(wait=True)
    return [results[b.name] for b in buckets]
