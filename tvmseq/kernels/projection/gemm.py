"""The input projection of the per-step GRU/RNN: ONE GEMM over all time steps, and its schedule.

gate_i[d, t, b, j] = sum_k X[t, b, k] W[d, j, k] + bias[d, j], float32 accumulation and output (X and
W float32 or float16), the time axis `seq` symbolic. The GEMM block iterates (d, t, b, j, k): M is the
(t, b) pair, of extent seq * B, and the batch axis b alone is split by the M tile, so with a tile that
divides B no predicate is needed whatever seq is.

On CUDA `TiledInputProjection` schedules it with the SIMT SGEMM template of `tvmseq.tune.space`
(`space._schedule`; d and t become leading block-row axes, fused into blockIdx.y with the b tiles);
where no M tile of the template divides B it returns None and dlight's Matmul rule schedules the
function as before. N (= gates * hidden) and K (= input size) that the tiles do not divide are
zero-padded with `pad_einsum`, the padding inlined into the global -> shared copies and the unpadding
into the predicated store, so odd sizes run the same template. On the CPU the same rule builds the
template's serial variant (same loops, no thread bindings) so CI checks its numerics;
`schedule_input_projection` itself leaves the CPU loop nest to LLVM.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import tvm
from tvm import tirx
try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (a deployment box): shapes and schedules still import, no building
    T = None

from ...tune import space
from .mma import MmaGemmTile
from .wgmma import WgmmaTile

# Measured on the H100 (artifacts/bench/search_compare.json, the pool of
# gemm_m6400_n3072_k1024_f32_nk_bias = the GRU input GEMM of batch 64, seq 100, H = I = 1024): the
# best point that needs no special build options, 0.949 ms = 42.4 TFLOP/s fp32 (cuBLAS 0.871 ms). The
# overall best (bm 128 / bn 64 / bk 8 / 16x8 per thread with cp.async, 0.940 ms) is 1% faster but its
# cp.async pipeline needs PassContext options (`space.build_config`: tirx.use_async_copy and StorageRewrite
# off) that the GRU/RNN model builds do not set, and a transposing cp.async cannot move one 2-byte
# float16 element. bm 64 also divides more batch sizes than 128.
PROJECTION_GENES: dict[str, int] = {
    "bm": 64, "bn": 128, "bk": 16, "tm": 8, "tn": 8, "wm": 4, "wn": 4, "warp_n": 8, "vec": 4,
    "stages": 3, "async_copy": 0, "pad": 4,
}


def _index_check(spec, unit_values: int, unit: str):
    """T.macro(n): the host check that n units (rows or steps) of unit_values values keep X's and gate_i's 32-bit
    offsets under 2^31, one line naming the projection (these prim_funcs index rows in int32 as the hand-scheduled
    kernels do; dlight's and the SIMT template's schedules keep the check at the top of the function)."""
    from ...onnx.checks import index_limit_check

    what = f"input projection (K {spec.input_size}, {spec.num_directions} x {spec.gates * spec.hidden} gate rows)"
    return index_limit_check(what, unit_values, unit)


def input_projection_func(spec) -> tirx.PrimFunc:
    """gate_i[d, t, b, j] = sum_k X[t, b, k] W[d, j, k] + bias[d, j] (float32 accumulation and output).
    `spec` is a GruSpec or an RnnSpec: W has spec.gates * hidden rows per direction. Blocks "gemm" (over
    d, t, b, j, k) and "epilogue" (the bias), as `space.gemm_func` names them."""
    D, B, I, G = spec.num_directions, spec.batch, spec.input_size, spec.gates * spec.hidden
    dt = spec.dtype
    check_steps = _index_check(spec, B * max(I, D * G), "step")

    @T.prim_func(s_tir=True)
    def gru_input_projection(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        T.func_attr({"global_symbol": "gru_input_projection", "tirx.noalias": True})
        seq = T.int32()
        X = T.match_buffer(x, (seq, B, I), dt)
        W = T.match_buffer(w, (D, G, I), dt)
        Bias = T.match_buffer(bias, (D, G), "float32")
        GateI = T.match_buffer(gate_i, (D, seq, B, G), "float32")
        check_steps(seq)
        acc = T.sblock_alloc_buffer((D, seq, B, G), "float32")
        for d, t, b, j, k in T.grid(D, seq, B, G, I):
            with T.sblock("gemm"):
                vd, vt, vb, vj, vk = T.axis.remap("SSSSR", [d, t, b, j, k])
                with T.init():
                    acc[vd, vt, vb, vj] = T.float32(0)
                acc[vd, vt, vb, vj] = acc[vd, vt, vb, vj] + T.Cast("float32", X[vt, vb, vk]) * T.Cast(
                    "float32", W[vd, vj, vk])
        for d, t, b, j in T.grid(D, seq, B, G):
            with T.sblock("epilogue"):
                vd, vt, vb, vj = T.axis.remap("SSSS", [d, t, b, j])
                GateI[vd, vt, vb, vj] = acc[vd, vt, vb, vj] + Bias[vd, vj]

    return gru_input_projection


@dataclass(frozen=True)
class ProjectionShape:
    """The static sizes of an input projection (seq stays symbolic)."""

    directions: int
    batch: int
    n: int       # gates * hidden
    k: int       # input size
    dtype: str

    @classmethod
    def of(cls, spec, batch: int | None = None) -> "ProjectionShape":
        """The shape of `input_projection_func(spec)` (with `batch` rows per time step if given)."""
        return cls(spec.num_directions, batch or spec.batch, spec.gates * spec.hidden, spec.input_size, spec.dtype)


def projection_shape(func: tirx.PrimFunc) -> ProjectionShape | None:
    """The shape of a function shaped like `input_projection_func`'s output, else None."""
    types = [getattr(p, "ty", None) for p in func.params]   # TVM 0.27: a buffer parameter's type has its shape
    if len(types) != 4 or not all(hasattr(t, "shape") and hasattr(t, "dtype") for t in types):
        return None
    X, W, Bias, GateI = types
    if (len(X.shape), len(W.shape), len(Bias.shape), len(GateI.shape)) != (3, 3, 2, 4):
        return None
    static = [X.shape[1], X.shape[2], *W.shape, *Bias.shape, GateI.shape[0], GateI.shape[2], GateI.shape[3]]
    if not all(isinstance(s, tirx.IntImm) for s in static):
        return None
    B, I = int(X.shape[1]), int(X.shape[2])
    D, G = int(W.shape[0]), int(W.shape[1])
    if ((int(W.shape[2]), int(Bias.shape[0]), int(Bias.shape[1])) != (I, D, G)
            or (int(GateI.shape[0]), int(GateI.shape[2]), int(GateI.shape[3])) != (D, B, G)
            or str(X.dtype) not in ("float32", "float16") or str(W.dtype) != str(X.dtype)
            or str(Bias.dtype) != "float32" or str(GateI.dtype) != "float32"):
        return None
    return ProjectionShape(D, B, G, I, str(X.dtype))


