"""boundgen demo: the built-in recommendation model scoring, recommending and measuring itself."""

from __future__ import annotations

import re
import time

from boundgen.commands._common import DEMO_MODEL, add_engine_args
from boundgen.demo.catalog import matches

HELP = "score a query against catalog items, recommend by trie beam search, print held-out quality"


def add_arguments(parser) -> None:
    add_engine_args(parser, model_default=DEMO_MODEL)
    parser.add_argument(
        "--query",
        default=None,
        help="search query (default: one from the held-out set), e.g. 'red Soldal running shoes'",
    )
    parser.add_argument(
        "--candidates", type=int, default=8, help="catalog items scored against the query"
    )
    parser.add_argument("--top", type=int, default=5, help="recommendations shown")
    parser.add_argument(
        "--eval-groups",
        type=int,
        default=40,
        help="held-out relevance groups for AUC (5 candidates each; 0 skips)",
    )
    parser.add_argument(
        "--eval-queries",
        type=int,
        default=100,
        help="held-out query prompts for recall@10 (0 skips)",
    )
    parser.add_argument(
        "--eval-histories",
        type=int,
        default=50,
        help="held-out history prompts for recall@10 (0 skips)",
    )


# The first screen's examples: a held-out query and history the shipped model gets right, so a new
# user sees what it does well; the held-out numbers after them say how it does over many.
# `tests/test_demo_model.py` checks that it still ranks and recommends them right.
SHOWCASE_QUERY = "show me Velund fitness tracker in pink"  # hard negatives: one attribute off each
SHOWCASE_HISTORY = 5  # eval.json's history 5: four Delette kitchen appliances


def _candidates(assets, query: str, n: int) -> list[int]:
    """Items sharing the most words with the query: the shortlist a recall stage would hand over."""
    words = set(re.findall(r"[\w$-]+", query.lower()))
    ranked = sorted(
        assets.catalog.items,
        key=lambda it: (-len(words & set(re.findall(r"[\w$-]+", it.title.lower()))), it.item_id),
    )
    return [it.item_id for it in ranked[:n]]


def _showcase(assets) -> tuple[str, list[int], dict]:
    """The showcase query, its held-out candidates and the attributes it names."""
    group = next(g for g in assets.eval["relevance"] if g["query"] == SHOWCASE_QUERY)
    return group["query"], [c["item_id"] for c in group["candidates"]], group["attrs"]


def _truth(item, attrs: dict | None) -> str:
    """The `matches` column: yes / no where the query's attributes are known, else no column."""
    if attrs is None:
        return ""
    return f"{'yes' if matches(item, attrs) else 'no':>7}  "


