"""Trie build time/memory and per-step cost of children / next_node / the beam search's trie step.

    python benchmarks/bench_trie.py --sizes 1e5,1e6,1e7 --beams 16,128

Items are random `depth`-level semantic IDs with `codes` codes per level (duplicates dropped).
Build peak memory is the numpy/Python peak seen by tracemalloc; `nbytes` is what the trie keeps.
Timed at depth `depth - 2` (many nodes, real fan-out), N beams of one prompt on real items:
`children` with a preallocated `TrieWorkspace` (the decode-loop path); `next_node` as the item
lookup calls it (no workspace); `step`: what `beam_search.run_beam` does with a trie per step
(children, gather of the children's fp32 log-probs over the W4 vocabulary (151936), top N of all
candidates, child lookup), eager and, on CUDA, captured in one CUDA graph (`graph`).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
import torch
from common import capture_graph

from boundgen.workloads.trie import Trie


def parse_list(text: str, cast=int) -> list:
    return [cast(float(x)) if cast is int else cast(x) for x in text.split(",") if x]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, iters: int) -> float:
    """Mean microseconds per call after a warm-up."""
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e6


def bench_build(num_items: int, depth: int, codes: int, seed: int):
    rng = np.random.default_rng(seed)
    seqs = rng.integers(0, codes, (num_items, depth), dtype=np.int64)
    tracemalloc.start()
    start = time.perf_counter()
    trie = Trie.from_sequences(seqs, on_duplicate="first")
    build_s = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return trie, seqs, build_s, peak


def beam_step(trie: Trie, depth: int, node, logp, scores, ws):
    """One trie step of `run_beam` for one prompt of N beams → (scores, tokens, next nodes)."""
    tokens, child, valid = trie.children(depth, node, ws=ws)  # [N, C] each
    lp = logp.gather(1, tokens).masked_fill_(~valid, float("-inf"))
    top, idx = torch.topk((scores.unsqueeze(1) + lp).view(1, -1), node.shape[0], dim=1)
    token = tokens.reshape(1, -1).gather(1, idx)
    nxt = child.reshape(1, -1).gather(1, idx).masked_fill_(top == float("-inf"), -1)
    return top.view(-1), token.view(-1), nxt.view(-1)


def bench_steps(trie: Trie, seqs: np.ndarray, device, beams: int, vocab: int, iters: int, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, len(seqs), (beams,), generator=gen)
    path = torch.as_tensor(seqs)[rows].to(device)  # real items, so every depth has live nodes
    depth = trie.depth - 2  # a deep level: many nodes, real fan-out
    node = torch.zeros(beams, dtype=torch.int64, device=device)
    for d in range(depth):
        node = trie.next_node(d, node, path[:, d].contiguous())
    logp = torch.randn(beams, vocab, device=device).log_softmax(1)
    scores = torch.zeros(beams, device=device)
    ws = trie.workspace(beams)
    token = path[:, depth].contiguous()
    step = lambda: beam_step(trie, depth, node, logp, scores, ws)
    result = {
        "children": time_call(lambda: trie.children(depth, node, ws=ws), device, iters),
        "next_node": time_call(lambda: trie.next_node(depth, node, token), device, iters),
        "step": time_call(step, device, iters),
        "graph": float("nan"),
    }

    if device.type == "cuda":
        graph = capture_graph(step, device=device)
        result["graph"] = time_call(graph.replay, device, iters)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6", help="item counts: 1e5,1e6,1e7")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--codes", type=int, default=256, help="codes per level")
    parser.add_argument("--beams", default="16,128", help="beam counts N")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--devices", default="cpu,cuda", help="cuda if available")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="0: torch default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = [
        torch.device(d) for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()
    ]
    beams = parse_list(args.beams)
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} CPU threads), depth {args.depth}, "
        f"{args.codes} codes/level, vocab {args.vocab}"
    )
    print()
    print(
        f"{'items':>10} {'kept':>10} {'build s':>8} {'peak MB':>8} {'trie MB':>8}  "
        "nodes per depth / max children"
    )
    built = []
    for size in parse_list(args.sizes):
        trie, seqs, build_s, peak = bench_build(size, args.depth, args.codes, args.seed)
        print(
            f"{size:>10} {trie.num_items:>10} {build_s:>8.2f} {peak / 2**20:>8.1f} "
            f"{trie.nbytes / 2**20:>8.1f}  {trie.nodes_per_depth} / {trie.max_children}"
        )
        built.append((size, trie, seqs))

    print()
    print(
        "step: children + gather of log-probs + top N + child lookup; graph: step in a CUDA graph"
    )
    print(
        f"{'items':>10} {'device':>6} {'N':>5} {'children us':>12} {'next_node us':>13} "
        f"{'step us':>9} {'graph us':>9}"
    )
    for size, trie, seqs in built:
        for device in devices:
            on_device = trie.to(device)
            for n in beams:
                t = bench_steps(on_device, seqs, device, n, args.vocab, args.iters, args.seed)
                print(
                    f"{size:>10} {device.type:>6} {n:>5} {t['children']:>12.1f} "
                    f"{t['next_node']:>13.1f} {t['step']:>9.1f} {t['graph']:>9.1f}"
                )


if __name__ == "__main__":
    main()