def _round_up(value: int, tile: int) -> int:
    return -(-value // tile) * tile


def projection_genes(shape: ProjectionShape, base: dict, gpu_target=None
                     ) -> tuple[dict, space.GemmProblem] | None:
    """Genes for this shape derived from `base`: the largest M tile (bm) of the template's choices, at
    most base's, that divides the batch (so it divides seq * batch for every seq), with the fewest
    accumulator rows per thread given up (tm) to stay feasible; the copy vector narrowed to divide the
    input size (global rows must stay aligned); N and K rounded up to the tiles (the rule pads them).
    Returns (genes, the GemmProblem `space.feasible` accepted) or None when nothing fits."""
    vec = max(v for v in space.GENES["vec"] if v <= base["vec"] and shape.k % v == 0)
    for bm in sorted((b for b in space.GENES["bm"] if b <= base["bm"]), reverse=True):
        if shape.batch % bm:
            continue
        for tm in sorted((t for t in space.GENES["tm"] if t <= base["tm"]), reverse=True):
            for stages, async_copy in dict.fromkeys([(base["stages"], base["async_copy"]), (2, 0), (1, 0)]):
                genes = dict(base, bm=bm, tm=tm, vec=vec, stages=stages, async_copy=async_copy)
                if shape.dtype == "float16":
                    genes["async_copy"] = 0  # a transposing cp.async would move single 2-byte elements
                problem = space.GemmProblem(shape.batch, _round_up(shape.n, genes["bn"]),
                                            _round_up(shape.k, genes["bk"]), shape.dtype, "nk", bias=True)
                if space.feasible(genes, problem, gpu_target) is None:
                    return genes, problem
    return None


# Batch 8 (24, 40, ...) is left to dlight: an 8-row tile of this template (bm 8, tm 2, bn 128, bk 32,
# copy vector 2) measured 0.41 ms against dlight's 0.35 ms on the H100 at H = I = 1024 (cuBLAS 0.16 ms;
# `tvmseq bench input_projection`, 2026-11-22): too few rows per block to reuse the weight tile.


@dataclass
class TiledInputProjection:
    """dlight-style rule: `apply(func, target)` schedules an `input_projection_func` function with the
    tiled GEMM template (CUDA; on any other target the template's serial CPU variant), or returns None
    when the function is not one or no tiling of `genes` fits (no M tile divides the batch)."""

    genes: dict = field(default_factory=lambda: dict(PROJECTION_GENES))

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target):
        from tvm import s_tir

        shape = projection_shape(func)
        if shape is None:
            return None
        gpu = target is not None and target.kind.name == "cuda"
        chosen = projection_genes(shape, self.genes, target if gpu else None)
        if chosen is None:
            return None
        genes, problem = chosen
        sch = s_tir.Schedule(func)
        try:
            gemm = sch.get_sblock("gemm")
            sch.get_sblock("epilogue")
        except Exception:  # noqa: BLE001 - not the projection's blocks
            return None
        if len(sch.get_loops(gemm)) != 5:
            return None
        consumers = ("epilogue",)
        padded = (problem.n, problem.k) != (shape.n, shape.k)
        try:
            if padded:
                # zero-pad j and k to the tiles; the padding blocks are inlined into the shared-memory
                # copies, the unpadding block (there is none when only k is padded) into the (then
                # predicated) register -> global store
                sch.pad_einsum(gemm, [1, 1, 1, genes["bn"], genes["bk"]])
                (unpad,) = sch.get_consumers(gemm)
                name = sch.get(unpad).name_hint
                consumers = (name, "epilogue") if name != "epilogue" else ("epilogue",)
            return space._schedule(sch, genes, problem, gpu, consumers=consumers, inline_producers=padded)
        except RuntimeError as err:  # TVM 0.27: ScheduleError, InternalError (no tvm.TVMError any more)
            # a shape the template cannot take (seen before it was fixed: only k padded, at batch 64/256):
            # dlight schedules it instead, as before this rule existed
            reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            warnings.warn(f"tiled input projection {shape}: {reason}; using dlight")
            return None


def schedule_input_projection(func: tirx.PrimFunc, target: tvm.target.Target,
                              rule: TiledInputProjection | None = None) -> tvm.IRModule:
    """On CUDA the tiled template (`TiledInputProjection`) where it applies, else dlight's GEMM rules
    (MetaSchedule databases override either when tuned); on the CPU the unscheduled loop nest is left
    to LLVM (it is correct, and CI checks the template's numerics through the rule's CPU variant)."""
    mod = tvm.IRModule({"main": func})
    if target.kind.name != "cuda":
        return mod
    sch = (rule or TiledInputProjection()).apply(func, target)
    if sch is not None:
        return tvm.IRModule({"main": sch.mod["main"].with_attr("tirx.is_scheduled", True)})
    from tvm.s_tir import dlight as dl

    with target:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Fallback())(mod)
    return mod


