"""boundgen.workloads.trie: CSR prefix trie of item IDs for constrained beam search."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from boundgen.workloads import trie as trie_mod
from boundgen.workloads.trie import NotAnItemError, Trie

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEG_INF = float("-inf")


# ----------------------------------------------------------------- helpers


@st.composite
def item_sets(draw, max_depth=4, max_token=6, max_items=40):
    """Distinct fixed-depth token sequences (small alphabets so prefixes are shared)."""
    depth = draw(st.integers(1, max_depth))
    hi = draw(st.integers(0, max_token))
    seq = st.lists(st.integers(0, hi), min_size=depth, max_size=depth).map(tuple)
    items = draw(st.lists(seq, min_size=1, max_size=max_items, unique=True))
    return [list(s) for s in items]


def prefixes(items, d):
    """Sorted distinct length-d prefixes: node i at depth d is the i-th of these."""
    return sorted({tuple(s[:d]) for s in items})


def check_against_brute_force(trie: Trie, items: list[list[int]], vocab: int) -> None:
    """`children` and `next_node` (every token below `vocab`) of every node against the item set."""
    depth = len(items[0])
    dev = trie.device
    assert trie.depth == depth and trie.num_items == len(items)
    assert trie.nodes_per_depth == tuple(len(prefixes(items, d)) for d in range(depth + 1))
    for d in range(depth):
        here, below = prefixes(items, d), prefixes(items, d + 1)
        index_below = {p: i for i, p in enumerate(below)}
        nodes = torch.arange(len(here), device=dev)
        tokens, child, valid = trie.children(d, nodes)
        assert tokens.shape == (len(here), trie.max_children[d]) and tokens.dtype == torch.int64
        assert child.dtype == torch.int64 and valid.dtype == torch.bool
        tokens, child, valid = tokens.cpu(), child.cpu(), valid.cpu()
        for i, p in enumerate(here):
            expect = sorted({s[d] for s in items if tuple(s[:d]) == p})
            assert tokens[i][valid[i]].tolist() == expect
            assert child[i][valid[i]].tolist() == [index_below[p + (t,)] for t in expect]
            assert (tokens[i][~valid[i]] == 0).all() and (child[i][~valid[i]] == -1).all()
        assert trie.max_children[d] == max(int(valid[i].sum()) for i in range(len(here)))

        # next_node for every (node, token) pair, plus a dead node: the child's index or -1.
        node = torch.cat([nodes, torch.tensor([-1], device=dev)]).repeat_interleave(vocab)
        token = torch.arange(vocab, device=dev).repeat(len(here) + 1)
        expect = [
            index_below.get(here[i] + (t,), -1) for i in range(len(here)) for t in range(vocab)
        ]
        assert trie.next_node(d, node, token).tolist() == expect + [-1] * vocab


def tables(trie: Trie) -> list[tuple[torch.Tensor, ...]]:
    """`children` of every node at every depth, on the CPU: the trie's tables seen from outside."""
    return [
        tuple(t.cpu() for t in trie.children(d, torch.arange(n, device=trie.device)))
        for d, n in enumerate(trie.nodes_per_depth[:-1])
    ]


