"""Stock Relax ops that run as tvmseq CPU kernels on llvm (before legalization).

`relax.nn.softmax` over a static, contiguous last axis of float32 becomes `kernels.softmax.rows`: the rows
flattened, each in three vectorized passes with the polynomial exp (TVM's legalized softmax ran scalar with one
libm expf an element on rows of 6625 / 8210 classes: PP-OCR's and ddddocr's heads). Any other softmax (another
axis, float16, a symbolic row length) is left to TVM.

float32 sigmoid, tanh and exp become TE ops on the CPU recurrences' activations (`gru.cpu_activation`: sigmoid and
tanh as rational functions; `gru.fast_exp`, a polynomial exp; arithmetic only, so they vectorize), which fuse with
their neighbours as TVM's ops did; TVM's lowering called libm's expf an element, scalar (ddddocr's conv epilogues with
a SiLU: 0.2 -> 0.04 ms each on 2 cores).

Integer contractions (ConvInteger / MatMulInteger as `tvmseq.onnx.quantized` imports them: int8/int16 operands,
int32 sums) with a constant weight become `kernels.integer.pairs` on an x86 target with AVX512BW or AVX2 (the
same kernels on 256-bit vectors): a dense NCHW conv2d takes its data padded, in channel pairs ([N, C/2, H, W, 2],
made by `pairs.image_pairs_func`) and its weight packed once; a matmul [..., M, K] x [K, N] runs as the 1 x 1 conv
of N channels over M columns (its rows paired and its result transposed back by two TE ops), or, where A is uint8
less a scalar zero point and the target has VNNI, on `kernels.integer.quads`. Sums bit-identical to the int32 products they replace (each pair's products
exact in int16 x int16, wrapped in int32 like any int32 sum).
"""
from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .cpu_layout import rewrite_functions
from .kernels.integer import pairs, quads
from .kernels.softmax.rows import PARALLEL_MIN_ELEMENTS, cpu_softmax_func

MIN_COLUMNS = 8      # shorter rows are left to TVM (a vector is 8-16 lanes)


