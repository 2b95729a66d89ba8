"""Shared benchmark pieces: DESIGN §9 workloads, timing, MFU, environment, the HF baseline model."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

GEMM_PEAK_TFLOPS = {"spec": 989.0, "measured_gemm": 776.0}  # H200 dense bf16 (DESIGN §9)


def env_info() -> dict:
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "argv": " ".join(sys.argv),
        # the engine's A/B switches (BOUNDGEN_BEAM_STREAMS, ...): a result says what it ran with
        "boundgen_env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("BOUNDGEN_") and k != "BOUNDGEN_CACHE"
        },
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return info


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int = 2, iters: int = 10, budget_s: float = 30.0) -> dict:
    """Median/min/p90 wall time (ms) of `fn()` including a device sync; stops early past
    `budget_s`."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return _summary(times)


def _summary(times: list[float]) -> dict:
    """Median/min/p90 ms of a list of call times, and how many."""
    times = sorted(times)
    return {
        "median_ms": statistics.median(times),
        "min_ms": times[0],
        "p90_ms": times[int(0.9 * (len(times) - 1))],
        "iters": len(times),
    }


def timed_interleaved(
    fns: dict, device, warmup: int = 2, iters: int = 10, budget_s: float = 60.0
) -> dict:
    """`timed` of every side of an A/B, call by call in turn (side 1, side 2, …, side 1, …), so
    that the sides share the machine's state as it drifts (clocks, the host's load), where one
    side timed after the other compares different moments (W4's sides moved by ±0.3 ms that way,
    BENCHMARKS.md thirty-sixth session). → {name: median/min/p90 ms, iters}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - start > budget_s and len(times[name]) >= 3:
            break
    return {name: {**_summary(ts), "interleaved": True} for name, ts in times.items()}


def w1_prompts(
    vocab: int, n: int = 256, lo: int = 64, hi: int = 256, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(100, vocab, (L,), generator=g).tolist() for L in lengths]


def w2_request(vocab: int, prefix: int = 256, items: int = 100, item_len: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    query = torch.randint(100, vocab, (prefix,), generator=g).tolist()
    cands = [torch.randint(100, vocab, (item_len,), generator=g).tolist() for _ in range(items)]
    return query, cands


W5_PROFILE = Path(__file__).parent / "profiles" / "w5.json"  # W2 requests merged 1..8 at a time
W5_BUDGET = 15000  # every W5 server's --batch-token-budget: 8 W2 requests (14,848 tokens) a forward


def w5_buckets(warmup: bool = True) -> list[str]:
    """The W5 servers' buckets as a user plans them for that traffic (`boundgen compile --profile
    benchmarks/profiles/w5.json --batch-token-budget 15000 --max-bucket-tokens 16384`: one cascade
    bucket per merge level, 0.8 % padding; the four hand-picked ones used until 2026-12-02 padded 8
    requests into 16,384 tokens), plus plain t256 and t1024 for the warm-up."""
    from boundgen.compile import planner

    plan = planner.plan(planner.load_profile(W5_PROFILE), W5_BUDGET, max_bucket_tokens=16384)
    return [b.name for b in plan.buckets] + (["t256", "t1024"] if warmup else [])


def prefill_flops(
    config, seq_lens: list[int], prefix: int = 0, head_rows: int = 0, head_cols: int = 0
) -> float:
    """2·non-embedding params·tokens + causal attention + the LM-head columns actually computed.

    `prefix` > 0: every sequence is a suffix attending to a shared prefix computed once (W2)."""
    p = config.num_params(include_embeddings=False)
    tokens = sum(seq_lens) + prefix
    attn_per_pair = (
        4 * config.num_heads * config.head_dim * config.num_layers
    )  # QK and PV, 2 FLOPs/MAC
    pairs = prefix * (prefix + 1) / 2 + sum(L * prefix + L * (L + 1) / 2 for L in seq_lens)
    return 2 * p * tokens + attn_per_pair * pairs + 2 * head_rows * head_cols * config.hidden_size


def mfu(flops: float, seconds: float) -> dict:
    return {k: flops / seconds / (v * 1e12) for k, v in GEMM_PEAK_TFLOPS.items()}


def hf_model(path, device, dtype, compile_mode: str | None = None):
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa"
        )
        .to(device)
        .eval()
    )
    if compile_mode:
        model.forward = torch.compile(model.forward, mode=compile_mode)
    return model


@torch.inference_mode()
def hf_last_logits(
    model, seqs: list[list[int]], device, batch_size: int = 64, columns=None
) -> torch.Tensor:
    """HF server-style scoring: left-padded batches, explicit positions, logits of the last token
    only."""
    outs = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, width - len(s) :] = torch.tensor(s)
            mask[r, width - len(s) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1
        ).logits[:, -1]
        outs.append(logits.float() if columns is None else logits[:, columns].float())
    return torch.cat(outs)


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def capture_graph(fn, reps: int = 1, device=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `reps` calls of `fn`, after one call on a side stream (what capture
    needs: allocations and lazy inits done outside it)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def graph_us(fn, iters: int, reps: int = 1) -> float:
    """Device µs of one `fn()` call, replayed from a CUDA graph of `reps` calls (no launch gaps),
    timed by CUDA events over `iters` replays."""
    graph = capture_graph(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * reps)


def kernel_table(fn, top: int = 25) -> dict:
    """One call of `fn` (after one unprofiled call) under torch.profiler: `kernels`, its CUDA
    kernels (CPU ops without CUDA) by their own total time, with calls and share of the kernel
    time; `wall_ms`, `launches` (kernel and copy executions) and `gpu_busy_ms` (their union)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    sync("cuda" if cuda else "cpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync("cuda" if cuda else "cpu")
        wall_ms = (time.perf_counter() - t0) * 1e3
    spans, host = [], []
    for e in prof.events():
        cuda_event = e.device_type == torch.autograd.DeviceType.CUDA
        (spans if cuda_event else host).append((e.time_range.start, e.time_range.end))
    return {
        "wall_ms": wall_ms,
        "launches": len(spans),
        "gpu_busy_ms": busy_us(spans) / 1e3,
        **idle_gaps(spans, host),
        "kernels": kernel_rows(prof, cuda)[:top],
    }


def kernel_rows(prof, cuda: bool) -> list[dict]:
    """A finished torch.profiler's kernels (`cuda`; else its CPU ops) by their own total time,
    largest first: kernel, calls, ms and share of the total."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [
        {"kernel": a.key[:120], "calls": a.count, "ms": getattr(a, key) / 1e3}
        for a in prof.key_averages()
        if getattr(a, key) > 0
    ]
    total = sum(r["ms"] for r in rows) or 1.0
    for r in rows:
        r["share"] = r["ms"] / total
    return sorted(rows, key=lambda r: -r["ms"])


def idle_gaps(spans: list[tuple[float, float]], host: list[tuple[float, float]], top: int = 5):
    """Where the GPU idled during a profiled call (µs spans in the profiler's clock): `lead_ms`
    from the call's first host op to its first GPU work, `tail_ms` from its last GPU work to the
    last host op, `idle_between_ms` between the first and the last GPU work, and the `top`
    longest gaps there (`at_ms` after the first GPU work)."""
    if not spans:
        return {}
    spans = sorted(spans)
    first, last = spans[0][0], max(e for _, e in spans)
    gaps, end = [], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            gaps.append((s - end, end - first))
        end = max(end, e)
    lead = first - min(s for s, _ in host) if host else 0.0
    tail = max(e for _, e in host) - last if host else 0.0
    return {
        "lead_ms": max(lead, 0.0) / 1e3,
        "tail_ms": max(tail, 0.0) / 1e3,
        "idle_between_ms": sum(g for g, _ in gaps) / 1e3,
        "longest_gaps": [
            {"ms": g / 1e3, "at_ms": at / 1e3} for g, at in sorted(gaps, reverse=True)[:top]
        ],
    }


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Time covered by the union of (start, end) intervals: the GPU's busy time from its kernels'
    spans (overlapping kernels counted once)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy
