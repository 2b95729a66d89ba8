"""wrk (C) driving a route with a body list: the open-loop-ish load generator the HTTP benchmarks
share (`bench_tail.py` for `/v1/score`, `bench_beam_wrk.py` for `/v1/beam`).

The Lua script cycles through a JSON-lines body file, POSTs each to the route, waits an exponential
think time between requests when asked, and reads every 200 response's `Server-Timing`: the
server's own `app` p50/p99, the mean of every timing entry, and the same means over the slowest 1 %
of requests by `app` (where the tail's time goes: queueing, a node, the reply), printed as one
`JSON ...` line.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import gil_profile
import gpu_window
import httpx

from boundgen.runner import HOST_PARTS

HERE = Path(__file__).resolve().parent

WRK_SCRIPT = r"""
local path, think = "/", 0
local reqs, n, i = {}, 0, 0
apps, timings, non200, sums, counts = {}, {}, 0, {}, {}
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  path = args[2] or path; think = tonumber(args[3] or "0")
  local headers = {["Content-Type"] = "application/json"}
  for line in io.lines(args[1]) do n = n + 1; reqs[n] = wrk.format("POST", path, headers, line) end
  math.randomseed(os.time() + n)
end
function request() i = i % n + 1; return reqs[i] end
function delay() if think > 0 then return -math.log(1 - math.random()) * think end return 0 end
function response(status, headers, body)
  if status ~= 200 then non200 = non200 + 1; return end
  local st = headers["server-timing"] or headers["Server-Timing"]
  if not st then return end
  for name, d in st:gmatch("([%w%-_%.]+);dur=([%d%.]+)") do
    local v = tonumber(d)
    sums[name] = (sums[name] or 0) + v; counts[name] = (counts[name] or 0) + 1
    if name == "app" then apps[#apps + 1] = v; timings[#timings + 1] = st end
  end
end
-- the mean of each timing entry over the slowest 1 % of responses by `app`
local function tail_means(sts)
  local by_app = {}
  for _, st in ipairs(sts) do
    local app = tonumber(st:match("app;dur=([%d%.]+)"))
    if app then by_app[#by_app + 1] = {app, st} end
  end
  table.sort(by_app, function(a, b) return a[1] > b[1] end)
  local k, s, c, out = math.max(1, math.ceil(#by_app / 100)), {}, {}, {}
  for j = 1, math.min(k, #by_app) do
    for name, d in by_app[j][2]:gmatch("([%w%-_%.]+);dur=([%d%.]+)") do
      s[name] = (s[name] or 0) + tonumber(d); c[name] = (c[name] or 0) + 1
    end
  end
  for name, v in pairs(s) do out[#out + 1] = string.format('"%s": %.4f', name, v / c[name]) end
  return table.concat(out, ", ")
end
function done(summary, latency, requests)
  local all, sts, bad, s, c = {}, {}, 0, {}, {}
  for _, t in ipairs(threads) do
    for _, v in ipairs(t:get("apps")) do all[#all + 1] = v end
    for _, v in ipairs(t:get("timings")) do sts[#sts + 1] = v end
    bad = bad + t:get("non200")
    for k, v in pairs(t:get("sums")) do s[k] = (s[k] or 0) + v end
    for k, v in pairs(t:get("counts")) do c[k] = (c[k] or 0) + v end
  end
  table.sort(all)
  local function pct(p)
    if #all == 0 then return -1 end
    return all[math.max(1, math.ceil(#all * p / 100))]
  end
  local means = {}
  for k, v in pairs(s) do means[#means + 1] = string.format('"%s": %.4f', k, v / c[k]) end
  local e = summary.errors
  io.write(string.format('JSON {"requests": %d, "duration_us": %d, "non200": %d, ' ..
    '"socket_errors": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, ' ..
    '"server_n": %d, "server_p50_ms": %.3f, "server_p99_ms": %.3f, "means": {%s}, ' ..
    '"tail_means": {%s}}\n',
    summary.requests, summary.duration, bad, e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    #all, pct(50), pct(99), table.concat(means, ", "), tail_means(sts)))
end
"""


def wrk_binary() -> str:
    """The repository's carried wrk (`.tools/wrk`, fetch_device_wheels.sh --with-wrk), else
    PATH's."""
    carried = HERE.parent / ".tools" / "wrk"
    return str(carried) if carried.exists() else "wrk"


def run_wrk(
    url: str,
    script: Path,
    bodies: Path,
    route: str,
    connections: int,
    think_ms: float,
    seconds: float,
    cpus: str | None,
    threads: int = 1,
) -> dict:
    """One wrk run: ok/s, client percentiles, the server's `app` p50/p99 and per-entry means, over
    all requests and over the slowest 1 %."""
    wrk = wrk_binary()
    cmd = [wrk, f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency"]
    cmd += ["--timeout", "30s", "-s", str(script), url, "--", str(bodies), route]
    cmd += [f"{think_ms:.3f}"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("JSON "))
    r = json.loads(line[5:])
    ok = r["requests"] - r["non200"]
    version = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout
    return {
        "generator": "wrk",
        "wrk_version": version.split("\n")[0],
        "connections": connections,
        "think_ms": think_ms,
        "requests": r["requests"],
        "ok_per_s": ok / (r["duration_us"] / 1e6),
        "errors": r["non200"] + r["socket_errors"],
        "non200": r["non200"],
        "socket_errors": r["socket_errors"],  # e.g. a keep-alive connection closed while idle
        "p50_ms": r["p50_us"] / 1e3,
        "p90_ms": r["p90_us"] / 1e3,
        "p99_ms": r["p99_us"] / 1e3,
        "max_ms": r["max_us"] / 1e3,
        "server_p50_ms": r["server_p50_ms"],
        "server_p99_ms": r["server_p99_ms"],
        "server_means_ms": dict(sorted(r["means"].items())),
        # the same over the slowest 1 % by the server's `app` time
        "server_tail_means_ms": dict(sorted(r["tail_means"].items())),
    }


def load_label(row: dict) -> str:
    """A run's load as a table cell: "16 conn", or "256 conn, think 504 ms"; a run the server
    was profiled during says so ("256 conn, GPU window on"): its numbers are the profiler's too
    (under a GPU window 256 connections got 674–686 `/v1/beam` req/s from a server that served
    1,183–1,190 to 64, seventeenth session)."""
    think = f", think {row['think_ms']:.0f} ms" if row["think_ms"] else ""
    profiled = f", {row['profiled']} on" if row.get("profiled") else ""
    return f"{row['connections']} conn{think}{profiled}"


def tail_line(row: dict, top: int = 6, keys: tuple[str, ...] = ()) -> str:
    """Where the slowest 1 % of a run's requests spent their time: their mean `app` ms, then the
    largest of their other timing entries — `keys` only when given (a route's parts, not the
    entries that hold them), else all but `runtime` (most of `app`). An entry's mean is over the
    requests that have it (a `-wait` appears only when there was one)."""
    tail = row.get("server_tail_means_ms") or {}
    if "app" not in tail:
        return ""
    shown = (lambda k: k in keys) if keys else (lambda k: k not in ("app", "runtime"))
    parts = sorted(((k, v) for k, v in tail.items() if shown(k)), key=lambda kv: -kv[1])
    split = ", ".join(f"{k} {v:.2f}" for k, v in parts[:top])
    return f"    slowest 1 %: app {tail['app']:.2f} ms ({split})"


def node_counters(url: str, node: str) -> dict[str, float]:
    """A batching node's counters so far (`/metrics`): merged batches, the requests and tokens in
    them, the stream seconds of its batches (CUDA), the host seconds of forming and launching
    them, the model runner's host seconds (wall and the running thread's CPU) by part, and the
    server's CPU seconds by thread; differences over a run give requests and tokens per batch,
    the GPU's share, the host time a batch's forward took by part and the CPU a request took by
    thread."""
    text = httpx.get(url + "/metrics", timeout=30).text

    def series(name: str) -> dict[str, float]:
        """Every sample of a metric, by its label text (`node="forward"`)."""
        pattern = rf"^{name}(?:_total)?\{{([^}}]*)\}} (\S+)$"
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}

    def value(name: str, label: str = f'node="{node}"') -> float:
        return series(name).get(label, 0.0)

    # the runner's host time is per part, not per node (one model node serves W5)
    host, cpu = "boundgen_runner_host_seconds", "boundgen_runner_host_cpu_seconds"
    return {
        "batches": value("boundgen_runtime_batches"),
        "requests": value("boundgen_runtime_batched_requests"),
        "tokens": value("boundgen_runtime_batched_tokens"),
        "device_s": value("boundgen_runtime_device_seconds"),
        "paced_wait_s": value("boundgen_runtime_paced_wait_seconds"),
        "launch_s": value("boundgen_runtime_launch_seconds"),
        "planned_cuts": value("boundgen_runtime_planned_cuts"),
        # the node's cost model at the reading (gauges: the after side is the one to read)
        "cost_fixed_s": value("boundgen_runtime_cost_fixed_seconds"),
        "cost_per_unit_s": value("boundgen_runtime_cost_per_unit_seconds"),
        **{f"host_{part}_s": value(host, f'part="{part}"') for part in HOST_PARTS},
        **{f"host_cpu_{part}_s": value(cpu, f'part="{part}"') for part in HOST_PARTS},
        # CPU seconds per server thread (`boundgen_thread_cpu_seconds`), as thread_cpu:NAME
        **{
            "thread_cpu:" + label.removeprefix('thread="').removesuffix('"'): seconds
            for label, seconds in series("boundgen_thread_cpu_seconds").items()
        },
        # the event loop's late wake-ups and the GC's pauses, cumulative by bucket (`stalls`)
        **_buckets(series("boundgen_event_loop_lag_seconds_bucket"), "lag_le:"),
        **_buckets(series("boundgen_gc_pause_seconds_bucket"), "gc_le:"),
        # with `--frontends`: their loops' late wake-ups, and each one's CPU seconds
        **_buckets(series("boundgen_frontend_event_loop_lag_seconds_bucket"), "flag_le:"),
        **{
            "frontend_cpu:" + label.removeprefix('frontend="').removesuffix('"'): seconds
            for label, seconds in series("boundgen_frontend_cpu_seconds").items()
        },
    }


def _buckets(samples: dict[str, float], prefix: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts by upper bound (`prefix` + le), summed over its
    other labels (the GC's generations)."""
    out: dict[str, float] = {}
    for labels, count in samples.items():
        le = re.search(r'le="([^"]+)"', labels)
        if le is not None:
            out[prefix + le.group(1)] = out.get(prefix + le.group(1), 0.0) + count
    return out


def stalls(before: dict, after: dict) -> dict:
    """Over a run, from two `node_counters` readings: the event loop's timer wake-ups (every 10
    ms, `server/loop_lag.py`) — how many, the bucket bound their p99 lag falls under, how many
    were late by more than 10 and 50 ms — and the GC's pauses over 10 ms. {} when the server
    exports no loop lag."""

    def delta(prefix: str) -> dict[float, float]:
        return {
            float(k.removeprefix(prefix)): after[k] - before.get(k, 0.0)
            for k in after
            if k.startswith(prefix)
        }

    def late(lag: dict[float, float], name: str) -> dict:
        total = lag.get(float("inf"), 0.0)
        if not total:
            return {}
        p99 = next(le for le, n in sorted(lag.items()) if n >= 0.99 * total)
        return {
            f"{name}_wakeups": total,
            f"{name}_lag_p99_le_ms": p99 * 1e3,
            f"{name}_late_10ms": total - lag.get(0.01, total),
            f"{name}_late_50ms": total - lag.get(0.05, total),
        }

    lag, gc = delta("lag_le:"), delta("gc_le:")
    out = late(lag, "loop")
    if not out:
        return {}
    out["gc_pauses_over_10ms"] = gc.get(float("inf"), 0.0) - gc.get(0.01, 0.0)
    return out | late(delta("flag_le:"), "frontend")


def stall_line(row: dict) -> str:
    """A run's `stalls` as one indented line; "" without them."""
    st = row.get("stalls") or {}
    if not st:
        return ""
    line = (
        f"    event loop: lag p99 ≤ {st['loop_lag_p99_le_ms']:g} ms, "
        f"{st['loop_late_10ms']:.0f} of {st['loop_wakeups']:.0f} wake-ups late > 10 ms, "
        f"{st['loop_late_50ms']:.0f} > 50 ms; GC pauses > 10 ms: {st['gc_pauses_over_10ms']:.0f}"
    )
    if "frontend_wakeups" in st:
        line += (
            f"; frontends' loops: lag p99 ≤ {st['frontend_lag_p99_le_ms']:g} ms, "
            f"{st['frontend_late_10ms']:.0f} of {st['frontend_wakeups']:.0f} late > 10 ms"
        )
    return line


def thread_cpu_per_request(before: dict, after: dict) -> dict[str, float]:
    """The server's CPU ms per request served by the node of two `node_counters` readings, per
    thread (largest first)."""
    served = after["requests"] - before["requests"]
    if served <= 0:
        return {}
    per = {
        k.split(":", 1)[1]: (after[k] - before.get(k, 0.0)) * 1e3 / served
        for k in after
        if k.startswith("thread_cpu:")
    }
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def frontend_cpu_per_request(before: dict, after: dict) -> dict[str, float]:
    """With `--frontends`: each frontend process's CPU ms per request served by the node of two
    `node_counters` readings ({} without frontends)."""
    served = after["requests"] - before["requests"]
    if served <= 0:
        return {}
    return {
        "frontend-" + k.split(":", 1)[1]: (after[k] - before.get(k, 0.0)) * 1e3 / served
        for k in sorted(after)
        if k.startswith("frontend_cpu:")
    }


def cpu_line(row: dict, top: int = 6) -> str:
    """The server's CPU per request served over a run, in total and by its busiest threads (its
    `thread_cpu_ms_per_request`), then its frontend processes' when it has them, as one indented
    line; "" without it."""
    per = row.get("thread_cpu_ms_per_request") or {}
    if not per:
        return ""
    shown = ", ".join(f"{k} {v:.2f}" for k, v in list(per.items())[:top])
    line = f"    CPU ms per request: {sum(per.values()):.2f} ({shown})"
    frontends = row.get("frontend_cpu_ms_per_request") or {}
    if frontends:
        each = ", ".join(f"{k} {v:.2f}" for k, v in frontends.items())
        line += f"; frontend processes {sum(frontends.values()):.2f} ({each})"
    return line


def add_gil_profile_args(p) -> None:
    """`--gil-profile SECONDS` and `--gil-profile-connections` (`profiled_steps`) on parser `p`."""
    p.add_argument(
        "--gil-profile",
        type=float,
        default=0,
        help="SECONDS: last, a closed loop of --gil-profile-connections while py-spy records "
        "which Python holds the server's GIL (gil_profile.py; py-spy, a server started here)",
    )
    p.add_argument("--gil-profile-connections", type=int, default=64)


def profiled_steps(
    pid: int | None, out: Path, args, closed_loop, record, window: Path, trigger: Path, gpu_conns
) -> tuple[dict | None, dict | None]:
    """A wrk benchmark's optional last steps on a server it started (`pid`): a saturated closed
    loop of `args.gil_profile_connections` while py-spy records `args.gil_profile` seconds of its
    GIL holders (`gil_profile.py`), then one of `gpu_conns` while it records `args.gpu_window`
    seconds of its GPU work (`gpu_window.py`). `closed_loop(connections, seconds)` runs a loop
    and returns its row, `record(row)` keeps it. → (the GIL summary, the GPU window), None each
    when not asked for."""
    gil = gpu = None
    if args.gil_profile and pid is not None:
        c = args.gil_profile_connections
        row, gil = gil_profile.under_load(
            pid,
            args.gil_profile,
            out.with_suffix(".gil.txt"),
            lambda s: closed_loop(c, s),
            f"{c} connections",
        )
        record(row)
    if args.gpu_window and pid is not None:
        row, gpu = gpu_window.under_load(
            window,
            trigger,
            args.gpu_window,
            lambda s: closed_loop(gpu_conns, s),
            f"{gpu_conns} connections",
        )
        record(row)
    return gil, gpu


def per_batch(before: dict[str, float], after: dict[str, float], what: str = "requests") -> float:
    """Requests (or tokens) per batch between two `node_counters` readings (0: no batch)."""
    batches = after["batches"] - before["batches"]
    return (after[what] - before[what]) / batches if batches > 0 else 0.0
