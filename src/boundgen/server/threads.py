"""CPU time per Python thread of this process, for `boundgen_thread_cpu_seconds{thread}`.

A server runs Python on several threads (the event loop, the pipeline nodes, the tokenizer) and
they share one GIL: while one runs Python, the others wait. When the server is bound by that, the
sum of its Python threads' CPU time approaches one core, and the per-thread split says whose work
to cut. On the H200 the forward node's host parts took 20-26 ms per merged W5 forward at
saturation, several times their CPU work on an idle machine (BENCHMARKS.md, 2026-12-02 sixth
session): this is what tells which threads held the GIL meanwhile. Native threads (CUDA's,
torch's pools) are summed as `other`.

Linux only (`/proc/self/task/<tid>/stat`); elsewhere the reading is empty.
"""

from __future__ import annotations

import os
import threading

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _task_cpu_seconds(tid: int | str) -> float | None:
    """utime + stime of one thread of this process, in seconds (None: no such thread)."""
    try:
        with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    # fields after the command name (which may hold spaces and parentheses): state is field 3,
    # utime 14 and stime 15
    rest = data[data.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _TICKS


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far per Python thread name (threads of one name summed), and `other` for
    the process's threads that are not Python's; {} where /proc is missing."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    out: dict[str, float] = {}
    python_tids = set()
    for t in threading.enumerate():
        tid = t.native_id
        seconds = _task_cpu_seconds(tid) if tid is not None else None
        if seconds is None:
            continue
        python_tids.add(str(tid))
        out[t.name] = out.get(t.name, 0.0) + seconds
    other = 0.0
    for tid in os.listdir("/proc/self/task"):
        if tid not in python_tids:
            other += _task_cpu_seconds(tid) or 0.0
    out["other"] = other
    return out
