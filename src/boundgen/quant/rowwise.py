"""Rowwise e4m3 quantization in plain torch: the numerics every FP8 path in `boundgen.quant` has.

Runs on any device and is traceable by `torch.export`/Inductor, which fuse it with the op that
produces its input. `triton_quant` computes exactly these expressions in one pass.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# Smallest scale: keeps all-zero rows (padding) finite; 1e-12 * 448 is far below any real
# activation.
SCALE_EPS = 1e-12


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (any float dtype) -> (q [M, K] e4m3, scale [M, 1] fp32) with x ≈ q * scale.

    The max-abs element of each row maps to ±448 exactly; elements keep e4m3's 3 mantissa bits
    (relative error ≤ 2^-4 for normal values).
    """
    # NOTE: few passes in eager (max-abs in one reduction; bf16 * fp32 promotes without an fp32
    # copy of x); Inductor fuses all of it.
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    amax = amax.clamp(min=SCALE_EPS * FP8_MAX)
    scale = amax * (1.0 / FP8_MAX)
    q = (x * (FP8_MAX / amax)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] -> (w8 [N, K] e4m3 contiguous, scale [1, N] fp32), one scale per output
    channel."""
    w8, scale = quantize_rowwise(weight.detach())
    return w8.contiguous(), scale.reshape(1, -1).contiguous()
