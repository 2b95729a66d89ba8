"""Overload and soak of `boundgen serve` (issue 19): open-loop load at multiples of the measured
saturation throughput, and a long soak with the server's resident memory sampled.

Overload (default):
1. nominal latency: closed loop, one request at a time (p50/p99 of an unloaded server);
2. saturation: closed loop with 2, 4, 8, 16, 32 concurrent clients; the best ok/s is the
   saturation throughput;
3. open-loop Poisson arrivals (`boundgen.loadtest`) at 1×, 2×, 3× saturation, --duration s each:
   accepted (200) p50/p99 from each request's scheduled arrival, and p99 / nominal p99; the same
   inside the server (its Server-Timing), which tells server queueing from a lagging client; the
   429 and 504 shares; goodput (200s per second from the first arrival to the last answer) and
   goodput / saturation. Before each step the script waits until the server has no request left
   running. Issue 19's targets at 3×: p99 ≤ 2× nominal, goodput ≥ 90 % of saturation.

`--retry-after`: closed-loop clients that honour a 429's `Retry-After` (sleep that many seconds
before their next request), as well-behaved clients do; `--sweep-only` stops after the closed-loop
sweep (no open loop): with both, `--concurrency 16` compares one connection with 16 (issue 23: ok/s
and the share answered 429).

`--soak MINUTES`: open-loop at --soak-load × saturation (mixed score + trie beam by default) for
MINUTES, sampling the server's RSS every --rss-every-s seconds (from /proc when this script started
the server, else from its /metrics); reports RSS at start, end, max and the slope over the second
half, and the errors.

The server is started with its defaults (what issue 19 judges; add flags with --serve-args) on the
built-in demo model on CPU, unless --url points at a running one. On a small machine the load
generator takes CPU from the server; `--server-cpus 0 --client-cpus 1` pins them apart (taskset).

    python benchmarks/bench_overload.py --duration 20
    python benchmarks/bench_overload.py --soak 10
    python benchmarks/bench_overload.py --retry-after --sweep-only --concurrency 16 --probe-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import host_cpu
import httpx
from bench_serving import serve_command, start, stop
from common import env_info

from boundgen.loadtest import LoadConfig, make_bodies, run_loadtest
from boundgen.server.testing import free_port

HERE = Path(__file__).resolve().parent
PATHS = {"score": "/v1/score", "beam": "/v1/beam"}
# A closed-loop client refused with 429 waits this long before its next request: resending at
# once would spin, and on a machine the client shares with the server, take the server's CPU.
SHED_BACKOFF_S = 0.005


# ------------------------------------------------------------------------------------ closed loop


async def _closed_loop(
    cfg: LoadConfig, bodies: list[bytes], concurrency: int, seconds: float, retry_after: bool
) -> list[tuple[float, int]]:
    """`concurrency` clients, each sending its next request as soon as the last one is answered
    (after a 429, SHED_BACKOFF_S later, or with `retry_after` its Retry-After seconds later):
    (latency s, status) per request; status 0 is a client-side error."""
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    out: list[tuple[float, int]] = []
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                try:
                    r = await client.post(PATHS["score"], content=bodies[i % len(bodies)])
                    status = r.status_code
                except httpx.HTTPError:
                    status = 0
                out.append((time.perf_counter() - t0, status))
                i += concurrency
                if status == 429:
                    wait = float(r.headers.get("retry-after", 1)) if retry_after else 0.0
                    await asyncio.sleep(max(wait, SHED_BACKOFF_S))

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return out


def closed_loop(
    cfg: LoadConfig,
    bodies: list[bytes],
    concurrency: int,
    seconds: float,
    retry_after: bool = False,
) -> dict:
    before = forward_batches(cfg)
    samples = asyncio.run(_closed_loop(cfg, bodies, concurrency, seconds, retry_after))
    after = forward_batches(cfg)
    ok = sorted(lat * 1e3 for lat, status in samples if status == 200)
    shed = sum(1 for _, status in samples if status == 429)
    batches, requests = (a - b for a, b in zip(after, before))
    return {
        "concurrency": concurrency,
        "retry_after": retry_after,
        "requests": len(samples),
        "ok_per_s": len(ok) / seconds,
        "errors": len(samples) - len(ok),
        "shed_429": shed,
        "share_429": shed / len(samples) if samples else 0.0,
        "p50_ms": _pct(ok, 50),
        "p99_ms": _pct(ok, 99),
        # how the server merged them: requests per forward, and a forward every so many ms
        "requests_per_forward": requests / batches if batches else float("nan"),
        "ms_per_forward": seconds * 1e3 / batches if batches else float("nan"),
    }


def forward_batches(cfg: LoadConfig) -> tuple[float, float]:
    """The server's forward node counters so far: (batches, requests in them)."""
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    text = httpx.get(cfg.url + "/metrics", headers=headers, timeout=30).text
    out = []
    for name in ("boundgen_runtime_batches_total", "boundgen_runtime_batched_requests_total"):
        m = re.search(rf'^{name}{{node="forward"}} ([0-9.e+]+)$', text, re.MULTILINE)
        out.append(float(m.group(1)) if m else 0.0)
    return out[0], out[1]


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return float("nan")
    return sorted_ms[min(len(sorted_ms) - 1, round((len(sorted_ms) - 1) * p / 100))]


