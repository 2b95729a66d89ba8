"""`server.json`: the one reply encoder. Its replies hold the same values as the encoders they
replaced (pydantic's `model_dump_json`, `json.dumps` of `tolist()`), non-finite floats are `null`
as in pydantic's replies, and `encode_async` writes `Slices` a slice at a time, yielding to the
event loop between slices, into the same bytes as one call."""

from __future__ import annotations

import asyncio
import json
import math
import struct

import numpy as np
import pytest

pytest.importorskip("orjson")

from boundgen.server import json as server_json
from boundgen.server.json import Slices, encode, encode_async, floats
from boundgen.server.schemas.common import Usage
from boundgen.server.schemas.openai import Embedding, EmbeddingsResponse
from boundgen.server.schemas.sglang import ScoreResponse, score_reply

# float32 values whose float64 spelling is long, tiny, huge, subnormal, negative zero
AWKWARD = np.array(
    [0.1, 1 / 3, 1e-5, 3.3e-8, 1e-45, 3.4e38, -0.0, 0.0, 1.0, -2.5, 12345.678, 2**-126],
    dtype=np.float32,
)


def bits(values) -> list[int]:
    """The float64 bit patterns (exact equality, -0.0 apart from 0.0)."""
    return [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]


def test_float32_arrays_keep_the_values_tolist_gave():
    want = json.loads(json.dumps(AWKWARD.tolist()))
    got = json.loads(encode(floats(AWKWARD)))
    assert bits(got) == bits(want)


def test_pydantic_replies_keep_their_values_and_key_order():
    rng = np.random.default_rng(0)
    scores = rng.random((100, 2)).astype(np.float32).tolist()  # W2: 100 items × 2 labels
    reply = ScoreResponse(
        scores=scores, model="m", usage=Usage(prompt_tokens=3, total_tokens=3, completion_tokens=0)
    )
    old = reply.model_dump_json(exclude_none=True)
    new = encode(reply)
    assert json.loads(new) == json.loads(old)
    assert list(json.loads(new)) == list(json.loads(old))  # key order
    assert "completion_tokens" in json.loads(new)["usage"]
    no_none = Usage(prompt_tokens=3, total_tokens=3)
    assert json.loads(encode(no_none)) == {"prompt_tokens": 3, "total_tokens": 3}


@pytest.mark.parametrize("scores", [[], [[0.25, 1.0], [math.nan, -math.inf]], "w2"])
def test_the_score_reply_is_what_its_schema_dumps_to(scores):
    """`/v1/score` replies are built without pydantic (`score_reply`): byte for byte the reply
    `ScoreResponse` gave."""
    if scores == "w2":
        scores = np.random.default_rng(1).random((100, 2)).astype(np.float32).tolist()
    usage = Usage(prompt_tokens=1856, total_tokens=1856, completion_tokens=0)
    schema = ScoreResponse(scores=scores, model="m", usage=usage)
    assert encode(score_reply(scores, "m", 1856)) == encode(schema)


def test_embeddings_reply_matches_the_schema():
    """The OpenAI embeddings reply is built as plain data (no per-float validation): the same
    JSON as `EmbeddingsResponse` with the same content."""
    vectors = np.stack([AWKWARD, -AWKWARD])
    usage = Usage(prompt_tokens=4, total_tokens=4)
    model = EmbeddingsResponse(
        data=[Embedding(index=i, embedding=v.tolist()) for i, v in enumerate(vectors)],
        model="m",
        usage=usage,
    )
    data = [
        {"object": "embedding", "index": i, "embedding": floats(v)} for i, v in enumerate(vectors)
    ]
    plain = {"object": "list", "data": Slices(data, 12), "model": "m", "usage": usage}
    got = json.loads(asyncio.run(encode_async(plain)))
    want = json.loads(model.model_dump_json(exclude_none=True))
    assert got == want
    assert list(got) == list(want) and list(got["data"][0]) == list(want["data"][0])
    for g, w in zip(got["data"], want["data"]):
        assert bits(g["embedding"]) == bits(w["embedding"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_null_as_in_pydantic_replies(bad):
    reply = ScoreResponse(
        scores=[[bad, 0.5]], model="m", usage=Usage(prompt_tokens=1, total_tokens=1)
    )
    pydantic_reply = json.loads(reply.model_dump_json(exclude_none=True))
    assert pydantic_reply["scores"] == [[None, 0.5]]
    assert json.loads(encode(reply)) == pydantic_reply
    assert json.loads(encode({"scores": [[bad, 0.5]]})) == {"scores": [[None, 0.5]]}
    array = floats(np.array([bad, 0.5], dtype=np.float32))
    assert json.loads(encode(array)) == [None, 0.5]
    sliced = asyncio.run(encode_async({"data": Slices(np.stack([array] * 3), 2)}))
    assert json.loads(sliced) == {"data": [[None, 0.5]] * 3}


def test_numpy_scalars_and_int_keys():
    out = json.loads(encode({1: np.float32(0.5), "n": np.int64(3), "b": np.bool_(True)}))
    assert out == {"1": 0.5, "n": 3, "b": True}
    assert json.loads(encode(floats(np.ones((3, 4)))[:, 1])) == [1.0, 1.0, 1.0]  # a strided view


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(server_json, "SLICE_VALUES", 8)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: Slices(a.reshape(-1)),  # KServe: one flat array
        lambda a: Slices(a, a.shape[1]),  # TEI: [N, D]
        lambda a: {"data": Slices([{"i": i, "v": v} for i, v in enumerate(a)], a.shape[1])},
        lambda a: {"x": [Slices(a.tolist(), 3), {"y": Slices(a[:1])}], "z": "after"},
    ],
)
def test_slices_encode_to_the_bytes_of_one_call(small_slices, make):
    array = floats(np.arange(60, dtype=np.float32).reshape(20, 3) / 7)
    value = make(array)

    def whole(v):
        if isinstance(v, Slices):
            return whole(v.items)
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        if isinstance(v, list):
            return [whole(x) for x in v]
        return v

    assert asyncio.run(encode_async(value)) == encode(whole(value))


def test_a_client_string_cannot_pose_as_a_slice(small_slices):
    """Placeholders carry a random tag per reply: text a client sent (echoed documents) that
    looks like one stays text."""
    lookalikes = [f"slices-{t}-0" for t in ("", "0" * 16, "x")]
    value = {"texts": lookalikes, "data": Slices(list(range(20)))}
    assert json.loads(asyncio.run(encode_async(value))) == {
        "texts": lookalikes,
        "data": list(range(20)),
    }


def test_encode_async_lets_the_loop_run_between_slices(small_slices):
    ticks = []

    async def main() -> bytes:
        stop = asyncio.Event()

        async def other_request() -> None:
            while not stop.is_set():
                ticks.append(1)
                await asyncio.sleep(0)

        task = asyncio.create_task(other_request())
        await asyncio.sleep(0)
        out = await encode_async(Slices(floats(np.zeros(80, dtype=np.float32))))
        stop.set()
        await task
        return out

    before = len(ticks)
    assert json.loads(asyncio.run(main())) == [0.0] * 80
    assert len(ticks) - before >= 9  # 10 slices of 8 values: the other task ran between them