@mutator
class _CpuOps(PyExprMutator):
    def __init__(self, mod, lanes: int, int_pairs: str | None):
        super().__init__(mod)
        self.softmax = tvm.ir.Op.get("relax.nn.softmax")
        self.conv2d = tvm.ir.Op.get("relax.nn.conv2d")
        self.matmul = tvm.ir.Op.get("relax.matmul")
        self.subtract = tvm.ir.Op.get("relax.subtract")
        self.astype = tvm.ir.Op.get("relax.astype")
        self.activations = {tvm.ir.Op.get(f"relax.{name}"): name for name in ("sigmoid", "tanh", "exp")}
        self.lanes = lanes
        self.int_pairs = int_pairs     # "vnni", "avx512bw", "avx2" or None (no integer kernels)
        self.kernels = {}
        self.changed = 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.same_as(self.softmax):
            return self._softmax_rows(call)
        if call.op in self.activations and str(getattr(call.ty, "dtype", "")) == "float32":
            self.changed += 1
            name = self.activations[call.op]
            return self.builder_.call_te(_fast_activation, call.args[0], name, primfunc_name_hint=name)
        if self.int_pairs and call.op.same_as(self.conv2d):
            return self._pair_conv(call)
        if self.int_pairs and call.op.same_as(self.matmul):
            return self._pair_matmul(call)
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
            self.kernels[key] = self._add_kernel(cpu_softmax_func(columns, self.lanes, parallel),
                                                 f"softmax_rows_{columns}")
        self.changed += 1
        flat = self.builder_.emit(relax.op.reshape(data, [rows, columns]))
        out = self.builder_.emit(relax.call_tir(self.kernels[key], [flat],
                                                relax.TensorType([rows, columns], "float32")))
        return relax.op.reshape(out, list(values))

    # ---- integer contractions ---------------------------------------------------------------------
    def _pair_conv(self, call):
        data, weight = call.args
        a = call.attrs
        w = _int_constant(weight)
        if w is None or not _int_operand(data) or str(call.ty.dtype) != "int32" or w.ndim != 4 \
                or int(a.groups) != 1 or (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != \
                ("NCHW", "OIHW", "NCHW") or not isinstance(data.ty.shape.values[1], tvm.tirx.IntImm):
            return call
        O, C, KH, KW = w.shape
        top, left, bottom, right = (int(p) for p in a.padding)
        paired = self._channel_pairs(data, C, [top, bottom, left, right])
        kernel = self._pair_kernel(C, O, KH, KW, tuple(int(v) for v in a.strides), tuple(int(v) for v in a.dilation))
        return self._pair_call(kernel, paired, w, call.ty)

    def _pair_matmul(self, call):
        a, b = call.args
        w = _int_constant(b)
        shape = getattr(a.ty, "shape", None)
        if w is None or w.ndim != 2 or not _int_operand(a) or str(call.ty.dtype) != "int32" or shape is None \
                or len(shape.values) < 2 or not isinstance(shape.values[-1], tvm.tirx.IntImm):
            return call
        K, N = w.shape
        if self.int_pairs == "vnni":
            quad = self._quad_matmul(call, a, w)
            if quad is not None:
                return quad
        kernel = self._pair_kernel(K, N, 1, 1, (1, 1), (1, 1))
        # the rows of a as the columns of a 1 x 1 conv's image (one TE op each way: Relax's reshapes of a symbolic
        # row count failed RewriteDataflowReshape)
        paired = self.builder_.emit_te(_rows_as_pairs, a, pairs.pair_count(K), primfunc_name_hint="rows_as_pairs")
        out = self._pair_call(kernel, paired, w.T.reshape(N, K, 1, 1),
                              relax.TensorType([1, N, 1, paired.ty.shape.values[3]], "int32"))
        return self.builder_.emit_te(_columns_as_rows, self.builder_.emit(out), list(call.ty.shape.values),
                                     primfunc_name_hint="columns_as_rows")

    def _quad_matmul(self, call, a, w):
        """a = uint8 x (less a scalar zero point z) times the constant centered w: sum x * w8 on `quads` plus
        shift[n] * sum_k x - z * sum_k w[k, n] (exact in int32), or None where a is not so made or w does not shift
        into int8 (module doc of `kernels.integer.quads`)."""
        K, N = w.shape
        source = None if K % quads.QUAD else self._uint8_source(a)
        shifted = None if source is None else quads.shifted_int8(w)   # a pass over the weight: only when used
        if shifted is None:
            return None
        x, zero_point = source
        w8, shift = shifted
        lead = list(x.ty.shape.values[:-1])
        rows = math.prod(lead)
        x2 = self.builder_.emit(relax.op.reshape(x, [rows, K]))
        key = ("quads", K, N)
        tile = pairs.PairTile.for_channels(N)
        if key not in self.kernels:
            self.kernels[key] = self._add_kernel(quads.u8s8_matmul_func(K, N, tile.vectors, tile.columns),
                                                 f"u8s8_matmul_{K}_{N}")
        self.changed += 1
        packed = relax.const(quads.pack_quads(w8, tile.vectors))
        product = self.builder_.emit(relax.call_tir(self.kernels[key], [x2, packed],
                                                    relax.TensorType([rows, N], "int32")))
        row_sums = relax.op.sum(relax.op.astype(x2, "int32"), axis=[1], keepdims=True)
        out = relax.op.add(product, relax.op.multiply(row_sums, relax.const(shift.astype(np.int32))))
        if zero_point is not None:
            column_sums = w.astype(np.int64).sum(axis=0).astype(np.int32)   # wraps as the int32 sums do
            out = relax.op.subtract(out, relax.op.multiply(relax.op.astype(zero_point, "int32"),
                                                           relax.const(column_sums)))
        return relax.op.reshape(self.builder_.emit(out), list(call.ty.shape.values))

    def _uint8_source(self, a):
        """(x, z) when a is uint8 x itself (z None) or astype(x, int16) - z with z of one element, else None."""
        if str(a.ty.dtype) == "uint8":
            return a, None
        value = self._bound(a)
        if not (isinstance(value, relax.Call) and value.op.same_as(self.subtract)):
            return None
        lhs, zero_point = (self._bound(v) for v in value.args)
        if not (isinstance(lhs, relax.Call) and lhs.op.same_as(self.astype)
                and str(lhs.args[0].ty.dtype) == "uint8"):
            return None
        z_shape = getattr(zero_point.ty, "shape", None)
        if z_shape is None or any(not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1) for d in z_shape.values):
            return None
        return lhs.args[0], value.args[1]

    def _bound(self, expr):
        """The value a dataflow variable is bound to (itself when it is none)."""
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        return expr if value is None else value

    def _channel_pairs(self, data, C: int, pads):
        """data [N, C, H, W] (8/16-bit integers) -> int16 [N, ceil(C/2), H + pads, W + pads, 2], the kernel's layout
        (`pairs.image_pairs_func`; pads: top, bottom, left, right)."""
        dtype = str(data.ty.dtype)
        key = ("image_pairs", C, tuple(pads), dtype)
        if key not in self.kernels:
            self.kernels[key] = self._add_kernel(pairs.image_pairs_func(C, pads, dtype), f"image_pairs_{C}")
        N, _, H, W = data.ty.shape.values
        top, bottom, left, right = pads
        return self.builder_.emit(relax.call_tir(
            self.kernels[key], [data],
            relax.TensorType([N, pairs.pair_count(C), H + top + bottom, W + left + right, 2], "int16")))

    def _pair_kernel(self, C, O, KH, KW, strides, dilation):
        key = ("pairs", C, O, KH, KW, strides, dilation)
        if key not in self.kernels:
            func = pairs.pair_conv2d_func(C, O, KH, KW, strides, dilation, isa=self.int_pairs)
            self.kernels[key] = self._add_kernel(func, f"pair_conv_{C}_{O}_{KH}x{KW}")
        return self.kernels[key]

    def _add_kernel(self, func, name: str):
        """func added under a global symbol of its own (several shapes of one kernel may be in a module)."""
        gv = self.builder_.add_func(func, name)
        self.builder_.update_func(gv, func.with_attr("global_symbol", gv.name_hint))
        return gv

    def _pair_call(self, kernel, paired, weight, out_ty):
        self.changed += 1
        packed = relax.const(pairs.pack_weight(weight, pairs.PairTile.for_channels(weight.shape[0], self.int_pairs)))
        return relax.call_tir(kernel, [paired, packed], relax.TensorType(out_ty.shape, "int32"))


