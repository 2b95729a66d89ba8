"""KServe v2 / Triton HTTP protocol: health, model metadata, statistics and `infer` (JSON and the
Triton binary tensor extension, request bodies plain or gzip/deflate, so `tritonclient.http` works
unchanged). Errors on these routes (unknown ones included, see `app.py`) follow the KServe protocol,
`{"error": "<message>"}`, which Triton clients parse.

One model, three tasks (request parameter `task`, default from the inputs):
- `score`: inputs `query` BYTES [1] (or INT64 token ids [L]), `items` BYTES [N] (or INT64 [N, L]),
  optional `label_token_ids` INT64 [K] (default: the rerank labels) → output `scores` FP32 [N, K].
  Parameters `apply_softmax` (default true) and `item_first` (default false).
- `embed`: input `text` BYTES [N] → output `embeddings` FP32 [N, H].
- `classify`: input `text` BYTES [N] → output `probs` FP32 [N, C].
"""

from __future__ import annotations

import dataclasses
import math
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from boundgen.server import fields, inputs
from boundgen.server.bodies import json_response, large_json_response
from boundgen.server.errors import BadRequest, NotFound, ServerError, TooLarge, Unavailable
from boundgen.server.handler_state import HandlerState
from boundgen.server.json import Slices, encode, floats
from boundgen.server.limits import JsonBounds, describe_validation_error, load_json, read_body
from boundgen.server.timing import SERVER_TIMES

_NP = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_INT_TYPES = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
_MAX_RANK = 8


class _Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr
    shape: list[StrictInt] = []
    datatype: StrictStr = "BYTES"
    parameters: dict[str, Any] | None = None
    data: Any = None


