"""Load an HF checkpoint directory into a `DecoderModel` on a device, in a dtype, with an attention
backend: what `Engine.from_pretrained` and the parallel compile workers share."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from boundgen.attention.backends import get_backend
from boundgen.config import DTYPES, ModelConfig
from boundgen.models.decoder import DecoderModel
from boundgen.models.weights import load_weights


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device '{device}'; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device '{device}'; use 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available on this machine")
    return dev


def open_device(device: str | torch.device) -> float:
    """Create the device's context now; the seconds it took. On CUDA the first allocation pays the
    driver's and the context's set-up (seconds on some machines), which start-up reports apart
    from reading the weights."""
    dev = resolve_device(device)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        torch.empty(1, device=dev)
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, config: ModelConfig
) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype is None:
        # CPU matmuls are fastest and exact in float32; on GPUs keep the checkpoint's precision.
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(config.torch_dtype or "bfloat16", torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    attention: str = "auto",
) -> DecoderModel:
    """The checkpoint in `path` (config.json + safetensors), weights loaded, in eval mode."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} does not exist or is not a directory")
    config = ModelConfig.from_dir(path)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev, config)
    backend = get_backend(attention, dev, torch_dtype)
    with torch.device("meta"):
        model = DecoderModel(config, backend)
    # the dtype is set while the model is still on meta: no float32 copy is allocated and converted
    model = model.to(torch_dtype).to_empty(device=dev)
    model.rotary.reset()
    load_weights(model, path)
    return model.eval().requires_grad_(False)
