"""The JSON encoder of every reply: orjson, with numpy arrays written straight from their buffers.

The replies keep the values the server sent before (pydantic's `model_dump_json` and `json.dumps`
of `array.tolist()`): a float32 array is written as the float64 values `tolist()` gave (shortest
round-trip digits of each float32 widened to float64, not of the float32 itself), key order is kept.
Only the spelling may differ: no spaces after `,` and `:`, and `1e-5` for `1e-05`. Non-finite
floats (NaN, ±Infinity) are written as `null`, as pydantic's replies always did (the few replies
built with `json.dumps` wrote the non-standard `NaN`/`Infinity` tokens, which strict JSON parsers
refuse).

One orjson call holds the GIL throughout, so a reply of millions of floats would stall the event
loop (and every other request on it) for as long as it takes. `encode_async` writes the parts
marked `Slices` a slice at a time and lets the loop run between slices.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS  # int keys as "1", as json does
# Values written per slice by `encode_async`: ~2 ms of orjson on the 2-core development machine
# (float64 arrays encode at ~40 M values/s there), far below the 100 ms /health bound.
SLICE_VALUES = 1 << 16


def _default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, np.ndarray):  # orjson writes C-contiguous arrays only
        return np.ascontiguousarray(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def floats(array: Any) -> np.ndarray:
    """`array` as float64, so orjson writes the values `array.tolist()` would give."""
    return np.ascontiguousarray(array, dtype=np.float64)


def encode(value: Any) -> bytes:
    """`value` as JSON: dicts, lists, str, int, float, bool, None, numpy arrays (written as they
    are: widen float32 ones with `floats`), pydantic models (None fields left out)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    return orjson.dumps(value, default=_default, option=_OPTIONS)


class Slices:
    """A long list (or array, first axis) that `encode_async` writes in slices of about
    `SLICE_VALUES` values, `values_per_item` values in each of its entries."""

    __slots__ = ("items", "values_per_item")

    def __init__(self, items: Any, values_per_item: int = 1) -> None:
        self.items = items
        self.values_per_item = max(1, int(values_per_item))


async def encode_async(value: Any) -> bytes:
    """`encode(value)` with every `Slices` in it (anywhere among dict values and list entries)
    written a slice at a time, yielding to the event loop between slices."""
    parts: list[Slices] = []
    tag = secrets.token_hex(8)  # no string a client sent can equal a placeholder
    skeleton = _mark(value, parts, tag)
    if not parts:
        return encode(value)
    # the skeleton holds the placeholders in the order `_mark` met them: cut it there
    rest = encode(skeleton)
    pieces: list[bytes | memoryview] = []
    for i, part in enumerate(parts):
        before, _, rest = rest.partition(encode(_placeholder(tag, i)))
        pieces.append(before)
        await _encode_slices(part, pieces)
    pieces.append(rest)
    return b"".join(pieces)  # the one copy of the whole reply


def _placeholder(tag: str, i: int) -> str:
    return f"slices-{tag}-{i}"


def _mark(value: Any, parts: list[Slices], tag: str) -> Any:
    """`value` with each `Slices` in its dicts and lists of containers replaced by a placeholder
    string (collected into `parts`); lists of scalars are not walked."""
    if isinstance(value, Slices):
        parts.append(value)
        return _placeholder(tag, len(parts) - 1)
    if isinstance(value, dict):
        return {k: _mark(v, parts, tag) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], (dict, list, Slices)):
        return [_mark(v, parts, tag) for v in value]
    return value


async def _encode_slices(part: Slices, pieces: list[bytes | memoryview]) -> None:
    """Append `part` as a JSON list to `pieces`, a slice at a time."""
    items = part.items
    step = max(1, SLICE_VALUES // part.values_per_item)
    pieces.append(b"[")
    for start in range(0, len(items), step):
        if start:
            await asyncio.sleep(0)  # let the loop answer whatever arrived meanwhile
            pieces.append(b",")
        encoded = encode(items[start : start + step])  # b"[...]"
        pieces.append(memoryview(encoded)[1:-1])
    pieces.append(b"]")
