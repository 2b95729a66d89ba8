"""Staged bucket inputs (issue 25, `compile/staging.py`): one host buffer, one copy, one replay per
small request. On CPU the same buffers, views and copies run without a CUDA graph (the bucket's
forward is called over the staged views), so these tests prove the layout, the reuse and the
results; the GPU side (pinned memory, the captured graph) is `benchmarks/profile_host.py --w3`."""

from __future__ import annotations

import itertools

import pytest
import torch

from boundgen.compile.backends import CompiledForwards, _eager_fns
from boundgen.compile.buckets import Bucket, parse_buckets
from boundgen.compile.staging import StagedBucket, StagedInputs
from boundgen.runner import ModelRunner
from boundgen.text.packing import SequenceGroup

W3_BUCKET = "t64-s4-m64"
CASCADE = "t64-s8-m64-g2-p32-q16"


def _ids(gen, n, vocab=500):
    return torch.randint(1, vocab, (n,), generator=gen).tolist()


def _staged_runner(engine, specs=(W3_BUCKET, CASCADE), rows=None, copy_in_graph=None):
    buckets = parse_buckets(list(specs))
    eager = _eager_fns(engine.model, buckets)
    fns = {
        b: StagedBucket(eager[b], b, engine.device, rows=rows, copy_in_graph=copy_in_graph)
        for b in buckets
    }
    return ModelRunner(engine.model, engine.device, CompiledForwards("staged", buckets, fns, False))


def _staged(runner, spec) -> StagedBucket:
    return runner.forwards.fns[Bucket.parse(spec)]


