"""Issue 24: `/v1/beam` over HTTP driven by wrk (C), and where a request's time goes in the server.

W4 requests by default (a 128-token prompt, width 16, 4 steps, a random 100K-item trie of depth 4,
64 distinct prompts: `boundgen loadtest`'s bodies) sent by wrk with a Lua script that cycles
through the bodies and reads every 200 response's `Server-Timing`:

- closed loop, `--connections` each (no think time): the throughput a closed loop reaches and its
  latency;
- then per `--rates` step, `--wrk-connections` connections each waiting an exponential think time
  between requests, so that together they offer about that rate (bench_tail.py's approximation of
  an open loop).

Each run reports ok/s, client p50/p99, the requests per merged search and the GPU's busy share
(the beam node's counters in /metrics: its searches' stream time over the run) and the server's
split: the mean of every `Server-Timing` entry over the run (`app`
the whole handler; `parse`, `prep`, `infer`, `hops`, `reply` the beam handler's stages; `runtime`
and its nodes, `beam-batch-wait` / `beam-batch-run` the merge wait and the merged search;
docs/serving.md) and `app`'s p50/p99; under it, the server's CPU per request by thread and the
beam leader's wait for the device per search (~0: the host, not the GPU, sets the pace) and its
host time forming and launching a search.
`--gil-profile SECONDS` ends with a closed loop while py-spy records which Python holds the
server's GIL (`gil_profile.py`).

`--fake-search FIXED_MS[,PER_PROMPT_MS]` (CPU): the server's `ModelRunner.beam_search` is replaced
by a fake of FIXED + PER_PROMPT × prompts ms that returns the trie's first items (or fixed tokens
without a trie): a search of known cost, so what is measured is everything around it. Like a GPU
search it returns at once with results that are not ready: searches queue one after the other
(one stream), and reading a result on the host (`.cpu()`, `.tolist()`, `.numpy()`, `float()`, ...)
waits until its search has ended; `--fake-sync`: the call itself sleeps instead (`fake_gpu.py`).

    # CPU, the tiny model, a fake 5 ms search
    python benchmarks/bench_beam_wrk.py --fake-search 5,0.1 --connections 1 8 32 --rates 100 200
    # H200 (run_h200.sh beam-wrk)
    python benchmarks/bench_beam_wrk.py --model M --serve-args "--device cuda ..." \\
        --connections 1 16 64 256
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import fake_gpu
import gpu_window
import host_cpu
import httpx
import wrk
from bench_serving import make_trie, serve_command, start, stop
from common import env_info

from boundgen.loadtest import LoadConfig, make_bodies
from boundgen.server.testing import free_port, tiny_model_dir

HERE = Path(__file__).resolve().parent

# wrk's Lua side: args = bodies file (one JSON body a line), path, mean think time in ms (0: none).
# `done` prints one line `JSON {...}`: client percentiles (µs), the `app` p50/p99 of the 200
# responses, and the mean of every Server-Timing entry over them.


def run_wrk(
    url: str, script: Path, bodies: Path, connections: int, think_ms: float, seconds: float, cpus
) -> dict:
    before = wrk.node_counters(url, "beam")
    host_before = host_cpu.read()
    threads = max(1, min(4, connections // 16 or 1))
    row = wrk.run_wrk(
        url, script, bodies, "/v1/beam", connections, think_ms, seconds, cpus, threads
    )
    after = wrk.node_counters(url, "beam")
    # the host's CPUs but the client's over the run: busy, and stolen by the hypervisor
    row["host_cpu"] = host_cpu.usage(host_before, host_cpu.read(), host_cpu.cpu_list(cpus))
    row["beam_batches"] = after["batches"] - before["batches"]
    row["requests_per_batch"] = wrk.per_batch(before, after)
    # the beam node's stream time over the run: the GPU's share (its searches queued back to back
    # read ~100 % even when the host sets the pace; compare beam-batch-run)
    row["gpu_busy"] = (after["device_s"] - before["device_s"]) / seconds
    # the leader blocked on the device before forming its next search, per search: ~0 says the
    # host, not the GPU, sets the pace (the stream-time share above cannot tell them apart)
    row["paced_wait_ms_per_search"] = wrk.per_batch(before, after, "paced_wait_s") * 1e3
    # the host time of forming and launching a search (merge, pack, copies, graph launch): the
    # GPU idles for it whenever the search before ends first, and that idle reads as GPU busy
    row["launch_ms_per_search"] = wrk.per_batch(before, after, "launch_s") * 1e3
    # the server's CPU per request by thread: how close its Python is to one core (the GIL)
    row["thread_cpu_ms_per_request"] = wrk.thread_cpu_per_request(before, after)
    row["frontend_cpu_ms_per_request"] = wrk.frontend_cpu_per_request(before, after)
    # the event loop's late wake-ups and GC pauses over the run: is a slow `hops` the loop?
    row["stalls"] = wrk.stalls(before, after)
    return row


# the split's columns, in the order a request meets them (missing entries print as –)
SPLIT = (
    "parse",
    "prep",
    "hops",
    "prepare",
    "beam-batch-wait",
    "beam-batch-run",
    "finish-wait",
    "finish",
    "reply",
)


def table(rows: list[dict]) -> str:
    head = "| load | ok/s | p50 ms | p99 ms | app p50 / p99 ms | req/search | GPU busy | "
    head += " | ".join(SPLIT) + " | errors |"
    lines = [head, "| --- |" + " ---: |" * (len(SPLIT) + 7)]
    for r in rows:
        load = wrk.load_label(r)
        means = r["server_means_ms"]
        split = " | ".join(f"{means[k]:.3f}" if k in means else "–" for k in SPLIT)
        lines.append(
            f"| {load} | {r['ok_per_s']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['server_p50_ms']:.2f} / {r['server_p99_ms']:.2f} | "
            f"{r.get('requests_per_batch', 0):.1f} | {r.get('gpu_busy', 0):.0%} | {split} | "
            f"{r['errors']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the tiny test model)")
    p.add_argument("--serve-args", default="", help="extra `boundgen serve` flags, one string")
    p.add_argument("--fake-search", default=None, help="FIXED_MS[,PER_PROMPT_MS]: see above")
    p.add_argument("--fake-sync", action="store_true", help="the fake search sleeps in the call")
    p.add_argument("--server-prelude", default="", help="Python run in the server process first")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trie-items", type=int, default=100_000, help="0: no trie")
    p.add_argument("--connections", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--rates", type=float, nargs="*", default=[])
    p.add_argument("--wrk-connections", type=int, default=64, help="connections per rate step")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--budget-s", type=float, default=None, help="skip runs past this many seconds")
    p.add_argument("--server-cpus", default="")
    p.add_argument("--client-cpus", default="")
    p.add_argument(
        "--gpu-window",
        type=float,
        default=0,
        help="SECONDS: last, a closed loop of --gpu-window-connections while the server records "
        "that long of its GPU work (gpu_window.py: the kernels' busy share, gaps, kernels; a "
        "server started here, on CUDA)",
    )
    p.add_argument("--gpu-window-connections", type=int, default=256)
    wrk.add_gil_profile_args(p)
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/...)")
    args = p.parse_args(argv)

    t_start = time.monotonic()
    out = Path(args.out or HERE / "results" / "beam_wrk_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    trie_path = None
    if args.trie_items:
        # not next to the results: a device call brings back a few files only
        trie_path = make_trie(Path(tempfile.gettempdir()), args.trie_items, args.steps)
    proc, url, ready_s, gpu, gil = None, args.url, None, None, None
    window = out.with_suffix(".gpu_window.json")
    trigger = out.with_suffix(".gpu_window.go")
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        prelude = (fake_gpu.PRELUDE if args.fake_search else "") + "\n" + args.server_prelude
        if args.gpu_window:
            prelude += gpu_window.prelude(args.gpu_window, window, trigger)
        model = args.model or str(tiny_model_dir())
        serve_args = ["--model", model, "--max-queue", "4096", "--timeout-ms", "2000"]
        if trie_path is not None:
            serve_args += ["--tries", f"w4={trie_path}"]
        serve_args += args.serve_args.split()
        env = {}
        if args.fake_search:
            env["BOUNDGEN_FAKE_SEARCH"] = args.fake_search
            env["BOUNDGEN_FAKE_SYNC"] = "1" if args.fake_sync else "0"
            if trie_path is not None:
                env["BOUNDGEN_FAKE_TRIE"] = str(trie_path)  # the items' sequences, in order
        cmd = serve_command(port, serve_args, prelude, args.server_cpus)
        print(f"== boundgen serve --port {port} {' '.join(serve_args)}", flush=True)
        t0 = time.monotonic()
        proc = start(cmd, url, out.with_suffix(".server.log"), env=env)
        ready_s = time.monotonic() - t0
        print(f"server ready in {ready_s:.1f} s", flush=True)
    rows: list[dict] = []
    try:
        vocab = httpx.get(url + "/v1/models").json()["data"][0]["vocab_size"]
        cfg = LoadConfig(
            url=url,
            workload="beam",
            prompt_tokens=args.prompt_tokens,
            beam_width=args.width,
            steps=args.steps,
            trie="w4" if trie_path is not None else None,
        )
        with tempfile.TemporaryDirectory() as tmp:
            script, bodies = Path(tmp, "beam.lua"), Path(tmp, "bodies.jsonl")
            script.write_text(wrk.WRK_SCRIPT)
            bodies.write_bytes(b"\n".join(make_bodies(cfg, vocab)["beam"]) + b"\n")
            run_wrk(url, script, bodies, 2, 0, 2, args.client_cpus)  # warm-up

            def record(row: dict) -> None:
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                if wrk.tail_line(row, keys=SPLIT):
                    print(wrk.tail_line(row, keys=SPLIT), flush=True)
                if wrk.cpu_line(row):
                    wait, launch = row["paced_wait_ms_per_search"], row["launch_ms_per_search"]
                    print(
                        f"{wrk.cpu_line(row)}; a search: paced wait {wait:.2f} ms, "
                        f"launch {launch:.2f} ms",
                        flush=True,
                    )
                if wrk.stall_line(row):
                    print(wrk.stall_line(row), flush=True)
                if host_cpu.line(row):
                    print(host_cpu.line(row), flush=True)
                partial = {"env": env_info(), "config": vars(args), "rows": rows}
                out.write_text(json.dumps(partial | {"server_ready_s": ready_s}, indent=1))

            def left() -> bool:
                if args.budget_s is None:
                    return True
                return time.monotonic() - t_start + args.duration + 3 < args.budget_s

            for c in args.connections:
                if not left():
                    print(f"skipped {c} connections: out of budget", flush=True)
                    continue
                record(run_wrk(url, script, bodies, c, 0, args.duration, args.client_cpus))
            unloaded = rows[0]["p50_ms"] if rows else 0.0
            for rate in args.rates:
                if not left():
                    print(f"skipped rate {rate:g}: out of budget", flush=True)
                    continue
                c = args.wrk_connections
                think = max(0.0, c / rate * 1e3 - unloaded)
                row = run_wrk(url, script, bodies, c, think, args.duration, args.client_cpus)
                record(row | {"rate": rate})
            # last, saturated closed loops under py-spy (who holds the GIL) and under the GPU
            # window (the beam node's stream time reads ~100 % whenever searches queue back to
            # back: the kernels' own busy share says whether the GPU or the host sets the pace)
            gil, gpu = wrk.profiled_steps(
                proc.pid if proc is not None else None,
                out,
                args,
                lambda c, s: run_wrk(url, script, bodies, c, 0, s, args.client_cpus),
                record,
                window,
                trigger,
                args.gpu_window_connections,
            )
            metrics = httpx.get(url + "/metrics", timeout=30).text
            keys = ("boundgen_compiles_after_ready", "boundgen_beam_graph", "boundgen_shed")
            counters = {
                line.split(" ")[0]: float(line.split(" ")[-1])
                for line in metrics.splitlines()
                if line.startswith(keys)
            }
    finally:
        if proc is not None:
            stop(proc)
    result = {
        "env": env_info(),
        "date": time.strftime("%Y-%m-%d"),
        "config": vars(args),
        "rows": rows,
        "server_ready_s": ready_s,
        "server_counters": counters,
        "gpu_window": gpu,
        "gil_profile": gil,
    }
    out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print(json.dumps(counters))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
