"""Held-out quality of a demo checkpoint through the engine's public API.

Relevance AUC comes from `engine.score` (label logits of ' yes'/' no'); retrieval recall@10 from
`engine.beam_search(..., trie=...)` over the catalog trie. Used by `boundgen demo`, the tests and
the FP8 gate's task metrics (`gate_task_metrics`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from boundgen.demo import catalog as cat
from boundgen.demo.train import auc, recall_at_k
from boundgen.quant.outputs import TaskMetric


@dataclass
class DemoAssets:
    path: Path
    catalog: cat.Catalog
    eval: dict
    meta: dict

    @classmethod
    def load(cls, path: str | Path) -> DemoAssets:
        path = Path(path)
        catalog = cat.Catalog.from_json(json.loads((path / "catalog.json").read_text()))
        return cls(
            path,
            catalog,
            json.loads((path / "eval.json").read_text()),
            json.loads((path / "demo.json").read_text()),
        )

    @property
    def label_token_ids(self) -> list[int]:
        return list(self.meta["label_token_ids"])

    @property
    def trie_path(self) -> Path:
        return self.path / self.meta.get("trie", "catalog_trie.jsonl")

    def title(self, item_id) -> str:
        return self.catalog.items[int(item_id)].title


def relevance_query(query: str) -> str:
    return cat.RELEVANCE_QUERY_TEMPLATE.format(query=query)


def relevance_item(title: str) -> str:
    return cat.RELEVANCE_ITEM_TEMPLATE.format(title=title)


def retrieval_prompt(query: str) -> str:
    return cat.RETRIEVAL_TEMPLATE.format(query=query)


def history_prompt(assets: DemoAssets, history: list[int]) -> str:
    return cat.HISTORY_TEMPLATE.format(history=cat.history_text(assets.catalog, history))


def score_items(engine, assets: DemoAssets, query: str, item_ids: list[int]) -> list[float]:
    """P(' yes') for each item (softmax over the two label tokens)."""
    items = [relevance_item(assets.title(i)) for i in item_ids]
    rows = engine.score(relevance_query(query), items, assets.label_token_ids, apply_softmax=True)
    return [r[0] for r in rows]


def recommend(engine, trie, prompt: str, k: int = 10, exclude=()) -> list[tuple[object, float]]:
    """(item id, sequence log-prob) of the top-k trie-constrained beams, minus `exclude` (items the
    user has already seen: the beam is widened by their number, then they are dropped)."""
    width = k + len(exclude)
    beams = engine.beam_search(prompt, beam_width=width, steps=trie.depth, top_k=width, trie=trie)
    got = [(trie.item_ids(list(tokens[-trie.depth :])), lp) for tokens, lp in beams]
    return [(item, lp) for item, lp in got if item not in set(exclude)][:k]


def recommend_many(
    engine, trie, prompts: list[str], k: int = 10, exclude: list | None = None, chunk: int = 64
):
    """`recommend` for many prompts via `engine.beam_search_batch` (one packed prefill per
    chunk)."""
    exclude = exclude or [()] * len(prompts)
    width = k + max((len(e) for e in exclude), default=0)
    out = []
    for i in range(0, len(prompts), chunk):
        batch = engine.beam_search_batch(
            prompts[i : i + chunk], beam_width=width, steps=trie.depth, top_k=width, trie=trie
        )
        for beams, skip in zip(batch, exclude[i : i + chunk]):
            got = [(trie.item_ids(list(tokens[-trie.depth :])), lp) for tokens, lp in beams]
            out.append([(item, lp) for item, lp in got if item not in set(skip)][:k])
    return out


def _relevance_scores(engine, assets: DemoAssets, groups: int) -> tuple[list[float], list[int]]:
    scores, labels = [], []
    for g in assets.eval["relevance"][:groups]:
        ids = [c["item_id"] for c in g["candidates"]]
        scores += score_items(engine, assets, g["query"], ids)
        labels += [c["label"] for c in g["candidates"]]
    return scores, labels


def relevance_auc(engine, assets: DemoAssets, groups: int = 40) -> tuple[float, int]:
    scores, labels = _relevance_scores(engine, assets, groups)
    return auc(scores, labels), len(labels)


def _recommendations(
    engine, trie, assets: DemoAssets, queries: int, histories: int, k: int
) -> dict[str, list[tuple[list, list[int]]]]:
    """Per prompt kind ("query", "history"): (recommended item ids, relevant ids) per held-out
    prompt. History prompts do not count the history's own items (they are excluded from the
    recommendations)."""
    cases = {
        "query": [
            (retrieval_prompt(q["query"]), q["relevant"], ())
            for q in assets.eval["retrieval"][:queries]
        ],
        "history": [
            (history_prompt(assets, h["history"]), h["relevant"], tuple(h["history"]))
            for h in assets.eval["history"][:histories]
        ],
    }
    out = {}
    for name, rows in cases.items():
        results = recommend_many(
            engine, trie, [prompt for prompt, _, _ in rows], k, [skip for _, _, skip in rows]
        )
        out[name] = [
            ([item for item, _ in got], relevant) for got, (_, relevant, _) in zip(results, rows)
        ]
    return out


def retrieval_recall(
    engine, trie, assets: DemoAssets, queries: int = 100, histories: int = 50, k: int = 10
) -> dict:
    """Mean recall@k (|top-k ∩ relevant| / min(k, |relevant|)) for query and history prompts, and
    the number of recommended ids that are not catalog items (must be 0)."""
    known = {it.item_id for it in assets.catalog.items}
    out: dict = {"invalid": 0}
    for name, rows in _recommendations(engine, trie, assets, queries, histories, k).items():
        out[name] = sum(recall_at_k(items, relevant, k) for items, relevant in rows) / max(
            1, len(rows)
        )
        out[f"n_{name}"] = len(rows)
        out["invalid"] += sum(1 for items, _ in rows for item in items if item not in known)
    return out


def gate_task_metrics(engine, assets: DemoAssets, trie, k: int = 10) -> dict[str, TaskMetric]:
    """What a user of the demo model gets, against every held-out label it ships (the FP8 gate's
    task metrics): relevance AUC, recall@k and hit@1 (the best recommendation is relevant) of the
    trie-constrained recommendations for query and history prompts. Each with its resolution,
    the change one decision makes: one positive/negative pair reordered, one relevant item found
    or lost by one prompt (on average over the prompts: 1/min(k, |relevant|) of that prompt's
    recall), one prompt's best recommendation."""
    scores, labels = _relevance_scores(engine, assets, len(assets.eval["relevance"]))
    positives = sum(labels)
    out = {
        "relevance AUC": TaskMetric(
            auc(scores, labels), 1.0 / (positives * (len(labels) - positives))
        )
    }
    rows_by_kind = _recommendations(
        engine, trie, assets, len(assets.eval["retrieval"]), len(assets.eval["history"]), k
    )
    for name, rows in rows_by_kind.items():
        n = len(rows)
        recall = sum(recall_at_k(items, relevant, k) for items, relevant in rows) / n
        one_item = sum(1.0 / min(k, len(relevant)) for _, relevant in rows) / n
        out[f"recall@{k} {name}"] = TaskMetric(recall, one_item / n)
        hits = sum(bool(items) and items[0] in set(relevant) for items, relevant in rows)
        out[f"hit@1 {name}"] = TaskMetric(hits / n, 1.0 / n)
    return out
