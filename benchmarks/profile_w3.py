"""Issue 25 item 1, "one replay per small request": what one W3 call (one 64-token prompt scored
for two label tokens, `apply_softmax=True`) costs on the host and the device, before and after the
staged bucket inputs (`compile/staging.py`); `--workload w2` the same for one W2 request (a
256-token query and 100 items of 16 tokens, in the cascade bucket the planner gives it), whose
wall time on the H200 is ~1.8 ms above its GPU time (BENCHMARKS.md, 2026-12-03).

    python benchmarks/profile_w3.py --json $OUT/w3.json                       # H200, ≈ 1 min
    python benchmarks/profile_w3.py --backend aoti+graphs --json $OUT/w3.json # builds t64 first
    python benchmarks/profile_w3.py --workload w2 --variants after --json $OUT/w2.json
    python benchmarks/profile_w3.py --workload w2 --backend aoti+graphs --variants after \
        --fp8 selective                                                      # FP8, gate skipped
    python benchmarks/profile_w3.py --preset tiny --device cpu --iters 50     # smoke test
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --stream 0,64                         # o_proj and down by cuBLAS, or streamed
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --gated 0,1                           # gate_up + SiLU·mul by cuBLAS + Inductor, or one GEMM
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --qkv 0,1                             # qkv + q/k rotation by cuBLAS + Inductor, or one GEMM
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --copy call,graph                     # staged inputs copied by the call or by the graph
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --pdl 0,1                             # the graph as captured, or with programmatic edges
    python benchmarks/profile_w3.py --workload w2 --backend aoti+graphs --variants after \
        --bucket-gated 0,1,persist            # a bucket's gate_up + SiLU·mul: cuBLAS or one GEMM
                                              # (pointer-fed, or persistent and TMA-fed)
    python benchmarks/profile_w3.py --backend aoti+graphs --variants after \
        --hf eager,compile                    # HF eager and HF + torch.compile in the same process
    python benchmarks/profile_w3.py --preset tiny --device cpu --variants after \
        --stub-rows --iters 2000              # the host path around the model alone

Variants (one model, one engine each, the same bucket: `t64-s4-m64`, W2's `WORKLOADS` entry):
- before: `CompileOptions(staged_inputs=False)` (each input copied into the graph's buffers, the
          rows gathered after the replay, two pooled H2D copies), label columns staged on every
          call, the scores read back by `.cpu()` in the finish node: the path before issue 25
          (only the label softmax runs in the head node, as now);
- after:  staged inputs (one host buffer, one H2D, rows gathered in the graph), label columns
          kept on the device, the scores copied to pinned memory in the head node.

Per variant, through `Engine.score` (executor, batching node, four pipeline nodes) and through the
runner alone (`rows` + `head` + softmax + `to_host` + sync):
- wall: median ms per call (N calls after a warm-up);
- under torch.profiler over `--profile-calls` calls, per call: CUDA runtime API calls by name
  (cudaMemcpyAsync, cudaStreamSynchronize, cudaEventSynchronize, cudaGraphLaunch, kernel launches,
  cudaEventRecord/Query/Create, cudaStreamWaitEvent, cudaMalloc, cudaHostAlloc) and the host time
  inside them; device-side copies by kind (HtoD, DtoH, DtoD), kernels, GPU busy time;
- on CUDA, one staged call's steps timed apart without the profiler (`split_us`): pieces, fill,
  copy, replay (the launch's host time), clone, head, wait, and the graph's GPU time by events;
  and pieces right after a wait for the GPU against pieces again at once (`pieces_after_wait`);
- one runner call's per-kernel table (`--kernels` rows: own time, calls, share);
- device tensor allocations per call (the caching allocator's `allocation.all.allocated`), pinned
  host allocations per call (`torch.cuda.host_memory_stats`, where this torch has it).

`--backend`: eager+graphs (default: no compile; the host path is the same as aoti+graphs, only
the graph's kernels differ) or aoti+graphs (builds the t64 bucket into `--cache-dir` when missing,
a package per variant, each about a minute or more: `--variants after` for the current path alone,
then loads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine, grid_dependency
from boundgen.checkpoints import ensure_model
from boundgen.compile import staging
from boundgen.compile.backends import CompiledForwards, CompileOptions, _eager_fns
from boundgen.compile.buckets import parse_buckets
from boundgen.compile.staging import StagedBucket
from boundgen.models import bucket_gated, stream, stream_gated, stream_qkv
from boundgen.runner import ModelRunner, make_runner
from boundgen.text.packing import SequenceGroup
from boundgen.workloads.score import ScoreRequest, prepare_score, request_scores

# workload → the bucket it runs in (W2's: `boundgen compile --profile` for one W2 request)
WORKLOADS = {"w3": "t64-s4-m64", "w2": "t1920-s104-m512-g2-p320-q1600"}
LABELS = [514, 371]
API = (
    "cudaMemcpyAsync",
    "cudaMemcpy",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
    "cudaGraphLaunch",
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaEventRecord",
    "cudaEventRecordWithFlags",
    "cudaEventQuery",
    "cudaEventCreateWithFlags",
    "cudaEventDestroy",
    "cudaStreamWaitEvent",
    "cudaMalloc",
    "cudaFree",
    "cudaHostAlloc",
    "cudaFreeHost",
    "cudaStreamIsCapturing",
)


def old_path(runner: ModelRunner) -> ModelRunner:
    """The label columns staged on every call and the scores left on the device (`.cpu()` in the
    finish node), as before issue 25."""
    runner._keep_label_weight = lambda columns, weight: None
    runner.to_host = lambda t: t
    return runner


def build_runner(engine: Engine, args, staged: bool) -> ModelRunner:
    cfg = engine.engine_config
    bucket = WORKLOADS[args.workload]
    if engine.device.type == "cpu":  # smoke test: the staged path without a graph
        buckets = parse_buckets([bucket])
        fns = _eager_fns(engine.model, buckets)
        if staged:
            fns = {b: StagedBucket(fns[b], b, engine.device) for b in buckets}
        forwards = CompiledForwards("eager-buckets", buckets, fns, False)
        return ModelRunner(engine.model, engine.device, forwards, cfg.max_batch_tokens)
    opts = CompileOptions(
        buckets=bucket, cache_dir=args.cache_dir, staged_inputs=staged, quant=args.fp8
    )
    return make_runner(
        engine.model,
        engine.device,
        cfg.max_batch_tokens,
        cfg.share_prefix,
        backend=args.backend,
        options=opts,
    )


def device_allocs() -> int:
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


def host_allocs() -> dict:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # a torch without it: nothing to report
        return {}
    return {k: v for k, v in stats.items() if isinstance(v, int) and "alloc" in k}


def profiled(fn, calls: int, cuda: bool) -> dict:
    """Per-call counts of one `fn()` under torch.profiler (mean over `calls`)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, profile_memory=True) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    api, api_us = Counter(), Counter()
    copies, kernels, spans = Counter(), 0, []
    cpu_allocs = dev_allocs = 0
    for e in prof.events():
        name = e.name
        if name == "[memory]":
            cpu_allocs += getattr(e, "cpu_memory_usage", 0) > 0
            dev = getattr(e, "device_memory_usage", None)
            dev_allocs += (getattr(e, "cuda_memory_usage", 0) if dev is None else dev) > 0
            continue
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end))
            if name.startswith("Memcpy"):
                kind = name.split()[1] if len(name.split()) > 1 else name
                copies[kind] += 1
            elif name.startswith("Memset"):
                copies["Memset"] += 1
            else:
                kernels += 1
            continue
        if name in API or name.startswith(("cuda", "cuLaunch")):
            api[name] += 1
            api_us[name] += e.time_range.end - e.time_range.start
    per = lambda c: {k: round(v / calls, 2) for k, v in sorted(c.items())}
    return {
        "api_calls": per(api),
        "api_host_us": per(api_us),
        "api_host_us_total": round(sum(api_us.values()) / calls, 1),
        "device_copies": per(copies),
        "kernels": round(kernels / calls, 2),
        "gpu_busy_us": round(common.busy_us(spans) / calls, 1),
        "cpu_tensor_allocations": round(cpu_allocs / calls, 2),
        "device_tensor_allocations": round(dev_allocs / calls, 2),
    }


