"""The Inductor settings this process compiles with, in one place: what AOTInductor builds and
the beam search's compiled layers pass to Inductor, and what the artifact cache's platform key
records of them (a change of either switch is a different artifact)."""

from __future__ import annotations

from typing import Any

from boundgen.compile import gemm_autotune, residual


def inductor_options() -> dict[str, Any]:
    """The switches' Inductor config (`residual`, `gemm_autotune`); {} when all are off."""
    return {**residual.inductor_options(), **gemm_autotune.inductor_options()}


def platform_keys() -> dict[str, str]:
    """The switches' modes, for `compile.cache.platform_info`."""
    return {"residual": residual.mode(), "gemm_autotune": gemm_autotune.mode()}
