"""tvmseq.tvm_fixes: TVMScript's macro-parser lookup and its decorators' stack walk without inspect's FrameInfo
scan. The same frames as inspect's, and TVMScript built through them (a macro in a prim_func, a prim_func in an
ir_module class, whose detection reads the decorator's source line) parses as before."""
from __future__ import annotations

import inspect

import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):
    pytest.skip("TVM runtime only: no TVMScript parser", allow_module_level=True)

import tvmseq.kernels  # noqa: E402,F401 - applies the fixes
from tvmseq import tvm_fixes  # noqa: E402


def test_fixes_are_installed():
    from tvm.script.parser.core.parser import ScriptMacro
    from tvm.tirx.script.parser import entry

    assert ScriptMacro._find_parser_def is tvm_fixes._find_parser_def
    assert isinstance(entry.inspect, tvm_fixes._InspectWithLazyStack)


def test_lazy_stack_has_inspects_frames_and_lines():
    def both():
        lazy = tvm_fixes._InspectWithLazyStack.stack()
        real = inspect.stack()
        return lazy, real

    lazy, real = both()
    assert len(lazy) == len(real)
    assert all(a.frame is b.frame for a, b in zip(lazy, real))
    # the first entry is `both` itself, at two different lines; every outer one is the same FrameInfo (the first
    # three as taken; the test function's own frame, lazy[1], has moved on since, and was taken at once)
    for a, b in zip(lazy[1:], real[1:]):
        assert (a.filename, a.lineno, a.function, a.code_context, a.index) == \
            (b.filename, b.lineno, b.function, b.code_context, b.index)


def test_macro_and_class_module_parse_through_the_fixes():
    from tvm.script import ir as I
    from tvm.script import tirx as T

    @T.macro
    def twice(buf, i):
        buf[i] = buf[i] * T.float32(2)

    @T.prim_func
    def scale(a: T.handle):
        A = T.match_buffer(a, (4,), "float32")
        for i in range(4):
            twice(A, i)

    assert "A[i] * T.float32(2.0)" in scale.script()

    @I.ir_module
    class Module:
        @T.prim_func
        def main(a: T.handle):
            A = T.match_buffer(a, (2,), "float32")
            A[0] = T.float32(1)

    assert [gv.name_hint for gv in Module.get_global_vars()] == ["main"]
