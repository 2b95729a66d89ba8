"""Embeddings: last-token or mean hidden state, optionally normalised or fed to a downstream MLP
head; or every token's hidden state (`pooling="tokens"`: one [L, H] tensor per text).

Pipeline: prepare (CPU: tokenize, load the head) → forward (shared batching node, last, mean or
per-token pooling) → mlp_head (DEVICE: normalize each row, optional MLP head).

An MLP head is a directory (or the JSON file in it) holding `head.json`:
    {"input_dim": H, "hidden_dims": [256], "output_dim": 1,
     "activation": "relu" | "gelu" | "silu" | "tanh", "output_activation": null | "sigmoid" |
     "tanh"}
and `head.safetensors` with `layers.{i}.weight` / `layers.{i}.bias` (bias optional) for each
linear layer.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from boundgen.runtime.dag import Pipeline
from boundgen.workloads.base import Workload, WorkloadContext, cpu_node, device_node
from boundgen.workloads.inputs import prepare_texts

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


@dataclass
class EmbedRequest:
    texts: list
    pooling: str = "last"
    normalize: bool = False
    truncate: bool = False


class MLPHead(nn.Module):
    def __init__(self, dims: list[int], activation: str, output_activation: str | None) -> None:
        super().__init__()
        for name in (activation, output_activation):
            if name is not None and name not in ACTIVATIONS:
                raise ValueError(f"unknown activation '{name}'; known: {', '.join(ACTIVATIONS)}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.activation = activation
        self.output_activation = output_activation

    @property
    def input_dim(self) -> int:
        return self.layers[0].in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = ACTIVATIONS[self.activation](x)
        return ACTIVATIONS[self.output_activation](x) if self.output_activation else x

    @classmethod
    def load(cls, path: str | Path) -> MLPHead:
        path = Path(path)
        spec_file = path / "head.json" if path.is_dir() else path
        if not spec_file.is_file():
            raise FileNotFoundError(f"no MLP head spec at {spec_file}")
        spec = json.loads(spec_file.read_text())
        try:
            dims = [
                int(spec["input_dim"]),
                *map(int, spec.get("hidden_dims", [])),
                int(spec["output_dim"]),
            ]
        except KeyError as exc:
            raise ValueError(f"{spec_file.name} is missing {exc}") from None
        head = cls(dims, spec.get("activation", "relu"), spec.get("output_activation"))
        weights_file = spec_file.parent / spec.get("weights", "head.safetensors")
        if not weights_file.is_file():
            raise FileNotFoundError(f"MLP head weights {weights_file} not found")
        state = load_file(str(weights_file))
        own = head.state_dict()
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise ValueError(f"unexpected tensor '{unexpected[0]}' in {weights_file.name}")
        for name, param in own.items():
            if name not in state:
                if name.endswith(".bias"):
                    param.zero_()
                    continue
                raise ValueError(f"{weights_file.name} is missing tensor '{name}'")
            if state[name].shape != param.shape:
                raise ValueError(
                    f"head tensor '{name}' has shape {tuple(state[name].shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.copy_(state[name])
        return head


POOLINGS = ("last", "mean", "tokens")


def finish_embed(rows: torch.Tensor, normalize: bool, head: MLPHead | None) -> torch.Tensor:
    x = rows.float()
    if normalize:
        x = F.normalize(x, dim=-1)
    if head is not None:
        if head.input_dim != x.shape[-1]:
            raise ValueError(
                f"MLP head expects {head.input_dim} inputs, the model gives {x.shape[-1]}"
            )
        head = head.to(x.device)
        with torch.inference_mode():
            x = head(x)
    return x


def build(context: WorkloadContext) -> Pipeline:
    def prepare(request: EmbedRequest, head: Any) -> tuple[list, str, Any]:
        if request.pooling not in POOLINGS:
            raise ValueError(
                f"unknown pooling '{request.pooling}'; use {', '.join(map(repr, POOLINGS))}"
            )
        if head is not None and not isinstance(head, MLPHead):
            head = MLPHead.load(head)
        groups = prepare_texts(request.texts, context.tokenizer, context.limits, request.truncate)
        return groups, request.pooling, head

    def finish(rows: torch.Tensor, request: EmbedRequest, mlp: Any, groups: list) -> Any:
        """[N, D]; with per-token pooling a list of [L, D], one per text."""
        vectors = finish_embed(rows, request.normalize, mlp)
        if request.pooling != "tokens":
            return vectors
        return list(vectors.split([len(s) for g in groups for s in g.suffixes]))

    return Pipeline(
        "embed",
        {"request": EmbedRequest, "head": Any},
        [
            cpu_node(
                "prepare",
                prepare,
                {"request": EmbedRequest, "head": Any},
                {"groups": list, "pooling": str, "mlp": Any},
                raises=(ValueError, FileNotFoundError),
            ),
            context.forward,
            device_node(
                "mlp_head",
                finish,
                {"rows": torch.Tensor, "request": EmbedRequest, "mlp": Any, "groups": list},
                {"vectors": torch.Tensor | list},
            ),
        ],
        ["vectors"],
        defaults={"head": None},
    )


WORKLOAD = Workload("embed", EmbedRequest, build)
