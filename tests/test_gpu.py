"""CUDA checks (skipped without a GPU): bf16 parity with HF and the varlen backend against the
reference.

bf16 tolerance: both engines round differently (kernel order, fused vs unfused ops), so we
compare each against the float32 HF result and require our error to stay within 2x HF's own bf16
error (+0.02 for values near zero). That says "as faithful as HF in bf16", independent of the
model's logit scale. Scores are compared as log-probabilities (`Engine.score` gives probabilities
under the full vocabulary, SGLang's semantics), whose errors are on a logit's scale.
"""

from __future__ import annotations

import pytest
import torch

from boundgen import Engine, Trie
from boundgen.attention.backends import AUTO_CUDA

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

QUERY = "Is this a good running shoe for a marathon on wet roads?"
ITEMS = [
    "Trail runner with waterproof mesh",
    "yes",
    "A blue ceramic coffee mug",
    "carbon racing flat",
    "no",
    "a much longer item description that goes on for quite a few more tokens than the others",
]


def hf_label_logprobs(model, tok, labels, item_first=False):
    """log P(label) under the full vocabulary after the joined text (SGLang's score semantics)."""
    out = []
    with torch.no_grad():
        for item in ITEMS:
            text = item + QUERY if item_first else QUERY + item
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)], device="cuda")
            logits = model(ids).logits[0, -1].float()
            out.append(torch.log_softmax(logits, dim=-1)[labels].cpu())
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("item_first", [False, True])
def test_bf16_score_parity_with_hf(arch, item_first, tiny_model):
    path = tiny_model(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    labels = [514, 371, 7]
    ref32 = (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    )
    hf16 = (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    )
    truth = hf_label_logprobs(ref32, tok, labels, item_first)
    hf_err = (hf_label_logprobs(hf16, tok, labels, item_first) - truth).abs().max().item()
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16")
    assert engine.model.backend.name == AUTO_CUDA  # the segments kernel for prefill, flash decode
    ours = torch.tensor(engine.score(QUERY, ITEMS, labels, item_first=item_first)).log()
    our_err = (ours - truth).abs().max().item()
    assert our_err <= 2 * hf_err + 0.02, (our_err, hf_err)


def test_varlen_engine_equals_reference_engine_in_bf16(tiny_model):
    path = tiny_model("qwen3")
    fast = Engine.from_pretrained(path, device="cuda", dtype="bfloat16")
    ref = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", attention="reference")
    a = torch.tensor(fast.score(QUERY, ITEMS, [514, 371]))
    b = torch.tensor(ref.score(QUERY, ITEMS, [514, 371]))
    assert (a - b).abs().max().item() < 0.05


def test_beam_search_on_cuda_matches_cpu_float32(tiny_model):
    path = tiny_model("qwen2")
    gpu = Engine.from_pretrained(path, device="cuda", dtype="float32", attention="reference")
    cpu = Engine.from_pretrained(path, device="cpu", dtype="float32")
    trie = Trie.from_sequences(
        torch.randint(0, 300, (500, 3), generator=torch.Generator().manual_seed(0))
        .unique(dim=0)
        .tolist()
    )
    for t in (None, trie):
        a = gpu.beam_search(QUERY, 8, 3, trie=t)
        b = cpu.beam_search(QUERY, 8, 3, trie=t)
        assert [x for x, _ in a] == [x for x, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-3


def test_bf16_beam_search_valid_on_varlen(tiny_model):
    engine = Engine.from_pretrained(tiny_model("llama"), device="cuda", dtype="bfloat16")
    trie = Trie.from_sequences([[5, 6, 7], [5, 6, 8], [9, 1, 2]])
    results = engine.beam_search(QUERY, 16, 3, trie=trie)
    assert sorted(tuple(t) for t, _ in results) == [(5, 6, 7), (5, 6, 8), (9, 1, 2)]
    free = engine.beam_search_batch([QUERY, "short"], 16, 4)
    assert all(len(r) == 16 and all(len(t) == 4 for t, _ in r) for r in free)


def test_concurrent_requests_merge_and_answer_as_alone(tiny_model):
    """32 score requests at once through the engine's runtime on CUDA: the forward node's batches
    wait for the device (`runtime/device_queue.py`), so requests merge; CPU nodes wait for device
    work off the workers (`runtime/device_waits.py`). Every request gets what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine.from_pretrained(tiny_model("qwen2"), device="cuda", dtype="bfloat16")
    labels = [514, 371]
    queries = [f"{QUERY} ({i})" for i in range(32)]
    alone = [engine.score(q, ITEMS, labels) for q in queries]
    futures = [engine.runtime.submit("score", _score_request(q, labels)) for q in queries]
    together = [f.result(timeout=120) for f in futures]
    for a, b in zip(alone, together):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=2e-3), (a, b)
    forward = engine.runtime.stats()["batching"]["forward"]
    assert forward["max_requests_in_batch"] > 1, forward
    with ThreadPoolExecutor(8) as pool:  # and from many threads through the public call
        again = list(pool.map(lambda q: engine.score(q, ITEMS, labels), queries))
    for a, b in zip(alone, again):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=2e-3)


def test_concurrent_beam_requests_merge_and_answer_as_alone(tiny_model):
    """16 beam requests with a trie at once through the runtime on CUDA: the beam node queues a
    merged search while the one before still runs, and the lane's finisher answers that one once
    it has run (`BatchingNode(finish=...)`). Every request gets what it gets alone, item ids
    included, and its results are the search's own (no other search's rows)."""
    from boundgen.workloads.beam import BeamRequest

    engine = Engine.from_pretrained(
        tiny_model("qwen2"), device="cuda", dtype="float32", attention="reference"
    )
    seqs = (
        torch.randint(0, 300, (500, 3), generator=torch.Generator().manual_seed(0))
        .unique(dim=0)
        .tolist()
    )
    trie = Trie.from_sequences(seqs, item_ids=[f"item-{i}" for i in range(len(seqs))])

    def request(i):
        return BeamRequest([f"{QUERY} ({i})"], 8, 3, trie=trie, item_ids=True)

    alone = [engine.runtime.run("beam", request(i)) for i in range(16)]
    futures = [engine.runtime.submit("beam", request(i)) for i in range(16)]
    together = [f.result(timeout=120) for f in futures]
    for a, b in zip(alone, together):
        (rows_a,), (rows_b,) = a, b
        assert [(t, item) for t, _, item in rows_a] == [(t, item) for t, _, item in rows_b]
        assert max(abs(x - y) for (_, x, _), (_, y, _) in zip(rows_a, rows_b)) < 1e-3
        assert all(item == f"item-{seqs.index(t)}" for t, _, item in rows_b)
    beam = engine.runtime.stats()["batching"]["beam"]
    assert beam["max_requests_in_batch"] > 1, beam


def _score_request(query, labels):
    from boundgen.workloads.score import ScoreRequest

    return ScoreRequest(query=query, items=ITEMS, label_token_ids=labels)
