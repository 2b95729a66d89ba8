"""Shared fixtures: tiny synthetic HF checkpoints made once per test session (never downloaded)."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels (`attention.segments`) run in Triton's CPU interpreter. Triton reads
# the flag when it and the kernels are imported, so it is set before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import settings

from boundgen.checkpoints import make_model

# Property tests draw the same examples on every run (no flaky CI), with no example database on
# disk.
settings.register_profile("boundgen", derandomize=True, database=None, deadline=None)
settings.load_profile("boundgen")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch="qwen2", seq_cls=None) → path of a tiny checkpoint (cached for the
    session)."""
    made = {}

    def get(arch: str = "qwen2", seq_cls: int | None = None):
        key = (arch, seq_cls)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{seq_cls or 'lm'}")
            made[key] = make_model(
                "tiny", out, arch=arch, seq_cls=seq_cls, seed=0, progress=False, overwrite=True
            )
        return made[key]

    return get


@pytest.fixture(scope="session")
def engine_for(tiny_model):
    """engine_for(arch, seq_cls=None) → a CPU float32 Engine over the tiny checkpoint (cached)."""
    from boundgen import Engine

    made = {}

    def get(arch: str = "qwen2", seq_cls: int | None = None):
        key = (arch, seq_cls)
        if key not in made:
            made[key] = Engine.from_pretrained(
                tiny_model(arch, seq_cls), device="cpu", dtype="float32"
            )
        return made[key]

    return get


@pytest.fixture
def package_builds(engine_for, tmp_path, monkeypatch):
    """package_builds() → the Inductor config each `aoti.build_package` of the tiny qwen2 model's
    `t16-s2-m8` bucket hands AOTInductor (its compile replaced by a stub that writes a dummy
    file): a build per call, in the switches' state at the call."""
    from boundgen.compile import aoti
    from boundgen.compile.buckets import Bucket

    seen = []

    def fake_compile(ep, package_path, inductor_configs):
        seen.append(dict(inductor_configs))
        with open(package_path, "wb") as f:
            f.write(b"not a package")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    model = engine_for("qwen2").model

    def build() -> dict:
        path = tmp_path / f"package-{len(seen)}.pt2"
        aoti.build_package(model, Bucket.parse("t16-s2-m8"), path, "cpu")
        return seen[-1]

    return build


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # a test process builds many models, and each is a new set of guards on the compiled
        # layer functions that every model shares (`compile.decode.ModelSteps`; the engine
        # compiles one model a process): past Dynamo's 8 a `fullgraph` function fails. Which
        # tests share an xdist worker decides whether one reaches it (three search tests did on
        # an H100 under `-n 4`, fifty-second session).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