def beam_step(trie, depth, node, logp, scores, ws=None):
    """One constrained step of `beam_search.run_beam` for one prompt of N beams: the beams' trie
    children, their log-probs gathered from `logp` [N, V], top N of all candidates, then the child
    lookup. → (scores, parent beams, tokens, next nodes), each [N]; dead beams: -inf and node -1."""
    tokens, child, valid = trie.children(depth, node, ws=ws)  # [N, C] each
    lp = logp.gather(1, tokens).masked_fill_(~valid, NEG_INF)
    cand = (scores.unsqueeze(1) + lp).view(1, -1)
    top, idx = torch.topk(cand, node.shape[0], dim=1)
    token = tokens.reshape(1, -1).gather(1, idx)
    nxt = child.reshape(1, -1).gather(1, idx).masked_fill_(top == NEG_INF, -1)
    return top.view(-1), (idx // tokens.shape[1]).view(-1), token.view(-1), nxt.view(-1)


def walk(trie: Trie, seqs: torch.Tensor) -> torch.Tensor:
    node = torch.zeros(seqs.shape[0], dtype=torch.int64, device=trie.device)
    for d in range(trie.depth):
        node = trie.next_node(d, node, seqs[:, d].contiguous())
    return node


# ----------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(items=item_sets())
def test_random_tries_match_brute_force(items):
    trie = Trie.from_sequences(items, [f"id{i}" for i in range(len(items))])
    check_against_brute_force(trie, items, vocab=8)
    leaves = walk(trie, torch.tensor(items))
    leaf_of = {p: i for i, p in enumerate(prefixes(items, len(items[0])))}
    assert leaves.tolist() == [leaf_of[tuple(s)] for s in items]
    assert torch.equal(trie.leaf_nodes(items), leaves)
    assert trie.item_ids(items) == [f"id{i}" for i in range(len(items))]
    assert all(trie.contains(s) for s in items)
    np.testing.assert_array_equal(trie.sequences(), np.array(items))


@settings(max_examples=40, deadline=None)
@given(items=item_sets(max_depth=3, max_token=4), data=st.data())
def test_next_node_non_children_and_dead(items, data):
    trie = Trie.from_sequences(items)
    depth = len(items[0])
    known = {tuple(s) for s in items}
    probe = data.draw(st.lists(st.integers(0, 6), min_size=depth, max_size=depth))
    assert trie.contains(probe) == (tuple(probe) in known)
    d = data.draw(st.integers(0, depth - 1))
    nodes = torch.arange(trie.nodes_per_depth[d])
    tokens, child, valid = trie.children(d, nodes)
    for tok in range(8):
        got = trie.next_node(d, nodes, torch.full_like(nodes, tok))
        expect = torch.where((tokens == tok) & valid, child, -1).max(dim=1).values
        assert torch.equal(got, expect)
    dead = torch.full((3,), -1)
    assert (trie.next_node(d, dead, torch.zeros(3, dtype=torch.int64)) == -1).all()
    assert not trie.children(d, dead)[2].any()


@settings(max_examples=30, deadline=None)
@given(items=item_sets(max_depth=3, max_token=9))
def test_binary_search_lookup_equals_dense(items):
    trie = Trie.from_sequences(items)
    d = len(items[0]) - 1
    nodes = torch.arange(trie.nodes_per_depth[d]).repeat_interleave(11)
    nodes[::7] = -1
    toks = torch.arange(11).repeat(trie.nodes_per_depth[d])
    dense = trie.next_node(d, nodes, toks)
    saved = trie_mod._DENSE_LOOKUP_MAX_CHILDREN
    trie_mod._DENSE_LOOKUP_MAX_CHILDREN = 0
    try:
        assert torch.equal(trie.next_node(d, nodes, toks), dense)
    finally:
        trie_mod._DENSE_LOOKUP_MAX_CHILDREN = saved


@settings(max_examples=30, deadline=None)
@given(items=item_sets(max_depth=4, max_token=5), scale=st.sampled_from([1, 2**20, 2**28]))
def test_sort_paths_agree(items, scale):
    """Packed key + value sort, packed key + argsort and lexsort (wide tokens) agree."""
    ref = Trie.from_sequences(items)
    wide = [[t * scale + 3 for t in s] for s in items]  # monotonic: same order, more bits per token
    trie = Trie.from_sequences(wide, on_duplicate="error")
    assert trie.nodes_per_depth == ref.nodes_per_depth
    for (tok, child, valid), (ref_tok, ref_child, ref_valid) in zip(tables(trie), tables(ref)):
        assert torch.equal(valid, ref_valid) and torch.equal(child, ref_child)
        assert torch.equal(tok[valid], ref_tok[valid] * scale + 3)
    np.testing.assert_array_equal(trie.sequences(), np.array(wide))
    assert trie.item_ids(wide) == list(range(len(items)))


# ----------------------------------------------------------------- devices & workspace


@pytest.mark.parametrize("device", DEVICES)
def test_device_tables_and_workspace(device):
    rng = np.random.default_rng(0)
    seqs = np.unique(rng.integers(0, 5, (200, 3)), axis=0)
    trie = Trie.from_sequences(seqs).to(device)
    assert trie.device.type == device
    assert trie.to(device) is trie
    check_against_brute_force(trie, seqs.tolist(), vocab=7)

    n, vocab = 16, 7
    ws = trie.workspace(n)
    # Step 0 has one live beam at the root (one prompt), the rest dead, as in `run_beam`.
    node = torch.full((n,), -1, dtype=torch.int64, device=device)
    node[0] = 0
    scores = torch.full((n,), NEG_INF, device=device)
    scores[0] = 0.0
    paths = torch.zeros(n, 0, dtype=torch.int64, device=device)
    path_logp = torch.zeros(n, device=device)  # the same sum, from the chosen tokens' log-probs
    ptrs = None
    for d in range(trie.depth):
        tokens, child, valid = trie.children(d, node, ws=ws)
        assert all(t.device.type == device for t in (tokens, child, valid))
        ref = trie.children(d, node)
        assert all(torch.equal(a, b) for a, b in zip((tokens, child, valid), ref))
        assert not valid[node < 0].any()
        buffers = (tokens.data_ptr(), child.data_ptr(), valid.data_ptr())
        assert ptrs is None or ptrs == buffers  # one set of buffers for every depth
        ptrs = buffers

        logp = torch.randn(n, vocab, device=device).log_softmax(1)
        eager = beam_step(trie, d, node, logp, scores)
        top, parent, token, nxt = beam_step(trie, d, node, logp, scores, ws=ws)
        assert all(torch.equal(a, b) for a, b in zip((top, parent, token, nxt), eager))
        live = top > NEG_INF
        # The child lookup agrees with next_node; dead beams get node -1.
        assert torch.equal(nxt[live], trie.next_node(d, node[parent], token)[live])
        assert (nxt[~live] == -1).all()
        path_logp = path_logp[parent] + logp[parent, token]
        paths = torch.cat([paths[parent], token.unsqueeze(1)], 1)
        node, scores = nxt, top
    assert (node >= 0).all()  # 16 beams of depth-2 nodes, each with a child: all survive
    assert torch.allclose(scores, path_logp)
    assert len({tuple(p) for p in paths.tolist()}) == n  # distinct items
    assert torch.equal(trie.leaf_nodes(paths), node)
    row_of = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    assert trie.item_ids(paths) == [row_of[tuple(p)] for p in paths.tolist()]


def test_narrow_trie_fewer_children_than_beams():
    # One chain and one fork of 2: every node has at most 2 children, beam width 16.
    items = [[5, 1, 1, 1], [5, 1, 1, 2], [7, 3, 3, 3]]
    trie = Trie.from_sequences(items, ["a", "b", "c"])
    assert trie.max_children == (2, 1, 1, 2)
    assert trie.nodes_per_depth == (1, 2, 2, 2, 3)
    n = 16
    node = torch.full((n,), -1, dtype=torch.int64)  # beams that died or were never filled
    node[0] = 0
    scores = torch.full((n,), NEG_INF)
    scores[0] = 0.0
    paths = torch.zeros(n, 0, dtype=torch.int64)
    ws = trie.workspace(n)
    for d, live_children in enumerate([2, 2, 2, 3]):
        tokens, _, valid = trie.children(d, node, ws=ws)
        assert tokens.shape == (n, trie.max_children[d])
        assert not valid[node < 0].any() and int(valid.sum()) == live_children
        logp = torch.zeros(n, 10).log_softmax(1)
        top, parent, token, node = beam_step(trie, d, node, logp, scores, ws=ws)
        assert not torch.isnan(top).any()
        assert int((top > NEG_INF).sum()) == live_children  # the surplus beams die
        paths = torch.cat([paths[parent], token.unsqueeze(1)], 1)
        scores = top
    alive = node >= 0
    assert sorted(trie.item_ids(paths[alive])) == ["a", "b", "c"]
    assert int(alive.sum()) == 3 and (scores[~alive] == NEG_INF).all()


# ----------------------------------------------------------------- files


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_from_file_jsonl_npy_and_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    seqs = np.unique(rng.integers(0, 9, (300, 3)), axis=0)
    seqs = seqs[rng.permutation(len(seqs))]
    ids = [f"sku-{i}" for i in range(len(seqs))]
    ref = Trie.from_sequences(seqs, ids)

    jsonl = tmp_path / "items.jsonl"
    write_jsonl(jsonl, [{"item_id": i, "tokens": s} for i, s in zip(ids, seqs.tolist())])
    npy = tmp_path / "items.npy"
    np.save(npy, seqs)
    from_jsonl, from_npy = Trie.from_file(jsonl), Trie.from_file(npy)
    for t in (from_jsonl, from_npy):
        assert t.nodes_per_depth == ref.nodes_per_depth
        for got, expect in zip(tables(t), tables(ref)):
            assert all(torch.equal(a, b) for a, b in zip(got, expect))
        np.testing.assert_array_equal(t.sequences(), seqs)
    assert from_jsonl.item_ids(seqs[:5].tolist()) == ids[:5]
    assert from_npy.item_ids(seqs[:5].tolist()) == [0, 1, 2, 3, 4]

    for name in ("out.jsonl", "out.npy"):
        ref.save(tmp_path / name)
        back = Trie.from_file(tmp_path / name)
        np.testing.assert_array_equal(back.sequences(), seqs)
        assert back.item_ids(seqs.tolist()) == ids
    Trie.from_sequences(seqs).save(tmp_path / "out.npy")  # default ids: stale ids file removed
    assert not (tmp_path / "out.ids.json").exists()
    assert Trie.from_file(tmp_path / "out.npy").item_ids(seqs[3].tolist()) == 3


def test_jsonl_blank_lines_and_int_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"item_id": 10, "tokens": [1, 2]}\n\n{"item_id": 11, "tokens": [1, 3]}\n')
    trie = Trie.from_file(path)
    assert trie.item_ids([[1, 3], [1, 2]]) == [11, 10]


