"""Built-in pipelines over a tiny Engine: parity with the direct Engine calls, cross-request
batching under 16 concurrent clients, input errors, deadlines, and a user post-logic node on top
of score."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from boundgen.runtime import DeadlineExceeded, NodeError, node
from boundgen.workloads.beam import BeamRequest
from boundgen.workloads.classify import ClassifyRequest
from boundgen.workloads.embed import EmbedRequest, MLPHead
from boundgen.workloads.registry import build_pipelines
from boundgen.workloads.score import ScoreRequest
from boundgen.workloads.service import EngineRuntime
from boundgen.workloads.trie import Trie

QUERY = "the user searched for running shoes"
ITEMS = [
    "trail shoes",
    "red running shoes size 42",
    "a book",
    "socks",
    "shoes for running fast on roads",
]
LABELS = [5, 7, 11]


def _close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=tol, rtol=0)


def _runtime(engine, max_wait_ms: float = 0.0, **kw) -> EngineRuntime:
    context = engine.workload_context()
    context.max_wait_ms = max_wait_ms
    return EngineRuntime(context, **kw)


def _score(rt, *args, timeout_ms=None, **kw):
    return rt.run("score", ScoreRequest(*args, **kw), timeout_ms)


def _embed(rt, texts, **kw):
    return rt.run("embed", EmbedRequest(texts, **kw))


def _beam(rt, prompt, width, steps, trie=None):
    return rt.run("beam", BeamRequest([prompt], width, steps, trie=trie))[0]


@pytest.fixture(scope="module")
def runtime(engine_for):
    rt = _runtime(engine_for("qwen2"), max_wait_ms=5.0, cpu_workers=4, trace_requests=256)
    yield rt
    rt.close()


def test_pipelines_match_engine(runtime, engine_for):
    """A runtime that batches across requests (5 ms window) answers like the engine's own calls."""
    eng = engine_for("qwen2")
    assert set(build_pipelines(eng.workload_context())) == {"score", "classify", "embed", "beam"}
    for softmax in (False, True):
        for item_first in (False, True):
            assert _close(
                _score(runtime, QUERY, ITEMS, LABELS, softmax, item_first),
                eng.score(QUERY, ITEMS, LABELS, softmax, item_first),
            )
    for pooling in ("last", "mean"):
        assert _close(
            _embed(runtime, ITEMS, pooling=pooling, normalize=True),
            eng.embed(ITEMS, pooling=pooling, normalize=True),
        )
    assert _beam(runtime, "hello there", 4, 3) == eng.beam_search("hello there", 4, 3)
    trie = Trie.from_sequences([[1, 2, 3], [1, 2, 4], [5, 6, 7], [5, 8, 9]])
    assert _beam(runtime, "hello", 3, 3, trie=trie) == eng.beam_search("hello", 3, 3, trie=trie)
    # request objects and dicts work through the generic entry points too
    assert _close(
        runtime.run("score", {"query": QUERY, "items": ITEMS, "label_token_ids": LABELS}),
        eng.score(QUERY, ITEMS, LABELS),
    )


def test_classify_pipeline(engine_for):
    eng = engine_for("qwen2", seq_cls=3)
    with _runtime(eng, cpu_workers=2) as rt:
        logits = rt.run("classify", ClassifyRequest(ITEMS))
        assert _close(logits, eng.classify(ITEMS))
        probs = rt.run("classify", ClassifyRequest(ITEMS, softmax=True))
        assert _close(probs, torch.softmax(torch.tensor(logits), -1))
        with pytest.raises(ValueError, match="needs a \\*ForCausalLM"):
            _score(rt, QUERY, ITEMS, LABELS)


def test_embed_with_mlp_head_node(runtime, engine_for):
    eng = engine_for("qwen2")
    torch.manual_seed(0)
    head = MLPHead([eng.config.hidden_size, 8, 2], "relu", "sigmoid")
    out = runtime.run("embed", EmbedRequest(ITEMS), head=head)
    assert out.shape == (len(ITEMS), 2)
    assert _close(out, eng.embed(ITEMS, head=head))
    # a dict request (as the server sends) may carry pipeline inputs such as `head` beside its
    # fields
    assert _close(runtime.run("embed", {"texts": ITEMS, "head": head}), out)
    assert [p.node.name for p in runtime.pipelines["embed"].plan] == [
        "prepare",
        "forward",
        "mlp_head",
    ]


