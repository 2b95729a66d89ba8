"""Open-loop HTTP load generator for the serving API (W5 of the benchmarks).

Requests arrive on a fixed schedule (Poisson or uniform) whatever the server does, so queueing shows
up as latency instead of silently lowering the offered load. Latency is measured from each request's
scheduled arrival (no coordinated omission). Workloads (the W2/W4 benchmark shapes by default):
- `score`: `/v1/score`, a 256-token query + 100 candidates × 16 tokens, 2 label tokens (W2 over
  HTTP);
- `beam`: `/v1/beam`, a 128-token prompt, beam width 16, 4 steps (W4 over HTTP);
- `mixed`: 80 % score, 20 % beam.
Token ids are random in the served model's vocabulary (read from `/v1/models`), seeded. Default
shapes that do not fit the served model are fitted to it (`fit_to_server`): the query and prompt
shortened to its context, the steps set to the trie's depth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from boundgen.settings import option


@dataclass(frozen=True)
class LoadConfig:
    url: str = option("http://127.0.0.1:8000", "server base URL")
    workload: str = option("score", "score | beam | mixed", choices=("score", "beam", "mixed"))
    qps: float = option(50.0, "offered requests per second (one step)")
    qps_steps: tuple[float, ...] = option(
        (),
        "run these QPS steps in turn (overrides --qps) and report the max QPS that meets --slo-ms",
    )
    duration: float = option(10.0, "seconds per step")
    warmup: int = option(20, "requests sent one by one before measuring")
    slo_ms: float = option(20.0, "p99 latency target for max-QPS search")
    max_error_rate: float = option(0.01, "a step with more errors than this fails the SLO")
    arrivals: str = option("poisson", "poisson | uniform", choices=("poisson", "uniform"))
    items: int = option(100, "score: candidates per request")
    item_tokens: int = option(16, "score: tokens per candidate")
    query_tokens: int = option(
        256, "score: query tokens (if not given: at most the context allows)"
    )
    labels: int = option(2, "score: label tokens")
    prompt_tokens: int = option(
        128, "beam: prompt tokens (if not given: at most the context allows)"
    )
    beam_width: int = option(16, "beam: width")
    steps: int = option(4, "beam: decode steps (if not given: the depth of --trie)")
    trie: str | None = option(None, "beam: trie name on the server")
    beam_fraction: float = option(0.2, "mixed: share of beam requests")
    distinct: int = option(64, "distinct request bodies (generated once, sent round-robin)")
    vocab_size: int | None = option(None, "token id range (default: from /v1/models)")
    api_key: str | None = option(None, "send `Authorization: Bearer KEY`")
    timeout_s: float = option(30.0, "client timeout per request")
    max_inflight: int = option(
        4096, "client connections; arrivals beyond it count as client errors"
    )
    stop_when_saturated: bool = option(
        True,
        "skip the higher QPS steps once a step completes under half "
        "its offered load or fails half its requests",
    )
    processes: int = option(
        1,
        "client processes, each sending qps/processes (one event loop tops out "
        "near 1-2k requests/s)",
    )
    seed: int = option(0, "random seed (arrivals and token ids)")
    label: str | None = option(None, "name of this run in results and plots (default: the URL)")
    out: str | None = option(None, "write results JSON here")
    plot: str | None = option(None, "write a PNG latency plot here")


@dataclass
class Sample:
    kind: str
    scheduled: float
    latency_s: float
    status: int  # HTTP status; 0 = client-side error (connect, timeout)
    error: str | None = None
    server: dict[str, float] | None = None  # the response's Server-Timing: name → ms
    message: str | None = None  # the server's error message


def parse_server_timing(value: str | None) -> dict[str, float] | None:
    """`app;dur=12.3, forward;dur=9.1` → {"app": 12.3, "forward": 9.1} (entries without dur are
    left out; a name that repeats is summed)."""
    if not value:
        return None
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for param in params:
            key, _, val = param.partition("=")
            if key.strip().lower() == "dur" and name:
                try:
                    out[name] = out.get(name, 0.0) + float(val.strip().strip('"'))
                except ValueError:
                    pass
    return out or None


# ---------------------------------------------------------------------------------------- bodies


def server_card(client: httpx.Client) -> dict[str, Any]:
    """The served model's card from `/v1/models` (empty when the server does not answer one)."""
    try:
        response = client.get("/v1/models")
    except httpx.TransportError as exc:
        raise unreachable(client.base_url, exc) from None
    try:
        return dict(response.json()["data"][0])
    except Exception:
        return {}


def unreachable(url: Any, exc: Exception) -> RuntimeError:
    """One line for a server that does not answer at all (not started, wrong port, gone)."""
    return RuntimeError(
        f"no answer from {url} ({type(exc).__name__}: {exc}); is `boundgen serve` running there?"
    )


