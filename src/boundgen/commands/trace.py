"""boundgen trace: run requests through the DAG runtime and write a Chrome-trace timeline and the
node latencies."""

from __future__ import annotations

import json
import threading

HELP = (
    "run requests through the runtime pipelines and write a Chrome-trace JSON (where do the ms go?)"
)

WORKLOADS = ("score", "embed", "beam", "demo")


def add_arguments(parser) -> None:
    from boundgen.commands._common import add_engine_args

    add_engine_args(parser, model_required=False)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="score",
        help="score: W2-style query + candidates; embed: texts; beam: one prompt; "
        "demo: a model-free pipeline (no checkpoint needed)",
    )
    parser.add_argument("--requests", type=int, default=32, help="how many requests to run")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--prefix-len", type=int, default=64, help="score: query tokens")
    parser.add_argument("--items", type=int, default=16, help="score/embed: candidates per request")
    parser.add_argument(
        "--item-len", type=int, default=16, help="score/embed: tokens per candidate"
    )
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-ms", type=float, default=None, help="per-request deadline")
    parser.add_argument("--out", default="boundgen-trace.json", help="Chrome-trace JSON to write")
    parser.add_argument(
        "--stats-json", default=None, help="also write node latency stats as JSON here"
    )


def _demo_pipeline():
    import time

    from boundgen.runtime import Pipeline, node

    @node(outputs="tokens")
    def tokenize(text: str) -> list:
        return [ord(c) for c in text]

    @node(outputs="logits", kind="device")
    def forward(tokens: list) -> list:
        time.sleep(0.002)  # stands in for the model
        return [t / 255 for t in tokens]

    @node(outputs="features")
    def features(tokens: list) -> float:
        return float(len(tokens))

    @node(outputs="top")
    def top_n(logits: list, features: float) -> list:
        return sorted(range(len(logits)), key=lambda i: -logits[i])[:3]

    return Pipeline("demo", {"text": str}, [tokenize, forward, features, top_n], ["top"])


def _requests(args, engine):
    import random

    from boundgen.workloads.beam import BeamRequest
    from boundgen.workloads.embed import EmbedRequest
    from boundgen.workloads.score import ScoreRequest

    rng = random.Random(0)
    vocab = engine.config.vocab_size
    lo = min(100, vocab // 2)

    def ids(n):
        return [rng.randrange(lo, vocab) for _ in range(n)]

    out = []
    for _ in range(args.requests):
        if args.workload == "score":
            out.append(
                ScoreRequest(
                    ids(args.prefix_len),
                    [ids(args.item_len) for _ in range(args.items)],
                    [lo, lo + 1],
                )
            )
        elif args.workload == "embed":
            out.append(EmbedRequest([ids(args.item_len) for _ in range(args.items)]))
        else:
            out.append(BeamRequest([ids(args.prefix_len)], args.beam_width, args.steps))
    return out


def _drive(submit, requests, concurrency: int) -> tuple[int, list[str]]:
    errors: list[str] = []
    lock = threading.Lock()
    it = iter(range(len(requests)))

    def client():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            try:
                submit(requests[i])
            except Exception as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(requests) - len(errors), errors


def run(args) -> int:
    from boundgen.runtime import Executor

    if args.requests <= 0 or args.concurrency <= 0:
        raise ValueError("--requests and --concurrency must be positive")
    keep = args.requests + 8
    if args.workload == "demo":
        pipe = _demo_pipeline()
        with Executor(trace_requests=keep, device="cpu") as ex:
            texts = [f"request number {i}" for i in range(args.requests)]
            ok, errors = _drive(
                lambda t: ex.run(pipe, {"text": t}, args.timeout_ms), texts, args.concurrency
            )
            tracer = ex.tracer
            tracer.export_chrome(args.out)
            stats = tracer.node_stats()
            table = tracer.format_stats()
    else:
        from boundgen.checkpoints import ensure_model
        from boundgen.commands._common import load_engine
        from boundgen.workloads.service import EngineRuntime

        if not args.model:
            args.model = str(ensure_model("tiny", progress=False))
        engine = load_engine(args)
        with EngineRuntime(engine.workload_context(), trace_requests=keep) as rt:
            reqs = _requests(args, engine)
            rt.run(args.workload, reqs[0])  # warm-up, not traced
            rt.executor.tracer.reset()
            ok, errors = _drive(
                lambda r: rt.run(args.workload, r, args.timeout_ms), reqs, args.concurrency
            )
            rt.export_trace(args.out)
            stats = rt.stats()
            table = rt.executor.tracer.format_stats()
            b = stats["batching"]
            table += "\n\nbatching: " + ", ".join(
                f"{k}: {v['requests']} requests in {v['batches']} forwards "
                f"(max {v['max_requests_in_batch']})"
                for k, v in b.items()
                if v["requests"]
            )
    print(table)
    print(f"\n{ok} ok, {len(errors)} failed" + (f" (first: {errors[0]})" if errors else ""))
    print(f"wrote {args.out} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f, indent=2, default=str)
    return 0 if not errors else 1
