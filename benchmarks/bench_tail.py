"""Issue 17: where the HTTP tail comes from. `/v1/score` (token ids in the JSON, a query + N items,
the body `boundgen loadtest --workload score` sends) measured by two load generators on the same
server:

- `wrk` (C, closed loop; a Lua script sends the loadtest's bodies round-robin and reads each 200
  response's `Server-Timing`): first with 1, 2, 4 connections and no think time (the unloaded
  latency, and the throughput a closed loop reaches); then, per --rates step, `--wrk-connections`
  connections each waiting an exponential think time between requests, so that they offer about
  that rate (a closed loop with many clients and Poisson think times approaches an open loop);
- `boundgen loadtest` (Python, open loop, Poisson arrivals) at the same rate.

For each: client p50/p99, server p50/p99 (the `app` entry of `Server-Timing`: the handler), and the
tail outside the server, client p99 − server p99. Server and load generator run on separate CPUs
(`--server-cpus`, `--client-cpus`, taskset). `--server-prelude CODE` runs Python in the server
process before `boundgen serve` (an A/B hook: e.g. `import sys; sys.setswitchinterval(0.001)`).

`--fake-forward FIXED_MS[,PER_1K_TOKENS_MS]`: the model's packed forward is a fake GPU call of that
cost (`fake_gpu.py`: queued on one fake stream, results readable when it ends), so a CPU run
measures the server around a forward of GPU-like cost — its ceiling in req/s and its own tail — and
each run reports the fake GPU's busy share and tokens per forward (`--fake-unpaced`: the forward
node never waits for the device, for an A/B). W5's shape (H200 issue 25): `--items 100 --item-tokens
16 --query-tokens 256 --model tiny` (the demo model has 256 positions; `tiny`: the server tests'
model, 512).
Writes JSON (every run) and prints a Markdown table.

`--encode`: no server; the time to build and encode replies the old way (pydantic models
validated float by float and `model_dump_json`, `json.dumps` of `tolist()`) and the new one
(`server.json`: orjson from float64 arrays), median of --encode-iters, on W2's score reply
(100 items × 2 labels) and embeddings replies.

    python benchmarks/bench_tail.py --rates 5 10 20 30 --duration 15
    python benchmarks/bench_tail.py --encode
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import fake_gpu
import gpu_window
import host_cpu
import httpx
import wrk
from bench_overload import wait_idle
from bench_serving import serve_command, start, stop
from common import env_info

from boundgen.loadtest import LoadConfig, make_bodies, run_loadtest
from boundgen.runner import HOST_PARTS
from boundgen.server.testing import free_port, tiny_model_dir

HERE = Path(__file__).resolve().parent

# wrk's Lua side: args = bodies file (one JSON body a line), path, mean think time in ms (0: none).
# `done` prints one line `JSON {...}`: client percentiles (µs, every response) and the `app`
# durations of the 200 responses (ms).


def run_wrk(
    url: str, script: Path, bodies: Path, connections: int, think_ms: float, seconds: float, cpus
) -> dict:
    return with_forwards(
        url,
        lambda: wrk.run_wrk(url, script, bodies, "/v1/score", connections, think_ms, seconds, cpus),
        cpus,
    )


def with_forwards(url: str, run, client_cpus: str | None) -> dict:
    """`run()`'s row, with the server's forward node over the run (its `/metrics`): requests and
    tokens per forward, the share of the run its batches kept the device busy (0 on CPU), its host
    time per forward by part (wall and CPU), the server's CPU per request by thread, and the
    host's CPUs but the client's: busy and stolen (`host_cpu`)."""
    before = wrk.node_counters(url, "forward")
    host_before = host_cpu.read()
    t0 = time.perf_counter()
    row = run()
    t1 = time.perf_counter()
    after = wrk.node_counters(url, "forward")
    host = host_cpu.usage(host_before, host_cpu.read(), host_cpu.cpu_list(client_cpus))
    return row | {
        "host_cpu": host,
        "t0": t0,
        "t1": t1,
        "requests_per_forward": wrk.per_batch(before, after),
        "tokens_per_forward": wrk.per_batch(before, after, "tokens"),
        "gpu_busy": (after["device_s"] - before["device_s"]) / (t1 - t0),
        # the forward node's leader blocked on the device, per forward (0: host-bound)
        "paced_wait_ms_per_forward": wrk.per_batch(before, after, "paced_wait_s") * 1e3,
        # the host time of forming and launching a forward (merge, pack, stage, launch)
        "launch_ms_per_forward": wrk.per_batch(before, after, "launch_s") * 1e3,
        # batches the tail merge plan ended early (`batch_merge` tail), per forward; the node's
        # fitted cost at the end of the run (its fixed ms a forward, µs a token)
        "planned_cuts_per_forward": wrk.per_batch(before, after, "planned_cuts"),
        "cost_fixed_ms": after["cost_fixed_s"] * 1e3,
        "cost_per_token_us": after["cost_per_unit_s"] * 1e6,
        "host_ms_per_forward": {
            part: wrk.per_batch(before, after, f"host_{part}_s") * 1e3 for part in HOST_PARTS
        },
        "host_cpu_ms_per_forward": {
            part: wrk.per_batch(before, after, f"host_cpu_{part}_s") * 1e3 for part in HOST_PARTS
        },
        "thread_cpu_ms_per_request": wrk.thread_cpu_per_request(before, after),
        "frontend_cpu_ms_per_request": wrk.frontend_cpu_per_request(before, after),
        "stalls": wrk.stalls(before, after),
    }


def run_open_loop(cfg: LoadConfig, rate: float, client_cpus: str | None) -> dict:
    step_cfg = dataclasses.replace(cfg, qps_steps=(rate,), stop_when_saturated=False, warmup=0)
    return with_forwards(cfg.url, lambda: _open_loop_row(step_cfg, rate), client_cpus)


def _open_loop_row(step_cfg: LoadConfig, rate: float) -> dict:
    step = run_loadtest(step_cfg, log=lambda *a: None)["steps"][0]
    lat, srv = step["latency_ms"], step.get("server_ms", {})
    return {
        "generator": "loadtest",
        "rate": rate,
        "requests": step["requests"],
        "ok_per_s": step["throughput_qps"],
        "errors": step["requests"] - step["ok"],
        "p50_ms": lat["p50"],
        "p90_ms": lat["p90"],
        "p99_ms": lat["p99"],
        "max_ms": lat["max"],
        "server_p50_ms": srv.get("p50", math.nan),
        "server_p99_ms": srv.get("p99", math.nan),
        "slowest": step.get("slowest"),
    }


def gc_pauses(url: str) -> dict[str, float]:
    """The server's collection pauses so far: count, sum and max per generation (/metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for m in re.finditer(
        r'^boundgen_gc_pause_(seconds_count|seconds_sum|max_seconds)\{generation="(\d)"\} (\S+)$',
        text,
        re.MULTILINE,
    ):
        out[f"gen{m.group(2)}_{m.group(1)}"] = float(m.group(3))
    return out


