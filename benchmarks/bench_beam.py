"""W4 (DESIGN §9): bounded beam search, prompt 128, W=16, S=4, batch 1 and 8, with and without a
trie of 100K item IDs, against HF `generate` in the same run.

The trie: 3 levels × 256 semantic codes plus a 4th disambiguation code (TIGER-style), so item IDs
are 4 tokens long and match S=4. HF's constrained baseline uses `prefix_allowed_tokens_fn` over
the same items (a Python dict trie), the way a user of HF would constrain it.

    python benchmarks/bench_beam.py --preset qwen2.5-0.5b --device cuda --out $OUT/beam.json

Trie heads (issue 24, `--heads`; `--heads-only` skips HF and the engine runs): the
W4 trie searches in whole-search CUDA graphs (`SearchGraphs`) with the trie's default
full-vocabulary scores ("vocab": the full LM head every step) against `softmax="children"` (the
head on each step's level tokens only): search time, kernels per search (one un-graphed search
under the profiler; with `--head-compile` one compiled whole-search replay too: its GPU busy time,
idle and top kernels), the per-step head time (head + normalisation + candidate gather at B·W rows,
replayed from a CUDA graph), and the children search's results against the same semantics
computed from the full head.

    python benchmarks/bench_beam.py --heads-only --head-compile --out $OUT/beam_heads.json

With `--head-compile`, `--stream-rows N…` adds the compiled search with o_proj and down streamed up
to N rows for each N given (`models/stream.py`, `stream.MAX_ROWS` N), `--stream-gated` the one with
gate_up and SiLU·mul as one streamed GEMM (`models/stream_gated.py`; the other variants then take
cuBLAS and Inductor's SiLU·mul: the GEMM is the default), `--stream-qkv` the one with qkv and the
q/k rotation as one streamed GEMM (`models/stream_qkv.py`), `--copy-in-graph` the one whose graph
copies its staged prompts in itself, `--pdl` the one whose graph's edges into boundgen's kernels are
programmatic (`compile/programmatic.py`), and `--trie-select` the one with each trie step's
selection in one kernel (`trie_select`, the other variants then take the ATen step: the kernel is
the default); `--residual-add` the one with the residual adds out of `addmm` (`compile.residual`,
the others then keep them in `addmm`, whatever `BOUNDGEN_RESIDUAL` says),
`--decode-attention KIND…` the one with each decode step's attention as KIND: `flash` (flash
attention + the own-slot kernel) or `fusedN[wW]` (one kernel, `attention/beam_decode.py`, N rows a
program — 16, the default, 32, 64 or 128 — on W warps, by default `beam_decode.DEFAULT_WARPS`);
given several, also every combination of them (one attention at a time) — every variant in one
process.

Two searches at once (`--overlap`; `--overlap-only` skips HF, the engine runs and the heads): two
whole-search graph instances (compiled layers, each its own buffers and graph pool) replayed on
two CUDA streams against the same searches one after the other on one stream — searches/s at each
batch. A small search's kernels leave most SMs idle (a b1 decode layer-step is ~17 launches of
1–7 µs), so whether two overlap, and by how much, says whether a lane should run two searches at
once.

    python benchmarks/bench_beam.py --overlap-only --batches 1 8 16 --out $OUT/beam_overlap.json
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import os
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from boundgen import Engine, Trie, grid_dependency, trie_select
from boundgen.attention import beam_decode
from boundgen.checkpoints import ensure_model
from boundgen.compile import residual, staging
from boundgen.compile.decode import SearchGraphs, plain_session
from boundgen.logsumexp import row_logsumexp
from boundgen.models import stream, stream_gated, stream_qkv
from boundgen.search import search


def make_items(num_items: int, vocab_lo: int, seed: int = 0) -> torch.Tensor:
    """[items, 4] unique token ids: 3 semantic codes (distinct 3-code prefixes) + a
    disambiguation code; each level uses its own 256-token range starting at `vocab_lo`."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(256**3, generator=g)[:num_items]
    codes = torch.stack([flat // 65536, (flat // 256) % 256, flat % 256], 1)
    fourth = torch.randint(0, 256, (num_items, 1), generator=g)
    return torch.cat([codes, fourth], 1) + torch.tensor([0, 256, 512, 768]) + vocab_lo


def hf_prefix_fn(items: torch.Tensor, prompt_len: int):
    children: dict[tuple, list[int]] = {}
    for row in items.tolist():
        for d in range(len(row)):
            children.setdefault(tuple(row[:d]), set()).add(row[d])
    children = {k: sorted(v) for k, v in children.items()}

    def allowed(batch_id, ids):
        return children.get(tuple(ids[prompt_len:].tolist()), [])

    return allowed


def full_head(model):
    """The full-vocabulary head, columns picked afterwards (the children semantics' reference)."""

    def head(rows, columns=None):
        logits = model.head(rows)
        return logits if columns is None else logits.index_select(1, columns)

    return head


def kernels(fn, dev) -> dict:
    """One call under the profiler: kernels launched, GPU busy ms, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    if dev.type != "cuda":
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    return {
        "kernels": len(spans),
        "kernel_ms": sum(r.end - r.start for r in spans) / 1e3,
        "top": table,
    }


def step_head_us(fn, dev, reps: int = 20, iters: int = 20) -> float:
    """Device µs of `fn()` (one step's head), from a CUDA graph of `reps` calls (no launch gaps);
    wall time per call on the CPU."""
    if dev.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1e6
    return common.graph_us(fn, iters, reps)


def _fused_tile(kind: str) -> tuple[int, int]:
    """`fusedN[wW]` → (N rows, W warps; W unset: `beam_decode.DEFAULT_WARPS`)."""
    rows, _, warps = kind.removeprefix("fused").partition("w")
    return int(rows), int(warps) if warps else beam_decode.DEFAULT_WARPS


def _attention_kind(kind: str) -> str:
    """argparse's check of a `--decode-attention` KIND."""
    try:
        if kind != "flash":
            if not kind.startswith("fused"):
                raise ValueError(kind)
            with beam_decode.tile(*_fused_tile(kind)):  # a tile the kernel has a build for
                pass
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{kind!r}: expected flash or fusedN[wW] (N in 16 32 64 128, W in 1 2 4 8)"
        ) from e
    return kind


def _one_of_each(kinds: list[list[tuple]]) -> list[tuple]:
    """Every combination of at most one option of each kind (an empty kind: not asked for), the
    empty one left out: single options first, then pairs, … ."""
    asked = [k for k in kinds if k]
    out = []
    for r in range(1, len(asked) + 1):
        for group in itertools.combinations(asked, r):
            out.extend(itertools.product(*group))
    return out


def section_heads(args, engine, trie: Trie, prompts_by_batch: dict, rows: list) -> dict:
    """The W4 trie searches with the full head ("vocab") and the candidate head ("children")."""
    model, dev = engine.model, engine.device
    eos = tuple(engine.eos_token_ids())
    kids = trie.with_softmax("children")
    w, s = args.width, args.steps
    variants = {"graph": SearchGraphs(model, dev, model.backend)}
    # a variant's kernels while it runs (its graphs are captured then): `stream.MAX_ROWS`,
    # whether a trie step is one kernel, the one-kernel decode attention's tile; the others run
    # the process's defaults
    select_of, tile_of, stream_of, gated_of, qkv_of, pdl_of = {}, {}, {}, {}, {}, {}
    of_kind = {
        "select": select_of,
        "stream": stream_of,
        "gated": gated_of,
        "qkv": qkv_of,
        "pdl": pdl_of,
    }
    # with --trie-select the other variants take the ATen step (the A/B's other side)
    select_default = False if args.trie_select else trie_select.ENABLED
    gated_default = False if args.stream_gated else stream_gated.GATED
    qkv_default = False if args.stream_qkv else stream_qkv.ROTATED
    # the searches' own side of `BOUNDGEN_PDL` (its "buckets" leaves them without)
    pdl_default = False if args.pdl else grid_dependency.in_searches()
    if args.head_compile:
        from boundgen.compile.aoti import export_attention
        from boundgen.compile.backends import allow_recompiles

        backend = export_attention(model, dev)
        # every variant's layers are compiles of the same two functions (two a variant: the
        # segment lengths turn dynamic at their second value): past dynamo's recompile limit
        # (8) a variant would run its layers eagerly, timed as if compiled
        allow_recompiles(64)
        # with --residual-add the other variants keep the adds in `addmm` (the A/B's other side)
        residual_default = "addmm" if args.residual_add else residual.MODE
        with mock.patch.object(residual, "MODE", residual_default):
            variants["graph+compile"] = SearchGraphs(model, dev, backend, compile_layers=True)
        # the same with the streamed few-row kernels, the one-kernel trie step, the residual
        # adds out of `addmm`, the decode attention as one kernel (at each of its row blocks), or
        # any of them together (one value of each kind)
        kinds = [
            [("stream", v) for v in args.stream_rows],
            [("gated", True)] if args.stream_gated else [],
            [("qkv", True)] if args.stream_qkv else [],
            [("copy", True)] if args.copy_in_graph else [],
            [("pdl", True)] if args.pdl else [],
            [("select", True)] if args.trie_select else [],
            [("add", True)] if args.residual_add else [],
            [("attention", kind) for kind in args.decode_attention],
        ]
        for combo in _one_of_each(kinds):
            name = "graph+compile+" + "+".join(
                f"stream{v}" if n == "stream" else v if n == "attention" else n for n, v in combo
            )
            opts = dict(combo)
            # the residual mode and the attention's kind are read as the variant's layers are set up
            mode = "add" if "add" in opts else residual_default
            kind = opts.get("attention", beam_decode.MODE)
            kind = "fused" if kind.startswith("fused") else kind
            with (
                mock.patch.object(residual, "MODE", mode),
                mock.patch.object(beam_decode, "MODE", kind),
                # read as the searches are set up: whether their graphs copy the prompts in
                mock.patch.object(staging, "COPY_IN_GRAPH", "copy" in opts),
            ):
                variants[name] = SearchGraphs(model, dev, backend, compile_layers=True)
            for n, v in combo:
                if n == "attention" and v.startswith("fused"):
                    tile_of[name] = _fused_tile(v)
                elif n in of_kind:
                    of_kind[n][name] = v
    ungraphed = SearchGraphs(model, dev, model.backend, use_graphs=False)
    out = {}
    g = torch.Generator().manual_seed(11)
    h = engine.config.hidden_size
    for batch, prompts in prompts_by_batch.items():
        n = batch * w
        hidden = torch.randn(n, h, generator=g).to(dev, model.head_weight.dtype)
        node = torch.randint(0, trie.nodes_per_depth[1], (n,), generator=g).to(dev)
        ws = trie.workspace(n)
        tokens, _, valid, cols = trie.candidates(1, node, ws=ws)
        level = trie.level_tokens(1)

        def vocab(logits=model.logits):
            # what the search runs: the children's logits (bf16, read in place) less the row's
            # log-sum-exp; with `model.head`, the float32 copy it took before
            z = logits(hidden)
            return z.gather(1, tokens).float().sub_(row_logsumexp(z).unsqueeze(1))

        heads = {
            "vocab": vocab,
            "children": lambda: torch.log_softmax(
                model.logits(hidden, level)
                .gather(1, cols)
                .float()
                .masked_fill_(~valid, float("-inf")),
                1,
            ),
        }
        with torch.inference_mode():
            ref = run_reference(engine, prompts, w, kids)
        for softmax, t_ in (("vocab", trie), ("children", kids)):
            name = f"W4 b{batch} trie {softmax}"
            entry = out.setdefault(name, {})
            try:
                with torch.inference_mode():
                    entry["step_head_us"] = step_head_us(heads[softmax], dev)
                    if softmax == "vocab":  # before: float32 logits; every log-prob written
                        entry["step_head_float32_us"] = step_head_us(lambda: vocab(model.head), dev)
                        entry["step_head_log_softmax_us"] = step_head_us(
                            lambda: torch.log_softmax(model.head(hidden), -1).gather(1, tokens), dev
                        )
                    entry.update(kernels(lambda: ungraphed.run(prompts, w, s, t_, eos), dev))
                    calls, results = {}, {}
                    for vname, sg in variants.items():
                        streamed = stream_of.get(vname, stream.MAX_ROWS)
                        gated = gated_of.get(vname, gated_default)
                        rotated = qkv_of.get(vname, qkv_default)
                        pdl = pdl_of.get(vname, pdl_default)
                        one_kernel = select_of.get(vname, select_default)
                        tile = tile_of.get(vname, (beam_decode.BLOCK_M, beam_decode.NUM_WARPS))

                        def call(
                            sg=sg,
                            s_=streamed,
                            g_=gated,
                            q_=rotated,
                            p_=pdl,
                            one_kernel=one_kernel,
                            tile=tile,
                        ):
                            # read as the search's layers compile and its graph is captured
                            with (
                                stream.rows_up_to(s_),
                                stream_gated.enabled(g_),
                                stream_qkv.enabled(q_),
                                grid_dependency.enabled(p_),
                                trie_select.enabled(one_kernel),
                                beam_decode.tile(*tile),
                            ):
                                return sg.run(prompts, w, s, t_, eos)

                        # (copies: a graph's outputs are its static buffers)
                        calls[vname] = call
                        results[vname] = tuple(t.clone() for t in call()[:2])
                    # the variants timed call by call in turn (an A/B on one drifting machine)
                    timings = common.timed_interleaved(calls, dev, warmup=2, iters=args.iters)
                    for vname, call in calls.items():
                        got, tm = results[vname], timings[vname]
                        if dev.type == "cuda" and vname.startswith("graph+compile"):
                            # one whole-search replay profiled: GPU busy, idle, the top kernels
                            tm["profile"] = common.kernel_table(call, top=15)
                        tm["invalid_ids"] = sum(
                            not t_.contains(x)
                            for b in range(batch)
                            for x, sc in zip(got[0][b].tolist(), got[1][b].tolist())
                            if sc > float("-inf")
                        )
                        if softmax == "children":  # the same semantics from the full head
                            tm["equal_to_full_head"] = bool(torch.equal(got[0], ref[0]))
                            tm["top1_equal_to_full_head"] = bool(
                                torch.equal(got[0][:, 0], ref[0][:, 0])
                            )
                            tm["max_score_diff"] = float((got[1] - ref[1]).abs().max())
                        entry[vname] = tm
                        rows.append(
                            {
                                "run": name,
                                "variant": vname,
                                "median_ms": tm["median_ms"],
                                "step_head_us": entry["step_head_us"],
                                "kernels": entry.get("kernels"),
                                "invalid_ids": tm["invalid_ids"],
                                "equal_to_full_head": tm.get("equal_to_full_head"),
                            }
                        )
                before = [
                    f"{label} {entry[key]:.1f}"
                    for label, key in (
                        ("float32 logits", "step_head_float32_us"),
                        ("log_softmax", "step_head_log_softmax_us"),
                    )
                    if key in entry
                ]
                was = f" (with {', with '.join(before)})" if before else ""
                print(f"  {name}: {entry.get('step_head_us', 0):.1f} µs/step head{was}", flush=True)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                traceback.print_exc()
    return out


def _finish_or_exit(what: str, timeout_s: float) -> None:
    """Wait for the device's queued work; if it is not done in `timeout_s`, say so and end the
    process (a kernel that never finishes leaves nothing else to measure)."""
    done = torch.cuda.Event()
    done.record()
    t0 = time.perf_counter()
    while not done.query():
        if time.perf_counter() - t0 > timeout_s:
            print(f"  {what}: not finished after {timeout_s:.0f} s (GPU hung)", flush=True)
            os._exit(3)
        time.sleep(0.01)
    print(f"  {what}: done in {time.perf_counter() - t0:.2f} s", flush=True)


def section_overlap(args, engine, trie: Trie, prompts_by_batch: dict) -> dict:
    """Searches/s of two whole-search graph instances on two streams against one stream (the
    module docstring), per batch, W4 with the trie; and whether both ways return the same beams."""
    from boundgen.compile.aoti import export_attention

    model, dev = engine.model, engine.device
    if dev.type != "cuda":
        return {"skipped": "needs CUDA streams"}
    eos = tuple(engine.eos_token_ids())
    backend = export_attention(model, dev)
    # each instance: its own slots (buffers, graphs) and graph pool, so the two can run at once
    instances = [SearchGraphs(model, dev, backend, compile_layers=True) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    w, s, n = args.width, args.steps, args.overlap_iters
    out = {}
    for batch, prompts in prompts_by_batch.items():
        name = f"W4 b{batch} trie"
        try:
            with torch.inference_mode():
                runs = [lambda sg=sg: sg.run(prompts, w, s, trie, eos) for sg in instances]
                want = []
                for i, run in enumerate(runs):  # makes each instance's bucket (compile, capture)
                    t0 = time.perf_counter()
                    want.append(run())
                    torch.cuda.synchronize()
                    print(f"  {name}: instance {i} made in {time.perf_counter() - t0:.1f} s")
                # each instance's graph alone, then both in turn, on one stream: a replay that
                # never finishes (the GPU kept busy) ends the process, saying which one
                for label, order in (("0 alone", [0]), ("1 alone", [1]), ("0, 1", [0, 1])):
                    for _ in range(5):
                        for i in order:
                            runs[i]()
                    _finish_or_exit(f"{name}: replays of instance {label}", 20.0)
                got = {}

                def one_stream():
                    for _ in range(n):
                        got["one stream"] = [run() for run in runs]

                def two_streams():
                    for _ in range(n):
                        res = []
                        for stream, run in zip(streams, runs):
                            stream.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(stream):
                                res.append(run())
                        got["two streams"] = res
                    for stream in streams:
                        torch.cuda.current_stream().wait_stream(stream)

                entry = {}
                for label, fn in (("one stream", one_stream), ("two streams", two_streams)):
                    fn()  # warm
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    entry[label] = {
                        "searches_per_s": 2 * n / dt,
                        "ms_per_search": dt / (2 * n) * 1e3,
                        "same_beams": all(
                            torch.equal(a[0], b[0]) for a, b in zip(got[label], want)
                        ),
                    }
                entry["two_vs_one"] = (
                    entry["two streams"]["searches_per_s"] / entry["one stream"]["searches_per_s"]
                )
            out[name] = entry
            print(
                f"  {name}: one stream {entry['one stream']['searches_per_s']:.1f} searches/s, "
                f"two streams {entry['two streams']['searches_per_s']:.1f} "
                f"({entry['two_vs_one']:.2f}x)",
                flush=True,
            )
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            traceback.print_exc()
    return out


def run_reference(engine, prompts, width: int, trie: Trie):
    """The children semantics from the full-vocabulary head (plain path)."""
    model = engine.model
    session = plain_session(model, engine.device, prompts, width, trie.depth)
    return search(session, full_head(model), width, trie.depth, trie)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--root", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--hf", nargs="*", default=["eager"])
    ap.add_argument("--backends", nargs="+", default=["eager"])
    ap.add_argument(
        "--fp8",
        default=None,
        help="also each backend with this FP8 policy, forced (e.g. selective; the rows say so)",
    )
    ap.add_argument(
        "--compile-buckets",
        default="t64",
        help="compiled backends' prefill buckets (a search uses none; the default set took the "
        "whole 250 s budget of a call to compile, H200 2026-12-04)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=15.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", action="store_true", help="also the trie heads section")
    ap.add_argument("--heads-only", action="store_true", help="only the trie heads section")
    ap.add_argument("--head-compile", action="store_true", help="heads: also compiled layers")
    ap.add_argument(
        "--stream-rows",
        type=int,
        nargs="+",
        default=[],
        help="heads with --head-compile: also the compiled search with o_proj and down streamed "
        "up to this many rows (`stream.MAX_ROWS`), a variant per value given",
    )
    ap.add_argument(
        "--stream-gated",
        action="store_true",
        help="heads with --head-compile: also the compiled search with gate_up and SiLU·mul as "
        "one streamed GEMM (`models/stream_gated.py`; with --stream-rows, also each together); "
        "the other variants then without it",
    )
    ap.add_argument(
        "--stream-qkv",
        action="store_true",
        help="heads with --head-compile: also the compiled search with qkv and the q/k rotation "
        "as one streamed GEMM (`models/stream_qkv.py`; crossed with the other variants' kinds)",
    )
    ap.add_argument(
        "--copy-in-graph",
        action="store_true",
        help="heads with --head-compile: also the compiled search whose graph copies the staged "
        "prompts in as its first node (`staging.COPY_IN_GRAPH`; the others copy them before "
        "the replay)",
    )
    ap.add_argument(
        "--pdl",
        action="store_true",
        help="heads with --head-compile: also the compiled search whose graph's edges into "
        "boundgen's kernels are programmatic (`compile/programmatic.py`; the others then "
        "without)",
    )
    ap.add_argument(
        "--trie-select",
        action="store_true",
        help="heads with --head-compile: also the compiled search with each trie step's "
        "selection in one kernel (`trie_select`, the others then take the ATen step; crossed "
        "with the other variants' kinds)",
    )
    ap.add_argument(
        "--residual-add",
        action="store_true",
        help="heads with --head-compile: also the compiled search with the layers' residual adds "
        "out of `addmm` (`compile.residual`; the others then keep them in `addmm`, whatever "
        "BOUNDGEN_RESIDUAL says; with the others, also together)",
    )
    ap.add_argument(
        "--decode-attention",
        nargs="*",
        default=[],
        type=_attention_kind,
        metavar="KIND",
        help="heads with --head-compile: also the compiled search with each decode step's "
        "attention as KIND: flash (flash + the own-slot kernel, BOUNDGEN_BEAM_ATTENTION=flash) "
        "or fusedN[wW] (one kernel, `attention/beam_decode.py`, N rows a program: 16 32 64 128, "
        "on W warps: 1 2 4 8); with the others, also together",
    )
    ap.add_argument("--overlap", action="store_true", help="also two searches at once (CUDA)")
    ap.add_argument("--overlap-only", action="store_true", help="only two searches at once")
    ap.add_argument("--overlap-iters", type=int, default=20, help="overlap: searches per instance")
    ap.add_argument(
        "--stacks-after", type=float, default=0, help="overlap: print every stack after S seconds"
    )
    args = ap.parse_args()
    if args.heads_only:
        args.heads, args.hf, args.backends = True, [], args.backends[:1]
    if args.overlap_only:
        args.overlap, args.heads, args.hf, args.backends = True, False, [], args.backends[:1]
    engine_runs = not (args.heads_only or args.overlap_only)
    dev = torch.device(args.device)
    dtype_name = "bfloat16" if dev.type == "cuda" else "float32"
    path = (
        Path(args.model)
        if args.model
        else ensure_model(args.preset, dtype=dtype_name, root=args.root)
    )
    engines = {}
    # the FP8 engines beside the bf16 ones, forced: a synthetic checkpoint has no gate verdict
    quant = [("", {})]
    if args.fp8:
        quant.append((f" fp8:{args.fp8}", {"fp8": args.fp8, "fp8_force": True}))
    for backend in args.backends:
        for suffix, fp8 in quant:
            kwargs = {}
            if backend != "eager":
                kwargs = {"backend": backend, "compile_buckets": args.compile_buckets}
            try:
                engines[backend + suffix] = Engine.from_pretrained(
                    path, device=args.device, dtype=dtype_name, **kwargs, **fp8
                )
            except Exception:
                traceback.print_exc()
    if not engines:
        raise SystemExit("no engine could be built (the tracebacks above say why)")
    engine = next(iter(engines.values()))
    vocab = min(engine.tokenizer.vocab_size, engine.config.vocab_size)
    t0 = time.perf_counter()
    items = make_items(args.items, vocab_lo=1000)
    trie = Trie.from_sequences(items.numpy()).to(dev)
    build_s = time.perf_counter() - t0
    hf = {
        m: common.hf_model(
            path, dev, getattr(torch, dtype_name), None if m == "eager" else "default"
        )
        for m in args.hf
    }
    results = {
        "env": common.env_info(),
        "model": str(path),
        "trie": {
            "items": trie.num_items,
            "depth": trie.depth,
            "build_s": build_s,
            "nbytes": trie.nbytes,
        },
        "runs": {},
    }
    rows = []
    g = torch.Generator().manual_seed(7)
    prompts_by_batch = {}
    for batch in args.batches:
        prompts = [
            torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(batch)
        ]
        prompts_by_batch[batch] = prompts
        for constrained in (False, True) if engine_runs else ():
            name = f"W4 b{batch} {'trie' if constrained else 'free'}"
            entry = results["runs"].setdefault(name, {})
            ref = None
            for mode, model in hf.items():
                ids = torch.tensor(prompts, device=dev)
                kw = dict(
                    num_beams=args.width,
                    num_return_sequences=args.width,
                    max_new_tokens=args.steps,
                    min_new_tokens=args.steps,
                    do_sample=False,
                    length_penalty=0.0,
                    early_stopping=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                if constrained:
                    kw["prefix_allowed_tokens_fn"] = hf_prefix_fn(items, args.prompt_len)
                try:
                    call = lambda: model.generate(ids, **kw)
                    out = call()
                    ref = out.sequences[:, args.prompt_len :].view(batch, args.width, -1).tolist()
                    t = common.timed(call, dev, warmup=1, iters=args.iters, budget_s=args.budget_s)
                    entry[f"hf-{mode}"] = t
                    rows.append({"run": name, "variant": f"hf-{mode}", **t})
                    # each as it is measured: a run its budget cuts short still says what it had
                    print(f"{name} hf-{mode}: {t['median_ms']:.2f} ms", flush=True)
                except Exception as exc:
                    entry[f"hf-{mode}"] = {"error": repr(exc)}
                    traceback.print_exc()
            for backend, eng in engines.items():
                try:
                    call = lambda: eng.beam_search_batch(
                        prompts,
                        args.width,
                        args.steps,
                        trie=trie if constrained else None,
                    )
                    ours = call()
                    t = common.timed(call, dev, warmup=2, iters=args.iters, budget_s=args.budget_s)
                    if ref is not None:
                        same_top1 = sum(o[0][0] == r[0] for o, r in zip(ours, ref)) / batch
                        overlap = (
                            sum(
                                len({tuple(x[0]) for x in o} & {tuple(x) for x in r}) / args.width
                                for o, r in zip(ours, ref)
                            )
                            / batch
                        )
                        t.update(top1_agreement_vs_hf=same_top1, set_overlap_vs_hf=overlap)
                    if constrained:
                        t["invalid_ids"] = sum(not trie.contains(x[0]) for o in ours for x in o)
                    base = entry.get("hf-eager", {}).get("median_ms")
                    if base:
                        t["speedup_vs_hf_eager"] = base / t["median_ms"]
                    entry[f"boundgen-{backend}"] = t
                    rows.append({"run": name, "variant": f"boundgen-{backend}", **t})
                    print(f"{name} boundgen-{backend}: {t['median_ms']:.2f} ms", flush=True)
                except Exception as exc:
                    entry[f"boundgen-{backend}"] = {"error": repr(exc)}
                    traceback.print_exc()
    head_rows = []
    if args.heads:
        results["heads"] = section_heads(args, engine, trie, prompts_by_batch, head_rows)
    if args.overlap:
        if args.stacks_after:  # a run its budget kills still says where it was
            faulthandler.dump_traceback_later(args.stacks_after, exit=False)
        results["overlap"] = section_overlap(args, engine, trie, prompts_by_batch)
        faulthandler.cancel_dump_traceback_later()
    print(
        f"trie: {trie.num_items} items, depth {trie.depth}, built in {build_s:.2f}s, "
        f"{trie.nbytes / 1e6:.1f} MB"
    )
    if rows:
        common.print_table(
            rows,
            [
                "run",
                "variant",
                "median_ms",
                "p90_ms",
                "speedup_vs_hf_eager",
                "top1_agreement_vs_hf",
                "set_overlap_vs_hf",
                "invalid_ids",
            ],
        )
    if head_rows:
        common.print_table(
            head_rows,
            [
                "run",
                "variant",
                "median_ms",
                "step_head_us",
                "kernels",
                "invalid_ids",
                "equal_to_full_head",
            ],
        )
    common.write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
