"""`host_cores`: the cores a process may use — its affinity, at most its cgroup's CPU quota
(a container's CPU limit), in cgroup v2 and v1 layouts, at the process's own cgroup, a parent
of it, or the root."""

from __future__ import annotations

import os

import pytest

from boundgen import host_cores


def _tree(tmp_path, files: dict[str, str], proc: str = "0::/\n"):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc_cgroup = tmp_path / "proc-cgroup"
    proc_cgroup.write_text(proc)
    return root, proc_cgroup


@pytest.mark.parametrize(
    "files, proc, quota",
    [
        ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0),  # v2, a container's namespace
        ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # v2, no limit
        ({"kubepods/pod1/cpu.max": "250000 100000\n"}, "0::/kubepods/pod1\n", 2.5),  # own cgroup
        (
            {"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"},
            "4:memory:/x\n3:cpu,cpuacct:/\n",
            1.5,
        ),  # v1 at the root
        (
            {
                "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000\n",
                "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            },
            "3:cpu,cpuacct:/docker/abc\n",
            4.0,
        ),  # v1, the process's own cgroup
        (
            {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
            "3:cpu,cpuacct:/\n",
            None,
        ),  # v1, no limit
        (
            {"system.slice/cpu.max": "150000 100000\n", "system.slice/app.service/cpu.max": "max"},
            "0::/system.slice/app.service\n",
            1.5,
        ),  # v2, the limit on a parent (a systemd slice) and none on the process's own cgroup
        (
            {"kubepods/cpu.max": "800000 100000\n", "kubepods/pod1/cpu.max": "300000 100000\n"},
            "0::/kubepods/pod1\n",
            3.0,
        ),  # v2, limits at two levels: the smaller applies
        (
            {
                "cpu/batch/cpu.cfs_quota_us": "200000\n",
                "cpu/batch/cpu.cfs_period_us": "100000\n",
                "cpu/batch/job/cpu.cfs_quota_us": "-1\n",
                "cpu/batch/job/cpu.cfs_period_us": "100000\n",
            },
            "3:cpu:/batch/job\n",
            2.0,
        ),  # v1, the limit on a parent
        ({}, "", None),  # no cgroups at all (not Linux, or not mounted)
        ({"cpu.max": "garbage\n"}, "0::/\n", None),
    ],
)
def test_the_cgroup_quota_is_read_where_the_process_sees_it(tmp_path, files, proc, quota):
    root, proc_cgroup = _tree(tmp_path, files, proc)
    assert host_cores.cpu_quota(root, proc_cgroup) == quota


def test_usable_cores_are_the_affinity_at_most_the_quota_rounded_up(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    root, proc_cgroup = _tree(tmp_path, {"cpu.max": "250000 100000\n"})
    assert host_cores.usable_cores(root, proc_cgroup) == 3  # 2.5 CPUs' time: 3 cores busy
    root, proc_cgroup = _tree(tmp_path / "b", {"cpu.max": "10000 100000\n"})
    assert host_cores.usable_cores(root, proc_cgroup) == 1  # a tenth of a CPU: still one
    root, proc_cgroup = _tree(tmp_path / "c", {"cpu.max": "max 100000\n"})
    assert host_cores.usable_cores(root, proc_cgroup) == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    root, proc_cgroup = _tree(tmp_path / "d", {"cpu.max": "800000 100000\n"})
    assert host_cores.usable_cores(root, proc_cgroup) == 2  # the affinity is the smaller


def test_a_container_limit_caps_the_frontends_a_gpu_server_starts(tmp_path, monkeypatch):
    """On a 64-core GPU node a pod limited to 2 CPUs starts one frontend, not four."""
    from boundgen.server.config import ServerConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    root, proc_cgroup = _tree(tmp_path, {"cpu.max": "200000 100000\n"})
    monkeypatch.setattr(host_cores, "CGROUP_ROOT", root)
    monkeypatch.setattr(host_cores, "PROC_CGROUP", proc_cgroup)
    assert ServerConfig().with_frontends_for("cuda").frontends == 1
