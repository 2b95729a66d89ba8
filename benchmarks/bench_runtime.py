"""Runtime overhead (per node, per request) against calling the same functions directly, and
W2-style requests through the engine's score pipeline at 1/2/4/8/16 concurrent clients.

    python benchmarks/bench_runtime.py --out runtime.json                       # CPU: tiny model
    python benchmarks/bench_runtime.py --preset qwen2.5-0.5b --device cuda --out runtime_h200.json

Part 1 needs no model: pipelines of no-op nodes (chains of 1/4/8 nodes, a diamond with a join),
run through `Executor.run` (the caller's thread does the work), `Executor.submit` (worker pool),
and the direct call. Overhead = runtime time - direct time. Part 2 (skip with --no-engine): W2
(prefix 256 + 100 candidates x 16 tokens, DESIGN §9) through the engine's runtime
(`Engine.score`) vs the score pipeline's functions called directly on this thread, then
closed-loop concurrency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from boundgen.runtime import Executor, Node, Pipeline, call_directly


def _noop_chain(n: int) -> Pipeline:
    nodes = [
        Node(
            f"n{i}",
            lambda v: v,
            inputs={"v": object},
            outputs={f"v{i}": object},
            bind={"v": "x" if i == 0 else f"v{i - 1}"},
        )
        for i in range(n)
    ]
    return Pipeline(f"chain{n}", {"x": object}, nodes, [f"v{n - 1}"])


def _diamond() -> Pipeline:
    nodes = [
        Node("a", lambda x: x, inputs=["x"], outputs=["a"]),
        Node("b", lambda a: a, inputs=["a"], outputs=["b"]),
        Node("c", lambda a: a, inputs=["a"], outputs=["c"]),
        Node("d", lambda b, c: b, inputs=["b", "c"], outputs=["d"]),
    ]
    return Pipeline("diamond4", ["x"], nodes, ["d"])


def _per_call_us(fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time per call (µs); the machine may be shared, so take
    medians."""
    for _ in range(min(200, iters)):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t) / iters * 1e6)
    return statistics.median(samples)


