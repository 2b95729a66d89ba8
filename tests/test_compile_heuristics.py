"""FP8 models are compiled with Inductor's wide-row reductions (their input quantize's amax read
once), and that choice is part of the compile cache key; bf16 models keep the defaults."""

from __future__ import annotations

import copy

import torch

from boundgen.compile import aoti
from boundgen.compile.buckets import Bucket
from boundgen.compile.cache import model_fingerprint
from boundgen.quant.fp8 import quantize_modules


def _fp8_copy(model):
    fp8 = copy.deepcopy(model)
    names = [n for n, m in fp8.named_modules() if n.endswith("mlp.down_proj")]
    return quantize_modules(fp8, names, emulate=True)


def _choices_during_build(model, tmp_path, monkeypatch) -> list:
    from torch._inductor.virtualized import V

    seen = []

    def fake_compile(ep, package_path, inductor_configs):
        seen.append(type(V.choices).__name__)
        seen.append(inductor_configs.get("aot_inductor.metadata", {}).get("boundgen_recipe"))
        with open(package_path, "wb") as f:
            f.write(b"not a package")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    aoti.build_package(model, Bucket.parse("t16-s2-m8"), tmp_path / "p.pt2", "cpu")
    return seen


def test_fp8_builds_use_wide_row_reductions(engine_for, tmp_path, monkeypatch):
    model = engine_for("qwen2").model
    fp8 = _fp8_copy(model)
    assert _choices_during_build(fp8, tmp_path, monkeypatch) == [
        "WideRowChoices",
        "wide-row-reductions",
    ]
    assert _choices_during_build(model, tmp_path, monkeypatch) == ["InductorChoices", None]


def test_the_recipe_is_part_of_the_cache_key(engine_for, monkeypatch):
    from boundgen.quant.fp8 import Fp8Linear

    fp8 = _fp8_copy(engine_for("qwen2").model)
    before = model_fingerprint(fp8)
    monkeypatch.setattr(Fp8Linear, "COMPILE_RECIPE", "another recipe")
    assert model_fingerprint(fp8) != before