def measure(name: str, fn, args, cuda: bool, runner: ModelRunner, runtime=None) -> dict:
    """`fn()`'s wall time (median and min ms over `--iters` after `--warmup`), allocations a
    call, its profile, the `runner`'s own host time a call by part (`runner_host_us`: packing,
    launch — the same parts whichever path calls it); with an engine's `runtime`, also where its
    calls went by the executor's own histograms (`nodes`: each node's and the whole request's p50 /
    mean µs over the timed calls)."""
    for _ in range(args.warmup):
        fn()
    common.sync("cuda" if cuda else "cpu")
    if runtime is not None:
        runtime.executor.tracer.reset()
    host0 = runner.stats()["host_seconds"]
    times = []
    d0, h0 = device_allocs(), host_allocs()
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fn()
        common.sync("cuda" if cuda else "cpu")
        times.append((time.perf_counter() - t0) * 1e3)
    d1, h1 = device_allocs(), host_allocs()
    out = {
        "wall_ms_median": round(statistics.median(times), 4),
        "wall_ms_min": round(min(times), 4),
        "device_allocations_per_call": round((d1 - d0) / args.iters, 2),
        "pinned_host_allocations_per_call": {
            k: round((h1[k] - h0.get(k, 0)) / args.iters, 2) for k in h1
        },
    }
    host1 = runner.stats()["host_seconds"]
    out["runner_host_us"] = {
        part: round((host1[part] - host0.get(part, 0.0)) / args.iters * 1e6, 1) for part in host1
    }
    if runtime is not None:
        out["nodes"] = node_split(runtime)
    out.update(profiled(fn, args.profile_calls, cuda))
    print(f"\n== {name}", flush=True)
    print(json.dumps(out, indent=1), flush=True)
    return out


