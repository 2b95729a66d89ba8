"""Token sequences as a request hands them to packing: `SequenceGroup`, a prefix shared by several
suffixes (a query and its candidates). No torch: an HTTP frontend process (`serve --frontends`)
builds these while parsing a request, and `text.packing` lays them out for the model."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SequenceGroup:
    prefix: list[int]
    suffixes: list[list[int]]
    # prefix + suffixes as one int64 array, where the group's maker has them so already (a
    # request's token ids, checked as one array: `workloads.inputs.check_token_ids`); packing then
    # takes the ids from it instead of converting every Python int again (W2's 1,856 ids: its
    # runner pieces 83-93 → 49-58 µs on the 2-core dev CPU).
    # It must hold the same ids as the lists: set it only on a group whose lists nobody changes.
    ids: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prefix) + sum(map(len, self.suffixes))  # a C loop: sizes every request


def int64_array(ints: Iterable[int], n: int) -> np.ndarray:
    """`n` Python ints as an int64 array: `struct` packs them straight into the array's buffer, in
    C, ~7 ns an id where `np.fromiter` takes ~12 (W2's 1,856 ids 23.2 → 13.6 µs, 2-core dev CPU).
    `struct.error` for an int past int64 or a count other than `n`."""
    out = np.empty(n, dtype=np.int64)
    struct.pack_into(f"{n}q", out, 0, *ints)
    return out


def shared_prefix_group(seqs: list[list[int]]) -> SequenceGroup:
    """The sequences as one group whose prefix is their longest common token prefix (computed once
    for all of them); a single sequence stays whole."""
    if len(seqs) < 2:
        return SequenceGroup([], [list(s) for s in seqs])
    # the lexicographically first and last sequences share exactly what all of them share
    first, last = min(seqs), max(seqs)
    n = next((i for i, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
    return SequenceGroup(list(seqs[0][:n]), [list(s[n:]) for s in seqs])
