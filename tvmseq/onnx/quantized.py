"""onnxruntime's int8 quantization (chiefly what `onnxruntime.quantization.quantize_dynamic` writes) onto
tvmseq's kernels.

A dynamically quantized model stores its weights as int8/uint8 with a scale and a zero point and
quantizes activations to uint8 at run time, from their own range:
  - com.microsoft::DynamicQuantizeLSTM: an LSTM whose W [D, I, 4H] and R [D, H, 4H] (transposed against
    ONNX LSTM's [D, 4H, I]) are int8/uint8, with scale and zero point per direction ([D]) or per column
    ([D, 4H]);
  - DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul for a MatMul, ConvInteger for a Conv, and the
    fused com.microsoft ops onnxruntime's optimizer makes of them (DynamicQuantizeMatMul,
    MatMulIntegerToFloat).

How tvmseq imports them:
  - DynamicQuantizeLSTM: W and R are dequantized at import, W_f = (W - zero_point) * scale, into float32
    constants of ONNX LSTM's layout, and the node becomes an ONNX LSTM for tvmseq's LSTM converter
    (tvmseq/onnx/lstm.py): the same kernels on every path. onnxruntime's kernel quantizes the float
    operand of each of its GEMMs (rnn_helpers.cc, ComputeGemm): X once for all steps (its range taken over
    the rows of the longest sequence) and h at every step (over the batch rows one thread handles). X's
    quantization is reproduced exactly here, as one elementwise pass in front of the input projection
    (x -> (q(x) - zp) * scale); h's is not (it sits inside the recurrence), so tvmseq's result differs from
    onnxruntime's by that rounding of h (tests/test_onnx_quantized.py measures it). The importer option
    `activation_quantization="none"` drops X's emulation too: the float LSTM of the dequantized weights.
  - DynamicQuantizeLinear: onnxruntime's arithmetic (qmath.h GetQuantizationParameter, MlasQuantizeLinear):
    range [min(x, 0), max(x, 0)], scale = range / 255 (1 when the range is empty), zero point and values
    rounded half to even. TVM's own converter rounds half away from zero and divides by a zero scale.
  - ConvInteger, MatMulInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat: (A - a_zp)(B - b_zp)
    accumulated in int32 as onnxruntime does, then (the fused ops) scaled in float32 (a_scale * b_scale)
    and the bias added: onnxruntime's numbers up to float rounding. The centered operands are stored
    narrow, the products widened to int32 by the contraction (out_dtype): a constant weight in int8 where
    every (w - zp) fits it, else int16, an activation in int16 (both exact: an 8-bit value less an 8-bit
    zero point lies in [-255, 255]); with int32 operands the convs and ddddocr-old-int8's classifier head
    read 2-4x the bytes (the head 34 MB, onnxruntime's 8 MB of uint8).
  - QLinearMatMul, QLinearConv (static quantization, QOperator format): the same int32 products (plus
    QLinearConv's int32 bias) requantized as MlasRequantizeOutput does: bit-exact uint8/int8 outputs.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from ..errors import UnsupportedOnnxError
from .conv import Conv, _pads, _static
from .importer import OnnxOpConverter, register_converter
from .lstm import LSTM, _direction

QMAX = 255          # activations are quantized to uint8 [0, QMAX]
ACTIVATION_OPTION = "activation_quantization"
ACTIVATION_MODES = ("onnxruntime", "none")
_WEIGHT_DTYPES = ("int8", "uint8")


# ---------------------------------------------------------------------------------------------------
# onnxruntime's dynamic quantization of a float activation
# ---------------------------------------------------------------------------------------------------
def _nearbyint(bb, x):
    """Round half to even, as onnxruntime does (relax.op.round rounds half away from zero)."""
    # a name of its own: the PrimFunc (and the fused CUDA kernel) would be named "<lambda>", not an identifier
    return bb.emit_te(lambda t: te.compute(t.shape, lambda *i: tirx.nearbyint(t(*i)), name="nearbyint"), x,
                      primfunc_name_hint="round_half_even")


def activation_qparams(bb, x):
    """(scale, zero point) onnxruntime gives float32 `x` for uint8, as float32 scalars: the range
    [min(x, 0), max(x, 0)] in QMAX steps (scale 1 when it is empty), zero point round(-min / scale) in
    [0, QMAX]."""
    zero = relax.const(0.0, "float32")
    lo = bb.emit(relax.op.minimum(relax.op.min(x), zero))
    hi = bb.emit(relax.op.maximum(relax.op.max(x), zero))
    span = bb.emit(relax.op.subtract(hi, lo))
    scale = bb.emit(relax.op.where(relax.op.equal(span, zero), relax.const(1.0, "float32"),
                                   relax.op.divide(span, relax.const(float(QMAX), "float32"))))
    zp = bb.emit(relax.op.clip(relax.op.subtract(zero, relax.op.divide(lo, scale)), 0, QMAX))
    return scale, _nearbyint(bb, zp)


def _quantize_te(x, scale, zp, dequantize: bool):
    """MlasQuantizeLinear: x / scale clamped to [-zp, QMAX - zp], rounded half to even, plus zp (uint8);
    with `dequantize` the float value that stands for it, (q - zp) * scale."""

    def value(*i):
        s, z = scale(), zp()
        steps = tirx.nearbyint(tirx.max(tirx.min(x(*i) / s, QMAX - z), -z))
        return steps * s if dequantize else (steps + z).astype("uint8")

    return te.compute(x.shape, value, name="dequantized" if dequantize else "quantized")


def quantize_activation(bb, x, scale, zp, dequantize: bool = False):
    return bb.emit_te(lambda t, s, z: _quantize_te(t, s, z, dequantize), x, scale, zp,
                      primfunc_name_hint="dequantize" if dequantize else "quantize")


def _rows_before_te(x, longest):
    """x with the time steps at and past `longest` zeroed (zeros never widen a range that holds 0)."""
    def value(t, *rest):
        return tirx.if_then_else(t < longest(), x(t, *rest), tirx.const(0.0, x.dtype))

    return te.compute(x.shape, value, name="rows_in_range")


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------
def _optional(inputs, index):
    return inputs[index] if len(inputs) > index else None


def _constant(value):
    return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else None


def _required_constant(value, what, node, op) -> np.ndarray:
    if value is None:
        raise UnsupportedOnnxError(node, op, f"required input '{what}' is missing")
    array = _constant(value)
    if array is None:
        raise UnsupportedOnnxError(node, op, f"input '{what}' must be a constant (an initializer): tvmseq "
                                             "dequantizes it at import")
    return array


def _dtype(value) -> str:
    return str(value.ty.dtype)


def _check_dtype(value, what, allowed, node, op):
    if value is not None and _dtype(value) not in allowed:
        raise UnsupportedOnnxError(node, op, f"input '{what}' has dtype {_dtype(value)}, expected one of {allowed}")


def _activation_mode(attr, node, op) -> str:
    mode = attr["tvm_custom"]["importer_options"].get(ACTIVATION_OPTION, "onnxruntime")
    if mode not in ACTIVATION_MODES:
        raise UnsupportedOnnxError(node, op, f"importer option {ACTIVATION_OPTION}={mode!r}: must be one of "
                                             f"{ACTIVATION_MODES}")
    return mode


# ---------------------------------------------------------------------------------------------------
# DynamicQuantizeLSTM
# ---------------------------------------------------------------------------------------------------
_DQ_LSTM_ATTRS = {"activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size",
                  "input_forget"}
_X, _W, _R, _B, _LENS, _H0, _C0, _P, _W_SCALE, _W_ZP, _R_SCALE, _R_ZP = range(12)


def dequantize_lstm_weight(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, what: str, D: int,
                           node: str) -> np.ndarray:
    """DynamicQuantizeLSTM's W [D, K, 4H] (or R) with scale / zero point [D] (per direction) or [D, 4H] (per
    column) -> float32 [D, 4H, K], ONNX LSTM's layout: (q - zero_point) * scale."""
    op = "DynamicQuantizeLSTM"
    if q.ndim != 3 or q.shape[0] != D:
        raise UnsupportedOnnxError(node, op, f"input '{what}' has shape {list(q.shape)}, expected [{D}, K, 4*hidden]")
    columns = q.shape[2]
    per_param = []
    for name, param in ((f"{what}_scale", scale), (f"{what}_zero_point", zero_point)):
        if param.shape == (D,):
            per_param.append(param.reshape(D, 1, 1))
        elif param.shape == (D, columns):
            per_param.append(param.reshape(D, 1, columns))
        else:
            raise UnsupportedOnnxError(node, op, f"input '{name}' has shape {list(param.shape)}, expected [{D}] "
                                                 f"(per direction) or [{D}, {columns}] (per column)")
    s, zp = per_param
    steps = (q.astype(np.int32) - zp.astype(np.int32)).astype(np.float32)
    return np.ascontiguousarray((steps * s.astype(np.float32)).transpose(0, 2, 1))


