"""Where the host time of a small request goes (W3: one 64-token prompt) in eager mode.

    python benchmarks/profile_host.py --preset qwen2.5-0.5b --out $OUT/profile.txt
Prints the top operators by CPU time and the cost of one attention call through each API.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine
from boundgen.checkpoints import ensure_model
from boundgen.text.packing import SequenceGroup


def per_call_us(fn, n=200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--root", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = ensure_model(args.preset, dtype="bfloat16", root=args.root)
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16")
    prompt = common.w1_prompts(1000, n=1, lo=64, hi=64, seed=3)
    call = lambda: engine.score([], prompt, [514, 371], apply_softmax=True)
    t = common.timed(call, "cuda", warmup=3, iters=20)
    print(f"W3 end to end: {t['median_ms']:.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
    print(table)
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(64, 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
    backend = engine.model.backend
    groups = [SequenceGroup([], prompt)]
    flash = torch.ops.aten._flash_attention_forward
    x = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)
    w = engine.model.layers[0].mlp.gate_up_proj.weight
    calls = {
        "varlen backend call": lambda: backend.varlen(q, k, k, cu, cu, 64, 64, True),
        "aten._flash_attention_forward": lambda: flash(q, k, k, cu, cu, 64, 64, 0.0, True, False),
        "linear 64x896x4864": lambda: torch.nn.functional.linear(x, w),
    }
    lines = [f"{name}: {per_call_us(fn):.1f} us" for name, fn in calls.items()]
    forward_us = per_call_us(lambda: engine.runner.rows(groups), 20)
    lines.append(f"one forward, host only (no sync): {forward_us:.1f} us")
    try:
        public = lambda: varlen_attn(q, k, k, cu, cu, 64, 64, window_size=(-1, 0))
        lines.insert(1, f"varlen_attn (public API): {per_call_us(public):.1f} us")
    except Exception as exc:
        lines.insert(1, f"varlen_attn failed: {exc}")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(table + "\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
