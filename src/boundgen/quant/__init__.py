"""Selective FP8: rowwise e4m3 projections (`fp8`), layer policies (`policy`), fidelity gate (`fidelity`)."""

from boundgen.quant.fp8 import (
    Fp8Linear,
    Fp8NotSupportedError,
    apply_fp8,
    fp8_modules,
    fp8_supported,
    quantize_modules,
    quantize_rowwise,
    quantize_weight,
    set_act_quant,
)
from boundgen.quant.policy import (
    DEFAULT_POLICY,
    POLICIES,
    Fp8PolicyError,
    check_policy_allowed,
    enable_fp8,
    parse_policy,
    select_modules,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "Fp8Linear",
    "Fp8NotSupportedError",
    "Fp8PolicyError",
    "apply_fp8",
    "check_policy_allowed",
    "enable_fp8",
    "fp8_modules",
    "fp8_supported",
    "parse_policy",
    "quantize_modules",
    "quantize_rowwise",
    "quantize_weight",
    "select_modules",
    "set_act_quant",
]
