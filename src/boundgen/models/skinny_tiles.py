"""The few-row fused linear kernels' tiles (`models/skinny.py`): which tile a call takes, how K
splits into whole steps, the table of tiles swept on the device, and its digest for the compile
cache's key. Plain arithmetic, apart from the kernels so a sweep or a test can reason about tiles
without Triton."""

from __future__ import annotations

import hashlib
import json
import os

# Tiles per (K, N, gated, BLOCK_M): (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); shapes not
# listed take `default_tile`. `bench_skinny.py --sweep` times tiles on the GPU; the fastest belong
# here.
TILES: dict[tuple[int, int, bool, int], tuple[int, int, int, int, int]] = {}
# Programs a call aims at when it picks its own split of K: two per multiprocessor of an H200
# (132). A few-row GEMM only streams its weights, and the sixth session's kernels, one program per
# 64 output columns walking all of K, left 118 of 132 multiprocessors idle in `down` and o_proj
# (N = 896: 14 programs) and ran them at a fifth of cuBLAS's bandwidth.
TARGET_PROGRAMS = 264


def load_tiles(path: str | os.PathLike) -> dict[tuple[int, int, bool, int], tuple]:
    """Tiles from a JSON file `bench_skinny.py --sweep --tiles-out` wrote: a list of
    {"key": [K, N, gated, BLOCK_M], "tile": [BLOCK_N, BLOCK_K, SPLIT_K, warps, stages]}."""
    with open(path) as f:
        rows = json.load(f)
    tiles = {}
    for row in rows:
        k, n, gated, block_m = row["key"]
        tile = tuple(int(v) for v in row["tile"])
        if len(tile) != 5 or block_m not in (16, 32, 64):
            raise ValueError(f"{path}: not a skinny tile: {row}")
        tiles[(int(k), int(n), bool(gated), int(block_m))] = tile
    return tiles


# `BOUNDGEN_SKINNY_TILES=<file>`: tiles swept on this device kind (an A/B in the call that swept
# them); compiled packages record them (`compile.cache.platform_info`), so a change rebuilds.
if os.environ.get("BOUNDGEN_SKINNY_TILES"):
    TILES.update(load_tiles(os.environ["BOUNDGEN_SKINNY_TILES"]))


def tiles_digest() -> str:
    """The tile table as a short hash ("" when empty: the packages built before it keep their
    keys)."""
    if not TILES:
        return ""
    text = json.dumps(sorted([list(k), list(v)] for k, v in TILES.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def block_m_for(m) -> int:
    """Rows a program takes (the MMA's narrow side, at least 16): the fewest of 16, 32 and 64 that
    hold `m`, so 16 beam rows do not pay a 64-row product; 64 when `m` is symbolic (the compiled
    beam layers' rows), since a branch on it would guard the compiled caller."""
    if not isinstance(m, int):
        return 64
    return 16 if m <= 16 else 32 if m <= 32 else 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_k_for(k: int, block_k: int) -> int:
    """`block_k` at most K's next power of two (and at least 16, a dot's least): the step a call
    of K takes (a wider one would only be masked)."""
    return min(block_k, max(16, 1 << (k - 1).bit_length()))


def default_tile(k: int, n: int, gated: bool, block_m: int, m_tiles: int = 1):
    """(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) for a shape without a measured tile: 64 columns
    a program, and K split until about `TARGET_PROGRAMS` programs run (each split a whole number of
    BLOCK_K steps)."""
    block_n, block_k = 64, block_k_for(k, 128)
    tiles = cdiv(n, block_n) * m_tiles
    split = max(1, min(cdiv(k, block_k), TARGET_PROGRAMS // tiles))
    return block_n, block_k, split, 4, 3


def tile_for(k: int, n: int, gated: bool, block_m: int, m_tiles: int = 1):
    return TILES.get((k, n, gated, block_m)) or default_tile(k, n, gated, block_m, m_tiles)


def k_split(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(K a split takes, splits): `split` rounded so every split is whole BLOCK_K steps and none
    is empty (K = 896 in 7 splits of a 256-wide step would leave three splits past K)."""
    per = cdiv(cdiv(k, split), block_k) * block_k
    return per, cdiv(k, per)


def rope_block_n(block_n: int, head_d: int, rotate_cols: int) -> int:
    """A tile's columns for a rotating call: whole heads (a power of two of them, at least one)
    that tile the rotated columns exactly, so no tile holds rotated and plain columns."""
    heads = max(1, block_n // head_d)
    while (rotate_cols // head_d) % heads:
        heads //= 2
    return heads * head_d