def encode_times(iters: int) -> list[dict]:
    """Old vs new reply encoding, ms (median of `iters`)."""
    import asyncio
    import json as std_json
    import statistics

    import numpy as np

    from boundgen.server.json import Slices, encode, encode_async, floats
    from boundgen.server.schemas.common import Usage
    from boundgen.server.schemas.openai import Embedding, EmbeddingsResponse
    from boundgen.server.schemas.sglang import ScoreResponse

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    loop = asyncio.new_event_loop()  # one loop: asyncio.run's set-up would dominate small replies
    rng = np.random.default_rng(0)
    usage = Usage(prompt_tokens=1856, total_tokens=1856, completion_tokens=0)
    scores = rng.random((100, 2)).astype(np.float32)
    rows = [
        {
            "reply": "score, W2 (100 items × 2 labels)",
            "old_ms": median_ms(
                lambda: ScoreResponse(
                    scores=scores.tolist(), model="m", usage=usage
                ).model_dump_json(exclude_none=True)
            ),
            "new_ms": median_ms(
                lambda: encode(
                    {"scores": floats(scores), "model": "m", "usage": usage, "object": "scoring"}
                )
            ),
        }
    ]
    for n, dim in ((64, 896), (4096, 128), (4096, 896)):
        vectors = rng.standard_normal((n, dim)).astype(np.float32)

        def old_openai(vectors=vectors):
            data = [Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)]
            return EmbeddingsResponse(data=data, model="m", usage=usage).model_dump_json(
                exclude_none=True
            )

        def new_openai(vectors=vectors, dim=dim):
            data = [
                {"object": "embedding", "index": i, "embedding": floats(v)}
                for i, v in enumerate(vectors)
            ]
            reply = {"object": "list", "data": Slices(data, dim), "model": "m", "usage": usage}
            return loop.run_until_complete(encode_async(reply))

        def old_kserve(vectors=vectors):
            return std_json.dumps({"outputs": [{"data": vectors.reshape(-1).tolist()}]})

        def new_kserve(vectors=vectors):
            reply = {"outputs": [{"data": Slices(floats(vectors.reshape(-1)))}]}
            return loop.run_until_complete(encode_async(reply))

        rows.append(
            {
                "reply": f"embeddings, OpenAI, {n} × {dim}",
                "old_ms": median_ms(old_openai),
                "new_ms": median_ms(new_openai),
            }
        )
        rows.append(
            {
                "reply": f"embeddings, KServe JSON, {n} × {dim}",
                "old_ms": median_ms(old_kserve),
                "new_ms": median_ms(new_kserve),
            }
        )
    loop.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| generator | load | ok/s | p50 ms | p99 ms | server p50 / p99 ms | p99 − server p99 ms "
        "| errors | requests per forward | GPU busy (forward node) | tokens per forward "
        "| host ms per forward: pack / stage / launch (their CPU) | paced wait ms per forward |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        if r["generator"] == "wrk":
            load = wrk.load_label(r)
        else:
            load = f"open loop {r['rate']:g}/s"
        fake = r.get("fake_gpu") or {}
        busy = f"{fake['busy_share']:.0%}" if fake.get("calls") else "–"
        if r.get("gpu_busy"):  # a real GPU: the forward node's device time
            busy = f"{r['gpu_busy']:.0%}"
        size = f"{fake['mean_size']:.0f}" if fake.get("calls") else "–"
        split, cpu = r.get("host_ms_per_forward") or {}, r.get("host_cpu_ms_per_forward") or {}
        host = " / ".join(f"{split[p]:.2f}" for p in HOST_PARTS) if split else "–"
        if cpu:  # (rows of older runs have no CPU split)
            host += " (CPU " + " / ".join(f"{cpu[p]:.2f}" for p in HOST_PARTS) + ")"
        if not fake.get("calls") and r.get("tokens_per_forward"):
            size = f"{r['tokens_per_forward']:.0f}"
        lines.append(
            f"| {r['generator']} | {load} | {r['ok_per_s']:.1f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['server_p50_ms']:.1f} / {r['server_p99_ms']:.1f} | "
            f"{r['p99_ms'] - r['server_p99_ms']:.1f} | {r['errors']} | "
            f"{r.get('requests_per_forward', 0):.1f} | {busy} | {size} | {host} | "
            f"{r.get('paced_wait_ms_per_forward', 0):.2f} |"
        )
    return "\n".join(lines)


