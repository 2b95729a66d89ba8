"""Load HF safetensors (single file or sharded index) into a `DecoderModel`, merging q/k/v and
gate/up.

Every tensor is checked: a missing, unexpected or mis-shaped tensor raises a `ValueError` naming
it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from boundgen.models.decoder import DecoderModel

# HF name fragment → (our merged parameter, slot). Slots index the merged tensor's row blocks.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"shards named in {index.name} are missing: {', '.join(missing)}"
            )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _target(name: str, model: DecoderModel) -> tuple[str, int | None]:
    """HF tensor name → (our parameter name, slot in a merged tensor or None)."""
    name = name.removeprefix("model.")
    for hf, (ours, slot) in PACKED_MODULES.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), slot
    return name, None


def _slot_rows(param_name: str, slot: int, model: DecoderModel) -> tuple[int, int]:
    c = model.config
    if ".qkv_proj." in param_name:
        sizes = [c.q_size, c.kv_size, c.kv_size]
    else:
        sizes = [c.intermediate_size, c.intermediate_size]
    start = sum(sizes[:slot])
    return start, start + sizes[slot]


def expected_hf_names(model: DecoderModel) -> set[str]:
    """The HF tensor names a checkpoint for this config must hold."""
    unpacked = {ours: [] for ours, _ in PACKED_MODULES.values()}
    for hf, (ours, _) in PACKED_MODULES.items():
        unpacked[ours].append(hf)
    names = set()
    for name, _ in model.named_parameters():  # tied head appears once, as embed_tokens
        prefix = "" if name.split(".")[0] in ("lm_head", "score") else "model."
        merged = next((m for m in unpacked if f".{m}." in name), None)
        if merged is None:
            names.add(prefix + name)
        else:
            names.update(prefix + name.replace(f".{merged}.", f".{hf}.") for hf in unpacked[merged])
    return names


@torch.no_grad()
def load_weights(model: DecoderModel, path: str | Path) -> None:
    """Copy checkpoint tensors into `model` (already materialised on its device and dtype)."""
    path = Path(path)
    params = dict(model.named_parameters())
    tied = model.config.task == "causal_lm" and model.config.tie_word_embeddings
    seen: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if tied and hf_name == "lm_head.weight":
                    continue  # some tied checkpoints also store the (identical) head
                name, slot = _target(hf_name, model)
                if name not in params:
                    raise ValueError(f"unexpected tensor '{hf_name}' in {file.name}")
                tensor = f.get_tensor(hf_name)
                dest = params[name]
                if slot is not None:
                    lo, hi = _slot_rows(name, slot, model)
                    dest = dest[lo:hi]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"tensor '{hf_name}' has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} for this config"
                    )
                dest.copy_(tensor.to(dtype=dest.dtype))
                seen.add(hf_name)
    missing = sorted(expected_hf_names(model) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ValueError(f"checkpoint {path} is missing tensors: {shown}")


@torch.no_grad()
def hf_state_dict(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The model's parameters under HF tensor names (merged q/k/v and gate/up split back), the
    inverse of `load_weights`; a tied head is stored once, as the embedding."""
    out = {}
    for name, param in model.named_parameters():
        prefix = "" if name.split(".")[0] in ("lm_head", "score") else "model."
        packed = [(hf, slot) for hf, (ours, slot) in PACKED_MODULES.items() if f".{ours}." in name]
        if not packed:
            out[prefix + name] = param.detach()
        for hf, slot in packed:
            ours = PACKED_MODULES[hf][0]
            lo, hi = _slot_rows(name, slot, model)
            out[prefix + name.replace(f".{ours}.", f".{hf}.")] = param.detach()[lo:hi]
    return out
