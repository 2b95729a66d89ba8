"""The fidelity gate's inputs: a fixed, deterministic evaluation set of ranking groups and beam
prompts (W1/W2/W4-style shapes from DESIGN §9, a held-out set, the set a demo checkpoint ships, or
one saved with `EvalSet.to_json`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ScoreCase:
    """One ranking group: `query` shared by `items`; an empty query means independent prompts."""

    set_name: str
    query: list[int]
    items: list[list[int]]
    label_token_ids: list[int]


@dataclass(frozen=True)
class BeamCase:
    set_name: str
    prompt: list[int]
    beam_width: int
    steps: int


@dataclass
class EvalSet:
    name: str
    score_cases: list[ScoreCase] = field(default_factory=list)
    beam_cases: list[BeamCase] = field(default_factory=list)

    def extend(self, other: EvalSet) -> EvalSet:
        return EvalSet(
            f"{self.name}+{other.name}",
            self.score_cases + other.score_cases,
            self.beam_cases + other.beam_cases,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "score_cases": [dataclasses.asdict(c) for c in self.score_cases],
                "beam_cases": [dataclasses.asdict(c) for c in self.beam_cases],
            }
        )

    def fit(self, max_len: int | None) -> EvalSet:
        """Trim sequences to a model's length limit (query + item ≤ max_len, prompt + steps ≤
        max_len), keeping the last tokens of queries/prompts; unchanged when everything fits or
        max_len is None."""
        if not max_len:
            return self
        cases = []
        for c in self.score_cases:
            items = [x[:max_len] for x in c.items]
            longest = max((len(x) for x in items), default=0)
            room = max(max_len - longest, 0)
            query = c.query[len(c.query) - room :] if len(c.query) > room else c.query
            cases.append(dataclasses.replace(c, query=list(query), items=items))
        beams = []
        for b in self.beam_cases:
            room = max(max_len - b.steps, 1)
            beams.append(dataclasses.replace(b, prompt=list(b.prompt[-room:])))
        return EvalSet(self.name, cases, beams)

    @classmethod
    def from_json(cls, text: str) -> EvalSet:
        d = json.loads(text)
        return cls(
            d.get("name", "custom"),
            [ScoreCase(**c) for c in d.get("score_cases", [])],
            [BeamCase(**c) for c in d.get("beam_cases", [])],
        )

    @classmethod
    def from_demo_dir(
        cls,
        model_dir: str | Path,
        encode: Callable[[str], list[int]],
        groups: int = 80,
        prompts: int = 100,
        beam_width: int = 10,
    ) -> EvalSet | None:
        """The held-out set shipped with a demo checkpoint (`eval.json` + `demo.json` +
        `catalog.json`, see boundgen.demo): relevance groups scored per query and pooled over all
        (query, item) pairs, and retrieval prompts decoded with `sid_levels` unconstrained beam
        steps. None if absent."""
        model_dir = Path(model_dir)
        files = [model_dir / n for n in ("eval.json", "demo.json", "catalog.json")]
        if not all(f.is_file() for f in files):
            return None
        ev, meta, catalog = (json.loads(f.read_text()) for f in files)
        t = meta["templates"]
        labels = list(meta["label_token_ids"])
        titles = {int(it["item_id"]): it["title"] for it in catalog["items"]}
        cases, pooled = [], []
        for g in ev.get("relevance", [])[:groups]:
            query = encode(t["relevance_query"].format(query=g["query"]))
            items = [
                encode(t["relevance_item"].format(title=titles[int(c["item_id"])]))
                for c in g["candidates"]
            ]
            cases.append(ScoreCase("demo", query, items, labels))
            pooled += [query + item for item in items]
        if pooled:
            cases.append(ScoreCase("demo-pooled", [], pooled, labels))
        beams = [
            BeamCase(
                "demo",
                encode(t["retrieval"].format(query=q["query"])),
                beam_width,
                int(meta.get("sid_levels", 3)),
            )
            for q in ev.get("retrieval", [])[:prompts]
        ]
        return cls(f"demo:{model_dir.name}", cases, beams)

    @classmethod
    def load(cls, path: str | Path) -> EvalSet:
        """A held-out set saved with `to_json` (e.g. a model's real queries, as token ids)."""
        return cls.from_json(Path(path).read_text())


# Sizes per scale: "full" is DESIGN §9's shapes (GPU), "small" keeps CPU runs to seconds on tiny
# models.
_SCALES = {
    "full": dict(
        w1_prompts=256,
        w1_len=(64, 256),
        w2_groups=8,
        w2_prefix=256,
        w2_items=100,
        w2_item_len=16,
        w4_prompts=100,
        w4_len=128,
        w4_width=16,
        w4_steps=4,
        ho_groups=6,
        ho_prefix=(64, 192),
        ho_items=50,
        ho_item_len=(8, 24),
        ho_beams=50,
    ),
    "small": dict(
        w1_prompts=32,
        w1_len=(8, 32),
        w2_groups=3,
        w2_prefix=24,
        w2_items=20,
        w2_item_len=4,
        w4_prompts=12,
        w4_len=16,
        w4_width=4,
        w4_steps=3,
        ho_groups=2,
        ho_prefix=(8, 24),
        ho_items=16,
        ho_item_len=(2, 6),
        ho_beams=6,
    ),
    "ci": dict(
        w1_prompts=8,
        w1_len=(4, 12),
        w2_groups=1,
        w2_prefix=8,
        w2_items=8,
        w2_item_len=3,
        w4_prompts=3,
        w4_len=6,
        w4_width=2,
        w4_steps=2,
        ho_groups=1,
        ho_prefix=(4, 8),
        ho_items=6,
        ho_item_len=(2, 4),
        ho_beams=1,
    ),
}


def default_label_ids(vocab_size: int) -> list[int]:
    """Two fixed label tokens (stand-ins for "yes"/"no") when the caller has none."""
    return [vocab_size // 3, (2 * vocab_size) // 3]


def make_eval_set(
    vocab_size: int,
    label_token_ids: Sequence[int] | None = None,
    scale: str = "full",
    seed: int = 0,
) -> EvalSet:
    """W1 (independent prompts), W2 (shared prefix + candidates), W4 (beam) inputs and a held-out
    set.

    Deterministic in (vocab_size, labels, scale, seed). W1-W4 draw token ids uniformly; the
    held-out set uses a different seed, Zipf-like token ids and other shapes, so a policy is not
    tuned to one shape.
    """
    if scale not in _SCALES:
        raise ValueError(f"unknown eval scale {scale!r}; choose from {list(_SCALES)}")
    p = _SCALES[scale]
    labels = list(label_token_ids) if label_token_ids else default_label_ids(vocab_size)
    rng = np.random.default_rng(seed)

    def uniform(n: int) -> list[int]:
        return rng.integers(0, vocab_size, size=n).tolist()

    cases: list[ScoreCase] = []
    lo, hi = p["w1_len"]
    w1_items = [uniform(int(rng.integers(lo, hi + 1))) for _ in range(p["w1_prompts"])]
    cases.append(ScoreCase("W1", [], w1_items, labels))
    for _ in range(p["w2_groups"]):
        cases.append(
            ScoreCase(
                "W2",
                uniform(p["w2_prefix"]),
                [uniform(p["w2_item_len"]) for _ in range(p["w2_items"])],
                labels,
            )
        )
    beams = [
        BeamCase("W4", uniform(p["w4_len"]), p["w4_width"], p["w4_steps"])
        for _ in range(p["w4_prompts"])
    ]

    held = np.random.default_rng(seed + 1_000_003)
    weights = 1.0 / np.arange(1, vocab_size + 1) ** 1.1
    weights /= weights.sum()
    perm = held.permutation(vocab_size)

    def zipf(n: int) -> list[int]:
        return perm[held.choice(vocab_size, size=n, p=weights)].tolist()

    for _ in range(p["ho_groups"]):
        plo, phi = p["ho_prefix"]
        ilo, ihi = p["ho_item_len"]
        cases.append(
            ScoreCase(
                "heldout",
                zipf(int(held.integers(plo, phi + 1))),
                [zipf(int(held.integers(ilo, ihi + 1))) for _ in range(p["ho_items"])],
                labels,
            )
        )
    for _ in range(p["ho_beams"]):
        beams.append(
            BeamCase(
                "heldout",
                zipf(int(held.integers(p["w4_len"] // 2, p["w4_len"] + 1))),
                p["w4_width"],
                p["w4_steps"],
            )
        )
    return EvalSet(f"{scale}-seed{seed}", cases, beams)


def gate_eval_set(
    engine,
    model_dir: str | Path,
    *,
    scale: str | None = None,
    seed: int = 0,
    labels: Sequence[int] | None = None,
    extra: Sequence[str | Path] = (),
    demo: bool = True,
) -> EvalSet:
    """The eval set `boundgen quant-check` gates a loaded engine on: W1/W2/W4 and held-out inputs at
    `scale` (default: "full" on CUDA, "small" elsewhere), the `extra` sets (`EvalSet.to_json`
    files), and the held-out set a demo checkpoint ships (unless `demo=False`), fitted to the
    model's context."""
    scale = scale or ("full" if engine.device.type == "cuda" else "small")
    eval_set = make_eval_set(engine.config.vocab_size, labels, scale=scale, seed=seed)
    for path in extra:
        eval_set = eval_set.extend(EvalSet.load(path))
    shipped = EvalSet.from_demo_dir(model_dir, engine.tokenizer.encode) if demo else None
    if shipped is not None:
        eval_set = eval_set.extend(shipped)
    return eval_set.fit(engine.limits.max_seq_len)
