"""Bad input gets a clear exception naming the problem, and the engine keeps working afterwards."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from boundgen import Engine

QUERY, ITEMS = "red running shoes", ["trail shoe", "coffee mug"]


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_supported(tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match="unsupported architecture 'MistralForCausalLM'.*Qwen2ForCausalLM"
    ):
        Engine.from_pretrained(path)


@pytest.mark.parametrize(
    "change,message",
    [
        ("drop", "missing tensors: model.layers.1.mlp.up_proj.weight"),
        ("extra", "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
        ("shape", "'model.layers.0.self_attn.k_proj.weight' has shape"),
    ],
)
def test_bad_tensors_are_named(change, message, tiny_model, tmp_path):
    path = copy_model(tiny_model("qwen2"), tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    if change == "drop":
        del state["model.layers.1.mlp.up_proj.weight"]
    elif change == "extra":
        state["model.layers.0.mlp.extra.weight"] = state["model.norm.weight"].clone()
    else:
        state["model.layers.0.self_attn.k_proj.weight"] = state[
            "model.layers.0.self_attn.k_proj.weight"
        ][:-1].clone()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(path)


def test_missing_path_dtype_device(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        Engine.from_pretrained(tiny_model("qwen2"), dtype="float8")
    with pytest.raises(ValueError, match="device"):
        Engine.from_pretrained(tiny_model("qwen2"), device="tpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        Engine.from_pretrained(tiny_model("qwen2"), attention="flash9")
    missing_tok = copy_model(tiny_model("qwen2"), tmp_path / "notok")
    (missing_tok / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Engine.from_pretrained(missing_tok)


def test_score_input_errors(engine_for):
    engine = engine_for("qwen2")
    vocab = engine.config.vocab_size
    with pytest.raises(ValueError, match="items is empty"):
        engine.score(QUERY, [], [1])
    with pytest.raises(ValueError, match=f"Token ID {vocab} is out of vocabulary range"):
        engine.score(QUERY, ITEMS, [1, vocab])
    with pytest.raises(ValueError, match="label_token_ids must be a non-empty list"):
        engine.score(QUERY, ITEMS, [])
    with pytest.raises(ValueError, match=r"items\[1\] has token id -3"):
        engine.score(QUERY, [[1, 2], [-3]], [1])
    with pytest.raises(ValueError, match=r"items\[0\] must be a string or a list of token ids"):
        engine.score(QUERY, [3.5], [1])
    for odd in ([1, True], [1, 2.0], [1, "2"], [1, None]):  # booleans are not token ids either
        with pytest.raises(ValueError, match=r"items\[0\] must be a string or a list of token ids"):
            engine.score(QUERY, [odd], [1])
    with pytest.raises(ValueError, match=rf"items\[0\] has token id {vocab} outside"):
        engine.score(QUERY, [[1, vocab, vocab + 5, -1]], [1])  # the first bad id is named
    with pytest.raises(ValueError, match="needs a \\*ForSequenceClassification"):
        engine.classify(["x"])
    assert len(engine.score(QUERY, ITEMS, [1, 2])) == 2  # still serving


def test_too_long_errors_unless_truncate(engine_for):
    engine = engine_for("llama")
    limit = engine.limits.max_seq_len
    long_item = list(range(5, 5 + limit))
    with pytest.raises(
        ValueError, match=f"over the limit of {limit - 2}; shorten it or pass truncate=True"
    ):
        engine.score([1, 2], [long_item], [3])
    truncated = engine.score([1, 2], [long_item], [3], truncate=True)
    assert truncated == engine.score([1, 2], [long_item[: limit - 2]], [3])
    with pytest.raises(ValueError, match="over the limit"):
        engine.embed([long_item + [1]])


def test_classify_and_embed_errors(engine_for):
    cls = engine_for("qwen2", 3)
    with pytest.raises(ValueError, match="score needs a \\*ForCausalLM"):
        cls.score(QUERY, ITEMS, [1])
    with pytest.raises(ValueError, match="texts is empty"):
        cls.classify([])
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        cls.embed(["x"], pooling="max")
    with pytest.raises(FileNotFoundError, match="no MLP head spec"):
        cls.embed(["x"], head="/nonexistent/head")


_ENTRY = st.one_of(
    st.integers(-2, 12),
    st.integers(2**63 - 2, 2**64),  # past int64: numpy's range check must not take them
    st.booleans(),
    st.floats(0, 3),
    st.text(max_size=2),
    st.none(),
)


@given(items=st.lists(st.lists(_ENTRY, max_size=4) | st.text(max_size=3), min_size=1, max_size=5))
@example(items=[[3, 4], [5, 2**64]])  # all ints, one past int64
def test_many_ids_is_to_ids_per_item(items):
    """`many_ids` checks all items in one pass; whatever it returns or raises, the check per item
    returns or raises too (the same error, naming the same item)."""
    from boundgen.workloads.inputs import Limits, many_ids, to_ids

    class Chars:  # a tokenizer: one id per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 10 for c in text]

    limits = Limits(vocab_size=10, max_seq_len=64, max_items=8)

    def outcome(fn):
        try:
            return fn()
        except ValueError as exc:
            return str(exc)

    per_item = outcome(
        lambda: [to_ids(x, Chars(), limits, f"items[{i}]") for i, x in enumerate(items)]
    )
    assert outcome(lambda: many_ids(items, Chars(), limits, "items")) == per_item


@pytest.mark.parametrize("bad", [None, -1, 10, 2**64, True, 2.0])
@pytest.mark.parametrize("n_items", [2, 40])  # 32 ids: Python's min and max; 640: numpy's
def test_many_ids_names_the_item_at_fault_few_ids_or_many(bad, n_items):
    """Both range checks of `many_ids` (Python's for few ids, numpy's for many) pass good ids
    and send any bad one to the per-item check, which names its item."""
    from boundgen.workloads.inputs import Limits, many_ids

    limits = Limits(vocab_size=10, max_seq_len=64, max_items=64)
    items = [[i % 10] * 16 for i in range(n_items)]
    assert many_ids(items, None, limits, "items") == items
    if bad is None:
        return
    items[-1] = items[-1][:15] + [bad]
    with pytest.raises(ValueError, match=rf"items\[{n_items - 1}\]"):
        many_ids(items, None, limits, "items")


@given(
    query=st.lists(_ENTRY, max_size=5) | st.text(max_size=3),
    items=st.lists(st.lists(_ENTRY, max_size=5) | st.text(max_size=3), min_size=1, max_size=4),
    truncate=st.booleans(),
    item_first=st.booleans(),
)
@example(query=[1, 2], items=[[3] * 300, [4]], truncate=False, item_first=False)  # numpy's check
@example(query=[1, 2, 3, 4, 5, 6], items=[[7, 8]], truncate=True, item_first=False)  # a cut query
def test_prepare_score_one_array_check_is_the_per_entry_check(query, items, truncate, item_first):
    """`prepare_score` checks a token-id request's query and items as one array (kept as the
    group's `ids`); whatever it returns or raises, the per-entry checks alone give the same groups
    or the same error, and the array holds the group's ids."""
    from unittest import mock

    from boundgen.workloads import score
    from boundgen.workloads.inputs import Limits

    class Chars:  # a tokenizer: one id per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) % 10 for c in text]

        def encode_batch(self, texts):
            return [self.encode(t) for t in texts]

    limits = Limits(vocab_size=10, max_seq_len=6 if len(items) < 2 else 400, max_items=8)
    req = score.ScoreRequest(query, items, [1], item_first=item_first, truncate=truncate)

    def outcome():
        try:
            return score.prepare_score(req, Chars(), limits)
        except ValueError as exc:
            return str(exc)

    got = outcome()
    with mock.patch.object(score, "check_token_ids", lambda seqs, vocab_size: (False, None)):
        want = outcome()
    assert got == want  # groups compare by their lists
    for g in got if isinstance(got, list) else []:
        if g.ids is not None:
            assert g.ids.tolist() == g.prefix + [t for s in g.suffixes for t in s]


def test_prepare_score_keeps_a_token_id_requests_array_unless_cut():
    """Past `_FEW_IDS` ids a token-id request's group carries them as one array; not where any is
    cut, or few."""
    from boundgen.workloads import inputs, score

    limits = inputs.Limits(vocab_size=10, max_seq_len=400, max_items=8)
    prepare = lambda q, items, **kw: score.prepare_score(
        score.ScoreRequest(q, items, [1], **kw), None, limits
    )[0]
    query, item = [1, 2] * 100, [3] * 100  # 300 ids in all
    assert len(query) + len(item) > inputs._FEW_IDS
    flat = query + item + [4]
    assert prepare(query, [item, [4]]).ids.tolist() == flat
    assert prepare(tuple(query), (tuple(item), [4])).ids.tolist() == flat  # tuples too
    assert prepare(query + [5] * 200, [item], truncate=True).ids is None  # the query cut
    assert prepare(query, [item * 3], truncate=True).ids is None  # an item cut
    assert prepare(query, [item], item_first=True).ids is None  # item + query: other lists
    assert prepare([1, 2], [[3, 4], [5]]).ids is None  # few ids: packing converts them
