"""ONNX TopK (opsets 1, 10, 11, 24) -> tvmseq top-k kernels (importer.emit_kernel: call_tir, or a prebuilt artifact).

The selected axis is moved last and the other axes flattened into rows (they may be symbolic); the
axis itself must be static. K:
  - constant (attribute in opset 1, an initializer or Constant node later): checked at import time,
    hierarchical kernel (LightSeq) when K is small, a full bitonic sort otherwise;
  - anything else (a graph input, a computed tensor): the outputs get a symbolic last dimension
    read from K at run time (`tensor_to_shape`), and the sort kernel fills it; K outside
    [0, axis size] is refused (TvmseqError naming the node) before the model runs when K is a graph
    input (tvmseq.runtime's input checks), and before the kernel runs when K is computed in the graph
    (`checks.checked_topk_k`).
Outputs: values (input dtype) and int64 indices, sorted best first (also for sorted=0, which lets
any order through), equal values by the lower index.
"""
from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from ..errors import UnsupportedOnnxError
from ..kernels.topk import topk as topk_kernels
from .checks import checked_topk_k, emit_shape_values
from .importer import KernelKey, OnnxOpConverter, add_input_check, emit_kernel, register_converter

_ATTRS = {1: {"k", "axis"}, 10: {"axis"}, 11: {"axis", "largest", "sorted"}}


def _check_attrs(attr, node: str, version: int):
    for key in attr:
        if key != "tvm_custom" and key not in _ATTRS[version]:
            raise UnsupportedOnnxError(node, "TopK", f"attribute '{key}' is not supported (opset {version})")
    for key in ("largest", "sorted"):
        if attr.get(key, 1) not in (0, 1):
            raise UnsupportedOnnxError(node, "TopK", f"attribute '{key}' = {attr[key]} must be 0 or 1")


def _constant_k(k_expr, params, node: str):
    """K as a Python int when it is known at import time, else None."""
    k_expr = get_constant(k_expr, params)
    if isinstance(k_expr, tvm.ir.GenericConst):
        values = k_expr.value.numpy()
        if values.size != 1:
            raise UnsupportedOnnxError(node, "TopK", f"input 'K' must hold one value, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise UnsupportedOnnxError(node, "TopK", f"input 'K' must be int64, got {values.dtype}")
        return int(values.reshape(-1)[0])
    return None


def convert_topk(bb, data, k, k_expr, attr, axis: int, largest: int):
    """Emit the top-k of `data` along `axis`: `k` (int) when known, else `k_expr` (a 1-element tensor)."""
    node = OnnxOpConverter.node_name(attr)
    target = attr["tvm_custom"]["importer_options"]["target"]
    if data is None:
        raise UnsupportedOnnxError(node, "TopK", "input 'X' is missing")
    ty = data.ty
    if ty.shape is None or getattr(ty.shape, "values", None) is None:
        raise UnsupportedOnnxError(node, "TopK", "input 'X' has an unknown shape")
    dims = list(ty.shape.values)
    dtype = str(ty.dtype)
    if dtype not in topk_kernels.SUPPORTED_DTYPES:
        raise UnsupportedOnnxError(node, "TopK", f"input 'X' has dtype {dtype}; supported: "
                                                 f"{', '.join(topk_kernels.SUPPORTED_DTYPES)}")
    if not dims:
        raise UnsupportedOnnxError(node, "TopK", "input 'X' is a scalar; TopK needs at least one axis")
    if not -len(dims) <= axis < len(dims):
        raise UnsupportedOnnxError(node, "TopK", f"attribute 'axis' = {axis} is out of range for rank {len(dims)}")
    axis %= len(dims)
    if not isinstance(dims[axis], tirx.IntImm):
        raise UnsupportedOnnxError(node, "TopK", f"axis {axis} of input 'X' has symbolic size {dims[axis]}; "
                                                 "tvmseq needs it static (pass --shape to fix it)")
    n = int(dims[axis])
    if k is not None and not 0 <= k <= n:
        raise UnsupportedOnnxError(node, "TopK", f"K = {k} is outside [0, {n}] (size of axis {axis} of 'X')")

    lead = dims[:axis] + dims[axis + 1:]
    rows = 1
    for d in lead:
        rows = rows * d
    rows = tvm.tirx.const(rows, "int64") if isinstance(rows, int) else rows
    static_rows = int(rows) if isinstance(rows, tirx.IntImm) else None
    if k == 0 or (k is not None and static_rows == 0):
        # empty outputs sliced from the input (a folded empty constant does not survive TVM's VM
        # serialization)
        values = bb.emit(relax.op.strided_slice(data, axes=[axis], begin=[0], end=[k]))
        return relax.Tuple([values, bb.emit(relax.op.astype(values, "int64"))])
    perm = [i for i in range(len(dims)) if i != axis] + [axis]
    moved = data if axis == len(dims) - 1 else bb.emit(relax.op.permute_dims(data, perm))
    x2 = bb.emit(relax.op.reshape(moved, relax.ShapeExpr([rows, n])))
    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    k_dim = _symbolic_k(bb, k_expr, attr, node, n) if k is None else k
    rows_dim = rows if static_rows is None else static_rows
    # the kernel: prebuilt (tvmseq build) when an artifact fits, else this TIR function compiled
    shapes = {"n": n, **({"rows": static_rows} if static_rows is not None else {}),
              **({"k": k} if k is not None else {})}
    dynamic = tuple(d for d, v in (("rows", static_rows), ("k", k)) if v is None)
    key = KernelKey(shapes, dtype, {"largest": bool(largest)}, dynamic)
    outs = emit_kernel(bb, "topk", key,
                       lambda: topk_kernels.topk_func(static_rows, n, k, dtype, bool(largest), kind),
                       [x2], [relax.TensorType([rows_dim, k_dim], dtype), relax.TensorType([rows_dim, k_dim], "int64")],
                       name_hint="tvmseq_topk")
    out_shape = relax.ShapeExpr(lead + [k_dim])
    values = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(outs, 0)), out_shape))
    indices = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(outs, 1)), out_shape))
    return _restore(bb, values, indices, axis, len(dims))


