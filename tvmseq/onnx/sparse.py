"""Sparse weights in ONNX models -> tvmseq's spmm / spmm_t kernels.

Three ways a MatMul/Gemm operand is sparse:
1. `graph.sparse_initializer` (SparseTensorProto) and 2. a `Constant` node with `sparse_value`:
   TVM's importer reads neither, so `preprocess_sparse(model, options)` runs before import. It turns
   every such 2-D float32/float16 tensor into a `tvmseq.sparse.CSR`, records it in
   options["sparse_operands"][node name][input index] for each MatMul/Gemm that consumes it, and
   leaves an empty placeholder in the graph (a dense copy instead, where some other node also reads
   the tensor or the kernels cannot take it: other ranks/dtypes).
3. a dense constant (initializer or Constant) whose share of zeros is at least
   options["sparse_threshold"] (e.g. 0.9): detected by the converters. Opt-in (default None): the
   kernels multiply only the stored non-zeros, so a NaN or Inf in X that meets an implicit zero of W
   gives 0 where dense math (and onnxruntime) gives NaN; a model whose weight is dense keeps dense
   semantics unless the caller asks. Cases 1 and 2 take the kernels always (the model says the
   weight is sparse), with the same difference: onnxruntime densifies sparse initializers.

The converters (registered for "MatMul" and "Gemm", so they see every such node) emit, for a sparse
weight W and a dense X:
    MatMul(X, W)          Y^T = W^T X^T           -> spmm_t(W, X^T), transposed back
    MatMul(W, X)          Y = W X                 -> spmm(W, X)
    Gemm(A, W, transB=0)  Y^T = W^T A'^T          -> spmm_t(W, A'^T)
    Gemm(A, W, transB=1)  Y^T = W A'^T            -> spmm(W, A'^T)
    Gemm(W, B, transA)    Y = W B' or W^T B'      -> spmm / spmm_t
(A'^T is A itself when transA=1, so no transpose is emitted.) alpha/beta/C follow TVM's stock
Gemm. Any node without a sparse operand goes to TVM's stock converter unchanged.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper
from tvm import relax
from tvm.ir import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import TvmseqError, UnsupportedOnnxError
from ..sparse import CSR
from . import matmul as dense
from .importer import KernelKey, OnnxOpConverter, emit_kernel, register_converter

OPERANDS_OPTION = "sparse_operands"  # node name -> {input index: CSR}
THRESHOLD_OPTION = "sparse_threshold"
DEFAULT_THRESHOLD = None   # mostly-zero dense weights stay dense unless sparse_threshold is given (module doc)
KERNEL_DTYPES = ("float32", "float16")
_SPARSE_OPS = ("MatMul", "Gemm")  # consumers that read a sparse operand directly (inputs 0 and 1)


# ----------------------------------------------------------------------------------------------
# SparseTensorProto -> CSR / dense


def sparse_tensor_coordinates(sp: onnx.SparseTensorProto, name: str) -> tuple[np.ndarray, np.ndarray, list]:
    """(linear indices sorted ascending, values in that order, dims) of a SparseTensorProto, checked:
    indices in range, no duplicates, as many indices as values."""
    values = numpy_helper.to_array(sp.values).reshape(-1)
    dims = [int(d) for d in sp.dims]
    if any(d < 0 for d in dims):
        raise TvmseqError(f"sparse tensor '{name}': negative dimension in dims {dims}")
    indices = numpy_helper.to_array(sp.indices).astype(np.int64) if sp.HasField("indices") \
        else np.zeros((0,), np.int64)
    nnz = len(values)
    if indices.ndim == 2:  # [nnz, rank] coordinates
        if indices.shape != (nnz, len(dims)):
            raise TvmseqError(f"sparse tensor '{name}': indices of shape {list(indices.shape)}, expected "
                              f"[{nnz}, {len(dims)}] (values x rank)")
        bad = (indices < 0) | (indices >= np.array(dims, dtype=np.int64))
        if bad.any():
            i = int(np.flatnonzero(bad.any(axis=1))[0])
            raise TvmseqError(f"sparse tensor '{name}': index {indices[i].tolist()} out of range for dims {dims}")
        linear = np.ravel_multi_index(tuple(indices.T), dims) if nnz else np.zeros(0, np.int64)
    elif indices.ndim == 1:  # linearized
        if len(indices) != nnz:
            raise TvmseqError(f"sparse tensor '{name}': {len(indices)} indices for {nnz} values")
        size = int(np.prod(dims)) if dims else 1
        bad = (indices < 0) | (indices >= size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TvmseqError(f"sparse tensor '{name}': linear index {indices[i]} out of range "
                              f"[0, {size}) for dims {dims}")
        linear = indices
    else:
        raise TvmseqError(f"sparse tensor '{name}': indices must be 1-D or 2-D, got {indices.ndim}-D")
    order = np.argsort(linear, kind="stable")
    linear, values = linear[order], values[order]
    if nnz > 1 and (np.diff(linear) == 0).any():
        i = int(np.flatnonzero(np.diff(linear) == 0)[0])
        raise TvmseqError(f"sparse tensor '{name}': index {[int(j) for j in np.unravel_index(linear[i], dims)]} "
                          "appears twice")
    return linear, values, dims


def sparse_tensor_to_dense(sp: onnx.SparseTensorProto, name: str) -> np.ndarray:
    linear, values, dims = sparse_tensor_coordinates(sp, name)
    out = np.zeros(int(np.prod(dims)) if dims else 1, dtype=values.dtype)
    out[linear] = values
    return out.reshape(dims)


def sparse_tensor_to_csr(sp: onnx.SparseTensorProto, name: str) -> CSR | None:
    """CSR of a 2-D float32/float16 sparse tensor; None for other ranks/dtypes (they go dense)."""
    linear, values, dims = sparse_tensor_coordinates(sp, name)
    if len(dims) != 2 or str(values.dtype) not in KERNEL_DTYPES:
        return None
    rows, cols = dims
    index_dtype = np.int32 if max(rows, cols, len(values)) < 2**31 else np.int64
    row_of, col_of = np.divmod(linear, max(cols, 1))
    indptr = np.zeros(rows + 1, dtype=index_dtype)
    np.cumsum(np.bincount(row_of, minlength=rows), out=indptr[1:])
    return CSR(indptr, col_of.astype(index_dtype), values, (rows, cols))


# ----------------------------------------------------------------------------------------------
# preprocessing (before TVM's importer sees the graph)


def preprocess_sparse(model: onnx.ModelProto, options: dict | None = None) -> tuple[onnx.ModelProto, dict]:
    """Take sparse initializers and Constant(sparse_value) nodes out of `model` (see module doc).
    Returns (the model, or a modified copy; options with "sparse_operands" added). Idempotent."""
    options = dict(options or {})
    options[OPERANDS_OPTION] = dict(options.get(OPERANDS_OPTION) or {})
    graph = model.graph
    has_constants = any(_sparse_value_attr(n) is not None for n in graph.node)
    if not graph.sparse_initializer and not has_constants:
        return model, options
    model = _copy(model)
    graph = model.graph
    _name_unnamed_nodes(graph)
    uses = _uses(graph)
    elsewhere = _names_read_outside_nodes(graph)

    def replace(name: str, sp: onnx.SparseTensorProto) -> onnx.TensorProto:
        csr = sparse_tensor_to_csr(sp, name)
        kernel_uses = [(node, i) for node, i in uses.get(name, []) if node.op_type in _SPARSE_OPS and i < 2]
        if csr is not None:
            for node, i in kernel_uses:
                options[OPERANDS_OPTION].setdefault(node.name, {})[i] = csr
        dense_needed = csr is None or len(kernel_uses) < len(uses.get(name, [])) or name in elsewhere
        if dense_needed:
            return numpy_helper.from_array(csr.to_dense() if csr is not None else
                                           sparse_tensor_to_dense(sp, name), name)
        return numpy_helper.from_array(np.zeros((0,), dtype=csr.dtype), name)  # never read

    for sp in list(graph.sparse_initializer):
        graph.initializer.append(replace(sp.values.name, sp))
    del graph.sparse_initializer[:]
    for node in graph.node:
        attr = _sparse_value_attr(node)
        if attr is not None:
            tensor = replace(node.output[0], attr.sparse_tensor)
            node.ClearField("attribute")
            node.attribute.append(onnx.helper.make_attribute("value", tensor))
    return model, options


def _sparse_value_attr(node: onnx.NodeProto):
    if node.op_type != "Constant":
        return None
    return next((a for a in node.attribute if a.name == "sparse_value"), None)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _name_unnamed_nodes(graph: onnx.GraphProto) -> None:
    """MatMul/Gemm nodes are found again by name at conversion: make their names unique."""
    taken = {node.name for node in graph.node}
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        if node.op_type in _SPARSE_OPS and (not node.name or node.name in seen):
            name, k = f"{node.op_type}_sparse_{i}", 0
            while name in taken:
                k += 1
                name = f"{node.op_type}_sparse_{i}_{k}"
            node.name = name
            taken.add(name)
        seen.add(node.name)


def _uses(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    uses: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))
    return uses


def _names_read_outside_nodes(graph: onnx.GraphProto) -> set[str]:
    """Graph outputs and names read inside subgraphs (If/Loop bodies): these need a dense tensor."""
    names = {o.name for o in graph.output}

    def visit(g: onnx.GraphProto):
        for node in g.node:
            names.update(node.input)
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    visit(sub)

    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                visit(sub)
    return names


# ----------------------------------------------------------------------------------------------
# converters


def sparse_threshold(options: dict, node: str, op: str) -> float | None:
    value = options.get(THRESHOLD_OPTION, DEFAULT_THRESHOLD)
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise UnsupportedOnnxError(node, op, f"importer option sparse_threshold={options[THRESHOLD_OPTION]!r} "
                                             "must be a share of zeros in [0, 1] (or None to disable)")
    return value


def _sparse_operands(inputs, attr, op: str) -> dict[int, CSR]:
    """Recorded sparse operands of this node, plus dense constants with enough zeros."""
    custom = attr["tvm_custom"]
    node, options = custom["name"], custom.get("importer_options", {})
    found = dict((options.get(OPERANDS_OPTION) or {}).get(node, {}))
    threshold = sparse_threshold(options, node, op)
    for i in (0, 1):
        x = inputs[i] if len(inputs) > i else None
        if i in found or threshold is None or not isinstance(x, GenericConst):
            continue
        if x.ty.ndim != 2 or str(x.ty.dtype) not in KERNEL_DTYPES:
            continue
        value = x.value.numpy()
        if value.size and np.count_nonzero(value) <= (1.0 - threshold) * value.size:
            found[i] = CSR.from_dense(value)
    return found


def _dims(x) -> list | None:
    """Dims as ints where static, PrimExprs where symbolic (None: unknown rank)."""
    shape = x.ty.shape if hasattr(x.ty, "shape") else None
    if shape is None or not hasattr(shape, "values"):
        return None
    return [int(d.value) if hasattr(d, "value") else d for d in shape.values]


def _is(dim, value: int) -> bool:
    """dim == value for a static dim; False for a symbolic one."""
    return isinstance(dim, int) and dim == value


def _emit(bb, S: CSR, dense, transposed: bool, target, node: str, op: str):
    """The spmm / spmm_t call (importer.emit_kernel) on S and the 2-D relax expression `dense` (its columns may be
    symbolic: the kernel is then built for any number of columns)."""
    from ..kernels.sparse.spmm import SpmmShape, spmm_func

    n = _dims(dense)[1]
    shape = SpmmShape(transposed, S.shape[0], S.shape[1], n if isinstance(n, int) else None, S.dtype,
                      S.index_dtype, S.transpose_map.dtype if transposed else "int32")
    try:
        shape.check()
    except TvmseqError as err:
        raise UnsupportedOnnxError(node, op, str(err)) from err
    out_rows = S.shape[1] if transposed else S.shape[0]
    args = [relax.const(a) for a in S.kernel_arrays(transposed)] + [dense]
    # the kernel: prebuilt (tvmseq build) when an artifact fits, else this TIR function compiled
    key = KernelKey({"rows": shape.rows, "cols": shape.cols, **({"n": n} if shape.n_cols is not None else {})},
                    shape.dtype, {"index_dtype": shape.index_dtype, "map_dtype": shape.map_dtype},
                    () if shape.n_cols is not None else ("n",))
    return emit_kernel(bb, "spmm_t" if transposed else "spmm", key, lambda: spmm_func(shape, target), args,
                       relax.TensorType([out_rows, n], S.dtype), name_hint=shape.name,
                       signature=_kernel_signature(shape))


def _kernel_signature(shape) -> dict:
    """What the spmm / spmm_t kernels take (any nnz; any number of D columns when n_cols is None), in
    the artifact manifest's form (tvmseq.kernels.sparse.spmm.spmm_func's parameter order)."""
    n = "n" if shape.n_cols is None else shape.n_cols
    idx, mdt, dt = shape.index_dtype, shape.map_dtype, shape.dtype
    spec = lambda name, dims, dtype: {"name": name, "shape": list(dims), "dtype": dtype}  # noqa: E731
    if shape.transposed:
        inputs = [spec("indptr", [shape.rows + 1], idx), spec("data", ["nnz"], dt),
                  spec("col_ptr", [shape.cols + 1], mdt), spec("entries", ["nnz"], mdt), spec("D", [shape.rows, n], dt)]
    else:
        inputs = [spec("indptr", [shape.rows + 1], idx), spec("indices", ["nnz"], idx), spec("data", ["nnz"], dt),
                  spec("D", [shape.cols, n], dt)]
    return {"inputs": inputs, "outputs": [spec("out", [shape.out_rows, n], dt)]}


def _dense_const(S: CSR):
    return relax.const(S.to_dense())


def _as_dense_inputs(inputs, found: dict[int, CSR]):
    """Inputs with recorded sparse placeholders replaced by dense constants (for stock converters)."""
    out = _tvm_onnx.onnx_input(inputs)
    for i, S in found.items():
        if isinstance(out[i], GenericConst) and _dims(out[i]) != list(S.shape):
            out[i] = _dense_const(S)
    return out


def _stock(op: str, opset: int, bb, inputs, attr, params):
    return _tvm_onnx._get_convert_map()[op].get_converter(opset)(bb, inputs, attr, params)


def _check_dtype(S: CSR, x, node: str, op: str, what: str) -> None:
    if str(x.ty.dtype) != S.dtype:
        raise UnsupportedOnnxError(node, op, f"sparse operand is {S.dtype} but {what} is {x.ty.dtype}")


def _fallback(node: str, why: str) -> None:
    """The sparse operand cannot go to the kernels here: say so, then compute densely."""
    warnings.warn(f"ONNX node '{node}': sparse operand multiplied densely ({why})", stacklevel=3)
    return None


class _SparseConverter(OnnxOpConverter):
    op = ""

    @classmethod
    def _convert(cls, bb, inputs, attr, params, opset):
        found = _sparse_operands(inputs, attr, cls.op)
        if found:
            y = cls._sparse(bb, inputs, attr, found)
            if y is not None:
                return y
        else:
            y = cls._dense(bb, inputs, attr)
            if y is not None:
                return y
        return _stock(cls.op, opset, bb, _as_dense_inputs(inputs, found), attr, params)

    @classmethod
    def _sparse(cls, bb, inputs, attr, found):
        raise NotImplementedError

    @classmethod
    def _dense(cls, bb, inputs, attr):
        """A dense product on a tvmseq kernel (`onnx.matmul`: float32 on tf32 tensor cores), or None."""
        return None


@register_converter("MatMul")
class SparseMatMul(_SparseConverter):
    """MatMul with a sparse 2-D operand -> spmm / spmm_t; a float32 one with a 2-D weight on sm_90a -> the tf32x3
    projection (`onnx.matmul`); any other MatMul -> TVM's converter."""

    op = "MatMul"
    _dense = classmethod(lambda cls, bb, inputs, attr: dense.matmul(bb, inputs, attr))

    @classmethod
    def _sparse(cls, bb, inputs, attr, found):
        node, target = attr["tvm_custom"]["name"], attr["tvm_custom"]["importer_options"]["target"]
        if 1 in found:  # X @ W, X of shape [..., K]: Y^T = W^T X^T
            S, x = found[1], inputs[0] if 0 not in found else _dense_const(found[0])
            dims = _dims(x)
            if not dims or not _is(dims[-1], S.shape[0]):
                return _fallback(node, f"input A of shape {dims} does not end in {S.shape[0]}")
            _check_dtype(S, x, node, cls.op, "input A")
            x2 = x if len(dims) == 2 else bb.emit(relax.op.reshape(x, [-1, S.shape[0]]))
            yt = _emit(bb, S, bb.emit(relax.op.permute_dims(x2, [1, 0])), True, target, node, cls.op)
            y = bb.emit(relax.op.permute_dims(yt, [1, 0]))
            return y if len(dims) == 2 else relax.op.reshape(y, dims[:-1] + [S.shape[1]])
        S, x = found[0], inputs[1]  # W @ X, X of shape [K] or [K, N] (a batched X goes dense)
        dims = _dims(x)
        if not dims or len(dims) > 2 or not _is(dims[0], S.shape[1]):
            return _fallback(node, f"input B of shape {dims} is not [{S.shape[1]}] or [{S.shape[1]}, N]")
        _check_dtype(S, x, node, cls.op, "input B")
        x2 = bb.emit(relax.op.reshape(x, [S.shape[1], 1])) if len(dims) == 1 else x
        y = _emit(bb, S, x2, False, target, node, cls.op)
        return relax.op.reshape(y, [S.shape[0]]) if len(dims) == 1 else y