def gc_line(before: dict, after: dict) -> str:
    """Each generation's collections between two readings of the server's `gc_pause` metrics:
    their count and mean pause, and the process's longest so far (which the warm-up may have set:
    the metric keeps no per-window maximum)."""
    gens = []
    for g in range(3):
        n = after.get(f"gen{g}_seconds_count", 0) - before.get(f"gen{g}_seconds_count", 0)
        total = after.get(f"gen{g}_seconds_sum", 0) - before.get(f"gen{g}_seconds_sum", 0)
        mean = f"{total / n * 1e3:.2f} ms on average, " if n else ""
        worst = after.get(f"gen{g}_max_seconds", 0) * 1e3
        gens.append(f"gen{g}: {n:.0f} ({mean}longest since start {worst:.1f} ms)")
    return ", ".join(gens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument(
        "--model", default=None, help="checkpoint dir, or tiny (default: the demo model)"
    )
    p.add_argument("--serve-args", default="", help="extra `boundgen serve` flags, one string")
    p.add_argument("--server-prelude", default="", help="Python run in the server process first")
    p.add_argument("--fake-forward", default=None, help="FIXED_MS[,PER_1K_TOKENS_MS]: see above")
    p.add_argument(
        "--fake-unpaced",
        action="store_true",
        help="with --fake-forward: the forward node never waits for the device (a batch ends when "
        "its call returns)",
    )
    p.add_argument("--items", type=int, default=20)
    p.add_argument("--item-tokens", type=int, default=16)
    p.add_argument("--query-tokens", type=int, default=64)
    p.add_argument("--closed", type=int, nargs="*", default=[1, 2, 4], help="wrk connections")
    p.add_argument("--rates", type=float, nargs="*", default=[5, 10, 20, 30])
    p.add_argument("--wrk-connections", type=int, default=16, help="wrk clients per rate step")
    p.add_argument(
        "--open-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after wrk's step, the same rate by `boundgen loadtest`'s open loop (--no-open-loop: "
        "wrk only, an A/B's shorter run)",
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    p.add_argument(
        "--client-processes", type=int, default=1, help="boundgen loadtest's client processes"
    )
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    wrk.add_gil_profile_args(p)
    p.add_argument(
        "--gpu-window",
        type=float,
        default=0,
        help="SECONDS: last, a closed loop of --gil-profile-connections while the server records "
        "that long of its GPU work (gpu_window.py: busy share, gaps, kernels; a server started "
        "here, on CUDA)",
    )
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/...)")
    p.add_argument("--encode", action="store_true", help="reply encoding times only (no server)")
    p.add_argument("--encode-iters", type=int, default=20)
    args = p.parse_args(argv)
    if args.model == "tiny":
        args.model = str(tiny_model_dir())

    if args.encode:
        if args.client_cpus:
            os.sched_setaffinity(0, host_cpu.cpu_list(args.client_cpus))
        rows = encode_times(args.encode_iters)
        out = Path(args.out or HERE / "results" / "encode_cpu.json")
        out.write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
        print("| reply | before ms | after ms | speed-up |\n| --- | ---: | ---: | ---: |")
        for r in rows:
            speedup = r["old_ms"] / r["new_ms"]
            print(f"| {r['reply']} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | {speedup:.1f}x |")
        print(f"wrote {out}")
        return 0

    if args.client_cpus:
        os.sched_setaffinity(0, host_cpu.cpu_list(args.client_cpus))
    out = Path(args.out or HERE / "results" / "tail_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, url, ready_s, fake_log = None, args.url, None, None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        prelude = (fake_gpu.PRELUDE if args.fake_forward else "") + "\n" + args.server_prelude
        window = out.with_suffix(".gpu_window.json")
        trigger = out.with_suffix(".gpu_window.go")
        if args.gpu_window:
            prelude += gpu_window.prelude(args.gpu_window, window, trigger)
        env = {}
        if args.fake_forward:
            env["BOUNDGEN_FAKE_FORWARD"] = args.fake_forward
            env["BOUNDGEN_FAKE_PACE"] = "0" if args.fake_unpaced else "1"
            env["BOUNDGEN_FAKE_LOG"] = fake_log = str(out.with_suffix(".fake.log"))
            Path(fake_log).unlink(missing_ok=True)
        serve_args = args.serve_args.split() + (["--model", args.model] if args.model else [])
        cmd = serve_command(port, serve_args, prelude, args.server_cpus)
        print(f"== boundgen serve --port {port} {' '.join(serve_args)}", flush=True)
        t0 = time.monotonic()
        proc = start(cmd, url, out.with_suffix(".server.log"), env=env)
        ready_s = time.monotonic() - t0
        print(f"server ready in {ready_s:.1f} s", flush=True)
    cfg = LoadConfig(
        url=url,
        workload="score",
        items=args.items,
        item_tokens=args.item_tokens,
        query_tokens=args.query_tokens,
        duration=args.duration,
        timeout_s=60.0,
        processes=args.client_processes,
        label="boundgen",
    )
    rows: list[dict] = []
    gil: dict | None = None
    gpu: dict | None = None
    try:
        vocab = httpx.get(url + "/v1/models").json()["data"][0]["vocab_size"]
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
        with tempfile.TemporaryDirectory() as tmp:
            script, bodies = Path(tmp, "score.lua"), Path(tmp, "bodies.jsonl")
            script.write_text(wrk.WRK_SCRIPT)
            bodies.write_bytes(b"\n".join(make_bodies(cfg, vocab)["score"]) + b"\n")
            run_wrk(url, script, bodies, 2, 0, 3, args.client_cpus)  # warm-up
            gc_before = gc_pauses(url)

            def record(row: dict) -> None:
                t0, t1 = row.pop("t0", None), row.pop("t1", None)
                if fake_log is not None and t0 is not None:  # the server this script started
                    row["fake_gpu"] = fake_gpu.busy(fake_log, t0, t1)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                if wrk.tail_line(row):
                    print(wrk.tail_line(row), flush=True)
                if wrk.cpu_line(row):  # where the server's CPU went, per request served
                    print(wrk.cpu_line(row), flush=True)
                if wrk.stall_line(row):  # the event loop held up, GC pauses
                    print(wrk.stall_line(row), flush=True)
                if host_cpu.line(row):  # a host whose cores were taken (steal) or full
                    print(host_cpu.line(row), flush=True)
                partial = {"env": env_info(), "config": vars(args), "rows": rows}
                out.write_text(json.dumps(partial | {"server_ready_s": ready_s}, indent=1))

            for c in args.closed:
                wait_idle(cfg)
                record(run_wrk(url, script, bodies, c, 0, args.duration, args.client_cpus))
            unloaded = rows[0]["p50_ms"] if rows else 0.0
            for rate in args.rates:
                c = args.wrk_connections
                think = max(0.0, c / rate * 1e3 - unloaded)
                wait_idle(cfg)
                record(run_wrk(url, script, bodies, c, think, args.duration, args.client_cpus))
                if args.open_loop:
                    wait_idle(cfg)
                    record(run_open_loop(cfg, rate, args.client_cpus))
            # last, saturated closed loops under py-spy and under the GPU window
            gil, gpu = wrk.profiled_steps(
                proc.pid if proc is not None else None,
                out,
                args,
                lambda c, s: run_wrk(url, script, bodies, c, 0, s, args.client_cpus),
                record,
                window,
                trigger,
                args.gil_profile_connections,
            )
            gc_after = gc_pauses(url)
    finally:
        if proc is not None:
            stop(proc)
    result = {
        "env": env_info(),
        "date": time.strftime("%Y-%m-%d"),
        "gil_profile": gil,
        "gpu_window": gpu,
        "config": vars(args),
        "rows": rows,
        "server_ready_s": ready_s,
        "gc_before": gc_before,
        "gc_after": gc_after,
    }
    out.write_text(json.dumps(result, indent=1))
    print(table(rows))
    print("collections during the runs: " + gc_line(gc_before, gc_after))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