def _lstm_weight(inputs, q_index, scale_index, zp_index, what, D, node):
    op = "DynamicQuantizeLSTM"
    q = _required_constant(_optional(inputs, q_index), what, node, op)
    if str(q.dtype) not in _WEIGHT_DTYPES:
        raise UnsupportedOnnxError(node, op, f"input '{what}' has dtype {q.dtype}, expected int8 or uint8")
    scale = _required_constant(_optional(inputs, scale_index), f"{what}_scale", node, op)
    zp = _required_constant(_optional(inputs, zp_index), f"{what}_zero_point", node, op)
    if zp.dtype != q.dtype:
        raise UnsupportedOnnxError(node, op, f"input '{what}_zero_point' has dtype {zp.dtype}, '{what}' {q.dtype}")
    return dequantize_lstm_weight(q, scale.astype(np.float32), zp, what, D, node)


def _check_lstm_shapes(x, w, r, attr, node):
    """W [D, I, 4H] and R [D, H, 4H] (as stored; `w`, `r` are already [D, 4H, K]) against X and hidden_size,
    told in the node's own layout."""
    op = "DynamicQuantizeLSTM"
    D, gates, H = r.shape
    hidden = attr.get("hidden_size", H)
    if gates != 4 * H or hidden != H:
        raise UnsupportedOnnxError(node, op, f"input 'R' has shape {[D, H, gates]}, expected [{D}, {hidden}, "
                                             f"{4 * hidden}] (hidden_size {hidden})")
    input_size = x.ty.shape.values[-1] if x.ty.shape is not None else None
    want_i = int(input_size) if isinstance(input_size, tirx.IntImm) else w.shape[2]
    if w.shape[1] != 4 * H or w.shape[2] != want_i:
        raise UnsupportedOnnxError(node, op, f"input 'W' has shape {[D, w.shape[2], w.shape[1]]}, expected "
                                             f"[{D}, {want_i}, {4 * H}] (X's input size, 4 * hidden_size)")