def fit_to_server(cfg: LoadConfig, card: dict[str, Any]) -> tuple[LoadConfig, list[str]]:
    """`cfg` with the shapes left at their defaults fitted to the served model (the query or prompt
    shortened to its `max_model_len`, beam steps set to the trie's depth), and what changed. Shapes
    given explicitly are kept: the server's error then says what does not fit."""
    defaults = {f.name: f.default for f in dataclasses.fields(LoadConfig)}
    changes: dict[str, tuple[int, str]] = {}
    depth = card.get("trie_depths", {}).get(cfg.trie) if cfg.trie else None
    if depth and cfg.steps == defaults["steps"] and depth != cfg.steps:
        changes["steps"] = depth, f"the depth of trie {cfg.trie!r}"
    context = card.get("max_model_len")
    if context:
        steps = changes.get("steps", (cfg.steps,))[0]
        room = {"query_tokens": context - cfg.item_tokens, "prompt_tokens": context - steps}
        for name, most in room.items():
            if getattr(cfg, name) == defaults[name] and 0 < most < getattr(cfg, name):
                changes[name] = most, f"to fit the served model's {context}-token context"
    notes = [
        f"{name} {getattr(cfg, name)} -> {value}: {why}" for name, (value, why) in changes.items()
    ]
    return dataclasses.replace(cfg, **{k: v for k, (v, _) in changes.items()}), notes


def make_bodies(cfg: LoadConfig, vocab: int) -> dict[str, list[bytes]]:
    rng = random.Random(cfg.seed)
    hi = max(2, min(vocab, 1 << 31)) - 1

    def ids(n: int) -> list[int]:
        return [rng.randint(1, hi) for _ in range(n)]

    labels = ids(cfg.labels)
    out: dict[str, list[bytes]] = {"score": [], "beam": []}
    for _ in range(cfg.distinct):
        out["score"].append(
            json.dumps(
                {
                    "query": ids(cfg.query_tokens),
                    "items": [ids(cfg.item_tokens) for _ in range(cfg.items)],
                    "label_token_ids": labels,
                    "apply_softmax": True,
                }
            ).encode()
        )
        beam = {"prompt": ids(cfg.prompt_tokens), "beam_width": cfg.beam_width, "steps": cfg.steps}
        if cfg.trie:
            beam["trie"] = cfg.trie
        out["beam"].append(json.dumps(beam).encode())
    return out


def arrival_times(cfg: LoadConfig, qps: float, duration: float) -> list[float]:
    rng = random.Random(cfg.seed + int(qps * 1000))
    times, t = [], 0.0
    n = int(qps * duration)
    for i in range(n):
        if cfg.arrivals == "uniform":
            t = i / qps
        else:
            t += rng.expovariate(qps)
            if t >= duration:
                break
        times.append(t)
    return times


# ---------------------------------------------------------------------------------------- running


async def _run_step(cfg: LoadConfig, bodies: dict[str, list[bytes]], qps: float) -> list[Sample]:
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["authorization"] = f"Bearer {cfg.api_key}"
    limits = httpx.Limits(
        max_connections=cfg.max_inflight, max_keepalive_connections=cfg.max_inflight
    )
    rng = random.Random(cfg.seed + 1)
    plan = []
    for i, t in enumerate(arrival_times(cfg, qps, cfg.duration)):
        kind = cfg.workload
        if kind == "mixed":
            kind = "beam" if rng.random() < cfg.beam_fraction else "score"
        plan.append((t, kind, bodies[kind][i % len(bodies[kind])]))
    samples: list[Sample] = []
    paths = {"score": "/v1/score", "beam": "/v1/beam"}

    async with httpx.AsyncClient(
        base_url=cfg.url, headers=headers, limits=limits, timeout=cfg.timeout_s
    ) as client:

        async def one(start: float, scheduled: float, kind: str, body: bytes) -> None:
            status, error, server, message = 0, None, None, None
            try:
                r = await client.post(paths[kind], content=body)
                status = r.status_code
                server = parse_server_timing(r.headers.get("server-timing"))
                if status != 200:
                    error, message = error_of(r)
            except httpx.HTTPError as exc:
                error, message = type(exc).__name__, str(exc) or type(exc).__name__
            samples.append(
                Sample(
                    kind,
                    scheduled,
                    time.perf_counter() - (start + scheduled),
                    status,
                    error,
                    server,
                    message,
                )
            )

        tasks = []
        start = time.perf_counter()
        for scheduled, kind, body in plan:
            delay = start + scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(start, scheduled, kind, body)))
        await asyncio.gather(*tasks)
    return samples


