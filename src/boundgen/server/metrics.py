"""Prometheus metrics, one `Metrics` per app (its own registry, so several apps can live in one
process).

Names: `boundgen_request_seconds{endpoint}`, `boundgen_requests_total{endpoint,status}`,
`boundgen_errors_total{endpoint,type}`, `boundgen_inflight`, `boundgen_batch_tokens`,
`boundgen_items_total{endpoint}` (items/s = rate()), `boundgen_shed_total{reason}`,
`boundgen_predicted_wait_seconds` and `boundgen_queue_budget_seconds` (admission),
`boundgen_device_memory_bytes{device,kind}`, the runtime's own
`boundgen_runtime_node_seconds{pipeline, node}` (every DAG node), batching counters, the compiled
buckets' use (`boundgen_bucket_batches_total{bucket}`, `boundgen_bucket_misses_total`, real and
padded tokens), GC pauses per generation and CPU time per Python thread
(`boundgen_thread_cpu_seconds{thread}`); with `serve --frontends`, the frontend processes'
event-loop lag (`boundgen_frontend_event_loop_lag_seconds`) and CPU
(`boundgen_frontend_cpu_seconds{frontend}`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from boundgen.server.loop_lag import LAG_BUCKETS
from boundgen.server.threads import thread_cpu_seconds

# Latency buckets in seconds: fine around the 20 ms p99 target, coarse beyond.
LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class _DeviceMemoryCollector:
    def collect(self):
        family = GaugeMetricFamily(
            "boundgen_device_memory_bytes", "accelerator memory", labels=["device", "kind"]
        )
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for i in range(torch.cuda.device_count()):
                    dev = f"cuda:{i}"
                    family.add_metric([dev, "allocated"], float(torch.cuda.memory_allocated(i)))
                    family.add_metric([dev, "reserved"], float(torch.cuda.memory_reserved(i)))
                    family.add_metric(
                        [dev, "max_allocated"], float(torch.cuda.max_memory_allocated(i))
                    )
        except Exception:  # metrics must never fail a scrape
            pass
        yield family


class _ThreadCpuCollector:
    def collect(self):
        family = CounterMetricFamily(
            "boundgen_thread_cpu_seconds",
            "CPU time per Python thread (name; `other`: the native threads): the Python threads "
            "share one GIL, so their sum near one core per second says the server is bound by it",
            labels=["thread"],
        )
        try:
            for name, seconds in sorted(thread_cpu_seconds().items()):
                family.add_metric([name], seconds)
        except Exception:  # metrics must never fail a scrape
            pass
        yield family


class _FrontendCpuCollector:
    def __init__(self, cpu_seconds: Callable[[], dict[int, float]]) -> None:
        self.cpu_seconds = cpu_seconds

    def collect(self):
        family = CounterMetricFamily(
            "boundgen_frontend_cpu_seconds",
            "CPU time of each HTTP frontend process (serve --frontends), as last reported by it "
            "(once a second): its HTTP work, off the engine process's GIL",
            labels=["frontend"],
        )
        for index, seconds in sorted(self.cpu_seconds().items()):
            family.add_metric([str(index)], seconds)
        yield family


class _RuntimeCollector:
    """The DAG runtime's own node histograms (`runtime.executor.tracer`) as Prometheus
    histograms."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def collect(self):
        hist = HistogramMetricFamily(
            "boundgen_runtime_node_seconds",
            "time in each DAG node of each pipeline (runtime tracer)",
            labels=["pipeline", "node"],
        )
        inflight = GaugeMetricFamily("boundgen_runtime_inflight", "requests inside the runtime")
        errors = CounterMetricFamily(
            "boundgen_runtime_errors", "runtime request failures", labels=["pipeline", "status"]
        )
        batches = CounterMetricFamily(
            "boundgen_runtime_batches", "forward batches merged across requests", labels=["node"]
        )
        batched = CounterMetricFamily(
            "boundgen_runtime_batched_requests", "requests merged into batches", labels=["node"]
        )
        batch_tokens = CounterMetricFamily(
            "boundgen_runtime_batched_tokens", "tokens in merged batches", labels=["node"]
        )
        device = CounterMetricFamily(
            "boundgen_runtime_device_seconds",
            "stream time of the batches a node's device queue has run, from a batch's launch to "
            "its end on the device (its rate: the node's share of the GPU, including any time the "
            "GPU waited for the host to launch the batch)",
            labels=["node"],
        )
        launch = CounterMetricFamily(
            "boundgen_runtime_launch_seconds",
            "host time a node spent forming and launching its batches (merging the requests, the "
            "call that queues the device work; without a device queue, the whole call): a batch's "
            "stream time includes it whenever the batch before it ended first",
            labels=["node"],
        )
        paced = CounterMetricFamily(
            "boundgen_runtime_paced_wait_seconds",
            "time a node's batch leaders waited for the device before forming the next batch "
            "(near 0 per batch at saturation: the host, not the device, sets the pace)",
            labels=["node"],
        )
        planned = CounterMetricFamily(
            "boundgen_runtime_planned_cuts",
            "batches a node's tail merge plan ended with requests waiting that would have fit "
            "(`batch_merge` tail)",
            labels=["node"],
        )
        fixed = GaugeMetricFamily(
            "boundgen_runtime_cost_fixed_seconds",
            "a node's cost model: the fitted fixed time of one forward (0 while cold)",
            labels=["node"],
        )
        per_unit = GaugeMetricFamily(
            "boundgen_runtime_cost_per_unit_seconds",
            "a node's cost model: the fitted time of one unit (a token; 0 while cold)",
            labels=["node"],
        )
        try:
            for node, st in self.runtime.stats().get("batching", {}).items():
                batches.add_metric([node], float(st.get("batches", 0)))
                batched.add_metric([node], float(st.get("requests", 0)))
                batch_tokens.add_metric([node], float(st.get("tokens", 0)))
                device.add_metric([node], float(st.get("device_seconds", 0.0)))
                launch.add_metric([node], float(st.get("launch_seconds", 0.0)))
                paced.add_metric([node], float(st.get("paced_wait_seconds", 0.0)))
                planned.add_metric([node], float(st.get("planned_cuts", 0)))
                cost = st.get("cost", {})
                warm = bool(cost.get("warm"))  # a cold model's fit predicts nothing yet
                fixed.add_metric([node], float(cost.get("fixed_ms", 0.0)) / 1e3 * warm)
                per_unit.add_metric([node], float(cost.get("per_unit_us", 0.0)) / 1e6 * warm)
        except Exception:
            pass
        yield batches
        yield batched
        yield batch_tokens
        yield device
        yield launch
        yield paced
        yield planned
        yield fixed
        yield per_unit
        try:
            tracer = self.runtime.executor.tracer
            for (pipeline, node), h in sorted(tracer.histograms().items()):
                hist.add_metric([pipeline, node], *_prometheus_buckets(h))
            for key, n in dict(tracer.errors).items():
                pipeline, _, status = str(key).partition(":")
                errors.add_metric([str(pipeline), str(status)], float(n))
            inflight.add_metric([], float(self.runtime.executor.stats().get("inflight", 0)))
        except Exception:  # metrics must never fail a scrape
            pass
        yield hist
        yield inflight
        yield errors
        yield from _bucket_families(self.runtime)


