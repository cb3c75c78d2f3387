"""float32 input projections on tf32 tensor cores at float32 accuracy ("3xTF32", as CUTLASS's fast-accurate
float32 GEMM): each operand is split into a high part (rounded to tf32's 10 mantissa bits) and a low part (the
remainder, rounded to tf32 again), both exact in tf32, and X W^T = Xlo Whi + Xhi Wlo + Xhi Whi with the lo x lo
term dropped. Every product is exact in float32 (11 x 11 significant bits), so what is lost against a float32 GEMM
is the lo x lo term and the low part's rounding, each under 2^-22 of a product, against float32's own 2^-24 a sum.
Three tf32 wgmmas cost ~1/3 of tf32's rate, still ~3x the float32 FMA rate a SIMT GEMM is bound by. The tensor
cores truncate as they accumulate, so the kernel adds their sum into float32 registers every few k steps
(`WgmmaTile.promote`): without that, the error over 3K grew to ~2.4x a float32 GEMM's at K 1024 (H200,
`schedules/tf32x3_sweep.py`); with chunks of 8 k steps it is half of it.

* `split_func`: X [rows, K] -> [2, rows, Kp] (high, low, K zero-padded to Kp), the kernel the importer runs
  before the projection;
* `split_array`: the same on a numpy array (constant weights, split once at import);
* `conv_split_func`: a convolution's im2col rows split the same way, straight from its input (the rows of a
  Conv computed as a product, `onnx.conv`; the im2col matrix itself is never written);
* `tf32x3_cpu_func`: the projection's numerics as a loop nest (CPU tests); the GPU kernel is
  `wgmma.projection_wgmma_func(..., operands="tf32x3")`.
"""
from __future__ import annotations

import numpy as np

ROUND = 0x1000          # half of tf32's last place in float32 bits: round half away from zero
KEEP = 0xFFFFE000       # sign, exponent and tf32's 10 mantissa bits


def split_weight(w: np.ndarray, Np: int, Kp: int) -> np.ndarray:
    """[2, D, Np, Kp]: a weight W [D, N, K] zero-padded to Np rows and Kp columns, split (what the kernel reads)."""
    D, N, K = w.shape
    return split_array(np.pad(np.asarray(w, np.float32), [(0, 0), (0, Np - N), (0, Kp - K)]))


def split_array(a: np.ndarray) -> np.ndarray:
    """[2, *a.shape] float32: a's high and low tf32 parts (`split_func`'s arithmetic, bit for bit)."""
    a = np.ascontiguousarray(a, dtype=np.float32)

    def tf32(v):
        return ((v.view(np.uint32) + np.uint32(ROUND)) & np.uint32(KEEP)).view(np.float32)

    hi = tf32(a)
    return np.stack([hi, tf32(a - hi)])


def split_func(K: int, Kp: int | None = None, row_values: int | None = None, what: str = ""):
    """prim_func(x [rows, K] f32, xs [2, rows, Kp] f32): xs[0] = tf32(x), xs[1] = tf32(x - xs[0]), zeros in the
    columns [K, Kp) (Kp: K padded to the projection's k step; default K); rows symbolic. An elementwise block
    (a memory-bound pass, ~3 bytes moved a byte of X) that the target's default schedule takes (dlight on a GPU).
    `row_values` (X's split: the most values a row of X becomes in any tensor after it, 2 Kp or D x G): rows x
    row_values must stay under 2^31, checked on the host before the kernel runs (one line naming `what`)."""
    from tvm import tirx
    from tvm.script import tirx as T

    Kp = Kp or K
    rows = tirx.Var("rows", "int32")

    def value(X, m, k):
        return X[m, k] if Kp == K else T.if_then_else(k < K, X[m, T.min(k, K - 1)], T.float32(0))

    return _split_of((rows, K), rows, Kp, value, row_values or 1, what, "tf32x3_split")


def _split_of(x_dims, rows, Kp: int, value, row_values: int, what: str, symbol: str):
    """prim_func(x [x_dims] f32, xs [2, rows, Kp] f32): xs[0][m, k] = tf32(value(X, m, k)), xs[1] its remainder
    in tf32, after the host check of rows x row_values against 2^31 (`what` names the tensor's node)."""
    from tvm.script import tirx as T

    from ...onnx.checks import index_limit_check

    check_rows = index_limit_check(what, row_values, "row")

    def tf32(v):
        return T.reinterpret("float32", T.bitwise_and(T.reinterpret("uint32", v) + T.uint32(ROUND),
                                                      T.uint32(KEEP)))

    @T.prim_func(s_tir=True)
    def main(x: T.handle, xs: T.handle):
        # opaque (op_pattern 8): FuseOps would merge X's reshape into it, which FuseTIR then maps inconsistently
        T.func_attr({"global_symbol": symbol, "tirx.noalias": True, "op_pattern": 8})
        X = T.match_buffer(x, x_dims, "float32")
        XS = T.match_buffer(xs, (2, rows, Kp), "float32")
        check_rows(rows)
        for m, k in T.grid(rows, Kp):
            with T.sblock("split"):
                vm, vk = T.axis.remap("SS", [m, k])
                XS[0, vm, vk] = tf32(value(X, vm, vk))
                XS[1, vm, vk] = tf32(value(X, vm, vk) - tf32(value(X, vm, vk)))

    return main


