"""Seeded synthetic product catalog for the built-in demo model.

Items have structured attributes (category, product type, brand, color, price band, city) and are
rendered as titles. Semantic IDs are three tokens derived from the attributes, so similar items
share
prefixes:

- level 1 `<a_i>`: category
- level 2 `<b_i>`: brand (within the category) x price band
- level 3 `<c_i>`: product type x color (unique inside its (category, brand, band) group)

The same seed always gives the same catalog, queries, histories and splits (`random.Random` only).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

# Prompt templates shared by training, `boundgen demo` and the server (see docs/demo.md).
# Relevance is scored as query part + item part, tokenized separately and concatenated; both parts
# split at a newline, so tokenizing them together gives the same ids.
RELEVANCE_QUERY_TEMPLATE = "Query: {query}\n"
RELEVANCE_ITEM_TEMPLATE = "Item: {title}\nRelevant:"
LABEL_WORDS = (" yes", " no")
RETRIEVAL_TEMPLATE = "Query: {query}\nID:"
HISTORY_TEMPLATE = "History: {history}\nNext:"
INDEX_TEMPLATE = "Item: {title}\nID:"

SID_LEVELS = ("a", "b", "c")
SID_CODES = 256

CATEGORIES: dict[str, dict] = {
    "shoes": {
        "types": {
            "running shoes": ["runners", "running sneakers"],
            "hiking boots": ["trail boots", "walking boots"],
            "sneakers": ["trainers"],
            "sandals": ["summer sandals"],
        },
        "scale": 1,
    },
    "jackets": {
        "types": {
            "rain jacket": ["raincoat", "waterproof jacket"],
            "down jacket": ["puffer jacket"],
            "fleece jacket": ["fleece"],
            "denim jacket": ["jean jacket"],
        },
        "scale": 1,
    },
    "bags": {
        "types": {
            "backpack": ["rucksack"],
            "tote bag": ["shopping tote"],
            "duffel bag": ["gym bag", "travel duffel"],
            "messenger bag": ["shoulder bag"],
        },
        "scale": 1,
    },
    "headphones": {
        "types": {
            "wireless earbuds": ["true wireless earbuds"],
            "over-ear headphones": ["noise cancelling headphones"],
            "sports earbuds": ["workout earbuds"],
            "studio headphones": ["monitor headphones"],
        },
        "scale": 1,
    },
    "watches": {
        "types": {
            "smartwatch": ["smart watch"],
            "dive watch": ["diver watch"],
            "dress watch": ["formal watch"],
            "fitness tracker": ["activity tracker"],
        },
        "scale": 10,
    },
    "kitchen": {
        "types": {
            "coffee maker": ["coffee machine"],
            "blender": ["smoothie blender"],
            "kettle": ["electric kettle"],
            "toaster": ["bread toaster"],
        },
        "scale": 1,
    },
    "furniture": {
        "types": {
            "office chair": ["desk chair"],
            "bookshelf": ["bookcase"],
            "desk lamp": ["reading lamp"],
            "sofa": ["couch"],
        },
        "scale": 10,
    },
    "bikes": {
        "types": {
            "road bike": ["racing bike"],
            "mountain bike": ["mtb"],
            "city bike": ["commuter bike"],
            "e-bike": ["electric bike"],
        },
        "scale": 10,
    },
    "toys": {
        "types": {
            "building set": ["building blocks"],
            "plush toy": ["stuffed animal"],
            "jigsaw puzzle": ["puzzle"],
            "rc car": ["remote control car"],
        },
        "scale": 1,
    },
    "sports": {
        "types": {
            "yoga mat": ["exercise mat"],
            "tennis racket": ["tennis racquet"],
            "football": ["soccer ball"],
            "dumbbells": ["hand weights"],
        },
        "scale": 1,
    },
    "camping": {
        "types": {
            "tent": ["camping tent"],
            "sleeping bag": ["sleep bag"],
            "camping stove": ["gas stove"],
            "headlamp": ["head torch"],
        },
        "scale": 1,
    },
    "laptops": {
        "types": {
            "ultrabook": ["thin laptop"],
            "gaming laptop": ["gaming notebook"],
            "2-in-1 laptop": ["convertible laptop"],
            "chromebook": ["chrome laptop"],
        },
        "scale": 10,
    },
}

COLORS = ["black", "white", "red", "blue", "green", "grey", "navy", "beige", "yellow", "pink"]
COLOR_SYNONYMS = {"grey": ["gray"], "navy": ["navy blue"], "beige": ["sand"]}
CITIES = ["Berlin", "Paris", "Madrid", "Rome", "Vienna", "Lisbon", "Prague", "Warsaw"]

# Price bands; prices are these points times the category's scale.
BANDS = ["budget", "mid-range", "premium", "luxury"]
BAND_PRICES = [
    [9, 12, 15, 19, 24],
    [29, 35, 39, 45, 49, 59, 69, 79],
    [99, 119, 129, 149, 179, 199, 249],
    [299, 349, 399, 499, 599, 799, 999],
]
BAND_WORDS = [
    ["budget", "cheap", "affordable", "low-cost"],
    ["mid-range", "mid-priced", "reasonably priced"],
    ["premium", "high-end", "quality"],
    ["luxury", "top-of-the-line", "designer"],
]
MODEL_WORDS = ["Pro", "Air", "Lite", "Max", "One", "Flex", "Edge", "Neo", "Core", "Plus", "X", "Go"]
BRANDS_PER_CATEGORY = 8

_SYL_A = [
    "Nor",
    "Zen",
    "Alt",
    "Vel",
    "Kor",
    "Lum",
    "Tri",
    "Ora",
    "Sky",
    "Bri",
    "Mar",
    "Fen",
    "Ast",
    "Cor",
    "Del",
    "Eko",
    "Hal",
    "Iso",
    "Jun",
    "Kai",
    "Lio",
    "Mos",
    "Nim",
    "Pax",
    "Qui",
    "Rho",
    "Sol",
    "Tev",
    "Ulm",
    "Vor",
    "Wex",
    "Yar",
]
_SYL_B = [
    "vik",
    "tra",
    "ora",
    "on",
    "ix",
    "ano",
    "ela",
    "ium",
    "sen",
    "dal",
    "ro",
    "ex",
    "ara",
    "is",
    "und",
    "ette",
]


@dataclass(frozen=True)
class Item:
    item_id: int
    category: str
    product_type: str
    brand: str
    color: str
    band: int
    price: int
    city: str
    model: str
    title: str
    sid: tuple[int, int, int]

    def sid_text(self) -> str:
        return sid_text(self.sid)


def sid_text(sid) -> str:
    return "".join(f"<{level}_{code}>" for level, code in zip(SID_LEVELS, sid))


def sid_vocab() -> list[str]:
    return [f"<{level}_{code}>" for level in SID_LEVELS for code in range(SID_CODES)]


@dataclass
class Catalog:
    seed: int
    items: list[Item]
    brands: dict[str, list[str]]
    by_sid: dict[tuple[int, int, int], Item] = field(default_factory=dict)

    by_category: dict[str, list[Item]] = field(default_factory=dict)

    def __post_init__(self):
        self.by_sid = {it.sid: it for it in self.items}
        self.by_category = {}
        for it in self.items:
            self.by_category.setdefault(it.category, []).append(it)

    def to_json(self) -> dict:
        return {"seed": self.seed, "items": [asdict(it) for it in self.items]}

    @classmethod
    def from_json(cls, data: dict) -> Catalog:
        items = [Item(**{**d, "sid": tuple(d["sid"])}) for d in data["items"]]
        brands: dict[str, list[str]] = {}
        for it in items:
            brands.setdefault(it.category, [])
            if it.brand not in brands[it.category]:
                brands[it.category].append(it.brand)
        return cls(seed=data["seed"], items=items, brands=brands)


def _brand_names(rng: random.Random) -> dict[str, list[str]]:
    names = sorted({a + b for a in _SYL_A for b in _SYL_B})
    rng.shuffle(names)
    out, pos = {}, 0
    for cat in CATEGORIES:
        out[cat] = names[pos : pos + BRANDS_PER_CATEGORY]
        pos += BRANDS_PER_CATEGORY
    return out


def render_title(
    brand: str, model: str, product_type: str, color: str, price: int, city: str
) -> str:
    return f"{brand} {model} {product_type}, {color}, ${price}, {city}"


def make_catalog(seed: int = 0, num_items: int = 3000) -> Catalog:
    """`num_items` distinct (category, type, brand, band, color) combinations, each one item."""
    rng = random.Random(seed)
    brands = _brand_names(rng)
    combos = [
        (cat, t, b, band, c)
        for cat in CATEGORIES
        for t in range(len(CATEGORIES[cat]["types"]))
        for b in range(BRANDS_PER_CATEGORY)
        for band in range(len(BANDS))
        for c in range(len(COLORS))
    ]
    if num_items > len(combos):
        raise ValueError(f"num_items must be <= {len(combos)}")
    chosen = sorted(rng.sample(range(len(combos)), num_items))
    cats = list(CATEGORIES)
    items = []
    for item_id, idx in enumerate(chosen):
        cat, t, b, band, c = combos[idx]
        ptype = list(CATEGORIES[cat]["types"])[t]
        price = rng.choice(BAND_PRICES[band]) * CATEGORIES[cat]["scale"]
        city = rng.choice(CITIES)
        model = rng.choice(MODEL_WORDS)
        brand = brands[cat][b]
        sid = (cats.index(cat), b * len(BANDS) + band, t * len(COLORS) + c)
        title = render_title(brand, model, ptype, COLORS[c], price, city)
        items.append(
            Item(item_id, cat, ptype, brand, COLORS[c], band, price, city, model, title, sid)
        )
    return Catalog(seed=seed, items=items, brands=brands)


# ---------------------------------------------------------------- queries


def _band_phrase(rng: random.Random, band: int, scale: int) -> tuple[str, bool]:
    """(phrase, goes_before_noun)."""
    r = rng.random()
    if band == 0 and r < 0.3:
        return f"under ${25 * scale}", False
    if band == 3 and r < 0.3:
        return f"over ${290 * scale}", False
    if band in (1, 2) and r < 0.25:
        lo, hi = (25, 95) if band == 1 else (95, 290)
        return f"between ${lo * scale} and ${hi * scale}", False
    return rng.choice(BAND_WORDS[band]), True


def _noun(rng: random.Random, item: Item, use_category: bool) -> str:
    if use_category:
        return item.category
    syn = CATEGORIES[item.category]["types"][item.product_type]
    return rng.choice(syn) if rng.random() < 0.3 else item.product_type


def _color_word(rng: random.Random, color: str) -> str:
    if color in COLOR_SYNONYMS and rng.random() < 0.4:
        return rng.choice(COLOR_SYNONYMS[color])
    return color


def make_query(rng: random.Random, item: Item, allow_city: bool) -> tuple[str, dict]:
    """A query naming a random subset of `item`'s attributes, with varied wording and order.

    Returns the text and the attributes it constrains (keys of `Item`)."""
    use_category = rng.random() < 0.15
    attrs: dict = {"category": item.category}
    if not use_category:
        attrs["product_type"] = item.product_type
    want = {k for k, p in (("brand", 0.6), ("color", 0.6), ("band", 0.5)) if rng.random() < p}
    if use_category and not want:
        want.add(rng.choice(["brand", "color", "band"]))
    city = allow_city and rng.random() < 0.25
    noun = _noun(rng, item, use_category)
    pre, post = [], []
    if "band" in want:
        phrase, before = _band_phrase(rng, item.band, CATEGORIES[item.category]["scale"])
        (pre if before else post).append(phrase)
        attrs["band"] = item.band
    if "color" in want:
        attrs["color"] = item.color
        word = _color_word(rng, item.color)
        if rng.random() < 0.7:
            pre.append(word)
        else:
            post.append(f"in {word}")
    if "brand" in want:
        attrs["brand"] = item.brand
        if rng.random() < 0.7:
            pre.append(item.brand)
        else:
            post.append(rng.choice(["by", "from"]) + f" {item.brand}")
    if city:
        attrs["city"] = item.city
        post.append(rng.choice(["in", "near", "ships from"]) + f" {item.city}")
    rng.shuffle(post)
    core = " ".join(pre + [noun] + post)
    lead = rng.choice(["", "", "", "looking for ", "best ", "need a ", "show me ", "buy "])
    return (lead + core).strip(), attrs


def matches(item: Item, attrs: dict) -> bool:
    """Whether a catalog item has every attribute the query names (the ground truth)."""
    return all(getattr(item, k) == v for k, v in attrs.items())


def _hard_negative(rng: random.Random, catalog: Catalog, item: Item, attrs: dict) -> Item | None:
    """An item that matches every constrained attribute but one."""
    keys = [k for k in attrs if k != "category"]
    rng.shuffle(keys)
    for key in keys:
        pool = [
            it
            for it in _same_category(catalog, item.category)
            if getattr(it, key) != attrs[key]
            and all(getattr(it, k) == v for k, v in attrs.items() if k != key)
        ]
        if pool:
            return rng.choice(pool)
    return None


def _same_category(catalog: Catalog, category: str) -> list[Item]:
    return catalog.by_category[category]


def relevance_groups(
    catalog: Catalog, seed: int, n_groups: int, items: list[Item] | None = None, candidates: int = 5
) -> list[dict]:
    """Groups of {query, attrs, candidates: [{item_id, label}]}: positives, hard and easy
    negatives."""
    rng = random.Random(seed)
    pool = items or catalog.items
    groups = []
    while len(groups) < n_groups:
        item = rng.choice(pool)
        query, attrs = make_query(rng, item, allow_city=True)
        same = _same_category(catalog, item.category)
        positives = [it for it in same if matches(it, attrs)]
        cands: dict[int, int] = {}
        for it in rng.sample(positives, min(len(positives), rng.randint(1, 2))):
            cands[it.item_id] = 1
        tries = 0
        while len(cands) < candidates and tries < 20:
            tries += 1
            r = rng.random()
            if r < 0.7:
                neg = _hard_negative(rng, catalog, item, attrs)
            elif r < 0.85:
                neg = rng.choice(same)
            else:
                neg = rng.choice(catalog.items)
            if neg is None or neg.item_id in cands:
                continue
            cands[neg.item_id] = int(matches(neg, attrs))
        groups.append(
            {
                "query": query,
                "attrs": attrs,
                "candidates": [{"item_id": i, "label": y} for i, y in cands.items()],
            }
        )
    return groups


def retrieval_queries(
    catalog: Catalog, seed: int, n: int, items: list[Item] | None = None
) -> list[dict]:
    """{query, target, relevant}: `relevant` = ids of every item matching the query's attributes."""
    rng = random.Random(seed)
    pool = items or catalog.items
    out = []
    for _ in range(n):
        item = rng.choice(pool)
        query, attrs = make_query(rng, item, allow_city=False)
        relevant = [
            it.item_id for it in _same_category(catalog, item.category) if matches(it, attrs)
        ]
        out.append({"query": query, "target": item.item_id, "relevant": relevant})
    return out


