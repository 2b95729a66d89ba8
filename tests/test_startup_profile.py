"""BOUNDGEN_STARTUP_PROFILE: the sampler names the functions a start-up spent its time in."""

import time

from boundgen import startup_profile


def _busy_start_up_step(sampler) -> None:
    # runs until the sampler has charged this frame 20 ms (no fixed duration: not timed)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sampler.charged("_busy_start_up_step") >= 0.02:
            return
        sum(i * i for i in range(1000))


def test_profile_names_the_busy_function(tmp_path, monkeypatch):
    out = tmp_path / "startup.txt"
    monkeypatch.setenv(startup_profile.ENV, str(out))
    startup_profile.start_from_env()
    _busy_start_up_step(startup_profile._sampler)
    startup_profile.stop()
    text = out.read_text()
    assert "== thread MainThread" in text
    assert "_busy_start_up_step" in text
    startup_profile.stop()  # a second stop (ready twice) writes nothing and does not fail
    assert out.read_text() == text


def test_no_env_no_sampler(monkeypatch):
    monkeypatch.delenv(startup_profile.ENV, raising=False)
    startup_profile.start_from_env()
    assert startup_profile._sampler is None
