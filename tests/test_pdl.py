"""`compile/pdl.py` (`BOUNDGEN_PDL`): programmatic dependent launch for Inductor's kernels in the
`torch.compile` paths — off by default, handed to the beam layers' compile when on, an error
naming the variable on a bad value. (Its GPU proof: `test_compile_gpu.py`.)"""

from __future__ import annotations

import pytest
import torch

from boundgen.compile import pdl


def test_off_by_default_and_an_inductor_option_when_on(monkeypatch):
    assert pdl.mode() == "0"
    assert pdl.inductor_options() == {}
    monkeypatch.setattr(pdl, "MODE", "1")
    assert pdl.inductor_options() == {"triton.enable_pdl": True}
    monkeypatch.setattr(pdl, "MODE", "on")
    with pytest.raises(ValueError, match="BOUNDGEN_PDL='on': choose one of 0, 1"):
        pdl.mode()


def test_the_beam_layers_compile_with_it(monkeypatch, tiny_model):
    from boundgen import Engine
    from boundgen.compile.decode import ModelSteps

    engine = Engine.from_pretrained(tiny_model("qwen2"), device="cpu", backend="eager")
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options")) or fn)
    for mode in ("0", "1"):
        monkeypatch.setattr(pdl, "MODE", mode)
        ModelSteps(engine.model, engine.model.backend, compile_layers=True)
    assert [o and o.get("triton.enable_pdl") for o in seen] == [None, None, True, True]
