"""Selective FP8: rowwise e4m3 numerics (`rowwise`, `triton_quant`), `Fp8Linear` and the swap pass
(`fp8`), layer policies (`policy`), the fidelity gate (`fidelity`: its eval set `evalset`, the
outputs of one configuration `outputs`, the reference's noise floor `noise`) and its verdicts
(`gate_cache`).

Imports go one way: rowwise ← triton_quant ← fp8 ← policy ← fidelity, evalset ← outputs ← noise ←
fidelity.
"""

from boundgen.quant.fp8 import (
    Fp8Linear,
    Fp8NotSupportedError,
    fp8_modules,
    fp8_supported,
    fp8_swapped,
    quantize_modules,
)
from boundgen.quant.policy import (
    PRESETS,
    Fp8Policy,
    Fp8PolicyError,
    apply_fp8,
    check_policy_allowed,
    enable_fp8,
    parse_policy,
    select_modules,
)
from boundgen.quant.rowwise import quantize_rowwise, quantize_weight

__all__ = [
    "PRESETS",
    "Fp8Linear",
    "Fp8NotSupportedError",
    "Fp8Policy",
    "Fp8PolicyError",
    "apply_fp8",
    "check_policy_allowed",
    "enable_fp8",
    "fp8_modules",
    "fp8_supported",
    "fp8_swapped",
    "parse_policy",
    "quantize_modules",
    "quantize_rowwise",
    "quantize_weight",
    "select_modules",
]
