"""A GPU of known cost inside a CPU server, so a benchmark measures everything around the model.

Imported in the server process before `boundgen serve` (`PRELUDE`), configured by environment:

- `BOUNDGEN_FAKE_SEARCH=FIXED_MS[,PER_PROMPT_MS]`: `ModelRunner.beam_search` costs FIXED +
  PER_PROMPT × prompts and returns the trie's first items (`BOUNDGEN_FAKE_TRIE`, the items'
  sequences as .npy) or fixed tokens; `BOUNDGEN_FAKE_SYNC=1`: the call itself sleeps instead.
  Its batching node runs on a fake device queue as the forward's does (below).
- `BOUNDGEN_FAKE_FORWARD=FIXED_MS[,PER_1K_TOKENS_MS]`: `ModelRunner.forward` (a packed batch → its
  hidden states) costs FIXED + PER_1K × tokens / 1000 and returns zeros; CPU pieces are cut at the
  runner's token budget, as on a GPU (not at `runner.CPU_PIECE_TOKENS`).
  Its batching node runs on a fake device queue (`runtime.device_queue`) whose batches have run
  when the fake stream says so, as CUDA events would say; `BOUNDGEN_FAKE_PACE=0`: the node never
  waits for them (a batch ends when its call returns, as on CUDA before device queues).
  The executor runs its CUDA path with fake streams and events (an event has completed when the
  fake stream's work queued before it has): CPU nodes after device nodes wait as on a GPU.
- `BOUNDGEN_FAKE_LOG=FILE`: one line per fake call, `start end cost tokens_or_prompts` (seconds on
  the process's perf_counter), for the fake GPU's busy share and its batch sizes.

Like GPU work, a fake call returns at once with results that are not ready: calls queue one after
the other (one stream), ops on a result give results ready at the same time (as kernels queued
behind it would), and reading one on the host (`.cpu()`, `.tolist()`, `.numpy()`, `float()`, ...)
waits until it is ready.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

PRELUDE = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
    "import fake_gpu; fake_gpu.install_from_env()"
)

_HOST_READS = {
    "cpu", "to", "tolist", "item", "numpy", "__float__", "__int__", "__bool__", "__index__",
    "__repr__", "__format__", "__array__",
}  # fmt: skip


class Pending(torch.Tensor):
    """A result "on the GPU", ready at `_ready` (perf_counter seconds)."""

    _ready: float

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        flat = list(args) + list((kwargs or {}).values())
        ready = max((a._ready for a in flat if isinstance(a, Pending)), default=0.0)
        if name in _HOST_READS:
            wait_until(ready)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if name in _HOST_READS or name == "__get__":
            return out
        if isinstance(out, torch.Tensor):
            return pending(out, ready)
        if isinstance(out, (tuple, list)):  # split, chunk, unbind, ...
            return type(out)(pending(t, ready) if isinstance(t, torch.Tensor) else t for t in out)
        return out


# The last stretch of a wait is spun, not slept: a sleep ends ~50–100 µs late on Linux (its timer
# slack), and a request waits for the fake device two or three times (the finish node for its
# head's event, the head's read), so W3 through `Engine.score` with a 0.9 ms fake forward read
# 309 µs from the device's end to the answer with sleeps, 62 µs spinning the last 150 µs (2-core
# dev CPU, forty-fifth session: BENCHMARKS.md). A CUDA wait spins too (`cuda_waits`: CUDA's
# default).
SPIN_S = 150e-6


def wait_until(t: float) -> None:
    """Block until `time.perf_counter()` reaches `t`: asleep until `SPIN_S` before it, then
    yielding the GIL in a loop (`sleep(0)`) as a spinning CUDA wait would hold its core."""
    left = t - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < t:
        time.sleep(0)


class Stream:
    """One queue of fake work: a call starts when the one queued before it ends."""

    def __init__(self, log_path: str | None) -> None:
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115

    def queue(self, cost_s: float, size: int) -> float:
        """Time at which a call of `cost_s` queued now ends."""
        with self.lock:
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + cost_s
            if self.log is not None:
                self.log.write(f"{start:.6f} {self.free_at:.6f} {cost_s:.6f} {size}\n")
            return self.free_at


def pending(t: torch.Tensor, ready: float) -> Pending:
    out = t.as_subclass(Pending)
    out._ready = ready
    return out


class Event:
    """A CUDA event of the fake stream: recorded, it completes when the work queued so far has."""

    def __init__(self, stream: Stream, ready: float = 0.0) -> None:
        self.stream, self.ready = stream, ready

    def record(self, _stream=None) -> None:
        self.ready = self.stream.free_at

    def query(self) -> bool:
        return time.perf_counter() >= self.ready

    def synchronize(self) -> None:
        wait_until(self.ready)


class _NoStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


class _Flight:
    def __init__(self, stream: Stream, begin: float, end: float) -> None:
        self.begin, self.end = begin, end
        self.event = Event(stream, end)

    def wait(self) -> None:
        wait_until(self.end)

    def device_ns(self) -> float:
        return (self.end - self.begin) * 1e9


class Queue:
    """A `runtime.device_queue.DeviceQueue` on the fake stream."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def launch(self, fn):
        begin = max(time.perf_counter(), self.stream.free_at)
        out = fn()
        return out, _Flight(self.stream, begin, max(begin, self.stream.free_at))


