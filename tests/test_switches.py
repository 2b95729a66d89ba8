"""`settings.switched`: the process-wide kernel switches' A/B context (a module global set inside
the block, restored after it, also when the block raises), as each module's own switch uses it;
and a bad value of a switch read from the environment named (`settings.env_choice`)."""

from __future__ import annotations

import pytest

from boundgen import settings, trie_select
from boundgen.models import layer_kernel, stream, stream_gated, stream_qkv


def test_the_switch_is_set_inside_and_restored_after_a_raise():
    space = {"MODE": "a"}
    with settings.switched(space, "MODE", "b"):
        assert space["MODE"] == "b"
    assert space["MODE"] == "a"
    with pytest.raises(RuntimeError), settings.switched(space, "MODE", "c"):
        assert space["MODE"] == "c"
        raise RuntimeError
    assert space["MODE"] == "a"


@pytest.mark.parametrize(
    ("module", "name", "switch", "value"),
    [
        (trie_select, "ENABLED", trie_select.enabled, False),
        (stream, "MAX_ROWS", stream.rows_up_to, 9),
        (stream_gated, "GATED", stream_gated.enabled, False),
        (stream_qkv, "ROTATED", stream_qkv.enabled, False),
        (layer_kernel, "MAX_ROWS", layer_kernel.rows_up_to, 5),
    ],
)
def test_each_kernel_switch_sets_its_own_module_global(module, name, switch, value):
    before = getattr(module, name)
    with switch(value):
        assert getattr(module, name) == value
    assert getattr(module, name) == before


def test_a_bad_value_names_the_variable_and_the_choices():
    # every `BOUNDGEN_*` choice read from the environment is checked so (`settings.env_choice`)
    with pytest.raises(ValueError, match="BOUNDGEN_X='nope': choose one of a, b"):
        settings.env_choice("BOUNDGEN_X", "nope", ("a", "b"))
    assert settings.env_choice("BOUNDGEN_X", "b", ("a", "b")) == "b"