def test_16_clients_mixed_requests_match_sequential_and_get_batched(runtime, engine_for):
    eng = engine_for("qwen2")
    work = []
    for i in range(64):
        items = ITEMS[: i % 5 + 1]
        kind = ("score", "embed", "beam", "score")[i % 4]
        if kind == "score":
            work.append(
                ("score", ScoreRequest(f"{QUERY} {i}", items, LABELS, apply_softmax=i % 2 == 0))
            )
        elif kind == "embed":
            pooling = ("last", "mean", "tokens")[i % 12 // 4]  # per-token rows merge with the rest
            work.append(("embed", EmbedRequest(items, pooling=pooling)))
        else:
            work.append(("beam", BeamRequest([f"prompt {i}"], 2 + i % 3, 2)))
    expected = []
    for kind, req in work:
        if kind == "score":
            expected.append(eng.score(req.query, req.items, req.label_token_ids, req.apply_softmax))
        elif kind == "embed":
            expected.append(eng.embed(req.texts, pooling=req.pooling))
        else:
            expected.append(eng.beam_search_batch(req.prompts, req.beam_width, req.steps))
    before = runtime.stats()["batching"]["forward"]["batches"]
    results = [None] * len(work)

    def client(k):
        for i in range(k, len(work), 16):
            kind, req = work[i]
            if i % 2:
                results[i] = runtime.run(kind, req, timeout_ms=60_000)
            else:
                results[i] = runtime.submit(kind, req, timeout_ms=60_000).result(timeout=60)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (kind, _), got, want in zip(work, results, expected):
        if kind == "beam":
            assert [t for t, _ in got[0]] == [t for t, _ in want[0]]
            assert _close([s for _, s in got[0]], [s for _, s in want[0]], 1e-4)
        elif isinstance(want, list):  # per-token embeddings: one [L, H] per text
            assert len(got) == len(want) and all(map(_close, got, want))
        else:
            assert _close(got, want), kind
    stats = runtime.stats()["batching"]["forward"]
    assert stats["max_requests_in_batch"] > 1  # concurrent requests were merged into one forward
    assert stats["batches"] - before < 48  # 48 forward requests (score + embed) in fewer batches


def test_input_errors_are_value_errors_and_runtime_keeps_serving(runtime):
    with pytest.raises(ValueError, match="items is empty"):
        _score(runtime, QUERY, [], LABELS)
    with pytest.raises(ValueError, match="Token ID 1000000000 is out of vocabulary range"):
        _score(runtime, QUERY, ITEMS, [10**9])
    with pytest.raises(ValueError, match="unknown pipeline 'nope'"):
        runtime.run("nope", {})
    with pytest.raises(ValueError, match="unknown pooling"):
        _embed(runtime, ITEMS, pooling="max")
    assert len(_score(runtime, QUERY, ITEMS, LABELS)) == len(ITEMS)


def test_deadline_on_engine_pipeline(runtime):
    with pytest.raises(DeadlineExceeded, match="pipeline 'score'"):
        _score(runtime, QUERY, ITEMS, LABELS, timeout_ms=0.001)
    assert len(_score(runtime, QUERY, ITEMS, LABELS, timeout_ms=60_000)) == len(ITEMS)


def test_user_post_logic_on_score_pipeline(runtime, engine_for):
    """Business post-logic as a plain function: calibrate, filter, top-n — registered as
    'rerank'."""

    @node(outputs="ranked")
    def calibrate_and_rank(scores: list, top_n: int, min_score: float) -> list:
        calibrated = [1 / (1 + 2.718281828 ** -(s[0] - s[1])) for s in scores]
        keep = [(i, p) for i, p in enumerate(calibrated) if p >= min_score]
        return sorted(keep, key=lambda ip: -ip[1])[:top_n]

    rerank = (
        runtime.pipelines["score"]
        .with_inputs(top_n=int, min_score=float, defaults={"min_score": 0.0})
        .extend(calibrate_and_rank, outputs=["ranked"], name="rerank")
    )
    runtime.register("rerank", rerank)
    try:
        req = ScoreRequest(QUERY, ITEMS, LABELS[:2])
        ranked = runtime.run("rerank", req, top_n=3)
        scores = engine_for("qwen2").score(QUERY, ITEMS, LABELS[:2])
        probs = [1 / (1 + 2.718281828 ** -(a - b)) for a, b in scores]
        assert [i for i, _ in ranked] == sorted(range(len(ITEMS)), key=lambda i: -probs[i])[:3]

        @node(outputs="ranked2")
        def broken(ranked: list) -> list:
            raise KeyError("business rule table missing")

        runtime.register("broken", rerank.extend(broken, outputs=["ranked2"]))
        with pytest.raises(NodeError, match=r"node 'broken' failed: KeyError"):
            runtime.run("broken", req, top_n=3)
        assert runtime.run("rerank", req, top_n=2, min_score=0.0) == ranked[:2]  # still serving
    finally:
        runtime.pipelines.pop("rerank", None)
        runtime.pipelines.pop("broken", None)


def test_trace_of_engine_requests(runtime, tmp_path):
    runtime.executor.tracer.clear()
    _score(runtime, QUERY, ITEMS, LABELS)
    _embed(runtime, ITEMS)
    import json

    runtime.export_trace(tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in data["traceEvents"] if e.get("cat") == "node"}
    assert {"prepare", "forward", "head", "finish", "mlp_head"} <= names
    fwd = [e for e in data["traceEvents"] if e.get("name") == "forward"]
    assert all("batch_requests" in e["args"] for e in fwd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pipelines_on_cuda(tiny_model):
    from boundgen import Engine

    # float32 on CUDA needs the reference attention backend (varlen/flash takes fp16/bf16 only)
    eng = Engine.from_pretrained(
        tiny_model("qwen2"), device="cuda", dtype="float32", attention="reference"
    )
    with _runtime(eng, max_wait_ms=2.0) as rt:
        futs = [
            rt.submit("score", ScoreRequest(QUERY, ITEMS[: i % 5 + 1], LABELS)) for i in range(32)
        ]
        for i, f in enumerate(futs):
            assert _close(f.result(timeout=60), eng.score(QUERY, ITEMS[: i % 5 + 1], LABELS), 1e-4)
        for i in range(20):  # warm-up: every staging bucket these sizes use
            _score(rt, QUERY, ITEMS[: i % 5 + 1], LABELS)
        before = rt.executor.pools.stats()["allocations"]
        for i in range(200):
            _score(rt, QUERY, ITEMS[: i % 5 + 1], LABELS)
        assert rt.executor.pools.stats()["allocations"] == before  # pinned/device staging reused


def test_staged_views_start_on_16_byte_boundaries():
    """AOTInductor kernels assume 16-byte aligned inputs (else a copy + warning per call): the
    packed staging buffer must place every tensor, e.g. cu_prefix after a 129-entry cu_seqlens,
    on a boundary."""
    from boundgen.runner import _stage_many
    from boundgen.runtime.memory import Lease, MemoryPools

    lease = Lease(MemoryPools("cpu"))
    ints = [
        torch.arange(129, dtype=torch.int32),
        torch.tensor([0, 256, 300], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
        torch.arange(6, dtype=torch.int32).view(2, 3),
    ]
    out = _stage_many(ints, torch.int32, lease)
    for src, got in zip(ints, out):
        assert got.data_ptr() % 16 == 0
        assert torch.equal(got, src)
    lease.release_all()


def test_runner_per_token_rows_next_to_pooled_rows(engine_for):
    """`ModelRunner.rows` with "tokens" beside "last"/"mean" rows in one call, a shared-prefix
    group among them: each sequence's rows are what it gives alone."""
    from boundgen.text.packing import SequenceGroup

    runner = engine_for("qwen2").runner
    prefix, suffixes = [5, 6, 7, 8], [[9, 10], [11], [12, 13, 14]]
    plain = [[20, 21, 22], [23]]
    groups = [SequenceGroup(prefix, suffixes), SequenceGroup([], plain)]
    modes = ["tokens", "last", "mean", "tokens", "last"]
    rows = runner.rows(groups, modes)
    seqs = [prefix + s for s in suffixes] + plain
    assert rows.shape[0] == len(seqs[0]) + 1 + 1 + len(seqs[3]) + 1
    alone = [runner.rows([SequenceGroup([], [s])], "tokens") for s in seqs]
    want = [alone[0], alone[1][-1:], alone[2].mean(0, keepdim=True), alone[3], alone[4][-1:]]
    assert _close(rows, torch.cat(want), 1e-5)


def test_engine_config_sets_the_batching_knobs(tiny_model):
    """`EngineConfig`'s batching knobs reach the model node the score, classify and embed share."""
    from boundgen import Engine

    eng = Engine.from_pretrained(
        tiny_model("qwen2"),
        device="cpu",
        dtype="float32",
        batch_token_budget=512,
        batch_max_wait_ms=3.0,
        batch_latency_target_ms=40.0,
        batch_device_depth=3,
    )
    node = eng.workload_context().forward
    assert (node.token_budget, node.max_wait_ns, node.latency_target_ms) == (512, 3_000_000, 40.0)
    assert node.device_depth == 3


class _TorchCalls(TorchFunctionMode):
    """The names of the torch calls made inside it (`t.device` and other attribute reads left
    out: no op, the GIL kept)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_the_score_and_classify_finish_is_one_torch_call():
    """A request's `finish` reads its head's result on the host: `tolist` alone, which keeps the
    GIL for a host tensor, where a `.cpu()` first gave it up (W5's slowest 1 % spent 10–18 ms in
    `finish` on the H100, 2026-12-05) — and the lists are the tensor's values."""
    from boundgen.workloads.classify import finish_classify
    from boundgen.workloads.score import finish_score

    scores = torch.rand(4, 3, generator=torch.Generator().manual_seed(0))
    for finish, request in (
        (finish_score, ScoreRequest([1], [[2]], [3, 4, 5])),
        (finish_classify, ClassifyRequest(["a"])),
    ):
        with _TorchCalls() as calls:
            got = finish(scores, request)
        assert calls.names == ["tolist"]
        assert got == scores.tolist()


def test_the_score_head_of_a_seen_label_set_is_two_torch_calls(engine_for):
    """On a server each torch call of a request's nodes gives the GIL up and, beside a busy event
    loop, waits up to the switch interval (5 ms) to take it back (`benchmarks/count_gil_trips.py`).
    The head of a request whose label ids were seen before makes one GEMM over the kept weight
    rows and one softmax computed in float32 (on CUDA one copy to the host more), and scores as
    the model's float32 label logits softmaxed."""
    from boundgen.workloads.score import request_scores

    engine = engine_for("qwen2")
    rows = torch.randn(
        5, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    request = ScoreRequest([1, 2], [[3], [4]], [5, 7, 11], apply_softmax=True)
    first = request_scores(engine.runner, rows, request)  # keeps the label set's weight rows
    with _TorchCalls() as calls:
        again = request_scores(engine.runner, rows, request)
    assert calls.names == ["linear", "softmax"]
    want = torch.softmax(engine.model.head(rows, torch.tensor([5, 7, 11])), dim=-1)
    assert torch.equal(first, again)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_the_forward_node_merges_late_only_when_configured(engine_for, monkeypatch):
    """`EngineConfig.batch_late_merge` reaches the forward node (off by default)."""
    import dataclasses

    eng = engine_for("qwen2")
    assert eng.workload_context().forward.late_merge is False
    late = dataclasses.replace(eng.engine_config, batch_late_merge=True)
    monkeypatch.setattr(eng, "engine_config", late)
    assert eng.workload_context().forward.late_merge is True