def _bucket_families(runtime):
    """The runner's statistics (`ModelRunner.stats`): batches per compiled bucket, batches no
    bucket took (run eagerly), real and padded tokens (hit rate = batches / (batches + misses);
    padding = 1 − real / padded), and the forwards' host time by part."""
    batches = CounterMetricFamily(
        "boundgen_bucket_batches", "forwards run by each compiled bucket", labels=["bucket"]
    )
    misses = CounterMetricFamily(
        "boundgen_bucket_misses", "forwards no compiled bucket took (run eagerly)"
    )
    real = CounterMetricFamily("boundgen_bucket_real_tokens", "real tokens in compiled buckets")
    padded = CounterMetricFamily(
        "boundgen_bucket_padded_tokens", "tokens compiled buckets ran, padding included"
    )
    backend = GaugeMetricFamily("boundgen_model_backend", "the model backend", labels=["backend"])
    beam_searches = CounterMetricFamily(
        "boundgen_beam_graph_searches",
        "beam searches (or pieces of a cut one) run in a whole-search CUDA graph",
    )
    beam_misses = CounterMetricFamily(
        "boundgen_beam_graph_misses",
        "beam searches no whole-search graph made at warm-up took (run on the plain path)",
    )
    host = CounterMetricFamily(
        "boundgen_runner_host_seconds",
        "host time of the model's packed forwards by part: pack (chunk, pack, pad a piece), "
        "stage (its inputs towards the device), launch (queue its forward and row gather)",
        labels=["part"],
    )
    host_cpu = CounterMetricFamily(
        "boundgen_runner_host_cpu_seconds",
        "CPU time of the same parts on the thread running them (host seconds minus this: waits, "
        "e.g. for the GIL)",
        labels=["part"],
    )
    pieces = CounterMetricFamily("boundgen_runner_pieces", "packed forward pieces run")
    try:
        stats = runtime.stats()["runner"]
        backend.add_metric([str(stats.get("backend", "eager"))], 1.0)
        for part, seconds in stats.get("host_seconds", {}).items():
            host.add_metric([part], float(seconds))
        for part, seconds in stats.get("host_cpu_seconds", {}).items():
            host_cpu.add_metric([part], float(seconds))
        pieces.add_metric([], float(stats.get("pieces", 0)))
        if "beam_graphs" in stats:
            beam_searches.add_metric([], float(stats["beam_graphs"]["searches"]))
            beam_misses.add_metric([], float(stats["beam_graphs"]["misses"]))
        if "buckets" in stats:
            for name in stats["buckets"]:
                batches.add_metric([name], float(stats["batches"].get(name, 0)))
            misses.add_metric([], float(stats["misses"]))
            real.add_metric([], float(stats["real_tokens"]))
            padded.add_metric([], float(stats["padded_tokens"]))
    except Exception:  # metrics must never fail a scrape
        pass
    yield from (
        backend,
        batches,
        misses,
        real,
        padded,
        beam_searches,
        beam_misses,
        host,
        host_cpu,
        pieces,
    )


