"""`ModelRunner`: the model node. It owns the model on its device and runs packed forwards.

This is the seam where compiled backends (torch.compile, AOTInductor, CUDA graphs) and FP8 plug in:
the runtime's forward node calls `split`, `pack_chunk` and `forward`, heads call `head`, and
`hidden_rows` serves
callers outside the runtime (the FP8 fidelity gate).
"""

from __future__ import annotations

import torch

from boundgen.models.decoder import DecoderModel
from boundgen.text.packing import PackedBatch, SequenceGroup, pack


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        device: torch.device,
        max_batch_tokens: int,
        share_prefix: bool = True,
    ) -> None:
        self.model = model
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.share_prefix = share_prefix

    @property
    def config(self):
        return self.model.config

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Final hidden states of every packed token: [T, H]."""
        return self.model(batch.input_ids, batch.positions, batch.attn)

    def split(self, groups: list[SequenceGroup]) -> list[list[SequenceGroup]]:
        """Chunks of whole groups that each fit the token budget (a group larger than it is split into
        groups with the same prefix, so any request runs)."""
        chunks: list[list[SequenceGroup]] = [[]]
        used = 0
        for g in groups:
            parts = [g]
            if g.num_tokens > self.max_batch_tokens and len(g.suffixes) > 1:
                parts, cur, cur_tokens = [], [], len(g.prefix)
                for s in g.suffixes:
                    if cur and cur_tokens + len(s) > self.max_batch_tokens:
                        parts.append(SequenceGroup(g.prefix, cur))
                        cur, cur_tokens = [], len(g.prefix)
                    cur.append(s)
                    cur_tokens += len(s)
                parts.append(SequenceGroup(g.prefix, cur))
            for part in parts:
                if chunks[-1] and used + part.num_tokens > self.max_batch_tokens:
                    chunks.append([])
                    used = 0
                chunks[-1].append(part)
                used += part.num_tokens
        return chunks

    def pack_chunk(self, chunk: list[SequenceGroup], share_prefix: bool) -> list[PackedBatch]:
        """Host-side packed batches of one `split` chunk, in row order (compiled runners pad them into
        their buckets and may cut a chunk larger than every bucket into pieces that fit)."""
        return [pack(chunk, share_prefix=share_prefix)]

    @torch.inference_mode()
    def hidden_rows(self, groups: list[SequenceGroup], pooling: str = "last") -> torch.Tensor:
        """Hidden state per output sequence ([N, H], input order): last token or mean over tokens."""
        share = self.share_prefix and pooling == "last"
        outs = []
        for chunk in self.split(groups):
            for batch in self.pack_chunk(chunk, share):
                batch = batch.to(self.device, non_blocking=True)
                hidden = self.forward(batch)
                if pooling == "last":
                    outs.append(hidden.index_select(0, batch.last_index))
                else:
                    outs.append(mean_pool(hidden, batch))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    @torch.inference_mode()
    def head(self, rows: torch.Tensor, columns: list[int] | None = None) -> torch.Tensor:
        cols = None if columns is None else torch.tensor(columns, device=rows.device)
        return self.model.head(rows, cols)


def mean_rows(hidden: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Mean of hidden rows [start, start+length) per sequence ([n, H]), as one segment sum."""
    n = start.shape[0]
    seq_id = torch.repeat_interleave(torch.arange(n, device=hidden.device), length)
    base = torch.repeat_interleave(start - (torch.cumsum(length, 0) - length), length)
    rows = base + torch.arange(seq_id.shape[0], device=hidden.device)
    sums = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_id, hidden.index_select(0, rows).float())
    return (sums / length[:, None].float()).to(hidden.dtype)


def mean_pool(hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Mean over each plain sequence of a packed batch."""
    return mean_rows(hidden, batch.seq_start, batch.seq_len)
