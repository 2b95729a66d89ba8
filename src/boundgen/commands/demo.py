"""boundgen demo: the built-in recommendation model scoring, recommending and measuring itself."""

from __future__ import annotations

import re
import time

from boundgen.commands._common import DEMO_MODEL, add_engine_args

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


def _candidates(assets, query: str, n: int) -> list[int]:
    """Items sharing the most words with the query: the shortlist a recall stage would hand over."""
    words = set(re.findall(r"[\w$-]+", query.lower()))
    ranked = sorted(
        assets.catalog.items,
        key=lambda it: (-len(words & set(re.findall(r"[\w$-]+", it.title.lower()))), it.item_id),
    )
    return [it.item_id for it in ranked[:n]]


def _default_query(assets) -> tuple[str, list[int], dict]:
    """A held-out query with two relevant candidates, and the catalog's truth for its candidates."""
    groups = assets.eval["relevance"]
    g = next((g for g in groups if sum(c["label"] for c in g["candidates"]) >= 2), groups[0])
    return g["query"], [c["item_id"] for c in g["candidates"]], g["attrs"]


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
    print(
        f"model {path} ({engine.config.architecture}, {len(assets.catalog.items)} catalog items) "
        f"loaded on {engine.device} in {time.perf_counter() - t0:.1f}s"
    )

    # 1. Relevance: rank a shortlist for a query.
    attrs = None
    if args.query:
        query, ids = args.query, _candidates(assets, args.query, args.candidates)
    else:
        query, ids, attrs = _default_query(assets)
        ids += [i for i in _candidates(assets, query, args.candidates) if i not in ids]
        ids = ids[: max(args.candidates, 5)]
    probs = score_items(engine, assets, query, ids)
    print(
        f"\nRelevance  engine.score(query, items, label_token_ids={assets.label_token_ids})\n"
        f'query: "{query}"' + (f"  (attributes: {attrs})" if attrs else "")
    )
    print(f"  {'rank':>4}  {'P(yes)':>6}  {'truth' if attrs else ''}  item")
    for rank, (p, i) in enumerate(sorted(zip(probs, ids), key=lambda x: -x[0]), 1):
        truth = ""
        if attrs:
            item = assets.catalog.items[i]
            truth = "yes" if all(getattr(item, k) == v for k, v in attrs.items()) else "no"
        print(f"  {rank:>4}  {p:6.3f}  {truth:>5}  {assets.title(i)}")

    # 2. Generative retrieval: trie-constrained beam search over the catalog's semantic IDs.
    print(
        f"\nRecommendations  engine.beam_search(prompt, beam_width=10, steps=3, trie=<{len(trie)} "
        "items>)"
    )
    print(f'query: "{query}"')
    for item, lp in recommend(engine, trie, retrieval_prompt(query))[: args.top]:
        print(
            f"  {math.exp(lp):6.3f}  {assets.catalog.items[item].sid_text():<22} "
            f"{assets.title(item)}"
        )
    hist = assets.eval["history"][0]["history"]
    print("user history:")
    for i in hist:
        print(f"          {assets.catalog.items[i].sid_text():<22} {assets.title(i)}")
    print("next (history items excluded):")
    for item, lp in recommend(engine, trie, history_prompt(assets, hist), exclude=hist)[: args.top]:
        print(
            f"  {math.exp(lp):6.3f}  {assets.catalog.items[item].sid_text():<22} "
            f"{assets.title(item)}"
        )

    # 3. Held-out quality, computed now through the same calls.
    print("\nHeld-out quality (computed now)")
    if args.eval_groups > 0:
        t = time.perf_counter()
        value, n = relevance_auc(engine, assets, args.eval_groups)
        print(
            f"  relevance AUC          {value:.3f}  ({n} query-item pairs, "
            f"{time.perf_counter() - t:.1f}s)"
        )
    if args.eval_queries > 0 or args.eval_histories > 0:
        t = time.perf_counter()
        rec = retrieval_recall(engine, trie, assets, args.eval_queries, args.eval_histories)
        el = time.perf_counter() - t
        if rec["n_query"]:
            print(f"  recall@10 (queries)    {rec['query']:.3f}  ({rec['n_query']} queries)")
        if rec["n_history"]:
            print(f"  recall@10 (histories)  {rec['history']:.3f}  ({rec['n_history']} histories)")
        print(f"  recommended ids not in the catalog: {rec['invalid']}  ({el:.1f}s)")
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    return 0
