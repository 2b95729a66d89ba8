"""Random decode-step inputs for the beam attention kernels' tests (`test_beam_decode.py`,
`test_own_slots.py`): beams of several prompts, the prompts' KV and the beams' own slots."""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def case(widths, prompts, hq, hkv, d, slots, dtype, seed=0):
    """q [N, Hq, D] (N = sum of `widths`), pk, pv [T, Hkv, D] (T = sum of `prompts`), bk, bv
    [N, slots, Hkv, D], cu_beams and cu_prompt (int32 offsets), all on DEV."""
    g = torch.Generator().manual_seed(seed)
    n, t = sum(widths), sum(prompts)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEV)
    cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)
    return (
        mk(n, hq, d),
        mk(t, hkv, d),
        mk(t, hkv, d),
        mk(n, slots, hkv, d),
        mk(n, slots, hkv, d),
        cu(widths).to(DEV),
        cu(prompts).to(DEV),
    )