# ----------------------------------------------------------------- errors


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        Trie.from_file(tmp_path / "nope.jsonl")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"item_id": 1, "tokens": [1, 2]}\n{"item_id": 2, "tokens": [1,\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        Trie.from_file(bad)

    missing = tmp_path / "missing.jsonl"
    write_jsonl(missing, [{"item_id": 1, "tokens": [1, 2]}, {"item_id": 2, "toks": [1, 3]}])
    with pytest.raises(ValueError, match=r"missing.jsonl:2: missing key 'tokens'"):
        Trie.from_file(missing)
    write_jsonl(missing, [{"tokens": [1, 2]}])
    with pytest.raises(ValueError, match=r"missing.jsonl:1: missing key 'item_id'"):
        Trie.from_file(missing)

    ragged = tmp_path / "ragged.jsonl"
    write_jsonl(ragged, [{"item_id": "a", "tokens": [1, 2]}, {"item_id": "b", "tokens": [1, 2, 3]}])
    with pytest.raises(ValueError, match=r"item 'b' has 3 tokens, but item 'a' has 2"):
        Trie.from_file(ragged)

    negative = tmp_path / "neg.jsonl"
    write_jsonl(negative, [{"item_id": "a", "tokens": [1, 2]}, {"item_id": "b", "tokens": [1, -2]}])
    with pytest.raises(ValueError, match=r"negative token in item 'b'"):
        Trie.from_file(negative)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty trie"):
        Trie.from_file(empty)
    np.save(tmp_path / "empty.npy", np.zeros((0, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="empty trie"):
        Trie.from_file(tmp_path / "empty.npy")

    np.save(tmp_path / "float.npy", np.array([[1.5, 2.0]]))
    with pytest.raises(ValueError, match="must be integers"):
        Trie.from_file(tmp_path / "float.npy")

    with pytest.raises(ValueError, match="unknown trie file type"):
        (tmp_path / "x.csv").write_text("1,2\n")
        Trie.from_file(tmp_path / "x.csv")

    notlist = tmp_path / "notlist.jsonl"
    write_jsonl(notlist, [{"item_id": "a", "tokens": "12"}])
    with pytest.raises(ValueError, match=r"notlist.jsonl:1: 'tokens' must be a list"):
        Trie.from_file(notlist)


def test_sequence_errors():
    with pytest.raises(ValueError, match="empty trie"):
        Trie.from_sequences([])
    with pytest.raises(ValueError, match="depth 0"):
        Trie.from_sequences([[]])
    with pytest.raises(ValueError, match=r"item 2 has 2 tokens, but item 0 has 3"):
        Trie.from_sequences([[1, 2, 3], [1, 2, 4], [1, 2]])
    with pytest.raises(ValueError, match=r"negative token in item 'y': \[0, -1\]"):
        Trie.from_sequences([[0, 0], [0, -1]], ["x", "y"])
    with pytest.raises(ValueError, match=r"must be integers; item 'y' has 'a'"):
        Trie.from_sequences([[0, 0], [0, "a"]], ["x", "y"])
    with pytest.raises(ValueError, match="2 item ids for 3"):
        Trie.from_sequences([[1], [2], [3]], ["a", "b"])
    with pytest.raises(ValueError, match="2-D"):
        Trie.from_sequences([1, 2, 3])


def test_duplicates():
    seqs = [[1, 2], [3, 4], [1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match=r"items 'a' and 'c' have the same tokens \[1, 2\]"):
        Trie.from_sequences(seqs, ["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match=r"2 duplicate sequence"):
        Trie.from_sequences(seqs)
    trie = Trie.from_sequences(seqs, ["a", "b", "c", "d", "e"], on_duplicate="first")
    assert trie.num_items == 3
    assert trie.item_ids(seqs) == ["a", "b", "a", "b", "e"]
    # Item ids need not be unique: two sequences may map to one id.
    assert Trie.from_sequences([[1], [2]], ["same", "same"]).item_ids([[1], [2]]) == ["same"] * 2


def test_lookup_and_vocab_errors():
    trie = Trie.from_sequences([[1, 2, 3], [1, 2, 300]], ["a", "b"])
    with pytest.raises(NotAnItemError, match=r"tokens \[1, 2, 4\] are not an item"):
        trie.item_ids([1, 2, 4])
    with pytest.raises(KeyError):
        trie.item_ids([[1, 2, 3], [9, 9, 9]])
    with pytest.raises(ValueError, match="3 tokens"):
        trie.item_ids([1, 2])
    assert not trie.contains([1, 2]) and trie.contains([1, 2, 300])
    trie.check_vocab(301)
    with pytest.raises(ValueError, match=r"token 300 .*item 'b'.*size 256"):
        trie.check_vocab(256)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 3\)"):
        trie.children(3, torch.zeros(1, dtype=torch.int64))
    ws = trie.workspace(4)
    with pytest.raises(ValueError, match="workspace is for 4 rows"):
        trie.children(0, torch.zeros(2, dtype=torch.int64), ws=ws)


# ----------------------------------------------------------------- scale


def test_million_items_depth4_builds_fast():
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, 256, (1_000_000, 4), dtype=np.int64)
    seqs[:, 0] = rng.integers(0, 64, len(seqs))  # 64*256^3 combinations: few collisions
    start = time.perf_counter()
    trie = Trie.from_sequences(seqs, on_duplicate="first")
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"build took {elapsed:.1f}s"
    assert trie.num_items > 990_000
    assert trie.nbytes < 64 * 2**20, trie.nbytes
    probe = torch.as_tensor(seqs[:1000])
    leaves = walk(trie, probe)
    assert (leaves >= 0).all()
    assert trie.item_ids(seqs[:3].tolist()) == [0, 1, 2]


# ----------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_beam_step_captures_in_cuda_graph():
    """The beam search's trie step at every depth (children with a workspace, gathers on logits,
    top-N, child lookup) in one CUDA graph gives the eager result."""
    rng = np.random.default_rng(2)
    seqs = np.unique(rng.integers(0, 40, (5000, 3)), axis=0)
    trie = Trie.from_sequences(seqs).to("cuda")
    n, vocab = 16, 64
    ws = trie.workspace(n)
    start = torch.full((n,), -1, dtype=torch.int64, device="cuda")
    start[0] = 0  # one live beam at the root, as in `run_beam`'s first step
    start_scores = torch.where(start == 0, 0.0, NEG_INF)
    logp = torch.randn(trie.depth, n, vocab, device="cuda").log_softmax(-1)

    def decode(use_ws):
        node, scores, hist = start, start_scores, []
        for d in range(trie.depth):
            scores, parent, token, node = beam_step(trie, d, node, logp[d], scores, ws=use_ws)
            hist = [h[parent] for h in hist] + [token]
        return scores, torch.stack(hist, 1), node

    expect = decode(None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        decode(ws)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = decode(ws)
    logp.copy_(torch.randn_like(logp).log_softmax(-1))  # replay reads the static input anew
    expect = decode(None)
    graph.replay()
    torch.cuda.synchronize()
    assert (got[2] >= 0).all()
    assert all(torch.equal(a, b) for a, b in zip(got, expect))
