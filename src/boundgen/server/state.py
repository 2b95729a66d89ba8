"""The state of the process that holds the engine: `ServerState`, the `HandlerState`
(`handler_state.py`) that runs the warm-up before readiness and serves `Infer` over the engine's
runtime; the tries it loads; KServe's statistics (`InferenceStats`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from boundgen import startup_profile
from boundgen.compile.cache import default_cache_dir
from boundgen.compile.events import COMPILES, watch_dynamo
from boundgen.engine import Engine
from boundgen.server.config import ServerConfig
from boundgen.server.handler_state import EngineFacts, HandlerState
from boundgen.server.infer import Infer
from boundgen.server.metrics import Metrics
from boundgen.workloads.beam import item_index
from boundgen.workloads.trie import Trie

log = logging.getLogger("boundgen.server")


class ServerState(HandlerState):
    """The state of the process that holds `engine`: its runtime behind `Infer`, the metrics'
    one registry, the warm-up before readiness."""

    def __init__(self, engine: Engine, config: ServerConfig, tries: dict[str, Trie] | None = None):
        self.engine = engine
        tries = dict(tries) if tries is not None else load_tries(config, engine.device)
        for trie in tries.values():  # the item-id lookup of /v1/beam, made once now
            item_index(trie)
        metrics = Metrics()
        runtime = engine.runtime
        metrics.watch_runtime(runtime)
        infer = Infer(
            runtime,
            metrics=metrics,
            max_queue=config.max_queue,
            retry_after_s=config.retry_after_s,
            max_queue_ms=config.max_queue_ms,
        )
        metrics.watch_admission(infer)
        facts = EngineFacts.of(engine, config, tries)
        super().__init__(facts, config, engine.tokenizer, tries, infer, metrics, InferenceStats())
        self.ready, self.unready, self.draining = True, "", False
        self.warmup = self._warmup_requests()  # checked now: a bad profile stops the start
        # run once the warm-up has succeeded, before readiness (the serving process freezes the
        # heap the warm-up grew: compiled graphs, dynamo's caches)
        self.after_warm_up: list[Callable[[], Any]] = []
        self._warming: threading.Thread | None = None  # the warm-up's thread, while it runs
        self._stop_warming = threading.Event()  # set at shutdown: no further warm-up request
        watch_dynamo()
        self.stop_watching_compiles = COMPILES.listen(self._compiled)

    def _compiled(self, kind: str, detail: str) -> None:
        """A compile or graph capture anywhere in the process: after readiness it ran on a
        request's path (a shape the warm-up did not cover)."""
        if not self.ready or self.draining:
            return
        self.metrics.compiles_after_ready.labels(kind).inc()
        log.warning(
            "%s after the server said ready (%s): a request paid for it; add its shape to the "
            "warm-up profile (--warmup FILE)",
            kind,
            detail,
        )

    def close(self) -> None:
        """Stop listening to the process's compiles (the app is shutting down)."""
        self.stop_watching_compiles()

    def _warmup_requests(self) -> list:
        from boundgen import warmup

        spec = self.config.warmup
        if spec == "off":
            return []
        if spec == "default":
            profile = warmup.default_profile(self.engine, self.tries)
        else:
            profile = warmup.load_profile(spec)
        return warmup.requests(self.engine, profile, self.tries)

    def start_warm_up(self) -> None:
        """At start-up (the app's lifespan): not ready until the warm-up requests have run on a
        worker thread; the event loop serves meanwhile (liveness, metrics, 503 on readiness)."""
        if not self.warmup:
            startup_profile.stop()
            return
        self.ready, self.unready = False, "warming up"
        self._warming = threading.Thread(target=self.warm_up, name="boundgen-warmup", daemon=True)
        self._warming.start()

    def stop_warm_up(self, timeout_s: float = 60.0) -> None:
        """At shutdown: no further warm-up request, and wait for the one running (a process that
        exits while the warm-up thread is inside torch aborts: "terminate called without an
        active exception", exit status 134)."""
        self._stop_warming.set()
        thread = self._warming
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("the warm-up did not stop within %.0f s of shutdown", timeout_s)

    def warm_up(self) -> None:
        """Run the warm-up requests (a worker thread at start-up), then say ready; a failing
        request keeps the server not ready, its error in /health's message."""
        from boundgen import warmup

        self.ready, self.unready = False, "warming up"
        t0 = time.perf_counter()
        done = []

        def progress(row: dict) -> None:
            done.append(row)
            self.unready = f"warming up ({len(done)}/{len(self.warmup)} requests done)"

        try:
            ec = self.engine.engine_config
            warmup.run(
                self.warmup,
                progress,
                cache_root=ec.compile_cache or default_cache_dir(),
                stop=self._stop_warming.is_set,
            )
            self.engine.runner.seal()  # nothing is compiled or captured on a request's path
            for hook in self.after_warm_up:
                hook()
        except Exception as exc:
            if isinstance(exc, warmup.Stopped):
                log.info("%s: the server is shutting down", exc)
                self.unready = "shutting down"
            else:
                log.exception("warm-up failed; the server stays not ready")
                self.unready = f"warm-up failed: {type(exc).__name__}: {exc}"
            for hook in self.after_warm_up:  # what start-up paused resumes all the same
                with contextlib.suppress(Exception):
                    hook()
            startup_profile.stop()
            return
        slowest = max(done, key=lambda r: r["seconds"])
        log.info(
            "warm-up: %d requests in %.2f s (slowest: %s, %.2f s); ready",
            len(done),
            time.perf_counter() - t0,
            slowest["what"],
            slowest["seconds"],
        )
        self.unready = ""
        self.ready = True
        startup_profile.stop()


def load_tries(config: ServerConfig, device: Any = "cpu") -> dict[str, Trie]:
    """The config's tries, on the engine's device (a beam request never copies a trie)."""
    return {
        name: Trie.from_file(path, device=device, softmax=config.trie_softmax)
        for name, path in config.trie_paths().items()
    }


_PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass
class InferenceStats:
    """Triton's statistics of the one model (`/v2/models/{m}/stats`): per phase a count and the
    nanoseconds spent in it. `success`/`fail`: whole requests; `queue`: waits inside the runtime
    (a node waiting for a worker or for its batch); `compute_infer`: the rest of the runtime;
    `compute_input`/`compute_output`: the handler before and after it (parse, tokenize; encode the
    reply)."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    phases: dict[str, list[int]] = field(default_factory=lambda: {p: [0, 0] for p in _PHASES})
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, ok: bool, total_ns: int, **phase_ns: int) -> None:
        """One request: whether it succeeded, its whole time, and `queue`, `compute_input`,
        `compute_infer`, `compute_output` nanoseconds (a successful one)."""
        with self._lock:
            self._add("success" if ok else "fail", total_ns)
            if ok:
                self.inference_count += 1
                self.execution_count += 1
                self.last_inference_ms = int(time.time() * 1000)
                for name, ns in phase_ns.items():
                    self._add(name, ns)

    def _add(self, phase: str, ns: int) -> None:
        entry = self.phases[phase]
        entry[0] += 1
        entry[1] += max(0, int(ns))

    def as_triton(self, name: str) -> dict[str, Any]:
        with self._lock:
            return {
                "name": name,
                "version": "1",
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    p: {"count": c, "ns": ns} for p, (c, ns) in self.phases.items()
                },
                "batch_stats": [],
            }