def error_of(r: httpx.Response) -> tuple[str, str]:
    """(error type, message) of an error reply: `{"error": {"message", "type"}}`, SGLang's flat
    `{"message", "type"}` (`/v1/score`), or whatever else the server sent."""
    try:
        body = r.json()
    except Exception:
        return f"http_{r.status_code}", r.text[:200]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict) and "message" in err:
        return str(err.get("type") or f"http_{r.status_code}"), str(err["message"])
    return f"http_{r.status_code}", str(err)[:200]


def _warmup(cfg: LoadConfig, client: httpx.Client, bodies: dict[str, list[bytes]]) -> None:
    kinds = ["score", "beam"] if cfg.workload == "mixed" else [cfg.workload]
    for i in range(cfg.warmup):
        kind = kinds[i % len(kinds)]
        try:
            client.post(
                "/v1/score" if kind == "score" else "/v1/beam",
                content=bodies[kind][i % len(bodies[kind])],
                headers={"content-type": "application/json"},
            )
        except httpx.TransportError as exc:
            raise unreachable(cfg.url, exc) from None


def summarize(samples: list[Sample], qps: float, duration: float, items: int) -> dict[str, Any]:
    ok = sorted(s.latency_s * 1e3 for s in samples if s.status == 200)
    errors: dict[str, int] = {}
    for s in samples:
        if s.status != 200:
            key = f"{s.status}:{s.error}" if s.status else f"client:{s.error}"
            errors[key] = errors.get(key, 0) + 1
    span = max([duration] + [s.scheduled + s.latency_s for s in samples])
    n_ok = len(ok)
    n_score = sum(1 for s in samples if s.status == 200 and s.kind == "score")
    return {
        "qps_target": qps,
        "requests": len(samples),
        "ok": n_ok,
        "errors": errors,
        "error_rate": (len(samples) - n_ok) / len(samples) if samples else 0.0,
        "offered_qps": len(samples) / duration if duration else 0.0,
        "throughput_qps": n_ok / span if span else 0.0,
        "items_per_s": n_score * items / span if span else 0.0,
        "latency_ms": {
            "p50": _pct(ok, 50),
            "p90": _pct(ok, 90),
            "p99": _pct(ok, 99),
            "mean": statistics.fmean(ok) if ok else math.nan,
            "max": ok[-1] if ok else math.nan,
        },
        **_server_side(samples),
    }


