"""A Relax pass for constants with no elements, which TVM cannot export.

An ONNX initializer of shape [1, 0, 4] (a decoder's empty cache before the first step of a Loop) becomes a Relax
constant of 0 bytes; TVM writes constants into the exported library and fails to read one of 0 bytes back
("Invalid DLTensor file format" when the .so loads; compiled in-process the model ran). `pass_()` replaces each by
a zero-size allocation. It runs after CallTIRRewrite, where every allocation is an `R.builtin.alloc_tensor`, and
before memory planning: both pipelines (tvmseq.schedule_gpu.pipeline, tvmseq.tune.model.relax_pipeline) put it
between TVM's dataflow-lowering and finalizing passes.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


def _is_empty(expr) -> bool:
    """A tensor constant of no elements (a GenericConst also holds dtypes and strings: those are not)."""
    value = getattr(expr, "value", None) if isinstance(expr, tvm.ir.GenericConst) else None
    return isinstance(value, tvm.runtime.Tensor) and int(np.prod(value.shape)) == 0


@mutator
class _Empty(PyExprMutator):
    def visit_generic_const_(self, const):
        if not _is_empty(const):
            return const
        return relax.op.builtin.alloc_tensor(relax.ShapeExpr([int(d) for d in const.value.shape]),
                                             str(const.value.dtype), 0)


def _rewrite(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    if not any(isinstance(f, relax.Function) and _has_empty(f) for f in mod.functions.values()):
        return mod
    empty = _Empty(mod)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            empty.builder_.update_func(gv, empty.visit_expr(func))
    return empty.builder_.get()


def _has_empty(func) -> bool:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if _is_empty(e) else None)
    return bool(found)


def pass_() -> tvm.transform.Pass:
    return tvm.transform.module_pass(_rewrite, opt_level=0, name="TvmseqEmptyConstants")
