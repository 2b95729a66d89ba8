"""Building blocks shared by every family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from boundgen.config import ModelConfig


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
    rotate-half convention: (x1·cos − x2·sin, x2·cos + x1·sin) of x's halves x1, x2. Written
    with `cat`: a form without it (x·cos + flip(x)·(∓sin)) rotated 1.2x faster alone but cost W2's
    compiled graph more (111.4 against 94.2 µs a call, H100, BENCHMARKS.md fifty-first session;
    removed, git history has it)."""
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