def _emulated_input(bb, x, lens):
    """X as onnxruntime's input GEMM sees it: quantized to uint8 with the range of the rows of the longest
    sequence (all rows without sequence_lens), and back to float."""
    ranged = x
    if lens is not None:
        longest = bb.emit(relax.op.max(relax.op.astype(lens, "int32")))
        ranged = bb.emit_te(_rows_before_te, x, longest)
    scale, zp = activation_qparams(bb, ranged)
    return quantize_activation(bb, x, scale, zp, dequantize=True)


@register_converter("DynamicQuantizeLSTM")
class DynamicQuantizeLSTM(OnnxOpConverter):
    """com.microsoft::DynamicQuantizeLSTM -> dequantized weights + tvmseq's LSTM converter (module doc)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "DynamicQuantizeLSTM"
        x = inputs[_X]
        if x is None:
            raise UnsupportedOnnxError(node, op, "required input 'X' is missing")
        _check_dtype(x, "X", ("float32",), node, op)
        extra = sorted(k for k in attr if k != "tvm_custom" and k not in _DQ_LSTM_ATTRS)
        if extra:
            raise UnsupportedOnnxError(node, op, f"attribute '{extra[0]}' is not one of DynamicQuantizeLSTM's")
        D = 2 if _direction(attr, node) == "bidirectional" else 1
        w = _lstm_weight(inputs, _W, _W_SCALE, _W_ZP, "W", D, node)
        r = _lstm_weight(inputs, _R, _R_SCALE, _R_ZP, "R", D, node)
        _check_lstm_shapes(x, w, r, attr, node)
        if _activation_mode(attr, node, op) == "onnxruntime":
            x = _emulated_input(bb, x, _optional(inputs, _LENS))
        float_inputs = [x, relax.const(w), relax.const(r)] + [_optional(inputs, i) for i in range(_B, _P + 1)]
        try:
            return LSTM._impl_v1(bb, float_inputs, attr, params)
        except UnsupportedOnnxError as err:     # told against this node's op type
            raise UnsupportedOnnxError(node, op, str(err).split("): ", 1)[-1]) from None


# ---------------------------------------------------------------------------------------------------
# DynamicQuantizeLinear, ConvInteger, DynamicQuantizeMatMul, MatMulIntegerToFloat
# ---------------------------------------------------------------------------------------------------
@register_converter("DynamicQuantizeLinear")
class DynamicQuantizeLinear(OnnxOpConverter):
    """ONNX DynamicQuantizeLinear (opset 11) as onnxruntime computes it: (y uint8, y_scale, y_zero_point)."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        _check_dtype(inputs[0], "x", ("float32",), node, "DynamicQuantizeLinear")
        scale, zp = activation_qparams(bb, inputs[0])
        y = quantize_activation(bb, inputs[0], scale, zp)
        return relax.Tuple([y, scale, bb.emit(relax.op.astype(zp, "uint8"))])


