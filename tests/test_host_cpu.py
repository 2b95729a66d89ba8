"""`benchmarks/host_cpu.py`: the host's CPU accounting over a run — busy and stolen shares of the
CPUs but the load generator's, from two readings of /proc/stat; and `host_probe.py`'s timings."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_cpu

STAT = """cpu  300 0 60 1000 10 0 5 40 0 0
cpu0 100 0 20 400 5 0 2 10 0 0
cpu1 200 0 40 600 5 0 3 30 0 0
intr 12345
"""


def test_read_takes_each_cpu_line_and_skips_the_total(tmp_path):
    path = tmp_path / "stat"
    path.write_text(STAT)
    assert host_cpu.read(path) == {
        0: (100, 0, 20, 400, 5, 0, 2, 10),
        1: (200, 0, 40, 600, 5, 0, 3, 30),
    }
    assert host_cpu.read(tmp_path / "missing") == {}


def test_cpu_list_reads_tasksets_format():
    assert host_cpu.cpu_list("0,2-3") == {0, 2, 3}
    assert host_cpu.cpu_list("8-15") == set(range(8, 16))
    assert host_cpu.cpu_list("") == set() and host_cpu.cpu_list(None) == set()


def test_usage_counts_the_run_on_the_cpus_but_the_clients():
    before = {0: (100, 0, 20, 400, 5, 0, 2, 10), 1: (200, 0, 40, 600, 5, 0, 3, 30)}
    # over the run cpu0: 60 user + 10 system + 20 idle + 10 steal; cpu1 (the client's): all busy
    after = {0: (160, 0, 30, 420, 5, 0, 2, 20), 1: (300, 0, 40, 600, 5, 0, 3, 30)}
    u = host_cpu.usage(before, after, exclude={1})
    assert u == {"busy": 0.7, "steal": 0.1}
    both = host_cpu.usage(before, after)
    assert both["busy"] == (70 + 100) / 200 and both["steal"] == 10 / 200
    assert host_cpu.usage({}, after) == {}  # nothing to compare: no line either
    assert host_cpu.line({"host_cpu": {}}) == ""
    assert "70 % busy, 10.0 % stolen" in host_cpu.line({"host_cpu": u})


def test_the_host_probe_times_python_numpy_and_a_thread_hand_off():
    import host_probe

    assert host_probe.python_ms(rounds=1) > 0
    assert host_probe.numpy_us(rounds=1, calls=2) > 0
    median, p99 = host_probe.handoff_us(trips=200)  # returns: the two threads took turns
    assert 0 < median <= p99
    assert host_probe.cpu_model()
