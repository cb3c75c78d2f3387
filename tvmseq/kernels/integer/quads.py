"""uint8 x int8 matmuls on the CPU as dot products of byte quads (x86 AVX512-VNNI `vpdpbusd`).

A MatMulInteger whose A is uint8 (DynamicQuantizeLinear's output, centered by its zero point) and whose B is a
constant: four adjacent k of a row of A are one 32-bit broadcast, and vpdpbusd sums their products with four bytes
of each of 16 columns into the 16 int32 lanes, 64 multiply-adds an instruction against the 32 of the int16 pairs
(`pairs`), from a weight of one byte an element instead of two. B's centered values (b - zero point, up to
[-255, 255]) are stored shifted into int8 per column, the shift's and A's zero point's terms added after
(`tvmseq.cpu_ops`). ddddocr-old-int8's 8210-class head ([frames, 1024] x [1024, 8210]): int16 pairs 1.7 ms, quads
0.6 ms on the 2-core Zen 4, and the weight (8.4 MB) leaves room for the rest of the model's weights in its L3.

Layouts: a uint8 [M, K] (K a multiple of 4, rows as they are), w int8 [NB, K / 4, V * 16, 4] (`pack_quads`: V
vectors of 16 columns a block, each lane's four k adjacent), out int32 [M, N]. Column blocks over TVM's thread
pool; a block walks the rows in register tiles of R rows x V vectors, the last R - 1 rows in tiles of 4, 2, 1,
its weight block staying in the core's cache across them.
"""
from __future__ import annotations

import math

import numpy as np

from .pairs import LANES, tail_tiles

QUAD = 4                   # bytes of k a lane sums an instruction


def pack_quads(weight, vectors: int):
    """int8 [K, N] -> int8 [NB, ceil(K/4), V * 16, 4]: V vectors of 16 columns a block, each lane's 4 k adjacent."""
    K, N = weight.shape
    NB = math.ceil(N / (LANES * vectors))
    KQ = math.ceil(K / QUAD)
    padded = np.zeros((QUAD * KQ, NB * vectors * LANES), np.int8)
    padded[:K, :N] = weight
    return np.ascontiguousarray(padded.reshape(KQ, QUAD, NB, vectors * LANES).transpose(2, 0, 3, 1))


def u8s8_matmul_func(K: int, N: int, vectors: int = 2, rows: int = 8):
    """prim_func(a, w, out): out[m, n] = sum_k a[m, k] * w8[k, n] (uint8 x int8 -> int32, vpdpbusd), a [m, K]
    with K a multiple of 4, w packed by `pack_quads`."""
    from tvm import tirx
    from tvm.script import tirx as T

    assert K % QUAD == 0 and rows > 4
    V, R = vectors, rows
    NB = math.ceil(N / (LANES * V))
    KQ = K // QUAD
    m = tirx.Var("m", "int64")

    @T.macro
    def row_tile(ctx, r0, count):
        A, Wq, Y, acc, nb = T.meta_var(ctx)
        for i in T.unroll(count * V):
            acc[T.ramp(i * LANES, 1, LANES)] = T.broadcast(T.int32(0), LANES)
        for kq in T.serial(KQ):
            for r in T.unroll(count):
                quad = T.meta_var(T.reinterpret(A.vload([r0 + r, kq * QUAD], "uint8x4"), dtype="int32"))
                for v in T.unroll(V):
                    acc[T.ramp((r * V + v) * LANES, 1, LANES)] = T.call_llvm_pure_intrin(
                        "int32x16", "llvm.x86.avx512.vpdpbusd.512", acc[T.ramp((r * V + v) * LANES, 1, LANES)],
                        T.reinterpret(T.broadcast(quad, LANES), dtype="int8x64"),
                        Wq.vload([nb, kq, v * LANES, 0], "int8x64"))
        for r, v, lane in T.grid(count, V, LANES):
            if (nb * V + v) * LANES + lane < N:
                Y[r0 + r, (nb * V + v) * LANES + lane] = acc[(r * V + v) * LANES + lane]

    tail = tail_tiles(row_tile)

    @T.prim_func(s_tir=True)
    def u8s8_matmul(a: T.handle, w: T.handle, out: T.handle):
        T.func_attr({"global_symbol": "u8s8_matmul", "tirx.noalias": True})
        A = T.match_buffer(a, (m, K), "uint8")
        Wq = T.match_buffer(w, (NB, KQ, V * LANES, QUAD), "int8")
        Y = T.match_buffer(out, (m, N), "int32")
        with T.sblock("root"):
            for nb in T.parallel(NB):
                acc = T.alloc_buffer((R * V * LANES,), "int32")
                ctx = T.meta_var((A, Wq, Y, acc, nb))
                for t in T.serial(m // R):
                    row_tile(ctx, t * R, R)
                tail(ctx, m, m % R)

    return u8s8_matmul.with_attrs({"tirx.is_scheduled": True, "op_pattern": 8})


def shifted_int8(centered: np.ndarray):
    """(w8 int8 [K, N], shift int64 [N]) with centered = w8 + shift per column, or None where a column spans more
    than 256 values (an 8-bit weight less its zero point never does)."""
    if centered.size == 0:
        return None
    lo, hi = centered.min(axis=0).astype(np.int64), centered.max(axis=0).astype(np.int64)
    if np.any(hi - lo > 255):
        return None
    shift = lo + 128
    return (centered.astype(np.int64) - shift).astype(np.int8), shift