def _narrowest(centered: np.ndarray) -> np.ndarray:
    """`centered` (int32) as int8 when every value fits it, else int16, which holds any (w - zp) of uint8/int8
    operands: the contraction reads 4x/2x fewer weight bytes than int32 (ddddocr-old-int8's 8210-class head:
    34 MB of int32), and its out_dtype int32 still sums the products exactly."""
    for dtype in (np.int8, np.int16):
        info = np.iinfo(dtype)
        if centered.size == 0 or (centered.min() >= info.min and centered.max() <= info.max):
            return centered.astype(dtype)
    raise AssertionError("a centered 8-bit value lies in [-255, 255]")


def _centered(bb, value, zero_point, axis: int = -1):
    """value - zero_point in the narrowest exact integer type: a constant (both constant) in int8 or int16
    (`_narrowest`), a computed one in int16 (uint8/int8 less an 8-bit zero point lies in [-255, 255]); a zero
    point of rank 1 lies along `axis` of value (per output channel of a ConvInteger weight, per column of a
    MatMul's B). The consumers multiply in int32 (out_dtype), so the results equal int32 operands' bit for bit."""
    ndim = value.ty.ndim
    axis = axis % ndim
    along = [1] * ndim
    if zero_point is not None and zero_point.ty.ndim == 1:
        along[axis] = -1
    v = _constant(value)
    z = _constant(zero_point) if zero_point is not None else np.zeros((), np.int32)
    if v is not None and z is not None:
        z = z.astype(np.int32).reshape(along if z.ndim == 1 else z.shape)
        return relax.const(_narrowest(v.astype(np.int32) - z))
    if zero_point is None:
        return value            # its own 8-bit type: the int32 products widen it exactly
    z16 = bb.normalize(relax.op.astype(zero_point, "int16"))
    if zero_point.ty.ndim == 1:
        z16 = relax.op.reshape(z16, along)
    return bb.emit(relax.op.subtract(bb.emit(relax.op.astype(value, "int16")), z16))


def _scaled_product(bb, acc, a_scale, b_scale, bias):
    """float32(acc) * (a_scale * b_scale) (+ bias), onnxruntime's order of the float operations."""
    multiplier = bb.emit(relax.op.multiply(relax.op.astype(a_scale, "float32"), relax.op.astype(b_scale, "float32")))
    out = bb.emit(relax.op.multiply(relax.op.astype(acc, "float32"), multiplier))
    return out if bias is None else bb.emit(relax.op.add(out, bias))


_CONV_OPS = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}


def _widened(bb, value):
    """`value` in int32 (a constant stays one)."""
    array = _constant(value)
    return relax.const(array.astype(np.int32)) if array is not None else bb.emit(relax.op.astype(value, "int32"))


def _dense_conv_attrs(x, w, attr, node):
    """(strides, pads, dilations) of a dense (group 1) conv of known rank and pads; None for any other."""
    nd = x.ty.ndim - 2
    if int(attr.get("group", 1)) != 1 or nd not in _CONV_OPS or x.ty.shape is None or w.ty.shape is None:
        return None
    w_dims = _static(w.ty.shape.values)
    kernel = list(attr.get("kernel_shape", w_dims[2:] if w_dims else []))
    strides = list(attr.get("strides", [1] * nd))
    dilations = list(attr.get("dilations", [1] * nd))
    pads = _pads(attr, node, x.ty.shape.values[2:], kernel, strides, dilations) if len(kernel) == nd else None
    return None if pads is None else (strides, pads, dilations)


