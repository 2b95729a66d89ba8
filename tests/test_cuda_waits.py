"""`cuda_waits`: the wait policy from the environment, events made to follow it, and the driver
calls that set a CUDA device's context to blocking sync (a stand-in driver here; the GPU run is
`BOUNDGEN_CUDA_WAIT=block` in `benchmarks/run_h200.sh`)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from boundgen import cuda_waits


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(cuda_waits, "_applied", set())


def test_policy_is_spin_unless_asked(monkeypatch):
    monkeypatch.delenv("BOUNDGEN_CUDA_WAIT", raising=False)
    assert cuda_waits.policy() == "spin"
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    assert cuda_waits.policy() == "block"


def test_a_process_default_yields_to_the_variable(monkeypatch):
    """`serve --frontends` makes `block` its engine process's default; the variable still rules."""
    monkeypatch.setattr(cuda_waits, "_default", "spin")
    monkeypatch.delenv("BOUNDGEN_CUDA_WAIT", raising=False)
    cuda_waits.set_default("block")
    assert cuda_waits.policy() == "block"
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "spin")
    assert cuda_waits.policy() == "spin"
    with pytest.raises(ValueError, match="'sleep'.*spin, block"):
        cuda_waits.set_default("sleep")


def test_an_unknown_policy_names_the_variable(monkeypatch):
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "sleep")
    with pytest.raises(ValueError, match="BOUNDGEN_CUDA_WAIT='sleep'.*spin, block"):
        cuda_waits.policy()


@pytest.mark.parametrize("policy, blocking", [("spin", False), ("block", True)])
def test_events_block_only_under_block(monkeypatch, policy, blocking):
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw) or kw)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", policy)
    cuda_waits.event(enable_timing=True)
    assert made == [{"blocking": blocking, "enable_timing": True}]


class _Driver:
    """The four driver entry points `apply` calls; `keeps` False: the flags do not change."""

    def __init__(self, flags: int = 0x10, keeps: bool = True) -> None:
        self.flags, self.keeps, self.calls = flags, keeps, []

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return 0

    def cuDeviceGet(self, dev, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        dev._obj.value = ordinal  # (a `ctypes.byref`)
        return 0

    def cuDevicePrimaryCtxGetState(self, dev, flags, active):
        flags._obj.value, active._obj.value = self.flags, 1
        return 0

    def cuDevicePrimaryCtxSetFlags_v2(self, dev, flags):
        self.calls.append(("set", dev.value, flags))
        if self.keeps:
            self.flags = flags
        return 0


def _with_driver(monkeypatch, driver):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)


def test_apply_sets_blocking_sync_keeping_the_other_flags(monkeypatch):
    driver = _Driver(flags=0x11)  # spin + a non-scheduling flag
    _with_driver(monkeypatch, driver)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    assert cuda_waits.apply("cuda:1") == 0x14
    assert ("set", 1, 0x14) in driver.calls
    assert cuda_waits.apply("cuda:1") is None  # once per device
    assert sum(1 for c in driver.calls if c[0] == "set") == 1


def test_apply_does_nothing_under_spin_or_off_cuda(monkeypatch):
    driver = _Driver()
    _with_driver(monkeypatch, driver)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "spin")
    assert cuda_waits.apply("cuda:0") is None
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    assert cuda_waits.apply("cpu") is None
    assert driver.calls == []


def test_apply_fails_loudly_when_the_context_keeps_its_flags(monkeypatch):
    _with_driver(monkeypatch, _Driver(flags=0x01, keeps=False))
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    with pytest.raises(RuntimeError, match="kept flags 0x1"):
        cuda_waits.apply("cuda:0")


def test_apply_names_a_failed_driver_call(monkeypatch):
    driver = _Driver()
    driver.cuInit = lambda flags: 100  # CUDA_ERROR_NO_DEVICE
    _with_driver(monkeypatch, driver)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    with pytest.raises(RuntimeError, match="cuInit failed with CUresult 100"):
        cuda_waits.apply("cuda:0")


def test_apply_says_when_the_driver_does_not_load(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.setenv("BOUNDGEN_CUDA_WAIT", "block")
    with pytest.raises(RuntimeError, match="CUDA driver did not load.*libcuda.so.1"):
        cuda_waits.apply("cuda:0")
