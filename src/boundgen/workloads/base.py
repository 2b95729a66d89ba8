"""What every workload's pipeline is built from: a `WorkloadContext` (never the `Engine`), node
helpers, and the `Workload` record a workload module registers itself with (`WORKLOAD = ...`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from boundgen.runner import ModelRunner
from boundgen.runtime.batching import BatchingNode
from boundgen.runtime.dag import Pipeline
from boundgen.runtime.node import Node, NodeKind
from boundgen.text.tokenizer import Tokenizer
from boundgen.workloads.forward import Forward
from boundgen.workloads.inputs import Limits
from boundgen.workloads.traffic import TrafficLog


@dataclass(frozen=True)
class BeamBounds:
    max_width: int
    max_steps: int


class WorkloadContext:
    """The runner, tokenizer and input limits a pipeline works with, the model's task and EOS
    ids, the cross-request batching knobs (`token_budget` tokens per merged batch,
    `max_wait_ms` a forming batch may wait, `max_batch_requests`, `latency_target_ms` that adapts
    the token budget to the measured batch cost, `device_depth` batches queued on the device,
    `merge_policy`: how the forward node splits waiting requests into forwards — `BatchingNode`'s;
    the beam node always merges all, its fixed cost dominating; `late_merge`: whether the forward
    node forms its next batch late — the beam node always does), and where the model
    nodes log the shapes of their forwards (`traffic`, None: nowhere)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        limits: Limits,
        *,
        beam_bounds: BeamBounds,
        eos_token_ids: tuple[int, ...] = (),
        token_budget: int | None = None,
        max_wait_ms: float = 0.0,
        max_batch_requests: int | None = None,
        traffic: TrafficLog | None = None,
        latency_target_ms: float | None = None,
        device_depth: int = 2,
        merge_policy: str = "tail",
        late_merge: bool = False,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.limits = limits
        self.beam_bounds = beam_bounds
        self.eos_token_ids = tuple(eos_token_ids)
        self.token_budget = token_budget or runner.max_batch_tokens
        self.max_wait_ms = max_wait_ms
        self.max_batch_requests = max_batch_requests
        self.traffic = traffic
        self.latency_target_ms = latency_target_ms
        self.device_depth = device_depth
        self.merge_policy = merge_policy
        self.late_merge = late_merge

    @property
    def task(self) -> str:
        return self.runner.config.task

    def need_task(self, task: str, what: str) -> None:
        if self.task != task:
            kind = "a *ForCausalLM" if task == "causal_lm" else "a *ForSequenceClassification"
            cfg = self.runner.config
            raise ValueError(f"{what} needs {kind} checkpoint; this model is {cfg.architecture}")

    @functools.cached_property
    def forward(self) -> BatchingNode:
        """The one model node score, classify and embed share: concurrent requests of any of them
        are packed into one forward within the token budget."""
        return self.batching(
            "forward",
            Forward(self.runner, self.traffic),
            inputs={"groups": list, "pooling": str},
            outputs={"rows": torch.Tensor},
            merge_policy=self.merge_policy,
            late_merge=self.late_merge,
        )

    def batching(
        self,
        name: str,
        fn: Any,
        inputs: dict,
        outputs: dict,
        raises: tuple = (),
        merge_policy: str = "all",
        late_merge: bool | None = None,
    ) -> BatchingNode:
        """A batching node with this context's knobs; `fn` has `merge`, `split` and `size`, and
        may have `shapes`, `lane`, `count`, `lane_max`, `finish`, `late_merge` and
        `batch_streams` (`BatchingNode`); `raises` pass through as themselves; `merge_policy`
        and `late_merge` (None: `fn`'s): `BatchingNode`'s."""
        return BatchingNode(
            name,
            fn,
            inputs=inputs,
            outputs=outputs,
            merge=fn.merge,
            split=fn.split,
            size=fn.size,
            shapes=getattr(fn, "shapes", None),
            lane=getattr(fn, "lane", None),
            count=getattr(fn, "count", None),
            lane_max=getattr(fn, "lane_max", None),
            finish=getattr(fn, "finish", None),
            late_merge=getattr(fn, "late_merge", False) if late_merge is None else late_merge,
            token_budget=self.token_budget,
            max_wait_ms=self.max_wait_ms,
            max_batch=self.max_batch_requests,
            latency_target_ms=self.latency_target_ms,
            device_depth=self.device_depth,
            merge_policy=merge_policy,
            batch_streams=getattr(fn, "batch_streams", 1),
            raises=raises,
        )


@dataclass(frozen=True)
class Workload:
    """A workload as the registry knows it: its kind, its request dataclass, its pipeline
    builder."""

    kind: str
    request: type
    build: Callable[[WorkloadContext], Pipeline]


def cpu_node(name: str, fn: Callable, inputs: dict, outputs: dict, raises: tuple = ()) -> Node:
    """A CPU node; `raises` pass through as themselves (e.g. ValueError → the server's 4xx)."""
    return Node(name, fn, inputs=inputs, outputs=outputs, kind=NodeKind.CPU, raises=raises)


def device_node(name: str, fn: Callable, inputs: dict, outputs: dict) -> Node:
    """A device node, run under inference mode."""

    @functools.wraps(fn)
    def run(**kw: Any) -> Any:
        with torch.inference_mode():
            return fn(**kw)

    return Node(name, run, inputs=inputs, outputs=outputs, kind=NodeKind.DEVICE)
