"""boundgen score: label-token scores of query + items, printed as JSON."""

from __future__ import annotations

import json

from boundgen.commands._common import DEMO_MODEL, add_engine_args, load_engine, parse_labels

HELP = "score a query against items by label-token logits (SGLang /v1/score semantics); prints JSON"


def add_arguments(parser) -> None:
    add_engine_args(parser, model_default=DEMO_MODEL)
    parser.add_argument("--query", required=True)
    parser.add_argument(
        "--item", action="append", required=True, help="an item (repeat for several)"
    )
    parser.add_argument(
        "--labels",
        nargs="+",
        required=True,
        help="label tokens: ids or single-token texts such as ' yes' ' no'",
    )
    parser.add_argument("--softmax", action="store_true", help="softmax over the label tokens")
    parser.add_argument("--item-first", action="store_true", help="sequence = item + query")
    parser.add_argument(
        "--truncate", action="store_true", help="cut over-long items instead of failing"
    )


def run(args) -> int:
    engine = load_engine(args)
    labels = parse_labels(engine, args.labels)
    scores = engine.score(
        args.query,
        args.item,
        labels,
        apply_softmax=args.softmax,
        item_first=args.item_first,
        truncate=args.truncate,
    )
    print(
        json.dumps(
            {"model": engine.model_name, "label_token_ids": labels, "scores": scores}, indent=2
        )
    )
    return 0
