"""Buffer pools: pinned host buffers for packing, device buffers per shape bucket, reused across
requests.

Shapes come from a small set of buckets (DESIGN §1), so after warm-up every `acquire` is served
from a free list and the allocator is never called on the hot path; `allocations` and `reuses`
show it. A request takes buffers through its `RequestContext`, which returns them when the
request ends (after its device work is synchronized), so a buffer is never reused while a copy or
kernel may still read it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

import torch

DEFAULT_BUCKETS: tuple[int, ...] = (
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32768,
    65536,
)


def bucket_for(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket >= n (n itself beyond the largest bucket, rounded up to a multiple of
    it)."""
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return -(-n // top) * top


class BufferPool:
    """Free lists of tensors keyed by (shape, dtype) on one device.

    `acquire` returns a tensor with undefined contents; `release` makes it available again.
    Thread-safe: one short lock around the free-list operation (uncontended it costs ~0.1 µs; the
    allocator costs far more).
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        max_free_per_key: int = 256,
    ):
        self.device = torch.device(device)
        self.pin_memory = (
            bool(pin_memory) and self.device.type == "cpu" and torch.cuda.is_available()
        )
        self.max_free_per_key = max_free_per_key
        self._free: dict[tuple[tuple[int, ...], torch.dtype], deque[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0
        self.releases = 0
        self.bytes_allocated = 0

    def acquire(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        key = (shape, dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reuses += 1
                return free.pop()
            self.allocations += 1
        t = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=self.pin_memory)
        with self._lock:
            self.bytes_allocated += t.numel() * t.element_size()
        return t

    def release(self, t: torch.Tensor) -> None:
        key = (tuple(t.shape), t.dtype)
        with self._lock:
            self.releases += 1
            free = self._free.get(key)
            if free is None:
                free = self._free[key] = deque()
            if len(free) < self.max_free_per_key:
                free.append(t)

    def stats(self) -> dict[str, int]:
        with self._lock:
            free = sum(len(d) for d in self._free.values())
            return {
                "allocations": self.allocations,
                "reuses": self.reuses,
                "releases": self.releases,
                "free": free,
                "bytes_allocated": self.bytes_allocated,
            }

    def warm(self, shapes: Iterable[tuple[Sequence[int], torch.dtype]], copies: int = 1) -> None:
        """Pre-allocate buffers (e.g. every bucket the pipeline can use) before serving."""
        taken = [self.acquire(s, d) for s, d in shapes for _ in range(copies)]
        for t in taken:
            self.release(t)


class MemoryPools:
    """The host pool (pinned when CUDA is present) and the device pool the executor hands to
    requests."""

    def __init__(
        self, device: str | torch.device = "cpu", buckets: Sequence[int] = DEFAULT_BUCKETS
    ):
        self.device = torch.device(device)
        self.buckets = tuple(buckets)
        self.host = BufferPool("cpu", pin_memory=self.device.type == "cuda")
        self.device_pool = (
            BufferPool(self.device) if self.device.type != "cpu" else BufferPool("cpu")
        )

    def bucket(self, n: int) -> int:
        return bucket_for(n, self.buckets)

    def stats(self) -> dict[str, int]:
        h, d = self.host.stats(), self.device_pool.stats()
        out = {f"host_{k}": v for k, v in h.items()}
        out.update({f"device_{k}": v for k, v in d.items()})
        out["allocations"] = h["allocations"] + d["allocations"]
        out["reuses"] = h["reuses"] + d["reuses"]
        return out


class Lease:
    """Buffers taken for one request; `release_all` returns them (called by the executor at
    request end)."""

    __slots__ = ("_taken", "pools")

    def __init__(self, pools: MemoryPools):
        self.pools = pools
        self._taken: list[tuple[BufferPool, torch.Tensor]] = []

    def host(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        t = self.pools.host.acquire(shape, dtype)
        self._taken.append((self.pools.host, t))
        return t

    def device(self, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        t = self.pools.device_pool.acquire(shape, dtype)
        self._taken.append((self.pools.device_pool, t))
        return t

    def stage(self, src: torch.Tensor, bucket: bool = True) -> torch.Tensor:
        """Copy a CPU tensor to the device through a pooled pinned buffer, into a pooled device
        buffer of the bucketed leading size; returns the `[:len(src)]` view on the device (async
        on the current stream)."""
        n = src.shape[0] if src.dim() else 1
        rows = self.pools.bucket(n) if bucket else n
        shape = (rows, *src.shape[1:])
        host = self.host(shape, src.dtype)
        host[:n].copy_(src)
        if self.pools.device.type == "cpu":
            return host[:n]
        dev = self.device(shape, src.dtype)
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]

    @property
    def taken(self) -> int:
        """Buffers this lease holds."""
        return len(self._taken)

    def release_all(self) -> None:
        taken, self._taken = self._taken, []
        for pool, t in taken:
            pool.release(t)