def _server_side(samples: list[Sample]) -> dict[str, Any]:
    """Where the time went, from the servers' `Server-Timing`: `server_ms` percentiles of the
    handler time, and `slowest`: the slowest 1 % of answered requests (at least one), mean client
    latency, mean time inside the server and outside it (network, client, event loop), and mean
    per reported entry — so a p99 can be traced to a node, to waiting, or to outside the server."""
    timed = sorted(
        (s for s in samples if s.status == 200 and s.server and "app" in s.server),
        key=lambda s: s.latency_s,
    )
    if not timed:
        return {}
    app = sorted(s.server["app"] for s in timed)
    tail = timed[-max(1, len(timed) // 100) :]
    names = sorted({k for s in tail for k in s.server if k != "app"})
    lat = statistics.fmean(s.latency_s * 1e3 for s in tail)
    inside = statistics.fmean(s.server["app"] for s in tail)
    return {
        "server_ms": {"p50": _pct(app, 50), "p90": _pct(app, 90), "p99": _pct(app, 99)},
        "slowest": {
            "n": len(tail),
            "latency_ms": lat,
            "server_ms": inside,
            "outside_ms": lat - inside,
            "entries_ms": {k: statistics.fmean(s.server.get(k, 0.0) for s in tail) for k in names},
        },
    }


def _pct(sorted_ms: list[float], p: float) -> float:
    if not sorted_ms:
        return math.nan
    k = (len(sorted_ms) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


def _child_step(cfg: LoadConfig, vocab: int, qps: float) -> list[tuple]:
    samples = asyncio.run(_run_step(cfg, make_bodies(cfg, vocab), qps))
    return [dataclasses.astuple(x) for x in samples]


def _run_step_processes(cfg: LoadConfig, vocab: int, qps: float) -> list[Sample]:
    """The step split over `cfg.processes` client processes (independent Poisson streams add up)."""
    import multiprocessing

    n = cfg.processes
    cfgs = [dataclasses.replace(cfg, seed=cfg.seed + 7919 * i, processes=1) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(n) as pool:
        parts = pool.starmap(_child_step, [(c, vocab, qps / n) for c in cfgs])
    return [Sample(*t) for part in parts for t in part]


def run_loadtest(cfg: LoadConfig, log=print) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    with httpx.Client(base_url=cfg.url, headers=headers, timeout=cfg.timeout_s) as client:
        card = server_card(client)
        cfg, notes = fit_to_server(cfg, card)
        for note in notes:
            log(note)
        vocab = cfg.vocab_size or int(card.get("vocab_size") or 1000)
        bodies = make_bodies(cfg, vocab)
        _warmup(cfg, client, bodies)
    steps = list(cfg.qps_steps) or [cfg.qps]
    results = []
    for qps in steps:
        if cfg.processes > 1:
            samples = _run_step_processes(cfg, vocab, qps)
        else:
            samples = asyncio.run(_run_step(cfg, bodies, qps))
        summary = summarize(samples, qps, cfg.duration, cfg.items)
        results.append(summary)
        log(step_line(qps, summary))
        if "slowest" in summary:
            log(slowest_line(summary["slowest"]))
        failed = next((x for x in samples if x.status != 200), None)
        if failed is not None:
            log(f"  first error: {failed.status or 'client'} {failed.error}: {failed.message}")
        saturated = (
            summary["throughput_qps"] < 0.5 * summary["offered_qps"] or summary["error_rate"] > 0.5
        )
        if cfg.stop_when_saturated and saturated and qps != steps[-1]:
            log(f"saturated at {qps:g} QPS: skipping {[q for q in steps if q > qps]}")
            break
    passing = [
        r["qps_target"]
        for r in results
        if r["latency_ms"]["p99"] <= cfg.slo_ms and r["error_rate"] <= cfg.max_error_rate
    ]
    report = {
        "label": cfg.label or cfg.url,
        "config": dataclasses.asdict(cfg),
        "vocab_size": vocab,
        "steps": results,
        "slo_ms": cfg.slo_ms,
        "max_qps_within_slo": max(passing) if passing else None,
    }
    if len(steps) > 1:
        best = report["max_qps_within_slo"]
        met = f"{best:g}" if best is not None else "none of the steps met it"
        slo = f"p99 <= {cfg.slo_ms:g} ms and errors <= {cfg.max_error_rate * 100:g} %"
        log(f"max QPS with {slo}: {met}")
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(report, indent=1))
    if cfg.plot:
        plot_reports([report], cfg.plot)
    return report


def step_line(qps: float, summary: dict[str, Any]) -> str:
    """One step on one line: load, answers per second, latency percentiles, errors."""
    lat = summary["latency_ms"]
    line = (
        f"qps {qps:8.1f}: offered {summary['offered_qps']:8.1f}  ok/s "
        f"{summary['throughput_qps']:8.1f}  p50 {_ms(lat['p50'])}  p90 {_ms(lat['p90'])}"
        f"  p99 {_ms(lat['p99'])}"
    )
    if "server_ms" in summary:
        line += f"  (server p99 {summary['server_ms']['p99']:.2f} ms)"
    line += f"  errors {summary['requests'] - summary['ok']}"
    return line + (f" {summary['errors']}" if summary["errors"] else "")


def slowest_line(tail: dict[str, Any], entries: int = 4) -> str:
    """Where the slowest 1 % spent their time: inside the server (its largest `Server-Timing`
    entries; they nest, e.g. `runtime` holds `forward`; all are in the JSON) and outside it
    (network, client, event loop)."""
    largest = sorted(tail["entries_ms"].items(), key=lambda kv: -kv[1])
    inside = ", ".join(f"{name} {ms:.2f}" for name, ms in largest[:entries])
    inside += ", ..." if len(largest) > entries else ""
    n = tail["n"]
    return (
        f"  slowest 1 % ({n} request{'s' if n != 1 else ''}): {tail['latency_ms']:.2f} ms = "
        f"server {tail['server_ms']:.2f} ms"
        + (f" ({inside})" if inside else "")
        + f" + outside the server {tail['outside_ms']:.2f} ms"
    )


def _ms(value: float) -> str:
    return "       - ms" if math.isnan(value) else f"{value:8.2f} ms"


def plot_reports(reports: list[dict[str, Any]], path: str | Path, title: str | None = None) -> None:
    """p50 and p99 latency against offered QPS, one line pair per report (side-by-side runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rep in reports:
        xs = [s["offered_qps"] for s in rep["steps"]]
        line = ax.plot(
            xs, [s["latency_ms"]["p99"] for s in rep["steps"]], "o-", label=f"{rep['label']} p99"
        )[0]
        ax.plot(
            xs,
            [s["latency_ms"]["p50"] for s in rep["steps"]],
            "s--",
            color=line.get_color(),
            alpha=0.7,
            label=f"{rep['label']} p50",
        )
    slo = reports[0].get("slo_ms")
    if slo:
        ax.axhline(slo, color="gray", lw=0.8, ls=":", label=f"SLO {slo:g} ms")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"{reports[0]['config']['workload']} over HTTP (open loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