def _integer_conv(bb, x, w, attr, params, node):
    """x conv w with products and sums in int32 (out_dtype) of the narrow centered operands: a dense conv as
    one relax conv op. Grouped and depthwise convs (and auto_pad SAME_* on symbolic sizes) go through tvmseq's
    Conv converter, whose rewrites multiply in the operands' own type: their operands are widened to int32."""
    dense = _dense_conv_attrs(x, w, attr, node)
    if dense is None:
        return Conv._impl_v1(bb, [_widened(bb, x), _widened(bb, w), None], attr, params)
    strides, pads, dilations = dense
    op = _CONV_OPS[x.ty.ndim - 2]
    return bb.normalize(op(x, w, strides=strides, padding=pads, dilation=dilations, out_dtype="int32"))


@register_converter("ConvInteger")
class ConvInteger(OnnxOpConverter):
    """ONNX ConvInteger (opset 10): (x - x_zero_point) conv (w - w_zero_point) in int32 (`_integer_conv`)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "ConvInteger"
        x, w = inputs[0], inputs[1]
        _check_dtype(x, "x", _WEIGHT_DTYPES, node, op)
        _check_dtype(w, "w", _WEIGHT_DTYPES, node, op)
        x_zp, w_zp = _optional(inputs, 2), _optional(inputs, 3)
        if x_zp is not None and [int(d) for d in x_zp.ty.shape.values if isinstance(d, tirx.IntImm)] not in ([], [1]):
            raise UnsupportedOnnxError(node, op, "input 'x_zero_point' must be a scalar (per-tensor)")
        centered_w = _centered(bb, w, w_zp, axis=0)       # a 1-D w_zero_point: one per output channel
        return _integer_conv(bb, _centered(bb, x, x_zp), centered_w, attr, params, node)


def _matmul_int32(bb, a, b):
    """a @ b with the products and sums in int32, whatever the (narrower) integer types of a and b."""
    return bb.emit(relax.op.matmul(a, b, out_dtype="int32"))


@register_converter("MatMulInteger")
class MatMulInteger(OnnxOpConverter):
    """ONNX MatMulInteger (opset 10): (A - a_zero_point)(B - b_zero_point) in int32. TVM's converter widens B to
    int32 before centering it (ddddocr-old-int8's head then read 34 MB of int32 weights); here B stays in
    int8/int16 (`_centered`). A 1-D a_zero_point is one per row of A, a 1-D b_zero_point one per column of B."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "MatMulInteger"
        a, b = inputs[0], inputs[1]
        _check_dtype(a, "A", _WEIGHT_DTYPES, node, op)
        _check_dtype(b, "B", _WEIGHT_DTYPES, node, op)
        return _matmul_int32(bb, _centered(bb, a, _optional(inputs, 2), axis=-2),
                             _centered(bb, b, _optional(inputs, 3), axis=-1))


@register_converter("DynamicQuantizeMatMul")
class DynamicQuantizeMatMul(OnnxOpConverter):
    """com.microsoft::DynamicQuantizeMatMul(A float, B int8/uint8, b_scale, b_zero_point, bias): A quantized
    as DynamicQuantizeLinear does, the int32 product scaled by a_scale * b_scale, plus bias."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "DynamicQuantizeMatMul"
        a, b = inputs[0], inputs[1]
        _check_dtype(a, "A", ("float32",), node, op)
        _check_dtype(b, "B", _WEIGHT_DTYPES, node, op)
        a_scale, a_zp = activation_qparams(bb, a)
        a_q = quantize_activation(bb, a, a_scale, a_zp)
        acc = _matmul_int32(bb, _centered(bb, a_q, a_zp), _centered(bb, b, _optional(inputs, 3)))
        return _scaled_product(bb, acc, a_scale, inputs[2], _optional(inputs, 4))


@register_converter("MatMulIntegerToFloat")
class MatMulIntegerToFloat(OnnxOpConverter):
    """com.microsoft::MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zero_point, b_zero_point, bias):
    (A - a_zp)(B - b_zp) in int32, scaled by a_scale * b_scale, plus bias."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "MatMulIntegerToFloat"
        a, b = inputs[0], inputs[1]
        _check_dtype(a, "A", _WEIGHT_DTYPES, node, op)
        _check_dtype(b, "B", _WEIGHT_DTYPES, node, op)
        a_zp = _optional(inputs, 4)
        if a_zp is not None and a_zp.ty.ndim == 1 and int(a_zp.ty.shape.values[0]) != 1:
            raise UnsupportedOnnxError(node, op, "input 'a_zero_point' must be a scalar (per-tensor)")
        acc = _matmul_int32(bb, _centered(bb, a, a_zp), _centered(bb, b, _optional(inputs, 5)))
        return _scaled_product(bb, acc, inputs[2], inputs[3], _optional(inputs, 6))


