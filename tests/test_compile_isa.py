"""Inductor's CPU-ISA check verdicts are kept in the cache: paid once per machine, not per
process (`compile/isa.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from boundgen.compile import isa

cpu_vec_isa = pytest.importorskip("torch._inductor.cpu_vec_isa")


@pytest.fixture
def fake_checks(monkeypatch):
    """VecISA.check_build replaced by a counting fake (restored after the test)."""
    calls = []

    def check_build(self, code):
        calls.append((type(self).__name__, self._arch_flags, code))
        return "fail" not in code

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", check_build)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_avx_py_load", "import torch\nload('__lib_path__')\n")
    return calls


def test_verdicts_are_stored_and_reused(tmp_path, fake_checks):
    avx2 = cpu_vec_isa.VecAVX2()
    assert isa.remember_isa_checks(tmp_path)
    assert isa.remember_isa_checks(tmp_path)  # idempotent: wrapped once
    assert avx2.check_build("ok code") is True
    assert avx2.check_build("fail code") is False
    assert len(fake_checks) == 2
    assert (tmp_path / isa.VERDICTS).exists()
    # a later process (here: the same check asked again) reads the verdicts, runs nothing
    assert avx2.check_build("ok code") is True and avx2.check_build("fail code") is False
    assert len(fake_checks) == 2
    # the flags are part of the key (the AVX512 checks widen them for a moment)
    avx2._arch_flags += " -mextra"
    try:
        assert avx2.check_build("ok code") is True
    finally:
        avx2._arch_flags = cpu_vec_isa.VecAVX2._arch_flags
    assert len(fake_checks) == 3


def test_another_cache_dir_checks_again(tmp_path, fake_checks):
    avx2 = cpu_vec_isa.VecAVX2()
    isa.remember_isa_checks(tmp_path / "a")
    avx2.check_build("ok code")
    isa.remember_isa_checks(tmp_path / "b")
    avx2.check_build("ok code")
    assert len(fake_checks) == 2


def test_the_child_that_imported_torch_no_longer_does(tmp_path, fake_checks):
    isa.remember_isa_checks(tmp_path)
    load = cpu_vec_isa.VecISA._avx_py_load
    assert "import torch" not in load.splitlines() and "__lib_path__" in load


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cheap child is Linux-only")
def test_cheap_child_loads_a_library_that_needs_torch():
    """The cheap child maps torch's libraries first, so a library linked against them loads; a
    missing library fails (the check's 'no')."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    needs_torch = os.path.join(lib_dir, "libtorch.so")
    if not os.path.exists(needs_torch):
        pytest.skip("no libtorch.so in this torch build")
    code = isa._CHEAP_LOAD.format(lib=lib_dir)
    ok = subprocess.run([sys.executable, "-c", code.replace("__lib_path__", needs_torch)])
    assert ok.returncode == 0
    missing = code.replace("__lib_path__", str(os.path.join(lib_dir, "no-such-lib.so")))
    assert subprocess.run([sys.executable, "-c", missing], capture_output=True).returncode != 0
