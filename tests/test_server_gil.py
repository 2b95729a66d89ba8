"""The serving process's GIL switch interval (`server/gil.py`, `ServerConfig.gil_switch_ms`)."""

from __future__ import annotations

import sys

import pytest

from boundgen.server.config import ServerConfig
from boundgen.server.gil import DEFAULT_MS, set_switch_interval


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


def test_the_server_default():
    assert ServerConfig().gil_switch_ms == DEFAULT_MS == 5.0  # CPython's, until measured better
