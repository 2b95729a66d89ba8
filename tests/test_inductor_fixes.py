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


def _keyed_on_the_writeline(self, int_array, writeline, known_statically=False, graph=None):
    """torch 2.11's `codegen_int_array_var` (its source printed on the device, 2026-12-05): the
    cache keyed on the `id()` of the bound `writeline` itself, where this torch keys on its
    buffer."""
    cache_key = (int_array, id(writeline), known_statically, id(graph) if graph else None)
    if cache_key not in self.codegen_int_array_var_cache:
        self.codegen_int_array_var_cache[cache_key] = self._codegen_int_array_var_impl(
            int_array, writeline, known_statically
        )
    return self.codegen_int_array_var_cache[cache_key]


@pytest.fixture(params=["this torch", "torch 2.11"])
def keying(request, monkeypatch):
    """Each test under this torch's cache key and under 2.11's, the mend applied on top."""
    if request.param == "torch 2.11":
        monkeypatch.setattr(
            cpp_wrapper.CppWrapperCpu, "codegen_int_array_var", _keyed_on_the_writeline
        )
    else:  # (the mend replaces the method: put the original back after the test either way)
        original = cpp_wrapper.CppWrapperCpu.codegen_int_array_var
        monkeypatch.setattr(cpp_wrapper.CppWrapperCpu, "codegen_int_array_var", original)
    return request.param


def test_every_fresh_buffer_gets_its_int_array_declared(keying):
    """The failure seen on the H200: a buffer freed, the next one at its address, and the array
    name handed back from the cache without its declaration (`int_array_188` not declared)."""
    keep_int_array_targets_alive()
    wrapper = _wrapper()
    for _ in range(64):
        buffer = IndentedBuffer()
        var = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
        assert f"{var}[] = {{2, 3}};" in buffer.getvalue()
        del buffer


def test_one_live_buffer_still_declares_an_array_once(keying):
    """The cache still works: the same array written twice into one buffer, each time through a
    new bound `writeline` as Inductor hands it, is declared once (under 2.11's key too, which
    the twenty-sixth session's mend missed: a second declaration every call, on an H100)."""
    keep_int_array_targets_alive()
    keep_int_array_targets_alive()  # applied before every build: once is enough
    wrapper = _wrapper()
    buffer = IndentedBuffer()
    first = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
    second = wrapper.codegen_int_array_var("{2, 3}", buffer.writeline)
    assert first == second
    assert buffer.getvalue().count(f"{first}[] = {{2, 3}};") == 1


def test_a_writeline_that_is_no_python_method_still_declares(keying):
    """Any callable may be handed in as the `writeline`: a builtin's bound method (an owner,
    no `__func__`) writes its declaration as a buffer's method does."""
    keep_int_array_targets_alive()
    wrapper = _wrapper()
    lines = []
    var = wrapper.codegen_int_array_var("{2, 3}", lines.append)
    assert f"{var}[] = {{2, 3}};" in "\n".join(lines)
