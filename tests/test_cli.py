"""The `boundgen` dispatcher: every command listed, optional dependencies reported, not crashed
on."""

from __future__ import annotations

import importlib

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
