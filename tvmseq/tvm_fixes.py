"""Work-arounds for TVM 0.27 behaviour that costs tvmseq time, applied once when tvmseq's kernels are imported
(`apply`); nothing here changes what TVM builds.

* `ScriptMacro._find_parser_def` (tvm.script.parser.core.parser) finds the parser of a TVMScript macro call through
  `inspect.getouterframes`, which builds a FrameInfo for every frame of the stack: each reads the frame's source
  file and lines, and `inspect.getmodule` scans all of sys.modules for a file that is no module's (TVMScript's own
  evaluated code). tvmseq's kernels are macros calling macros, so that scan ran ~20,000 times for one LSTM
  recurrence (building it took 3.8-9 s, 70% of it there) and ~32,000 times for one wmma projection schedule
  (109 s). The replacement walks the same frames, innermost first, through `f_back` and reads only their globals.
* The `@T.prim_func`, `@I.ir_module` and `@R.function` decorators take `inspect.stack()` (a FrameInfo of every
  frame, the same scan) to look at the third frame's source line and, with string annotations only, at frames'
  locals. Every prim_func defined in a function pays it at each call: TVM's own tensor intrinsics (a wmma
  projection schedule parses ~500: 65 s of its 85 s), and each tvmseq kernel builder. `_LazyStack` gives them the
  same frames, each FrameInfo built when an entry's source line is read.
"""
from __future__ import annotations

import inspect

_applied = False


def _find_parser_def(self):
    # ScriptMacro._find_parser_def: the first frame, from this one outwards, whose globals hold the parser
    from tvm.script.parser.core.parser import ScriptMacro

    frame = inspect.currentframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


class _LazyFrame:
    """One entry of `_LazyStack`: .frame at once, the rest of inspect.FrameInfo (source file, line, context) built
    on first use."""

    __slots__ = ("frame", "_context", "_info")

    def __init__(self, frame, context: int):
        self.frame, self._context, self._info = frame, context, None

    def __getattr__(self, name):
        if self._info is None:
            self._info = inspect.FrameInfo(self.frame, *inspect.getframeinfo(self.frame, self._context))
        return getattr(self._info, name)


class _LazyStack:
    """What `inspect.stack(context)` returns (the caller's frame outwards) as a sequence of `_LazyFrame`, the first
    EAGER of them with their FrameInfo taken at once: the decorators read the source line of the third, which must
    be where that frame stood when the stack was taken (a running frame's line moves on)."""

    EAGER = 3

    def __init__(self, entries: list):
        self._entries = entries

    @classmethod
    def of(cls, frames: list, context: int) -> "_LazyStack":
        entries = [_LazyFrame(f, context) for f in frames]
        for entry in entries[:cls.EAGER]:
            entry.lineno    # noqa: B018 - builds its FrameInfo now
        return cls(entries)

    def __len__(self):
        return len(self._entries)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return _LazyStack(self._entries[index])
        return self._entries[index]

    def __iter__(self):
        return iter(self._entries)


class _InspectWithLazyStack:
    """The `inspect` module as the TVMScript decorators' modules see it: `stack` lazy, everything else inspect's."""

    def __getattr__(self, name):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1):
        frame, frames = inspect.currentframe().f_back, []   # from stack()'s caller outwards, as inspect.stack
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return _LazyStack.of(frames, context)


# the modules whose decorators call inspect.stack()
_STACK_USERS = ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry")


def apply() -> None:
    """Install the work-arounds (no-op without TVM's script parser, e.g. TVM's runtime only)."""
    global _applied
    if _applied:
        return
    try:
        from tvm.script.parser.core.parser import ScriptMacro
    except ImportError:
        return
    import importlib

    ScriptMacro._find_parser_def = _find_parser_def
    for name in _STACK_USERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "inspect", None) is inspect:
            module.inspect = _InspectWithLazyStack()
    _applied = True
