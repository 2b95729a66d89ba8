"""A small stand-in decoder with boundgen's module names, and score/beam callables over it (CPU)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ToyAttention(nn.Module):
    def __init__(self, hidden: int, bias: bool = True):
        super().__init__()
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):  # x: [T, H], one causal sequence
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return self.o_proj(out)


class ToyMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden)
        self.self_attn = ToyAttention(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)
        self.mlp = ToyMLP(hidden, inter)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ToyDecoder(nn.Module):
    def __init__(
        self, vocab: int = 96, hidden: int = 64, inter: int = 128, layers: int = 2, seed: int = 0
    ):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden, inter) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] -> logits [T, V]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def toy_callables(model: ToyDecoder):
    from boundgen.quant.outputs import GateCallables

    @torch.no_grad()
    def score(query, items, labels):
        rows = []
        for item in items:
            logits = model(torch.tensor(list(query) + list(item)))[-1]
            rows.append(logits[labels].float().tolist())
        return rows

    @torch.no_grad()
    def beam(prompt, width, steps):
        beams = [(list(prompt), 0.0)]
        for _ in range(steps):
            cand = []
            for toks, lp in beams:
                logp = torch.log_softmax(model(torch.tensor(toks))[-1].float(), -1)
                top = torch.topk(logp, width)
                cand += [(toks + [int(t)], lp + float(v)) for v, t in zip(top.values, top.indices)]
            beams = sorted(cand, key=lambda b: -b[1])[:width]
        return [(toks[len(prompt) :], lp) for toks, lp in beams]

    return GateCallables(score, beam)
