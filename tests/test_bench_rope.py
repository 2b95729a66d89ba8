"""`benchmarks/bench_rope.py` (CUDA only to time): every way it rotates — where cos/sin come from,
the rotation's form, q and k together or apart — gives the same q and k (eager, on the CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_rope as bench  # noqa: E402

from boundgen.models import layers  # noqa: E402


def test_every_side_rotates_alike(monkeypatch):
    heads, kv_heads, d, t = 4, 2, 16, 40
    positions = bench.packed_positions(t, "cpu")
    assert positions.shape == (t,) and positions[0] == 0
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, d, 2).float() / d))
    grid = torch.arange(512).float()[:, None] * inv_freq[None, :]
    table = (grid.cos(), grid.sin())
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = (f.to(torch.bfloat16).unsqueeze(1) for f in (freqs.cos(), freqs.sin()))
    g = torch.Generator().manual_seed(0)
    qkvs = [torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)]
    outs = []
    for form in layers.ROPE_FORMS:
        monkeypatch.setattr(layers, "ROPE_FORM", form)
        for apart in (False, True):
            for variant in bench.VARIANTS:
                fn = bench.rotations(variant, inv_freq, table, apart)
                args = (cos, sin) if variant == "inputs" else (positions,)
                outs.append(fn(qkvs, *args, heads, kv_heads, d))
    want = outs[0]
    assert [tuple(x.shape) for x in want] == [(t, heads, d), (t, kv_heads, d)]
    for got in outs[1:]:
        for a, b in zip(got, want):
            # the float32 table's rows cast to bf16 are the in-graph cos/sin's, so all alike
            assert torch.equal(a, b)


def test_it_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("times on this GPU")
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_rope.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode != 0 and "needs CUDA" in res.stderr