# ---------------------------------------------------------------------------------------------------
# Batches no M tile divides (1, 8, 100, ...): the projection on seq * batch rows padded to whole tiles
# ---------------------------------------------------------------------------------------------------
# Padded rows with few blocks: at seq 100 and batch 1-8 the row tiles of PROJECTION_GENES (64 x 128, 8 x 8 a thread)
# make under 4 blocks an SM, and a 64 x 64 tile with 8 x 4 accumulators a thread (twice the blocks, 128 threads
# each) is faster. Measured on the H100, fp32, seq 100 (a sweep of row
# tiles, 2026-11-23, cuBLAS in the same process; notes/persistent.md): us a step B1 H1024 0.75 -> 0.52, B1 H512
# 0.40 -> 0.27, B8 H512 0.66 -> 0.51, B8 H1024 1.64 -> 1.59, bi B8 H512 0.87 -> 0.84; where the large tile makes
# more blocks (bi B8 H1024: 624, 2.72 vs 3.09 us; B100 H1024: 3768, 14.2 vs 16.5) it stays.
FEW_BLOCKS_GENES: dict[str, int] = dict(PROJECTION_GENES, bn=64, tn=4)
FEW_BLOCKS_WAVES = 4


def padded_rows_genes(spec, seq, target) -> dict:
    """The genes of the padded-rows projection of `spec` at `seq` steps: FEW_BLOCKS_GENES when seq is known
    (an int) and PROJECTION_GENES' tiles would give fewer than FEW_BLOCKS_WAVES blocks an SM of the target,
    else PROJECTION_GENES (a symbolic seq: any length, so the tile that wins on long inputs)."""
    from ..recurrent_gemm import gpu_facts

    if not isinstance(seq, int) or spec.dtype != "float32":   # float16 was not measured on this path
        return PROJECTION_GENES
    g = PROJECTION_GENES
    blocks = spec.num_directions * -(-seq * spec.batch // g["bm"]) * -(-spec.gates * spec.hidden // g["bn"])
    return FEW_BLOCKS_GENES if blocks < FEW_BLOCKS_WAVES * gpu_facts(target).num_sms else PROJECTION_GENES


def row_tile(spec, target) -> int | None:
    """Rows per tile when the projection of `spec` should run on its seq * batch rows padded to whole tiles
    of the template's M tile (a [tiles, tile, input] view, i.e. the projection of a batch of `tile`):
    on CUDA, when the template declines the batch itself and accepts the tile. None otherwise (the batch
    layout is used: tiled, or dlight, or the CPU loop nest). At batch 8, H = I = 1024 the padded rows take
    the tiled template (42 TFLOP/s at batch 64) where dlight's schedule of the batch layout ran at 14."""
    if target is None or target.kind.name != "cuda":
        return None
    if projection_genes(ProjectionShape.of(spec), PROJECTION_GENES, target) is not None:
        return None
    tile = PROJECTION_GENES["bm"]
    if projection_genes(ProjectionShape.of(spec, batch=tile), PROJECTION_GENES, target) is None:
        return None
    return tile


# `projection_for`'s row tile for the tensor-core projection: it runs on the seq * batch rows as one flat
# [rows, I] matrix (dlight pads them inside the kernel), so the caller reshapes X and gate_i around it
FLAT = "flat"


def flat_projection_func(spec) -> tirx.PrimFunc:
    """gate_i[d, m, j] = sum_k X[m, k] W[d, j, k] + bias[d, j] over the flat m = (t, b) rows (symbolic)."""
    D, I, G, dt = spec.num_directions, spec.input_size, spec.gates * spec.hidden, spec.dtype
    check_rows = _index_check(spec, max(I, D * G), "row")

    @T.prim_func(s_tir=True)
    def gru_input_projection(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        T.func_attr({"global_symbol": "gru_input_projection", "tirx.noalias": True})
        rows = T.int32()
        X = T.match_buffer(x, (rows, I), dt)
        W = T.match_buffer(w, (D, G, I), dt)
        Bias = T.match_buffer(bias, (D, G), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, G), "float32")
        check_rows(rows)
        acc = T.sblock_alloc_buffer((D, rows, G), "float32")
        for d, m, j, k in T.grid(D, rows, G, I):
            with T.sblock("gemm"):
                vd, vm, vj, vk = T.axis.remap("SSSR", [d, m, j, k])
                with T.init():
                    acc[vd, vm, vj] = T.float32(0)
                acc[vd, vm, vj] = acc[vd, vm, vj] + T.Cast("float32", X[vm, vk]) * T.Cast("float32", W[vd, vj, vk])
        for d, m, j in T.grid(D, rows, G):
            with T.sblock("epilogue"):
                vd, vm, vj = T.axis.remap("SSS", [d, m, j])
                GateI[vd, vm, vj] = acc[vd, vm, vj] + Bias[vd, vj]

    return gru_input_projection


def sm_version(target) -> int:
    """90 for sm_90a (dlight's check_sm_version gives -1 for the 'a' suffix, so its Matmul rule never
    tensorizes for the H100 target)."""
    arch = str(target.attrs.get("arch", ""))
    digits = "".join(ch for ch in arch[3:] if ch.isdigit()) if arch.startswith("sm_") else ""
    return int(digits) if digits else -1


@dataclass(frozen=True)
class TensorCoreTile:
    """Tile constants of the tensor-core projection (wmma 16x16x16 fragments): a block has warps_m x warps_n
    warps, each holding frags_m x frags_n accumulator fragments; K is staged k_frags fragments deep.
    dlight's MatmulTensorization hard-codes (4, 2, 4, 2, 4): 16 warps of 32 x 32."""

    warps_m: int = 4
    frags_m: int = 2
    warps_n: int = 4
    frags_n: int = 2
    k_frags: int = 4


# Measured on the H100 (a tile sweep, 2026-11-23, notes/persistent.md; GRU input GEMMs
# of batch 64/256, H = I = 512/1024): wmma rule 148-206 TFLOP/s at dlight's tile (no other of 9 tiles better);
# the mma.sync kernel 176-228 TFLOP/s at MMA_TILE (the best of 8), 0.33-0.36x cuBLAS.
TENSOR_CORE_TILE = TensorCoreTile()


MMA_TILE = MmaGemmTile(bm=128, bn=128, bk=64, warps_m=2, warps_n=4, stages=3)
# sm_90a: the warpgroup kernel (`wgmma`), the first tile whose bn divides N. Measured on the H100
# (a tile sweep, 2026-11-23, notes/persistent.md: GRU input
# GEMMs of batch 37/64/256, H = I = 1024): 128 x 256, 4 stages, a wgmma group kept in flight 428-495 TFLOP/s,
# 0.69-0.73x cuBLAS; 128 x 128, 3 stages 409-462 (the mma.sync kernel: 245-262)
WGMMA_TILES = (WgmmaTile(bm=128, bn=256, stages=4, inflight=True), WgmmaTile(bm=128, bn=128, stages=3))
# up to this K (4 k steps of 64) 128 x 128 in 3 stages first: two blocks an SM, one's epilogue beside the other's
# loads. Measured on an H200 (2026-11-28, `schedules/projection_sweep.py`, the float16 LSTM grid's input GEMMs,
# `artifacts/bench/projection_sweep_2026-11-28.json`): K 128 rows 25,600 x 2 directions 52.5 -> 44.7 us, K 256
# rows 25,600 (float16 gate_i) 66.0 -> 58.8, rows 6,400 23.3 -> 21.4; from K 1024 128 x 256 stays ahead (4-7%).
# Whole LSTM steps against the rule before, two rounds (`persistent_lstm_small_k_projection_2026-11-28.json`):
# 0.7-2.5% faster in all six float16 cells with K <= 256 (H128 B256 1.858 / 1.864 -> 1.810 / 1.832 us)
WGMMA_SMALL_K = 256


class TensorCoreProjection:
    """dlight's MatmulTensorization (float16 x float16 -> float32 on wmma) with its tile sizes as data
    (`TensorCoreTile`): C[S, I, J] += A[S, I, K] B[S, J, K] on reindexed, padded operands, both staged in
    shared memory (double-buffered, software-pipelined), fragments loaded by wmma, the accumulators stored
    through shared memory into the consumer chain (the bias epilogue). `apply` returns None where the rule
    does not match (no reduction block, a tensorization that fails)."""

    def __init__(self, tile: TensorCoreTile = TENSOR_CORE_TILE):
        self.tile = tile

    def apply(self, func: tirx.PrimFunc, target) -> "tvm.s_tir.Schedule | None":  # noqa: C901 - one schedule
        from tvm import s_tir
        from tvm.s_tir.dlight.analysis import get_root_block
        from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers,
                                                 get_index_map, get_reduction_blocks)
        from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group

        t = self.tile
        sch = s_tir.Schedule(func)
        reduction_blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if reduction_blocks is None:
            return None
        warp_size, vector_size, micro = 32, 4, 16
        i_factors, j_factors, k_factors = [None, 1, t.warps_m, t.frags_m], [1, None, t.warps_n, t.frags_n], \
            [None, t.k_frags]
        num_ty = t.warps_m * t.warps_n
        # normalise to C[S, I, J] += A[S, I, K] * B[S, J, K], pad I, J, K to whole block tiles
        main_block = reduction_blocks[0]
        reindex_a = sch.reindex(main_block, ("read", 0))
        reindex_b = sch.reindex(main_block, ("read", 1))
        reindex_c = sch.reindex(main_block, ("write", 0))
        matmul_map, a_map, b_map, c_map = get_index_map(sch.get(main_block))
        sch.transform_layout(reindex_a, ("write", 0), a_map)
        sch.transform_layout(reindex_b, ("write", 0), b_map)
        sch.transform_layout(reindex_c, ("read", 0), c_map)
        sch.transform_block_layout(main_block, matmul_map)
        sch.pad_einsum(main_block, [1, micro * t.warps_m * t.frags_m, micro * t.warps_n * t.frags_n,
                                    micro * t.k_frags])
        batch, i, j, k = sch.get_loops(main_block)
        i, i_inner = sch.split(i, factors=[None, micro])
        j, j_inner = sch.split(j, factors=[None, micro])
        k, k_inner = sch.split(k, factors=[None, micro])
        sch.reorder(i, j, k, i_inner, j_inner, k_inner)
        block_inner = main_block
        block_outer = sch.blockize(i_inner)
        i0, i1, i2, i3 = sch.split(i, factors=i_factors)
        j0, j1, j2, j3 = sch.split(j, factors=j_factors)
        k0, k1 = sch.split(k, k_factors)
        sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.reorder(i0, j0, i1, j1, j2, i2, k0, k1, i3, j3)
        sch.bind(batch, "blockIdx.z")
        sch.bind(sch.fuse(i0, j0), "blockIdx.x")
        sch.bind(sch.fuse(i1, j1), "blockIdx.y")
        thread_idy = sch.fuse(j2, i2)
        sch.bind(thread_idy, "threadIdx.y")

        def fetch_to_shared(block, idx):
            block_read = sch.cache_read(block, idx, "shared.dyn")
            sch.compute_at(block_read, k0)
            fused = sch.fuse(*sch.get_loops(block_read)[-2:])
            _, f_1, f_2, f_3 = sch.split(fused, factors=[None, num_ty, warp_size, vector_size])
            sch.bind(f_2, "threadIdx.x")
            sch.bind(f_1, "threadIdx.y")
            sch.vectorize(f_3)
            sch.storage_align(block_read, 0, axis=-2, factor=16, offset=8)
            sch.annotate(block_read, "tirx.manifest_shared_memory_local_stage", 1)
            sch.annotate(block_read, "double_buffer_scope", 0)
            return block_read

        a_g2s, b_g2s = fetch_to_shared(block_outer, 0), fetch_to_shared(block_outer, 1)
        auto_inline_producers(sch, a_g2s)
        auto_inline_producers(sch, b_g2s)
        a_frag = sch.cache_read(block_outer, 0, "wmma.matrix_a")
        b_frag = sch.cache_read(block_outer, 1, "wmma.matrix_b")
        sch.compute_at(a_frag, k1)
        sch.compute_at(b_frag, k1)
        to_global = sch.cache_write(block_outer, 0, "shared.dyn")
        sch.storage_align(to_global, 0, -2, 16, 4)
        store = sch.cache_write(block_outer, 0, "wmma.accumulator")
        sch.reverse_compute_at(store, thread_idy)
        sch.reverse_compute_at(to_global, thread_idy)
        si, sj = sch.get_loops(store)[-2:]
        si0, si1 = sch.split(si, factors=[None, micro])
        sj0, sj1 = sch.split(sj, factors=[None, micro])
        sch.reorder(si0, sj0, si1, sj1)
        init = sch.get_child_blocks(sch.decompose_reduction(block_outer, k0))[0]
        intrins = get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                        out_dtype="float32", trans_b=True)
        for frag, name in ((a_frag, "load_a"), (b_frag, "load_b")):
            fi, fj = sch.get_loops(frag)[-2:]
            fi0, fi1 = sch.split(fi, factors=[None, micro])
            fj0, fj1 = sch.split(fj, factors=[None, micro])
            sch.reorder(fi0, fj0, fi1, fj1)
            sch.unroll(fi0)
            sch.unroll(fj0)
            sch.tensorize(fi1, intrins[name])
        sch.tensorize(sch.get_loops(init)[-2], intrins["init"])
        sch.tensorize(sch.get_loops(store)[-2], intrins["store"])
        sch.tensorize(sch.get_loops(block_inner)[-3], intrins["compute"])
        auto_inline_consumer_chain(sch, to_global)
        _, f1, f2 = sch.split(sch.fuse(*sch.get_loops(to_global)[-2:]), factors=[None, warp_size, vector_size])
        sch.bind(f1, "threadIdx.x")
        sch.vectorize(f2)
        return sch


