"""Per-batch attention metadata, passed explicitly to the model (no global context, so export sees
it).

Packed token layout (see `boundgen.text.packing`):

    [ prefix_0 | prefix_1 | ... | suffixes of group 0 | suffixes of group 1 | ... | plain sequences
    ]
      `-- num_prefix_tokens --' `---------- num_shared_tokens -----------'

Every prefix, every suffix and every plain sequence is one causal segment of `cu_seqlens`. Suffix
tokens of group g additionally attend, non-causally, to prefix g: one varlen call whose query
segments are `cu_group_q` (over the shared-suffix span) and whose key segments are `cu_prefix`
(over the prefix span). The two partial results are merged with their log-sum-exps (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree


@dataclass
class AttnInputs:
    cu_seqlens: torch.Tensor  # int32 [S+1]: causal segments over all T tokens
    max_seqlen: int
    cu_prefix: torch.Tensor | None = None  # int32 [G+1] over tokens [0, num_prefix_tokens)
    cu_group_q: torch.Tensor | None = None  # int32 [G+1] over the shared-suffix span
    max_prefix: int = 0
    max_group_q: int = 0
    num_prefix_tokens: int = 0
    num_shared_tokens: int = 0

    @property
    def has_shared_prefix(self) -> bool:
        return self.cu_prefix is not None and self.num_shared_tokens > 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> AttnInputs:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return AttnInputs(
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            cu_prefix=move(self.cu_prefix),
            cu_group_q=move(self.cu_group_q),
            max_prefix=self.max_prefix,
            max_group_q=self.max_group_q,
            num_prefix_tokens=self.num_prefix_tokens,
            num_shared_tokens=self.num_shared_tokens,
        )


_TENSORS = ("cu_seqlens", "cu_prefix", "cu_group_q")
_STATIC = ("max_seqlen", "max_prefix", "max_group_q", "num_prefix_tokens", "num_shared_tokens")


def _flatten(a: AttnInputs):
    return [getattr(a, n) for n in _TENSORS], tuple(getattr(a, n) for n in _STATIC)


def _flatten_with_keys(a: AttnInputs):
    children, context = _flatten(a)
    return [(pytree.GetAttrKey(n), c) for n, c in zip(_TENSORS, children)], context


def _unflatten(children, context) -> AttnInputs:
    return AttnInputs(**dict(zip(_TENSORS, children)), **dict(zip(_STATIC, context)))


# NOTE: tensors are pytree children and the ints are static context, so torch.export specialises a
# compiled bucket on the layout sizes and takes the segment boundaries as graph inputs.
pytree.register_pytree_node(
    AttnInputs,
    _flatten,
    _unflatten,
    serialized_type_name="boundgen.attention.metadata.AttnInputs",
    flatten_with_keys_fn=_flatten_with_keys,
)
