"""Parity with HuggingFace transformers on identical weights (CPU, float32, 1e-4 absolute)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from boundgen import Engine

transformers = pytest.importorskip("transformers")

ARCHS = ["qwen2", "qwen3", "llama"]
TOL = 1e-4
QUERY = "Is this a good running shoe for a marathon on wet roads?"
ITEMS = [
    "Trail runner with waterproof mesh, size 42",
    "yes",
    "A blue ceramic coffee mug that holds 350 ml and keeps drinks warm for an hour or more",
    "Lightweight carbon plate racing flat",
    "no",
]


@pytest.fixture(scope="module")
def hf_causal(tiny_model):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model(arch)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
            tok = transformers.AutoTokenizer.from_pretrained(path)
            cache[arch] = (model, tok)
        return cache[arch]

    return get


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("item_first", [False, True])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_score_matches_hf(arch, item_first, share_prefix, tiny_model, hf_causal):
    """SGLang semantics (issue 18): the joined text tokenized, each label's probability under the
    full vocabulary's softmax."""
    model, tok = hf_causal(arch)
    engine = Engine.from_pretrained(tiny_model(arch), share_prefix=share_prefix)
    labels = [
        tok.encode(" yes", add_special_tokens=False)[0],
        tok.encode(" no", add_special_tokens=False)[0],
        7,
    ]
    ours = torch.tensor(engine.score(QUERY, ITEMS, labels, item_first=item_first))
    ref = []
    for item in ITEMS:
        ids = tok.encode(item + QUERY if item_first else QUERY + item, add_special_tokens=False)
        ref.append(torch.log_softmax(hf_last_logits(model, ids), -1)[labels].exp())
    assert torch.allclose(ours, torch.stack(ref), atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_score_softmax_token_ids_and_split_batches(arch, tiny_model, hf_causal):
    """Token-id inputs, softmax over labels, and a token budget that forces several forwards."""
    model, _ = hf_causal(arch)
    engine = Engine.from_pretrained(tiny_model(arch), max_batch_tokens=40)
    g = torch.Generator().manual_seed(1)
    query = torch.randint(0, 1000, (23,), generator=g).tolist()
    items = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 9, 17, 4, 30, 2)]
    labels = [3, 11]
    ours = torch.tensor(engine.score(query, items, labels, apply_softmax=True))
    ref = torch.stack(
        [torch.softmax(hf_last_logits(model, query + it)[labels], -1) for it in items]
    )
    assert torch.allclose(ours, ref, atol=TOL, rtol=0)
    assert torch.allclose(ours.sum(-1), torch.ones(len(items)), atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_classify_matches_hf(arch, tiny_model, engine_for):
    path = tiny_model(arch, seq_cls=3)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = ITEMS + [QUERY]
    ours = torch.tensor(engine_for(arch, 3).classify(texts))
    with torch.no_grad():
        ref = torch.stack([model(torch.tensor([tok.encode(t)])).logits[0] for t in texts])
    assert ours.shape == (len(texts), 3)
    assert torch.allclose(ours, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_hf(arch, pooling, engine_for, hf_causal):
    model, tok = hf_causal(arch)
    texts = ITEMS + [QUERY]
    ours = engine_for(arch).embed(texts, pooling=pooling, normalize=True)
    refs = []
    with torch.no_grad():
        for t in texts:
            h = model.model(torch.tensor([tok.encode(t)])).last_hidden_state[0]
            refs.append(h[-1] if pooling == "last" else h.mean(0))
    ref = torch.nn.functional.normalize(torch.stack(refs), dim=-1)
    assert ours.shape == (len(texts), engine_for(arch).config.hidden_size)
    assert torch.allclose(ours, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_per_token_embeddings_match_hf(arch, engine_for, hf_causal):
    """pooling="tokens": every token's final hidden state, one [L, H] tensor per text."""
    model, tok = hf_causal(arch)
    texts = ITEMS + [QUERY]
    ours = engine_for(arch).embed(texts, pooling="tokens")
    assert len(ours) == len(texts)
    with torch.no_grad():
        for got, t in zip(ours, texts):
            want = model.model(torch.tensor([tok.encode(t)])).last_hidden_state[0]
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=TOL, rtol=0)


def test_embed_through_mlp_head(engine_for, tmp_path):
    engine = engine_for("qwen2")
    h = engine.config.hidden_size
    g = torch.Generator().manual_seed(0)
    weights = {
        "layers.0.weight": torch.randn(8, h, generator=g),
        "layers.0.bias": torch.randn(8, generator=g),
        "layers.1.weight": torch.randn(1, 8, generator=g),
        "layers.1.bias": torch.randn(1, generator=g),
    }
    save_file(weights, str(tmp_path / "head.safetensors"))
    (tmp_path / "head.json").write_text(
        json.dumps(
            {
                "input_dim": h,
                "hidden_dims": [8],
                "output_dim": 1,
                "activation": "relu",
                "output_activation": "sigmoid",
            }
        )
    )
    out = engine.embed(ITEMS, head=tmp_path)
    x = engine.embed(ITEMS)
    ref = torch.sigmoid(
        torch.relu(x @ weights["layers.0.weight"].T + weights["layers.0.bias"])
        @ weights["layers.1.weight"].T
        + weights["layers.1.bias"]
    )
    assert out.shape == (len(ITEMS), 1)
    assert torch.allclose(out, ref, atol=1e-5)


def test_sharded_checkpoint_loads_identically(tmp_path, engine_for):
    from boundgen.checkpoints import make_model

    path = make_model(
        "tiny", tmp_path / "sharded", arch="qwen2", max_shard_bytes=200_000, progress=False
    )
    assert (path / "model.safetensors.index.json").is_file()
    sharded = Engine.from_pretrained(path)
    single = engine_for("qwen2")
    assert sharded.score(QUERY, ITEMS, [5, 6]) == single.score(QUERY, ITEMS, [5, 6])
