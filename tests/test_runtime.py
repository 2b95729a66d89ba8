"""Static DAG runtime: validation, concurrency, deadlines, failure isolation, pools, batching,
tracing."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from boundgen.runtime import (
    BatchingNode,
    DeadlineExceeded,
    Executor,
    Node,
    NodeError,
    NodeKind,
    Pipeline,
    PipelineError,
    call_directly,
    node,
    node_from_function,
)

# ---- a small "business request": tokenize -> (model || features) -> post
# --------------------------------


@node(outputs="tokens")
def tokenize(text: str) -> list[int]:
    return [ord(c) % 97 for c in text]


@node(outputs="logits", kind="device")
def model(tokens: list[int]) -> torch.Tensor:
    t = torch.tensor(tokens, dtype=torch.float32)
    return torch.stack([t.sum(), t.mean(), t.max()])


@node(outputs="bonus")
def features(tokens: list[int]) -> float:
    return float(len(tokens))


@node(outputs="score")
def post(logits: torch.Tensor, bonus: float) -> float:
    return float(logits.sum()) + bonus


def demo_pipeline() -> Pipeline:
    return Pipeline("demo", {"text": str}, [tokenize, model, features, post], ["score", "tokens"])


@pytest.fixture
def ex():
    executor = Executor(cpu_workers=4, trace_requests=64)
    yield executor
    executor.close()


def test_run_matches_direct_call(ex):
    pipe = demo_pipeline()
    out = ex.run(pipe, {"text": "hello"}, timeout_ms=5000)
    assert out == call_directly(pipe, {"text": "hello"})
    assert set(out) == {"score", "tokens"}
    assert ex.submit(pipe, {"text": "hello"}).result(timeout=10) == out


def test_submitted_request_reports_its_node_times(ex):
    fut = ex.submit(demo_pipeline(), {"text": "hello"})
    fut.result(timeout=10)
    assert sorted(t.node for t in fut.timings) == ["features", "model", "post", "tokenize"]
    assert fut.timings[-1].node == "post"  # completion order: the sink last
    assert all(t.wait_ms >= 0 and t.run_ms >= 0 for t in fut.timings)
    assert fut.total_ms >= max(t.run_ms for t in fut.timings)


# ---- validation
# -----------------------------------------------------------------------------------------


def _n(name, inputs, outputs, fn=lambda **kw: 0, **extra):
    return Node(name, fn, inputs=inputs, outputs=outputs, **extra)


def test_cycle_names_the_nodes():
    nodes = [
        _n("a", {"c": Any}, {"a_out": Any}, bind={"c": "c_out"}),
        _n("b", ["a_out"], ["b_out"]),
        _n("c", ["b_out"], ["c_out"]),
    ]
    with pytest.raises(PipelineError, match=r"cycle: .*a.*->.*b.*->.*c|cycle: .*c.*->.*a") as e:
        Pipeline("p", {}, nodes, ["c_out"])
    assert "pipeline 'p'" in str(e.value)


def test_unbound_input_suggests_a_name():
    with pytest.raises(
        PipelineError, match=r"node 'b' input 'tokenz' is unbound.*did you mean 'tokens'"
    ):
        Pipeline(
            "p", {"text": str}, [_n("a", ["text"], ["tokens"]), _n("b", ["tokenz"], ["y"])], ["y"]
        )


def test_unknown_names_rejected():
    with pytest.raises(PipelineError, match=r"node 'a': bind names unknown input port 'nope'"):
        _n("a", ["x"], ["y"], bind={"nope": "x"})
    with pytest.raises(PipelineError, match=r"output 'z' names unknown value 'z'"):
        Pipeline("p", ["x"], [_n("a", ["x"], ["y"])], ["z"])


def test_duplicates_rejected():
    with pytest.raises(
        PipelineError, match=r"duplicate output 'y': produced by node 'b' and by node 'a'"
    ):
        Pipeline("p", ["x"], [_n("a", ["x"], ["y"]), _n("b", ["x"], ["y"])], ["y"])
    with pytest.raises(PipelineError, match=r"duplicate node name 'a'"):
        Pipeline("p", ["x"], [_n("a", ["x"], ["y"]), _n("a", ["x"], ["z"])], ["y"])
    with pytest.raises(PipelineError, match=r"duplicate output 'x'.*pipeline input 'x'"):
        Pipeline("p", ["x"], [_n("a", ["x"], ["x"])], ["x"])


def test_type_mismatch_names_ports():
    @node(outputs="n")
    def count(text: str) -> int:
        return len(text)

    @node(outputs="upper")
    def shout(word: str) -> str:
        return word.upper()

    with pytest.raises(
        PipelineError,
        match=r"node 'shout' input 'word' expects str, but node 'count' produces 'n' as int",
    ):
        Pipeline("p", {"text": str}, [count, shout.renamed("shout", bind={"word": "n"})], ["upper"])
    # compatible generics and Any pass
    Pipeline(
        "ok",
        {"tokens": list[int]},
        [node_from_function(lambda tokens: 1, name="f", outputs="y")],
        ["y"],
    )


# ---- concurrency
# ---------------------------------------------------------------------------------------


def _batching_pipeline(
    max_wait_ms: float = 2.0, token_budget: int = 64
) -> tuple[Pipeline, BatchingNode]:
    """Rows per request vary; the batched 'model' sees all rows of several requests at once."""

    def merge(items):
        rows = [r for it in items for r in it["rows"]]
        return torch.tensor(rows, dtype=torch.float64), [len(it["rows"]) for it in items]

    def split(out, sizes):
        return list(torch.split(out, sizes))

    forward = BatchingNode(
        "forward",
        lambda x: x * 2.0 + 1.0,
        inputs={"rows": list},
        outputs={"out": torch.Tensor},
        merge=merge,
        split=split,
        size=lambda a: len(a["rows"]),
        token_budget=token_budget,
        max_wait_ms=max_wait_ms,
    )

    @node(outputs="rows")
    def expand(n: int) -> list:
        return [float(n * 10 + k) for k in range(n % 5 + 1)]

    @node(outputs="total")
    def finish(out: torch.Tensor) -> list:
        return out.tolist()

    return Pipeline("batched", {"n": int}, [expand, forward, finish], ["total"]), forward


def test_16_threads_mixed_requests_match_sequential(ex):
    demo = demo_pipeline()
    batched, forward = _batching_pipeline()
    work = [
        (demo, {"text": f"request {i} " * (i % 7 + 1)}) if i % 2 else (batched, {"n": i})
        for i in range(160)
    ]
    expected = [call_directly(p, x) for p, x in work]
    results: list[Any] = [None] * len(work)

    def client(k: int) -> None:
        for idx in range(k, len(work), 16):
            p, x = work[idx]
            if idx % 3:
                results[idx] = ex.run(p, x, timeout_ms=10_000)
            else:
                results[idx] = ex.submit(p, x, timeout_ms=10_000).result(timeout=30)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    assert forward.stats()["requests"] == 80
    assert ex.stats()["inflight"] == 0
    forward.close()


def test_independent_branches_overlap():
    @node(outputs="a")
    def left(x: int) -> int:
        time.sleep(0.05)
        return x

    @node(outputs="b")
    def right(x: int) -> int:
        time.sleep(0.05)
        return x

    @node(outputs="y")
    def join(a: int, b: int) -> int:
        return a + b

    pipe = Pipeline("branches", ["x"], [left, right, join], ["y"])
    with Executor(cpu_workers=2) as ex:
        ex.run(pipe, {"x": 1})  # learns that the branches are long enough to fan out
        t = time.perf_counter()
        assert ex.run(pipe, {"x": 2}) == {"y": 4}
        assert time.perf_counter() - t < 0.09


# ---- deadlines and failures
# ------------------------------------------------------------------------------


@node(outputs="slept")
def nap(ms: float) -> float:
    time.sleep(ms / 1000)
    return ms


@node(outputs="done")
def after_nap(slept: float) -> str:
    return f"slept {slept}"


def test_deadline_fails_only_that_request(ex):
    pipe = Pipeline("nap", {"ms": float}, [nap, after_nap], ["done"])
    slow = ex.submit(pipe, {"ms": 80.0}, timeout_ms=20)
    fast = [ex.submit(pipe, {"ms": 1.0}, timeout_ms=5_000) for _ in range(8)]
    with pytest.raises(
        DeadlineExceeded, match=r"deadline of 20 ms cannot be met before node 'after_nap'"
    ) as e:
        slow.result(timeout=10)
    assert e.value.node == "after_nap" and e.value.pipeline == "nap"
    assert [f.result(timeout=10) for f in fast] == [{"done": "slept 1.0"}] * 8
    assert ex.stats()["errors"] == {"nap:deadline": 1}


def test_deadline_fails_fast_before_work_that_cannot_make_it(ex):
    calls = []

    @node(outputs="slept")
    def counted_nap(ms: float) -> float:
        calls.append(ms)
        time.sleep(ms / 1000)
        return ms

    pipe = Pipeline("nap2", {"ms": float}, [counted_nap, after_nap], ["done"])
    for _ in range(3):
        ex.run(pipe, {"ms": 30.0}, timeout_ms=1_000)  # the executor learns ~30 ms
    assert ex.estimate_ms(pipe) > 20
    t = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match=r"before node 'counted_nap'.*estimated rest"):
        ex.run(pipe, {"ms": 30.0}, timeout_ms=10)
    assert (
        time.perf_counter() - t < 0.025 and len(calls) == 3
    )  # dropped without running the 30 ms node
    with pytest.raises(DeadlineExceeded, match="leaves no time"):
        ex.run(pipe, {"ms": 1.0}, timeout_ms=0)


def test_finished_requests_leave_no_reference_cycles(ex):
    """A request that ended — answered, failed by its deadline, or cancelled, awaited directly or
    through `asyncio.wrap_future` as the server does — is freed by reference counting. A cycle
    per request (its Future and context referred to each other) left every request's graph to the
    collector: on the H200 each full collection walked the W5 requests piled up since the last
    one for 0.5-1.3 s under load (BENCHMARKS.md, 2026-12-02)."""
    pipe = demo_pipeline()
    naps = Pipeline("nap", {"ms": float}, [nap, after_nap], ["done"])
    ex.run(pipe, {"text": "warm"})
    ex.run(naps, {"ms": 0.0})

    async def awaited() -> list:
        futures = [asyncio.wrap_future(ex.submit(pipe, {"text": f"async {i}"})) for i in range(8)]
        return await asyncio.wait_for(asyncio.gather(*futures), 10)

    gc.collect()
    gc.disable()
    try:
        for i in range(20):
            ex.submit(pipe, {"text": f"request {i}"}).result(timeout=10)
        late = ex.submit(naps, {"ms": 80.0}, timeout_ms=20)
        assert isinstance(late.exception(timeout=10), DeadlineExceeded)
        gone = ex.submit(naps, {"ms": 50.0})
        assert gone.cancel()
        assert len(asyncio.run(awaited())) == 8
        deadline = time.monotonic() + 10
        while "nap:cancelled" not in ex.stats()["errors"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the cancelled request's end is accounted on a worker
        del late, gone
        assert ex.stats()["errors"].get("nap:cancelled") == 1
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_failing_custom_node_is_isolated(ex):
    @node(outputs="checked")
    def business_rule(score: float) -> float:
        if score > 1000:
            raise ValueError(f"score {score} out of range")
        return score

    pipe = demo_pipeline().extend(business_rule, outputs=["checked"])
    with pytest.raises(
        NodeError, match=r"node 'business_rule' failed: ValueError: score .* out of range"
    ) as e:
        ex.run(pipe, {"text": "x" * 100})
    assert e.value.node == "business_rule" and isinstance(e.value.__cause__, ValueError)
    futs = [ex.submit(pipe, {"text": "x" * (50 if i % 4 == 0 else 1)}) for i in range(20)]
    outcomes = [
        type(f.exception(timeout=10)).__name__ if f.exception(timeout=10) else "ok" for f in futs
    ]
    assert outcomes == ["NodeError" if i % 4 == 0 else "ok" for i in range(20)]
    assert ex.run(pipe, {"text": "ab"}) == call_directly(pipe, {"text": "ab"})  # still serving


def test_bad_inputs_are_rejected_clearly(ex):
    pipe = demo_pipeline()
    with pytest.raises(ValueError, match=r"needs input 'text'"):
        ex.run(pipe, {"txt": "a"})
    with pytest.raises(ValueError, match=r"unknown input\(s\) 'extra'"):
        ex.run(pipe, {"text": "a", "extra": 1})
    bad = Node("two", lambda text: 1, inputs=["text"], outputs=["a", "b"])
    with pytest.raises(
        NodeError, match=r"node 'two' failed: TypeError: must return a tuple of 2 values"
    ):
        ex.run(Pipeline("bad", ["text"], [bad], ["a"]), {"text": "a"})


# ---- user nodes
# ----------------------------------------------------------------------------------------


def test_user_post_logic_node_extends_a_pipeline(ex):
    @node(outputs="top")
    def top_n(scores: list[float], n: int) -> list[int]:
        return sorted(range(len(scores)), key=lambda i: -scores[i])[:n]

    base = Pipeline(
        "scorer",
        {"items": list},
        [
            node_from_function(
                lambda items: [len(s) / 10 for s in items], name="score", outputs="scores"
            )
        ],
        ["scores"],
    )
    pipe = base.with_inputs(n=int).extend(top_n, outputs=["scores", "top"])
    out = ex.run(pipe, {"items": ["aaa", "a", "aaaaa", "aa"], "n": 2})
    assert out == {"scores": [0.3, 0.1, 0.5, 0.2], "top": [2, 0]}


# ---- memory pools
# --------------------------------------------------------------------------------------


def test_allocation_counters_flat_after_warmup():
    @node(outputs="packed")
    def pack(tokens: list[int], ctx) -> torch.Tensor:
        ids = ctx.lease.host(ctx._executor.pools.bucket(len(tokens)), torch.int64)
        ids[: len(tokens)] = torch.as_tensor(tokens)
        return ctx.lease.stage(ids[: len(tokens)])

    @node(outputs="total", kind="device")
    def reduce(packed: torch.Tensor, ctx) -> int:
        scratch = ctx.lease.device((4, 8), torch.float32)
        scratch.zero_()
        return int(packed.sum())

    pipe = Pipeline("pooled", {"text": str}, [tokenize, pack, reduce], ["total"])
    with Executor(cpu_workers=2) as ex:
        texts = ["a" * (i % 300 + 1) for i in range(64)]
        # Warm-up: every bucket the pipeline can use, as many copies as requests in flight (5) can
        # hold.
        buckets = sorted({ex.pools.bucket(len(t)) for t in texts})
        ex.pools.host.warm([((b,), torch.int64) for b in buckets], copies=10)
        ex.pools.device_pool.warm([((4, 8), torch.float32)], copies=5)
        ex.pools.device_pool.warm(
            [((b,), torch.int64) for b in buckets], copies=5
        )  # staging (CUDA)
        for t in texts:
            ex.run(pipe, {"text": t})
        before = ex.pools.stats()
        futs = []
        for i in range(1000):
            t = texts[i % len(texts)]
            if i % 2:
                futs.append(ex.submit(pipe, {"text": t}))
            else:
                assert ex.run(pipe, {"text": t}) == {"total": sum(ord(c) % 97 for c in t)}
            if len(futs) >= 4:
                futs.pop(0).result(timeout=10)
        for f in futs:
            f.result(timeout=10)
        after = ex.pools.stats()
    assert after["allocations"] == before["allocations"], (
        before,
        after,
    )  # flat: no allocator calls
    staged_on_device = 1000 if ex.device.type == "cuda" else 0
    assert after["reuses"] - before["reuses"] == 3 * 1000 + staged_on_device  # pack, stage, scratch


# ---- batching
# ------------------------------------------------------------------------------------------


def test_batching_merges_concurrent_requests_and_splits_back():
    pipe, forward = _batching_pipeline(max_wait_ms=50.0, token_budget=1000)
    with Executor(cpu_workers=4, trace_requests=32) as ex:
        futs = [ex.submit(pipe, {"n": n}) for n in range(12)]
        results = [f.result(timeout=10) for f in futs]
    assert results == [call_directly(pipe, {"n": n}) for n in range(12)]
    assert results[3] == {"total": [61.0, 63.0, 65.0, 67.0]}
    s = forward.stats()
    assert s["requests"] == 12 and s["batches"] < 12 and s["max_requests_in_batch"] > 1
    forward.close()


def test_batching_respects_token_budget():
    pipe, forward = _batching_pipeline(max_wait_ms=50.0, token_budget=6)
    with Executor(cpu_workers=4) as ex:
        futs = [ex.submit(pipe, {"n": 4}) for _ in range(6)]  # 5 rows each: one request per batch
        assert all(f.result(timeout=10) == call_directly(pipe, {"n": 4}) for f in futs)
    assert forward.stats()["max_requests_in_batch"] == 1 and forward.stats()["batches"] == 6
    forward.close()


def test_batching_error_fails_every_request_of_that_batch_only():
    def merge(items):
        return [it["x"] for it in items], len(items)

    def fn(xs):
        if "boom" in xs:
            raise RuntimeError("bad batch")
        return [x.upper() for x in xs]

    fwd = BatchingNode(
        "upper", fn, ["x"], ["y"], merge=merge, split=lambda out, n: out, max_wait_ms=0
    )
    pipe = Pipeline("up", ["x"], [fwd], ["y"])
    with Executor(cpu_workers=2) as ex:
        with pytest.raises(NodeError, match=r"node 'upper' failed: RuntimeError: bad batch"):
            ex.run(pipe, {"x": "boom"})
        assert ex.run(pipe, {"x": "ok"}) == {"y": "OK"}
    fwd.close()


# ---- observability
# -------------------------------------------------------------------------------------


def test_histograms_and_chrome_trace(ex, tmp_path):
    pipe = demo_pipeline()
    for i in range(10):
        ex.run(pipe, {"text": "abc" * (i + 1)})
    with pytest.raises(NodeError):
        ex.run(pipe, {"text": None})
    stats = ex.stats()["nodes"]["demo"]
    assert set(stats) == {"tokenize", "model", "features", "post", "<request>"}
    assert stats["tokenize"]["count"] == 10 and stats["post"]["count"] == 10
    assert (
        0
        < stats["model"]["p50_us"]
        <= stats["model"]["p99_us"]
        <= stats["model"]["max_us"] * 1.0001 + 1
    )
    path = ex.tracer.export_chrome(tmp_path / "trace.json")
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans if e["cat"] == "node"} == {
        "tokenize",
        "model",
        "features",
        "post",
    }
    requests = [e for e in spans if e["cat"] == "request"]
    assert len(requests) == 11 and requests[-1]["args"]["status"] == "error"
    for e in spans:
        assert e["dur"] >= 0 and isinstance(e["ts"], float) and isinstance(e["pid"], int)
    # each request's node spans lie inside its request span
    by_req = {e["args"]["request"]: e for e in requests}
    for e in spans:
        if e["cat"] == "node":
            r = by_req[e["args"]["request"]]
            assert r["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1


def test_device_nodes_fall_back_to_cpu_without_cuda():
    with Executor(cpu_workers=1, device="cpu") as ex:
        assert ex.streams == []
        assert ex.run(demo_pipeline(), {"text": "hi"}) == call_directly(
            demo_pipeline(), {"text": "hi"}
        )
        assert model.kind is NodeKind.DEVICE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_nodes_on_streams_with_events():
    @node(outputs="x", kind="device")
    def make(n: int, ctx) -> torch.Tensor:
        assert ctx.stream is not None and torch.cuda.current_stream() == ctx.stream
        return torch.arange(n, device="cuda", dtype=torch.float32)

    @node(outputs="y", kind="device")
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    @node(outputs="z", kind="device")
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @node(outputs="total")
    def total(y: torch.Tensor, z: torch.Tensor) -> float:
        return float((y + z).sum().item())

    pipe = Pipeline("gpu", {"n": int}, [make, square, double, total], ["total"])
    with Executor(cpu_workers=4, device_streams=4) as ex:
        futs = [ex.submit(pipe, {"n": n}) for n in range(1, 200)]
        for n, f in zip(range(1, 200), futs):
            expect = sum(i * i + 2 * i for i in range(n))
            assert f.result(timeout=30) == {"total": float(expect)}


def test_trace_cli_writes_chrome_trace(tmp_path, capsys):
    from boundgen.cli import main

    out = tmp_path / "demo.json"
    stats = tmp_path / "stats.json"
    assert (
        main(
            [
                "trace",
                "--workload",
                "demo",
                "--requests",
                "6",
                "--concurrency",
                "2",
                "--out",
                str(out),
                "--stats-json",
                str(stats),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "forward" in printed and "6 ok, 0 failed" in printed
    events = json.loads(out.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("cat") == "request") == 6
    assert json.loads(stats.read_text())["demo"]["forward"]["count"] == 6


def test_latency_histogram_counts_sums_and_keeps_the_max_per_thread():
    """`record_ns` reads the thread's shard directly (made on its first record) and keeps the
    max by comparison: the merged snapshot counts every record of every thread."""
    from boundgen.runtime.trace import LatencyHistogram

    h = LatencyHistogram()
    h.record_ns(5_000)
    h.record_ns(2_000)
    other = threading.Thread(target=h.record_ns, args=(9_000,))
    other.start()
    other.join()
    snap = h.snapshot()
    assert snap["count"] == 3
    assert snap["max_us"] == 9.0
    assert snap["mean_us"] == pytest.approx(16.0 / 3)
    assert sum(n for _, n in h.buckets()) == 3
