"""One decoder for Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) and Llama (llama3 RoPE scaling).

The forward takes every per-batch tensor explicitly (packed tokens, positions, attention metadata,
KV state), so `torch.export` sees them as inputs. Output rows are gathered by the caller before
`head`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from boundgen.attention.backends import AttentionBackend, get_backend
from boundgen.attention.cascade import by_kv_head, prefill_attention
from boundgen.attention.metadata import AttnInputs
from boundgen.config import ModelConfig
from boundgen.kv import DecodeKV, PromptKV, decode_attention
from boundgen.models import bucket_gated, layer_kernel, stream, stream_gated, stream_qkv
from boundgen.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope

# q and k are rotated together: one rotation over the q and k heads of the qkv projection's
# view, then q and k are views of its output (attention kernels take head strides), so Inductor
# compiles one kernel a layer (none where the streamed qkv kernel takes the layer: it rotates
# them, `models/stream_qkv.py`). Rotated apart, one rotation each, it was two kernels a layer: on
# the H200 (W3's package, BENCHMARKS.md twenty-second session) together took 24 kernels and ~30 µs
# of GPU time off a call, with the same arithmetic per element (the switch back to apart was
# removed in the fifty-sixth session). Models with q/k norms (Qwen3) and the grouped query layout
# rotate apart. A third form, the `segments` kernel rotating q and k as it loads them, lost W3 and
# W2 (BENCHMARKS.md twenty-third and thirty-fourth sessions; git history has it).


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.qkv_proj = nn.Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def heads(
        self, qkv, cos, sin, grouped: bool = False, rotate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2·Hkv)·D] → q [T, Hq, D], k and v [T, Hkv, D], q and k normed (Qwen3)
        and rotated (not with `rotate=False`: the fused qkv kernel has rotated them already).
        `grouped`: q as [T, G, Hkv, D] (G = Hq / Hkv; query head j·G + g at [:, g, j]), written
        so by the rotation itself, for attention that takes a KV head's query heads as rows
        (`cascade.grouped_rows_attention`: a reshape, no copy)."""
        t = qkv.shape[0]
        kv_size = self.num_kv_heads * self.head_dim
        if rotate and self.rotates_together(grouped):
            heads = self.num_heads + self.num_kv_heads
            qk = qkv[:, : self.rotated_columns].view(t, heads, self.head_dim)
            q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
            return q, k, qkv[:, self.rotated_columns :].view(t, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotate:
            return q, k, v
        if grouped:  # the rotation is per head: rotate the permuted view
            q = by_kv_head(q, self.num_heads // self.num_kv_heads)
            return apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), apply_rope(k, cos, sin), v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def rotates_together(self, grouped: bool) -> bool:
        """Whether q and k are rotated as one run of heads, the qkv projection's first
        `rotated_columns` columns: no q/k norm, q not grouped by KV head."""
        return self.q_norm is None and not grouped

    @property
    def rotated_columns(self) -> int:
        return (self.num_heads + self.num_kv_heads) * self.head_dim

    def attend(self, q, k, v, attn: AttnInputs, kv, layer: int, backend: AttentionBackend):
        """Attention over the packed batch (or a decode step's KV): → [T, Hq·D]."""
        if isinstance(kv, DecodeKV):
            o = decode_attention(q, k, v, layer, kv, backend)
        else:
            if isinstance(kv, PromptKV):
                kv.store(layer, k, v)
            o = prefill_attention(q, k, v, attn, backend)
        return o.reshape(q.shape[0], -1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    # The layer's three parts around attention, which the engine's forward and the beam layers
    # (compile/decode.py) share. With few rows (a decode step, a short prompt: bound by their
    # kernels' count and weight reads, not by FLOPs) qkv takes the q/k rotation into its GEMM
    # (`models/stream_qkv.py`), gate_up its SiLU·mul (`models/stream_gated.py`), and o_proj and
    # `down` stream their weights into partial sums (`models/stream.py`). A version that also
    # folded the norms in and summed K's splits inside the kernel (`models/skinny.py`) lost W4 by
    # 2.0–2.5 ms (BENCHMARKS.md, twenty-ninth session; git history has it).

    def attention_input(
        self, x, cos, sin, grouped: bool = False, normed=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] → q, k, v of the normed x (`Attention.heads`, q `grouped` or not).
        `normed`: x through this layer's input norm, computed already (the beam layers compute
        it at the end of the layer before, where it fuses with that layer's last residual add)."""
        attn = self.self_attn
        proj, h = attn.qkv_proj, self._input_normed(x, normed)
        if self._streams_qkv(x, grouped):
            # one streamed GEMM rotates q and k in its epilogue: no rotation kernel
            qkv = stream_qkv.rotated(h, proj.weight, proj.bias, cos, sin, attn.rotated_columns)
            return attn.heads(qkv, cos, sin, grouped, rotate=False)
        return attn.heads(proj(h), cos, sin, grouped)

    def _input_normed(self, x, normed):
        """x through the input norm: `normed` where the caller has it already."""
        return self.input_layernorm(x) if normed is None else normed

    def _streams_qkv(self, x, grouped: bool) -> bool:
        """Whether qkv and the q/k rotation take the streamed kernel (`models/stream_qkv.py`)."""
        attn = self.self_attn
        return stream_qkv.applies(x, attn.qkv_proj, attn.head_dim) and attn.rotates_together(
            grouped
        )

    def decode_input(self, x, cos, sin, kv, step, grouped: bool = False, normed=None):
        """A decode step's q, its k and v stored: x [N, hidden] (one token a beam) → q [N, Hq, D]
        (or grouped by KV head, [N, G, Hkv, D]), with k and v written into slot `step` (an int64
        tensor [1]) of `kv` [N, S, 2, Hkv, D] (`BeamKV`'s layer). Where the streamed qkv kernel
        takes the layer it also rotates q and k and writes the slot (one kernel, where the
        rotation and the slot's write were one or two more). `normed`: as
        `attention_input`'s."""
        attn = self.self_attn
        if self._streams_qkv(x, grouped):
            # the streamed qkv kernel writes k and v into the slot itself: no copy kernel after
            proj, h = attn.qkv_proj, self._input_normed(x, normed)
            q = stream_qkv.rotated_into_slot(
                h, proj.weight, proj.bias, cos, sin, attn.rotated_columns, kv, step
            )
            return q.view(x.shape[0], attn.num_heads, attn.head_dim)
        q, k, v = self.attention_input(x, cos, sin, grouped, normed)
        kv.index_copy_(1, step, torch.stack((k, v), 1).unsqueeze(1))
        return q

    def attention_output(self, x, o) -> torch.Tensor:
        """x + o_proj(o): o [T, Hq·D] → [T, hidden]."""
        proj = self.self_attn.o_proj
        if stream.applies(o, proj):
            return stream.linear_residual(o, proj.weight, x)
        return x + proj(o)

    def mlp_block(self, x) -> torch.Tensor:
        """x + MLP(RMSNorm(x))."""
        norm, mlp = self.post_attention_layernorm, self.mlp
        streamed = stream.applies(x, mlp.down_proj)
        if stream_gated.applies(x, mlp.gate_up_proj):  # gate_up with SiLU·mul as its epilogue
            h = stream_gated.gated(norm(x), mlp.gate_up_proj.weight)
        elif streamed:
            h = mlp.gated(norm(x))
        elif bucket_gated.applies(x, mlp.gate_up_proj):  # a bucket's rows: the same epilogue
            h = bucket_gated.gated(norm(x), mlp.gate_up_proj.weight)
        else:
            return x + mlp(norm(x))
        if streamed:
            return stream.linear_residual(h, mlp.down_proj.weight, x)
        return x + mlp.down_proj(h)

    def forward(self, x, cos, sin, attn, kv, layer, backend):
        q, k, v = self.attention_input(x, cos, sin)
        o = self.self_attn.attend(q, k, v, attn, kv, layer, backend)
        return self.mlp_block(self.attention_output(x, o))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend or get_backend("reference", "cpu")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        if config.task == "seq_cls":
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        elif config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnInputs,
        kv: PromptKV | DecodeKV | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] → final-normed hidden states [T, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if layer_kernel.applies(self, x, attn, kv):  # a short prompt: one kernel a layer
            return self.norm(layer_kernel.run_layers(self, x, cos, sin, attn))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, kv, i, self.backend)
        return self.norm(x)

    @property
    def head_weight(self) -> torch.Tensor:
        if self.config.task == "seq_cls":
            return self.score.weight
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, rows: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """rows [N, H] → float32 logits [N, C]; `columns` picks vocabulary ids (label scoring)."""
        return self.logits(rows, columns).float()

    def logits(self, rows: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """`head` in the model's dtype. Beam search takes these: at 512 rows × the vocabulary a
        float32 copy is a 311 MB write a step, and its kernels read bf16 as well (exactly)."""
        w = self.head_weight
        if columns is not None:
            w = self.label_weight(columns)
        return F.linear(rows, w)

    def label_weight(self, columns: torch.Tensor) -> torch.Tensor:
        """The head's weight rows of vocabulary ids `columns` [C, H]: `F.linear(rows, it)` is the
        model's label logits (`logits(rows, columns)`), for a caller that keeps it."""
        return self.head_weight.index_select(0, columns)
