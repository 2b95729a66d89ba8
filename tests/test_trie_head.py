"""A trie with `softmax="children"`: the LM head on each step's level tokens only (issue 24).

The candidate-only search must give exactly the beams, scores and items of the same semantics
computed from the full-vocabulary head (full logits → each beam's children → log-softmax over
them), on the plain path and in the whole-search buckets; the default ("vocab") is untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import boundgen.search
from boundgen import Trie
from boundgen.compile.decode import plain_session
from boundgen.search import search

PROMPTS = [[5, 17, 99, 3], [250, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def semantic_items(g, n, codes, depth, lo=1000, disambiguate=0):
    """Up to n unique items: `depth` levels of `codes` codes, each level its own token range from
    `lo`, plus a disambiguation level of `disambiguate` codes (TIGER-style: items sharing their
    semantic codes get different last codes)."""
    flat = torch.randint(0, codes**depth, (n,), generator=g)
    cols = [(flat // codes**k) % codes + lo + (depth - 1 - k) * codes for k in range(depth)][::-1]
    items = torch.stack(cols, 1)
    if disambiguate:
        extra = torch.randint(0, disambiguate, (n, 1), generator=g) + lo + depth * codes
        items = torch.cat([items, extra], 1)
    return items.unique(dim=0).tolist()


def tries(g) -> list[tuple[str, list[list[int]]]]:
    out = [
        ("semantic+disambiguation", semantic_items(g, 60, 5, 2, disambiguate=4)),
        ("semantic-depth3", semantic_items(g, 40, 4, 3)),
        ("narrow", [[1, 2, 3], [1, 2, 4], [9, 9, 9]]),  # width > every fan-out: dead beams
        ("one-item", [[7, 8]]),
    ]
    rand = torch.randint(0, 300, (50, 3), generator=g)
    rand[:20, 0] = 5  # one crowded root child next to sparse ones; tokens shared across levels
    out.append(("random-shared-tokens", rand.unique(dim=0).tolist()))
    wide = torch.stack([torch.arange(120) % 3 + 40, torch.arange(120) + 600], 1)  # fan-out 40
    out.append(("wide", wide.tolist()))
    return out


def full_head(model):
    """The full-vocabulary head, column-picked afterwards: the reference for `head(rows, cols)`."""

    def head(rows, columns=None):
        logits = model.head(rows)
        return logits if columns is None else logits.index_select(1, columns)

    return head


def run_plain(engine, prompts, width, trie, head=None):
    model = engine.model
    session = plain_session(model, engine.device, prompts, width, trie.depth)
    return search(session, head or model.head, width, trie.depth, trie)


def check_valid(trie, tokens, scores):
    for b in range(tokens.shape[0]):
        live = [tokens[b, j].tolist() for j in range(tokens.shape[1]) if scores[b, j] > -math.inf]
        assert len({tuple(x) for x in live}) == len(live)
        assert all(trie.contains(x) for x in live)  # 0 invalid item ids
        s = scores[b].tolist()
        assert s == sorted(s, reverse=True) and all(x <= 1e-6 for x in s)


def test_level_tokens_and_candidate_columns():
    trie = Trie.from_sequences([[3, 10, 7], [3, 11, 7], [5, 10, 8], [5, 12, 9], [6, 10, 7]])
    assert trie.level_sizes == (3, 3, 3)
    assert trie.level_tokens(1).tolist() == [10, 11, 12]
    node = torch.tensor([0, 1, 2, -1])  # depth-1 nodes 3, 5, 6 and a dead beam
    tokens, child, valid, cols = trie.candidates(1, node, ws=trie.workspace(4))
    t2, c2, v2 = trie.children(1, node)
    assert torch.equal(tokens, t2) and torch.equal(child, c2) and torch.equal(valid, v2)
    assert torch.equal(trie.level_tokens(1)[cols][valid], tokens[valid])
    assert not valid[3].any() and (cols[~valid] == 0).all()
    assert trie.softmax == "vocab" and trie.with_softmax("vocab") is trie
    kids = trie.with_softmax("children")
    assert kids.softmax == "children" and kids.to("cpu") is kids and trie.softmax == "vocab"
    assert kids.depth == trie.depth and kids.num_items == trie.num_items
    with pytest.raises(ValueError, match="softmax"):
        Trie.from_sequences([[1]], softmax="allowed")


def test_children_tables_equal_the_csr_path(monkeypatch, engine_for):
    """A depth's padded children table (one gather a step) gives what the CSR kernels give: every
    node and dead nodes, every depth; and the same searches. Too much padding: no table."""
    import boundgen.workloads.trie as trie_mod

    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(3)
    for _, items in tries(g):
        dense = Trie.from_sequences(items)
        monkeypatch.setattr(trie_mod, "_TABLE_SLACK", (0, 0))
        monkeypatch.setattr(trie_mod, "_TABLE_SMALL", 0)
        csr = Trie.from_sequences(items)
        monkeypatch.undo()
        assert all(t is not None for t in dense._tables)
        assert all(t is None for t in csr._tables)
        for d in range(dense.depth):
            node = torch.cat([torch.arange(dense.nodes_per_depth[d]), torch.tensor([-1, -1])])
            node = node[torch.randperm(len(node), generator=g)]
            a = dense.candidates(d, node, ws=dense.workspace(len(node)))
            b = csr.candidates(d, node)
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        with torch.inference_mode():
            for t in (dense, dense.with_softmax("children")):
                other = csr.with_softmax(t.softmax)
                got, want = run_plain(engine, PROMPTS, 5, t), run_plain(engine, PROMPTS, 5, other)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    skewed = [[0, i] for i in range(300)] + [[i, 0] for i in range(1, 300)]  # 300 x 300 padded
    monkeypatch.setattr(trie_mod, "_TABLE_SLACK", (2, 1000))
    monkeypatch.setattr(trie_mod, "_TABLE_SMALL", 1000)
    assert Trie.from_sequences(skewed)._tables[1] is None


@pytest.mark.parametrize(
    "width,level_head_max", [(1, None), (3, None), (8, None), (20, None), (8, 4)]
)
def test_candidate_head_equals_full_head(width, level_head_max, engine_for, monkeypatch):
    """The candidate-only head = the full head picked at each beam's children, then renormalised:
    the same beams and items, the same scores; batch > 1; varied fan-outs and depths; dead beams
    (width > fan-out); the disambiguation level; levels too wide for the level head (full head)."""
    if level_head_max is not None:
        monkeypatch.setattr(boundgen.search, "LEVEL_HEAD_MAX", level_head_max)
    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(width)
    for name, items in tries(g):
        trie = Trie.from_sequences(items, softmax="children")
        with torch.inference_mode():
            got = run_plain(engine, PROMPTS, width, trie)
            want = run_plain(engine, PROMPTS, width, trie, full_head(engine.model))
        assert torch.equal(got[0], want[0]), name
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1] == -math.inf, want[1] == -math.inf)
        check_valid(trie, *got)
        alive = (got[1] > -math.inf).sum(1)
        assert (alive == min(width, len(items))).all(), name  # every item, or `width` beams


def test_children_semantics_brute_force(engine_for):
    """Scores are log-probs normalised over each beam's trie children (teacher-forced check over
    every item), and the default trie keeps the full-vocabulary scores."""
    engine = engine_for("llama")
    model = engine.model
    g = torch.Generator().manual_seed(1)
    items = semantic_items(g, 30, 4, 2, disambiguate=3)
    trie = Trie.from_sequences(items)
    prompt = PROMPTS[0]
    depth = len(items[0])
    with torch.inference_mode():
        logits = {
            tuple(it): model.head(model(*_plain_inputs(prompt + it)))[len(prompt) - 1 :]
            for it in items
        }
    kids: dict[tuple, set] = {}
    for it in items:
        for d in range(depth):
            kids.setdefault(tuple(it[:d]), set()).add(it[d])

    def step_logp(prefix, token, norm):
        row = logits[next(tuple(it) for it in items if tuple(it[: len(prefix)]) == prefix)]
        z = row[len(prefix)]
        if norm == "vocab":
            return torch.log_softmax(z, -1)[token].item()
        allowed = sorted(kids[prefix])
        return torch.log_softmax(z[allowed], -1)[allowed.index(token)].item()

    for norm in ("vocab", "children"):
        beams = [((), 0.0)]
        for _ in range(depth):
            cands = [(p + (t,), s + step_logp(p, t, norm)) for p, s in beams for t in kids[p]]
            beams = sorted(cands, key=lambda x: -x[1])[:6]
        with torch.inference_mode():
            tokens, scores = run_plain(engine, [prompt], 6, trie.with_softmax(norm))
        assert [tuple(x) for x in tokens[0].tolist()] == [p for p, _ in beams], norm
        want = torch.tensor([s for _, s in beams])
        torch.testing.assert_close(scores[0], want, atol=1e-4, rtol=0)


def _plain_inputs(ids):
    from boundgen.text.packing import SequenceGroup, pack

    batch = pack([SequenceGroup([], [ids])], share_prefix=False)
    return batch.input_ids, batch.positions, batch.attn


def test_search_buckets_with_candidate_head(engine_for):
    """The whole-search bucket layout (the CUDA-graph path, here without graphs) with the
    candidate head = the plain search with the full head, across reused buckets; and the runner
    takes a children trie as is."""
    from boundgen.compile.buckets import parse_buckets
    from boundgen.compile.decode import SearchGraphs

    engine = engine_for("qwen2")
    model = engine.model
    sg = SearchGraphs(
        model, torch.device("cpu"), model.backend, parse_buckets(["t32-s8"]), use_graphs=False
    )
    g = torch.Generator().manual_seed(5)
    trie = Trie.from_sequences(semantic_items(g, 50, 5, 2, disambiguate=4), softmax="children")
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[1:], PROMPTS):
        for width in (4, 9):
            with torch.inference_mode():
                got = sg.run(prompts, width, trie.depth, trie, (1,))
                want = run_plain(engine, prompts, width, trie, full_head(model))
                runner = engine.runner.beam_search(prompts, width, trie.depth, trie, (1,))
            assert got is not None and torch.equal(got[0], want[0])
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
            assert torch.equal(runner[0], want[0])
            check_valid(trie, *got)


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    same = sum(
        len(set(map(tuple, a[i].tolist())) & set(map(tuple, b[i].tolist())))
        for i in range(a.shape[0])
    )
    return same / (a.shape[0] * a.shape[1])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    items=st.lists(
        st.lists(st.integers(0, 40), min_size=2, max_size=2),
        min_size=1,
        max_size=40,
        unique_by=tuple,
    ),
    width=st.integers(1, 10),
    batch=st.integers(1, 3),
)
def test_candidate_head_equals_full_head_on_random_tries(items, width, batch, engine_for):
    engine = engine_for("qwen3")
    trie = Trie.from_sequences(items, softmax="children")
    with torch.inference_mode():
        got = run_plain(engine, PROMPTS[:batch], width, trie)
        want = run_plain(engine, PROMPTS[:batch], width, trie, full_head(engine.model))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    check_valid(trie, *got)


def test_engine_takes_a_children_trie(engine_for):
    engine = engine_for("qwen2")
    trie = Trie.from_sequences([[1, 2, 3], [1, 2, 4], [9, 9, 9]], item_ids=["a", "b", "c"])
    results = engine.beam_search(PROMPTS[0], 4, 3, trie=trie.with_softmax("children"))
    assert sorted(trie.item_ids(t) for t, _ in results) == ["a", "b", "c"]
    assert math.isclose(sum(math.exp(s) for _, s in results), 1.0, rel_tol=1e-5)  # all items


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,compile_layers", [("float32", False), ("bfloat16", False), ("bfloat16", True)]
)
def test_candidate_head_on_cuda(tiny_model, dtype, compile_layers, monkeypatch):
    """On CUDA: float32 (reference attention, whose host reads cannot be captured: the bucket
    layout without graphs) equals the full-head path exactly; bf16 in the whole-search CUDA graph
    equals the plain candidate-head search (as `test_search_graphs_match_plain_search` asks of
    any search) and mostly the full-head one (GEMMs of other shapes may round near-ties apart);
    0 invalid items throughout."""
    from boundgen import Engine
    from boundgen.attention import beam_decode
    from boundgen.compile.aoti import export_attention
    from boundgen.compile.buckets import parse_buckets
    from boundgen.compile.decode import SearchGraphs

    # the head is what this test compares; the decode kernel's rounding has its own test
    # (test_compile_gpu.py::test_search_graphs_match_plain_search)
    monkeypatch.setattr(beam_decode, "MODE", "flash")
    g = torch.Generator().manual_seed(2)
    items = semantic_items(g, 2000, 16, 3, disambiguate=8)
    exact = dtype == "float32"
    engine = Engine.from_pretrained(
        tiny_model("qwen2"),
        device="cuda",
        dtype=dtype,
        attention="reference" if exact else "varlen",
        backend="eager",
    )
    model, dev = engine.model, engine.device
    backend = export_attention(model, dev) if compile_layers else model.backend
    buckets = parse_buckets(["t32-s8"])
    sg = SearchGraphs(
        model, dev, backend, buckets, compile_layers=compile_layers, use_graphs=not exact
    )
    trie = Trie.from_sequences(items, softmax="children").to(dev)
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS):
        with torch.inference_mode():
            got = sg.run(prompts, 16, trie.depth, trie)
            plain = run_plain(engine, prompts, 16, trie)
            full = run_plain(engine, prompts, 16, trie, full_head(model))
        assert got is not None
        check_valid(trie, got[0].cpu(), got[1].cpu())
        if exact:
            assert torch.equal(got[0], full[0]) and torch.equal(plain[0], full[0])
            torch.testing.assert_close(got[1], full[1], atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(got[0][:, 0], plain[0][:, 0])
            assert overlap(got[0], plain[0]) >= (0.85 if compile_layers else 1.0)
            assert overlap(plain[0], full[0]) >= 0.75
    assert exact or all(s.graph is not None for s in sg.slots.values())