def tensor_core_projection(spec, target, tile: TensorCoreTile | None = None) -> tirx.PrimFunc | None:
    """float16 on a GPU: the flat projection on tensor cores, fp16 inputs, fp32 accumulation: the hand-scheduled
    warpgroup kernel (`wgmma`, sm_90a) or mma.sync kernel (`mma`, sm_80+) where its
    tile divides N and K, else `TensorCoreProjection` (wmma 16x16x16; always with an explicit `tile`); None
    elsewhere or when the rule declines. The SIMT template runs fp16 at fp32 FMA speed (1.25 ms at batch 64,
    H = I = 1024, against cuBLAS's 0.20 ms)."""
    from . import mma, wgmma

    if spec.dtype != "float16" or target is None or target.kind.name != "cuda" or sm_version(target) < 70:
        return None
    D, N, K = spec.num_directions, spec.gates * spec.hidden, spec.input_size
    if tile is None and str(target.attrs.get("arch", "")) == "sm_90a":   # wgmma exists on sm_90a only
        for wg_tile in (WGMMA_TILES[::-1] if K <= WGMMA_SMALL_K else WGMMA_TILES):
            if wgmma.supports(N, K, wg_tile) is None:
                return wgmma.projection_wgmma_func(D, N, K, True, wg_tile)
    if tile is None and sm_version(target) >= 80 and mma.supports(N, K, MMA_TILE) is None:
        return mma.projection_mma_func(D, N, K, True, MMA_TILE)
    try:
        sch = TensorCoreProjection(tile or TENSOR_CORE_TILE).apply(flat_projection_func(spec), target)
    except RuntimeError as err:   # a schedule error: fall back to the SIMT template / dlight
        warnings.warn(f"tensor-core input projection: {str(err).strip().splitlines()[-1:]}; not used")
        return None
    return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)