_INT_DTYPES = ("int8", "uint8", "int16")


def _fast_activation(x, name: str):
    """sigmoid / tanh / exp of a float32 tensor as the CPU recurrences compute them (arithmetic only, so it
    vectorizes; TVM's calls libm's expf an element)."""
    from tvm import te

    from .kernels.activations import Activation
    from .kernels.recurrent.gru import cpu_activation, fast_exp

    f = fast_exp if name == "exp" else cpu_activation(Activation.make(name))
    return te.compute(x.shape, lambda *i: f(x(*i)), name=name)


def _rows_as_pairs(a, cp: int):
    """a [d0, .., M, K] -> int16 [1, ceil(K/2), 1, d0 x .. x M, 2] (zero past K)."""
    from tvm import te, tirx

    *lead, K = a.shape
    rows = 1
    for d in lead:
        rows = rows * d

    def value(_n, p, _y, m, e):
        index, rest = [], m
        for d in reversed(lead):
            index.append(rest % d)
            rest = rest // d
        k = 2 * p + e
        return tirx.if_then_else(k < K, a[(*reversed(index), tirx.min(k, K - 1))].astype("int16"),
                                 tirx.const(0, "int16"))

    return te.compute((1, cp, 1, rows, 2), value, name="pairs")


def _columns_as_rows(out, shape):
    """[1, N, 1, M] -> shape [d0, .., N] with M = d0 x .. (the rows back in the matmul's order)."""
    from tvm import te

    lead = shape[:-1]

    def value(*i):
        m = 0
        for d, v in zip(lead, i[:-1]):
            m = m * d + v
        return out[0, i[-1], 0, m]

    return te.compute(shape, value, name="rows")


def _int_operand(expr) -> bool:
    return str(getattr(expr.ty, "dtype", "")) in _INT_DTYPES


def _int_constant(expr) -> np.ndarray | None:
    """A constant 8/16-bit integer operand's value, else None (a weight passed in, or wider)."""
    if isinstance(expr, tvm.ir.GenericConst) and str(expr.value.dtype) in _INT_DTYPES:
        return expr.value.numpy()
    return None


def _int_pairs(target) -> str | None:
    """Which pair instructions the llvm target has: "vnni" (vpdpwssd), "avx512bw" (vpmaddwd), "avx2" (vpmaddwd on
    256-bit vectors), or None (`pairs.ISA_LANES`)."""
    from tvm.target import codegen

    if target.kind.name != "llvm":
        return None
    if codegen.target_has_features("avx512bw", target):
        return "vnni" if codegen.target_has_features("avx512vnni", target) else "avx512bw"
    return "avx2" if codegen.target_has_features("avx2", target) else None


def cpu_ops(mod: tvm.IRModule, lanes: int = 16, int_pairs: str | None = None) -> tvm.IRModule:
    """`mod` with the ops of the module doc replaced by tvmseq's CPU kernels; `mod` itself when none is."""
    return rewrite_functions(_CpuOps(mod, lanes, int_pairs), mod)


def cpu_ops_pass(target) -> tvm.transform.Pass:
    """`cpu_ops` as a module pass for an llvm `target` (vectors as wide as its SIMD registers)."""
    from .schedule_cpu import vector_lanes

    lanes, int_pairs = vector_lanes(target, "float32"), _int_pairs(target)
    return tvm.transform.module_pass(lambda mod, _ctx: cpu_ops(mod, lanes, int_pairs), opt_level=0,
                                     name="TvmseqCpuOps")
