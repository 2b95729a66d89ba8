"""Vectors → the wire formats the peers' clients read.

- vLLM / OpenAI: `float` (JSON numbers), `base64` (the raw bytes of each vector), `bytes` (one body
  of every vector's raw bytes, described by a `metadata` header: vLLM's `MetadataItem`s, from
  `vllm/utils/serial_utils.py`), `bytes_only` (the body alone); raw bytes are `embed_dtype`
  (float32, float16, bfloat16) in the given `endianness`.
- Cohere: `float`, `int8` (round(127·x / max|x|)), `uint8` (int8 + 128), `ubinary` (bit = x > 0,
  packed 8 per byte, first value in the high bit), `binary` (ubinary − 128), `base64` (float32
  little-endian bytes).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from starlette.responses import Response

from boundgen.server.errors import BadRequest
from boundgen.server.json import floats

_ORDER = {"native": "=", "big": ">", "little": "<"}


def check_binary_options(encoding_format: str, embed_dtype: str, endianness: str) -> None:
    """`embed_dtype` and `endianness` shape raw bytes; with JSON floats they would be ignored."""
    if encoding_format == "float" and (embed_dtype, endianness) != ("float32", "native"):
        raise BadRequest(
            f"embed_dtype={embed_dtype!r} and endianness={endianness!r} apply to "
            "encoding_format base64, bytes and bytes_only, not float"
        )


def raw_bytes(array: np.ndarray, embed_dtype: str, endianness: str) -> bytes:
    """float32 `array` as `embed_dtype` values in `endianness` byte order, row-major."""
    order = _ORDER[endianness]
    a = np.ascontiguousarray(array, dtype=np.float32)
    if embed_dtype == "bfloat16":
        return bfloat16_bits(a).astype(f"{order}u2").tobytes()
    char = {"float32": "f4", "float16": "f2"}[embed_dtype]
    return a.astype(f"{order}{char}").tobytes()


def bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (uint16), rounded to nearest even, a NaN as 0xFFFF: the bits
    torch's CPU conversion writes (the test compares them). numpy, not torch: a frontend process
    (`serve --frontends`) encodes replies without torch."""
    u = a.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0xFFFF), bits)


def json_value(array: np.ndarray, encoding_format: str, embed_dtype: str, endianness: str) -> Any:
    """One vector (or [L, H] rows) as JSON floats (float64, the values of the float32 vector, for
    `server.json`) or a base64 string of its raw bytes."""
    if encoding_format == "base64":
        return base64.b64encode(raw_bytes(array, embed_dtype, endianness)).decode()
    return floats(np.asarray(array, dtype=np.float32))


def bytes_response(
    arrays: list[np.ndarray],
    embed_dtype: str,
    endianness: str,
    reply: dict[str, Any],
    encoding_format: str = "bytes",
) -> Response:
    """vLLM's binary reply: every array's raw bytes in one body; `bytes` adds the `metadata`
    header (JSON: the reply's fields and per array `{index, embed_dtype, endianness, start, end,
    shape}`)."""
    parts, items, start = [], [], 0
    for i, a in enumerate(arrays):
        raw = raw_bytes(a, embed_dtype, endianness)
        parts.append(raw)
        items.append(
            {
                "index": i,
                "embed_dtype": embed_dtype,
                "endianness": endianness,
                "start": start,
                "end": start + len(raw),
                "shape": list(np.shape(a)),
            }
        )
        start += len(raw)
    headers = {}
    if encoding_format == "bytes":
        meta = {k: (v.model_dump() if hasattr(v, "model_dump") else v) for k, v in reply.items()}
        headers["metadata"] = json.dumps({**meta, "data": items})
    return Response(b"".join(parts), media_type="application/octet-stream", headers=headers)


def cohere_embeddings(vectors: np.ndarray, types: list[str]) -> dict[str, list]:
    """[N, D] float32 → `{type: one value list per vector}` for Cohere's `embedding_types`."""
    x = np.asarray(vectors, dtype=np.float32)
    out: dict[str, list] = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            out[kind] = x.tolist()
        elif kind in ("int8", "uint8"):
            scale = np.abs(x).max(axis=-1, keepdims=True)
            q = np.rint(127.0 * x / np.where(scale > 0, scale, 1.0)).astype(np.int64)
            out[kind] = (q if kind == "int8" else q + 128).tolist()
        elif kind in ("binary", "ubinary"):
            packed = np.packbits(x > 0, axis=-1).astype(np.int64)  # [N, ceil(D / 8)]
            out[kind] = (packed if kind == "ubinary" else packed - 128).tolist()
        elif kind == "base64":
            out[kind] = [base64.b64encode(raw_bytes(v, "float32", "little")).decode() for v in x]
    return out