class _AdmissionCollector:
    """What admission sees now: the predicted wait for the model and the budget it sheds at."""

    def __init__(self, infer) -> None:
        self.infer = infer

    def collect(self):
        wait = GaugeMetricFamily(
            "boundgen_predicted_wait_seconds",
            "predicted time the model needs for the work admitted and not done yet",
        )
        budget = GaugeMetricFamily(
            "boundgen_queue_budget_seconds",
            "predicted wait beyond which requests are shed (429): max_queue_ms; absent unless set",
        )
        try:
            wait.add_metric([], self.infer.predicted_wait_ms() / 1e3)
            ms = self.infer.queue_budget_ms()
            if ms is not None:
                budget.add_metric([], ms / 1e3)
        except Exception:  # metrics must never fail a scrape
            pass
        yield wait
        yield budget


def _prometheus_buckets(h) -> tuple[list[tuple[str, float]], float]:
    """Re-bucket a runtime `LatencyHistogram` (fine log buckets, µs) onto LATENCY_BUCKETS (s)."""
    fine = h.buckets()  # [(upper bound µs, count)], non-empty only
    total = sum(n for _, n in fine)
    out = []
    for le in LATENCY_BUCKETS:
        out.append((repr(le), float(sum(n for bound, n in fine if bound <= le * 1e6))))
    out.append(("+Inf", float(total)))
    sum_s = h.snapshot()["mean_us"] * total / 1e6
    return out, sum_s


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "boundgen_request_seconds",
            "request latency by endpoint",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "boundgen_requests",
            "requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "boundgen_errors", "errors by endpoint and type", ["endpoint", "type"], registry=r
        )
        self.inflight = Gauge(
            "boundgen_inflight", "admitted requests (waiting + running)", registry=r
        )
        self.batch_tokens = Histogram(
            "boundgen_batch_tokens", "tokens per model call", buckets=TOKEN_BUCKETS, registry=r
        )
        self.items = Counter(
            "boundgen_items",
            "items scored / texts embedded / beams returned",
            ["endpoint"],
            registry=r,
        )
        self.shed = Counter(
            "boundgen_shed",
            "requests refused before any work: 429 at capacity (max_queue), over the queue "
            "budget max_queue_ms (predicted_wait) or late for their deadline behind the queue "
            "(deadline), 504 when their own run is longer than their deadline (not_run)",
            ["reason"],
            registry=r,
        )
        self.compiles_after_ready = Counter(
            "boundgen_compiles_after_ready",
            "compiles (torch.compile) and whole-search graph captures after the server said "
            "ready: each one ran on a request's path; should stay 0 (a WARNING names it)",
            ["kind"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "boundgen_event_loop_lag_seconds",
            "how much later than asked the event loop woke a timer (server/loop_lag.py): the "
            "loop, or the GIL it needs, held that long",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag_max = Gauge(
            "boundgen_event_loop_lag_max_seconds",
            "the largest event-loop lag since the server started (its warm-up included)",
            registry=r,
        )
        # with `--frontends`: the frontend processes' event loops (their probes, all together)
        self.frontend_loop_lag = Histogram(
            "boundgen_frontend_event_loop_lag_seconds",
            "how much later than asked the HTTP frontend processes' event loops woke a timer "
            "(serve --frontends; all frontends together)",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.frontend_loop_lag_max = Gauge(
            "boundgen_frontend_event_loop_lag_max_seconds",
            "the largest event-loop lag of any HTTP frontend process since the server started",
            registry=r,
        )
        r.register(_DeviceMemoryCollector())
        r.register(_ThreadCpuCollector())
        from boundgen.server.heap import GCPauses

        r.register(GCPauses.install())
        try:
            ProcessCollector(registry=r)
        except Exception:
            pass

    def watch_frontends(self, cpu_seconds: Callable[[], dict[int, float]]) -> None:
        """Export `boundgen_frontend_cpu_seconds{frontend}` from `cpu_seconds()` (each frontend
        process's CPU time, as it last reported it)."""
        self.registry.register(_FrontendCpuCollector(cpu_seconds))

    def watch_runtime(self, runtime) -> None:
        self.registry.register(_RuntimeCollector(runtime))

    def watch_admission(self, infer) -> None:
        self.registry.register(_AdmissionCollector(infer))

    def observe_request(
        self, endpoint: str, status: int, seconds: float, error_type: str | None = None
    ) -> None:
        self.request_seconds.labels(endpoint).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()
        if error_type:
            self.errors.labels(endpoint, error_type).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