@pytest.mark.parametrize("spec", [W3_BUCKET, CASCADE, "t2048-s128-m512-g2-p320-q1728"])
def test_layout_one_buffer_aligned_views(spec):
    """Every input is a view of the one staged buffer (and of the one host buffer), on a 16-byte
    boundary, disjoint from the others; the static batch has the bucket's exact shapes and ints."""
    bucket = Bucket.parse(spec)
    inputs = StagedInputs(bucket, "cpu")
    spans = []
    for name, view in inputs.views.items():
        host = inputs.host_views[name]
        assert view.untyped_storage().data_ptr() == inputs.staged.untyped_storage().data_ptr()
        assert host.untyped_storage().data_ptr() == inputs.host.untyped_storage().data_ptr()
        assert view.data_ptr() % 16 == 0 and host.data_ptr() % 16 == 0
        start = view.data_ptr() - inputs.staged.data_ptr()
        spans.append((start, start + view.numel() * view.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and spans[-1][1] <= inputs.nbytes
    example = bucket.example()
    batch = inputs.batch
    assert batch.input_ids.shape == example.input_ids.shape == batch.positions.shape
    assert batch.attn.cu_seqlens.shape == example.attn.cu_seqlens.shape
    for field in ("max_seqlen", "max_prefix", "max_group_q", "num_prefix_tokens"):
        assert getattr(batch.attn, field) == getattr(example.attn, field)
    if bucket.cascade:
        assert batch.attn.cu_prefix.shape == example.attn.cu_prefix.shape
    assert inputs.rows.shape == (bucket.segments,) and inputs.capacity == bucket.segments


def test_w3_request_one_fill_one_copy_and_eager_rows(engine_for):
    """A W3-shaped request (one 64-token prompt) runs its bucket's staged forward: one fill and
    one copy, no pooled staging buffer, the rows eager gives."""
    engine = engine_for("qwen2")
    runner = _staged_runner(engine)
    staged = _staged(runner, W3_BUCKET)
    groups = [SequenceGroup([], [_ids(torch.Generator().manual_seed(3), 64)])]
    before = staged.inputs.stats()
    got = runner.rows(groups)
    after = staged.inputs.stats()
    assert (after["fills"], after["copies"]) == (before["fills"] + 1, before["copies"] + 1)
    assert staged.replays == 1
    assert runner.pools.stats()["allocations"] == 0 and runner.pools.stats()["reuses"] == 0
    torch.testing.assert_close(got, engine.runner.rows(groups), rtol=1e-4, atol=1e-4)
    assert runner.stats()["batches"] == {W3_BUCKET: 1}


def test_reused_without_reallocation(engine_for):
    """Many calls of one bucket: the same two buffers every time (no allocation, no pooled buffer),
    one copy per call, never a wait on CPU."""
    engine = engine_for("qwen2")
    runner = _staged_runner(engine)
    staged = _staged(runner, W3_BUCKET)
    ptrs = (staged.inputs.host.data_ptr(), staged.inputs.staged.data_ptr())
    g = torch.Generator().manual_seed(1)
    start = staged.inputs.stats()
    for n in (64, 5, 33, 64, 1, 17):
        runner.rows([SequenceGroup([], [_ids(g, n)])])
    s = staged.inputs.stats()
    assert s["copies"] - start["copies"] == 6 and s["fills"] - start["fills"] == 6
    assert s["allocations"] == 2 and s["waits"] == 0
    assert (staged.inputs.host.data_ptr(), staged.inputs.staged.data_ptr()) == ptrs
    assert runner.pools.stats()["allocations"] == 0
    assert runner.stats()["staged"]["copies"] == sum(
        f.inputs.copies for f in runner.forwards.fns.values()
    )


def test_smaller_request_after_bigger_one_sees_no_stale_data(engine_for):
    """A 10-token request after a 3-sequence 64-token one in the same bucket: every input field is
    rewritten (pad tokens id 0, position 0, unused gather rows 0) and its rows equal those of a
    fresh staged runner exactly, and eager's."""
    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(7)
    big = [SequenceGroup([], [_ids(g, 20), _ids(g, 20), _ids(g, 24)])]
    small = [SequenceGroup([], [_ids(g, 10)])]
    runner = _staged_runner(engine)
    runner.rows(big)
    got = runner.rows(small)
    inputs = _staged(runner, W3_BUCKET).inputs
    host = inputs.host_views
    assert host["input_ids"][10:].eq(0).all() and host["positions"][10:].eq(0).all()
    assert host["rows"].tolist() == [9, 0, 0, 0]
    assert torch.equal(inputs.staged, inputs.host)  # the device copy is the host buffer's
    fresh = _staged_runner(engine).rows(small)
    assert torch.equal(got, fresh)
    torch.testing.assert_close(got, engine.runner.rows(small), rtol=1e-4, atol=1e-4)


def test_a_beam_search_s_prompts_staged_with_their_lengths():
    """`lengths=True` (a whole-search bucket's inputs, `compile.decode.SearchGraphs`): the
    prompts' ids, positions, segments, last rows and lengths are what padding their packed
    batch gives, a later smaller fill leaves nothing of an earlier one, and rows past a fill are
    length 1 (a pad prompt's)."""
    from boundgen.compile.buckets import BucketSet
    from boundgen.text.packing import pack, pack_arrays

    bucket = Bucket.parse("t64-s8-m64")
    inputs = StagedInputs(bucket, "cpu", rows=4, lengths=True)
    assert inputs.host_views["lengths"].shape == (4,) and inputs.allocations == 2
    g = torch.Generator().manual_seed(3)
    for lens in [(20, 30, 5, 9), (7, 1), (12,)]:
        group = SequenceGroup([], [_ids(g, n) for n in lens])
        k = inputs.fill(pack_arrays([group], share_prefix=False))
        inputs.copy()
        _, want = BucketSet([bucket]).pad(pack([group], share_prefix=False))
        v = inputs.views
        assert k == len(lens)
        assert torch.equal(v["input_ids"], want.input_ids)
        assert torch.equal(v["positions"], want.positions)
        assert torch.equal(v["cu_seqlens"], want.attn.cu_seqlens)
        assert torch.equal(v["rows"][:k], want.last_index)
        assert v["lengths"].tolist() == list(lens) + [1] * (4 - k)
    assert inputs.copies == 3 and inputs.allocations == 2


def test_cascade_bucket_rows(engine_for):
    """A shared-prefix group staged into a cascade bucket (cu_prefix, cu_group_q in the buffer):
    eager's rows; then a plain request in the same bucket (its cascade part all padding)."""
    engine = engine_for("qwen2")
    runner = _staged_runner(engine, (CASCADE,))
    g = torch.Generator().manual_seed(2)
    shared = [SequenceGroup(_ids(g, 20), [_ids(g, 4), _ids(g, 6), _ids(g, 3)])]
    plain = [SequenceGroup([], [_ids(g, 5), _ids(g, 6)])]
    for groups in (shared, plain, shared):
        torch.testing.assert_close(
            runner.rows(groups), engine.runner.rows(groups), rtol=1e-4, atol=1e-4
        )
    assert _staged(runner, CASCADE).inputs.copies == 1 + 3


def test_other_poolings_and_too_many_rows_take_the_general_path(engine_for):
    """Mean and per-token rows, and more rows than the gather holds, run the bucket through its
    call (inputs assigned from the pooled staging, no staged copy): the same rows as eager."""
    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(4)
    groups = [SequenceGroup([], [_ids(g, 7), _ids(g, 11)])]
    runner = _staged_runner(engine, (W3_BUCKET,), rows=1)
    staged = _staged(runner, W3_BUCKET)
    copies = staged.inputs.copies
    for pooling in ("mean", "tokens", "last"):
        torch.testing.assert_close(
            runner.rows(groups, pooling),
            engine.runner.rows(groups, pooling),
            rtol=1e-4,
            atol=1e-4,
        )
    assert staged.inputs.copies == copies and staged.replays == 3


def test_engine_score_through_staged_buckets(engine_for):
    """`Engine.score` over a staged runner: the eager engine's results; after the first call the
    label columns are kept on the device, so a call takes no pooled buffer at all."""
    engine = engine_for("qwen2")
    runner = _staged_runner(engine)
    staged_engine = engine.with_runner(runner)
    g = torch.Generator().manual_seed(9)
    prompt = [_ids(g, 64)]
    try:
        for kw in ({"apply_softmax": True}, {}):
            got = staged_engine.score([], prompt, [5, 7], **kw)
            want = engine.score([], prompt, [5, 7], **kw)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
        pools, copies = runner.pools.stats(), _staged(runner, W3_BUCKET).inputs.copies
        for _ in range(3):
            staged_engine.score([], prompt, [5, 7], apply_softmax=True)
        assert runner.pools.stats() == pools  # no pooled buffer taken: one staged copy per call
        assert _staged(runner, W3_BUCKET).inputs.copies == copies + 3
        query, items = _ids(g, 12), [_ids(g, 5) for _ in range(3)]
        got = staged_engine.score(query, items, [5, 7, 9])
        torch.testing.assert_close(
            torch.tensor(got),
            torch.tensor(engine.score(query, items, [5, 7, 9])),
            rtol=1e-4,
            atol=1e-5,
        )
    finally:
        staged_engine.close()


def test_inputs_copied_in_by_the_bucket_s_own_body(engine_for):
    """`copy_in_graph` (the graph's first node copies the host buffer in; without a graph, the
    body on each call): the last-token path fills and replays with no copy call of its own, the
    general path stages its device batch into the host buffer first — the same rows as eager,
    one copy counted a call either way, the device buffer the host buffer's after each."""
    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(12)
    runner = _staged_runner(engine, rows=2, copy_in_graph=True)
    staged = _staged(runner, W3_BUCKET)
    assert staged.inputs.by_graph
    assert not _staged(_staged_runner(engine), W3_BUCKET).inputs.by_graph  # CPU: no graph
    copies = staged.inputs.copies
    requests = [[SequenceGroup([], [_ids(g, 40)])], [SequenceGroup([], [_ids(g, 9), _ids(g, 3)])]]
    for groups in requests * 2:
        torch.testing.assert_close(
            runner.rows(groups), engine.runner.rows(groups), rtol=1e-4, atol=1e-4
        )
        assert torch.equal(staged.inputs.staged, staged.inputs.host)
    assert staged.inputs.copies == copies + 4
    # three rows: past the gather's two, so the bucket's call with a device batch
    groups = [SequenceGroup([], [_ids(g, 7), _ids(g, 11), _ids(g, 5)])]
    for pooling in ("mean", "last"):
        torch.testing.assert_close(
            runner.rows(groups, pooling), engine.runner.rows(groups, pooling), rtol=1e-4, atol=1e-4
        )
    assert staged.inputs.copies == copies + 6
    host = staged.inputs.host_views
    assert host["input_ids"][:23].tolist() == [t for s in groups[0].suffixes for t in s]
    assert host["cu_seqlens"][:4].tolist() == [0, 7, 18, 23]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copy_in_graph", [False, True])
def test_cuda_staged_graphs_match_the_older_graphs(tiny_model, copy_in_graph, monkeypatch):
    """On CUDA (eager+graphs, bf16, varlen): the staged graphs give exactly the rows of the older
    graphs, a small request after a big one included, from one stream or two; one H2D copy per
    call from a pinned buffer (made by the call, or by the graph's own first node with
    `copy_in_graph`), one device allocation (the rows handed out), and scores equal."""
    from boundgen import Engine
    from boundgen.compile import staging
    from boundgen.compile.backends import CompileOptions
    from boundgen.runner import make_runner

    monkeypatch.setattr(staging, "COPY_IN_GRAPH", copy_in_graph)
    base = Engine.from_pretrained(
        tiny_model("qwen2"), device="cuda", dtype="bfloat16", attention="varlen", backend="eager"
    )

    def runner(staged: bool) -> ModelRunner:
        opts = CompileOptions(buckets=[W3_BUCKET, CASCADE], staged_inputs=staged)
        return make_runner(base.model, base.device, 4096, True, "eager+graphs", opts)

    new, old = runner(True), runner(False)
    staged = _staged(new, W3_BUCKET)
    assert staged.graph is not None and staged.inputs.host.is_pinned()
    assert staged.inputs.by_graph is copy_in_graph
    g = torch.Generator().manual_seed(11)
    requests = [
        [SequenceGroup([], [_ids(g, 20), _ids(g, 20), _ids(g, 24)])],
        [SequenceGroup([], [_ids(g, 10)])],
        [SequenceGroup(_ids(g, 20), [_ids(g, 4), _ids(g, 6), _ids(g, 3)])],
        [SequenceGroup([], [_ids(g, 64)])],
    ]
    with torch.inference_mode():
        for groups in requests * 2:
            assert torch.equal(new.rows(groups), old.rows(groups))
        copies = staged.inputs.copies
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(10):
            new.rows(requests[3])
        torch.cuda.synchronize()
        assert staged.inputs.copies == copies + 10
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocs == 10
        want = [old.rows(r) for r in requests]
        side = torch.cuda.Stream()
        for i, groups in enumerate(requests * 3):  # alternate streams: the device buffer waits
            with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
                got = new.rows(groups)
            torch.cuda.synchronize()
            assert torch.equal(got, want[i % len(requests)])
    e_new, e_old = base.with_runner(new), base.with_runner(old)
    try:
        query, items, prompt = _ids(g, 12), [_ids(g, 5) for _ in range(3)], [_ids(g, 64)]
        for kw in ({"apply_softmax": True}, {}):
            for q, x in ((query, items), ([], prompt)):
                assert e_new.score(q, x, [5, 7], **kw) == e_old.score(q, x, [5, 7], **kw)
    finally:
        e_new.close()
        e_old.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_fill_waits_for_the_graph_s_copy_not_its_whole_replay():
    """A graph that copies its inputs in marks the copy from inside (a record node): the next
    call fills the host buffer while the previous replay still runs, never before that replay's
    copy has read it. Each replay sleeps ~20 ms after its copy and returns its last-token ids:
    calls made back to back each get their own ids (a fill too early would hand a call the next
    one's), and a call returns while the one before it still sleeps (a fill that waited for the
    whole replay, as when the host marked the copy after it, could not)."""
    from boundgen.text.packing import pack_arrays

    bucket = Bucket.parse(W3_BUCKET)

    def fn(batch):
        torch.cuda._sleep(40_000_000)  # ~20 ms at 2 GHz, after the graph's copy in
        return batch.input_ids.to(torch.float32)[:, None].repeat(1, 4)

    staged = StagedBucket(fn, bucket, "cuda", copy_in_graph=True)
    assert staged.graph is not None and staged.inputs.by_graph
    torch.cuda.synchronize()
    ids = [[7 + 10 * i, 8 + 10 * i, 9 + 10 * i] for i in range(5)]
    outs, ends, running_before = [], [], []
    with torch.inference_mode():
        for i, seq in enumerate(ids):
            outs.append(staged.rows(pack_arrays([SequenceGroup([], [seq])], share_prefix=False)))
            if i:
                running_before.append(not ends[-1].query())
            ends.append(torch.cuda.Event())
            ends[-1].record()
    torch.cuda.synchronize()
    assert [o[:, 0].tolist() for o in outs] == [[float(s[-1])] for s in ids]
    assert all(running_before), running_before
    assert staged.inputs.waits >= 2  # the later fills did wait: for their predecessor's copy
