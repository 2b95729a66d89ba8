"""How a host thread waits for the GPU: spinning on its core (CUDA's default here) or asleep.

CUDA's default scheduling for one process on a host with more cores than contexts is to spin: a
thread waiting for the GPU in an event's or a stream's `synchronize()` busy-loops on its core until
the GPU is done (a copy from pageable memory waits without spinning: measured). An event spins
whatever the context says unless it was made with `blocking=True`. A server waits on several
threads at once, each for up to a merged batch's GPU time: the device-waits thread, the CPU
workers waiting on events, the beam finisher. Those spinning threads hold no GIL, but they hold
cores, and the event loop and the Python threads have to be scheduled beside them. On some
machines `/v1/beam`'s event loop woke up more than 10 ms late in up to half of its wake-ups under
load, on others never (BENCHMARKS.md, thirty-first session).

`BOUNDGEN_CUDA_WAIT=block` makes the waits sleep instead: the device's primary context is set to
blocking sync (`apply`, by the runner of a CUDA device) and the events the engine makes block
(`event`; the executor's own events likewise). On an H100 host a 20 ms GPU wait cost its thread
7.8 ms of CPU spinning and 0.05–0.08 ms asleep, which went on ~0.1 ms later (a single request's
latency pays that); `/v1/beam` on the late-loop machine was the same either way — the spinning
threads were not what held its loop — so `spin` (CUDA's behaviour) stays the default, but for
`boundgen serve --frontends N`, whose engine process sets `block` as its default (`set_default`):
with four frontends on an H100, W5 at ~230 req/s had a p99 of 27.9, 31.7 and 32.5 ms asleep
against 31.6, 42.4 and 45.0 spinning (three alternated pairs) and 1.8–1.9 against 10.1–12.2 ms of
the engine's CPU a request (BENCHMARKS.md, thirty-second and thirty-third sessions). The variable
still decides when set.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from boundgen.settings import env_choice

log = logging.getLogger("boundgen.runtime")

POLICIES = ("spin", "block")
# the driver's scheduling flags (cuda.h): the three low bits of a context's flags
_SCHED_MASK = 0x07
_SCHED_BLOCKING_SYNC = 0x04


_default = "spin"  # this process's policy while BOUNDGEN_CUDA_WAIT is unset (`set_default`)


def set_default(wait: str) -> None:
    """This process's policy while `BOUNDGEN_CUDA_WAIT` is unset; before the engine loads (the
    runner applies the policy to the device's context, the executor reads it for its events)."""
    global _default
    if wait not in POLICIES:
        raise ValueError(f"unknown CUDA wait policy {wait!r}; use one of {', '.join(POLICIES)}")
    _default = wait


def policy() -> str:
    """This process's wait policy (`BOUNDGEN_CUDA_WAIT`; when unset `spin`, or `set_default`'s)."""
    given = os.environ.get("BOUNDGEN_CUDA_WAIT", _default)
    return env_choice("BOUNDGEN_CUDA_WAIT", given, POLICIES)


def event(**kwargs) -> torch.cuda.Event:
    """A CUDA event whose `synchronize()` follows the policy (`torch.cuda.Event` arguments)."""
    return torch.cuda.Event(blocking=policy() == "block", **kwargs)


def synchronize(event: torch.cuda.Event) -> None:
    """Wait until `event`'s work has run. `query` first: it keeps the GIL, where `synchronize`
    gives it up and, beside a busy thread (the event loop), may wait up to the switch interval to
    take it back — for work that has often run already (a batch's flight, a search's copies)."""
    if not event.query():
        event.synchronize()


_applied: set[int] = set()


def apply(device: torch.device | str) -> int | None:
    """Set the primary context of `device` (a CUDA device) to blocking sync when the policy is
    `block`, once per device. → the context's flags after (None: nothing set). The driver takes
    new scheduling flags on an active primary context too (CUDA 11 and later)."""
    device = torch.device(device)
    if device.type != "cuda" or policy() != "block":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _applied:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise RuntimeError(
            f"BOUNDGEN_CUDA_WAIT=block: the CUDA driver did not load ({exc})"
        ) from exc
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    _check(lib.cuInit(0), "cuInit")
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)), "state")
    wanted = (flags.value & ~_SCHED_MASK) | _SCHED_BLOCKING_SYNC
    _check(lib.cuDevicePrimaryCtxSetFlags_v2(dev, wanted), "cuDevicePrimaryCtxSetFlags_v2")
    _check(lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)), "state")
    if flags.value & _SCHED_MASK != _SCHED_BLOCKING_SYNC:
        raise RuntimeError(
            f"BOUNDGEN_CUDA_WAIT=block: cuda:{index}'s context kept flags {flags.value:#x}"
        )
    _applied.add(index)
    log.info("CUDA waits on cuda:%d block (context flags %#x)", index, flags.value)
    return flags.value


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"BOUNDGEN_CUDA_WAIT=block: {call} failed with CUresult {status}")
