"""Building blocks shared by every family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from boundgen.config import ModelConfig
from boundgen.settings import env_choice

# How `apply_rope` writes HF's rotate-half. "cat" (the default): the halves' two expressions joined
# by `torch.cat`, which Inductor lowers either as one pointwise kernel that evaluates both halves'
# expressions for every element or as writes into the halves' slices: W2's rotation kernel took
# 92.9, 69.1 and 166.8 µs a call (24 layers) in three compiles of one bucket on an H100
# (BENCHMARKS.md, forty-seventh and forty-eighth sessions). "flip" (`BOUNDGEN_ROPE_FORM=flip`): x
# viewed as its two halves, x·cos + flip(x)·(∓sin), no `cat`: one pointwise pass, each element read
# with its partner; the same products and sums per element (the same values in eager). Part of the
# compiled artifacts' platform key when not "cat". Not yet measured on a GPU (`bench_rope.py`,
# `profile_w3.py --rope-forms`).
ROPE_FORMS = ("cat", "flip")
ROPE_FORM = env_choice(
    "BOUNDGEN_ROPE_FORM", os.environ.get("BOUNDGEN_ROPE_FORM", "cat"), ROPE_FORMS
)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalise in float32, cast back, then scale (the numerics measured
    against HF on the H200; a fused `F.rms_norm` would save memory passes in eager bf16 but is
    not yet measured)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    d = config.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
    inv_freq = 1.0 / (config.rope_theta**exponents)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, [max_position_embeddings, D/2] float32:
    the expressions HF evaluates on each call (positions × inv_freq, then cos/sin in float32)."""
    inv_freq = rope_inv_freq(config, device=device)
    positions = torch.arange(config.max_position_embeddings, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


class RotaryEmbedding(nn.Module):
    """cos/sin looked up by position in tables made once (`rope_tables`), not computed per call:
    compiled, Inductor inlined the per-call sin/cos into every layer's q/k rotation — both halves'
    sin and cos for every element, 42.7 µs a layer for a W1 chunk on the H200 where moving the
    data takes ~10 (BENCHMARKS.md, 2026-12-02). The lookup reads the same float32 values."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        cos, sin = rope_tables(config)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def reset(self) -> None:
        """Recompute the tables in float32 on their device (after `to_empty` materialises the
        model from the meta device: `load_model` casts the model to its dtype before, which would
        otherwise have left bf16 tables)."""
        self.cos_table, self.sin_table = rope_tables(self.config, device=self.cos_table.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, 1, D/2] in `dtype`."""
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by cos, sin [..., D/2] (broadcast over x's leading dims) with HF's
    rotate-half convention: (x1·cos − x2·sin, x2·cos + x1·sin) of x's halves x1, x2, written as
    `ROPE_FORM` says."""
    if ROPE_FORM == "flip":
        halves = x.unflatten(-1, (2, x.shape[-1] // 2))  # [..., 2, D/2]: x1, x2
        # [[-1], [1]] from an op, not a constant: an exported graph lifts a constant tensor as
        # an input no model parameter is (the packages load without their constants)
        sign = (torch.arange(2, device=x.device) * 2 - 1).to(sin.dtype).unsqueeze(-1)
        turned = halves.flip(-2) * (sin.unsqueeze(-2) * sign)  # −x2·sin, x1·sin (sign exact)
        return (halves * cos.unsqueeze(-2) + turned).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a down projection that takes SiLU·mul's input itself (FP8: the SiLU·mul and its input
        # quantize in one pass, `quant.fp8.Fp8Linear.silu_mul_forward`)
        down = getattr(self.down_proj, "silu_mul_forward", None)
        if down is not None:
            return down(self.gate_up_proj(x))
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(gate)·up of x: the down projection's input."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up
