"""boundgen beam: bounded beam search (optionally trie-constrained), printed as JSON."""

from __future__ import annotations

import json

from boundgen.commands._common import add_engine_args, load_engine

HELP = "bounded beam search for one prompt, optionally constrained to the item IDs of a trie file"


def add_arguments(parser) -> None:
    add_engine_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--beam-width", "--width", dest="beam_width", type=int, default=16, help="beam width"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="decode steps (= item ID length with a trie)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="results to print (default: width)")
    parser.add_argument(
        "--trie", default=None, help="item IDs: JSONL {item_id, tokens} or .npy [items, depth]"
    )


def run(args) -> int:
    from boundgen import Trie

    engine = load_engine(args)
    trie = Trie.from_file(args.trie) if args.trie else None
    results = engine.beam_search(
        args.prompt, args.beam_width, args.steps, top_k=args.top_k, trie=trie
    )
    rows = []
    for tokens, logprob in results:
        row = {"tokens": tokens, "logprob": logprob, "text": engine.tokenizer.decode(tokens)}
        if trie is not None:
            row["item_id"] = trie.item_ids(tokens)
        rows.append(row)
    print(json.dumps({"model": engine.model_name, "results": rows}, indent=2))
    return 0
