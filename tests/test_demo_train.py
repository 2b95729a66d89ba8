"""The demo trainer: one `TrainConfig` behind `train()` and the `train-demo` flags, its evaluation
through the engine's beam search, and determinism."""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from boundgen.cli import build_parser
from boundgen.demo import ASSETS
from boundgen.demo import catalog as cat
from boundgen.demo import train as tr
from boundgen.settings import from_args

shipped = pytest.mark.skipif(
    not (ASSETS / "model.safetensors").exists(),
    reason="demo model not built (boundgen train-demo --out src/boundgen/demo/assets)",
)


def parse(*flags: str):
    return build_parser().parse_args(["train-demo", *flags])


def test_train_demo_flags_are_the_config_fields(capsys):
    args = parse()
    assert from_args(tr.TrainConfig, args) == tr.TrainConfig()
    assert args.out == "boundgen-demo-model"
    with pytest.raises(SystemExit):
        parse("--help")
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(tr.TrainConfig):
        assert f.metadata["help"], f.name
        assert "--" + f.name.replace("_", "-") in help_text


def test_train_demo_flags_override_the_defaults():
    args = parse("--steps", "7", "--lr", "0.01", "--pack-relevance", "--max-minutes", "2")
    config = from_args(tr.TrainConfig, args)
    assert (config.steps, config.lr, config.pack_relevance, config.max_minutes) == (
        7,
        0.01,
        True,
        2,
    )
    assert config.rel_batch == tr.TrainConfig().rel_batch


@pytest.mark.parametrize(
    "change", [{"steps": 0}, {"rel_batch": -1}, {"lr": -1e-3}, {"max_minutes": 0.0}]
)
def test_bad_config_values_are_refused(change):
    (name,) = change
    with pytest.raises(ValueError, match=name):
        tr.TrainConfig(**change)


@shipped
def test_defaults_are_the_recipe_of_the_shipped_model():
    """Every training setting recorded in the shipped demo.json is the TrainConfig default."""
    recorded = json.loads((ASSETS / "demo.json").read_text())
    defaults = tr.TrainConfig()
    fields = {f.name for f in dataclasses.fields(tr.TrainConfig)}
    checked = sorted(fields & recorded.keys())
    assert len(checked) >= 12, checked
    for name in checked:
        assert getattr(defaults, name) == recorded[name], name
    assert defaults.batch_sizes == recorded["batch_sizes"]


def test_trainer_does_not_import_the_cli():
    """Not at import time (a subprocess sees every module loaded) and nowhere in the source."""
    tree = ast.parse(Path(tr.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "boundgen.cli" not in imported
    assert not [m for m in imported if m and m.startswith("boundgen.commands")]
    code = (
        "import sys, boundgen.demo.train; "
        "print([m for m in sys.modules"
        " if m == 'boundgen.cli' or m.startswith('boundgen.commands')])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def _shipped_encoder():
    from tokenizers import Tokenizer

    catalog = cat.Catalog.from_json(json.loads((ASSETS / "catalog.json").read_text()))
    return tr.Encoder(Tokenizer.from_file(str(ASSETS / "tokenizer.json")), catalog)


@shipped
def test_catalog_trie_is_the_shipped_trie_file():
    from boundgen import Trie

    enc = _shipped_encoder()
    trie, shipped_trie = tr.catalog_trie(enc), Trie.from_file(ASSETS / "catalog_trie.jsonl")
    assert len(trie) == len(shipped_trie) == len(enc.catalog.items)
    tokens = [enc.sid_ids(it.item_id) for it in enc.catalog.items]
    assert trie.item_ids(tokens) == shipped_trie.item_ids(tokens)


@shipped
@pytest.mark.slow
def test_evaluation_of_the_shipped_model_reproduces_its_recorded_metrics():
    """The trainer's evaluation (engine beam search over the catalog trie) of the shipped weights
    gives the held-out metrics recorded when they were trained."""
    recorded = json.loads((ASSETS / "demo.json").read_text())
    test = json.loads((ASSETS / "eval.json").read_text())
    limit = tr.TrainConfig().eval_limit
    metrics = tr.evaluate(tr.load_model(ASSETS), _shipped_encoder(), test, limit)
    assert metrics == pytest.approx(recorded["heldout_metrics_at_training"], abs=1e-9)


@shipped
@pytest.mark.slow
def test_beam_items_are_engine_beam_search_results():
    from boundgen import Engine

    enc = _shipped_encoder()
    trie = tr.catalog_trie(enc)
    engine = Engine.from_pretrained(ASSETS, device="cpu")
    queries = ["red running shoes", "cheap Soldal backpack", "navy down jacket"]
    prompts = [cat.RETRIEVAL_TEMPLATE.format(query=q) for q in queries]
    got = tr.beam_items(tr.load_model(ASSETS), [enc.enc(p) for p in prompts], trie)
    for prompt, items in zip(prompts, got):
        beams = engine.beam_search(prompt, tr.SID_BEAM_WIDTH, trie.depth, trie=trie)
        assert items == [trie.item_ids(tokens) for tokens, _ in beams]


def _small_run(tmp_path, monkeypatch, **change):
    small = {
        "train_rel": 100,
        "train_ret": 50,
        "train_hist": 20,
        "test_rel": 10,
        "test_ret": 5,
        "test_hist": 5,
    }
    monkeypatch.setattr(tr.cat, "make_splits", functools.partial(cat.make_splits, **small))
    config = tr.TrainConfig(
        steps=3, num_items=300, eval_limit=2, hidden_size=32, rel_batch=4, eval_every=1, **change
    )
    return tr.train(config, tmp_path)


@pytest.mark.slow
def test_same_config_gives_bit_identical_weights(tmp_path, monkeypatch):
    _small_run(tmp_path / "a", monkeypatch)
    _small_run(tmp_path / "b", monkeypatch)
    _small_run(tmp_path / "c", monkeypatch, seed=1)
    weights = [(tmp_path / run / "model.safetensors").read_bytes() for run in "abc"]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


@pytest.mark.slow
def test_train_writes_a_loadable_checkpoint_and_its_record(tmp_path, monkeypatch):
    from boundgen import Engine, Trie

    meta = _small_run(tmp_path, monkeypatch, lm_weight=0.5)
    assert meta["steps"] == 3
    names = {p.name for p in tmp_path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "catalog_trie.jsonl",
        "catalog.json",
        "eval.json",
        "demo.json",
    } <= names
    written = json.loads((tmp_path / "demo.json").read_text())
    assert written["lm_weight"] == 0.5 and written["num_items"] == 300
    assert set(written["heldout_metrics_at_training"]) == {
        "auc",
        "recall@10_query",
        "recall@10_history",
    }
    engine = Engine.from_pretrained(tmp_path)
    trie = Trie.from_file(tmp_path / "catalog_trie.jsonl")
    beams = engine.beam_search(cat.RETRIEVAL_TEMPLATE.format(query="red shoes"), 4, 3, trie=trie)
    assert len(beams) == 4 and all(trie.item_ids(t) is not None for t, _ in beams)
