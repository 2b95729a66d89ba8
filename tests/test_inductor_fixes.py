"""The Inductor mends `compile.aoti.build_package` applies before each build."""

from itertools import count

import pytest

from boundgen.compile.inductor_fixes import keep_int_array_targets_alive

cpp_wrapper = pytest.importorskip("torch._inductor.codegen.cpp_wrapper_cpu")
IndentedBuffer = pytest.importorskip("torch._inductor.utils").IndentedBuffer


def _wrapper():
    """A C++ wrapper with only the state its int-array declarations use (a whole one needs a
    graph being lowered)."""
    from torch.utils._ordered_set import OrderedSet

    wrapper = cpp_wrapper.CppWrapperCpu.__new__(cpp_wrapper.CppWrapperCpu)
    wrapper.int_array_id = count()
    wrapper.declared_int_array_vars = OrderedSet()
    wrapper.codegen_int_array_var_cache = {}
    wrapper._int_array_writeline_targets = []  # where a torch carries the upstream fix
    return wrapper


def test_every_fresh_buffer_gets_its_int_array_declared():
    """The failure seen on the H200: a buffer freed, the next one at its address, and the array
    name handed back from the cache without its declaration (`int_array_188` not declared)."""
    keep_int_array_targets_alive()
    wrapper = _wrapper()
    for _ in range(64):
        buffer = IndentedBuffer()
        var = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
        assert f"{var}[] = {{2, 3}};" in buffer.getvalue()
        del buffer


def test_one_live_buffer_still_declares_an_array_once():
    keep_int_array_targets_alive()
    keep_int_array_targets_alive()  # applied before every build: once is enough
    wrapper = _wrapper()
    buffer = IndentedBuffer()
    first = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
    second = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
    assert first == second
    assert buffer.getvalue().count(f"{first}[] = {{2, 3}};") == 1
