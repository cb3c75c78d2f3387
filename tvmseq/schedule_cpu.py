"""Schedules for the stock operators on llvm (the ops around tvmseq's kernels), and the CPU thread count.

TVM 0.27's default Relax pipeline for llvm (`relax.backend.cpu_generic`) legalizes and fuses the stock ops
but schedules none of them, so a Linear, a Conv or a bias+ReLU runs as the naive loop nest LegalizeOps
wrote (one thread, no SIMD). dlight has two CPU rules (`dlight.cpu.GEMV` for inner-reduction matrix-vector
products, `dlight.cpu.Reduction` for softmax/norm-like chains) and no rule for matmul, convolution or
elementwise ops. `schedule_pass` applies, to every PrimFunc not yet marked `tirx.is_scheduled` (tvmseq's
kernels are, and so are functions a MetaSchedule database scheduled):

- `Contraction`: one reduction block (matmul, batch matmul, conv1d/2d with its pad inlined) whose output's
  last axis reads every input contiguously or not at all: a register tile of `rows x 2 vectors` accumulated
  in a local buffer over the whole reduction, the tile's epilogue (bias, ReLU, sigmoid, BatchNorm) fused
  into its write-back, the row tiles split over threads, full column tiles apart from the tail
  (`pragma_loop_partition_hint`) so they vectorize;
- TVM's `dlight.cpu.GEMV` and `dlight.cpu.Reduction`;
- `Elementwise`: every remaining block's innermost loop vectorized, its outer loops fused and split over
  threads when the block is large enough to pay for the thread pool's wake-up.

Threads: TVM's runtime pool takes TVM_NUM_THREADS, else OMP_NUM_THREADS, else half of
`std::thread::hardware_concurrency()` on x86 (it assumes hyper-threading): one thread on a 2-core machine
without SMT. `configure_threads` sets TVM_NUM_THREADS to the physical cores this process may run on unless
either variable is set; it must run before the first parallel TVM call creates the pool.
"""
from __future__ import annotations

import os

import tvm
from tvm import tirx

try:
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
    from tvm.s_tir.dlight.base.utils import get_extent
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
    from tvm.sym.pattern import detect_linear_equation
except ImportError:     # TVM's runtime alone (no compiler): configure_threads still works
    CPUScheduleRule = object

PARALLEL_MIN_ELEMENTS = 1 << 15     # elementwise blocks smaller than this stay on one thread
PARALLEL_MIN_MACS = 1 << 16         # contractions with fewer multiply-adds than this stay on one thread
MAX_TILE_ROWS = 4                   # accumulator rows of a contraction tile (x 2 vectors: 8 of 32 zmm)


# ---------------------------------------------------------------------------------------------------
# Threads
# ---------------------------------------------------------------------------------------------------
def physical_cores() -> int:
    """Cores this process may run on, hyper-threads counted once (psutil when installed)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        import psutil

        logical, physical = psutil.cpu_count(logical=True), psutil.cpu_count(logical=False)
        if logical and physical and logical > physical:
            allowed = max(1, allowed * physical // logical)
    except ImportError:
        pass
    return max(1, allowed)


def configure_threads() -> int:
    """Threads TVM's CPU thread pool will use: TVM_NUM_THREADS or OMP_NUM_THREADS when set (honoured as
    given), else the physical cores (written to TVM_NUM_THREADS for the pool to read when it starts)."""
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    cores = physical_cores()
    os.environ["TVM_NUM_THREADS"] = str(cores)
    return cores


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------
def schedule_pass() -> tvm.transform.Pass:
    """dlight's ApplyDefaultSchedule with the CPU rules above (module doc); runs under the llvm target."""
    from tvm.s_tir import dlight as dl

    return dl.ApplyDefaultSchedule(Contraction(), dl.cpu.GEMV(), dl.cpu.Reduction(), Elementwise())


