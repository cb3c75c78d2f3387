"""TVM's default Relax pipeline for CUDA, with its dlight scheduling step made safe (notes/tvm_depthwise_conv_cuda.md).

TVM 0.27's CUDA pipeline schedules every PrimFunc with `dl.ApplyDefaultSchedule(Matmul, GEMV, Reduction,
GeneralReduction, Fallback)`: the first rule that matches schedules it, and whatever it does is final.
Found on small blocks of real models:
  - a rule that matches can raise: Matmul's `pad-einsum` on a dense conv1d with a symbolic time axis
    (ScheduleError), Reduction's `rfactor` on a reduction to a rank-0 tensor (ReduceMean keepdims=0 over
    every axis: `block_realize == old_block_realize_` InternalError), GEMV's `extent.value` assert on a
    depthwise conv at batch 1; the whole build fails;
  - a rule can return a schedule that does not lower: the Reduction rule on a grouped conv fails later in
    `LowerCrossThreadReduction` (`n_deepest_reduction_loops == reduction_loops.size()`);
  - a reduction whose reduction loops all have extent 1 (a depthwise 1x1 conv, a MatMul with K = 1)
    followed by an additive epilogue (a bias) computes the epilogue twice: Fallback drops the unit
    loops, then inlines the epilogue into both the `T.init` and the update of the reduction block.

`schedule_each` does what ApplyDefaultSchedule does, one PrimFunc at a time and checked: a reduction
block with only unit reduction loops first becomes the spatial block it is (`init` folded into the
update), then the rules are tried in TVM's order, and a rule's schedule is taken only when it did not
raise and the PrimFunc alone lowers through TVM's TIR pipeline; otherwise the next rule (Fallback, last,
maps the spatial loops to blockIdx/threadIdx and keeps reductions serial a thread). PrimFuncs marked
scheduled (tvmseq's kernels) are left as they are, as before.
"""
from __future__ import annotations

import contextlib
import logging
import traceback

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx
from tvm.s_tir.dlight.base.utils import get_extent
from tvm.s_tir.dlight.gpu import Matmul as DlightMatmul

from . import empty_constants, targets
from .errors import TvmseqError

log = logging.getLogger(__name__)
_STOCK = {"on": False}     # `stock_pipeline()`: TVM's own pipeline, to show its bugs in tests


def default_rules():
    """dlight's GPU rules, in the order of TVM's default CUDA pipeline, with tvmseq's rules for the reductions
    they leave before dlight's Fallback, then tvmseq's two last resorts."""
    from tvm.s_tir import dlight as dl

    return [SmallReduction(), SmallRowsMatmul(), Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(), SerialReduction(), Transpose(), dl.gpu.Fallback(), UnfusedSpatial(), OneThread()]


class Matmul(DlightMatmul):
    """dlight's Matmul rule with a CUDA tile of 16 rows x 64 columns x 32 k (its own: 32 x 64 x 16). An FC layer
    over a symbolic frame count (a model built for any number of frames) runs this SIMT schedule; at 100 frames
    the 32-row tiles left 4 row tiles x N / 64 column tiles, 28-76 blocks on 132 SMs, each stepping through k
    16 at a time with two barriers a step. Measured on the H100 (2026-11-27, FC + bias + ReLU / sigmoid, rows x
    K x N, VM call with the launch, us, dlight's tile -> this one): 100 x 161 x 400 10.8 -> 7.4, 100 x 400 x 600
    19.1 -> 11.9, 100 x 600 x 600 30.7 -> 16.4, 100 x 600 x 161 30.2 -> 16.8; 1000 rows 15.9 -> 13.9, 38.5 ->
    30.4, 62.6 -> 43.5, 30.8 -> 22.4; 8 rows 10.1 -> 7.3 ... 28.7 -> 16.5. Tried in the same sweep: 8- and
    16-row tiles with k 16 / 64, 32-column tiles (slower at 1000 rows), the weight transposed to [N, K]
    (no gain)."""

    CONFIG = dict(block_size_x=8, block_size_y=16, vthread_x=1, vthread_y=1, micro_size_x=2, micro_size_y=4,
                  micro_size_k=32, vector_size=2, unroll=256, use_shared=True, storage_align=True, inner_x=False)
    # rows from which dlight's own tile is kept: a row count that is a multiple of this (a batch of 32 or more
    # frames of a symbolic count) or a static one from MANY_ROWS_STATIC. Batch 32, two runs each, builds
    # alternated (ms, small tile everywhere -> dlight's kept here): VAD 100 / 1000 frames 0.273 -> 0.268, 2.76 ->
    # 2.67; CRNN 2.33 -> 2.27, 22.1 -> 21.0; ASR equal; the denoiser (K = 600 FCs) 1.37 -> 1.43, 13.4 -> 13.8
    MANY_ROWS_FACTOR, MANY_ROWS_STATIC = 32, 2048

    def __init__(self):
        super().__init__()
        # set by `apply` for the function at hand: dlight's apply asks get_configs for the target only
        self._many_rows = False

    def apply(self, func, target, tunable):
        self._many_rows = _many_rows(func, self.MANY_ROWS_FACTOR, self.MANY_ROWS_STATIC)
        return super().apply(func, target, tunable)

    def get_configs(self, target):
        if target.kind.name == "cuda" and not self._many_rows:
            return self.Config(**self.CONFIG)
        return super().get_configs(target)