def conv_output_sizes(spatial, kernel, strides, dilations, pads) -> list:
    """Output sizes of a conv over input sizes `spatial` (ints or TIR expressions; `//` is floordiv on both), pads
    [begin..., end...]."""
    nd = len(kernel)
    return [(size + pads[i] + pads[nd + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
            for i, size in enumerate(spatial)]


def conv_split_func(dims, kernel, strides, dilations, pads, Kp: int, row_values: int | None = None, what: str = ""):
    """prim_func(x [N, C, *S] f32, xs [2, rows, Kp] f32): the im2col rows of a conv over x, split as `split_func`
    splits rows: row r = (n, o_0, ..) an output position, column k = (c, t_0, ..) an input channel and kernel tap,
    the value x[n, c, o_i s_i - pad_i + t_i d_i ..] (zero in the padding and in the columns [C x taps, Kp)). `dims`:
    x's dims, ints or int32 tirx.Vars (the kernel's symbolic sizes); pads [begin..., end...]. rows x row_values
    must stay under 2^31 (checked on the host, one line naming `what`, as `split_func`)."""
    from tvm import tirx
    from tvm.script import tirx as T

    nd = len(kernel)
    spatial = list(dims[2:])
    channels = int(dims[1])
    outs = conv_output_sizes(spatial, kernel, strides, dilations, pads)
    rows = dims[0]
    for o in outs:
        rows = rows * o
    taps = 1
    for k in kernel:
        taps *= k
    K = channels * taps

    def value(X, m, k):
        """The im2col entry (m, k): one output position's input value under one tap, or 0."""
        position, tap, n, t = [], [], m, k % taps
        for i in reversed(range(nd)):
            position.insert(0, n % outs[i])
            n = n // outs[i]
            tap.insert(0, t % kernel[i])
            t = t // kernel[i]
        at = [position[i] * strides[i] - pads[i] + tap[i] * dilations[i] for i in range(nd)]
        inside = tirx.all(k < K, *[bound for a, size in zip(at, spatial) for bound in (a >= 0, a < size)])
        return T.if_then_else(inside, X[(n, k // taps, *at)], T.float32(0))

    return _split_of(tuple(dims), rows, Kp, value, row_values or 2 * Kp, what, "conv_tf32x3_split")


SPLIT_THREADS = 256


def scheduled_split_func(K: int, Kp: int, target, row_values: int | None = None, what: str = ""):
    """`split_func` scheduled for `target`: on a GPU a thread a 16-byte vector of X (one element where K is padded)
    and its two parts; else as written (the CPU's default schedule takes it)."""
    import tvm

    func = split_func(K, Kp, row_values, what)
    if target.kind.name != "cuda":
        return func
    sch = tvm.s_tir.Schedule(func)
    m, k = sch.get_loops(sch.get_sblock("split"))
    vec = 4 if K == Kp else 1
    bx, tx, v = sch.split(sch.fuse(m, k), factors=[None, SPLIT_THREADS, vec])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    if vec > 1:
        sch.vectorize(v)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# rows of the im2col matrix one block of `scheduled_conv_split_func` makes: its threads lie along the row's columns
# (coalesced writes), each thread taking the rows in turn, so a row's position (n, o..) is worked out once a row,
# not once an element (a thread an element, the divisions by the symbolic output width took 102 us under ncu for
# the CRNN benchmark's 25,600 x 288 rows at batch 8, H200, 2026-11-29)
CONV_SPLIT_ROWS = 8


def scheduled_conv_split_func(dims, kernel, strides, dilations, pads, Kp: int, target, row_values: int | None = None,
                              what: str = ""):
    """`conv_split_func` scheduled for `target`: on a GPU a block CONV_SPLIT_ROWS rows, its threads (up to
    SPLIT_THREADS, a multiple of 32 dividing Kp) along the columns; else as written."""
    import tvm

    func = conv_split_func(dims, kernel, strides, dilations, pads, Kp, row_values, what)
    if target.kind.name != "cuda":
        return func
    warps = max(d for d in range(1, SPLIT_THREADS // 32 + 1) if (Kp // 32) % d == 0)
    sch = tvm.s_tir.Schedule(func)
    m, k = sch.get_loops(sch.get_sblock("split"))
    mb, r = sch.split(m, factors=[None, CONV_SPLIT_ROWS])
    ko, ki = sch.split(k, factors=[None, 32 * warps])
    sch.reorder(mb, ki, r, ko)
    sch.bind(mb, "blockIdx.x")
    sch.bind(ki, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def tf32x3_cpu_func(D: int, N: int, K: int, Np: int | None = None):
    """The tf32x3 projection's numerics as a loop nest: gate_i[d, m, n] = bias[d, n] + the float32 sum of hi x hi over
    K plus the float32 sum of the small products (lo x hi, hi x lo) over K, of XS [2, rows, K] x WS [2, D, Np, K]
    (W's rows padded to Np >= N): the kernel's two sums (`gemm.TF32X3_TILE`, both planes a stage)."""
    from tvm.script import tirx as T

    @T.prim_func
    def main(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        rows = T.int32()
        XS = T.match_buffer(x, (2, rows, K), "float32")
        WS = T.match_buffer(w, (2, D, Np or N, K), "float32")
        Bias = T.match_buffer(bias, (D, N), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, N), "float32")
        acc = T.alloc_buffer((2,), "float32")
        for d, m, n in T.grid(D, rows, N):
            acc[0] = T.float32(0)
            acc[1] = T.float32(0)
            for k in T.serial(K):
                acc[1] = acc[1] + XS[1, m, k] * WS[0, d, n, k]
                acc[1] = acc[1] + XS[0, m, k] * WS[1, d, n, k]
                acc[0] = acc[0] + XS[0, m, k] * WS[0, d, n, k]
            GateI[d, m, n] = acc[0] + acc[1] + Bias[d, n]

    return main.with_attrs({"tirx.is_scheduled": True, "global_symbol": "gru_input_projection",
                            "tirx.noalias": True})
