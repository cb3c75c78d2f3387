"""Converters for shape ops whose sizes real exports compute in the graph, where TVM's frontend wants
constants: `Pad` with pads from `Shape` arithmetic (constant, reflect, edge), `Squeeze` of an axis whose
size is symbolic. Both fall back to TVM's converter where the sizes are known at import."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, topi
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from .importer import OnnxOpConverter, register_converter

_PAD_MODES = {"constant", "reflect", "edge"}


def _static_rank(data) -> int:
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        raise ValueError("the input's rank is not known at import")
    return ty.ndim


def _as_int_list(value):
    """The ints of a constant or all-static shape value, else None."""
    if isinstance(value, tvm.ir.GenericConst):
        return [int(v) for v in value.value.numpy().reshape(-1)]
    if isinstance(value, relax.ShapeExpr) and all(isinstance(v, tvm.tirx.IntImm) for v in value.values):
        return [int(v) for v in value.values]
    return None


def _size_exprs(bb, value, prefix: str) -> list:
    """The elements of a 1-D int64 value (a ShapeExpr or a tensor computed in the graph) as PrimExprs."""
    if isinstance(value, relax.ShapeExpr):
        return list(value.values)
    if isinstance(value.ty, relax.ShapeType):
        value = bb.normalize(relax.op.shape_to_tensor(value))
    ty = value.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim != 1 or not isinstance(ty.shape, relax.ShapeExpr) \
            or not isinstance(ty.shape.values[0], tvm.tirx.IntImm):
        raise ValueError("the pads input must be a 1-D tensor of a length known at import")
    if str(ty.dtype) != "int64":
        value = bb.normalize(relax.op.astype(value, "int64"))
    length = int(ty.shape.values[0])
    return list(_tvm._tensor_to_shape_expr(bb, value, length, prefix).values)


@register_converter("Pad")
class Pad(OnnxOpConverter):
    """ONNX Pad (opsets 2-19) with pads and axes either constant (TVM's converter) or computed."""

    takes_shape_expr = True

    @classmethod
    def _impl_v2(cls, bb, inputs, attr, params):
        return _tvm.Pad._impl_v2(bb, inputs, attr, params)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._pad(bb, inputs, attr, params, _tvm.Pad._impl_v11)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return cls._pad(bb, inputs, attr, params, _tvm.Pad._impl_v18)

    @classmethod
    def _impl_v19(cls, bb, inputs, attr, params):
        return cls._pad(bb, inputs, attr, params, _tvm.Pad._impl_v19)

    @classmethod
    def _pad(cls, bb, inputs, attr, params, stock):
        mode = attr.get("mode", b"constant").decode()
        data = inputs[0]
        pads = _tvm.get_constant(inputs[1], params)
        axes = _tvm.get_constant(inputs[3], params) if len(inputs) > 3 and inputs[3] is not None else None
        static_pads = _as_int_list(pads)
        if static_pads is not None and (axes is None or _as_int_list(axes) is not None):
            # sizes known at import: TVM's converter (it reads pads as a constant)
            inputs = list(inputs)
            inputs[1] = relax.const(np.array(static_pads, "int64"))
            if axes is not None:
                inputs[3] = relax.const(np.array(_as_int_list(axes), "int64"))
            return stock(bb, _tvm.onnx_input(inputs), attr, params)
        if mode not in _PAD_MODES:
            raise ValueError(f"mode {mode!r} with computed pads is not supported (supported: "
                             f"{', '.join(sorted(_PAD_MODES))})")
        rank = _static_rank(data)
        exprs = _size_exprs(bb, pads, "pad")
        axis_list = list(range(rank)) if axes is None else _as_int_list(axes)
        if axis_list is None:
            raise ValueError("axes computed in the graph are not supported")
        axis_list = [a + rank if a < 0 else a for a in axis_list]
        if len(exprs) != 2 * len(axis_list):
            raise ValueError(f"pads has {len(exprs)} values, expected {2 * len(axis_list)} (2 x axes)")
        zero = tvm.tirx.IntImm("int64", 0)
        before, after = [zero] * rank, [zero] * rank
        for i, axis in enumerate(axis_list):
            before[axis], after[axis] = exprs[i], exprs[i + len(axis_list)]
        if mode == "constant":
            return bb.emit_te(topi.nn.pad, data, before, after, _pad_value(inputs, params))
        if mode == "reflect":
            return bb.emit_te(topi.nn.mirror_pad, data, before, after, "REFLECT")
        return bb.emit_te(topi.nn.replicate_pad, data, before, after)


def _pad_value(inputs, params) -> float:
    if len(inputs) < 3 or inputs[2] is None:
        return 0.0
    value = _tvm.get_constant(inputs[2], params)
    if not isinstance(value, tvm.ir.GenericConst):
        raise ValueError("a constant_value computed in the graph is not supported")
    return value.value.numpy().item()


@register_converter("Squeeze")
class Squeeze(OnnxOpConverter):
    """ONNX Squeeze; an axis whose size is symbolic is squeezed after a run-time check that it is 1."""

    takes_shape_expr = True

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        axes = attr.get("axes")
        return cls._squeeze(bb, inputs, attr, params, None if axes is None else list(axes), 1)

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        axes = _tvm.get_constant(inputs[1], params) if len(inputs) > 1 and inputs[1] is not None else None
        static_axes = None if axes is None else _as_int_list(axes)
        if axes is not None and static_axes is None:
            return _tvm.Squeeze._impl_v13(bb, inputs, attr, params)
        return cls._squeeze(bb, inputs, attr, params, static_axes, 13)

    @classmethod
    def _squeeze(cls, bb, inputs, attr, params, axes, version):
        data = inputs[0]
        ty = getattr(data, "ty", None)
        if axes is None or not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
            return _tvm.Squeeze.get_converter(version)(bb, inputs, attr, params)
        dims = list(ty.shape.values)
        axes = [a + len(dims) if a < 0 else a for a in axes]
        symbolic = [a for a in axes if not isinstance(dims[a], tvm.tirx.IntImm)]
        if not symbolic:
            return _tvm.Squeeze.get_converter(version)(bb, inputs, attr, params)
        for a in symbolic:
            dims[a] = tvm.tirx.IntImm("int64", 1)
        data = bb.match_cast(data, relax.TensorType(dims, ty.dtype))    # fails at run time unless 1
        return relax.op.squeeze(data, axes)
