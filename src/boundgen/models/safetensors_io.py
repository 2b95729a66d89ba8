"""Read a safetensors file onto a device in a few large copies.

Reading tensor by tensor (`safe_open(...).get_tensor` then `param.copy_`) costs a synchronous
copy from pageable memory per tensor: 6.0 s for the 1 GB of Qwen2.5-0.5B on the H200 (2026-12-02),
most of a server's later start. Here consecutive tensors are read into one host buffer (pinned on
CUDA, so the copy to the device is one DMA), copied at once, and handed out as views of the device
copy; the caller copies each view into its parameter (device to device).

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header size, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets relative to the end of the
header; an optional "__metadata__" entry), then the raw little-endian data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# one host buffer of this size is reused across copies (a tensor larger than it gets its own)
CHUNK_BYTES = 256 << 20


def read_header(file: Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data section, {name: {dtype, shape, data_offsets}}), checked."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file.name}: not a safetensors file (shorter than its header size)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{file.name}: not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file.name}: unreadable safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    data_bytes = file.stat().st_size - 8 - size
    for name, entry in header.items():
        dtype = entry.get("dtype")
        if dtype not in DTYPES:
            raise ValueError(f"{file.name}: tensor '{name}' has unsupported dtype {dtype!r}")
        begin, end = entry["data_offsets"]
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        if not 0 <= begin <= end <= data_bytes or end - begin != numel * _itemsize(dtype):
            raise ValueError(f"{file.name}: tensor '{name}' has inconsistent data offsets")
    return 8 + size, header


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def _chunks(entries: list[tuple[str, dict]], limit: int) -> Iterator[list[tuple[str, dict]]]:
    """Runs of tensors in file order whose bytes span at most `limit` (or one larger tensor)."""
    run: list[tuple[str, dict]] = []
    for name, entry in entries:
        end = entry["data_offsets"][1]
        if run and end - run[0][1]["data_offsets"][0] > limit:
            yield run
            run = []
        run.append((name, entry))
    if run:
        yield run


def read_tensors(
    file: str | Path, device: torch.device | str, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device`) for every tensor of `file`, in file order. A tensor is a view of a
    device buffer that the next chunk may overwrite: copy it before asking for the next one."""
    file, device = Path(file), torch.device(device)
    data_start, header = read_header(file)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    pinned = device.type == "cuda"
    host: torch.Tensor | None = None
    with open(file, "rb", buffering=0) as f:
        for run in _chunks(entries, chunk_bytes):
            lo, hi = run[0][1]["data_offsets"][0], run[-1][1]["data_offsets"][1]
            if host is None or host.numel() < hi - lo:
                host = torch.empty(max(hi - lo, chunk_bytes), dtype=torch.uint8, pin_memory=pinned)
            f.seek(data_start + lo)
            view = memoryview(host.numpy())[: hi - lo]
            got = 0
            while got < hi - lo:
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{file.name}: truncated (data ends before its header says)")
                got += n
            # one DMA from pinned memory; the host buffer is reused only after it has completed
            buf = host[: hi - lo].to(device, non_blocking=True) if pinned else host[: hi - lo]
            for name, entry in run:
                begin, end = entry["data_offsets"]
                raw = buf[begin - lo : end - lo]
                if (begin - lo) % _itemsize(entry["dtype"]):
                    raw = raw.clone()  # the format does not promise aligned offsets
                yield name, raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
            if pinned:
                torch.cuda.current_stream(device).synchronize()