class _Output(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: StrictStr
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[_Tensor]
    outputs: list[_Output] | None = None


def add_routes(route: Callable[..., None]) -> None:
    get = ("GET",)
    route("/v2", "kserve.server_metadata", server_metadata, get)
    route("/v2/health/live", "kserve.live", live, get)
    route("/v2/health/ready", "kserve.ready", ready, get)
    route("/v2/models/stats", "kserve.stats", statistics, get)
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        route(base, "kserve.model_metadata", model_metadata, get)
        route(base + "/ready", "kserve.model_ready", model_ready, get)
        route(base + "/config", "kserve.model_config", model_config, get)
        route(base + "/stats", "kserve.stats", statistics, get)
        route(base + "/infer", "kserve.infer", infer)


async def server_metadata(request: Request, state: HandlerState) -> Response:
    from boundgen import __version__

    return json_response(
        {"name": "boundgen", "version": __version__, "extensions": ["binary_tensor_data"]}
    )


async def live(request: Request, state: HandlerState) -> Response:
    return json_response({"live": True})


async def ready(request: Request, state: HandlerState) -> Response:
    if state.draining or not state.ready:
        why = "shutting down" if state.draining else state.unready
        raise Unavailable(f"server is not ready ({why})")
    return json_response({"ready": True})


def _model(request: Request, state: HandlerState) -> str:
    name = request.path_params["name"]
    if name != state.model_name:
        # Triton's words, which its clients' users know; then the one name that works
        raise NotFound(
            f"Request for unknown model: {name!r} is not found (this server serves "
            f"{state.model_name!r})"
        )
    version = request.path_params.get("version")
    if version not in (None, "", "1"):
        raise NotFound(f"unknown version {version!r} of model {name!r}; the only version is '1'")
    return name


def _metadata(state: HandlerState) -> dict[str, Any]:
    outputs = [
        {"name": "scores", "datatype": "FP32", "shape": [-1, -1]},
        {"name": "embeddings", "datatype": "FP32", "shape": [-1, state.hidden_size]},
    ]
    if state.num_labels > 0:
        outputs.append({"name": "probs", "datatype": "FP32", "shape": [-1, state.num_labels]})
    return {
        "name": state.model_name,
        "versions": ["1"],
        "platform": "boundgen",
        "inputs": [
            {"name": "query", "datatype": "BYTES", "shape": [1]},
            {"name": "items", "datatype": "BYTES", "shape": [-1]},
            {"name": "label_token_ids", "datatype": "INT64", "shape": [-1]},
            {"name": "text", "datatype": "BYTES", "shape": [-1]},
        ],
        "outputs": outputs,
    }


async def model_metadata(request: Request, state: HandlerState) -> Response:
    _model(request, state)
    return json_response(_metadata(state))


async def model_ready(request: Request, state: HandlerState) -> Response:
    _model(request, state)
    if state.draining or not state.ready:
        raise Unavailable(
            f"model is not ready ({'shutting down' if state.draining else state.unready})"
        )
    return json_response({"name": state.model_name, "ready": True})


async def statistics(request: Request, state: HandlerState) -> Response:
    """Triton's inference statistics (`get_inference_statistics`): of the one model, also when
    asked for every model (`/v2/models/stats`)."""
    if "name" in request.path_params:
        _model(request, state)
    return json_response({"model_stats": [await state.model_stats()]})


async def model_config(request: Request, state: HandlerState) -> Response:
    _model(request, state)
    meta = _metadata(state)
    return json_response(
        {
            "name": state.model_name,
            "platform": "boundgen",
            "max_batch_size": 0,
            "input": [
                {
                    "name": t["name"],
                    "data_type": "TYPE_" + t["datatype"].replace("BYTES", "STRING"),
                    "dims": t["shape"],
                }
                for t in meta["inputs"]
            ],
            "output": [
                {"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": t["shape"]}
                for t in meta["outputs"]
            ],
        }
    )


# ----------------------------------------------------------------------------------------------
# decoding inputs


def _decompress(request: Request, body: bytes, limit: int) -> bytes:
    """A body sent with `Content-Encoding: gzip` or `deflate` (tritonclient's
    `request_compression_algorithm`), inflated to at most `limit` bytes."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported; use gzip or deflate")
    # gzip: its header; deflate: zlib-wrapped (what HTTP and tritonclient send) or raw
    tries = [zlib.MAX_WBITS | 16] if encoding == "gzip" else [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    for wbits in tries:
        inflate = zlib.decompressobj(wbits)
        try:
            out = inflate.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise TooLarge(
                f"request body inflates past {limit} bytes (server option max_body_bytes)"
            )
        if inflate.eof:
            return out
    raise BadRequest(f"request body is not valid {encoding} data")


def _split_body(request: Request, body: bytes) -> tuple[bytes, bytes]:
    header = request.headers.get("inference-header-content-length")
    if header is None:
        return body, b""
    try:
        n = int(header)
    except ValueError:
        raise BadRequest("Inference-Header-Content-Length is not an integer") from None
    if not 0 < n <= len(body):
        raise BadRequest(f"Inference-Header-Content-Length={n} but the body is {len(body)} bytes")
    return body[:n], body[n:]


def _decode_bytes_tensor(raw: bytes, name: str, count: int) -> list[bytes]:
    out: list[bytes] = []
    pos = 0
    while pos < len(raw):
        if len(out) == count:
            raise BadRequest(f"input {name!r}: more than the {count} BYTES elements of its shape")
        if pos + 4 > len(raw):
            raise BadRequest(f"input {name!r}: truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise BadRequest(f"input {name!r}: BYTES element of {n} bytes runs past the data")
        out.append(raw[pos : pos + n])
        pos += n
    return out


def _flatten(data: Any, name: str, depth: int = 0) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if depth > 8:
        raise BadRequest(f"input {name!r}: data nested deeper than 8 levels")
    out: list[Any] = []
    for x in data:
        out.extend(_flatten(x, name, depth + 1) if isinstance(x, list) else [x])
    return out


def _element_count(t: _Tensor, max_elements: int) -> int:
    """The elements `t.shape` declares, an exact integer product, each dimension and the product
    checked against `max_elements` before anything is allocated for them."""
    shown = repr(t.shape) if len(t.shape) <= _MAX_RANK else f"of {len(t.shape)} dimensions"
    if len(t.shape) > _MAX_RANK:
        raise BadRequest(f"input {t.name!r}: shape {shown}; at most {_MAX_RANK} dimensions")
    if any(d < 0 for d in t.shape):
        raise BadRequest(f"input {t.name!r}: negative dimension in shape {shown}")
    if any(d > max_elements for d in t.shape):
        raise TooLarge(
            f"input {t.name!r}: shape {shown} has a dimension over {max_elements}, the most "
            "elements a tensor may have (server option max_request_tokens)"
        )
    count = math.prod(t.shape)
    if count > max_elements:
        raise TooLarge(
            f"input {t.name!r}: shape {shown} declares {count} elements; the limit is "
            f"{max_elements} (server option max_request_tokens)"
        )
    return count


def _decode_inputs(tensors: list[_Tensor], binary: bytes, max_elements: int) -> dict[str, Any]:
    """name → (tensor, its values as a flat list); each shape checked before its data is read."""
    decoded: dict[str, Any] = {}
    pos = 0
    for t in tensors:
        if t.name in decoded:
            raise BadRequest(f"input {t.name!r} given twice")
        count = _element_count(t, max_elements)
        size = (t.parameters or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(
                    f"input {t.name!r}: binary_data_size must be a non-negative integer"
                )
            raw = binary[pos : pos + size]
            if len(raw) != size:
                raise BadRequest(f"input {t.name!r}: binary_data_size={size} runs past the body")
            pos += size
            if t.datatype == "BYTES":
                values: list[Any] = _decode_bytes_tensor(raw, t.name, count)
            elif t.datatype in _NP:
                dt = np.dtype(_NP[t.datatype]).newbyteorder("<")
                if size != count * dt.itemsize:
                    raise BadRequest(
                        f"input {t.name!r}: shape {t.shape} of {t.datatype} needs "
                        f"{count * dt.itemsize} bytes; binary_data_size is {size}"
                    )
                values = np.frombuffer(raw, dtype=dt).tolist()
            else:
                raise BadRequest(f"input {t.name!r}: unsupported datatype {t.datatype!r}")
        else:
            if t.data is None:
                raise BadRequest(f"input {t.name!r} has neither `data` nor binary_data_size")
            values = _flatten(t.data, t.name)
        if len(values) != count:
            raise BadRequest(
                f"input {t.name!r}: shape {t.shape} needs {count} elements, got {len(values)}"
            )
        decoded[t.name] = (t, values)
    if pos != len(binary):
        raise BadRequest(f"{len(binary) - pos} bytes of binary data are not claimed by any input")
    return decoded


def _texts(t: _Tensor, values: list[Any]) -> list[str]:
    if t.datatype != "BYTES":
        raise BadRequest(f"input {t.name!r} must be BYTES (text), got {t.datatype}")
    out = []
    for v in values:
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"input {t.name!r}: element is not valid UTF-8") from None
        if not isinstance(v, str):
            raise BadRequest(f"input {t.name!r}: expected strings, got {type(v).__name__}")
        out.append(v)
    return out


def _ints(t: _Tensor, values: list[Any]) -> list[int]:
    if t.datatype not in _INT_TYPES:
        raise BadRequest(f"input {t.name!r} must be an integer tensor, got {t.datatype}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise BadRequest(f"input {t.name!r}: expected integers")
    return [int(v) for v in values]


def _param(params: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    value = params.get(key, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"parameter {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


async def _score(state: HandlerState, need, tensors, params, timeout_ms: int) -> np.ndarray:
    qt, qv = need("query")
    it, iv = need("items")
    cfg = state.config
    item_first = _param(params, "item_first", False, bool)
    if qt.datatype == "BYTES" and len(qv) != 1:
        raise BadRequest(f"input 'query' must hold one string, got {len(qv)}")
    if qt.datatype == "BYTES" and it.datatype == "BYTES":
        # text: each joined string tokenized, as /v1/score does
        group = await inputs.joined_text(state, _texts(qt, qv)[0], _texts(it, iv), item_first)
        query, items, item_first = group.prefix, group.suffixes, False
    else:
        query_value = _texts(qt, qv)[0] if qt.datatype == "BYTES" else _ints(qt, qv)
        query = await inputs.token_ids(
            state, "query", query_value, cfg.max_query_tokens, "max_query_tokens", allow_empty=True
        )
        if it.datatype == "BYTES":
            items = await inputs.many_token_ids(state, "items", _texts(it, iv))
        else:
            if len(it.shape) != 2:
                raise BadRequest("input 'items' as token ids must have shape [N, L]")
            n, length = it.shape
            state.limits.count("items", n, state.max_items, "max_items")  # before slicing n rows
            if length == 0:
                raise BadRequest(f"input 'items': shape {it.shape}: the items have no tokens")
            flat = _ints(it, iv)
            rows = [flat[i * length : (i + 1) * length] for i in range(n)]
            items = await inputs.many_token_ids(state, "items", rows)
    if "label_token_ids" in tensors:
        labels = _ints(*tensors["label_token_ids"])
    elif state.rerank_label_ids is not None:
        labels = list(state.rerank_label_ids)
    else:
        raise BadRequest("input 'label_token_ids' is required (no default rerank labels)")
    labels = inputs.label_ids(state, labels)
    scores = await inputs.score(
        state,
        query,
        items,
        labels,
        _param(params, "apply_softmax", True, bool),
        item_first,
        timeout_ms,
    )
    return np.asarray(scores, dtype=np.float32).reshape(len(items), len(labels))


def _binary_output(req: InferRequest, params: dict[str, Any]) -> dict[str | None, bool]:
    """Whether each requested output goes as binary data (None: an output not named), checked
    before any work: `binary_data_output` and `outputs[].parameters.binary_data` are booleans."""
    default = _param(params, "binary_data_output", False, bool)
    out: dict[str | None, bool] = {None: default}
    for o in req.outputs or ():
        out[o.name] = _param(o.parameters or {}, "binary_data", default, bool)
    return out


# ----------------------------------------------------------------------------------------------
# infer


async def infer(request: Request, state: HandlerState) -> Response:
    _model(request, state)
    start = time.perf_counter_ns()
    try:
        response, output_ns = await _infer(request, state)
    except ServerError:
        state.kserve_stats.record(False, time.perf_counter_ns() - start)
        raise
    total = time.perf_counter_ns() - start
    times = dict(SERVER_TIMES.get() or ())
    runtime_ns = int(times.get("runtime", 0.0) * 1e6)
    queue_ns = int(sum(ms for name, ms in times.items() if name.endswith("wait")) * 1e6)
    state.kserve_stats.record(
        True,
        total,
        queue=queue_ns,
        compute_input=total - runtime_ns - output_ns,
        compute_infer=runtime_ns - queue_ns,
        compute_output=output_ns,
    )
    return response


async def _infer(request: Request, state: HandlerState) -> tuple[Response, int]:
    """The reply, and the nanoseconds spent encoding it."""
    max_bytes = state.config.max_body_bytes
    body = _decompress(request, await read_body(request), max_bytes)
    head, binary = _split_body(request, body)
    if not head.strip():
        raise BadRequest("request body is empty; expected a KServe v2 inference request")
    cfg = state.config
    # a tensor's `data` is one flat list of up to max_request_tokens values
    bounds = dataclasses.replace(
        JsonBounds.for_server(cfg, state.max_items), list_entries=cfg.max_request_tokens
    )
    data = load_json(head, bounds)
    if isinstance(data, dict):
        fields.check(InferRequest, data)  # `paramters` must not silently drop the task
    try:
        req = InferRequest.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(describe_validation_error(exc)) from None
    params = req.parameters or {}
    binary_outputs = _binary_output(req, params)
    tensors = _decode_inputs(req.inputs, binary, cfg.max_request_tokens)
    task = _param(params, "task", "score" if "items" in tensors else "embed", str)
    timeout_ms = params.get("timeout_ms")
    if timeout_ms is not None and (
        not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms < 1
    ):
        raise BadRequest("parameter 'timeout_ms' must be a positive integer")
    timeout_ms = state.timeout_ms(timeout_ms)

    def need(name: str) -> tuple[_Tensor, list[Any]]:
        if name not in tensors:
            raise BadRequest(f"task {task!r} needs input {name!r}; got {sorted(tensors)}")
        return tensors[name]

    if task == "score":
        name, array = "scores", await _score(state, need, tensors, params, timeout_ms)
    elif task in ("embed", "classify"):
        tt, tv = need("text")
        ids = await inputs.text_inputs(state, "text", _texts(tt, tv))
        if task == "embed":
            normalize = _param(params, "normalize", state.config.embed_normalize, bool)
            vectors = await inputs.embed(
                state, ids, state.config.embed_pooling, normalize, timeout_ms
            )
            name, array = "embeddings", vectors
        else:
            probs = await inputs.classify(state, ids, timeout_ms)
            name, array = "probs", np.asarray(probs, dtype=np.float32)
    else:
        raise BadRequest(f"unknown task {task!r}; use score, embed or classify")

    encode_start = time.perf_counter_ns()
    if req.outputs is not None and req.outputs and all(o.name != name for o in req.outputs):
        raise BadRequest(
            f"task {task!r} produces output {name!r}; requested {[o.name for o in req.outputs]}"
        )
    binary_out = binary_outputs.get(name, binary_outputs[None])
    out: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
    response: dict[str, Any] = {
        "model_name": state.model_name,
        "model_version": "1",
        "outputs": [out],
    }
    if req.id is not None:
        response["id"] = req.id
    if not binary_out:
        out["data"] = Slices(floats(array.reshape(-1)))  # written in slices: the loop keeps serving
        reply = await large_json_response(response)
        return reply, time.perf_counter_ns() - encode_start
    raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
    out["parameters"] = {"binary_data_size": len(raw)}
    head_out = encode(response)
    reply = Response(
        head_out + raw,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head_out))},
    )
    return reply, time.perf_counter_ns() - encode_start
