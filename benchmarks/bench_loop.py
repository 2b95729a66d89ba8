"""Issue 25: the server's Python per request, without sockets or a load generator.

At W5's saturation the server's Python threads share one GIL, and the event loop does most of
that Python (BENCHMARKS.md, 2026-12-02 sixth session: 1.2-1.6 of 2.2-2.7 CPU ms a request). A
`bench_tail.py` run measures it through uvicorn and wrk, on a 2-core machine shared with the load
generator: its per-request CPU moves by ±15 % between runs. This drives the app in process
instead: W2 requests to `/v1/score` (token ids: the loadtest's 64 distinct W5 bodies, 2 label
tokens, `apply_softmax`, sent round-robin as wrk sends them) go straight into the ASGI app
(guard, routing, handler, runtime) from `--concurrency` tasks, the model's forward is the fake GPU
of `fake_gpu.py` (default 1 ms + 1.7 ms per 1K tokens, about the H200's rate; the fake's own head
and bookkeeping run on the CPU workers, so their numbers are the fake's, not the H200's), and per
round it reports the CPU ms per request of each Python thread (the event loop is `MainThread`)
and the fake GPU's busy share (near 100 %: the round was bound by the GPU, not the host).
Not measured here: uvicorn's HTTP parsing and socket writes (in `bench_tail.py`); counted in the
loop's time though it is not the server's: this client's few µs a request (the scope, two
callbacks).

`--route beam` (issue 24): W4 requests to `/v1/beam` instead (a 128-token prompt, width 16, 4
steps, a random 100K-item trie: bench_beam_wrk.py's bodies) around the fake search of
`fake_gpu.py` (`--fake-search`, default 6 ms + 0.25 ms a prompt); run it with `--concurrency 64`
so that searches merge as they do under wrk.

    python benchmarks/bench_loop.py                               # ~1 min: 5 rounds of 1,000
    python benchmarks/bench_loop.py --concurrency 16 --rounds 3
    python benchmarks/bench_loop.py --profile 40                  # cProfile of the loop's Python
    python benchmarks/bench_loop.py --route beam --concurrency 64
    python benchmarks/bench_loop.py --route beam --concurrency 64 --frontend

`--frontend` (`boundgen serve --frontends`): the app and the client run in a frontend process and
send their model work over the link; this process is the engine's (its state behind the link), so
the CPU per thread and `--profile` are what the engine's process does for each request.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import itertools
import json
import multiprocessing
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fake_gpu
from bench_serving import make_trie

from boundgen.loadtest import LoadConfig, make_bodies
from boundgen.server.testing import http_scope


class Client:
    """POSTs `bodies` round-robin to `path` of an ASGI `app` as uvicorn would hand each over (one
    body message)."""

    def __init__(self, app, path: str, bodies: list[bytes]) -> None:
        self.app, self.path, self.bodies = app, path, itertools.cycle(bodies)

    async def post(self) -> int:
        body, done = next(self.bodies), asyncio.Event()
        headers = {"Host": "127.0.0.1:8000", "Content-Type": "application/json"}
        headers["Content-Length"] = str(len(body))
        scope = http_scope("POST", self.path, headers)

        async def receive() -> dict:
            nonlocal body
            if body is not None:
                message = {"type": "http.request", "body": body, "more_body": False}
                body = None
                return message
            await done.wait()  # the guard's watcher: the response is complete
            return {"type": "http.disconnect"}

        status = 0

        async def send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif not message.get("more_body", False):
                done.set()

        await self.app(scope, receive, send)
        return status


async def lifespan(app, event: str) -> None:
    """Run the app's startup (warm-up) or shutdown."""
    if event == "startup":
        lifespan.inbox, lifespan.outbox = asyncio.Queue(), asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        lifespan.task = asyncio.create_task(app(scope, lifespan.inbox.get, lifespan.outbox.put))
    await lifespan.inbox.put({"type": f"lifespan.{event}"})
    reply = await lifespan.outbox.get()
    if not reply["type"].endswith(".complete"):
        raise RuntimeError(f"lifespan {event}: {reply}")