def split(runner: ModelRunner, groups: list[SequenceGroup], args, cuda: bool) -> dict | None:
    """One staged call's steps timed apart, without the profiler (median µs over `--iters`): the
    host's `pieces` (chunk + `pack_arrays`), `fill` of the pinned buffer (`write_padded`), the H2D
    `copy`, the graph's `replay` (host time of the launch), the `clone` of the wanted rows and its
    event, the head + softmax + copy to pinned memory, the wait for the GPU; and the graph's GPU
    time (events around the replay). None when the call's batch does not run a staged graph."""
    modes = ["last"] * sum(len(g.suffixes) for g in groups)
    staged, _ = next(runner.pieces(groups, modes))
    if staged is not None and not cuda:  # the CPU smoke run: the host steps before a replay
        return host_split(runner, staged, groups, modes, args)
    if staged is None or staged.graph is None:
        return None
    marks = ("pieces", "fill", "copy", "replay", "clone", "head", "wait")
    steps: dict[str, list[float]] = {m: [] for m in marks + ("graph_gpu", "wall")}
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(args.warmup + args.iters):
        t = [time.perf_counter()]
        with torch.inference_mode():
            _, lay = next(runner.pieces(groups, modes))
            t.append(time.perf_counter())
            k = staged.inputs.fill(lay)
            t.append(time.perf_counter())
            staged.inputs.before_replay()  # the copy (or, where the graph copies, the order)
            t.append(time.perf_counter())
            e0.record()
            staged.graph.graph.replay()
            e1.record()
            staged.inputs.after_replay()
            t.append(time.perf_counter())
            rows = staged.graph.output[1][:k].clone()
            staged.inputs.done()
            t.append(time.perf_counter())
            head_and_wait(runner, rows, t)
        if i < args.warmup:
            continue
        add_steps(steps, marks, t)
        steps["graph_gpu"].append(e0.elapsed_time(e1) * 1e3)
    out = medians(steps)
    print("\n== host/GPU split of one staged call (median µs): " + json.dumps(out), flush=True)
    out["runner"] = runner_steps(runner, groups, args)
    out["pieces_after_wait"] = pieces_after_wait(runner, staged, groups, modes, args)
    return out


