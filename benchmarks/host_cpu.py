"""The host's CPU accounting over a run (Linux `/proc/stat`): how busy the server's cores were and
how much of their time the hypervisor took (steal).

The device machines differ in their hosts: with the same code the `/v1/beam` server's event loop
took 0.20 ms of CPU a request on one H100 machine and 0.50 on another, and woke late only there
(BENCHMARKS.md, thirty-first session). Steal over the run says whether a virtual machine's cores
were taken away from it; busy says how full the server's cores were.
"""

from __future__ import annotations

from pathlib import Path

# /proc/stat's columns after the cpu name, in jiffies (proc(5))
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def read(path: str | Path = "/proc/stat") -> dict[int, tuple[int, ...]]:
    """Per CPU, its cumulative jiffies in `_FIELDS` order; {} where there is no /proc/stat."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, *cols = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(c) for c in cols[: len(_FIELDS)]]
            out[int(name[3:])] = tuple(values + [0] * (len(_FIELDS) - len(values)))
    return out


def cpu_list(spec: str | None) -> set[int]:
    """`0,2-3` → {0, 2, 3} (taskset's list format); empty for none given."""
    cpus: set[int] = set()
    for part in (spec or "").split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def usage(before: dict, after: dict, exclude: set[int] = frozenset()) -> dict[str, float]:
    """Over the CPUs but `exclude` (the load generator's) between two `read`s: the share of their
    time busy (not idle, not iowait, not stolen) and stolen by the hypervisor; {} with nothing to
    compare."""
    total = busy = steal = 0
    for cpu, now in after.items():
        if cpu in exclude or cpu not in before:
            continue
        d = dict(zip(_FIELDS, (a - b for a, b in zip(now, before[cpu]))))
        span = sum(d.values())
        total += span
        steal += d["steal"]
        busy += span - d["idle"] - d["iowait"] - d["steal"]
    if total <= 0:
        return {}
    return {"busy": busy / total, "steal": steal / total}


def line(row: dict) -> str:
    """A run's `host_cpu` as one indented line; "" without it."""
    u = row.get("host_cpu") or {}
    if not u:
        return ""
    return (
        f"    host: the CPUs but the client's {100 * u['busy']:.0f} % busy, "
        f"{100 * u['steal']:.1f} % stolen by the hypervisor"
    )
