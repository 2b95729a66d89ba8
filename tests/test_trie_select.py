"""`trie_select.select` (a trie step's selection in one Triton kernel) against the ATen step it
replaces (`search._pick` over `search.Expander`'s candidates): in Triton's CPU interpreter here,
on the device in the GPU run."""

from __future__ import annotations

import pytest
import torch

from boundgen import search as search_mod
from boundgen import trie_select
from boundgen.logsumexp import row_logsumexp
from boundgen.search import NEG_INF, Expander, _pick
from boundgen.workloads.trie import Trie

pytestmark = pytest.mark.skipif(not trie_select.AVAILABLE, reason="needs triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _trie(items: int, depth: int, codes: int, seed: int) -> Trie:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, codes, (items, depth), generator=g)
    return Trie.from_sequences(seqs, on_duplicate="first").to(DEV)


def _steps(trie: Trie, b: int, w: int, vocab: int, dtype, seed: int, dead: int = 0):
    """Every step of a search over random logits, ATen and kernel fed the same inputs (the ATen
    step's outputs): yields (step, kernel's outputs, ATen's outputs)."""
    g = torch.Generator().manual_seed(seed)
    steps = trie.depth
    hist = torch.randint(1, vocab, (b, w, steps), generator=g).to(DEV)  # stale columns are copied
    scores = torch.zeros(b, 1, device=DEV)
    node = torch.zeros(b, dtype=torch.long, device=DEV)
    expand = Expander(trie, torch.empty(0, dtype=torch.long, device=DEV))
    for step in range(steps):
        wc = scores.shape[1]
        # rows wider than the vocabulary: a slice, read in place
        wide = torch.randn(b * wc, vocab + 3, generator=g).mul_(3).to(dtype).to(DEV)
        logits = wide[:, :vocab]
        lse = row_logsumexp(logits)  # as `Expander` takes it (the Triton kernel on CUDA)
        if step == 1 and dead:  # beams whose prompt ran out of continuations
            node = node.clone()
            node[:dead] = -1
            scores = scores.clone()
            scores.view(-1)[:dead] = NEG_INF
        ptr, tok = trie.level_csr(step)
        got = trie_select.select(
            logits, lse, scores, node, ptr, tok, trie.max_children[step], hist, step
        )
        want = _pick(*expand(step, logits, scores, node), hist.clone(), step)
        yield step, got, want
        scores, node, _, hist = want


@pytest.mark.parametrize("level_head", [True, False], ids=["level-logits", "full-logits"])
def test_children_scored_step_equals_the_aten_step_up_to_rounding(level_head, monkeypatch):
    """`softmax="children"`: each beam's children renormalised in the kernel, over the level's
    logits (their columns there) or the vocabulary's (their tokens): the ATen step's scores up to
    float32 rounding, and the same picks (float32 logits: no near-ties)."""
    if not level_head:  # the ATen step's full head over the vocabulary
        monkeypatch.setattr(search_mod, "LEVEL_HEAD_MAX", 0)
    trie = _trie(1500, 3, 30, seed=4).with_softmax("children")
    b, w, vocab = 3, 8, 37
    g = torch.Generator().manual_seed(6)
    scores = torch.zeros(b, 1, device=DEV)
    node = torch.zeros(b, dtype=torch.long, device=DEV)
    hist = torch.zeros(b, w, trie.depth, dtype=torch.long, device=DEV)
    expand = Expander(trie, torch.empty(0, dtype=torch.long, device=DEV))
    for step in range(trie.depth):
        wc = scores.shape[1]
        level = torch.randn(b * wc, trie.level_sizes[step], generator=g).mul_(2).to(DEV)
        full = torch.randn(b * wc, vocab, generator=g).mul_(2).to(DEV)
        full[:, trie.level_tokens(step)] = level  # the same logits either way
        z, columns = (level, trie.level_columns(step)) if level_head else (full, None)
        ptr, tok = trie.level_csr(step)
        got = trie_select.select(
            z, None, scores, node, ptr, tok, trie.max_children[step], hist, step, columns
        )

        def head(rows, cols=None, full=full, level=level):
            return full if cols is None else level

        want = _pick(*expand.children(step, None, scores, node, head), hist.clone(), step)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-5)
        live = got[0].view(-1) > NEG_INF
        assert torch.equal(live, want[0].view(-1) > NEG_INF)
        assert torch.equal(got[1][live], want[1][live]), step
        assert torch.equal(got[3][live.view(b, w)], want[3][live.view(b, w)]), step
        scores, node, _, hist = want


