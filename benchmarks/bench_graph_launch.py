"""Issue 24: what launching one big CUDA graph costs before the GPU starts, and whether a chain of
smaller graphs hides it.

A W4 search is one whole-search graph of ~1,800 kernels (graph + compiled layers). In its profile
(H200, 2026-12-02 sixth session, `benchmarks/results/h200-2026-12-02-s6-call3/gpu_unfused.json`)
the GPU idles 0.73 ms early in the search, and the plain-layer graph of ~7,000 kernels idles
2.2 ms: the idle grows with the graph's size, as the graph's launch would. If a launch submits
every node before the GPU starts, a chain of graphs (prefill, then one per decode step) lets the
GPU run the first while the host launches the next.

This captures N tiny kernels (a scalar add each, ~2 µs on the GPU) as one graph, and as K graphs
of N/K kernels replayed back to back, and reports per N and K:
- `launch_ms`: host time of the replay calls (`CUDAGraph.replay()` returning),
- `wall_ms`: replay calls + synchronize (what a caller waits),
- `gpu_ms`: CUDA events around the replays (the GPU's span from the moment the replays are
  called, so the wait for a graph's launch counts, as do the gaps between kernels).
With kernels of ~2 µs, `gpu_ms` well above N × 2 µs while `launch_ms` is about as long says the
GPU waited for the launch; a chain whose `wall_ms` is lower says chaining hides it.

    python benchmarks/bench_graph_launch.py --out $OUT/graph_launch.json     # H200, ~30 s

Answer (H200, 2026-12-02 eighth session, BENCHMARKS.md): no wait. A replay returns in 11–24 µs
up to 4,000 kernels and the GPU's span equals the kernels' own (~0.85 µs each, the floor of a
kernel in a graph), one graph or ten; so `SearchGraphs` keeps one graph per search. The early
idle in W4's profile (0.64 ms lead + a 0.56 ms gap) is then most likely the profiler's own cost
of launching a traced graph (not measured apart): the unprofiled search takes 6.82 ms against the
profiled 7.81 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def capture(kernels: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph of `kernels` in-place scalar adds on `x` (each its own kernel node)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1.0)
    return graph


def measure(graphs: list[torch.cuda.CUDAGraph], iters: int) -> dict[str, float]:
    """Replay `graphs` in order, `iters` times: the medians of host launch, wall and GPU span."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launch, wall, gpu = [], [], []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        gpu.append(start.elapsed_time(end))
    launch, wall, gpu = launch[3:], wall[3:], gpu[3:]  # the first replays upload the graphs
    return {
        "launch_ms": statistics.median(launch),
        "wall_ms": statistics.median(wall),
        "gpu_ms": statistics.median(gpu),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
    ap.add_argument("--chains", type=int, nargs="+", default=[1, 2, 5, 10])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    x = torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm the add kernel outside any capture
        x.add_(1.0)
    torch.cuda.synchronize()
    rows = []
    head = ("kernels", "graphs", "launch ms", "wall ms", "gpu ms", "us/kernel wall")
    print("{:>7} {:>6} {:>9} {:>8} {:>7} {:>14}".format(*head))
    for n in args.kernels:
        for k in args.chains:
            if n % k:
                continue
            graphs = [capture(n // k, x) for _ in range(k)]
            row = {"kernels": n, "graphs": k, **measure(graphs, args.iters)}
            rows.append(row)
            print(
                f"{n:>7} {k:>6} {row['launch_ms']:>9.3f} {row['wall_ms']:>8.3f} "
                f"{row['gpu_ms']:>7.3f} {row['wall_ms'] / n * 1e3:>14.2f}"
            )
            del graphs
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