def histories(catalog: Catalog, seed: int, n: int) -> list[dict]:
    """{history: [item ids], target, relevant}: a user browsing one (category, brand, price band);
    a quarter of histories carry one unrelated item. `relevant` = the group minus the history."""
    rng = random.Random(seed)
    groups: dict[tuple[int, int], list[Item]] = {}
    for it in catalog.items:
        groups.setdefault(it.sid[:2], []).append(it)
    keys = sorted(k for k, v in groups.items() if len(v) >= 3)
    out = []
    for _ in range(n):
        group = groups[rng.choice(keys)]
        k = rng.randint(2, min(4, len(group) - 1))
        picked = rng.sample(group, k + 1)
        hist, target = picked[:k], picked[k]
        if rng.random() < 0.25:
            other = rng.choice(catalog.items)
            if other.sid[:2] != target.sid[:2]:
                hist.insert(rng.randrange(len(hist) + 1), other)
        hist_ids = [it.item_id for it in hist]
        relevant = [it.item_id for it in group if it.item_id not in hist_ids]
        out.append({"history": hist_ids, "target": target.item_id, "relevant": relevant})
    return out


def make_splits(
    catalog: Catalog,
    seed: int = 0,
    *,
    train_rel: int = 40000,
    train_ret: int = 30000,
    train_hist: int = 8000,
    test_rel: int = 400,
    test_ret: int = 400,
    test_hist: int = 200,
) -> dict:
    """Train and held-out sets. Held-out queries never occur verbatim in training, and 10% of the
    items never appear as a training query's source (they are learned through the index task
    only)."""
    rng = random.Random(seed + 1)
    ids = list(range(len(catalog.items)))
    rng.shuffle(ids)
    held_items = set(ids[: len(ids) // 10])
    train_items = [it for it in catalog.items if it.item_id not in held_items]

    train = {
        "relevance": relevance_groups(catalog, seed + 10, train_rel // 5, train_items),
        "retrieval": retrieval_queries(catalog, seed + 11, train_ret, train_items),
        "history": histories(catalog, seed + 12, train_hist),
    }
    seen_q = {g["query"] for g in train["relevance"]} | {q["query"] for q in train["retrieval"]}
    seen_h = {tuple(h["history"]) for h in train["history"]}
    test_rel_groups = [
        g
        for g in relevance_groups(catalog, seed + 20, test_rel // 5 * 3)
        if g["query"] not in seen_q
    ][: test_rel // 5]
    test_ret_q = [
        q for q in retrieval_queries(catalog, seed + 21, test_ret * 3) if q["query"] not in seen_q
    ][:test_ret]
    test_hist = [
        h for h in histories(catalog, seed + 22, test_hist * 3) if tuple(h["history"]) not in seen_h
    ][:test_hist]
    test = {"relevance": test_rel_groups, "retrieval": test_ret_q, "history": test_hist}
    return {"train": train, "test": test, "held_out_items": sorted(held_items)}


def history_text(catalog: Catalog, history: list[int]) -> str:
    return "".join(catalog.items[i].sid_text() for i in history)


def corpus_lines(catalog: Catalog, splits: dict) -> list[str]:
    """Text the tokenizer is trained on: titles and every prompt template filled in."""
    lines = [INDEX_TEMPLATE.format(title=it.title) for it in catalog.items]
    for g in splits["train"]["relevance"][:3000]:
        lines.append(RELEVANCE_QUERY_TEMPLATE.format(query=g["query"]))
        for c in g["candidates"]:
            title = catalog.items[c["item_id"]].title
            lines.append(RELEVANCE_ITEM_TEMPLATE.format(title=title) + LABEL_WORDS[1 - c["label"]])
    lines += [
        RETRIEVAL_TEMPLATE.format(query=q["query"]) for q in splits["train"]["retrieval"][:3000]
    ]
    lines += [HISTORY_TEMPLATE.format(history="") for _ in range(10)]
    return lines
