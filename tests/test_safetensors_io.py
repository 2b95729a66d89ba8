"""The chunked safetensors reader returns exactly what the safetensors library reads."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from boundgen.models.safetensors_io import read_header, read_tensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.odd_bool": torch.rand(3, generator=g) > 0.5,  # 3 bytes: the next offset is unaligned
        "c.f32": torch.randn(4, 3, generator=g),
        "d.i64": torch.arange(9).reshape(3, 3),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.big": torch.randn(64, 64, generator=g),  # larger than the small chunks below
        "g.empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1 << 20])
def test_read_tensors_matches_safetensors(tmp_path, chunk_bytes):
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file), metadata={"format": "pt"})
    expected = load_file(str(file))
    got = {}
    for name, t in read_tensors(file, "cpu", chunk_bytes=chunk_bytes):
        got[name] = t.clone()  # a view of a buffer the next chunk may reuse
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_truncated_and_foreign_files_are_refused(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file(_tensors(), str(file))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(ValueError, match="inconsistent data offsets"):
        read_header(cut)
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(b"PK\x03\x04 not a safetensors file at all")
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(read_tensors(foreign, "cpu"))
