"""`benchmarks/pack_out.sh`: a device call brings back at most 8 files, so past 8 the logs of a
call's $OUT go back as one `logs.tgz` (the compile cache's parts beside it), merged with the one an
earlier run of the same call packed."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pack(out: Path, *args: str) -> None:
    script = f'. "{ROOT / "benchmarks" / "pack_out.sh"}" && pack_out "$1" {" ".join(args)}'
    subprocess.run(["bash", "-c", script, "pack", str(out)], check=True, timeout=60)


def _write(out: Path, names: list[str]) -> None:
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)


def _packed(out: Path) -> set[str]:
    with tarfile.open(out / "logs.tgz") as tar:
        return {Path(m.name).as_posix().removeprefix("./") for m in tar.getmembers() if m.isfile()}


def test_eight_files_come_back_as_they_are(tmp_path):
    names = [f"run{i}.json" for i in range(7)] + ["cache.tgz.aa"]
    _write(tmp_path, names)
    _pack(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_past_eight_the_logs_go_back_as_one_tar_beside_the_cache(tmp_path):
    logs = [f"tail{i}.json" for i in range(4)] + [f"tail{i}.log" for i in range(4)] + ["w/a.log"]
    _write(tmp_path, [*logs, "cache.tgz.aa", "cache.tgz.ab"])
    _pack(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cache.tgz.aa",
        "cache.tgz.ab",
        "logs.tgz",
    ]
    assert _packed(tmp_path) == set(logs)
    # a later run of the same call adds files: one tar with both runs' logs
    later = [f"late{i}.log" for i in range(8)]
    _write(tmp_path, later)
    _pack(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cache.tgz.aa",
        "cache.tgz.ab",
        "logs.tgz",
    ]
    assert _packed(tmp_path) == set(logs) | set(later)


@pytest.mark.parametrize("files", [0, 2])
def test_forced_packs_whatever_there_is(tmp_path, files):
    _write(tmp_path, [f"a{i}.log" for i in range(files)])
    _pack(tmp_path, "force")
    assert [p.name for p in tmp_path.iterdir()] == ["logs.tgz"]
    assert _packed(tmp_path) == {f"a{i}.log" for i in range(files)}
