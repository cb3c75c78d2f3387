"""Softmax over the contiguous last axis on the CPU: each row in three vectorized passes.

TVM 0.27 legalizes `relax.nn.softmax` into four loop nests (max, exp, exp-sum, normalize) that no CPU rule of
tvmseq.schedule_cpu vectorizes when the row length is no multiple of a vector (the OCR heads: 6625 and 8210
classes), and its exp is one libm `expf` call an element: PP-OCR's softmax over 2 x 80 rows of 6625 classes took
10.8% of the model's time on the 2-core Zen 4 (2.3 ms alone). Here a row is:
  1. the maximum, `lanes` running maxima a vector, then across them and the tail;
  2. y = exp(x - max) with the polynomial exp of the CPU gate loops (`gru.fast_exp`, arithmetic only: it stays
     in SIMD registers), written out and summed the same way;
  3. y *= 1 / sum.
Rows go over TVM's thread pool. Results differ from exact exp by the polynomial's ~1e-7 relative error.
"""
from __future__ import annotations

# rows x columns from which the row loop is split over threads (below, one thread does it in a few us)
PARALLEL_MIN_ELEMENTS = 1 << 14


def cpu_softmax_func(columns: int, lanes: int = 16, parallel: bool = True):
    """prim_func(x, y): y[r, :] = softmax(x[r, :]) for x, y float32 [rows, columns], rows symbolic (int64)."""
    from tvm import tirx
    from tvm.script import tirx as T

    from ..recurrent.gru import fast_exp

    rows = tirx.Var("rows", "int64")
    n, L = int(columns), int(lanes)
    whole, tail = n // L, n % L
    row_loop = T.parallel if parallel else T.serial
    neg_inf = T.float32(-3.4028234663852886e38)

    @T.prim_func(s_tir=True)
    def softmax_rows(x: T.handle, y: T.handle):
        T.func_attr({"global_symbol": "softmax_rows", "tirx.noalias": True})
        X = T.match_buffer(x, (rows, n), "float32")
        Y = T.match_buffer(y, (rows, n), "float32")
        with T.sblock("root"):   # Relax's reshape-pattern check reads a root block
            for r in row_loop(rows):
                acc = T.alloc_buffer((L,), "float32")      # constant size under 1 KB: a stack array, in registers
                total = T.alloc_buffer((1,), "float32")
                for lane in T.vectorized(L):
                    acc[lane] = neg_inf
                for v in range(whole):
                    for lane in T.vectorized(L):
                        acc[lane] = T.max(acc[lane], X[r, v * L + lane])
                total[0] = neg_inf
                for lane in range(L):
                    total[0] = T.max(total[0], acc[lane])
                for t in range(tail):
                    total[0] = T.max(total[0], X[r, whole * L + t])
                for lane in T.vectorized(L):
                    acc[lane] = T.float32(0)
                for v in range(whole):
                    for lane in T.vectorized(L):
                        Y[r, v * L + lane] = fast_exp(X[r, v * L + lane] - total[0])
                        acc[lane] = acc[lane] + Y[r, v * L + lane]
                for t in range(tail):
                    Y[r, whole * L + t] = fast_exp(X[r, whole * L + t] - total[0])
                # the maximum is no longer needed: total now holds the sum
                total[0] = T.float32(0)
                for lane in range(L):
                    total[0] = total[0] + acc[lane]
                for t in range(tail):
                    total[0] = total[0] + Y[r, whole * L + t]
                total[0] = T.float32(1) / total[0]
                for v in range(whole):
                    for lane in T.vectorized(L):
                        Y[r, v * L + lane] = Y[r, v * L + lane] * total[0]
                for t in range(tail):
                    Y[r, whole * L + t] = Y[r, whole * L + t] * total[0]

    # opaque to FuseOps (op_pattern 8): a kernel of its own, as tvmseq's other kernels
    return softmax_rows.with_attrs({"tirx.is_scheduled": True, "op_pattern": 8})