def pieces_after_wait(runner, staged, groups, modes, args) -> dict:
    """`pieces` right after a wait for the GPU (the graph replayed, the stream synchronized: as
    in `split`) and again at once (median µs over `--iters`): the CPU path times `pieces` hot,
    back to back, at a third of what `split` reads on the GPU hosts (fifty-first session, H100:
    35.4 against 97.9–150.8 µs for W2) — whether the wait itself (a core idling, its caches and
    clock cold) or the CUDA path's own work costs the difference."""
    marks = ("after_wait", "again")
    steps: dict[str, list[float]] = {m: [] for m in marks + ("wall",)}
    for i in range(args.warmup + args.iters):
        with torch.inference_mode():
            staged.graph.graph.replay()
            torch.cuda.current_stream().synchronize()
            t = [time.perf_counter()]
            for _ in marks:
                next(runner.pieces(groups, modes))
                t.append(time.perf_counter())
        if i >= args.warmup:
            add_steps(steps, marks, t)
    out = medians(steps)
    print("== pieces after the wait and at once again (median µs): " + json.dumps(out), flush=True)
    return out


def add_steps(steps: dict[str, list[float]], marks: tuple[str, ...], t: list[float]) -> None:
    """One timed call's `time.perf_counter()` readings `t` into `steps`: µs of each step of
    `marks` (between consecutive readings) and of the whole call ("wall")."""
    for m, a, b in zip(marks, t, t[1:]):
        steps[m].append((b - a) * 1e6)
    steps["wall"].append((t[-1] - t[0]) * 1e6)


def medians(steps: dict[str, list[float]]) -> dict[str, float]:
    """Each step's median µs, to a tenth."""
    return {m: round(statistics.median(v), 1) for m, v in steps.items()}


def head_and_wait(runner: ModelRunner, rows: torch.Tensor, marks: list[float]) -> None:
    """A staged call's end as the splits time it: the head (a time appended to `marks`), the wait
    for the GPU (another), then the scores to lists."""
    host = head(runner, rows)
    marks.append(time.perf_counter())
    torch.cuda.current_stream().synchronize()
    marks.append(time.perf_counter())
    host.tolist()


def runner_steps(runner: ModelRunner, groups: list[SequenceGroup], args) -> dict:
    """The runner-alone call (`runner_call`) timed in its steps (median µs over `--iters`):
    `rows` (packing, fill, copy, replay, clone, as the runner does them: what `split` times step
    by step, in its own loop), `head`, `wait` for the GPU, `tolist`; beside `split`, where the
    runner alone spends what the split's steps do not."""
    marks = ("rows", "head", "wait", "tolist")
    steps: dict[str, list[float]] = {m: [] for m in marks + ("wall",)}
    for i in range(args.warmup + args.iters):
        t = [time.perf_counter()]
        with torch.inference_mode():
            rows = runner.rows(groups)
            t.append(time.perf_counter())
            head_and_wait(runner, rows, t)
            t.append(time.perf_counter())
        if i < args.warmup:
            continue
        add_steps(steps, marks, t)
    out = medians(steps)
    print("== the runner-alone call's steps (median µs): " + json.dumps(out), flush=True)
    return out