def _symbolic_k(bb, k_expr, attr, node: str, n: int):
    """A symbolic dimension bound to K's value at run time."""
    if k_expr is None:
        raise UnsupportedOnnxError(node, "TopK", "input 'K' is missing")
    kty = k_expr.ty
    if kty.shape is not None and getattr(kty.shape, "values", None) is not None:
        kdims = [int(d) if isinstance(d, tirx.IntImm) else None for d in kty.shape.values]
        if len(kdims) > 1 or (kdims and kdims[0] not in (1, None)):
            raise UnsupportedOnnxError(node, "TopK", f"input 'K' must have shape [1], got {kdims}")
    if str(kty.dtype) not in ("int64", "int32"):
        raise UnsupportedOnnxError(node, "TopK", f"input 'K' must be int64, got {kty.dtype}")
    k1 = bb.emit(relax.op.reshape(k_expr, relax.ShapeExpr([1])))
    if str(kty.dtype) != "int64":
        k1 = bb.emit(relax.op.astype(k1, "int64"))
    if not isinstance(k_expr, relax.Var):    # computed in the graph: checked in the model, before the kernel
        return checked_topk_k(bb, attr, k1, n, node)
    # a graph input: the runtime checks its value before running
    add_input_check(attr, k_expr.name, {"kind": "range", "min": 0, "max": n, "what": f"K of TopK node '{node}'"})
    return emit_shape_values(bb, k1, "topk_k")[0]


def _restore(bb, values, indices, axis: int, ndim: int):
    if axis != ndim - 1:
        perm = list(range(axis)) + [ndim - 1] + list(range(axis, ndim - 1))
        values = relax.op.permute_dims(values, perm)
        indices = relax.op.permute_dims(indices, perm)
    return relax.Tuple([bb.emit(values), bb.emit(indices)])


@register_converter("TopK")
class TopK(OnnxOpConverter):
    """TopK-1: K attribute; TopK-10: K input; TopK-11/24: K input, `largest`, `sorted`."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        _check_attrs(attr, node, 1)
        if "k" not in attr:
            raise UnsupportedOnnxError(node, "TopK", "attribute 'k' is required in opset 1")
        return convert_topk(bb, inputs[0], int(attr["k"]), None, attr, int(attr.get("axis", -1)), 1)

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        return cls._k_input(bb, inputs, attr, params, 10)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._k_input(bb, inputs, attr, params, 11)

    @classmethod
    def _k_input(cls, bb, inputs, attr, params, version):
        node = cls.node_name(attr)
        _check_attrs(attr, node, version)
        if len(inputs) < 2 or inputs[1] is None:
            raise UnsupportedOnnxError(node, "TopK", "input 'K' is missing")
        k = _constant_k(inputs[1], params, node)
        return convert_topk(bb, inputs[0], k, inputs[1], attr, int(attr.get("axis", -1)),
                            int(attr.get("largest", 1)))
