"""`settings.switched`: the process-wide kernel switches' A/B context (a module global set inside
the block, restored after it, also when the block raises), as each module's own switch uses it;
and the switches read from the environment that change what a compiled artifact holds
(`settings.env_choice`): their defaults, their part in the artifacts' platform key, a bad value
named."""

from __future__ import annotations

import os
from types import ModuleType
from typing import NamedTuple

import pytest

from boundgen import settings, trie_select
from boundgen.compile.cache import platform_info
from boundgen.models import decoder, layer_kernel, layers, stream, stream_gated, stream_qkv


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


class Keyed(NamedTuple):
    """A switch read from the environment whose value a compiled artifact holds: `old` is the
    value the packages built before it were built with (left out of the platform key), `new` one
    the key records under `key`."""

    env: str
    module: ModuleType
    name: str
    choices: tuple[str, ...]
    default: str
    old: str
    new: str
    key: str


KEYED = [
    Keyed("BOUNDGEN_QK_ROTATION", decoder, "QK_ROTATION", decoder.QK_ROTATIONS, "together",
          "apart", "together", "qk_rotation"),
    Keyed("BOUNDGEN_ROPE_FORM", layers, "ROPE_FORM", layers.ROPE_FORMS, "cat", "cat", "flip",
          "rope_form"),
]  # fmt: skip


@pytest.mark.parametrize("switch", KEYED, ids=lambda k: k.env)
def test_a_keyed_switch_defaults_as_documented(switch):
    assert getattr(switch.module, switch.name) == os.environ.get(switch.env, switch.default)
    assert switch.default in switch.choices


@pytest.mark.parametrize("switch", KEYED, ids=lambda k: k.env)
def test_a_keyed_switch_is_in_the_platform_key_only_off_its_old_value(switch, monkeypatch):
    monkeypatch.setattr(switch.module, switch.name, switch.old)
    assert switch.key not in platform_info("cpu")  # the keys of the packages built before it
    monkeypatch.setattr(switch.module, switch.name, switch.new)
    assert platform_info("cpu")[switch.key] == switch.new


@pytest.mark.parametrize("switch", KEYED, ids=lambda k: k.env)
def test_a_bad_value_names_the_variable_and_the_choices(switch):
    named = f"{switch.env}='nope': choose one of {', '.join(switch.choices)}"
    with pytest.raises(ValueError, match=named):
        settings.env_choice(switch.env, "nope", switch.choices)
