"""Build many buckets at once: one process per job, each with its own copy of the model.

AOTInductor compiles are long (~50 s a bucket on the H200, half of it the C++ build of the
wrapper; BENCHMARKS.md, 2026-12-02) and mostly host work, so N buckets on a machine with many
cores take about N/jobs compile times. Each worker loads the checkpoint once (same device, dtype,
attention and FP8 policy as the parent, hence the same model fingerprint), writes through the
shared, lock-protected `ArtifactCache` and, when asked, checks its bucket against eager right
after building it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

_WORKER: dict = {}


def _init(
    model_dir: str, device: str, dtype: str | None, attention: str, quant: str, emulate: bool
) -> None:
    # NOTE: Inductor's compile pool stays at its default (a process per core in every worker):
    # capped at cores/jobs, the C++ build of a W5 bucket took 41-50 s on the H200 against 24-27 s
    # (BENCHMARKS.md, 2026-12-02): the build runs in that pool
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


def _build_one(
    bucket_name: str, cache_dir: str | None, quant: str, rebuild: bool, verify: bool
) -> dict:
    from boundgen.compile.backends import build_aoti
    from boundgen.compile.buckets import Bucket
    from boundgen.compile.cache import ArtifactCache

    bucket = Bucket.parse(bucket_name)
    try:
        entries = build_aoti(
            _WORKER["model"], _WORKER["device"], [bucket], ArtifactCache(cache_dir), quant, rebuild
        )
    except Exception as exc:
        # Sent back as text: an exception raised deep in a compile may hold a frame, and the pool
        # then reports "cannot pickle 'frame' object" in place of the cause (the H200's t16384
        # W5 bucket, 2026-12-02).
        return failed(bucket_name, exc)
    info = entries[0][2]
    if verify:  # while the other buckets still build (this worker started with the preload)
        from boundgen.compile.verify import max_abs_diff

        try:
            diff = max_abs_diff(_WORKER["model"], bucket, info["path"])
            info["max_abs_diff"] = "n/a" if diff is None else diff
        except Exception as exc:  # reported; the parent verifies it instead
            info["verify_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return info


TRACEBACK_LINES = 12  # of a failed build, kept in its row


def failed(bucket_name: str, exc: BaseException) -> dict:
    """A bucket's build error as plain data: the row `boundgen compile` reports, with the
    traceback's last lines."""
    tb = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return {
        "bucket": bucket_name,
        "event": "error",
        "error": f"{type(exc).__name__}: {exc}"[:500],
        "traceback": tb[-TRACEBACK_LINES:],
    }


class ParallelBuild:
    """Every bucket's build (or verification) in `jobs` worker processes, started at once: the
    caller does its own work meanwhile, then takes `results()`, one info dict per bucket.

    `quant` is the FP8 policy's canonical name: each worker swaps the same projections as the
    parent's model, so the artifacts are the ones that model looks up. A bucket that fails (or is
    still building after `timeout_s`) gives `failed`'s row (its error and traceback) instead of
    stopping the rest; workers still running at the timeout are terminated. `verify`: each worker
    compares its bucket with eager right after building it (`preload`: the libstdc++ the workers
    start with, so that loading a package is safe in them)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str,
        dtype: str | None,
        attention: str,
        buckets: list,
        cache_dir: str | Path | None,
        quant: str = "none",
        rebuild: bool = True,
        jobs: int = 2,
        fp8_emulate: bool = False,
        verify: bool = False,
        preload: str | None = None,
    ) -> None:
        self.buckets = buckets
        self.pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=mp.get_context("spawn"),
            initializer=_init,
            initargs=(str(model_dir), device, dtype, attention, quant, fp8_emulate),
        )
        cache = None if cache_dir is None else str(cache_dir)
        # NOTE: spawned workers take this process's environment as they start, in the submits
        saved = os.environ.get("LD_PRELOAD")
        if preload:
            os.environ["LD_PRELOAD"] = " ".join(p for p in (preload, saved) if p)
        try:
            self.futs = {
                self.pool.submit(_build_one, b.name, cache, quant, rebuild, verify): b.name
                for b in buckets
            }
        finally:
            if saved is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = saved

    def cancel(self) -> None:
        procs = list(getattr(self.pool, "_processes", {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # our own workers: stop the compiles still running
            p.terminate()

    def results(
        self, on_done: Callable[[dict], None] | None = None, timeout_s: float | None = None
    ) -> list[dict]:
        results: dict[str, dict] = {}
        try:
            for fut in as_completed(self.futs, timeout=timeout_s):
                name = self.futs[fut]
                try:
                    info = fut.result()
                except Exception as exc:  # the worker itself died (its build errors come back)
                    info = failed(name, exc)
                results[name] = info
                if on_done:
                    on_done(info)
        except FuturesTimeout:
            for name in set(self.futs.values()) - set(results):
                results[name] = {
                    "bucket": name,
                    "event": "error",
                    "error": f"not built within {timeout_s:.0f}s",
                }
            self.cancel()
        else:
            self.pool.shutdown(wait=True)
        return [results[b.name] for b in self.buckets]