def find_saturation(
    cfg: LoadConfig,
    bodies: list[bytes],
    seconds: float,
    concurrency: list[int],
    retry_after: bool = False,
    log=print,
) -> dict:
    """Nominal latency at concurrency 1, then ok/s at each concurrency; the best is saturation."""
    nominal = closed_loop(cfg, bodies, 1, seconds, retry_after)
    log(
        f"nominal (1 client): {nominal['ok_per_s']:.1f} ok/s, p50 {nominal['p50_ms']:.1f} ms, "
        f"p99 {nominal['p99_ms']:.1f} ms"
    )
    sweep = []
    for c in concurrency:
        wait_idle(cfg)
        step = closed_loop(cfg, bodies, c, seconds, retry_after)
        sweep.append(step)
        log(
            f"closed loop, {c} clients: {step['ok_per_s']:.1f} ok/s, p50 {step['p50_ms']:.1f} ms, "
            f"p99 {step['p99_ms']:.1f} ms, errors {step['errors']} "
            f"({step['share_429']:.1%} answered 429)"
        )
    best = max(sweep, key=lambda s: s["ok_per_s"])
    return {
        "nominal": nominal,
        "sweep": sweep,
        "saturation_ok_per_s": best["ok_per_s"],
        "saturation_concurrency": best["concurrency"],
    }


def wait_idle(cfg: LoadConfig, limit_s: float = 300.0) -> None:
    """Until the server has no admitted request left (`boundgen_inflight` 0): work a step left
    behind (requests answered 504 may still run) must not count against the next step."""
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        text = httpx.get(cfg.url + "/metrics", headers=headers, timeout=30).text
        m = re.search(r"^boundgen_inflight ([0-9.e+]+)$", text, re.MULTILINE)
        if not m or float(m.group(1)) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"server still busy {limit_s} s after the last step")


# --------------------------------------------------------------------------------------- overload


def overload(cfg: LoadConfig, sat: dict, multiples: list[float], log=print) -> list[dict]:
    steps = []
    for m in multiples:
        wait_idle(cfg)
        qps = m * sat["saturation_ok_per_s"]
        one = dataclasses.replace(cfg, qps_steps=(qps,), stop_when_saturated=False, warmup=0)
        steps.append(run_loadtest(one, log=log)["steps"][0])
    nominal_p99 = sat["nominal"]["p99_ms"]
    rows = []
    for m, step in zip(multiples, steps):
        n = step["requests"] or 1
        errors = step["errors"]
        shed = sum(v for k, v in errors.items() if k.startswith("429"))
        late = sum(v for k, v in errors.items() if k.startswith("504"))
        lat = step["latency_ms"]
        rows.append(
            {
                "multiple": m,
                "offered_qps": step["offered_qps"],
                "goodput_ok_per_s": step["throughput_qps"],
                "goodput_ratio": step["throughput_qps"] / sat["saturation_ok_per_s"],
                "accepted_p50_ms": lat["p50"],
                "accepted_p99_ms": lat["p99"],
                "p99_over_nominal": lat["p99"] / nominal_p99,
                # inside the server (Server-Timing `app`): tells server queueing from client lag
                "server_p50_ms": step.get("server_ms", {}).get("p50", float("nan")),
                "server_p99_ms": step.get("server_ms", {}).get("p99", float("nan")),
                "share_429": shed / n,
                "share_504": late / n,
                "other_errors": {
                    k: v for k, v in errors.items() if not k.startswith(("429", "504"))
                },
                "step": step,
            }
        )
    return rows