def _many_rows(func, factor: int, static_rows: int) -> bool:
    """Whether a matmul-like PrimFunc's output rows (the product of all but its last axis) are at least
    `static_rows` (static) or provably a multiple of `factor` (symbolic: a static batch of that many times a
    frame count)."""
    from tvm.sym import Analyzer

    if not isinstance(func, tirx.PrimFunc) or not func.params:
        return False
    out = func.params[-1]                  # TVM 0.27: a PrimFunc's parameters carry their buffer's shape
    if len(getattr(out, "shape", ())) < 2:
        return False
    rows = out.shape[0]
    for dim in out.shape[1:-1]:
        rows = rows * dim
    analyzer = Analyzer()
    rows = analyzer.simplify(rows)
    if isinstance(rows, tirx.IntImm):
        return int(rows) >= static_rows
    return analyzer.can_prove_equal(tirx.floormod(rows, factor), 0)


class SmallRowsMatmul:
    """A matmul of a few rows: one reduction block `out[rows..., j] += A[rows..., k] * W[k, j]` (every extent
    static, 2 <= rows <= MAX_ROWS, W's contiguous axis the output's last), then elementwise epilogues: what an
    FC layer is in a model compiled for one frame at a batch of a few rows. dlight's Matmul tiles it for large
    row counts (an 8 x 600 x 600 FC + bias + ReLU took 26-44 us on the H100, 6-12 here) and its GEMV takes one
    row only.
    Here a thread takes one column j of a block's COLS (threadIdx.x: W read once, coalesced) and one of
    K_THREADS shares of k (threadIdx.y), keeping every row's sum in registers, then stores them to shared
    memory; after one barrier a thread per (row, column) adds the shares up (a tree of barriers per row, TVM's
    cross-thread reduction, cost more than the products) and applies the epilogue. None when it does not
    match."""

    # H100, 2026-11-26 (FC + bias + ReLU, 8 x 600 x 600 ... 16 x 600 x 600, 2 x 1024 x 1024, 8 x 1536 x 512):
    # 16 columns x 32 shares was the best of COLS {8, 16, 32} x K_THREADS {8, 16, 32}: 6-16 us a call where
    # dlight's Matmul took 22-31 (cold L2 under ncu: 7-32 us against 15-55)
    MAX_ROWS = 16
    COLS = 16
    K_THREADS = 32
    UNROLL = 8

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        loops = _small_rows_loops(sch, blocks[0], self.MAX_ROWS, self.COLS) if blocks else None
        if loops is None or not all(_spatial(sch, b) for b in blocks[1:]):
            return None
        col, k, rows = loops
        main = blocks[0]
        sch.reorder(col, k, *rows)
        rows = sch.fuse(*rows) if len(rows) > 1 else rows[0]
        col_o, col_i = sch.split(col, [None, self.COLS])
        k_o, k_i = sch.split(k, [None, self.K_THREADS])
        sch.reorder(col_o, col_i, k_i, k_o, rows)
        partial = sch.rfactor(k_i, 0)             # per (k share, row, column) sums
        col_o, col_i, k_share, k_o, _ = sch.get_loops(partial)
        sch.bind(col_o, "blockIdx.x")
        sch.bind(col_i, "threadIdx.x")
        sch.bind(k_share, "threadIdx.y")
        sch.set_scope(partial, 0, "shared")
        in_registers = sch.cache_write(partial, 0, "local")     # summed in registers, stored once
        sch.reverse_compute_at(in_registers, k_share, preserve_unit_loops=True)
        sch.decompose_reduction(partial, k_o)
        sch.annotate(k_o, "pragma_auto_unroll_max_step", self.UNROLL)
        sch.annotate(k_o, "pragma_unroll_explicit", 1)
        # a thread per (row, column) adds the shares up from shared memory (one barrier, not a tree of them)
        # and applies the epilogue to its sum in a register
        sch.reverse_compute_at(main, col_i, preserve_unit_loops=True)
        share, *row_loops = sch.get_loops(main)[2:]
        row = sch.fuse(*row_loops) if len(row_loops) > 1 else row_loops[0]
        sch.reorder(row, share)
        _, row_t = sch.split(row, [None, self.K_THREADS])
        sch.bind(row_t, "threadIdx.y")
        if len(blocks) == 1:
            return sch
        for block in blocks[1:-1]:
            sch.compute_inline(block)
        sch.reverse_compute_at(blocks[-1], col_i, preserve_unit_loops=True)
        rest = sch.get_loops(blocks[-1])[2:]
        fused = sch.fuse(*rest) if len(rest) > 1 else rest[0]
        _, row_t = sch.split(fused, [None, self.K_THREADS])
        sch.bind(row_t, "threadIdx.y")
        sch.compute_at(main, row_t, preserve_unit_loops=True)
        sch.set_scope(main, 0, "local")
        return sch


