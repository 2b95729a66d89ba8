"""Inductor's CPU-ISA check verdicts are kept in the cache: paid once per machine, not per
process (`compile/isa.py`)."""

from __future__ import annotations

import pytest

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


def test_checks_finishing_together_lose_no_verdict(tmp_path, fake_checks):
    import threading

    isa.remember_isa_checks(tmp_path)
    avx2 = cpu_vec_isa.VecAVX2()
    threads = [threading.Thread(target=avx2.check_build, args=(f"ok code {i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import json

    assert len(json.loads((tmp_path / isa.VERDICTS).read_text())) == 8


def test_each_candidate_isa_is_checked_at_the_same_time(tmp_path, monkeypatch):
    """warm_isa_checks runs the candidates' check chains side by side: three fakes that each
    wait for the other two to be checking pass only if they run at once."""
    import threading

    barrier = threading.Barrier(3, timeout=30)
    checked = []

    class FakeISA:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

        def __bool__(self):
            barrier.wait()  # BrokenBarrierError (the thread dies, nothing checked) when serial
            checked.append(self.name)
            return True

    monkeypatch.setattr(isa, "remember_isa_checks", lambda root: True)
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(
        cpu_vec_isa, "supported_vec_isa_list", [FakeISA("a"), FakeISA("b"), FakeISA("c")]
    )
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: ["a", "b", "c"])
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: None)
    isa.warm_isa_checks(tmp_path)
    assert sorted(checked) == ["a", "b", "c"]
