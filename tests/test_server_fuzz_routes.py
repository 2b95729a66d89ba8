"""Issue 19 fuzz: ≥ 1,000 generated requests over every route of a live `boundgen serve` (demo
model, CPU): near-valid and broken JSON bodies, wrong methods and content types, KServe tensors of
every datatype with generated shapes, as JSON or as Triton binary data. No answer may be a 5xx, and
none may hang: a request unanswered within HANG_S fails the test (it does not wait on a wedged
server).

A live server rather than an in-process app: a request that wedges the event loop, or allocates
without bound, must fail the test, not hang or exhaust the test process. The KServe shapes whose
element count overflows int64 get their own test and a server of their own.
"""

from __future__ import annotations

import json
import re
import resource
import struct

import httpx
import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from boundgen.server.testing import ServeProcess

EXAMPLES = 1000
HANG_S = 10.0  # far above what any generated request needs; the default deadline is 10 s too
VOCAB = 1856  # the demo model's vocabulary (checked in the fixture)
MODEL = "boundgen-demo"
INFER = f"/v2/models/{MODEL}/infer"
INFER_ROUTES = [INFER, f"/v2/models/{MODEL}/versions/1/infer", "/v2/models/nope/infer"]
JSON_ROUTES = [
    "/v1/score",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/classify",
    "/v1/embeddings",
    "/v1/beam",
]
GET_ROUTES = [
    "/health",
    "/v1/models",
    "/metrics",
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    f"/v2/models/{MODEL}",
    f"/v2/models/{MODEL}/ready",
    f"/v2/models/{MODEL}/config",
    f"/v2/models/{MODEL}/versions/1",
    f"/v2/models/{MODEL}/versions/7/ready",
    "/v2/models/nope/config",
    "/docs",
    "/openapi.json",
    "/nope",
]
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
DATATYPES += ["FP16", "FP32", "FP64", "BYTES", "BF16", "STRING", ""]
NUMPY_FORMAT = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q"}
NUMPY_FORMAT |= {"INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "FP16": "e"}
NUMPY_FORMAT |= {"FP32": "f", "FP64": "d"}


# ------------------------------------------------------------------------------------- strategies

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
token = st.one_of(
    st.integers(min_value=0, max_value=VOCAB - 1),
    st.sampled_from([-1, VOCAB, 2**31, 2**63, 2**64]),
)
short_text = st.text(max_size=48)
ids = st.lists(token, max_size=24)
text_or_ids = st.one_of(short_text, ids)
items = st.one_of(
    short_text,
    st.lists(short_text, max_size=8),
    st.lists(ids, max_size=8),
    st.lists(st.one_of(short_text, ids), max_size=4),
)
labels = st.one_of(st.lists(token, max_size=6), st.just([299, 272]))
timeout_ms = st.one_of(st.sampled_from([5000, 60000, 10**12]), st.sampled_from([0, -1, "9", 1.5]))


def maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly a plausible one, sometimes any JSON at all."""
    return st.one_of(value, value, value, json_value)


ROUTE_FIELDS = {
    "/v1/score": {
        "query": text_or_ids,
        "items": items,
        "label_token_ids": labels,
        "apply_softmax": st.booleans(),
        "item_first": st.booleans(),
    },
    "rerank": {
        "query": short_text,
        "documents": st.lists(st.one_of(short_text, st.fixed_dictionaries({"text": short_text}))),
        "top_n": st.integers(min_value=-1, max_value=10),
        "return_documents": st.booleans(),
    },
    "/v1/classify": {"input": items},
    "/v1/embeddings": {
        "input": items,
        "encoding_format": st.sampled_from(["float", "base64", "int8"]),
        "dimensions": st.sampled_from([128, 64, 0]),
        "pooling": st.sampled_from(["last", "mean", "max"]),
        "normalize": st.booleans(),
    },
    "/v1/beam": {
        "prompt": text_or_ids,
        "beam_width": st.integers(min_value=-1, max_value=5),
        "steps": st.integers(min_value=-1, max_value=4),
        "top_k": st.integers(min_value=0, max_value=5),
        "trie": st.sampled_from(["catalog", "nope"]),
    },
}
COMMON_FIELDS = {"model": st.sampled_from([MODEL, "other"]), "timeout_ms": timeout_ms}


@st.composite
def json_route_body(draw, path: str) -> bytes:
    fields = ROUTE_FIELDS["rerank" if "rerank" in path else path] | COMMON_FIELDS
    body = {}
    for name, value in fields.items():
        if draw(st.integers(0, 9)) < 8:
            body[name] = draw(maybe(value))
    body |= draw(st.dictionaries(st.text(max_size=6), json_value, max_size=2))
    return draw(mangled(json.dumps(body).encode()))


@st.composite
def mangled(draw, raw: bytes) -> bytes:
    """Mostly the body as is; else truncated, a key repeated, bytes that are not UTF-8, or junk."""
    how = draw(st.integers(0, 19))
    if how == 0:
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if how == 1 and raw.startswith(b"{") and len(raw) > 2:
        return b'{"query": 1, ' + raw[1:]
    if how == 2:
        at = draw(st.integers(0, len(raw)))
        return (
            raw[:at] + draw(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"])) + raw[at:]
        )
    if how == 3:
        return draw(st.binary(max_size=64))
    if how == 4:
        return json.dumps(draw(json_value)).encode()
    return raw


@st.composite
def tensor(draw) -> tuple[dict, bytes]:
    """A KServe input tensor (JSON `data` or Triton binary data) and its binary bytes."""
    name = draw(st.sampled_from(["query", "items", "text", "label_token_ids", "other"]))
    datatype = draw(st.sampled_from(DATATYPES))
    dims = st.one_of(st.integers(0, 6), st.sampled_from([-1, 1 << 10, 1 << 20]))
    shape = draw(st.lists(dims, max_size=3))
    count = 1
    for d in shape:
        count *= max(d, 0)
    n = count if count <= 64 and draw(st.integers(0, 4)) else draw(st.integers(0, 8))
    if datatype == "BYTES" or datatype not in NUMPY_FORMAT:
        values = draw(st.lists(st.one_of(short_text, token), min_size=n, max_size=n))
    elif datatype.startswith("FP"):
        values = draw(st.lists(st.floats(width=16), min_size=n, max_size=n))
    elif datatype == "BOOL":
        values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    else:
        values = draw(st.lists(token, min_size=n, max_size=n))
    t = {"name": name, "shape": shape, "datatype": datatype}
    if not draw(st.integers(0, 3)):
        return t | {"data": draw(json_value)}, b""
    if draw(st.booleans()):
        return t | {"data": values}, b""
    raw = _binary(datatype, values)
    if not draw(st.integers(0, 4)):
        raw = raw[: draw(st.integers(0, len(raw)))]
    size = draw(st.one_of(st.just(len(raw)), st.sampled_from([-1, 0, 3, 1 << 40, "8"])))
    return t | {"parameters": {"binary_data_size": size}}, raw


def _binary(datatype: str, values: list) -> bytes:
    if datatype not in NUMPY_FORMAT:
        out = b""
        for v in values:
            b = str(v).encode("utf-8", "surrogatepass")
            out += struct.pack("<I", len(b)) + b
        return out
    fmt = NUMPY_FORMAT[datatype]
    out = b""
    for v in values:
        try:
            out += struct.pack("<" + fmt, v)
        except (struct.error, OverflowError):
            out += b"\0" * struct.calcsize(fmt)
    return out


@st.composite
def kserve_request(draw) -> tuple[bytes, dict[str, str]]:
    tensors = draw(st.lists(tensor(), max_size=4))
    req: dict = {"inputs": [t for t, _ in tensors]}
    params = draw(
        st.dictionaries(
            st.sampled_from(
                ["task", "apply_softmax", "item_first", "timeout_ms", "binary_data_output"]
            ),
            st.one_of(
                st.sampled_from(["score", "embed", "classify", "nope", "false"]),
                st.booleans(),
                st.sampled_from([1, 5000, -1]),
            ),
            max_size=3,
        )
    )
    if params:
        req["parameters"] = params
    if draw(st.booleans()):
        req["outputs"] = [
            {"name": draw(st.sampled_from(["scores", "embeddings", "probs", "x"]))}
            | {"parameters": {"binary_data": draw(st.one_of(st.booleans(), st.just("false")))}}
        ]
    head = draw(mangled(json.dumps(req).encode()))
    binary = b"".join(raw for _, raw in tensors)
    headers = {}
    if binary or not draw(st.integers(0, 5)):
        size = draw(st.one_of(st.just(len(head)), st.sampled_from([0, -3, 10**9, "x"])))
        headers["Inference-Header-Content-Length"] = str(size)
    return head + binary, headers


CONTENT_TYPES = ["application/json"] * 6 + [
    "application/json; charset=utf-8",
    "application/octet-stream",
    "text/plain",
    "application/x-www-form-urlencoded",
    "nonsense",
    None,
]


@st.composite
def any_request(draw) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers) over every route."""
    kind = draw(st.sampled_from(["json"] * 5 + ["kserve"] * 3 + ["get", "wrong_method"]))
    if kind == "get":
        return "GET", draw(st.sampled_from(GET_ROUTES)), b"", {}
    if kind == "wrong_method":
        path = draw(st.sampled_from(JSON_ROUTES + INFER_ROUTES + GET_ROUTES))
        return draw(st.sampled_from(["PUT", "DELETE", "PATCH", "GET", "POST"])), path, b"x", {}
    if kind == "kserve":
        body, headers = draw(kserve_request())
        path = draw(st.sampled_from(INFER_ROUTES))
    else:
        path = draw(st.sampled_from(JSON_ROUTES))
        body, headers = draw(json_route_body(path)), {}
    ctype = draw(st.sampled_from(CONTENT_TYPES))
    if ctype is not None:
        headers["Content-Type"] = ctype
    return "POST", path, body, headers


# ------------------------------------------------------------------------------------------- tests


def server_errors(client: httpx.Client) -> dict[str, float]:
    """The 5xx series of `boundgen_requests_total` (endpoint and status → count)."""
    metrics = client.get("/metrics").text
    found = re.finditer(
        r'^boundgen_requests_total(\{[^}]*status="5\d\d"[^}]*\}) (\S+)$', metrics, re.M
    )
    return {m.group(1): float(m.group(2)) for m in found}


# 5xx answers before the fuzz started: /health's 503s while ServeProcess waited for the warm-up
BEFORE: dict[str, float] = {}


@pytest.fixture(scope="module")
def client():
    server = ServeProcess("--device", "cpu")
    with httpx.Client(base_url=server.url, timeout=HANG_S) as c:
        card = c.get("/v1/models").json()["data"][0]
        assert (card["id"], card["vocab_size"]) == (MODEL, VOCAB)
        BEFORE.update(server_errors(c))
        yield c
    server.stop()


SEEN: list[int] = []


def _send(client: httpx.Client, req: tuple[str, str, bytes, dict[str, str]]) -> httpx.Response:
    method, path, body, headers = req
    try:
        return client.request(method, path, content=body, headers=headers)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {HANG_S} s: {method} {path} {body[:300]!r} {headers}")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=any_request())
def test_no_request_gets_a_5xx_or_hangs(client, req):
    r = _send(client, req)
    SEEN.append(r.status_code)
    method, path, body, headers = req
    assert r.status_code < 500, (method, path, body[:300], headers, r.status_code, r.text[:300])


def test_fuzz_ran_every_route_and_the_server_is_well(client):
    assert len(SEEN) >= EXAMPLES, len(SEEN)
    assert {200, 400}.issubset(SEEN), sorted(set(SEEN))  # valid requests were among them
    assert client.get("/health").status_code == 200
    assert server_errors(client) == BEFORE, "a 5xx"


# ---------------------------------------------------------------- element counts beyond int64


def huge_dim() -> st.SearchStrategy:
    return st.one_of(
        st.integers(0, 4),
        st.integers(2**31, 2**65),
        st.sampled_from([10**12, 2**32, 2**62, 2**63 - 1, 2**64 - 1, 6148914691236517206]),
    )


@st.composite
def huge_shape_request(draw) -> bytes:
    shape = draw(st.lists(huge_dim(), min_size=1, max_size=4))
    datatype = draw(st.sampled_from(["INT64", "INT32", "BYTES", "FP32", "UINT64"]))
    data = draw(st.lists(st.integers(1, 100), max_size=4))
    query = {"name": "query", "shape": [1], "datatype": "BYTES", "data": ["q"]}
    name = draw(st.sampled_from(["items", "text", "query", "label_token_ids"]))
    tensor = {"name": name, "shape": shape, "datatype": datatype, "data": data}
    return json.dumps({"inputs": [query, tensor] if name != "query" else [tensor]}).encode()


@pytest.fixture(scope="module")
def own_client():
    """A server of its own, with an address-space cap: before issue 19's fixes, one of these
    requests wedged its event loop and allocated until stopped."""
    server = ServeProcess("--device", "cpu")
    with open(f"/proc/{server.proc.pid}/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.prlimit(server.proc.pid, resource.RLIMIT_AS, (vm + (4 << 30), vm + (4 << 30)))
    with httpx.Client(base_url=server.url, timeout=3.0) as c:
        yield c
    server.stop(timeout_s=3)


WEDGED: list[bytes] = []


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # a wedged server makes shrinking pointless
    report_multiple_bugs=False,
)
@given(body=huge_shape_request())
def test_kserve_shapes_beyond_int64_are_refused(own_client, body):
    if WEDGED:  # one wedge is the answer: do not wait on it again for every later example
        pytest.fail(f"the server was wedged by {WEDGED[0][:300]!r}")
    try:
        r = own_client.post(INFER, content=body, headers={"Content-Type": "application/json"})
    except httpx.TimeoutException:
        WEDGED.append(body)
        raise
    assert r.status_code in (400, 413), (body[:300], r.status_code, r.text[:300])