def _costs(spec: str) -> tuple[float, float]:
    fixed, _, per = spec.partition(",")
    return float(fixed) / 1e3, float(per or 0) / 1e3


def install_search(stream: Stream, spec: str, sync: bool, trie_path: str | None) -> None:
    import boundgen.runner as runner

    fixed, per_prompt = _costs(spec)
    items = torch.as_tensor(np.load(trie_path)[:64]) if trie_path else None

    def fake(self, prompts, width, steps, trie=None, banned=()):
        b = len(prompts)
        cost = fixed + per_prompt * b
        if trie is not None and items is not None:
            rows = items[:width, :steps]
        else:
            rows = torch.arange(width * steps).view(width, steps) + 10
        tokens = rows.unsqueeze(0).expand(b, width, steps).clone()
        first = torch.tensor([float(p[0]) for p in prompts]).unsqueeze(1)
        scores = -torch.arange(width, dtype=torch.float32).unsqueeze(0) - first * 1e-3
        if sync:
            wait_until(time.perf_counter() + cost)
            return tokens, scores
        ready = stream.queue(cost, b)
        return pending(tokens, ready), pending(scores, ready)

    runner.ModelRunner.beam_search = fake


def install_forward(stream: Stream, spec: str, paced: bool) -> None:
    import boundgen.runner as runner
    from boundgen.runtime import batching

    if not paced:  # never wait for queued batches: a batch ends when its call returns
        init = batching.BatchingNode.__init__

        def unpaced(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.device_depth = 1 << 30

        batching.BatchingNode.__init__ = unpaced

    fixed, per_1k = _costs(spec)
    runner.CPU_PIECE_TOKENS = 1 << 30  # pieces at the runner's budget, as on a GPU

    def fake(self, batch):
        t = batch.num_tokens
        ready = stream.queue(fixed + per_1k * t / 1000, t)
        hidden = torch.zeros(t, self.config.hidden_size, dtype=self.dtype, device=self.device)
        return pending(hidden, ready)

    runner.ModelRunner.forward = fake


def install_device(stream: Stream) -> None:
    """Batching nodes queue their work on the fake stream (`Queue`), and executors take their
    CUDA path: device nodes record fake events, CPU successors wait."""
    import contextlib
    import types

    from boundgen.runtime import device_queue
    from boundgen.runtime import executor as ex

    device_queue.set_queue_factory(lambda executor, streams: Queue(stream))

    cuda = types.SimpleNamespace(
        Event=lambda *a, **kw: Event(stream),
        stream=lambda s: contextlib.nullcontext(),
        default_stream=lambda device=None: _NoStream(),
    )
    init = ex.Executor.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cuda, self._torch = True, types.SimpleNamespace(cuda=cuda)
        self.streams = [_NoStream() for _ in range(4)]

    ex.Executor.__init__ = patched


def install_from_env() -> None:
    stream = Stream(os.environ.get("BOUNDGEN_FAKE_LOG"))
    if os.environ.get("BOUNDGEN_FAKE_SEARCH") or os.environ.get("BOUNDGEN_FAKE_FORWARD"):
        install_device(stream)  # once, for the search and the forward alike
    if os.environ.get("BOUNDGEN_FAKE_SEARCH"):
        install_search(
            stream,
            os.environ["BOUNDGEN_FAKE_SEARCH"],
            os.environ.get("BOUNDGEN_FAKE_SYNC") == "1",
            os.environ.get("BOUNDGEN_FAKE_TRIE"),
        )
    if os.environ.get("BOUNDGEN_FAKE_FORWARD"):
        paced = os.environ.get("BOUNDGEN_FAKE_PACE", "1") == "1"
        install_forward(stream, os.environ["BOUNDGEN_FAKE_FORWARD"], paced)


def busy(log_path: str | Path, t0: float, t1: float) -> dict:
    """The fake GPU between `time.perf_counter()` t0 and t1: busy share, calls, mean size (tokens
    or prompts). perf_counter is CLOCK_MONOTONIC on Linux, one clock for the benchmark and the
    server process that wrote the log."""
    rows = [tuple(map(float, ln.split())) for ln in Path(log_path).read_text().splitlines() if ln]
    if not rows:
        return {"calls": 0}
    inside = [r for r in rows if r[0] >= t0 and r[1] <= t1]
    span = t1 - t0
    return {
        "calls": len(inside),
        "busy_share": sum(r[2] for r in inside) / span if span > 0 else 0.0,
        "mean_size": sum(r[3] for r in inside) / len(inside) if inside else 0.0,
    }
