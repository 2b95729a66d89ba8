"""Where a batching node's device work goes, and when it has run.

A CUDA forward returns as soon as its kernels (or its graph replay) are queued: the host is done
long before the device. A batching node that took "the batch ran" to mean "the call returned"
formed its next batch at once, so requests never merged by the device's time — on the H200, W5
(`/v1/score`) ran one request per forward at 4 connections and saturated at ~155 req/s — and its
cost model learned launch times, not run times. A `DeviceQueue` runs a batch's function on the
node's stream between two timing events (a `Flight`), so the node can wait until a batch has run
on the device before it forms the batch after next (`BatchingNode(device_depth=...)`), and learn
what a batch costs the device.

`queue_for(executor)` picks the queue of an executor: a `CudaQueue` on CUDA, none on CPU (a CPU
forward has run when it returns). A test or a CPU benchmark with a simulated device installs its
own (`set_queue_factory`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from boundgen import cuda_waits


class Flight(Protocol):
    """One batch's device work, queued."""

    event: Any  # what the executor waits on before a CPU node reads the batch's outputs

    def wait(self) -> None:
        """Block until the work has run on the device."""

    def device_ns(self) -> float:
        """How long the device ran it (valid after `wait`)."""


class DeviceQueue(Protocol):
    def launch(self, fn: Callable[[], Any]) -> tuple[Any, Flight]:
        """Run `fn` (which queues device work) on this queue: (its result, the work's flight)."""


class _CudaFlight:
    __slots__ = ("end", "event", "start")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end
        self.event = end

    def wait(self) -> None:
        cuda_waits.synchronize(self.end)

    def device_ns(self) -> float:
        return self.start.elapsed_time(self.end) * 1e6


class CudaQueue:
    """CUDA streams of its own (one batching node's), each launch ordered after the default
    stream's work (the inputs CPU nodes staged). With `streams` > 1 the launches take the streams
    in turn, so a batch launched while the one before it runs starts beside it: for work that
    is safe to run twice at once (the beam node's searches, `compile.search_streams`)."""

    def __init__(self, device: torch.device, streams: int = 1) -> None:
        self.device = device
        self.streams = [torch.cuda.Stream(device=device) for _ in range(max(1, streams))]
        self._turn = itertools.count()  # next() is atomic: launches from several lanes

    def launch(self, fn: Callable[[], Any]) -> tuple[Any, Flight]:
        stream = self.streams[next(self._turn) % len(self.streams)]
        stream.wait_stream(torch.cuda.default_stream(self.device))
        start = cuda_waits.event(enable_timing=True)
        end = cuda_waits.event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            out = fn()
        end.record(stream)
        return out, _CudaFlight(start, end)


def _default_factory(executor: Any, streams: int = 1) -> DeviceQueue | None:
    return CudaQueue(executor.device, streams) if executor.cuda else None


_factory: Callable[[Any, int], DeviceQueue | None] = _default_factory


def queue_for(executor: Any, streams: int = 1) -> DeviceQueue | None:
    """The device queue of a DEVICE batching node under `executor` (None: the work runs in the
    call); `streams`: how many of its batches may run at once."""
    return _factory(executor, streams)


def set_queue_factory(factory: Callable[[Any, int], DeviceQueue | None] | None) -> None:
    """Make `queue_for` use `factory(executor, streams)` (None: back to CUDA streams on CUDA
    executors). For tests and benchmarks that simulate a device (one simulated stream may ignore
    `streams`); affects nodes whose queue is made afterwards."""
    global _factory
    _factory = factory or _default_factory
