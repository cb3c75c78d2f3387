"""Integer convolutions on the CPU as dot products of int16 pairs (x86 AVX-512 or AVX2).

ONNX ConvInteger / MatMulInteger reach TVM as conv2d / matmul of centered int16 (or int8) operands summed in int32
(`tvmseq.onnx.quantized`). Legalized and vectorized by `schedule_cpu`, a product is a sign-extending load, a
`vpmulld` and a `vpaddd` on 16 int32 lanes: one multiply-add a lane an instruction (ddddocr-old-int8's 48 -> 192
3x3 convs: 1.26 ms each on the 2-core Zen 4, where onnxruntime's VNNI kernels run its whole call in ~5 ms). Here
two adjacent reduction elements share a 32-bit lane: (a0, a1) . (w0, w1) = a0 w0 + a1 w1, exact (int16 products,
int32 sums), 32 multiply-adds an instruction: `vpdpwssd` (AVX512-VNNI, into the accumulator) or `vpmaddwd` +
`vpaddd` (AVX512BW only); with AVX2 the same pair of instructions on 256-bit vectors of 8 int32 lanes (the ISA
names: ISA_LANES). A matmul [M, K] x [K, N] runs as the 1 x 1 conv of N output channels over M columns.

Layouts (`pack_weight` packs a constant weight once, `image_pairs_func` pads and pairs the data; `tvmseq.cpu_ops`
puts both in front of the conv):
  data   int16 [N, CP, IH, IW, 2]   input channels 2 cp and 2 cp + 1 adjacent, zero padded spatially already
  weight int16 [OB, KH, KW, CP, V * L, 2]   V vectors of L (16, AVX2: 8) output channels a block, a lane's pair
  out    int32 [N, O, OH, OW]        NCHW, as the conv it replaces

Work: (image, channel block, output row) items over TVM's thread pool; an item walks its row in register tiles of
R output columns x V vectors of L channels (the `PairTile`), the last R - 1 columns in tiles of 4, 2, 1, the
weight block staying in the core's cache across the row's tiles. Each column's two channels enter as one 32-bit
broadcast. Stores go channel by channel (NCHW: L lanes a plane apart), one per output against KH x KW x CP / 2
instructions of products.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LANES = 16                 # int32 lanes of a 512-bit vector
REGISTERS = 32             # zmm registers: R x V accumulators + V weight vectors + the broadcast
# the pair instructions of a target (`tvmseq.cpu_ops`): int32 lanes and vector registers of each
ISA_LANES = {"vnni": LANES, "avx512bw": LANES, "avx2": 8}
ISA_REGISTERS = {"vnni": REGISTERS, "avx512bw": REGISTERS, "avx2": 16}


@dataclass(frozen=True)
class PairTile:
    """Register tile of the pair conv: `vectors` (V) of `lanes` output channels x `columns` (R) output columns."""
    vectors: int
    columns: int
    lanes: int = LANES

    @classmethod
    def for_channels(cls, out_channels: int, isa: str = "vnni") -> "PairTile":
        """The widest channel block (<= 4 vectors) that divides the channels' vectors evenly, then as many columns
        as the ISA's registers hold (at most 8: the tail tiles are 4, 2, 1)."""
        lanes = ISA_LANES[isa]
        vectors_all = math.ceil(out_channels / lanes)
        vectors = next(v for v in (4, 3, 2, 1) if vectors_all % v == 0)
        return cls(vectors, min(8, (ISA_REGISTERS[isa] - 2 - vectors) // vectors), lanes)


def pair_count(channels: int) -> int:
    return (channels + 1) // 2


def pack_weight(weight: np.ndarray, tile: PairTile) -> np.ndarray:
    """OIHW integer weight -> int16 [OB, KH, KW, CP, V * L, 2] (L: the tile's lanes; zero padded channels)."""
    O, C, KH, KW = weight.shape
    V, L = tile.vectors, tile.lanes
    OB = math.ceil(O / (L * V))
    padded = np.zeros((OB * V * L, 2 * pair_count(C), KH, KW), np.int16)
    padded[:O, :C] = weight
    return np.ascontiguousarray(
        padded.reshape(OB, V * L, pair_count(C), 2, KH, KW).transpose(0, 4, 5, 2, 1, 3))


def tail_tiles(tile):
    """T.macro tail(ctx, end, rest): the last `rest` (< 8) columns or rows before `end` in register tiles of 4, 2
    and 1 (rest's bits, highest first), `tile(ctx, start, count)` each: the tails of the int16-pair and byte-quad
    kernels, whose full tiles are wider than 4."""
    from tvm.script import tirx as T

    @T.macro
    def tail(ctx, end, rest):
        if rest // 4 % 2 == 1:
            tile(ctx, end - rest, 4)
        if rest // 2 % 2 == 1:
            tile(ctx, end - rest % 4, 2)
        if rest % 2 == 1:
            tile(ctx, end - 1, 1)

    return tail


# the pairwise multiply-add of each ISA: (intrinsic, whether it adds into the accumulator itself)
_PAIR_PRODUCT = {"vnni": ("llvm.x86.avx512.vpdpwssd.512", True), "avx512bw": ("llvm.x86.avx512.pmaddw.d.512", False),
                 "avx2": ("llvm.x86.avx2.pmadd.wd", False)}


def pair_conv2d_func(C: int, O: int, KH: int, KW: int, stride=(1, 1), dilation=(1, 1), tile: PairTile | None = None,
                     isa: str = "vnni"):
    """prim_func(data, weight, out) of the module doc: out[n, o, y, x] = sum over (kh, kw, c) of
    data[n, c // 2, y * sh + kh * dh, x * sw + kw * dw, c % 2] * weight of (o, c, kh, kw), in int32; N, IH, IW,
    OH, OW symbolic (OH, OW: the caller's, within the padded data). `isa`: a key of ISA_LANES; `tile` in its
    lanes (default: `PairTile.for_channels(O, isa)`)."""
    from tvm import tirx
    from tvm.script import tirx as T

    tile = tile or PairTile.for_channels(O, isa)
    V, R, L = tile.vectors, tile.columns, tile.lanes
    assert L == ISA_LANES[isa], f"a tile of {L} lanes for {isa}'s {ISA_LANES[isa]}"
    CP = pair_count(C)
    OB = math.ceil(O / (L * V))
    SH, SW = stride
    DH, DW = dilation
    n, ih, iw, oh, ow = (tirx.Var(name, "int64") for name in ("n", "ih", "iw", "oh", "ow"))
    assert 1 <= R <= 8, "the tail tiles are 4, 2 and 1 columns"
    intrinsic, accumulates = _PAIR_PRODUCT[isa]

    def dot(acc, pair, wv):
        """acc + the pairwise products of the broadcast pair and the L weight pairs."""
        a = T.reinterpret(T.broadcast(pair, L), dtype=f"int16x{2 * L}")
        if accumulates:
            return T.call_llvm_pure_intrin(f"int32x{L}", intrinsic, acc, a, wv)
        return acc + T.call_llvm_pure_intrin(f"int32x{L}", intrinsic, a, wv)

    @T.macro
    def row_tile(ctx, x0, cols):
        D, Wt, Y, acc, b, ob, y = T.meta_var(ctx)
        for i in T.unroll(cols * V):
            acc[T.ramp(i * L, 1, L)] = T.broadcast(T.int32(0), L)
        for kh, kw, cp in T.grid(KH, KW, CP):
            for c in T.unroll(cols):
                pair = T.meta_var(T.reinterpret(
                    D.vload([b, cp, y * SH + kh * DH, (x0 + c) * SW + kw * DW, 0], "int16x2"), dtype="int32"))
                for v in T.unroll(V):
                    acc[T.ramp((c * V + v) * L, 1, L)] = dot(
                        acc[T.ramp((c * V + v) * L, 1, L)], pair,
                        Wt.vload([ob, kh, kw, cp, v * L, 0], f"int16x{2 * L}"))
        for c, v, lane in T.grid(cols, V, L):
            if (ob * V + v) * L + lane < O:
                Y[b, (ob * V + v) * L + lane, y, x0 + c] = acc[(c * V + v) * L + lane]

    tail = tail_tiles(row_tile)

    @T.prim_func(s_tir=True)
    def pair_conv(d: T.handle, w: T.handle, out: T.handle):
        T.func_attr({"global_symbol": "pair_conv", "tirx.noalias": True})
        D = T.match_buffer(d, (n, CP, ih, iw, 2), "int16")
        Wt = T.match_buffer(w, (OB, KH, KW, CP, V * L, 2), "int16")
        Y = T.match_buffer(out, (n, O, oh, ow), "int32")
        with T.sblock("root"):
            for item in T.parallel(n * OB * oh):
                acc = T.alloc_buffer((R * V * L,), "int32")
                b = T.meta_var(item // (OB * oh))
                ob = T.meta_var(item // oh % OB)
                y = T.meta_var(item % oh)
                ctx = T.meta_var((D, Wt, Y, acc, b, ob, y))
                for t in T.serial(ow // R):
                    row_tile(ctx, t * R, R)
                tail(ctx, ow, ow % R)

    # opaque to FuseOps (op_pattern 8), as tvmseq's other kernels
    return pair_conv.with_attrs({"tirx.is_scheduled": True, "op_pattern": 8})


def image_pairs_func(C: int, pads, in_dtype: str = "int16"):
    """prim_func(x, out): x [N, C, H, W] (8/16-bit integers) -> int16 [N, ceil(C/2), H + top + bottom,
    W + left + right, 2], the data layout of `pair_conv2d_func` (pads: top, bottom, left, right; zeros there and
    in an odd C's last pair). Padded rows over the thread pool, each copied without a bounds check an element
    (a TE compute of the same took ~130 us for 48 x 18 x 18 pairs, one thread and a check every element)."""
    from tvm import tirx
    from tvm.script import tirx as T

    CP = pair_count(C)
    top, bottom, left, right = pads
    n, h, w = (tirx.Var(name, "int64") for name in ("n", "h", "w"))

    @T.prim_func(s_tir=True)
    def image_pairs(x: T.handle, out: T.handle):
        T.func_attr({"global_symbol": "image_pairs", "tirx.noalias": True})
        X = T.match_buffer(x, (n, C, h, w), in_dtype)
        Y = T.match_buffer(out, (n, CP, h + top + bottom, w + left + right, 2), "int16")
        with T.sblock("root"):
            for row in T.parallel(n * CP * (h + top + bottom)):
                b = T.meta_var(row // (CP * (h + top + bottom)))
                cp = T.meta_var(row // (h + top + bottom) % CP)
                y = T.meta_var(row % (h + top + bottom))
                if y < top or y >= h + top:
                    for xx, e in T.grid(w + left + right, 2):
                        Y[b, cp, y, xx, e] = T.int16(0)
                else:
                    for xx, e in T.grid(left, 2):
                        Y[b, cp, y, xx, e] = T.int16(0)
                    for xx, e in T.grid(right, 2):
                        Y[b, cp, y, left + w + xx, e] = T.int16(0)
                    for xx in T.serial(w):
                        Y[b, cp, y, left + xx, 0] = T.Cast("int16", X[b, 2 * cp, y - top, xx])
                        if 2 * cp + 1 < C:
                            Y[b, cp, y, left + xx, 1] = T.Cast("int16", X[b, 2 * cp + 1, y - top, xx])
                        else:
                            Y[b, cp, y, left + xx, 1] = T.int16(0)

    return image_pairs.with_attrs({"tirx.is_scheduled": True, "op_pattern": 8})
