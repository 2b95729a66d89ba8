"""Pack token sequences into one padding-free batch (the one thing passed from packing to the model).

A `SequenceGroup` is a prefix shared by several suffixes (query + candidates). Groups with a prefix
and
at least two suffixes are laid out for cascade attention: the prefix is computed once and the
suffixes
attend to it (see `boundgen.attention.metadata`). Everything else is a plain causal sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from boundgen.attention.metadata import AttnInputs


@dataclass
class SequenceGroup:
    prefix: list[int]
    suffixes: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return len(self.prefix) + sum(len(s) for s in self.suffixes)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attn: AttnInputs
    last_index: torch.Tensor  # int64 [N]: row of each output sequence's last token, in input order
    seq_start: torch.Tensor  # int64 [N]: first row of a plain sequence (−1 for shared-prefix rows)
    seq_len: torch.Tensor  # int64 [N]
    rows_per_group: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.last_index.shape[0])

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        mv = lambda t: t.to(device, non_blocking=non_blocking)
        return PackedBatch(
            mv(self.input_ids),
            mv(self.positions),
            self.attn.to(device, non_blocking),
            mv(self.last_index),
            mv(self.seq_start),
            mv(self.seq_len),
            list(self.rows_per_group),
        )


def _cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def pack(groups: list[SequenceGroup], share_prefix: bool = True) -> PackedBatch:
    shared = [g for g in groups if share_prefix and g.prefix and len(g.suffixes) >= 2]
    shared_ids = {id(g) for g in shared}
    ids: list[int] = []
    pos: list[int] = []
    segments: list[int] = []
    prefix_start: dict[int, int] = {}
    for g in shared:
        prefix_start[id(g)] = len(ids)
        ids += g.prefix
        pos += range(len(g.prefix))
        segments.append(len(g.prefix))
    num_prefix = len(ids)
    group_q: list[int] = []
    row_of: dict[tuple[int, int], tuple[int, int, int]] = {}  # (group, suffix) → (last, start, len)
    for g in shared:
        p, start_tokens = len(g.prefix), len(ids)
        for j, s in enumerate(g.suffixes):
            if s:
                ids += s
                pos += range(p, p + len(s))
                segments.append(len(s))
                row_of[id(g), j] = (len(ids) - 1, -1, p + len(s))
            else:  # an empty suffix scores the prefix's own last token
                row_of[id(g), j] = (prefix_start[id(g)] + p - 1, -1, p)
        group_q.append(len(ids) - start_tokens)
    num_shared = len(ids) - num_prefix
    for g in groups:
        if id(g) in shared_ids:
            continue
        for j, s in enumerate(g.suffixes):
            seq = g.prefix + s
            if not seq:
                raise ValueError("cannot pack an empty sequence (prefix and suffix both empty)")
            start = len(ids)
            ids += seq
            pos += range(len(seq))
            segments.append(len(seq))
            row_of[id(g), j] = (len(ids) - 1, start, len(seq))
    rows = [row_of[id(g), j] for g in groups for j in range(len(g.suffixes))]
    prefix_lens = [len(g.prefix) for g in shared]
    attn = AttnInputs(
        cu_seqlens=_cu(segments),
        max_seqlen=max(segments),
        cu_prefix=_cu(prefix_lens) if shared and num_shared else None,
        cu_group_q=_cu(group_q) if shared and num_shared else None,
        max_prefix=max(prefix_lens, default=0),
        max_group_q=max(group_q, default=0),
        num_prefix_tokens=num_prefix,
        num_shared_tokens=num_shared,
    )
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        attn=attn,
        last_index=torch.tensor([r[0] for r in rows], dtype=torch.int64),
        seq_start=torch.tensor([r[1] for r in rows], dtype=torch.int64),
        seq_len=torch.tensor([r[2] for r in rows], dtype=torch.int64),
        rows_per_group=[len(g.suffixes) for g in groups],
    )
