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

import warnings
from dataclasses import dataclass, field

import tvm
from tvm import tirx
try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (a deployment box): shapes and schedules still import, no building
    T = None

from ..tune import space

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


def input_projection_func(spec) -> tirx.PrimFunc:
    """gate_i[d, t, b, j] = sum_k X[t, b, k] W[d, j, k] + bias[d, j] (float32 accumulation and output).
    `spec` is a GruSpec or an RnnSpec: W has spec.gates * hidden rows per direction. Blocks "gemm" (over
    d, t, b, j, k) and "epilogue" (the bias), as `space.gemm_func` names them."""
    D, B, I, G = spec.num_directions, spec.batch, spec.input_size, spec.gates * spec.hidden
    dt = spec.dtype

    @T.prim_func(s_tir=True)
    def gru_input_projection(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        T.func_attr({"global_symbol": "gru_input_projection", "tirx.noalias": True})
        seq = T.int32()
        X = T.match_buffer(x, (seq, B, I), dt)
        W = T.match_buffer(w, (D, G, I), dt)
        Bias = T.match_buffer(bias, (D, G), "float32")
        GateI = T.match_buffer(gate_i, (D, seq, B, G), "float32")
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
# `tvmseq bench input_projection`, session 3): too few rows per block to reuse the weight tile.


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

    @T.prim_func(s_tir=True)
    def gru_input_projection(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        T.func_attr({"global_symbol": "gru_input_projection", "tirx.noalias": True})
        rows = T.int32()
        X = T.match_buffer(x, (rows, I), dt)
        W = T.match_buffer(w, (D, G, I), dt)
        Bias = T.match_buffer(bias, (D, G), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, G), "float32")
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


def tensor_core_projection(spec, target) -> tirx.PrimFunc | None:
    """float16 on an sm_70+ GPU: the flat projection on tensor cores (dlight's MatmulTensorization: wmma
    16x16x16, fp16 inputs, fp32 accumulation), scheduled; None elsewhere or when the rule declines. The SIMT
    template runs fp16 at fp32 FMA speed (1.25 ms at batch 64, H = I = 1024, against cuBLAS's 0.20 ms)."""
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    if spec.dtype != "float16" or target is None or target.kind.name != "cuda":
        return None
    if sm_version(target) < 70:
        return None
    try:
        sch = MatmulTensorization().apply(flat_projection_func(spec), target, False)
    except RuntimeError as err:   # a schedule error: fall back to the SIMT template / dlight
        warnings.warn(f"tensor-core input projection: {str(err).strip().splitlines()[-1:]}; not used")
        return None
    return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)


def projection_for(spec, target):
    """(scheduled projection prim_func, row tile): the tensor-core projection on the flat rows (tile FLAT:
    X [seq * B, I] -> gate_i [D, seq * B, gates * H]); else on the batch layout (tile None), or for the
    padded rows of `row_tile` (then the prim_func is the projection of a batch of `tile` rows: X [tiles,
    tile, I] -> gate_i [D, tiles, tile, gates * H])."""
    import dataclasses

    flat = tensor_core_projection(spec, target)
    if flat is not None:
        return flat, FLAT
    tile = row_tile(spec, target)
    run_spec = dataclasses.replace(spec, batch=tile) if tile else spec
    return schedule_input_projection(input_projection_func(run_spec), target)["main"], tile


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