# float32 on sm_90a: the projection on tf32 tensor cores at float32 accuracy (`tf32x3`), X split into two tf32
# parts by a pass before it (`tf32x3.split_func`), W split once at import. Used from this many rows (seq x batch,
# both static; a length known at run time goes through the importer's row dispatch, whose few rows take the stock
# matmul), any N (W's rows are zero-padded to whole tiles, K to whole 32-column steps).
TF32X3 = "tf32x3"
TF32X3_MIN_ROWS = 512
# and from this many columns (gate rows): a product of fewer is a GEMV-like pass over X that fills at most 1/8 of
# the kernel's 128-column tile. The VAD's last layer (128 -> 1, 100 frames, H200 under ncu, 2026-11-29): the X split,
# the projection and the sigmoid apart 1.8 + 4.1 + 1.7 us, the stock matmul with the sigmoid fused 2.2
TF32X3_MIN_N = 16
# Measured on an H200 (2026-11-28, `schedules/tf32x3_sweep.py`, 17 float32 input GEMMs of 800-32,000 rows, K
# 100-1024, `artifacts/bench/tf32x3_sweep_2026-11-28.json`): split and projection together 1.2-2.1x faster than
# the SIMT projection it replaces (H1024 B256 4.77 -> 2.52 ms for 100 steps; 1.2x at K 128) and its largest error
# against a float64 GEMM 5.3-6.2e-7 at K 1024, where the SIMT kernel's and cuBLAS's float32 GEMMs had 9.9e-7-1.2e-6.
# 128 x 256 without promoted chunks was ~1.3x faster still, but the tensor cores' truncating sums over 3K gave
# 2.4e-6 there; chunks of 8 k steps (256 products of each pass) keep the error under float32's.
# Since 2026-11-29 (H200, `schedules/tf32x3_sweep.py` at the benchmark architectures' products,
# `artifacts/bench/tf32x3_sweep_2026-11-29.json`): a stage holds both tf32 planes of X and W and a k step runs the
# three products (the passes had loaded each tile pair three times and stepped 3x as often: at 800-1000 rows the
# kernel sat at ~1 us a k step, latency-bound), 64-row blocks (a block count of 1.27 waves at 128 rows: the ASR
# encoder at batch 8, 800 rows). The small products' sum kept apart from hi x hi's: in one sum the tensor cores'
# truncation to the big sum's scale gave 1.5-5x float32's error; apart, 0.8-1.3x the 128 x 128 tile's (1.5-2.0e-6
# against float64 at K 600-1024, float32's 1.4-2.6e-6). Kernel alone, us (the tile before -> this one): 1000 x 600 x
# 600 28.9 -> 19.4; the ASR layers' 2 x 1536 x 1024 at 1000 rows 94.6 -> 76.0, 8000 rows 570 -> 544, 129 rows 84 -> 27.
TF32X3_TILE = WgmmaTile(bm=64, bn=128, stages=4, inflight=True, promote=3, both_planes=True)
# From this many rows, both known at import (an LSTM cell of batch 256, 100 steps), 128-row blocks (3 stages of 64 KB):
# the same sweep at 25,600 rows x 4096 x 1024: 2427.7 us against 2556.4 for 64 rows (the tile before: 2438.5); at
# 8,000 (the ASR layer) 566.1 against 559.8, at 6,400 x 512 x 128 19.5 against 20.6. Derived from TF32X3_TILE: the
# same columns (W's padding, `tf32x3_n`), chunks and planes
TF32X3_LARGE_ROWS = 16384
TF32X3_LARGE_TILE = replace(TF32X3_TILE, bm=128, stages=3)
# Narrower tiles, widest first, for products of few rows: a 64 x 128 tile gives 100 rows x 600 columns 10 blocks on
# 132 SMs, each walking all of K at ~0.6-1 us a k step. The rule (`tf32x3_tile`): the widest tile whose blocks fill
# TF32X3_FILL of the SMs, else the narrowest. Measured on an H200 (2026-11-29, `schedules/tf32x3_sweep.py build DIR
# few-rows`, `artifacts/bench/tf32x3_sweep_few_rows_2026-11-29.json`, the projection alone with CUDA events around
# each launch, whose ~10 us host floor the smaller times sit on), us, 64 x 128 -> the rule's tile: the denoiser's
# products at 100 rows, 400 -> 1200 16.8 -> 12.8 (32 columns), 400 -> 600 18.0 -> 11.8, 600 -> 600 18.7 -> 12.9,
# 600 -> 161 20.9 -> 12.8 (16 columns); at 800 rows 600 -> 600 18.3 -> 15.8 (64), 600 -> 161 21.0 -> 14.3 (32),
# 400 -> 1200 keeps 64 x 128 (17.5; 64 columns 18.6). Stages: 8 for 32 and 16 columns (a k step's loads further ahead
# for the same shared memory), 4 for 64
TF32X3_NARROW_TILES = (replace(TF32X3_TILE, bn=64), replace(TF32X3_TILE, bn=32, stages=8),
                       replace(TF32X3_TILE, bn=16, stages=8))