async def _batch(client: Client, concurrency: int, n: int) -> tuple[float, float, None]:
    """`n` requests from `concurrency` tasks, each waiting for its reply before the next: →
    the perf_counter at the start and at the end (and no frontend's CPU: there is none)."""

    async def worker(k: int) -> None:
        for _ in range(k):
            status = await client.post()
            if status != 200:
                raise RuntimeError(f"{client.path} answered {status}")

    per, extra = divmod(n, concurrency)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(per + (i < extra)) for i in range(concurrency)))
    return t0, time.perf_counter(), None


async def _through_a_frontend(engine, config, path: str, bodies: list[bytes], concurrency: int):
    """`--frontend`: this process is the engine's (its state behind the link, as `boundgen serve
    --frontends` runs it); a frontend process runs the app and the client. → `batch(n)` (the
    frontend sends n requests; its start and end on this process's clock, and the frontend
    process's CPU seconds for them) and `stop()`."""
    from boundgen.server.engine_link import EngineLink
    from boundgen.server.state import ServerState

    state = ServerState(engine, config)
    await asyncio.to_thread(state.warm_up)
    link = EngineLink(state)
    tmp = tempfile.mkdtemp(prefix="bench-loop-link-")
    link_path = str(Path(tmp) / "engine.sock")
    await link.start(link_path)
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    frontend = context.Process(
        target=_frontend, args=(link_path, config, path, bodies, concurrency, theirs), daemon=True
    )
    frontend.start()

    async def batch(n: int) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        mine.send(n)
        cpu_s = await asyncio.to_thread(mine.recv)
        if cpu_s is None:
            raise RuntimeError("the frontend's requests failed (its output says why)")
        return t0, time.perf_counter(), cpu_s

    async def stop() -> None:
        mine.send(None)
        await asyncio.to_thread(frontend.join, 30)
        await link.close()
        state.close()
        state.infer.close()

    return batch, stop


def _frontend(link_path: str, config, path: str, bodies: list[bytes], concurrency: int, conn):
    """The frontend process of `--frontend`: the app over the link, and the client; runs `n`
    requests per `n` received, answers with its CPU seconds for them (None: one failed)."""
    from boundgen.server.app import build_app
    from boundgen.server.frontend import connect

    async def main() -> None:
        sock, state = connect(link_path, 0, config)
        app = build_app(
            state, config, on_start=lambda: state.link.attach(sock), on_stop=lambda: None
        )
        client = Client(app, path, bodies)
        await lifespan(app, "startup")
        while (n := await asyncio.to_thread(conn.recv)) is not None:
            cpu = time.process_time()
            try:
                await _batch(client, concurrency, n)
                conn.send(time.process_time() - cpu)
            except Exception as exc:
                print(f"frontend: {exc}", file=sys.stderr)
                conn.send(None)
        await lifespan(app, "shutdown")

    asyncio.run(main())


