"""Bounded beam search: parity with HF `generate`, trie-constrained correctness, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from boundgen import Trie

transformers = pytest.importorskip("transformers")

PROMPT = "customer bought running shoes and a water bottle, next they want"


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model(arch), dtype=torch.float32
            ).eval()
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("width,steps", [(4, 3), (16, 4)])
def test_unconstrained_matches_hf_generate(arch, width, steps, engine_for, hf_model):
    """Same sequences in the same order. Scores are compared with HF's `sequences_scores`, which
    with length_penalty=0 are the cumulative log-probs of the generated tokens (log_softmax over
    the full vocabulary; EOS excluded from selection by min_new_tokens, as in our bounded
    search)."""
    engine = engine_for(arch)
    prompt = engine.tokenizer.encode(PROMPT)
    ours = engine.beam_search(prompt, width, steps)
    out = hf_model(arch).generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert [tokens for tokens, _ in ours] == out.sequences[:, len(prompt) :].tolist()
    for (_, score), ref in zip(ours, out.sequences_scores.tolist()):
        assert abs(score - ref) < 1e-4


def test_batch_equals_single_prompts(engine_for):
    engine = engine_for("llama")
    prompts = [PROMPT, "a", "gift ideas for a cyclist who has everything already"]
    batch = engine.beam_search_batch(prompts, 8, 3, top_k=5)
    for prompt, result in zip(prompts, batch):
        single = engine.beam_search(prompt, 8, 3, top_k=5)
        assert [t for t, _ in result] == [t for t, _ in single]
        assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(result, single))


def test_grouped_query_rows_are_a_layout_not_a_result(engine_for, monkeypatch):
    """The decode step's prompt attention with a KV head's query heads as rows of its segment (the
    default, `cascade.grouped_rows_attention`) and with the heads as they come
    (`BOUNDGEN_BEAM_GQA_ROWS=0`, the A/B's switch) give the same beams and scores."""
    from boundgen.attention import cascade
    from boundgen.compile.decode import plain_session

    engine = engine_for("qwen2")
    assert engine.config.gqa > 1
    prompts = [[5, 9, 13, 2, 7], [11, 3], [8, 8, 1, 4]]

    def searched():
        session = plain_session(engine.model, engine.device, prompts, 4, 3)
        return session.state.group, engine.runner.beam_search(prompts, 4, 3)

    group, grouped = searched()
    monkeypatch.setattr(cascade, "GQA_ROWS", False)
    plain_group, as_they_come = searched()
    assert (group, plain_group) == (engine.config.gqa, 1)
    assert torch.equal(grouped[0], as_they_come[0])
    torch.testing.assert_close(grouped[1], as_they_come[1], atol=1e-5, rtol=1e-5)


def brute_force_beam(model, prompt, trie_items, width):
    """The exact beam-search path over the trie, from teacher-forced log-probs of every item."""
    depth = len(trie_items[0])
    logp = {}  # prefix tuple → log-prob of its last token
    with torch.no_grad():
        for item in trie_items:
            lp = torch.log_softmax(model(torch.tensor([prompt + item])).logits[0].float(), -1)
            for d in range(depth):
                logp[tuple(item[: d + 1])] = lp[len(prompt) - 1 + d, item[d]].item()
    beams = [((), 0.0)]
    for d in range(depth):
        cands = {p[: d + 1] for p in logp if len(p) == d + 1 and p[:d] in {b for b, _ in beams}}
        scored = [(c, dict(beams)[c[:d]] + logp[c]) for c in cands]
        beams = sorted(scored, key=lambda x: -x[1])[:width]
    return [(list(p), s) for p, s in beams]


@pytest.mark.parametrize("width", [2, 5, 16])
def test_trie_constrained_equals_brute_force(width, engine_for, hf_model):
    engine, model = engine_for("qwen2"), hf_model("qwen2")
    g = torch.Generator().manual_seed(width)
    items = torch.randint(0, 40, (25, 3), generator=g).unique(dim=0)
    items[:8, 0] = 5  # a crowded first level next to sparse ones
    items = items.unique(dim=0).tolist()
    trie = Trie.from_sequences(items)
    prompt = engine.tokenizer.encode(PROMPT)
    ours = engine.beam_search(prompt, width, 3, trie=trie)
    ref = brute_force_beam(model, prompt, items, width)
    assert [t for t, _ in ours] == [t for t, _ in ref]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours, ref))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    items=st.lists(
        st.lists(st.integers(0, 60), min_size=3, max_size=3),
        min_size=1,
        max_size=30,
        unique_by=tuple,
    ),
    width=st.integers(1, 12),
    top_k=st.integers(1, 12),
)
def test_constrained_results_are_valid_items(items, width, top_k, engine_for):
    engine = engine_for("qwen3")
    trie = Trie.from_sequences(items)
    top_k = min(top_k, width)
    results = engine.beam_search("hello there", width, 3, top_k=top_k, trie=trie)
    seqs = [tuple(t) for t, _ in results]
    scores = [s for _, s in results]
    assert set(seqs) <= {tuple(i) for i in items}
    assert len(seqs) == len(set(seqs))
    assert all(math.isfinite(s) and s <= 0 for s in scores)
    assert scores == sorted(scores, reverse=True)
    root_fanout = len({i[0] for i in items})
    assert min(top_k, root_fanout) <= len(results) <= top_k
    assert [trie.item_ids(list(s)) for s in seqs] == [items.index(list(s)) for s in seqs]