def _candidate_score(trie, logits, lse, scores, depth, parent_row, child):
    """The score the ATen step gives candidate `child` of beam row `parent_row`."""
    token = int(trie.level_csr(depth)[1][child])
    z = float(logits[parent_row, token]) - float(lse[parent_row])
    return float(scores.view(-1)[parent_row]) + z


@pytest.mark.parametrize(
    ("b", "w", "items", "depth", "codes", "dead"),
    [
        (2, 4, 300, 3, 500, 0),  # a root of ~220 children, then few
        (3, 5, 60, 3, 9, 0),  # width not a power of two, children in full levels
        (1, 16, 2000, 3, 40, 3),  # W4's width, three beams dead from step 1
        (2, 8, 3, 3, 50, 0),  # fewer items than beams: dead beams padded
    ],
    ids=["wide-root", "odd-width", "width-16-dead-beams", "narrow-trie"],
)
def test_one_kernel_step_equals_the_aten_step(b, w, items, depth, codes, dead):
    """float32 logits (no ties): the same scores, child nodes, parents and history, every step."""
    trie = _trie(items, depth, codes, seed=b * w)
    for step, got, want in _steps(trie, b, w, codes + 7, torch.float32, seed=w, dead=dead):
        top, node, parent, hist = got
        top_w, node_w, parent_w, hist_w = want
        assert torch.equal(top, top_w), step
        live = top.view(-1) > NEG_INF
        assert torch.equal(node[live], node_w[live]), step
        assert (node[~live] == -1).all()
        if step > 0:
            assert torch.equal(parent[live], parent_w[live]), step
        rows = live.view(b, w)
        assert torch.equal(hist[rows], hist_w[rows]), step
        assert (hist[~rows][:, step] == 0).all()  # a dead beam's token is 0


@pytest.mark.parametrize(
    ("items", "depth", "codes", "b", "vocab"),
    [
        (3000, 3, 64, 2, 71),
        pytest.param(
            100_000,
            4,
            256,
            8,
            151_936,
            id="w4",
            marks=pytest.mark.skipif(DEV == "cpu", reason="W4's size: on the device"),
        ),
    ],
)
def test_tied_scores_keep_distinct_candidates_with_those_scores(items, depth, codes, b, vocab):
    """bf16 logits tie often among a beam's children: the kernel keeps the first of a tie where
    `topk` may keep another, so each kept candidate is checked for its own score instead."""
    trie = _trie(items, depth, codes, seed=5)
    w = 16
    g = torch.Generator().manual_seed(9)
    scores = torch.zeros(b, 1, device=DEV)
    node = torch.zeros(b, dtype=torch.long, device=DEV)
    hist = torch.zeros(b, w, trie.depth, dtype=torch.long, device=DEV)
    for step in range(trie.depth):
        wc = scores.shape[1]
        logits = torch.randn(b * wc, vocab, generator=g).to(torch.bfloat16).to(DEV)
        lse = row_logsumexp(logits)
        ptr, tok = trie.level_csr(step)
        top, child, parent, hist_new = trie_select.select(
            logits, lse, scores, node, ptr, tok, trie.max_children[step], hist, step
        )
        cand = Expander(trie, torch.empty(0, dtype=torch.long, device=DEV))(
            step, logits, scores, node
        )[0]
        # the kept scores are the best W of the candidates, in order
        assert torch.equal(top, cand.topk(w, dim=1).values)
        picks = set()
        for i in range(b * w):
            if top.view(-1)[i] == NEG_INF:
                continue
            row = int(parent[i]) if step > 0 else i // w
            assert (row, int(child[i])) not in picks
            picks.add((row, int(child[i])))
            want = _candidate_score(trie, logits, lse, scores, step, row, int(child[i]))
            assert float(top.view(-1)[i]) == pytest.approx(want, rel=0, abs=1e-5)
            assert int(hist_new.view(b * w, -1)[i, step]) == int(tok[child[i]])
        scores, node, hist = top, child, hist_new