TF32X3_FILL = 0.5


def tf32x3_k(K: int) -> int:
    """K padded to whole tf32 k steps (32 columns: one 128-byte row); the split pass writes the zeros."""
    return -(-K // 32) * 32


def tf32x3_n(N: int) -> int:
    """N (gate rows) padded to whole tiles: the rows of W the kernel reads (zeros past N)."""
    return -(-N // TF32X3_TILE.bn) * TF32X3_TILE.bn


def _tf32x3_blocks(rows: int, N: int, tile: WgmmaTile) -> int:
    return -(-rows // tile.bm) * -(-N // tile.bn)


def tf32x3_tile(N: int, rows: int, num_sms: int) -> WgmmaTile:
    """The tile of a tf32x3 product of `rows` rows and N columns: 128-row blocks from TF32X3_LARGE_ROWS, else the
    widest of TF32X3_TILE and TF32X3_NARROW_TILES whose blocks fill TF32X3_FILL of the SMs, else the narrowest.
    The blocks of one direction are counted (as measured: a bidirectional product runs twice as many, so it may
    get a tile narrower than it needs; not timed against the wider one)."""
    if rows >= TF32X3_LARGE_ROWS:
        return TF32X3_LARGE_TILE
    return next((t for t in (TF32X3_TILE, *TF32X3_NARROW_TILES)
                 if _tf32x3_blocks(rows, N, t) >= TF32X3_FILL * num_sms), TF32X3_NARROW_TILES[-1])


def tf32x3_row_ranges(N: int, num_sms: int) -> list:
    """`tf32x3_tile` for a row count known at run time, below TF32X3_LARGE_ROWS: [(from_rows, tile), ...] in
    ascending from_rows (the first 1): each tile from that row count up to the next's."""
    ranges, tiles = [], (TF32X3_TILE, *TF32X3_NARROW_TILES)
    for tile in reversed(tiles):   # narrowest first: the starts only grow with the tile's width
        cols = -(-N // tile.bn)
        row_tiles = -(-math.ceil(TF32X3_FILL * num_sms) // cols)   # block rows needed to fill
        start = 1 if tile is tiles[-1] else (row_tiles - 1) * tile.bm + 1
        if tf32x3_tile(N, start, num_sms) is tile:   # (a wider tile that fills from the same row count wins)
            ranges.append((start, tile))
    return ranges


def tf32x3_applies(spec, target, seq=None) -> bool:
    """Whether `tf32x3_projection` takes the spec (decided without building the kernel): a float32 spec with a
    static batch on sm_90a, at least TF32X3_MIN_ROWS rows when the length is static, at least TF32X3_MIN_N gate rows,
    an N and K (W's rows padded to whole tiles: `tf32x3_n`) that the warpgroup kernel supports."""
    from . import wgmma

    if spec.dtype != "float32" or target is None or target.kind.name != "cuda" or \
            str(target.attrs.get("arch", "")) != "sm_90a" or not isinstance(spec.batch, int):
        return False
    if isinstance(seq, int) and seq * spec.batch < TF32X3_MIN_ROWS:
        return False
    N = spec.gates * spec.hidden
    return N >= TF32X3_MIN_N and wgmma.supports(tf32x3_n(N), tf32x3_k(spec.input_size), TF32X3_TILE, 4) is None


def tf32x3_projection(spec, target, seq=None):
    """The tf32x3 warpgroup projection of a float32 spec with a static batch on sm_90a (a prim_func on XS [2, rows,
    Kp], WS [2, D, Np, Kp]; with static rows in `tf32x3_tile`'s tile, else TF32X3_TILE: the importer dispatches a
    run-time row count over `tf32x3_row_ranges`), or None where it does not apply (`tf32x3_applies`)."""
    from .. import recurrent_gemm as rg

    if not tf32x3_applies(spec, target, seq):
        return None
    N = spec.gates * spec.hidden
    tile = tf32x3_tile(N, seq * spec.batch, rg.gpu_facts(target).num_sms) if isinstance(seq, int) else TF32X3_TILE
    return tf32x3_tile_projection(spec, tile)


def tf32x3_tile_projection(spec, tile: WgmmaTile):
    """The tf32x3 warpgroup projection of a spec in `tile`, on W's rows padded for TF32X3_TILE (`tf32x3_n`)."""
    from . import wgmma

    D, N, K = spec.num_directions, spec.gates * spec.hidden, tf32x3_k(spec.input_size)
    return wgmma.projection_wgmma_func(D, N, K, True, tile, operands="tf32x3", w_rows=tf32x3_n(N))


def projection_for(spec, target, seq=None):
    """(scheduled projection prim_func, row tile): on the CPU the SIMD GEMM of `cpu_projection_func`, on a
    GPU the tensor-core projection, both on the flat rows (tile FLAT: X [seq * B, I] -> gate_i [D, seq * B,
    gates * H]; float32 on sm_90a: `tf32x3_projection`, tile TF32X3, X split into tf32 parts first); with any
    batch (spec.batch None) the flat rows scheduled by dlight; else on the batch layout (tile None), or for the
    padded rows of `row_tile` (then the prim_func is the projection of a batch of `tile` rows: X [tiles,
    tile, I] -> gate_i [D, tiles, tile, gates * H], its genes from `padded_rows_genes` at `seq` steps, an int
    when the model's length is static)."""
    import dataclasses

    if (target is None or target.kind.name != "cuda") and not row_tile(spec, target):
        return cpu_projection_func(spec, target), FLAT
    split = tf32x3_projection(spec, target, seq)
    if split is not None:
        return split, TF32X3
    flat = tensor_core_projection(spec, target)
    if flat is not None:
        return flat, FLAT
    if spec.batch is None:   # any batch: the flat rows, scheduled by dlight (the tiled template needs a static batch)
        return schedule_input_projection(flat_projection_func(spec), target)["main"], FLAT
    tile = row_tile(spec, target)
    if not tile:
        return schedule_input_projection(input_projection_func(spec), target)["main"], tile
    rule = TiledInputProjection(dict(padded_rows_genes(spec, seq, target)))
    func = input_projection_func(dataclasses.replace(spec, batch=tile))
    return schedule_input_projection(func, target, rule)["main"], tile


def pad_rows_func(batch: int, input_size: int, tile: int, dtype: str) -> tirx.PrimFunc:
    """X [seq, batch, I] -> [tiles, tile, I]: the seq * batch rows, then zero rows up to whole tiles
    (`tiles` is bound by the output's shape, which the caller sizes to ceil(seq * batch / tile))."""
    B, I = batch, input_size

    @T.prim_func(s_tir=True)
    def pad_rows(x: T.handle, y: T.handle):
        T.func_attr({"global_symbol": "pad_rows", "tirx.noalias": True})
        seq = T.int32()
        tiles = T.int32()
        X = T.match_buffer(x, (seq, B, I), dtype)
        Y = T.match_buffer(y, (tiles, tile, I), dtype)
        for mt, mi, k in T.grid(tiles, tile, I):
            with T.sblock("pad"):
                vt, vi, vk = T.axis.remap("SSS", [mt, mi, k])
                Y[vt, vi, vk] = T.if_then_else(
                    vt * tile + vi < seq * B,
                    X[T.min(vt * tile + vi, seq * B - 1) // B, T.min(vt * tile + vi, seq * B - 1) % B, vk],
                    T.Cast(dtype, 0))

    return pad_rows


# Flat rows from which the CPU projection packs W into 64-row panels (`step_gemm.cpu_pack_macro`, once a call)
# and runs the panel GEMM (outputs in the 16 AVX-512 lanes, X shared by the directions, the bias added as each
# tile is stored); fewer rows keep the k-in-lanes GEMM on W as stored: rows >= max(MIN_ROWS, I * NUM / DEN).
# Measured on the 2-core Zen 4, one thread, old vs new alternated in one process, 2026-11-27, D = 1, G = 3H
# and 4H, I = H (us, new/old): packing W costs ~15 / 60 / 240 / 2600-4000 us at H 128 / 256 / 512 / 1024, the
# panel GEMM runs 50-55 GMAC/s where the old one ran 33-35 (H128) / 42-48 (H256-1024), so it breaks even at
# ~32 / 64 / 128 / 256 rows (H128 rows 16: 1.41, 32: 0.87-1.06, 48: 0.82; H256 rows 64: 0.95, 96: 0.87;
# H512 rows 128: 0.97, 192: 0.89-0.91; H1024 rows 256: 0.97-1.00, 384: 0.85-0.93; at rows 800: 0.64 / 0.84-0.87
# / 0.81-0.84 at H 128 / 512 / 1024, rows 6400 0.67 / 0.87 / 0.82-0.84; rows 1 and 8: 2-10x slower). The threshold,
# 3/8 of I and at least 48 rows, is ~1.5x the break-even. Nodes at batch 8, seq 100 (2 threads): 0.80-0.94x the time.
# The bias added in the GEMM's store rather than a pass over the output after it (LSTM, I = H, one thread,
# alternated, 2026-11-27): H128 rows 100 / 800 0.98-0.99 / 0.98, H512 rows 800 0.97-0.99 the time (same sums).
CPU_PANEL_PROJECTION_MIN_ROWS = 48
CPU_PANEL_PROJECTION_ROWS_PER_K = (3, 8)


def cpu_panel_projection_min_rows(input_size: int) -> int:
    """Rows (seq x batch) from which the CPU projection with input size `input_size` packs W."""
    num, den = CPU_PANEL_PROJECTION_ROWS_PER_K
    return max(CPU_PANEL_PROJECTION_MIN_ROWS, -(-input_size * num // den))


def cpu_panel_projection(spec, target=None) -> bool:
    """Whether `cpu_projection_func(spec, target)` has the packed panel path (chosen at run time from
    `cpu_panel_projection_min_rows` rows): float32, W with enough rows for panels, an AVX-512 target."""
    from ..recurrent.step_gemm import cpu_pack_worthwhile

    return spec.dtype == "float32" and cpu_pack_worthwhile(spec.gates * spec.hidden, target)


def w_panels(spec, target=None):
    """How `cpu_projection_func(spec, target, packed_w=True)` takes W (`step_gemm.Panels`): where the CPU
    projection has its panel path (`cpu_panel_projection`), else None."""
    from ..recurrent.step_gemm import Panels, cpu_panel_size

    return Panels(panel=cpu_panel_size(target)) if cpu_panel_projection(spec, target) else None


# X of the CPU projection may sit at any 16-byte boundary (numpy's large arrays do; TVM's code otherwise assumes 64
# and loads with aligned vector instructions): a model input that only tvmseq kernels marked so read is passed in
# place, not copied (`build.in_place_inputs`; an LSTM node's 6.5 MB input cost 0.84 ms a call to copy on the 16-core
# Xeon, 2026-11-28). The attribute lists the PrimFunc's arguments that take such data.
IN_PLACE_ALIGN = 16
IN_PLACE_ATTR = "tvmseq.in_place_args"


def cpu_projection_func(spec, target=None, panel: bool | None = None,
                        min_rows: int | None = None, packed_w: bool = False) -> tirx.PrimFunc:
    """The projection on the CPU over the flat rows (any number: seq * batch, either symbolic):
    gate_i[d, m, j] = sum_k X[m, k] W[d, j, k] + bias[d, j]. Below `min_rows` (`cpu_panel_projection_min_rows`)
    rows, or without the panel path (`cpu_panel_projection`; `panel` forces it on or off), the step GEMM's
    SIMD loop (`step_gemm.cpu_gemm_macro`: k in vector lanes, W rows as stored, row blocks over threads) with
    the bias added as the sums are stored; X and W float32 or float16 (converted as loaded). From `min_rows`
    rows W is packed into 64-row panels in a workspace (`cpu_pack_macro`) and `cpu_panel_gemm_macro` runs on
    them, X read through a view with a zero direction stride, the bias again added as the sums are stored.
    packed_w: W comes packed (`w_panels`, by the importer: a constant packed once) and every call, of any
    number of rows, runs the panel GEMM on it."""
    from ..recurrent.step_gemm import (cpu_gemm_macro, cpu_panel_size, cpu_lanes, cpu_pack_macro, cpu_panel_count,
                                       cpu_panel_gemm_macro)

    D, I, G, dt = spec.num_directions, spec.input_size, spec.gates * spec.hidden, spec.dtype
    rows = tirx.Var("rows", "int32")
    gemm = cpu_gemm_macro(D, rows, I, dt, G, 0, cpu_lanes(target), shared_src=True, bias=True)
    use_panel = cpu_panel_projection(spec, target) if panel is None else panel
    threshold = cpu_panel_projection_min_rows(I) if min_rows is None else min_rows
    check_rows = _index_check(spec, max(I, D * G), "row")

    @T.macro
    def project(X, W, Bias, GH):
        gemm(X, W, GH, Bias)

    w_shape, w_dtype = (D, G, I), dt
    if packed_w:
        panels = w_panels(spec, target)
        if panels is None:
            raise ValueError("packed W needs the CPU projection's panel path (float32, AVX2 or AVX-512)")
        w_shape, w_dtype = panels.shape(D, G, I), "float32"
        panel_gemm = cpu_panel_gemm_macro(D, rows, I, G, 0, panels.panel, bias=True)

        @T.macro
        def project(X, W, Bias, GH):   # noqa: F811 - W packed by the importer: the panel GEMM at any row count
            Xd = T.decl_buffer((D, rows, I), dt, data=X.data, strides=(0, I, 1), align=IN_PLACE_ALIGN)
            panel_gemm(Xd, W, GH, Bias)

    if use_panel and not packed_w:
        if dt != "float32":
            raise ValueError("the packed CPU projection takes float32 X and W")
        P = cpu_panel_size(target)
        nP = cpu_panel_count(G, P)
        pack = cpu_pack_macro(D, G, I, P)
        panel_gemm = cpu_panel_gemm_macro(D, rows, I, G, 0, P, bias=True)

        @T.macro
        def project(X, W, Bias, GH):   # noqa: F811 - the packed path from `threshold` rows, else the above
            if rows >= threshold:
                Wp = T.alloc_buffer((D, nP, I, P), "float32")
                Xd = T.decl_buffer((D, rows, I), dt, data=X.data, strides=(0, I, 1), align=IN_PLACE_ALIGN)
                pack(W, Wp)
                panel_gemm(Xd, Wp, GH, Bias)
            else:
                gemm(X, W, GH, Bias)

    @T.prim_func
    def gru_input_projection(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        T.func_attr({"global_symbol": "gru_input_projection", "tirx.noalias": True})
        X = T.match_buffer(x, (rows, I), dt, align=IN_PLACE_ALIGN)
        W = T.match_buffer(w, w_shape, w_dtype)
        Bias = T.match_buffer(bias, (D, G), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, G), "float32")
        GH = T.decl_buffer((1, D, rows, G), "float32", data=GateI.data)   # the GEMM macro's [S, D, M, N] view
        check_rows(rows)
        project(X, W, Bias, GH)

    return gru_input_projection.with_attrs({"tirx.is_scheduled": True, IN_PLACE_ATTR: [0]})
