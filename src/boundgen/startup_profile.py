"""Where a server's start-up goes, by sampling every thread's Python stack.

`BOUNDGEN_STARTUP_PROFILE=<file>` starts a sampler thread as the command starts (after its
re-exec); when the server says ready (`stop()`), the file gets the functions that were on the
stacks the most, cumulative and innermost, per thread. A sampler needs no ptrace (py-spy and perf
are often not allowed in containers) and costs ~1 % at the default 5 ms.

Time inside C code (a CUDA call, a compile subprocess, an import's file reads) is charged to the
Python frame that called it, which is what one needs to know to move or remove it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

ENV = "BOUNDGEN_STARTUP_PROFILE"
_sampler: _Sampler | None = None


class _Sampler:
    def __init__(self, path: str, interval_s: float) -> None:
        self.path, self.interval_s = path, interval_s
        self.t0 = time.perf_counter()
        self.samples: collections.Counter = collections.Counter()  # (thread, frame) → seconds
        self.leaf: collections.Counter = collections.Counter()
        self.per_thread: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # the counters are read (charged, report) while sampling
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="boundgen-sampler", daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            # a sample stands for the time since the previous one: the sampler needs the GIL, so
            # long C calls that hold it space the samples out
            now = time.perf_counter()
            dt, last = now - last, now
            names = {t.ident: t.name for t in threading.enumerate()}
            with self._lock:
                for ident, frame in sys._current_frames().items():
                    if ident != me:
                        self._charge(names.get(ident, str(ident)), frame, dt)

    def _charge(self, thread: str, frame, dt: float) -> None:
        self.per_thread[thread] += dt
        seen = set()
        leaf = True
        while frame is not None:
            code = frame.f_code
            key = (thread, f"{code.co_filename}:{code.co_firstlineno} {code.co_name}")
            if leaf:
                self.leaf[key] += dt
                leaf = False
            if key not in seen:  # recursion counts once
                seen.add(key)
                self.samples[key] += dt
            frame = frame.f_back

    def charged(self, name: str) -> float:
        """Seconds charged so far to frames whose function text contains `name`."""
        with self._lock:
            return sum(k for (_t, fn), k in self.samples.items() if name in fn)

    def report(self, top: int = 60) -> str:
        lines = [
            f"start-up profile: {time.perf_counter() - self.t0:.2f} s, "
            f"sampled every {self.interval_s * 1000:.0f} ms"
        ]
        for thread, n in self.per_thread.most_common():
            lines.append(f"\n== thread {thread}: {n:.2f} s on stack")
            for title, counter in (("cumulative", self.samples), ("innermost", self.leaf)):
                lines.append(f"   {title:>10} s  function")
                rows = [(fn, k) for (t, fn), k in counter.most_common() if t == thread]
                lines.extend(f"   {k:12.2f}  {_short(fn)}" for fn, k in rows[:top])
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        with open(self.path, "w") as f:
            f.write(self.report())


def _short(fn: str) -> str:
    for marker in ("site-packages/", "dist-packages/", "/src/", "/lib/python"):
        i = fn.find(marker)
        if i >= 0:
            return fn[i + len(marker) :]
    return fn


def start_from_env() -> None:
    """Start sampling when `BOUNDGEN_STARTUP_PROFILE` names a file (once per process)."""
    global _sampler
    path = os.environ.get(ENV)
    if path and _sampler is None:
        _sampler = _Sampler(path, interval_s=0.005)
        _sampler.start()


def stop() -> None:
    """Write the profile (when sampling); later calls do nothing."""
    global _sampler
    if _sampler is not None:
        sampler, _sampler = _sampler, None
        sampler.stop()
