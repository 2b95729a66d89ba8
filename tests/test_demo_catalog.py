"""The synthetic catalog behind the demo model: determinism, semantic IDs, splits, templates."""

from __future__ import annotations

import random

import pytest

from boundgen.demo import catalog as cat

SMALL = {
    "train_rel": 500,
    "train_ret": 300,
    "train_hist": 100,
    "test_rel": 100,
    "test_ret": 100,
    "test_hist": 50,
}


@pytest.fixture(scope="module")
def catalog():
    return cat.make_catalog(0, 1000)


def test_generator_is_deterministic(catalog):
    again = cat.make_catalog(0, 1000)
    assert again.to_json() == catalog.to_json()
    assert cat.make_splits(catalog, 0, **SMALL) == cat.make_splits(again, 0, **SMALL)
    assert cat.make_catalog(1, 1000).to_json() != catalog.to_json()


def test_semantic_ids_are_unique_bounded_and_hierarchical(catalog):
    sids = [it.sid for it in catalog.items]
    assert len(set(sids)) == len(sids)
    assert all(0 <= code < cat.SID_CODES for sid in sids for code in sid)
    for it in catalog.items:
        # Level 1 is the category, level 2 brand x price band: similar items share prefixes.
        assert it.sid[0] == list(cat.CATEGORIES).index(it.category)
        same_b = [o for o in catalog.items if o.sid[:2] == it.sid[:2]]
        assert all(o.brand == it.brand and o.band == it.band for o in same_b)
        break
    by_prefix = {}
    for it in catalog.items:
        by_prefix.setdefault(it.sid[:2], set()).add((it.category, it.brand, it.band))
    assert all(len(v) == 1 for v in by_prefix.values())
    assert cat.sid_text((1, 2, 3)) == "<a_1><b_2><c_3>"
    assert len(cat.sid_vocab()) == 3 * cat.SID_CODES


def test_titles_render_attributes(catalog):
    it = catalog.items[0]
    for value in (it.brand, it.product_type, it.color, f"${it.price}", it.city):
        assert value in it.title
    assert it.price in [p * cat.CATEGORIES[it.category]["scale"] for p in cat.BAND_PRICES[it.band]]


def test_queries_constrain_what_they_say(catalog):
    rng = random.Random(3)
    for _ in range(200):
        item = rng.choice(catalog.items)
        query, attrs = cat.make_query(rng, item, allow_city=True)
        assert attrs["category"] == item.category
        assert all(getattr(item, k) == v for k, v in attrs.items())
        if "brand" in attrs:
            assert item.brand in query
        if "city" in attrs:
            assert item.city in query


def test_relevance_labels_and_hard_negatives(catalog):
    groups = cat.relevance_groups(catalog, 5, 100)
    n_hard = 0
    for g in groups:
        for c in g["candidates"]:
            item = catalog.items[c["item_id"]]
            match = all(getattr(item, k) == v for k, v in g["attrs"].items())
            assert c["label"] == int(match)
            n_hard += (not match) and item.category == g["attrs"]["category"]
        assert any(c["label"] for c in g["candidates"])
    assert n_hard > 100  # most negatives share the query's category


def test_heldout_split_is_disjoint(catalog):
    splits = cat.make_splits(catalog, 0, **SMALL)
    train_q = {g["query"] for g in splits["train"]["relevance"]}
    train_q |= {q["query"] for q in splits["train"]["retrieval"]}
    test = splits["test"]
    assert test["relevance"] and test["retrieval"] and test["history"]
    assert not train_q & {g["query"] for g in test["relevance"]}
    assert not train_q & {q["query"] for q in test["retrieval"]}
    held = set(splits["held_out_items"])
    assert len(held) == len(catalog.items) // 10
    assert not held & {q["target"] for q in splits["train"]["retrieval"]}
    for q in test["retrieval"]:
        assert q["target"] in q["relevant"]
    for h in test["history"]:
        assert h["target"] in h["relevant"] and not set(h["history"]) & set(h["relevant"])


def test_catalog_json_roundtrip(catalog):
    back = cat.Catalog.from_json(catalog.to_json())
    assert back.items == catalog.items
    assert back.by_sid[catalog.items[7].sid] == catalog.items[7]