def schedule_func(func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    """One PrimFunc through the rules (for tests and timing): the scheduled function, or None when no rule
    applies."""
    from tvm.s_tir import dlight as dl

    for rule in (Contraction(), dl.cpu.GEMV(), dl.cpu.Reduction(), Elementwise()):
        sch = rule.apply(func, target, False)
        if sch is not None:
            return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return None


def _lanes(target, dtype: str) -> int:
    from tvm.target.codegen import llvm_get_vector_width

    bits = llvm_get_vector_width(target)
    return max(2, (bits if bits > 0 else 128) // tvm.DataType(dtype).bits)


# ---------------------------------------------------------------------------------------------------
# Contraction: matmul / conv
# ---------------------------------------------------------------------------------------------------
class Contraction(CPUScheduleRule):
    """One reduction block (+ injective producers that inline into it, + an injective epilogue), vectorized
    along the output's last axis (module doc). Only that axis needs a static extent."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = _anchor_and_epilogue(sch)
        if infos is None:
            return None
        anchor = infos[0]
        block = sch.get(anchor.block_rv)
        vec_iter = _contiguous_axis(block, anchor)
        if vec_iter is None or not isinstance(vec_iter.dom, (int, tirx.IntImm)):
            return None
        lanes = _lanes(target, str(block.writes[0].source.dtype))
        width = int(vec_iter.dom)
        padded = False
        if width % lanes and width > lanes:
            # a tail tile would put a bounds check in the vector loop (VectorizeLoop then scalarizes it):
            # pad the column axis to whole vectors (pad_einsum adds padded copies of the operands it indexes)
            try:
                sch.pad_einsum(anchor.block_rv, [lanes if it is vec_iter else 1 for it in anchor.iters])
                padded = True
            except Exception:  # noqa: BLE001 - not an einsum (a conv's shifted index): scalar tail
                pass
        if padded:
            infos = _after_padding(sch, anchor.block_rv, lanes)
            if infos is None:
                return None
            position = anchor.iters.index(vec_iter)      # pad_einsum keeps the block's iter order
            anchor = infos[0]
            vec_iter = anchor.iters[position]
            if not isinstance(vec_iter.dom, (int, tirx.IntImm)) or int(vec_iter.dom) % lanes:
                return None
            width = int(vec_iter.dom)
        _tile_contraction(sch, anchor, infos[1:], vec_iter, width, lanes, padded)
        return sch


def _after_padding(sch, anchor_rv, lanes: int):
    """After pad_einsum: the padded operand copies scheduled as elementwise blocks (they must not inline:
    the bounds check would land in the vector loop), the copy out of the padded result inlined into the
    epilogue; [anchor, epilogue] as `_anchor_and_epilogue` gives them."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    at = [i for i, b in enumerate(infos) if not b.is_injective()]
    if len(at) != 1:
        return None
    after = try_inline_contiguous_spatial(sch, infos[at[0] + 1:])
    if len(after) > 1:
        return None
    for producer in infos[:at[0]]:     # rows over threads; LLVM vectorizes the inner loop (masked loads)
        loops = sch.get_loops(producer.block_rv)
        if len(loops) > 1 and _static_product(sch, producer.block_rv) >= PARALLEL_MIN_ELEMENTS:
            sch.parallel(loops[0])
    return [infos[at[0]]] + after


def _anchor_and_epilogue(sch, lanes: int = 0):
    """[reduction block, at most one injective epilogue] after inlining what inlines; None for any other
    shape. With `lanes`, injective blocks before the reduction (pad_einsum's padded operand
    copies) are scheduled as elementwise blocks and left out of the list."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline_contiguous_spatial(sch, infos)
    if lanes:
        while infos and infos[0].is_injective():
            _vectorize_parallel(sch, infos[0].block_rv, lanes)
            infos = infos[1:]
    if not infos or infos[0].is_injective() or any(not b.is_injective() for b in infos[1:]) or len(infos) > 2:
        return None
    if any(it.kind not in "SR" for it in infos[0].iters) or len(sch.get(infos[0].block_rv).writes) != 1:
        return None
    return infos


def _tile_contraction(sch, anchor, epilogues, vec_iter, width: int, lanes: int, padded: bool) -> None:
    """Register tile (rows x columns) accumulated in a local buffer over the whole reduction, epilogue fused
    into the write-back (after padding, whose epilogue covers fewer columns than the tile: run per row tile
    instead), row tiles over threads."""
    loops = sch.get_loops(anchor.block_rv)
    spatial = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "S"]
    reduce = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "R"]
    vec_loop = loops[anchor.iters.index(vec_iter)]
    others = [lp for lp in spatial if not lp.same_as(vec_loop)]
    tile_cols = _column_tile(width, lanes)
    col_o, col_i = sch.split(vec_loop, factors=[None, tile_cols])
    vec_parts = [col_i]
    if tile_cols > lanes and tile_cols % lanes == 0:
        # one native vector per accumulator: LLVM keeps those in registers, a wider one goes to the stack
        vec_parts = list(sch.split(col_i, factors=[None, lanes]))
    rows = [lp for lp in others if get_extent(sch, lp) != 1]
    outer = [lp for lp in others if not rows or not lp.same_as(rows[-1])]
    tile_rows = []
    if rows:
        height = get_extent(sch, rows[-1])
        tile_h = _tile(height, tuple(range(MAX_TILE_ROWS, 0, -1)), fallback=1) if isinstance(height, int) else 1
        row_o, row_i = sch.split(rows[-1], factors=[None, tile_h])
        outer, tile_rows = outer + [row_o], [row_i]
    sch.reorder(*outer, col_o, *reduce, *tile_rows, *vec_parts)
    par = sch.fuse(*outer) if len(outer) > 1 else (outer[0] if outer else None)
    if par is not None and _static_product(sch, anchor.block_rv) >= PARALLEL_MIN_MACS:
        sch.parallel(par)
    acc = sch.cache_write(anchor.block_rv, 0, "local")
    if not padded:
        for epi in epilogues:
            sch.reverse_compute_inline(epi.block_rv)
    sch.reverse_compute_at(acc, col_o)
    if padded and par is not None:
        for epi in epilogues:
            sch.reverse_compute_at(epi.block_rv, par)
    sch.vectorize(vec_parts[-1])        # before decompose_reduction: the init inherits the loop kinds
    for lp in tile_rows + vec_parts[:-1]:
        sch.unroll(lp)
    sch.decompose_reduction(anchor.block_rv, reduce[0])
    inner = sch.get_loops(acc)
    if tile_cols > lanes and tile_cols % lanes == 0:
        _, last = sch.split(inner[-1], factors=[None, lanes])
        inner = sch.get_loops(acc)
    sch.vectorize(inner[-1])
    for lp in inner[:-1]:
        if _below(sch, lp, col_o) and get_extent(sch, lp) != 1:
            sch.unroll(lp)


def _static_product(sch, block_rv) -> int:
    """Iterations of the block's loops, symbolic extents counted as 64 (a sequence of some length)."""
    total = 1
    for lp in sch.get_loops(block_rv):
        extent = get_extent(sch, lp)
        total *= extent if isinstance(extent, int) else 64
    return total


def _tile(extent: int, choices: tuple, fallback: int) -> int:
    """The first of `choices` that divides `extent` (no tail to predicate), else `fallback`."""
    return next((c for c in choices if extent % c == 0), fallback)


def _column_tile(width: int, lanes: int) -> int:
    """Columns of a tile, a divisor of `width` (a tail would put a bounds check in the vector loop, and
    VectorizeLoop scalarizes a loop with one): 2 or 1 whole vectors, else the whole row up to 4 vectors, which
    LLVM splits into legal vectors; else 2 vectors with the check (correct, scalar)."""
    for cols in (2 * lanes, lanes):
        if width % cols == 0:
            return cols
    return width if width <= 4 * lanes else 2 * lanes


def _below(sch, loop, ancestor) -> bool:
    """Whether `loop` is nested (strictly) inside `ancestor`."""
    target = sch.get(ancestor)
    parent = sch.get_sref(loop).parent
    while parent is not None:
        if parent.stmt is not None and parent.stmt.same_as(target):
            return True
        parent = parent.parent
    return False


def _contiguous_axis(block, anchor):
    """The spatial iter that indexes the output's last axis alone, provided every read either ignores it or
    uses it only in its last index with coefficient 1 (stride 1 along the vector); else None."""
    if not block.writes[0].region:      # a rank-0 result (a full reduction): no axis to vectorize along
        return None
    last = block.writes[0].region[-1].min
    candidates = [it for it in anchor.iters if it.kind == "S" and isinstance(last, tirx.Var)
                  and last.same_as(it.var)]
    if not candidates:
        return None
    var = candidates[0].var
    for read in block.reads:
        for dim, rng in enumerate(read.region):
            used = _uses(rng.min, var)
            if not used:
                continue
            if dim != len(read.region) - 1:
                return None
            coeff = detect_linear_equation(rng.min, [var])
            if len(coeff) != 2 or not isinstance(coeff[0], tirx.IntImm) or coeff[0].value != 1:
                return None
    return candidates[0]


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


# ---------------------------------------------------------------------------------------------------
# Elementwise and whatever else is left
# ---------------------------------------------------------------------------------------------------
class Elementwise(CPUScheduleRule):
    """Every block: innermost loop vectorized (split by the vector width when static), outer spatial loops
    fused and run in parallel when the block has PARALLEL_MIN_ELEMENTS or more iterations. Blocks with a
    reduction keep their reduction loops serial under the parallel spatial ones."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        changed = False
        for info in try_inline_contiguous_spatial(sch, infos):
            block = sch.get(info.block_rv)
            if not block.writes:
                continue
            lanes = _lanes(target, str(block.writes[0].source.dtype))
            if info.is_injective():
                changed |= _vectorize_parallel(sch, info.block_rv, lanes)
            else:
                changed |= _parallel_spatial(sch, info)
        return sch if changed else None


def _vectorize_parallel(sch, block_rv, lanes: int) -> bool:
    loops = sch.get_loops(block_rv)
    if not loops:
        return False
    total = _static_product(sch, block_rv)
    last = get_extent(sch, loops[-1])
    changed = False
    if isinstance(last, int) and last > 1:
        if last % lanes == 0 or last < lanes:
            inner = sch.split(loops[-1], factors=[None, min(lanes, last)])[-1]
            sch.vectorize(inner)
            loops, changed = loops[:-1] + [sch.get_loops(block_rv)[-2]], True
        # an odd static width would put a bounds check in the vector loop (scalarized): left to LLVM
    head = loops[:-1] if len(loops) > 1 else loops
    if total >= PARALLEL_MIN_ELEMENTS and head:
        fused = sch.fuse(*head) if len(head) > 1 else head[0]
        if get_extent(sch, fused) != 1:
            sch.parallel(fused)
            changed = True
    return changed


def _parallel_spatial(sch, info) -> bool:
    loops = sch.get_loops(info.block_rv)
    lead = 0
    while lead < len(info.iters) and info.iters[lead].kind == "S":
        lead += 1
    if lead == 0 or _static_product(sch, info.block_rv) < PARALLEL_MIN_ELEMENTS:
        return False
    fused = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
    if get_extent(sch, fused) == 1:
        return False
    sch.parallel(fused)
    return True
