"""`EngineRuntime`: one executor serving every registered workload's pipeline (and user pipelines).

    rt = EngineRuntime(context)          # context: a WorkloadContext (Engine.workload_context())
    rt.run("score", ScoreRequest(query, items, [yes, no]), timeout_ms=20)
    fut = rt.submit("embed", {"texts": texts}, timeout_ms=20)

`submit(kind, request, timeout_ms) -> Future` and `run(...)` take the workload's request
dataclass or a dict of its fields; extra keyword arguments are further pipeline inputs (`head=`
for embed, or inputs of user nodes). Input validation errors raise `ValueError` unchanged; other
node failures raise `NodeError`, deadlines `DeadlineExceeded`.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from typing import Any

from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.executor import Executor
from boundgen.workloads.base import WorkloadContext
from boundgen.workloads.registry import build_pipelines, workloads


class EngineRuntime:
    def __init__(
        self,
        context: WorkloadContext,
        executor: Executor | None = None,
        cpu_workers: int | None = None,
        device_streams: int = 4,
        default_timeout_ms: float | None = None,
        trace_requests: int = 0,
    ) -> None:
        self.context = context
        self._own_executor = executor is None
        self.executor = executor or Executor(
            cpu_workers=cpu_workers,
            device_streams=device_streams,
            device=str(context.runner.device),
            pools=context.runner.pools,
            default_timeout_ms=default_timeout_ms,
            trace_requests=trace_requests,
        )
        self.pipelines: dict[str, Pipeline] = build_pipelines(context)
        self._lock = threading.Lock()

    def register(self, kind: str, pipeline: Pipeline, replace: bool = False) -> None:
        """Serve `pipeline` under `kind` (e.g. `rt.pipelines["score"].extend(top_n)` as "rerank").
        Its first input must be `request`."""
        if "request" not in pipeline.inputs:
            raise ValueError(
                f"pipeline {pipeline.name!r} has no 'request' input "
                f"(inputs: {', '.join(pipeline.inputs)})"
            )
        with self._lock:
            if kind in self.pipelines and not replace:
                raise ValueError(f"a pipeline is already registered as {kind!r}; pass replace=True")
            self.pipelines = {**self.pipelines, kind: pipeline}

    def _inputs(
        self, kind: str, request: Any, extra: dict[str, Any]
    ) -> tuple[Pipeline, dict[str, Any]]:
        try:
            pipe = self.pipelines[kind]
        except KeyError:
            known = ", ".join(sorted(self.pipelines))
            raise ValueError(f"unknown pipeline {kind!r}; known: {known}") from None
        if isinstance(request, dict):
            rtype = pipe.inputs.get("request")
            if not isinstance(rtype, type) or not dataclasses.is_dataclass(rtype):
                raise ValueError(f"pipeline {kind!r} needs a request object, not a dict")
            fields = {f.name for f in dataclasses.fields(rtype)}
            # keys that are pipeline inputs rather than request fields (embed's `head`) go there
            extra = {
                **{k: v for k, v in request.items() if k not in fields and k in pipe.inputs},
                **extra,
            }
            try:
                request = rtype(
                    **{k: v for k, v in request.items() if k in fields or k not in pipe.inputs}
                )
            except TypeError as exc:
                raise ValueError(f"bad {kind} request: {exc}") from None
        return pipe, {"request": request, **extra}

    def request_type(self, kind: str) -> type:
        return workloads()[kind].request

    def submit(
        self, kind: str, request: Any, timeout_ms: float | None = None, **inputs: Any
    ) -> Future:
        pipe, values = self._inputs(kind, request, inputs)
        return self.executor.submit(pipe, values, timeout_ms, unwrap=len(pipe.outputs) == 1)

    def run(self, kind: str, request: Any, timeout_ms: float | None = None, **inputs: Any) -> Any:
        pipe, values = self._inputs(kind, request, inputs)
        return self.executor.run(pipe, values, timeout_ms, unwrap=len(pipe.outputs) == 1)

    def stats(self) -> dict[str, Any]:
        out = self.executor.stats()
        out["batching"] = {
            p.node.name: p.node.stats()
            for pipe in self.pipelines.values()
            for p in pipe.plan
            if isinstance(p.node, BatchingNode)
        }
        out["runner"] = self.context.runner.stats()
        return out

    def export_trace(self, path: str) -> str:
        return self.executor.tracer.export_chrome(path)

    def close(self) -> None:
        for pipe in self.pipelines.values():
            for p in pipe.plan:
                if isinstance(p.node, BatchingNode):
                    p.node.close()
        if self._own_executor:
            self.executor.close()

    def __enter__(self) -> EngineRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
