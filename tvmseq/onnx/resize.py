"""ONNX Upsample (opsets 7-9) and Resize of opset 10: scales only, the "asymmetric" coordinate transform.

PyTorch's exports at opset 9 write `nn.Upsample` as Upsample with its scales as an input, at opset 10 as a
Resize of that older form; TVM's converters take the scales of every Upsample from an attribute (opset 7's
form: an opset-9 node fails) and round its nearest neighbour to the closest source pixel (opset 7: wrong
values), and read a Resize of opset 10 as one of opset 11+ (its second input as the roi: it fails). All
three are one compute here (TVM's resize derives its scale from the output size: for a scale like 1.7 that is
not the node's), with onnxruntime's semantics:
  - output size floor(input size x scale) on every axis, in float32;
  - the source coordinate of output pixel x is x / scale ("asymmetric");
  - nearest: onnxruntime's "simple" rounding, the source pixel floor(x / scale) where an axis grows and
    ceil(x / scale) where it shrinks (so one rounding for all the axes resized: up, or down);
  - linear: between the two source pixels around min(x / scale, size - 1) on every axis resized (n-linear).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from .importer import OnnxOpConverter, register_converter

_MODES = ("nearest", "linear")


def _constant_scales(value, params) -> list[float]:
    scales = _tvm.get_constant(value, params)
    if not isinstance(scales, tvm.ir.GenericConst):
        raise ValueError("scales computed in the graph are not supported (a constant is)")
    return [float(v) for v in scales.value.numpy().reshape(-1)]


def _resized(bb, data, scales: list[float], attr, params):
    """`data` resized by constant `scales` with Upsample's semantics (module doc)."""
    mode = attr.get("mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} is not supported ({' or '.join(_MODES)})")
    rank = data.ty.ndim
    if len(scales) != rank:
        raise ValueError(f"{len(scales)} scales for an input of rank {rank}")
    if any(not s > 0 for s in scales):
        raise ValueError(f"scales must be positive, got {scales}")
    spatial = [s for s in scales if s != 1]
    if mode == "nearest" and spatial and min(spatial) < 1 < max(spatial):
        raise ValueError("nearest resizing that grows some axes and shrinks others is not supported")
    compute = _nearest if mode == "nearest" else _linear
    scales = [np.float32(s) for s in scales]
    return bb.emit_te(lambda x: compute(x, scales), data, primfunc_name_hint="upsample_" + mode)


def _out_dim(dim, scale):
    """floor(dim x scale) in float32, as onnxruntime computes it."""
    if isinstance(dim, tvm.tirx.IntImm):
        return tvm.tirx.IntImm(str(dim.ty), int(np.float32(dim.value) * scale))
    return tvm.tirx.Cast(str(dim.ty), tvm.tirx.floor(tvm.tirx.Cast("float32", dim) * tvm.tirx.const(scale, "float32")))


def _source(index, scale):
    """The float32 source coordinate index / scale of an output index ("asymmetric")."""
    return tvm.tirx.Cast("float32", index) / tvm.tirx.const(scale, "float32")


def _nearest(data, scales):
    dims = list(data.shape)
    grows = any(s > 1 for s in scales)
    rounded = tvm.tirx.floor if grows or all(s == 1 for s in scales) else tvm.tirx.ceil

    def pick(*idx):
        src = [i if s == 1 else tvm.tirx.min(tvm.tirx.Cast(str(i.ty), rounded(_source(i, s))), d - 1)
               for i, s, d in zip(idx, scales, dims)]
        return data(*src)

    return te.compute([_out_dim(d, s) for d, s in zip(dims, scales)], pick, name="upsample_nearest")


def _linear(data, scales):
    dims = list(data.shape)
    resized = [a for a, s in enumerate(scales) if s != 1]

    def corner_terms(idx):
        """(source index tuple, weight) of the 2^k corners around idx's source point."""
        terms = [(list(idx), tvm.tirx.const(1.0, "float32"))]
        for a in resized:
            c = tvm.tirx.min(_source(idx[a], scales[a]), tvm.tirx.Cast("float32", dims[a] - 1))
            i0 = tvm.tirx.Cast(str(idx[a].ty), tvm.tirx.floor(c))
            i1 = tvm.tirx.min(i0 + 1, dims[a] - 1)
            w1 = c - tvm.tirx.Cast("float32", i0)
            terms = [(t[:a] + [i] + t[a + 1:], w * wi) for t, w in terms for i, wi in ((i0, 1 - w1), (i1, w1))]
        return terms

    def blend(*idx):
        total = None
        for src, w in corner_terms(idx):
            term = tvm.tirx.Cast("float32", data(*src)) * w
            total = term if total is None else total + term
        return tvm.tirx.Cast(data.dtype, total)

    return te.compute([_out_dim(d, s) for d, s in zip(dims, scales)], blend, name="upsample_linear")


@register_converter("Upsample")
class Upsample(OnnxOpConverter):
    """ONNX Upsample: scales an attribute (opset 7), an input (opsets 9-10)."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        if "scales" not in attr:
            raise ValueError("the scales attribute is missing")
        return cls._upsample(bb, inputs[0], [float(s) for s in attr["scales"]], attr, params)

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return cls._upsample(bb, inputs[0], _constant_scales(inputs[1], params), attr, params)

    @classmethod
    def _upsample(cls, bb, data, scales, attr, params):
        if min(scales) < 1:
            raise ValueError(f"Upsample's scales must be at least 1, got {scales} (Resize shrinks)")
        return _resized(bb, data, scales, attr, params)


@register_converter("Resize")
class Resize(OnnxOpConverter):
    """ONNX Resize: opset 10 here (X, scales), opset 11+ TVM's converter."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        return _resized(bb, inputs[0], _constant_scales(inputs[1], params), attr, params)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return _tvm.Resize._impl_v18(bb, inputs, attr, params)
