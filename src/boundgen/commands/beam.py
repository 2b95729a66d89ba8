"""boundgen beam: bounded beam search (optionally trie-constrained), printed as JSON."""

from __future__ import annotations

import json

from boundgen.commands._common import DEMO_MODEL, add_engine_args, load_engine

HELP = "bounded beam search for one prompt, optionally constrained to the item IDs of a trie file"


def add_arguments(parser) -> None:
    add_engine_args(parser, model_default=DEMO_MODEL)
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--beam-width", "--width", dest="beam_width", type=int, default=16, help="beam width"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="decode steps (default: the trie's depth, which is the item ID length; else 4)",
    )
    parser.add_argument("--top-k", type=int, default=None, help="results to print (default: width)")
    parser.add_argument(
        "--trie",
        default=None,
        help="item IDs: JSONL {item_id, tokens} or .npy [items, depth] (default: with the "
        "built-in model, its catalog's trie)",
    )
    parser.add_argument(
        "--trie-softmax",
        choices=("vocab", "children"),
        default="vocab",
        help="a step's log-probs over the full vocabulary (default, as HF generate) or over the "
        "beam's trie children (the LM head then runs on the trie's tokens only)",
    )


def run(args) -> int:
    from boundgen import Trie
    from boundgen.demo import default_trie_path

    engine = load_engine(args)
    trie_path = args.trie or (default_trie_path() if args.model is None else None)
    trie = Trie.from_file(trie_path, softmax=args.trie_softmax) if trie_path else None
    steps = args.steps or (trie.depth if trie is not None else 4)
    results = engine.beam_search(args.prompt, args.beam_width, steps, top_k=args.top_k, trie=trie)
    titles = _catalog_titles() if args.model is None else {}
    rows = []
    for tokens, logprob in results:
        row = {"tokens": tokens, "logprob": logprob, "text": engine.tokenizer.decode(tokens)}
        if trie is not None:
            row["item_id"] = trie.item_ids(tokens)
            if row["item_id"] in titles:
                row["title"] = titles[row["item_id"]]
        rows.append(row)
    print(json.dumps({"model": engine.model_name, "results": rows}, indent=2))
    return 0


def _catalog_titles() -> dict[int, str]:
    """The built-in model's catalog: item id → title, to show next to each semantic ID."""
    from boundgen.demo import default_model_path
    from boundgen.demo.evaluate import DemoAssets

    return {
        item.item_id: item.title for item in DemoAssets.load(default_model_path()).catalog.items
    }