@register_converter("Gemm")
class SparseGemm(_SparseConverter):
    """Gemm with a sparse A or B -> spmm / spmm_t (+ alpha, beta * C); float32 A B^T + C on sm_90a -> the tf32x3
    projection (`onnx.matmul`); any other Gemm -> TVM's."""

    op = "Gemm"
    _dense = classmethod(lambda cls, bb, inputs, attr: dense.gemm(bb, inputs, attr))

    @classmethod
    def _sparse(cls, bb, inputs, attr, found):
        node, target = attr["tvm_custom"]["name"], attr["tvm_custom"]["importer_options"]["target"]
        trans_a, trans_b = bool(attr.get("transA", 0)), bool(attr.get("transB", 0))
        if 1 in found:  # Y^T = B'^T A'^T
            S = found[1]
            a = inputs[0] if 0 not in found else _dense_const(found[0])
            dims, k = _dims(a), S.shape[1] if trans_b else S.shape[0]  # B' = S^T if transB else S
            if not dims or len(dims) != 2 or not _is(dims[0 if trans_a else 1], k):
                return _fallback(node, f"input A of shape {dims} does not match B")
            _check_dtype(S, a, node, cls.op, "input A")
            at = a if trans_a else bb.emit(relax.op.permute_dims(a, [1, 0]))  # A'^T
            yt = _emit(bb, S, at, not trans_b, target, node, cls.op)
            y = bb.emit(relax.op.permute_dims(yt, [1, 0]))
        else:  # Y = A' B', A' = S or S^T
            S, b = found[0], inputs[1]
            dims, k = _dims(b), S.shape[0] if trans_a else S.shape[1]
            if not dims or len(dims) != 2 or not _is(dims[1 if trans_b else 0], k):
                return _fallback(node, f"input B of shape {dims} does not match A")
            _check_dtype(S, b, node, cls.op, "input B")
            bp = bb.emit(relax.op.permute_dims(b, [1, 0])) if trans_b else b
            y = _emit(bb, S, bp, trans_a, target, node, cls.op)
        alpha, beta = float(attr.get("alpha", 1.0)), float(attr.get("beta", 1.0))
        if alpha != 1.0:
            y = bb.emit(relax.op.multiply(y, relax.const(alpha, S.dtype)))
        c = inputs[2] if len(inputs) > 2 else None
        if c is not None:
            if beta != 1.0:
                c = relax.op.multiply(c, relax.const(beta, S.dtype))
            y = relax.op.add(y, c)
        return y


def _add_versions(cls, versions):
    """One _impl_vN per ONNX version of the op, each knowing N (to pick the stock converter's)."""
    for v in versions:
        setattr(cls, f"_impl_v{v}", classmethod(
            lambda c, bb, inputs, attr, params, _v=v: c._convert(bb, inputs, attr, params, _v)))


_add_versions(SparseMatMul, (1, 9, 13))
_add_versions(SparseGemm, (1, 6, 7, 9, 11, 13))