def overhead_table(iters: int) -> list[dict]:
    rows = []
    with Executor(cpu_workers=2, device="cpu") as ex:
        for pipe in (_noop_chain(1), _noop_chain(4), _noop_chain(8), _diamond()):
            inputs = {"x": 1}
            direct = _per_call_us(lambda p=pipe, x=inputs: call_directly(p, x), iters)
            run = _per_call_us(lambda p=pipe, x=inputs: ex.run(p, x), iters)
            submit = _per_call_us(lambda p=pipe, x=inputs: ex.submit(p, x).result(), iters // 2)
            with_deadline = _per_call_us(
                lambda p=pipe, x=inputs: ex.run(p, x, timeout_ms=1000), iters
            )
            n = len(pipe.plan)
            rows.append(
                {
                    "pipeline": pipe.name,
                    "nodes": n,
                    "direct_us": direct,
                    "run_us": run,
                    "submit_us": submit,
                    "run_deadline_us": with_deadline,
                    "run_overhead_per_request_us": run - direct,
                    "run_overhead_per_node_us": (run - direct) / n,
                    "submit_overhead_per_request_us": submit - direct,
                }
            )
    return rows


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def beam_request(engine, args):
    """One prompt of `--prompt-len` tokens, W × S beam search over a trie of `--trie-items`
    random item IDs of S tokens (the closed loop's beam workload)."""
    from boundgen import Trie
    from boundgen.workloads.beam import BeamRequest

    gen = torch.Generator().manual_seed(0)
    vocab = engine.config.vocab_size
    items = torch.randint(10, vocab, (args.trie_items, args.beam_steps), generator=gen)
    trie = Trie.from_sequences(items.tolist(), device=engine.device, on_duplicate="first")
    prompt = torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist()
    return BeamRequest([prompt], args.beam_width, args.beam_steps, trie=trie)


def engine_part(args) -> dict:
    import common

    from boundgen import Engine
    from boundgen.checkpoints import ensure_model
    from boundgen.workloads.score import ScoreRequest
    from boundgen.workloads.service import EngineRuntime

    path = args.model or ensure_model(args.preset, root=args.root, progress=False)
    engine = Engine.from_pretrained(path, device=args.device, dtype=args.dtype)
    vocab = engine.config.vocab_size
    query, items = common.w2_request(vocab, items=args.w2_items)
    labels = [100, 200]
    device = engine.device

    req = ScoreRequest(query, items, labels)
    context = engine.workload_context()
    context.max_wait_ms = args.max_wait_ms
    kind, node, loaded = "score", "forward", req
    if args.workload == "beam":  # closed loop over beam searches instead (one prompt each)
        kind, node, loaded = "beam", "beam", beam_request(engine, args)

    def direct():
        with torch.inference_mode():
            return call_directly(engine.runtime.pipelines["score"], {"request": req})["scores"]

    out: dict = {
        "model": str(path),
        "device": str(device),
        "dtype": str(engine.dtype),
        "w2_items": args.w2_items,
    }
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    d = common.timed(direct, device, warmup=3, iters=args.iters)
    out["direct_ms"] = d
    results = {}
    with EngineRuntime(context, trace_requests=0) as rt:
        r = common.timed(lambda: rt.run("score", req), device, warmup=3, iters=args.iters)
        out["runtime_1client_ms"] = r
        out["runtime_overhead_ms"] = r["median_ms"] - d["median_ms"]
        same = torch.allclose(
            torch.tensor(rt.run("score", req)),
            torch.tensor(direct()),
            atol=1e-3,
            rtol=1e-3,
        )
        out["same_result"] = bool(same)
        for c in args.concurrency:
            lat: list[float] = []
            lock = threading.Lock()
            n_per = max(1, args.requests // c)
            before = rt.stats()["batching"][node]

            def client(n_per: int = n_per, lat: list = lat, lock: threading.Lock = lock) -> None:
                mine = []
                for _ in range(n_per):
                    t = time.perf_counter()
                    rt.run(kind, loaded)
                    mine.append((time.perf_counter() - t) * 1e3)
                with lock:
                    lat.extend(mine)

            for _ in range(2):  # warm-up at this concurrency
                rt.run(kind, loaded)
            sync()
            threads = [threading.Thread(target=client) for _ in range(c)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = rt.stats()["batching"][node]
            batches = after["batches"] - before["batches"]
            reqs = after["requests"] - before["requests"]
            results[c] = {
                "clients": c,
                "requests": len(lat),
                "req_per_s": len(lat) / wall,
                "p50_ms": _pct(lat, 0.5),
                "p99_ms": _pct(lat, 0.99),
                "mean_ms": statistics.mean(lat),
                "requests_per_forward": reqs / batches if batches else 0.0,
            }
        out["workload"] = kind
        out["concurrency"] = list(results.values())
        out["node_stats"] = rt.executor.tracer.node_stats().get("score", {})
        out["memory"] = rt.executor.pools.stats()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--iters", type=int, default=2000, help="calls per overhead measurement")
    ap.add_argument("--no-engine", action="store_true", help="only the model-free overhead table")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--model", default=None, help="existing model dir (default: make the preset)")
    ap.add_argument("--root", default=None, help="where synthetic models are cached")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--w2-items", type=int, default=100)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--max-wait-ms", type=float, default=0.0, help="batching node max wait")
    ap.add_argument(
        "--workload", choices=("score", "beam"), default="score", help="the closed loop's requests"
    )
    ap.add_argument("--beam-width", type=int, default=16)
    ap.add_argument("--beam-steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--trie-items", type=int, default=10_000)
    args = ap.parse_args()
    result: dict = {}
    try:
        import common

        result["env"] = common.env_info()
    except Exception:
        result["env"] = {"torch": torch.__version__}

    rows = overhead_table(args.iters)
    result["overhead"] = rows
    print("Runtime overhead vs direct calls (no-op nodes; µs per request, median of 5 runs)")
    print(
        f"{'pipeline':<10} {'nodes':>5} {'direct':>8} {'run':>8} {'submit':>8} {'run+ddl':>8} "
        f"{'ovh/req':>8} {'ovh/node':>9}"
    )
    for r in rows:
        print(
            f"{r['pipeline']:<10} {r['nodes']:>5} {r['direct_us']:>8.1f} {r['run_us']:>8.1f} "
            f"{r['submit_us']:>8.1f} "
            f"{r['run_deadline_us']:>8.1f} {r['run_overhead_per_request_us']:>8.1f} "
            f"{r['run_overhead_per_node_us']:>9.1f}"
        )

    if not args.no_engine:
        args.iters = 20
        eng = engine_part(args)
        result["engine_w2"] = eng
        print(
            f"\nW2 score ({eng['w2_items']} candidates) on {eng['device']} {eng['dtype']}: direct "
            f"{eng['direct_ms']['median_ms']:.2f} ms, runtime "
            f"{eng['runtime_1client_ms']['median_ms']:.2f} ms "
            f"(overhead {eng['runtime_overhead_ms'] * 1e3:.0f} µs), same result: "
            f"{eng['same_result']}"
        )
        print(f"closed loop: {eng['workload']}")
        print(f"{'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/forward':>12}")
        for c in eng["concurrency"]:
            print(
                f"{c['clients']:>7} {c['req_per_s']:>8.1f} {c['p50_ms']:>8.2f} {c['p99_ms']:>8.2f} "
                f"{c['requests_per_forward']:>12.2f}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
