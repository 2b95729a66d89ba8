"""The `boundgen` dispatcher: every command listed, optional dependencies reported, not crashed
on."""

from __future__ import annotations

import importlib
import json

import pytest

from boundgen import cli


def test_every_command_is_listed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in (
        "demo",
        "score",
        "beam",
        "make-model",
        "serve",
        "loadtest",
        "compile",
        "quant-check",
        "trace",
        "train-demo",
    ):
        assert name in out


def test_command_with_missing_optional_dependency(monkeypatch, capsys):
    real = importlib.import_module

    def fake(name, *a, **kw):
        if name == "boundgen.commands.loadtest":
            raise ModuleNotFoundError("No module named 'httpx'", name="httpx")
        return real(name, *a, **kw)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["loadtest", "--url", "http://127.0.0.1:1"]) == 1
    assert "pip install 'boundgen[server]'" in capsys.readouterr().err
    assert "make-model" in cli.build_parser().format_help()  # the other commands still build


def test_unknown_flags_still_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(
            ["score", "--model", "m", "--query", "q", "--item", "i", "--labels", "1", "--bogus"]
        )
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_user_errors_are_one_line(tmp_path, capsys):
    assert (
        cli.main(
            [
                "score",
                "--model",
                str(tmp_path / "nope"),
                "--query",
                "q",
                "--item",
                "i",
                "--labels",
                "1",
            ]
        )
        == 1
    )
    assert "does not exist" in capsys.readouterr().err


# ---- score and beam run on the built-in demo model without --model, as serve and demo do


def test_score_defaults_to_the_demo_model(capsys):
    query, item = "Query: red Astora sneakers\n", "Item: {}\nRelevant:"
    right, wrong = "Astora Core sneakers, red, $999, Vienna", "Nimtra Max sofa, red, $1290, Madrid"
    argv = ["score", "--query", query, "--item", item.format(right), "--item", item.format(wrong)]
    assert cli.main([*argv, "--labels", " yes", " no", "--softmax", "--device", "cpu"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["model"] == "boundgen-demo"
    (right_yes, _), (wrong_yes, _) = reply["scores"]
    assert right_yes > 0.9 > 0.1 > wrong_yes


def test_beam_defaults_to_the_demo_model_its_trie_and_its_depth(capsys):
    prompt = "Query: red Astora sneakers\nID:"
    assert cli.main(["beam", "--prompt", prompt, "--beam-width", "3", "--device", "cpu"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 3 and all(len(r["tokens"]) == 3 for r in results)  # the trie's depth
    assert results[0]["title"] == "Astora Core sneakers, red, $999, Vienna"  # the catalog's title
    # log-probs renormalised over each step's trie children: the same best item, no lower a score
    argv = ["beam", "--prompt", prompt, "--beam-width", "3", "--trie-softmax", "children"]
    assert cli.main([*argv, "--device", "cpu"]) == 0
    children = json.loads(capsys.readouterr().out)["results"]
    assert children[0]["title"] == results[0]["title"]
    assert children[0]["logprob"] >= results[0]["logprob"] - 1e-6


@pytest.mark.parametrize("command", ["score", "beam", "demo"])
def test_model_help_names_the_default(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "(default: the built-in demo model)" in " ".join(capsys.readouterr().out.split())