def overload_table(sat: dict, rows: list[dict]) -> str:
    nom = sat["nominal"]
    lines = [
        f"nominal (unloaded) p50 {nom['p50_ms']:.1f} ms, p99 {nom['p99_ms']:.1f} ms; saturation "
        f"{sat['saturation_ok_per_s']:.1f} ok/s at {sat['saturation_concurrency']} clients",
        "",
        "| load | offered req/s | goodput ok/s | goodput / sat. | accepted p50 ms | "
        "accepted p99 ms | p99 / nominal | server p50 / p99 ms | 429 | 504 | other errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['multiple']:g}× | {r['offered_qps']:.1f} | {r['goodput_ok_per_s']:.1f} | "
            f"{r['goodput_ratio']:.0%} | {r['accepted_p50_ms']:.1f} | {r['accepted_p99_ms']:.1f} | "
            f"{r['p99_over_nominal']:.1f} | {r['server_p50_ms']:.0f} / {r['server_p99_ms']:.0f} | "
            f"{r['share_429']:.0%} | {r['share_504']:.0%} | "
            f"{r['other_errors'] or '–'} |"
        )
    return "\n".join(lines)


def sweep_table(sat: dict) -> str:
    lines = [
        "| clients | ok/s | vs 1 client | p50 ms | p99 ms | answered 429 | other errors | "
        "requests per forward | ms per forward |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    one = sat["nominal"]["ok_per_s"]
    for s in [sat["nominal"], *sat["sweep"]]:
        lines.append(
            f"| {s['concurrency']} | {s['ok_per_s']:.1f} | {s['ok_per_s'] / one:.2f}x | "
            f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['share_429']:.1%} | "
            f"{s['errors'] - s['shed_429']} | {s['requests_per_forward']:.1f} | "
            f"{s['ms_per_forward']:.1f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- soak


class RssSampler:
    """Samples the server's resident memory every `every_s` seconds in a thread: (t s, MiB)."""

    def __init__(self, every_s: float, pid: int | None, url: str, headers: dict[str, str]):
        self.every_s, self.pid, self.url, self.headers = every_s, pid, url, headers
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read_mib(self) -> float:
        if self.pid is not None:
            with open(f"/proc/{self.pid}/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            return kib / 1024
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        m = re.search(r"^process_resident_memory_bytes ([0-9.e+]+)$", text, re.MULTILINE)
        return float(m.group(1)) / 2**20 if m else float("nan")

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(OSError, httpx.HTTPError, StopIteration):  # a missed sample
                self.samples.append((time.monotonic() - start, self.read_mib()))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of RSS over time, in MiB per minute."""
    if len(samples) < 3:
        return float("nan")
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    tm, ym = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - tm) ** 2 for t in ts)
    return 60 * sum((t - tm) * (y - ym) for t, y in samples) / var if var else float("nan")


def soak(cfg: LoadConfig, qps: float, minutes: float, sampler: RssSampler, log=print) -> dict:
    soak_cfg = dataclasses.replace(cfg, qps=qps, qps_steps=(), duration=minutes * 60, warmup=0)
    with sampler:
        report = run_loadtest(soak_cfg, log=log)
    samples = sampler.samples
    second_half = [s for s in samples if s[0] >= samples[-1][0] / 2] if samples else []
    rss = [y for _, y in samples]
    step = report["steps"][0]
    return {
        "qps": qps,
        "minutes": minutes,
        "requests": step["requests"],
        "ok": step["ok"],
        "errors": step["errors"],
        "latency_ms": step["latency_ms"],
        "rss_start_mib": rss[0] if rss else None,
        "rss_end_mib": rss[-1] if rss else None,
        "rss_max_mib": max(rss) if rss else None,
        "rss_growth_pct": 100 * (rss[-1] / rss[0] - 1) if rss else None,
        "rss_slope_second_half_mib_per_min": slope_mib_per_min(second_half),
        "rss_samples": samples,
    }


def soak_table(s: dict) -> str:
    lat = s["latency_ms"]
    return "\n".join(
        [
            "| minutes | req/s | requests | errors | p50 ms | p99 ms | RSS start → end (max) MiB "
            "| growth | slope, 2nd half |",
            "| ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |",
            f"| {s['minutes']:g} | {s['qps']:.1f} | {s['requests']} | {s['errors'] or 0} | "
            f"{lat['p50']:.1f} | {lat['p99']:.1f} | {s['rss_start_mib']:.0f} → "
            f"{s['rss_end_mib']:.0f} ({s['rss_max_mib']:.0f}) | {s['rss_growth_pct']:+.1f} % | "
            f"{s['rss_slope_second_half_mib_per_min']:+.2f} MiB/min |",
        ]
    )


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--serve-args", default="", help="extra `boundgen serve` flags, one string")
    p.add_argument("--items", type=int, default=16, help="score: candidates per request")
    p.add_argument("--item-tokens", type=int, default=16)
    p.add_argument("--query-tokens", type=int, default=16)
    p.add_argument("--probe-s", type=float, default=8.0, help="seconds per closed-loop probe")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[2, 4, 8, 16, 32],
        help="closed-loop clients to try; the best ok/s is the saturation",
    )
    p.add_argument(
        "--retry-after",
        action="store_true",
        help="closed-loop clients honour a 429's Retry-After (default: retry 5 ms later)",
    )
    p.add_argument(
        "--sweep-only", action="store_true", help="stop after the closed-loop sweep (no open loop)"
    )
    p.add_argument("--multiples", type=float, nargs="+", default=[1.0, 2.0, 3.0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per open-loop step")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES")
    p.add_argument("--soak-load", type=float, default=0.5, help="soak QPS / saturation")
    p.add_argument("--soak-workload", default="mixed", choices=["score", "beam", "mixed"])
    p.add_argument("--rss-every-s", type=float, default=5.0)
    p.add_argument("--server-cpus", default=None, help="run the server on these CPUs (taskset -c)")
    p.add_argument("--client-cpus", default=None, help="run this load generator on these CPUs")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/...)")
    args = p.parse_args(argv)

    if args.client_cpus:
        os.sched_setaffinity(0, host_cpu.cpu_list(args.client_cpus))
    name = "soak" if args.soak is not None else "sweep" if args.sweep_only else "overload"
    out = Path(args.out or HERE / "results" / f"{name}_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, log_path, pid = None, None, None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve_args = ["--device", args.device, *args.serve_args.split()]
        if args.model:
            serve_args += ["--model", args.model]
        cmd = serve_command(port, serve_args, cpus=args.server_cpus)
        log_path = out.with_suffix(".server.log")
        print(f"== boundgen serve --port {port} {' '.join(serve_args)}", flush=True)
        proc = start(cmd, url, log_path)
        pid = proc.pid
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    cfg = LoadConfig(
        url=url,
        workload="score",
        items=args.items,
        item_tokens=args.item_tokens,
        query_tokens=args.query_tokens,
        beam_width=4,
        steps=3,
        prompt_tokens=32,
        trie="catalog" if args.model is None else None,
        api_key=args.api_key,
        timeout_s=60.0,
        label="boundgen",
    )
    try:
        vocab = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["vocab_size"]
        cfg = dataclasses.replace(cfg, vocab_size=vocab)
        bodies = make_bodies(cfg, vocab)["score"]
        closed_loop(cfg, bodies, 4, 2.0)  # warm-up: first calls pay one-off costs
        sat = find_saturation(cfg, bodies, args.probe_s, args.concurrency, args.retry_after)
        result = {"env": env_info(), "config": vars(args), "saturation": sat}
        if args.sweep_only:
            table = sweep_table(sat)
        elif args.soak is not None:
            qps = args.soak_load * sat["saturation_ok_per_s"]
            sampler = RssSampler(args.rss_every_s, pid, url, headers)
            scfg = dataclasses.replace(cfg, workload=args.soak_workload)
            result["soak"] = soak(scfg, qps, args.soak, sampler)
            table = soak_table(result["soak"])
        else:
            result["overload"] = overload(cfg, sat, args.multiples)
            table = overload_table(sat, result["overload"])
        result["metrics_tail"] = httpx.get(url + "/metrics", headers=headers).text[-20000:]
    finally:
        if proc is not None:
            stop(proc)
    out.write_text(json.dumps(result, indent=1))
    print(table)
    print(f"wrote {out}" + (f" (server log {log_path})" if log_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