def run(args) -> int:
    import math

    from boundgen import Engine, Trie
    from boundgen.config import EngineConfig
    from boundgen.demo import default_model_path
    from boundgen.demo.evaluate import (
        DemoAssets,
        history_prompt,
        recommend,
        relevance_auc,
        retrieval_prompt,
        retrieval_recall,
        score_items,
    )
    from boundgen.settings import from_args

    t0 = time.perf_counter()
    path = args.model or default_model_path()
    engine = Engine.from_pretrained(path, config=from_args(EngineConfig, args))
    assets = DemoAssets.load(path)
    trie = Trie.from_file(assets.trie_path)
    items = assets.catalog.items
    params = assets.meta.get("params")
    size = f"a {params / 1e6:.1f}M-parameter " if params else "an "
    print(
        f"boundgen demo: {size}{engine.config.architecture} trained on a synthetic catalog of "
        f"{len(items)} products,\nloaded from {path} on {engine.device} in "
        f"{time.perf_counter() - t0:.1f}s.\nEvery product has a title and a semantic ID of 3 "
        "tokens, <a_category><b_brand, band><c_type, color>\n(band: price range; similar "
        "products share a prefix)."
    )

    # 1. Relevance: rank a shortlist for a query.
    attrs = None
    if args.query:
        query, ids = args.query, _candidates(assets, args.query, args.candidates)
    else:
        query, ids, attrs = _showcase(assets)
        ids += [i for i in _candidates(assets, query, args.candidates) if i not in ids]
        ids = ids[: max(args.candidates, 5)]
    probs = score_items(engine, assets, query, ids)
    labels = " / ".join(repr(w) for w in assets.meta.get("label_words", ())) or "the labels"
    print(
        "\n1. Relevance: how well each product matches a query (a ranking stage)\n"
        f"   engine.score(query, items, label_token_ids={assets.label_token_ids}, "
        "apply_softmax=True)\n"
        f'   P(yes): the probability of {labels} after "Query: <query>\\nItem: <title>\\n'
        'Relevant:"'
    )
    if attrs:
        print(
            "   matches: the catalog's truth, every attribute the query names; the other products\n"
            "   share words with the query but differ in one attribute (brand, type, color) or more"
        )
    print(f'query: "{query}"' + ("  (held out: not in the training data)" if attrs else ""))
    column = "matches  " if attrs else ""
    print(f"  {'rank':>4}  {'P(yes)':>6}  {column}item")
    for rank, (p, i) in enumerate(sorted(zip(probs, ids), key=lambda x: -x[0]), 1):
        print(f"  {rank:>4}  {p:6.3f}  {_truth(items[i], attrs)}{assets.title(i)}")

    # 2. Generative retrieval: trie-constrained beam search over the catalog's semantic IDs.
    print(
        "\n2. Recommendations: the model writes a product's semantic ID, token by token "
        "(generative retrieval)\n"
        f"   engine.beam_search(prompt, beam_width=10, steps=3, trie=<{len(trie)} items>)\n"
        "   The trie lets it write only the IDs of catalog products, so every answer is a real\n"
        "   product, shown with its catalog title; P is the probability of the whole ID."
    )
    print(f'query: "{query}"')
    if attrs:
        n = sum(matches(it, attrs) for it in items)
        print(f"  (the catalog has {n} product{'s' if n != 1 else ''} matching it)")
    print(f"  {'P':>6}  {'semantic ID':<22} {column}item")
    for item, lp in recommend(engine, trie, retrieval_prompt(query))[: args.top]:
        sid, truth = items[item].sid_text(), _truth(items[item], attrs)
        print(f"  {math.exp(lp):6.3f}  {sid:<22} {truth}{assets.title(item)}")
    shown = assets.eval["history"][SHOWCASE_HISTORY]
    print("user history (oldest first):")
    for i in shown["history"]:
        print(f"          {items[i].sid_text():<22} {assets.title(i)}")
    print(
        "next for that user (seen items excluded; right = the history's category, brand and price\n"
        "band, which many products share, so P spreads over them):"
    )
    right = set(shown["relevant"])
    prompt = history_prompt(assets, shown["history"])
    for item, lp in recommend(engine, trie, prompt, exclude=shown["history"])[: args.top]:
        sid, truth = items[item].sid_text(), "right" if item in right else "wrong"
        print(f"  {math.exp(lp):6.3f}  {sid:<22} {truth:>5}  {assets.title(item)}")

    # 3. Held-out quality, computed now through the same calls.
    print("\n3. Held-out quality, computed now over many queries (not only the examples above)")
    if args.eval_groups > 0:
        t = time.perf_counter()
        value, n = relevance_auc(engine, assets, args.eval_groups)
        print(
            f"  relevance AUC          {value:.3f}  ({n} query-item pairs, "
            f"{time.perf_counter() - t:.1f}s; how often a match outscores a non-match)"
        )
    if args.eval_queries > 0 or args.eval_histories > 0:
        t = time.perf_counter()
        rec = retrieval_recall(engine, trie, assets, args.eval_queries, args.eval_histories)
        el = time.perf_counter() - t
        if rec["n_query"]:
            print(
                f"  recall@10 (queries)    {rec['query']:.3f}  ({rec['n_query']} queries; the "
                "share of the matching products in the top 10)"
            )
        if rec["n_history"]:
            print(f"  recall@10 (histories)  {rec['history']:.3f}  ({rec['n_history']} histories)")
        print(f"  recommended ids not in the catalog: {rec['invalid']}  ({el:.1f}s)")
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    return 0
