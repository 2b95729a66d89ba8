"""The serving process's GIL switch interval (`server/gil.py`, `ServerConfig.gil_switch_ms`)."""

from __future__ import annotations

import sys

import pytest

from boundgen.server.config import ServerConfig
from boundgen.server.gil import set_switch_interval


def test_sets_the_interval_and_returns_the_previous_one():
    before = sys.getswitchinterval()
    try:
        set_switch_interval(5.0)
        assert set_switch_interval(0.25) == pytest.approx(5.0)
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_non_positive_interval_is_refused(bad):
    with pytest.raises(ValueError, match="switch interval"):
        set_switch_interval(bad)
    with pytest.raises(ValueError, match="gil_switch_ms"):
        ServerConfig(gil_switch_ms=bad).validate()


def test_unset_leaves_the_interpreter_alone(tiny_model, monkeypatch, tmp_path):
    """Without `--gil-switch-ms` the server keeps the interval it was started with (a prelude's,
    or CPython's): `boundgen serve` sets it only when asked."""
    from boundgen.cli import build_parser
    from boundgen.commands import serve

    calls = []
    monkeypatch.setattr("boundgen.server.gil.set_switch_interval", calls.append)
    monkeypatch.setattr("boundgen.server.uvicorn.serve", lambda app, server: None)
    monkeypatch.setattr("boundgen.compile.preload.cli_startup", lambda: None)
    (tmp_path / "c.toml").write_text("gc_freeze = false\n")  # (no gc.freeze() in the tests)
    base = ["serve", "--config", str(tmp_path / "c.toml"), "--model", str(tiny_model())]
    base += ["--device", "cpu", "--warmup", "off"]
    assert ServerConfig().gil_switch_ms is None
    for extra, want in (([], []), (["--gil-switch-ms", "0.5"], [0.5])):
        calls.clear()
        assert serve.run(build_parser().parse_args(base + extra)) == 0
        assert calls == want
