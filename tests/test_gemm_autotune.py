"""`compile/gemm_autotune.py` (`BOUNDGEN_GEMM_AUTOTUNE`) and `compile/options.py`: the Inductor
switches reach both compile paths and the artifact cache's platform key."""

from __future__ import annotations

import pytest
import torch

from boundgen.compile import gemm_autotune, options, residual


def test_the_mode_picks_the_options_and_is_part_of_the_platform_key(monkeypatch):
    from boundgen.compile.cache import platform_info

    assert gemm_autotune.inductor_options() == {} == options.inductor_options()  # defaults
    assert platform_info("cpu")["gemm_autotune"] == "0"
    monkeypatch.setattr(gemm_autotune, "MODE", "1")
    monkeypatch.setattr(residual, "MODE", "add")
    opts = options.inductor_options()
    assert opts["max_autotune_gemm"] is True and opts["max_autotune_gemm_backends"] == "ATEN,TRITON"
    assert isinstance(opts["post_grad_custom_post_pass"], residual.UnfusedResidual)
    assert options.platform_keys() == {"residual": "add", "gemm_autotune": "1"}
    assert platform_info("cpu")["gemm_autotune"] == "1"
    monkeypatch.setattr(gemm_autotune, "MODE", "yes")
    with pytest.raises(ValueError, match="BOUNDGEN_GEMM_AUTOTUNE='yes': choose one of 0, 1"):
        options.inductor_options()


def test_inductor_takes_the_options_and_the_result_is_unchanged(monkeypatch):
    """The option names exist in this torch (an unknown one is an error at compile): a GEMM
    compiled with autotuning on equals eager's (on the CPU only cuBLAS's counterpart, ATen, is
    a candidate)."""
    import torch._functorch.config as functorch

    monkeypatch.setattr(gemm_autotune, "MODE", "1")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 32, generator=g)
    torch._dynamo.reset()
    opts = {**options.inductor_options(), "fx_graph_cache": False}
    with functorch.patch(enable_autograd_cache=False):
        got = torch.compile(lambda a, b: (a @ b).relu(), fullgraph=True, options=opts)(a, b)
    torch.testing.assert_close(got, (a @ b).relu())


def test_both_compile_paths_pass_the_options(engine_for, tmp_path, monkeypatch):
    """An AOTInductor build and the beam search's compiled layers (`ModelSteps`) compile with
    `options.inductor_options()`."""
    from boundgen.compile import aoti
    from boundgen.compile.buckets import Bucket
    from boundgen.compile.decode import ModelSteps

    monkeypatch.setattr(gemm_autotune, "MODE", "1")
    built, compiled = [], []

    def fake_package(ep, package_path, inductor_configs):
        built.append(inductor_configs)
        with open(package_path, "wb") as f:
            f.write(b"not a package")

    def fake_compile(fn, fullgraph=False, options=None):
        compiled.append(options)
        return fn

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_package)
    monkeypatch.setattr(torch, "compile", fake_compile)
    model = engine_for("qwen2").model
    aoti.build_package(model, Bucket.parse("t16-s2-m8"), tmp_path / "p.pt2", "cpu")
    ModelSteps(model, aoti.export_attention(model, "cpu"), compile_layers=True)
    assert built[0]["max_autotune_gemm"] is True
    assert len(compiled) == 2 and all(o["max_autotune_gemm"] is True for o in compiled)
