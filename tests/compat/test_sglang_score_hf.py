"""SGLang `/v1/score` semantics, checked numerically against HF transformers on the demo weights.

What SGLang computes (sgl-project/sglang `test/srt/test_score_api.py` `compute_hf_scores`, and the
tokenizer manager's score path), for each item:
- text: the JOINED string is tokenized (`f"{query}{item}"`, or `f"{item}{query}"` with
  `item_first`), so a join inside a word tokenizes as one word;
- token ids: `query + item` (or `item + query`), as given;
- the next-token distribution at the last position; `apply_softmax=true`: softmax over the label
  tokens' logits; `apply_softmax=false`: exp(log-prob) of each label token under the softmax over
  the FULL vocabulary (a probability in [0, 1], not a logit).

The expected numbers come from `AutoModelForCausalLM` on the same checkpoint directory the server
loads (`boundgen serve` without `--model`), both in float32 on the CPU, with the checkpoint's
`tokenizer.json` in transformers' fast tokenizer (see the last test for `AutoTokenizer`).
"""

from __future__ import annotations

import pytest
import torch

from boundgen.demo import default_model_path

LABELS = [299, 272, 57]  # " yes", " no" and "Y" of the demo tokenizer
QUERY = "Query: red Astora sneakers\n"
ITEMS = ["Item: Astora Core sneakers, red, $999, Vienna\nRelevant:", "Item: Nimtra sofa\nRelevant:"]
# SGLang's own item_first case, " is a city" after the item, with the demo's words
ITEM_FIRST_QUERY = " is a red item. Relevant:"
ITEM_FIRST_ITEMS = ["Item: Astora Core sneakers", "Item: Nimtra Max sofa"]
# A join inside a word: SGLang (and boundgen) score "... running shoes", not "... running sho|es"
SPLIT_QUERY = "Query: Soldal running sho"
SPLIT_ITEMS = ["es\nItem: Soldal Max running shoes, blue, $24, Berlin\nRelevant:", "es"]

SCORE_TOLERANCE = 1e-4  # float32 on both sides; SGLang's own test allows 0.01 (GPU, bf16)


@pytest.fixture(scope="session")
def hf_causal_lm(demo_tokenizer):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), demo_tokenizer


def hf_scores(hf_causal_lm, query, items, label_token_ids, apply_softmax, item_first):
    model, tokenizer = hf_causal_lm
    rows = []
    for item in items:
        if isinstance(query, str):
            ids = tokenizer(f"{item}{query}" if item_first else f"{query}{item}")["input_ids"]
        else:
            ids = item + query if item_first else query + item
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
        if apply_softmax:
            probs = torch.softmax(logits[label_token_ids], dim=-1)
        else:
            probs = torch.log_softmax(logits, dim=-1)[label_token_ids].exp()
        rows.append(probs.tolist())
    return rows


def served_scores(demo_http, query, items, label_token_ids, apply_softmax, item_first):
    body = {
        "query": query,
        "items": items,
        "label_token_ids": label_token_ids,
        "apply_softmax": apply_softmax,
        "item_first": item_first,
    }
    response = demo_http.post("/v1/score", json=body)
    assert response.status_code == 200, response.text
    return response.json()["scores"]


def check(demo_http, hf_causal_lm, query, items, apply_softmax, item_first):
    want = hf_scores(hf_causal_lm, query, items, LABELS, apply_softmax, item_first)
    got = served_scores(demo_http, query, items, LABELS, apply_softmax, item_first)
    assert len(got) == len(want)
    for got_row, want_row in zip(got, want):
        assert got_row == pytest.approx(want_row, abs=SCORE_TOLERANCE)
        assert all(0.0 <= p <= 1.0 for p in got_row)
    if apply_softmax:
        assert all(sum(row) == pytest.approx(1.0, abs=1e-6) for row in got)


def as_ids(hf_causal_lm, query, items):
    tokenizer = hf_causal_lm[1]
    return tokenizer.encode(query), [tokenizer.encode(item) for item in items]


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
def test_token_ids(demo_http, hf_causal_lm, apply_softmax, item_first):
    query, items = (QUERY, ITEMS) if not item_first else (ITEM_FIRST_QUERY, ITEM_FIRST_ITEMS)
    query_ids, item_ids = as_ids(hf_causal_lm, query, items)
    check(demo_http, hf_causal_lm, query_ids, item_ids, apply_softmax, item_first)


@pytest.mark.parametrize("apply_softmax", [True, False])
@pytest.mark.parametrize("item_first", [False, True])
def test_text_joined_at_a_token_boundary(demo_http, hf_causal_lm, apply_softmax, item_first):
    """Joins at a newline or a space tokenize the same joined or apart."""
    query, items = (QUERY, ITEMS) if not item_first else (ITEM_FIRST_QUERY, ITEM_FIRST_ITEMS)
    check(demo_http, hf_causal_lm, query, items, apply_softmax, item_first)


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_text_joined_inside_a_word(demo_http, hf_causal_lm, apply_softmax):
    check(demo_http, hf_causal_lm, SPLIT_QUERY, SPLIT_ITEMS, apply_softmax, item_first=False)


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_text_item_first_joined_inside_a_word(demo_http, hf_causal_lm, apply_softmax):
    items = ["Query: Soldal running sho", "Query: Soldal sandals and sho"]
    check(demo_http, hf_causal_lm, "es\nRelevant:", items, apply_softmax, item_first=True)


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_empty_item_scores_the_query_alone(demo_http, hf_causal_lm, apply_softmax):
    check(
        demo_http,
        hf_causal_lm,
        QUERY + "Item: Astora sofa\nRelevant:",
        ["", " no"],
        apply_softmax,
        False,
    )


def test_split_inside_a_word_tokenizes_differently(hf_causal_lm):
    """The split cases above test something: apart, the ids differ from the joined string's."""
    tokenizer = hf_causal_lm[1]
    for query, item in [
        (SPLIT_QUERY, SPLIT_ITEMS[0]),
        ("Query: Soldal running sho", "es\nRelevant:"),
    ]:
        assert tokenizer.encode(query) + tokenizer.encode(item) != tokenizer.encode(query + item)


@pytest.mark.xfail(
    strict=True,
    reason="transformers 5: AutoTokenizer builds Qwen2Tokenizer for any qwen2 checkpoint (Qwen2's "
    "split rules: one token per digit) instead of the shipped tokenizer.json, so '$999' tokenizes "
    "differently from the server; not fixable without retraining the demo (docs/compat.md)",
)
def test_autotokenizer_matches_the_served_tokenizer(demo_tokenizer):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(default_model_path())
    text = ITEMS[0]
    assert auto.encode(text) == demo_tokenizer.encode(text)
