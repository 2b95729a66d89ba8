"""What a host thread's wait for the GPU costs under each `BOUNDGEN_CUDA_WAIT` policy (CUDA only).

The GPU sleeps `--gpu-ms` (`torch.cuda._sleep`), the thread waits for it three ways — an event's
`synchronize()`, the stream's, and a copy from pageable memory queued behind the sleep (what a
whole-search graph's inputs do) — and we read the thread's CPU time over the wait and the wait's
wall time minus the GPU's (timing events around the sleep): how long after the GPU was done the
thread went on (a few µs under, the launch's own lead). First spinning (CUDA's default), then
after `cuda_waits.apply` with `BOUNDGEN_CUDA_WAIT=block` set in this process: both sides in one
process.

    python benchmarks/bench_cuda_wait.py --gpu-ms 20 --iters 20 --out $OUT/cuda_wait.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from boundgen import cuda_waits


def _cycles_per_ms() -> float:
    """GPU clock cycles in one ms of `torch.cuda._sleep` (calibrated once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _one(kind: str, cycles: int, blocking: bool) -> tuple[float, float]:
    """(thread CPU ms, ms the wait lasted past the GPU's work) of one wait of `kind`."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True, blocking=blocking)
    host = torch.zeros(1 << 16, dtype=torch.int64)  # pageable
    dev = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    t0, c0 = time.perf_counter(), time.thread_time()
    if kind == "event":
        end.synchronize()
    elif kind == "stream":
        torch.cuda.current_stream().synchronize()
    else:  # a pageable copy behind the sleep: the host blocks until it can be staged
        dev.copy_(host, non_blocking=True)
    wall, cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
    torch.cuda.synchronize()
    return cpu, wall - start.elapsed_time(end)


def run(gpu_ms: float, iters: int) -> dict:
    cycles = int(_cycles_per_ms() * gpu_ms)
    out = {}
    for policy in ("spin", "block"):
        if policy == "block":
            os.environ["BOUNDGEN_CUDA_WAIT"] = "block"
            out["context_flags"] = cuda_waits.apply("cuda")
        for kind in ("event", "stream", "pageable copy"):
            runs = [_one(kind, cycles, policy == "block") for _ in range(iters)]
            cpu = statistics.median(r[0] for r in runs)
            late = statistics.median(r[1] for r in runs)
            out[f"{policy} {kind}"] = {"cpu_ms": round(cpu, 3), "wall_minus_gpu_ms": round(late, 3)}
            print(
                f"{policy:5} {kind:13}: thread CPU {cpu:7.3f} ms over a {gpu_ms:g} ms GPU wait, "
                f"wall − GPU {late:6.3f} ms (median of {iters})",
                flush=True,
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu-ms", type=float, default=20.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_wait.py needs a CUDA device")
    torch.zeros(1, device="cuda")  # the context exists before `apply`, as in a server
    result = {"gpu_ms": args.gpu_ms, "iters": args.iters, **run(args.gpu_ms, args.iters)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
