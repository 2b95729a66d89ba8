"""Throughput of one large score request on CPU with the runner's forward pieces at
`CPU_PIECE_TOKENS` (the cancellation granularity, issue 19) against one piece of up to
`max_batch_tokens`: the module constant is swapped between interleaved rounds.

    python benchmarks/bench_pieces.py --rounds 4
"""

from __future__ import annotations

import argparse
import random
import time

import boundgen.runner as runner
from boundgen import Engine
from boundgen.demo import default_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--item-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    rng = random.Random(1)
    query = [rng.randrange(10, 1800) for _ in range(16)]
    items = [[rng.randrange(10, 1800) for _ in range(args.item_tokens)] for _ in range(args.items)]
    engine = Engine.from_pretrained(default_model_path(), device="cpu")
    engine.score(query, items[:16], [299, 272])  # warm-up
    pieces = (runner.CPU_PIECE_TOKENS, engine.runner.max_batch_tokens)
    seconds: dict[int, list[float]] = {piece: [] for piece in pieces}
    for _ in range(args.rounds):
        for piece in pieces:
            runner.CPU_PIECE_TOKENS = piece
            start = time.perf_counter()
            engine.score(query, items, [299, 272])
            seconds[piece].append(time.perf_counter() - start)
    tokens = len(query) + sum(len(i) for i in items)
    for piece, runs in seconds.items():
        runs = sorted(runs)
        print(
            f"pieces of {piece} tokens: {tokens} tokens, best {runs[0]:.2f} s "
            f"({tokens / runs[0]:,.0f} tokens/s), median {runs[len(runs) // 2]:.2f} s"
        )


if __name__ == "__main__":
    main()