async def run(args) -> dict:
    from boundgen import Engine
    from boundgen.checkpoints import ensure_model
    from boundgen.server.app import create_app
    from boundgen.server.config import ServerConfig
    from boundgen.server.heap import freeze_startup_heap
    from boundgen.server.threads import thread_cpu_seconds

    engine = Engine.from_pretrained(ensure_model(args.model, root=args.root), device="cpu")
    vocab = engine.config.vocab_size
    if args.route == "beam":
        # W4's bodies: what bench_beam_wrk.py's wrk sends
        config = ServerConfig(tries=(f"w4={args.trie}",))
        shape = LoadConfig(prompt_tokens=128, beam_width=16, steps=4, trie="w4")
    else:
        # W5's bodies: what `boundgen loadtest --workload score` and bench_tail.py's wrk send
        config = ServerConfig()
        shape = LoadConfig(
            query_tokens=args.query_tokens, items=args.items, item_tokens=args.item_tokens
        )
    path = f"/v1/{args.route}"
    bodies = make_bodies(shape, vocab)[args.route]
    if args.frontend:
        batch, stop = await _through_a_frontend(engine, config, path, bodies, args.concurrency)
    else:
        app = create_app(engine, config)
        client = Client(app, path, bodies)
        await lifespan(app, "startup")
        batch = functools.partial(_batch, client, args.concurrency)

        async def stop() -> None:
            await lifespan(app, "shutdown")

    if config.gc_freeze:  # as `boundgen serve` does: collections skip the start-up heap
        freeze_startup_heap()

    unit = "prompts" if args.route == "beam" else "tokens"
    await batch(min(args.requests, 100))  # warm: first calls, batching estimates
    rounds = []
    prof = cProfile.Profile() if args.profile else None
    for r in range(args.rounds):
        before = thread_cpu_seconds()
        if prof is not None:
            prof.enable()
        t0, t1, frontend_s = await batch(args.requests)
        if prof is not None:
            prof.disable()
        after = thread_cpu_seconds()
        wall = t1 - t0
        per_request = {
            k: (after[k] - before.get(k, 0.0)) * 1e3 / args.requests for k in sorted(after)
        }
        gpu = fake_gpu.busy(os.environ["BOUNDGEN_FAKE_LOG"], t0, t1)
        row = {"wall_ms": wall * 1e3 / args.requests, "cpu_ms": per_request, "gpu": gpu}
        loop = per_request.get("MainThread", 0.0)
        total = sum(per_request.values())
        # the frontend process's CPU also counts its client (a few µs a request: bench_loop's)
        frontend = ""
        if frontend_s is not None:
            row["frontend_cpu_ms"] = frontend_s * 1e3 / args.requests
            frontend = f"; the frontend process {row['frontend_cpu_ms']:.3f}"
        rounds.append(row)
        print(
            f"round {r + 1}: {args.requests / wall:.0f} req/s, fake GPU "
            f"{gpu.get('busy_share', 0.0):.0%} busy ({gpu.get('mean_size', 0.0):.1f} {unit} a "
            f"call); CPU ms a request: event loop {loop:.3f}, all threads {total:.3f}{frontend}",
            flush=True,
        )
    await stop()
    names = sorted({k for r in rounds for k in r["cpu_ms"]})
    median = {k: statistics.median(r["cpu_ms"].get(k, 0.0) for r in rounds) for k in names}
    print(
        "median CPU ms a request by thread: " + ", ".join(f"{k} {v:.3f}" for k, v in median.items())
    )
    if prof is not None:
        stats = pstats.Stats(prof)
        stats.sort_stats(args.sort).print_stats(args.profile)
    return {"rounds": rounds, "median_cpu_ms": median}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a checkpoint preset (made under --root)")
    ap.add_argument("--root", default="/tmp/boundgen-models")
    ap.add_argument("--requests", type=int, default=1000, help="per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    ap.add_argument("--query-tokens", type=int, default=256)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--item-tokens", type=int, default=16)
    ap.add_argument("--route", choices=("score", "beam"), default="score")
    ap.add_argument("--fake-forward", default="1,1.7", help="FIXED_MS[,PER_1K_TOKENS_MS]")
    ap.add_argument("--fake-search", default="6,0.25", help="FIXED_MS[,PER_PROMPT_MS] (beam)")
    ap.add_argument(
        "--frontend",
        action="store_true",
        help="the app in a frontend process, this one the engine's behind the link (--frontends)",
    )
    ap.add_argument("--profile", type=int, default=0, help="print the top N of a cProfile")
    ap.add_argument(
        "--sort", default="cumulative", help="the profile's order (pstats' keys: tottime, …)"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["BOUNDGEN_FAKE_FORWARD"] = args.fake_forward
    with tempfile.TemporaryDirectory() as tmp:
        if args.route == "beam":
            args.trie = str(make_trie(Path(tmp), 100_000, 4))
            os.environ["BOUNDGEN_FAKE_SEARCH"] = args.fake_search
            os.environ["BOUNDGEN_FAKE_TRIE"] = args.trie  # the items' sequences, in order
        # the fake GPU's calls, for its busy share: a round whose GPU is busy throughout is bound
        # by it, not by the host
        os.environ["BOUNDGEN_FAKE_LOG"] = str(Path(tmp) / "fake_gpu.log")
        fake_gpu.install_from_env()
        result = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