def host_split(runner, staged, groups, modes, args) -> dict:
    """`split`'s host steps before the replay (`pieces`, `fill`), median µs over `--iters` calls,
    where no graph replays (CPU: the same Python and numpy as on a GPU host)."""
    marks = ("pieces", "fill")
    steps: dict[str, list[float]] = {m: [] for m in marks + ("wall",)}
    for i in range(args.warmup + args.iters):
        t = [time.perf_counter()]
        _, lay = next(runner.pieces(groups, modes))
        t.append(time.perf_counter())
        staged.inputs.fill(lay)
        t.append(time.perf_counter())
        if i >= args.warmup:
            add_steps(steps, marks, t)
    out = medians(steps)
    print("\n== host steps before the replay (median µs): " + json.dumps(out), flush=True)
    return out


def node_split(runtime) -> dict:
    """{node: {p50_us, mean_us}} of the score pipeline's nodes and "<request>" (the executor's
    histograms since its tracer's last reset), printed: where `Engine.score` spends what the
    runner alone does not."""
    nodes = runtime.stats()["nodes"].get("score", {})
    out = {n: {"p50_us": s["p50_us"], "mean_us": round(s["mean_us"], 1)} for n, s in nodes.items()}
    print(
        "  nodes (p50 / mean µs): "
        + ", ".join(f"{n} {v['p50_us']:.0f} / {v['mean_us']:.0f}" for n, v in out.items()),
        flush=True,
    )
    return out


def kernels(fn, top: int) -> dict:
    """One runner call's CUDA kernels by their own time (`common.kernel_table`), printed."""
    table = common.kernel_table(fn, top)
    idle = table.get("idle_between_ms", 0.0)  # no GPU work (CPU): no gaps
    print(
        f"\n== kernels of one call: {table['launches']} launches, GPU busy "
        f"{table['gpu_busy_ms'] * 1e3:.1f} us, idle between {idle * 1e3:.1f} us"
    )
    for r in table["kernels"]:
        print(f"{r['ms'] * 1e3:9.1f} us {r['calls']:5d}x {r['share']:6.1%}  {r['kernel'][:90]}")
    return table