def _inlined_blocks(func):
    """(schedule, dlight's block infos after inlining what inlines) of a PrimFunc, or (None, None) where dlight
    cannot normalize it (or it is no PrimFunc)."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline

    if not isinstance(func, tirx.PrimFunc):
        return None, None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return (sch, try_inline(sch, infos)) if infos is not None else (None, None)


class SmallReduction:
    """A reduction of at most MAX_PRODUCTS products an output, over many outputs: a convolution of few input
    channels and taps (a VAD's conv1d front end, a CRNN's first conv2d), a short sum. One thread an output, its
    sum in a register, the epilogue (bias, activation) applied before the one store; producers (padding) read
    in place. dlight's Matmul took these as GEMMs of K = 5..40: shared-memory tiles and two barriers a k step for
    a handful of products, and its Fallback keeps the sum in a global buffer. None when the function is not one
    such reduction block followed by at most one elementwise consumer. Where only the outermost output extent is
    symbolic (a VAD's frames x batch rows) the output axes are fused into one thread index, split by divisions by
    constants (the VAD's two conv1d at batch 32, 1000 frames 249 -> ~120 us, the model 2.22 -> 2.09 ms; H200,
    2026-11-28); where an inner one is (a CRNN's width), the innermost axis lies over the threads and the others
    on the grid, so no index is divided by a run-time value (with one fused index, divisions by the run-time
    width took the CRNN's first conv2d at batch 8, 1000 frames from 0.2 to 0.89 ms)."""

    MAX_PRODUCTS = 64
    THREADS = 256

    def apply(self, func, target, _tunable):
        sch, infos = _inlined_blocks(func)
        if not infos or not infos[0].is_reduction() or len(infos) > 2 or any(b.is_reduction() for b in infos[1:]):
            return None
        main, kinds = infos[0].block_rv, infos[0].dom_kind()
        loops = sch.get_loops(main)
        if "O" in kinds or "S" not in kinds or not self._few_products(sch, loops, kinds):
            return None
        spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
        reduce = [lp for lp, k in zip(loops, kinds) if k == "R"]
        static_inner = all(isinstance(sch.get(lp).extent, tirx.IntImm) for lp in spatial[1:])
        sch.reorder(*spatial, *reduce)
        if static_inner:            # one fused output index: its divisions by constants
            block_x, thread_x = sch.split(sch.fuse(*spatial), [None, self.THREADS])
            sch.bind(block_x, "blockIdx.x")
        else:                       # no division by a run-time extent: the innermost over the threads
            block_x, thread_x = sch.split(spatial[-1], [None, self.THREADS])
            _bind_blocks(sch, [*spatial[:-1], block_x])
        sch.bind(thread_x, "threadIdx.x")
        if len(infos) == 2:
            sch.reverse_compute_at(infos[1].block_rv, thread_x, preserve_unit_loops=True)
            sch.set_scope(main, 0, "local")
        else:           # the sum in a register, one store
            sch.reverse_compute_at(sch.cache_write(main, 0, "local"), thread_x, preserve_unit_loops=True)
        sch.decompose_reduction(main, reduce[0])
        sch.annotate(reduce[0], "pragma_auto_unroll_max_step", self.MAX_PRODUCTS or SmallReduction.MAX_PRODUCTS)
        sch.annotate(reduce[0], "pragma_unroll_explicit", 1)
        return sch

    def _few_products(self, sch, loops, kinds) -> bool:
        products = 1
        for loop, kind in zip(loops, kinds):
            if kind == "R":
                extent = sch.get(loop).extent
                if not isinstance(extent, tirx.IntImm):
                    return False
                products *= int(extent)
        return self.MAX_PRODUCTS is None or products <= self.MAX_PRODUCTS


class SerialReduction(SmallReduction):
    """What none of dlight's GEMM / reduction rules took (they come first): one thread an output, its sum in a
    register over any static number of products. dlight's Fallback, which came next, kept each sum in global
    memory: a read-modify-write of the output per product, one after another (silero v3's STFT as a conv1d of
    256 taps into 258 channels: 95 us a call on the H200; the next six conv1d 12-50 us each)."""

    MAX_PRODUCTS = None


class Transpose:
    """One spatial block (after inlining) that reads an input along another innermost axis than it writes: a
    transpose, alone or fused with elementwise work (a Relu after a Conv computed as rows of output positions x
    channels, `onnx.conv`). dlight's Fallback gives each thread one output, so a warp's 32 reads of that input are
    32 lines apart: the CRNN benchmark's [8, 16, 200, 64] -> [8, 64, 16, 200] transpose + Relu took 24.7 us under ncu
    at batch 8, 100 frames (H200, 2026-11-29), 0.5 TB/s. Here a TILE x TILE tile of the input is read along its
    innermost axis into shared memory (rows padded by one float: no bank conflicts) and written along the
    output's. None where the block has another shape, or where either axis is shorter than a tile (static)."""

    TILE = 32
    THREADS = 256

    def apply(self, func, target, _tunable):
        sch, infos = _inlined_blocks(func)
        if not infos or len(infos) != 1 or infos[0].is_reduction() or set(infos[0].dom_kind()) != {"S"}:
            return None
        block = infos[0].block_rv
        found = self._axes(sch, block)
        if found is None:
            return None
        try:
            return self._schedule(sch, block, *found)
        except Exception:  # noqa: BLE001 - a schedule primitive refused this block: the next rule takes it
            log.debug("Transpose: %s", traceback.format_exc())
            return None

    def _axes(self, sch, block):
        """(index of the transposed read, loop position of its innermost axis, loop position of the write's, the
        read's dim indexed by the write's innermost var) or None: the write's last index is the last loop's var,
        one read's indices each a loop var or a constant, its last one another loop's var."""
        stmt = sch.get(block)
        iters = [iv.var for iv in stmt.iter_vars]
        loops = sch.get_loops(block)
        if len(loops) != len(iters) or len(stmt.writes) != 1:
            return None
        if not stmt.writes[0].region[-1].min.same_as(iters[-1]):
            return None
        position = {v: j for j, v in enumerate(iters)}
        for i, read in enumerate(stmt.reads):
            index = [r.min for r in read.region]
            if not all(isinstance(x, tirx.IntImm) or x in position for x in index) or read.source.shape[-1] == 1:
                continue
            a = position.get(index[-1])
            b_dim = next((k for k, x in enumerate(index) if x.same_as(iters[-1])), None)
            if a is None or a == len(iters) - 1 or b_dim is None:
                continue
            if all(self._long(get_extent(sch, loops[j])) for j in (a, len(loops) - 1)):
                return i, a, len(loops) - 1, b_dim
        return None

    def _long(self, extent) -> bool:
        return not isinstance(extent, int) or extent >= self.TILE

    def _schedule(self, sch, block, read_index: int, a: int, b: int, b_dim: int):
        T = self.TILE
        loops = sch.get_loops(block)
        a_out, a_in = sch.split(loops[a], [None, T])
        b_out, b_in = sch.split(loops[b], [None, T])
        # the grid's loops with a run-time extent last: `_bind_blocks` puts the innermost on blockIdx.x, the only
        # axis that takes one (a CRNN's [8, 256, W] -> [W, 8, 256] ran on the batch's 8 blocks, 187 us at batch 8,
        # 1000 frames under ncu)
        outer = sorted([lp for i, lp in enumerate(loops) if i not in (a, b)] + [a_out, b_out],
                       key=lambda lp: not isinstance(get_extent(sch, lp), int))
        sch.reorder(*outer, a_in, b_in)
        _bind_blocks(sch, outer)
        tile = sch.cache_read(block, read_index, "shared")
        sch.compute_at(tile, outer[-1], preserve_unit_loops=True)
        shape = list(sch.get(tile).writes[0].source.shape)
        symbolic = [k for k, d in enumerate(shape) if not isinstance(d, tirx.IntImm)]
        # each dim of run-time size as (d // TILE, d % TILE): the strict compaction bounds the tile's shared buffer
        # by the input's dims, a run-time size (not allocatable); its region in d % TILE is TILE at most
        def split_symbolic(*index):   # every index as int64: the run-time dims are (relax's shapes are int64)
            wide = [tirx.Cast("int64", v) for v in index]
            return [p for k, v in enumerate(wide) for p in ((v // T, v % T) if k in symbolic else (v,))]

        if symbolic:
            sch.transform_layout(tile, ("write", 0), split_symbolic, assume_injective_transform=True)
        # the write's innermost axis strides the tile by TILE + 1 floats: its reads along it hit 32 banks
        b_axis = b_dim + sum(1 for k in symbolic if k <= b_dim)
        sch.storage_align(tile, 0, axis=b_axis, factor=T, offset=1)
        copy = sch.get_loops(tile)[len(outer):]
        _, copy_x = sch.split(sch.fuse(*copy), [None, self.THREADS])
        sch.bind(copy_x, "threadIdx.x")
        _, write_x = sch.split(sch.fuse(a_in, b_in), [None, self.THREADS])
        sch.bind(write_x, "threadIdx.x")
        return sch


def _spatial(sch, block) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _small_rows_loops(sch, block, max_rows: int, min_cols: int):
    """(column loop, k loop, row loops) of a small-rows matmul block (SmallRowsMatmul), else None."""
    from tvm.s_tir.dlight.analysis import get_sblock_info

    info = get_sblock_info(sch, block)
    if any(it.kind == "O" or not isinstance(it.dom, (int, tirx.IntImm)) for it in info.iters):
        return None
    reduce = [it for it in info.iters if it.kind == "R"]
    stmt = sch.get(block)
    if len(reduce) != 1 or len(stmt.writes) != 1:
        return None
    written = stmt.writes[0].source
    reads = [r for r in stmt.reads if not r.source.same_as(written)]
    col_var = stmt.writes[0].region[-1].min
    k_var = reduce[0].var
    weights = [r for r in reads if len(r.region) == 2 and r.region[0].min.same_as(k_var)
               and r.region[1].min.same_as(col_var)]
    if len(reads) != 2 or len(weights) != 1:
        return None
    other = reads[0] if reads[1].same_as(weights[0]) else reads[1]
    if any(_uses(dim.min, col_var) for dim in other.region):
        return None
    col = [it for it in info.iters if it.kind == "S" and it.var.same_as(col_var)]
    rows = [it for it in info.iters if it.kind == "S" and not it.var.same_as(col_var)]
    n_rows = 1
    for it in rows:
        n_rows *= int(it.dom)
    if len(col) != 1 or not 2 <= n_rows <= max_rows or int(col[0].dom) < min_cols:
        return None
    return col[0].loop_rv, reduce[0].loop_rv, [it.loop_rv for it in rows]


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


class UnfusedSpatial:
    """For PrimFuncs dlight's Fallback cannot fuse (it raises on `zeros` of shape [t, 4 - n, 5], and on a max pool
    over [1, 32, T - 2, 257]: an iter-map check on the symbolic extent): each top-level block's outer loop on
    blockIdx.x, its innermost spatial loop split over threadIdx.x, no loop fused. Spatial blocks, and reductions
    whose spatial loops all lie outside their reduction loops (a pool: each thread reduces its own output); None
    otherwise (PLCMOS's three pools ran on OneThread: 12 ms a call against onnxruntime's 0.6 on the CPU)."""

    THREADS = 128

    def apply(self, func, target, _tunable):
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        spatial_counts = [_outer_spatial_loops(sch, b) for b in blocks]
        if not blocks or not all(spatial_counts):
            return None
        for block, count in zip(blocks, spatial_counts):
            loops = sch.get_loops(block)[:count]
            if len(loops) < 2:
                loops = [sch.add_unit_loop(loops[0]), *loops]
            outer, inner = sch.split(loops[-1], [None, self.THREADS])
            _bind_blocks(sch, loops[:-1])
            sch.bind(inner, "threadIdx.x")
        return sch


# the grid's y and z extents are limited (x: 2^31 - 1)
GRID_YZ_MAX = 65535


def _bind_blocks(sch, outer) -> None:
    """Up to three outer loops on blockIdx.x / y / z (innermost on x: it may be symbolic), so a pool over [1, C, T,
    W] launches C x T blocks, not one; with more loops, the leading ones fused into one where their extents are
    static (a CRNN's pool over [8, C, H, W / 2]: 8 x C on z; it ran on 8 blocks, 0.29 ms a pool at 100 frames
    on the H200); with a y / z loop of symbolic or too large an extent, the outermost alone on blockIdx.x (the
    others serial in each block)."""
    outer = list(outer)
    if len(outer) > 3 and all(isinstance(get_extent(sch, loop), int) for loop in outer[:-2]):
        outer = [sch.fuse(*outer[:-2]), *outer[-2:]]
    yz = list(reversed(outer))[1:]
    if len(outer) <= 3 and all(isinstance(e, int) and e <= GRID_YZ_MAX
                               for e in (get_extent(sch, loop) for loop in yz)):
        for loop, axis in zip(reversed(outer), ("blockIdx.x", "blockIdx.y", "blockIdx.z")):
            sch.bind(loop, axis)
    else:
        sch.bind(outer[0], "blockIdx.x")


def _outer_spatial_loops(sch, block) -> int:
    """How many of the block's loops are spatial, where each loop binds one iter in order and the spatial ones
    come first (0 where that is not the block's shape)."""
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    loops = sch.get_loops(block)
    count = next((i for i, k in enumerate(kinds) if k != tirx.IterVar.DataPar), len(kinds))
    if len(loops) != len(kinds) or any(k != tirx.IterVar.CommReduce for k in kinds[count:]):
        return 0
    return count


class OneThread:
    """The last resort: every top-level block run by one GPU thread (slow, but on the device: a PrimFunc left
    without thread bindings is compiled as host code that writes device memory, which crashed the process on
    the H100: notes/tvm_symbolic_concat_cuda.md)."""

    def apply(self, func, target, _tunable):
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            loops = sch.get_loops(block)
            top = loops[0] if loops else block
            sch.bind(sch.add_unit_loop(top), "blockIdx.x")
        return sch


@contextlib.contextmanager
def stock_pipeline():
    """Within it, `pipeline` gives TVM's default pipeline (its dlight step unchecked)."""
    before = _STOCK["on"]
    _STOCK["on"] = True
    try:
        yield
    finally:
        _STOCK["on"] = before


def pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """The Relax pipeline `build_relax` compiles with: TVM's default, with `schedule_each` for dlight on
    GPU targets."""
    if not targets.is_gpu(target) or _STOCK["on"]:
        return relax.get_default_pipeline(target)
    from tvm.relax.backend.cuda import pipeline as cuda

    @tvm.transform.module_pass(opt_level=0, name="TvmseqCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(cuda.library_dispatch_passes(target) + legalize_passes(target)
                                            + cuda.dataflow_lower_passes(target) + [empty_constants.pass_()]
                                            + cuda.finalize_passes(target))(mod)

    return _pipeline


def legalize_passes(target: tvm.target.Target) -> list:
    """TVM's CUDA legalization passes (legalize, fuse) with `schedule_each` in place of ApplyDefaultSchedule,
    after ConvertToDataflow: TVM's importer builds `main` without a dataflow block when the graph has an If
    (even one the import decides and inlines), and the importer's If branches and Loop functions are built
    outside one too; FuseOps fuses only inside dataflow blocks, so every op of those was a kernel of its own
    (silero v3 on the H200: 351 launches, ~3 ms a call against 1.2 ms of kernel time)."""
    from tvm.relax.backend.cuda import pipeline as cuda

    passes = [p for p in cuda.legalize_passes(target) if p.info.name != "ApplyDefaultSchedule"]
    return [relax.transform.ConvertToDataflow()] + passes + [schedule_each(target)]


def schedule_each(target: tvm.target.Target, rules=None) -> tvm.transform.Pass:
    """Module pass: every unscheduled PrimFunc scheduled by the first rule that works on it (module doc)."""

    @tvm.transform.module_pass(opt_level=0, name="TvmseqScheduleEach")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and not _is_scheduled(func):
                own = func.attrs.get("target", None) if func.attrs is not None else None
                scheduled = schedule_func(func, own or target, rules, gvar.name_hint)
                if scheduled is not None:
                    updates[gvar] = scheduled
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    return _pass


def schedule_func(func: tirx.PrimFunc, target, rules=None, name: str = "func") -> tirx.PrimFunc | None:
    """`func` scheduled (marked so) by the first rule whose schedule lowers, or None when no rule applies."""
    func = unit_reductions_to_spatial(func)
    last = None
    for rule in rules or default_rules():
        rule_name = type(rule).__name__
        try:
            with target:
                space = rule.apply(func, target, False)
        except Exception as err:  # noqa: BLE001 - a dlight bug: the next rule schedules this PrimFunc
            log.debug("dlight %s raised on %s: %s", rule_name, name, _first_line(err))
            continue
        if space is None:
            continue
        sch = space[0] if isinstance(space, (list, tuple)) else space
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        last = scheduled
        error = lowering_error(scheduled, target)
        if error is None:
            log.debug("%s scheduled %s", rule_name, name)
            return scheduled
        log.debug("dlight %s's schedule of %s does not lower: %s", rule_name, name, error)
    if last is None:
        # never leave a PrimFunc unscheduled on a GPU target: it would run on the host against device memory
        raise TvmseqError(f"no GPU schedule for the stock operator {name}: every rule failed")
    return last       # none lowers: the last one, so the build reports TVM's own error


def lowering_error(func: tirx.PrimFunc, target) -> str | None:
    """None when `func` alone goes through TVM's TIR lowering for `target` and CUDA code generation can take
    what it allocates, else why not (the error's first line)."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    try:
        with target:
            mod = tirx.transform.BindTarget(target)(mod)
            lower, _, _ = tvm.tirx.get_default_tir_pipeline(target)
            lowered = lower(mod)
    except Exception as err:  # noqa: BLE001 - any failure rejects this schedule
        return _first_line(err)
    return _symbolic_allocation(lowered)


def _symbolic_allocation(mod: tvm.IRModule) -> str | None:
    """A thread-local or shared buffer of symbolic size, which CUDA code generation refuses ("Can only handle
    constant size stack allocation"): dlight's Matmul rule makes a local one for an int32 MatMulInteger over a
    symbolic axis."""
    found = []

    def visit(node):
        buf = node.buffer
        if buf.scope().startswith(("local", "shared")) and not all(isinstance(d, tvm.tirx.IntImm) for d in buf.shape):
            found.append(f"{buf.scope()} buffer {buf.name} of symbolic size {list(buf.shape)}")
        return node

    for _, fn in mod.functions_items():
        tvm_ffi.structural_map(fn, [(tirx.AllocBuffer, visit)])
    return found[0] if found else None


def unit_reductions_to_spatial(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Every reduction block whose reduction iterators all have extent 1 (its loops run once) rewritten as
    the spatial block it is: `init: Y = c; Y = Y + e` -> `Y = c + e`, reduction iterators made spatial.
    With no `init` left, dlight cannot inline an epilogue into it twice."""
    def rewrite(block):
        folded = _fold_unit_reduction(block)
        return block if folded is None else folded

    return tvm_ffi.structural_map(func, [(s_tir.SBlock, rewrite)])


def unit_reductions_pass() -> tvm.transform.Pass:
    """Module pass: `unit_reductions_to_spatial` on every unscheduled PrimFunc (for other targets' schedule
    rules that inline epilogues: the same bug class)."""

    @tvm.transform.module_pass(opt_level=0, name="TvmseqUnitReductionsToSpatial")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {gvar: unit_reductions_to_spatial(func) for gvar, func in mod.functions_items()
                   if isinstance(func, tirx.PrimFunc) and not _is_scheduled(func)}
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    return _pass


def _fold_unit_reduction(block):
    if block.init is None or not isinstance(block.body, tirx.BufferStore) \
            or not isinstance(block.init, tirx.BufferStore):
        return None
    reduce_vars = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if any(iv.iter_type not in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce) for iv in block.iter_vars) \
            or not all(isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1 for iv in reduce_vars):
        return None
    store, init = block.body, block.init
    if not store.buffer.same_as(init.buffer) or not _same_indices(store.indices, init.indices):
        return None
    loads = {"self": 0, "other": 0}

    def count(load):
        if load.source.same_as(store.buffer):
            loads["self" if _same_indices(load.indices, store.indices) else "other"] += 1

    tvm_ffi.structural_walk(store.value, [(tvm.ir.TensorLoad, count)])
    if loads["other"] or loads["self"] != 1:     # not `Y = Y op e`: left alone
        return None

    def initial(load):
        return init.value if load.source.same_as(store.buffer) else load

    value = tvm_ffi.structural_map(store.value, [(tvm.ir.TensorLoad, initial)])
    iter_vars = [tirx.IterVar(iv.dom, iv.var, tirx.IterVar.DataPar) if iv.iter_type == tirx.IterVar.CommReduce
                 else iv for iv in block.iter_vars]
    reads = [r for r in block.reads if not r.source.same_as(store.buffer)]
    return s_tir.SBlock(iter_vars, reads, block.writes, block.name_hint,
                        tirx.BufferStore(store.buffer, value, store.indices), None, block.alloc_buffers,
                        block.match_buffers, block.annotations)


def _same_indices(a, b) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs is not None and "tirx.is_scheduled" in func.attrs and func.attrs["tirx.is_scheduled"])


def _first_line(err: Exception) -> str:
    """The line of a TVM error that says what failed (its message also carries tracebacks and TIR)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    said = [line for line in lines if "Check failed" in line or "Error message:" in line]
    if not lines and err.__traceback__ is not None:        # a bare assert: where it is
        frame = traceback.extract_tb(err.__traceback__)[-1]
        lines = [f"{frame.filename}:{frame.lineno}: {frame.line}"]
    return f"{type(err).__name__}: {(said or lines or [''])[0]}"[:300]