@pytest.mark.skipif(DEV != "cpu", reason="the CPU engine; on CUDA: test_compile_gpu's search")
@pytest.mark.parametrize("softmax", ["vocab", "children"])
def test_whole_searches_with_the_kernel_equal_the_aten_searches(softmax, engine_for, monkeypatch):
    """The tiny model's constrained searches, the step in one kernel (forced on, in the
    interpreter on CPU) against the ATen steps: the same items, and the same scores (over the
    children up to float32 rounding)."""
    engine = engine_for("qwen2")
    g = torch.Generator().manual_seed(2)
    items = torch.randint(0, 60, (200, 3), generator=g).unique(dim=0).tolist()
    trie = Trie.from_sequences(items, softmax=softmax)
    prompts = [engine.tokenizer.encode(p) for p in ("a short prompt", "another one, longer")]
    with torch.inference_mode():
        want = engine.runner.beam_search(prompts, 6, 3, trie)
        ran = []
        monkeypatch.setattr(search_mod, "_one_kernel", lambda *a: ran.append(a[1]) or True)
        got = engine.runner.beam_search(prompts, 6, 3, trie)
    assert ran == [0, 1, 2]
    assert torch.equal(got[0], want[0])
    if softmax == "vocab":
        assert torch.equal(got[1], want[1])
    else:
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_which_steps_take_the_kernel(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert trie_select.ENABLED  # on by default (BOUNDGEN_TRIE_SELECT=0: off)
    monkeypatch.setattr(trie_select, "ENABLED", False)
    assert not trie_select.chosen(cuda, 16, 256)  # off
    with trie_select.enabled():
        assert trie_select.chosen(cuda, 16, 256)
        assert trie_select.chosen(cuda, 16, 1024)  # 16,384 candidates
        assert not trie_select.chosen(cuda, 16, 1025)  # more: the ATen path
        assert not trie_select.chosen(cpu, 16, 256)
        # a search's steps: the first scores one row a prompt, so a root of 2,048 children
        # fits; 16 beams of up to 2,048 children do not
        trie = Trie.from_sequences([[t, 0] for t in range(2048)] + [[0, t] for t in range(1, 2048)])
        assert trie.max_children == (2048, 2048)
        assert search_mod._one_kernel(trie, 0, 16, cuda)
        assert not search_mod._one_kernel(trie, 1, 16, cuda)
    assert not trie_select.ENABLED  # the block's switch undone


def test_bad_inputs_are_clear_errors():
    trie = _trie(50, 2, 10, seed=1)
    ptr, tok = trie.level_csr(1)
    hist = torch.zeros(1, 2, 2, dtype=torch.long, device=DEV)
    logits = torch.randn(4, 12, device=DEV)
    args = (torch.zeros(4, device=DEV), torch.zeros(1, 4, device=DEV))
    node = torch.zeros(4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="at least as many"):
        trie_select.select(logits, *args, node, ptr, tok, 10, hist, 1)
    with pytest.raises(ValueError, match="contiguous columns"):
        trie_select.select(logits.t(), *args, node, ptr, tok, 10, hist, 1)
    with pytest.raises(ValueError, match="depth"):
        trie.level_csr(2)