def request(workload: str, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The (query, items) of one request of `workload`."""
    if workload == "w2":
        return common.w2_request(vocab)
    return [], common.w1_prompts(vocab, n=1, lo=64, hi=64, seed=3)


# what the head node reads of a request: its label ids and the softmax over them
HEAD_REQUEST = ScoreRequest([], [], LABELS, apply_softmax=True)


def head(runner: ModelRunner, rows: torch.Tensor) -> torch.Tensor:
    """The score head node's work, the server's own (`workloads.score.request_scores`): the
    scores on the host (`runner.to_host`), readable once the stream is synchronized."""
    return request_scores(runner, rows, HEAD_REQUEST)


def stub_rows(runner: ModelRunner, groups: list[SequenceGroup]) -> None:
    """`runner.rows` answers every call with the rows it computed once for `groups` (the model
    and its packing skipped): what a call then costs is the host path around the model."""
    with torch.inference_mode():
        rows = runner.rows(groups)
    runner.rows = lambda *args, **kwargs: rows


def runner_call(runner: ModelRunner, groups: list[SequenceGroup], cuda: bool):
    def call():
        with torch.inference_mode():
            rows = runner.rows(groups)
            host = head(runner, rows)
            if host.device.type != "cpu":  # before: `.cpu()` (a copy and a stream sync)
                return host.cpu().tolist()
            if cuda:  # after: the copy to pinned memory is waited for once
                torch.cuda.current_stream().synchronize()
            return host.tolist()

    return call


def interleaved(built, groups, query, items, args, cuda: bool) -> dict:
    """Every side's `Engine.score` and runner call timed in turn, call by call, for `--iters`
    rounds (after the warm-up): an A/B whose sides share the machine's state as it drifts (the
    first run of a process, the host's load), where separate runs compare different moments.
    Median and min ms per side and path, printed."""
    calls = {}
    for name, runner, engine in built:
        calls[(name, "engine")] = lambda e=engine: e.score(query, items, LABELS, apply_softmax=True)
        calls[(name, "runner")] = runner_call(runner, groups, cuda)
    device = "cuda" if cuda else "cpu"
    times = common.timed_interleaved(
        calls, device, warmup=args.warmup, iters=args.iters, budget_s=float("inf")
    )
    out = {}
    print("\n== interleaved, ms (median / min)", flush=True)
    for (name, path_), tm in times.items():
        med, low = round(tm["median_ms"], 4), round(tm["min_ms"], 4)
        out.setdefault(name, {})[path_] = {"wall_ms_median": med, "wall_ms_min": low}
        print(f"{name:18s} {path_:7s} {med:7.3f} / {low:7.3f}", flush=True)
    return out


def hf_baselines(path, modes, query, items, want, args, cuda: bool, dtype: str) -> dict:
    """The request through transformers, per mode (eager, compile): median / min ms of a call
    (`--iters`, after the warm-up; compile's first calls compile) and the largest difference of
    its scores from boundgen eager's, printed. A mode that fails is recorded as its error."""
    device = "cuda" if cuda else "cpu"
    seqs = [query + item for item in items]
    out = {}
    for mode in modes:
        try:
            t0 = time.perf_counter()
            compiled = "reduce-overhead" if mode == "compile" else None
            model = common.hf_model(path, device, getattr(torch, dtype), compiled)

            def call(model=model):
                logits = common.hf_last_logits(model, seqs, device, len(seqs), LABELS)
                return logits.softmax(-1).cpu().tolist()

            got = call()
            for _ in range(max(args.warmup, 3)):
                call()
            load_s = time.perf_counter() - t0
            tm = common.timed(call, device, warmup=0, iters=args.iters, budget_s=60.0)
            diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
            out[mode] = {
                "wall_ms_median": round(tm["median_ms"], 4),
                "wall_ms_min": round(tm["min_ms"], 4),
                "iters": tm["iters"],
                "load_and_warmup_s": round(load_s, 1),
                "max_abs_diff_vs_eager": diff,
            }
            print(f"\n== HF {mode}: {json.dumps(out[mode])}", flush=True)
            del model
        except Exception as e:  # one baseline failing leaves boundgen's numbers standing
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
            print(f"\n== HF {mode} failed: {out[mode]['error']}", flush=True)
    return out


def _axis(ap, flag: str, text: str | None, choices) -> list:
    """An axis's values from its comma list, each one of `choices` (else the parser's error, before
    anything is built); [None] when the flag is not given (the process's setting)."""
    values = text.split(",") if text else [None]
    if any(v is not None and v not in choices for v in values):
        ap.error(f"{flag}: choose from {','.join(choices)}")
    return values


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--root", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--backend", default="eager+graphs", choices=["eager+graphs", "aoti+graphs"])
    ap.add_argument("--cache-dir", default=None, help="AOTInductor artifacts (aoti+graphs)")
    ap.add_argument("--workload", default="w3", choices=sorted(WORKLOADS))
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--profile-calls", type=int, default=20)
    ap.add_argument("--fp8", default="none", help="FP8 policy (e.g. selective), gate skipped")
    ap.add_argument("--kernels", type=int, default=30, help="rows of the per-kernel table")
    ap.add_argument(
        "--stream",
        default=None,
        help="`stream.MAX_ROWS` values to build side by side (0,64: o_proj and down by cuBLAS or "
        "streamed, `models/stream.py`), crossed with the other axes",
    )
    ap.add_argument(
        "--gated",
        default=None,
        help="`stream_gated.GATED` values to build side by side (0,1: gate_up by cuBLAS and "
        "SiLU·mul by Inductor, or both as one streamed GEMM, `models/stream_gated.py`), crossed "
        "with the other axes",
    )
    ap.add_argument(
        "--bucket-gated",
        default=None,
        help="`BOUNDGEN_BUCKET_GATED` forms to build side by side (0,1,persist: a bucket's gate_up "
        "by cuBLAS and SiLU·mul by Inductor, or both as one GEMM, `models/bucket_gated.py`, "
        "pointer-fed or persistent TMA-fed), "
        "crossed with the other axes",
    )
    ap.add_argument(
        "--qkv",
        default=None,
        help="`stream_qkv.ROTATED` values to build side by side (0,1: qkv by cuBLAS and the q/k "
        "rotation by Inductor, or both as one streamed GEMM, `models/stream_qkv.py`), crossed "
        "with the other axes",
    )
    ap.add_argument(
        "--copy",
        default=None,
        help="`staging.COPY_IN_GRAPH` values to build side by side (call,graph: each call copies "
        "the staged inputs in before the replay, or the bucket's graph copies them in as its "
        "first node), crossed with the other axes",
    )
    ap.add_argument(
        "--pdl",
        default=None,
        help="`grid_dependency.ON` values to build side by side (0,1: a package each; the bucket's "
        "graph as captured, or its kernels waiting for the ones before and its edges into them "
        "made programmatic, `compile/programmatic.py`), crossed with the other axes",
    )
    ap.add_argument(
        "--hf",
        default=None,
        help="HF baselines timed in the same process after boundgen's sides (eager,compile: "
        "transformers eager and with `torch.compile(mode='reduce-overhead')`), the same request "
        "scored as HF servers do (`common.hf_last_logits`, label softmax, scores to the host)",
    )
    ap.add_argument(
        "--stub-rows",
        action="store_true",
        help="the model's rows computed once and handed back on every call (`stub_rows`): the "
        "host work of `Engine.score` (executor, batching, the score nodes) and of the runner's "
        "head alone, on any device",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hf_modes = _axis(ap, "--hf", args.hf, ("eager", "compile"))
    streams = args.stream.split(",") if args.stream else [None]
    for st in streams:
        if st is not None and not st.isdigit():
            ap.error(f"--stream: rows are a whole number, not {st!r}")
    gateds = _axis(ap, "--gated", args.gated, ("0", "1"))
    qkvs = _axis(ap, "--qkv", args.qkv, ("0", "1"))
    bucket_gateds = _axis(ap, "--bucket-gated", args.bucket_gated, bucket_gated.FORMS)
    copies = _axis(ap, "--copy", args.copy, ("call", "graph"))
    pdls = _axis(ap, "--pdl", args.pdl, ("0", "1"))
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    path = ensure_model(args.preset, dtype=dtype, root=args.root)
    # FP8 on random weights without the fidelity gate: a speed measurement (the gate is
    # `boundgen quant-check` on a real checkpoint)
    fp8 = {"fp8": args.fp8, "fp8_force": True} if args.fp8 != "none" else {}
    if fp8 and not cuda:  # the smoke test: FP8's numerics emulated
        fp8["fp8_emulate"] = True
    base = Engine.from_pretrained(path, device=args.device, dtype=dtype, backend="eager", **fp8)
    vocab = base.config.vocab_size
    query, items = request(args.workload, vocab)
    # the groups as `Engine.score`'s prepare node makes them (with their checked ids as one array,
    # `SequenceGroup.ids`): the runner's pieces as the served path packs them
    groups = prepare_score(ScoreRequest(query, items, LABELS), base.tokenizer, base.limits)
    want = base.score(query, items, LABELS, apply_softmax=True)
    bucket = WORKLOADS[args.workload]
    res = {"env": common.env_info(), "backend": args.backend, "workload": args.workload}
    res["fp8"] = args.fp8
    res.update(bucket=bucket, variants={})
    sides = [
        (v, st, gt, q, c, p, bg)
        for v in args.variants.split(",")
        for st in streams
        for gt in gateds
        for q in qkvs
        for c in copies
        for p in pdls
        for bg in bucket_gateds
    ]
    built = []  # (name, runner, engine): every side built first, then measured
    try:
        for side in sides:
            variant, stream_rows, gated, qkv, copy, pdl, b_gated = side
            name = "/".join(
                [variant]
                + ([f"stream{stream_rows}"] if stream_rows is not None else [])
                + ([f"gated{gated}"] if gated is not None else [])
                + ([f"qkv{qkv}"] if qkv is not None else [])
                + ([f"copy-{copy}"] if copy is not None else [])
                + ([f"pdl{pdl}"] if pdl is not None else [])
                + ([f"bucket-gated{b_gated}"] if b_gated is not None else [])
            )
            # each read when the runner traces, builds or captures the model
            if stream_rows is not None:
                stream.MAX_ROWS = int(stream_rows)
            if gated is not None:
                stream_gated.GATED = gated == "1"
            if qkv is not None:
                stream_qkv.ROTATED = qkv == "1"
            if copy is not None:
                staging.COPY_IN_GRAPH = copy == "graph"
            if pdl is not None:
                grid_dependency.ON = pdl == "1"
            if b_gated is not None:
                bucket_gated.set_form(b_gated)
            t0 = time.perf_counter()
            runner = build_runner(base, args, staged=variant == "after")
            if variant == "before":
                old_path(runner)
            if args.stub_rows:
                stub_rows(runner, groups)
            print(f"[{name}] runner built in {time.perf_counter() - t0:.1f} s", flush=True)
            built.append((name, runner, base.with_runner(runner)))
        if len(built) > 1:
            res["interleaved"] = interleaved(built, groups, query, items, args, cuda)
        for name, runner, engine in built:
            got = engine.score(query, items, LABELS, apply_softmax=True)
            diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
            call = lambda e=engine: e.score(query, items, LABELS, apply_softmax=True)
            res["variants"][name] = {
                "max_abs_diff_vs_eager": diff,
                "engine": measure(
                    f"{name}: Engine.score", call, args, cuda, runner, engine.runtime
                ),
                "runner": measure(
                    f"{name}: runner only", runner_call(runner, groups, cuda), args, cuda, runner
                ),
                "split_us": split(runner, groups, args, cuda),
                "kernels": kernels(runner_call(runner, groups, cuda), args.kernels),
                "runner_stats": runner.stats(),
            }
    finally:
        for _, _, engine in built:
            engine.close()
    if hf_modes != [None]:
        res["hf"] = hf_baselines(path, hf_modes, query, items, want, args, cuda, dtype)
    # `alone`: each side's `measure`, the sides one after another (a host that slows meanwhile
    # slows one side only: on an H100 in the forty-ninth session every host step of the second
    # side doubled); an A/B reads `interleaved`, the sides timed call by call
    both = res.get("interleaved", {})
    print(
        "\nvariant         path   alone ms  interleaved ms  GPU busy us  API host us  H2D  D2H  "
        "DtoD  syncs  graphs  launches  dev allocs"
    )
    for variant, out in res["variants"].items():
        for path_ in ("engine", "runner"):
            m = out[path_]
            c, a = m["device_copies"], m["api_calls"]
            syncs = sum(v for k, v in a.items() if "Synchronize" in k)
            launches = sum(v for k, v in a.items() if "LaunchKernel" in k or "cuLaunch" in k)
            mixed = both.get(variant, {}).get(path_, {}).get("wall_ms_median")
            mixed = f"{mixed:14.3f}" if mixed is not None else f"{'–':>14s}"
            print(
                f"{variant:15s} {path_:7s} {m['wall_ms_median']:8.3f} {mixed} "
                f"{m['gpu_busy_us']:12.1f} {m['api_host_us_total']:12.1f} {c.get('HtoD', 0):4} "
                f"{c.get('DtoH', 0):4} {c.get('DtoD', 0):5} {syncs:6} "
                f"{a.get('cudaGraphLaunch', 0):7} {launches:9} "
                f"{m['device_allocations_per_call']:11}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    from boundgen.compile.preload import cli_startup

    cli_startup()  # AOTInductor packages may need the libstdc++ preload: re-exec as the CLI does
    sys.exit(main())
