"""How many CPU cores this process may use: its CPU affinity, capped by a container's CPU limit.

`os.cpu_count()` and the affinity see every core of the host; a container limited to 2 CPUs on a
64-core node (Kubernetes `limits.cpu: 2`, `docker run --cpus 2`) may run on all 64 but gets 2 cores'
time per scheduling period, and whatever is sized by the host's count (frontend processes,
compile workers) is throttled. The limit is the cgroup's CPU quota: `cpu.max` ("QUOTA PERIOD", or
"max") in cgroup v2, `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none) in v1 — read at the
process's own cgroup (`/proc/self/cgroup`), every cgroup above it and the root a cgroup namespace
shows a container; the smallest applies (a quota set on a parent, e.g. a systemd slice, limits
every cgroup under it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(root: Path | None = None, proc_cgroup: Path | None = None) -> int:
    """The cores this process may run on (its affinity where the OS says, else all), at most its
    cgroup's CPU quota rounded up (a limit of 2.5 CPUs: 3). `root`, `proc_cgroup`: where to read
    (default `CGROUP_ROOT`, `PROC_CGROUP`)."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS, Windows
        cores = os.cpu_count() or 1
    quota = cpu_quota(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def cpu_quota(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """CPUs' worth of time a period the cgroup allows (2.0: two cores' time): the smallest quota
    of the process's cgroup and those above it; None without a limit (or where there are no
    cgroups to read)."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    quotas = [q for f in _cgroup_folders(root, proc_cgroup) if (q := _folder_quota(f)) is not None]
    return min(quotas, default=None)


def _folder_quota(folder: Path) -> float | None:
    """One cgroup folder's CPU quota (v2 `cpu.max`, else v1's pair); None: none set or
    unreadable."""
    v2 = _read(folder / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        return _ratio(parts[0], parts[1]) if len(parts) == 2 and parts[0] != "max" else None
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    if quota is None or period is None or quota.startswith("-"):
        return None
    return _ratio(quota, period)


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """Where the process's CPU controller may be: its own cgroup's folder (v2's one hierarchy,
    v1's `cpu` one) and every folder above it, then the roots (a container's cgroup namespace
    shows its own as the root)."""
    own: list[Path] = []
    text = _read(proc_cgroup)
    for line in (text or "").splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not ident or not path.startswith("/") or path == "/":
            continue
        parts = path.strip("/").split("/")
        chains = [parts[:n] for n in range(len(parts), 0, -1)]  # own cgroup, then its parents
        if controllers == "":  # v2: 0::/path
            own += [root.joinpath(*c) for c in chains]
        elif "cpu" in controllers.split(","):  # v1: N:cpu,cpuacct:/path
            mounts = dict.fromkeys(("cpu", "cpu,cpuacct", controllers))
            own += [root.joinpath(name, *c) for c in chains for name in mounts]
    roots = [root, root / "cpu", root / "cpu,cpuacct"]
    return list(dict.fromkeys(own + roots))


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
