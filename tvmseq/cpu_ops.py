"""Stock Relax ops that run as tvmseq CPU kernels on llvm (before legalization).

`relax.nn.softmax` over a static, contiguous last axis of float32 becomes `kernels.softmax.rows`: the rows
flattened, each in three vectorized passes with the polynomial exp (TVM's legalized softmax ran scalar with one
libm expf an element on rows of 6625 / 8210 classes: PP-OCR's and ddddocr's heads). Any other softmax (another
axis, float16, a symbolic row length) is left to TVM.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .cpu_layout import rewrite_functions
from .kernels.softmax.rows import PARALLEL_MIN_ELEMENTS, cpu_softmax_func

MIN_COLUMNS = 8      # shorter rows are left to TVM (a vector is 8-16 lanes)


@mutator
class _CpuOps(PyExprMutator):
    def __init__(self, mod, lanes: int):
        super().__init__(mod)
        self.softmax = tvm.ir.Op.get("relax.nn.softmax")
        self.lanes = lanes
        self.kernels = {}
        self.changed = 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.same_as(self.softmax):
            return self._softmax_rows(call)
        return call

    def _softmax_rows(self, call):
        (data,) = call.args
        ty = data.ty
        shape = getattr(ty, "shape", None)
        values = getattr(shape, "values", None)
        if values is None or str(ty.dtype) != "float32" or int(call.attrs.axis) not in (-1, len(values) - 1) \
                or not isinstance(values[-1], tvm.tirx.IntImm) or int(values[-1]) < MIN_COLUMNS:
            return call
        columns = int(values[-1])
        rows = math.prod(values[:-1]) if len(values) > 1 else tvm.tirx.IntImm("int64", 1)
        static_rows = int(rows) if isinstance(rows, (int, tvm.tirx.IntImm)) else None
        parallel = static_rows is None or static_rows * columns >= PARALLEL_MIN_ELEMENTS
        key = (columns, parallel)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(cpu_softmax_func(columns, self.lanes, parallel),
                                                       f"softmax_rows_{columns}")
        self.changed += 1
        flat = self.builder_.emit(relax.op.reshape(data, [rows, columns]))
        out = self.builder_.emit(relax.call_tir(self.kernels[key], [flat],
                                                relax.TensorType([rows, columns], "float32")))
        return relax.op.reshape(out, list(values))


def cpu_ops(mod: tvm.IRModule, lanes: int = 16) -> tvm.IRModule:
    """`mod` with the ops of the module doc replaced by tvmseq's CPU kernels; `mod` itself when none is."""
    return rewrite_functions(_CpuOps(mod, lanes), mod)


def cpu_ops_pass(target) -> tvm.transform.Pass:
    """`cpu_ops` as a module pass for an llvm `target` (vectors as wide as its SIMD registers)."""
    from .schedule_cpu import _lanes

    lanes = _lanes(target, "float32")
    return tvm.transform.module_pass(lambda mod, _ctx: cpu_ops(mod, lanes), opt_level=0, name="TvmseqCpuOps")
