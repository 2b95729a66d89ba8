"""`compile/bucket_autotune.py` (`BOUNDGEN_BUCKET_AUTOTUNE`): Inductor's GEMM autotuning for the
AOTInductor buckets only — off by default, part of the platform key when on, and handed to the
package build (not to the beam layers' `torch.compile`)."""

from __future__ import annotations

import pytest

from boundgen.compile import bucket_autotune
from boundgen.compile.cache import platform_info


def test_off_by_default_and_keyed_only_when_on(monkeypatch):
    assert bucket_autotune.mode() == "0"
    assert bucket_autotune.inductor_options() == {}
    assert "bucket_autotune" not in platform_info("cpu")  # off: the keys of the packages before
    monkeypatch.setattr(bucket_autotune, "MODE", "1")
    assert bucket_autotune.inductor_options() == {
        "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "ATEN,TRITON",
    }
    assert platform_info("cpu")["bucket_autotune"] == "1"
    monkeypatch.setattr(bucket_autotune, "MODE", "yes")
    with pytest.raises(ValueError, match="BOUNDGEN_BUCKET_AUTOTUNE='yes': choose one of 0, 1"):
        bucket_autotune.mode()


def test_a_package_build_autotunes_its_gemms_when_on(package_builds, monkeypatch):
    seen = []
    for mode in ("0", "1"):
        monkeypatch.setattr(bucket_autotune, "MODE", mode)
        seen.append(package_builds())
    assert "max_autotune_gemm" not in seen[0]
    assert seen[1]["max_autotune_gemm"] is True
    assert seen[1]["max_autotune_gemm_backends"] == "ATEN,TRITON"