# ---------------------------------------------------------------------------------------------------
# QLinearMatMul, QLinearConv (static quantization, QOperator format)
# ---------------------------------------------------------------------------------------------------
_QRANGE = {"uint8": (0, 255), "int8": (-128, 127)}


def _requantized(bb, acc, in_scale, w_scale, y_scale, y_zp, axis: int):
    """MlasRequantizeOutput: float32(acc) * (in_scale * w_scale / y_scale), clamped to the output type's
    range less y_zp, rounded half to even, plus y_zp; a per-channel w_scale lies along `axis` of acc."""
    out_dtype = _dtype(y_zp) if y_zp is not None else "uint8"
    qmin, qmax = _QRANGE[out_dtype]
    multiplier = bb.emit(relax.op.divide(relax.op.multiply(in_scale, w_scale), y_scale))
    if w_scale.ty.ndim == 1:
        along = [1] * acc.ty.ndim
        along[axis % acc.ty.ndim] = -1
        multiplier = relax.op.reshape(multiplier, along)
    zp = relax.op.astype(y_zp, "float32") if y_zp is not None else relax.const(0.0, "float32")
    scaled = relax.op.multiply(relax.op.astype(acc, "float32"), multiplier)
    clamped = relax.op.minimum(relax.op.maximum(scaled, relax.op.subtract(relax.const(float(qmin)), zp)),
                               relax.op.subtract(relax.const(float(qmax)), zp))
    steps = _nearbyint(bb, bb.emit(clamped))
    return bb.emit(relax.op.astype(relax.op.add(steps, zp), out_dtype))


@register_converter("QLinearMatMul")
class QLinearMatMul(OnnxOpConverter):
    """ONNX QLinearMatMul (opsets 10, 21): (a - a_zp)(b - b_zp) in int32, requantized to y's scale and zero point."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "QLinearMatMul"
        a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (list(inputs) + [None] * 8)[:8]
        _check_dtype(a, "a", _WEIGHT_DTYPES, node, op)
        _check_dtype(b, "b", _WEIGHT_DTYPES, node, op)
        acc = _matmul_int32(bb, _centered(bb, a, a_zp), _centered(bb, b, b_zp))
        return _requantized(bb, acc, a_scale, b_scale, y_scale, y_zp, axis=-1)


@register_converter("QLinearConv")
class QLinearConv(OnnxOpConverter):
    """ONNX QLinearConv (opsets 10): ConvInteger's int32 convolution plus the int32 bias, requantized to y's
    scale and zero point (w_scale per output channel or per tensor)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        node, op = cls.node_name(attr), "QLinearConv"
        x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias = (list(inputs) + [None] * 9)[:9]
        _check_dtype(x, "x", _WEIGHT_DTYPES, node, op)
        _check_dtype(w, "w", _WEIGHT_DTYPES, node, op)
        _check_dtype(bias, "B", ("int32",), node, op)
        acc = bb.normalize(_integer_conv(bb, _centered(bb, x, x_zp), _centered(bb, w, w_zp, axis=0), attr, params,
                                         node))
        if bias is not None:
            acc = bb.emit(relax.op.add(acc, relax.op.reshape(bias, [1, -1] + [1] * (acc.ty.ndim - 2))))
        return _requantized(bb, acc, x_scale, w_scale, y_scale, y_zp, axis=1)