def test_narrow_trie_returns_fewer_results_without_nan(engine_for):
    engine = engine_for("qwen2")
    trie = Trie.from_sequences([[1, 2, 3], [1, 2, 4], [9, 9, 9]], item_ids=["a", "b", "c"])
    results = engine.beam_search(PROMPT, 16, 3, trie=trie)
    assert sorted(trie.item_ids(t) for t, _ in results) == ["a", "b", "c"]
    assert all(math.isfinite(s) for _, s in results)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beam_width": 0}, "beam_width must be a positive integer"),
        ({"beam_width": 65}, "above the configured bound"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"steps": 17}, "above the configured bound"),
        ({"top_k": 5, "beam_width": 4}, "top_k 5 is above"),
        ({"prompt": ""}, "prompts[0] is empty"),
        ({"prompt": [1, -2]}, "outside the vocabulary"),
        ({"trie": [[1, 2]]}, "trie must be a boundgen.Trie"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message, engine_for):
    engine = engine_for("qwen2")
    args = {"prompt": PROMPT, "beam_width": 4, "steps": 2, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.beam_search(**args)
    assert len(engine.beam_search(PROMPT, 4, 2)) == 4  # nothing else disturbed


def test_trie_depth_and_vocab_are_checked(engine_for):
    engine = engine_for("qwen2")
    with pytest.raises(ValueError, match="trie depth 3 != steps 2"):
        engine.beam_search(PROMPT, 4, 2, trie=Trie.from_sequences([[1, 2, 3]]))
    too_big = engine.config.vocab_size
    with pytest.raises(ValueError, match=str(too_big)):
        engine.beam_search(PROMPT, 4, 2, trie=Trie.from_sequences([[1, too_big]]))


def test_merged_searches_are_the_beam_nodes_forwards_and_shapes():
    """Each merged search is one forward of its own shape for the cost model: a new width, steps,
    trie or prompt count is a first run (on a GPU it compiles its whole-search graph)."""
    from boundgen.workloads.beam import BeamRequest, _Beam

    trie = Trie.from_sequences([[1, 2], [1, 3]])

    def item(width: int, prompts: int, with_trie: bool = False) -> dict:
        request = BeamRequest(["p"] * prompts, width, 2, trie=trie if with_trie else None)
        return {"request": request, "prompts": [[5, 6]] * prompts}

    shapes = _Beam.shapes([item(8, 1), item(8, 2), item(4, 1), item(8, 1, with_trie=True)])
    assert sorted(shapes, key=repr) == sorted(
        [(8, 2, None, 3), (4, 2, None, 1), (8, 2, id(trie), 1)], key=repr
    )


class _EmbeddingSession:
    """A decode session over a random bf16 "model": a step's hidden state is its token's embedding
    row; `head` gives the logits in bf16, or their float32 copy (what search took before)."""

    def __init__(self, float32: bool, prompts: int = 2, vocab: int = 96, hidden: int = 16):
        g = torch.Generator().manual_seed(7)
        self.emb = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
        self.weight = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
        self.last_hidden = torch.randn(prompts, hidden, generator=g).to(torch.bfloat16)
        self.prompt_lengths = torch.full((prompts,), 5)
        self.float32 = float32

    def head(self, rows, columns=None):
        w = self.weight if columns is None else self.weight.index_select(0, columns)
        z = torch.nn.functional.linear(rows, w)
        return z.float() if self.float32 else z

    def step(self, i, tokens, positions):
        return self.head(self.emb[tokens])

    def hidden(self, i, tokens, positions):
        return self.emb[tokens]

    def reorder(self, parent):
        pass


class _CountingSession(_EmbeddingSession):
    def __init__(self):
        super().__init__(False)
        self.reorders = 0

    def reorder(self, parent):
        self.reorders += 1


@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_a_search_reorders_the_beams_kv_only_before_a_step_that_reads_it(steps):
    # step 0 picks new beams (nothing to reorder); after the last step no decode step reads the
    # beams' KV, so its gather would be a kernel a search for nothing
    from boundgen.search import search

    session = _CountingSession()
    search(session, session.head, 4, steps, None)
    assert session.reorders == max(steps - 2, 0)


@pytest.mark.parametrize("softmax", [None, "vocab", "children"])
def test_search_over_bf16_logits_equals_search_over_their_float32_copy(softmax):
    # the search reads the model's bf16 logits in place (no float32 copy of 512 × vocab a step):
    # every bf16 value is exact in float32, so tokens and scores must be the very same
    from boundgen.search import search

    trie = None
    if softmax is not None:
        g = torch.Generator().manual_seed(3)
        items = torch.randint(0, 96, (40, 3), generator=g).unique(dim=0).tolist()
        trie = Trie.from_sequences(items, softmax=softmax)
    runs = []
    for float32 in (False, True):
        session = _EmbeddingSession(float32)
        runs.append(search(session, session.head, 4, 3, trie))
    (tokens, scores), (tokens_ref, scores_ref) = runs
    assert torch.equal(tokens, tokens_ref)
    assert torch.equal(scores, scores_ref)
    assert torch.isfinite(scores[:, 0]).all()
