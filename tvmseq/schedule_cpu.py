"""Schedules for the stock operators on llvm (the ops around tvmseq's kernels), and the CPU thread count.

TVM 0.27's default Relax pipeline for llvm (`relax.backend.cpu_generic`) legalizes and fuses the stock ops
but schedules none of them, so a Linear, a Conv or a bias+ReLU runs as the naive loop nest LegalizeOps
wrote (one thread, no SIMD). dlight has two CPU rules (`dlight.cpu.GEMV` for inner-reduction matrix-vector
products, `dlight.cpu.Reduction` for softmax/norm-like chains) and no rule for matmul, convolution or
elementwise ops. `schedule_pass` applies, to every PrimFunc not yet marked `tirx.is_scheduled` (tvmseq's
kernels are, and so are functions a MetaSchedule database scheduled):

- `Contraction`: one reduction block (matmul, batch matmul, conv1d with its pad inlined, conv2d after its pad
  as a pass of its own) whose output's last axis reads every input contiguously or not at all (a conv's image
  axis read through its window gives way to its output channels): a register tile of
  `rows x 2 vectors` accumulated
  in a local buffer over the whole reduction, the tile's epilogue (bias, ReLU, sigmoid, BatchNorm) fused
  into its write-back, the row tiles split over threads, full column tiles apart from the tail
  (`pragma_loop_partition_hint`) so they vectorize;
- `InnerReduction`: a reduction whose output has no such axis but whose innermost reduction axis every input
  reads contiguously (a strided conv, a one-frame pointwise conv): partial sums in vector lanes (rfactor);
- TVM's `dlight.cpu.GEMV`;
- `RowSums`: sums over a row's contiguous last axis broadcast back over the row (a layer norm's mean and
  variance): each sum one pass of partial sums in vector lanes, the elementwise blocks vectorized;
- TVM's `dlight.cpu.Reduction` (softmax);
- `Elementwise`: every remaining block's innermost loop vectorized, its outer loops fused and split over
  threads when the block is large enough to pay for the thread pool's wake-up.

Then `guard_parallel_pass`: a parallel loop whose size is symbolic picks, at run time, between itself and a
serial twin (a batch-1 frame of a model with symbolic dims is too small for the thread pool).

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
    from tvm.sym import Analyzer
    from tvm.sym.pattern import detect_linear_equation
except (ImportError, ValueError):   # TVM's runtime alone (no compiler; dlight's import then raises
    # ValueError for a missing compiler function): configure_threads still works
    CPUScheduleRule = object

PARALLEL_MIN_ELEMENTS = 1 << 15     # elementwise blocks smaller than this stay on one thread
PARALLEL_MIN_MACS = 1 << 16         # contractions with fewer multiply-adds than this stay on one thread
MIN_ACCUMULATORS = 8                # vectors a register tile accumulates at least: fewer leave the FMA pipes
                                    # waiting on each other's latency (2 pipes x 4 cycles)
MAX_TILE_ROWS = 4                   # accumulator rows of a contraction tile (x 2 vectors: 8 of 32 zmm)
MATERIALIZE_PADS = True             # a contraction's padded input as its own pass (`_is_pad`), not inlined
ROW_PAD = 2 * MAX_TILE_ROWS         # a symbolic row count padded to a multiple of this where pad_einsum can


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
    given), else the physical cores (written to TVM_NUM_THREADS for the pool to read when it starts).
    The pool's workers are left unpinned (TVM_BIND_THREADS=0 unless set): TVM pins worker i to core i, as
    onnxruntime pins its own, so in one process (or beside any pinned pool) two spinning workers shared a core
    and a parallel kernel waited a scheduler tick for its late worker: on the 16-core Xeon a silero-v4 call in
    `tvmseq bench cpu` took 2-12 ms in some bursts against 0.23-0.42 ms alone; unpinned, alone 0.16 / 0.31 ms
    (pinned 0.23 / 0.42) and no such burst in the bench runs (2026-11-27)."""
    os.environ.setdefault("TVM_BIND_THREADS", "0")
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
    """dlight's ApplyDefaultSchedule with the CPU rules above (module doc), then `guard_parallel_pass`; runs
    under the llvm target. Named like the GPU's scheduling pass, so a tuning database goes in before it."""
    from tvm.s_tir import dlight as dl

    # InnerReduction before dlight's GEMV, which vectorized a one-frame pointwise conv (a GEMV on a [C_out, C_in]
    # weight) along its output channels: a gather of 64-128 weight rows every k (dtln's 0.32 of 0.44 ms)
    rules = dl.ApplyDefaultSchedule(Contraction(), InnerReduction(), dl.cpu.GEMV(), RowSums(), dl.cpu.Reduction(),
                                     Elementwise())
    return tvm.transform.Sequential([rules, guard_parallel_pass()], name="TvmseqScheduleEach")


def schedule_func(func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    """One PrimFunc through the rules (for tests and timing): the scheduled function, or None when no rule
    applies."""
    from tvm.s_tir import dlight as dl

    for rule in (Contraction(), InnerReduction(), dl.cpu.GEMV(), RowSums(), dl.cpu.Reduction(), Elementwise()):
        sch = rule.apply(func, target, False)
        if sch is not None:
            return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    return None


# ---------------------------------------------------------------------------------------------------
# Parallel loops whose size is known only at run time
# ---------------------------------------------------------------------------------------------------
# The rules above decide T.parallel from a block's static size, a symbolic dim counted as 64; a model with
# symbolic batch and time then ran ~90 tiny kernels of a batch-1, 512-sample VAD (silero v4) on TVM's thread
# pool, and every launch waits until each worker has run: 0.7 ms on one thread, 180 ms with two on the
# 2-core machine while other processes held the cores (2026-11-26). A parallel loop whose work is symbolic
# therefore gets its serial twin and picks one at run time.
def guard_parallel_pass() -> tvm.transform.Pass:
    """A PrimFunc pass: every top-level T.parallel loop of a scheduled stock function whose iteration count
    is symbolic becomes `if work >= PARALLEL_MIN_MACS: parallel loop else: the same loop serial`."""

    def transform(func, _mod, _ctx):
        if not isinstance(func, tirx.PrimFunc) or not isinstance(func.body, s_tir.SBlockRealize):
            return func
        root = func.body.block
        body = _guard_parallel(root.body)
        if body.same_as(root.body):
            return func
        block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                             root.alloc_buffers, root.match_buffers, root.annotations)
        realize = s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, block)
        # each loop, block and iteration variable must be defined once: the serial twin gets its own
        guarded = _convert_ssa(func.with_body(realize))
        # ConvertSSA leaves some bindings shared (a Let of TopK's sort, `lv`): such a function keeps its parallel
        # loop unguarded rather than fail to compile
        return guarded if s_tir.analysis.verify_well_formed(guarded, assert_mode=False) else func

    return tirx.transform.prim_func_pass(transform, opt_level=0, name="TvmseqGuardParallel")


def _convert_ssa(func: tirx.PrimFunc) -> tirx.PrimFunc:
    mod = s_tir.transform.ConvertSSA()(tvm.IRModule({"main": func}))
    return mod["main"]


def _guard_parallel(stmt):
    if isinstance(stmt, tirx.SeqStmt):
        items = [_guard_parallel(s) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(items, stmt.seq)) else tirx.SeqStmt(items)
    if not isinstance(stmt, tirx.For) or stmt.kind != tirx.ForKind.PARALLEL:
        return stmt
    work = Analyzer().simplify(_iterations(stmt))
    if isinstance(work, tirx.IntImm) or _least_work(work) >= PARALLEL_MIN_MACS:
        # decided at schedule time, or large at any size (guarded, ddddocr's convs on a 64-pixel image ran at
        # half the speed: 237 against 117 ms; not investigated further, so left out where it is not needed)
        return stmt
    serial = tirx.For(stmt.loop_var, stmt.min, stmt.extent, tirx.ForKind.SERIAL, stmt.body, None,
                      stmt.annotations)
    # the twin shares the loop's variables; the pass's ConvertSSA gives it its own
    return tirx.IfThenElse(work >= PARALLEL_MIN_MACS, stmt, serial)


def _least_work(work) -> int:
    """`work` with every symbolic size set to 1 (a batch of 1, one frame): the least the loop nest does."""
    for size in (1, 2, 8):
        # an extent divided by a symbolic size folds a division by zero at 1 (PP-OCR's convs made NHWC by TVM's
        # ConvertLayout, tried for issue #23): the next size up
        analyzer = Analyzer()
        for var in tirx.analysis.undefined_vars(work):
            analyzer.bind(var, tirx.IntImm(str(var.ty.dtype) if hasattr(var, "ty") else "int64", size))
        try:
            least = analyzer.simplify(work)
        except tvm.error.InternalError:
            continue
        return int(least) if isinstance(least, tirx.IntImm) else 0
    return 0


def _iterations(stmt):
    """Innermost iterations of a loop nest (a TIR expression: sibling nests add, nested loops multiply)."""
    if isinstance(stmt, tirx.For):
        return stmt.extent * _iterations(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        total = _iterations(stmt.seq[0])
        for item in stmt.seq[1:]:
            total = total + _iterations(item)
        return total
    if isinstance(stmt, s_tir.SBlockRealize):
        return _iterations(stmt.block.body)
    if isinstance(stmt, (tirx.IfThenElse,)):
        return _iterations(stmt.then_case)
    if isinstance(stmt, (tirx.LetStmt, tirx.AttrStmt, tirx.DeclBuffer, tirx.AllocBuffer)) and hasattr(stmt, "body"):
        return _iterations(stmt.body)
    return tirx.IntImm("int64", 1)


def vector_lanes(target, dtype: str) -> int:
    """Lanes of `target`'s SIMD vector of `dtype` (its vector width: `targets.with_vector_width`)."""
    from tvm.target.codegen import llvm_get_vector_width

    bits = llvm_get_vector_width(target)
    return max(2, (bits if bits > 0 else 128) // tvm.DataType(dtype).bits)


# ---------------------------------------------------------------------------------------------------
# Contraction: matmul / conv
# ---------------------------------------------------------------------------------------------------
class Contraction(CPUScheduleRule):
    """One reduction block (+ injective producers that inline into it, + an injective epilogue), vectorized
    along the output's last axis (module doc)."""

    def apply(self, func, target, _tunable):
        opened = _open_contraction(self, func, target)
        if opened is None:
            return None
        sch, infos, anchor, block, lanes = opened
        vec_iter = _contiguous_axis(block, anchor, lanes)
        if vec_iter is None:
            return None
        if not isinstance(vec_iter.dom, (int, tirx.IntImm)):
            # a symbolic width (ddddocr's and PP-OCR's convs along the image width): tried with a predicated last
            # tile; LoopPartition then left VectorizeLoop a loop of symbolic extent, which it refuses
            return None
        width = int(vec_iter.dom)
        padded = False
        row_iter = _symbolic_row_iter(sch, anchor, vec_iter)
        pads = [lanes if it is vec_iter and width % lanes and width > lanes
                else ROW_PAD if it is row_iter else 1 for it in anchor.iters]
        # a tail tile would put a bounds check in the vector loop (VectorizeLoop then scalarizes it): pad the
        # column axis to whole vectors (pad_einsum adds padded copies of the operands it indexes); a symbolic row
        # count to whole row tiles too (a matmul's frames: the tile's rows then need no check, `_tile_contraction`)
        columns_only = [p if it is vec_iter else 1 for p, it in zip(pads, anchor.iters)]
        for factors in [pads] + ([columns_only] if row_iter is not None else []):
            if all(p == 1 for p in factors):
                continue
            try:
                sch.pad_einsum(anchor.block_rv, factors)
                padded = True
                break
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
        # an epilogue over fewer columns than the product (tvmseq.cpu_layout's padded matmul weight, sliced back):
        # inlined, it would write the padding's columns past its buffer; it runs per tile, as after pad_einsum
        narrower = any(_narrower(sch.get(epi.block_rv).writes[0].source, block.writes[0].source) for epi in infos[1:])
        _tile_contraction(sch, anchor, infos[1:], vec_iter, width, lanes, padded or narrower)
        return sch


def _narrower(epilogue_out, product) -> bool:
    """Whether an epilogue's output has the product's rank but not its shape (a slice of it)."""
    analyzer = Analyzer()
    return len(epilogue_out.shape) == len(product.shape) and \
        not all(analyzer.can_prove_equal(x, y) for x, y in zip(epilogue_out.shape, product.shape))


class InnerReduction(CPUScheduleRule):
    """One reduction block (+ epilogue) whose output has no axis every input reads contiguously (a strided
    conv's time axis: silero's STFT as a conv with stride 64, 258 x 256 taps, ran scalar, 80% of that model)
    but whose innermost reduction axis is contiguous in every read that uses it: `lanes` partial sums a
    vector (rfactor), added across the lanes once per output; outputs over threads."""

    def apply(self, func, target, _tunable):
        opened = _open_contraction(self, func, target)
        if opened is None:
            return None
        sch, infos, anchor, block, lanes = opened
        reduce = [it for it in anchor.iters if it.kind == "R"]
        if not reduce or not isinstance(reduce[-1].dom, (int, tirx.IntImm)) or int(reduce[-1].dom) % lanes \
                or not _contiguous_reads(block, reduce[-1].var) or all(it.kind != "S" for it in anchor.iters):
            return None
        try:
            _lanes_reduction(sch, anchor, infos[1:], reduce[-1], lanes, len(block.writes[0].region))
        except Exception:  # noqa: BLE001 - e.g. an epilogue that also reads the input (a norm) does not inline:
            return None    # the rule declines, the next one schedules the function
        return sch


def _lanes_reduction(sch, anchor, epilogues, last_reduce, lanes: int, out_rank: int) -> None:
    """InnerReduction's schedule: `lanes` partial sums of the innermost reduction axis (rfactor), outputs over
    threads, the lanes added and the epilogue applied once an output."""
    loops = sch.get_loops(anchor.block_rv)
    spatial = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "S"]
    outer_reduce = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "R"][:-1]
    r_o, r_i = sch.split(loops[anchor.iters.index(last_reduce)], factors=[None, lanes])
    sch.reorder(*spatial, *outer_reduce, r_o, r_i)
    partial = sch.rfactor(r_i, factor_axis=out_rank)
    sch.set_scope(partial, 0, "local")
    spatial = sch.get_loops(partial)[:len(spatial)]     # the loops rfactor left to the partial sums
    par = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if _static_product(sch, partial) >= PARALLEL_MIN_MACS:
        sch.parallel(par)
    sch.reverse_compute_at(anchor.block_rv, par)
    for epi in epilogues:
        sch.reverse_compute_inline(epi.block_rv)
    sch.vectorize(sch.get_loops(partial)[-1])
    first_reduce = sch.get_loops(partial)[1]
    sch.decompose_reduction(partial, first_reduce)


class RowSums(CPUScheduleRule):
    """Sums over a row's contiguous last axis whose results the following elementwise blocks broadcast back
    over the row (a mean-subtract, a layer norm's mean and variance). dlight's cpu.Reduction fused every
    spatial loop of the output, the row's own axis included (the sum's keepdims axis counted as a shared one),
    and recomputed the whole sum under it for each element: dtln-2's two 256-wide norms summed 256 x 256
    values on the thread pool, 41% of its call. Here each sum is one pass: `lanes` partial sums (rfactor, as in
    InnerReduction) added once a row, each elementwise block vectorized along its last axis, rows over threads
    when large. Sums only: softmax's max and exp-sum stay with dlight (a vector exp is not what LLVM emits)."""

    def apply(self, func, target, _tunable):
        opened = _open_blocks(self, func, target)
        if opened is None:
            return None
        sch, infos = opened
        sums = [info for info in infos if not info.is_injective()]
        if not sums or not infos[-1].is_injective():
            return None
        lanes = vector_lanes(target, str(sch.get(infos[-1].block_rv).writes[0].source.dtype))
        if not all(_row_sum(sch.get(info.block_rv), info, lanes) for info in sums):
            return None
        for info in infos:
            if info.is_injective():
                _vectorize_parallel(sch, info.block_rv, lanes)
            else:
                last = [it for it in info.iters if it.kind == "R"][-1]
                _lanes_reduction(sch, info, [], last, lanes, len(sch.get(info.block_rv).writes[0].region))
        return sch


def _row_sum(block, info, lanes: int) -> bool:
    """Whether `block` adds up its reads over trailing reduction axes, the last one static, whole vectors and
    read contiguously (what `_lanes_reduction` vectorizes)."""
    kinds = "".join(it.kind for it in info.iters)
    if kinds.rstrip("R") != kinds.rstrip("R").replace("R", "") or kinds[-1] != "R" or len(block.writes) != 1:
        return False
    last = info.iters[-1]
    if not isinstance(last.dom, (int, tirx.IntImm)) or int(last.dom) % lanes or not _contiguous_reads(block, last.var):
        return False
    update = block.body
    return isinstance(update, tirx.BufferStore) and isinstance(update.value, tirx.Add) \
        and _loads(update.value.a, update.buffer) and isinstance(block.init, tirx.BufferStore) \
        and _is_zero(block.init.value)


def _loads(expr, buffer) -> bool:
    """Whether `expr` is a load of `buffer` (in TVM 0.27 a TensorLoad whose `source` is the buffer)."""
    return getattr(expr, "source", None) is not None and expr.source.same_as(buffer)


def _is_zero(value) -> bool:
    return isinstance(value, (tirx.FloatImm, tirx.IntImm)) and value.value == 0


def _contiguous_reads(block, var) -> bool:
    """Whether every read of `block` that uses `var` uses it in one index only, with coefficient 1, followed by
    dims of size 1 (the last index, or a channel index of a one-frame conv's [N, C, 1] input)."""
    used = False
    for read in block.reads:
        shape = read.source.shape
        for dim, rng in enumerate(read.region):
            if not _uses(rng.min, var):
                continue
            coeff = detect_linear_equation(rng.min, [var])
            trailing_ones = all(isinstance(n, (int, tirx.IntImm)) and int(n) == 1 for n in shape[dim + 1:])
            if not trailing_ones or len(coeff) != 2 or not isinstance(coeff[0], tirx.IntImm) or coeff[0].value != 1:
                return False
            used = True
    return used


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


def _open_blocks(rule, func, target):
    """(schedule, its blocks after inlining what inlines) of a PrimFunc `rule` may take on `target`, or None:
    what RowSums and Elementwise begin with."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    return sch, try_inline_contiguous_spatial(sch, infos)


def _open_contraction(rule, func, target):
    """(schedule, [anchor, epilogue], anchor, its block, vector lanes of its output dtype) of a PrimFunc one
    reduction rule may take (module doc), or None: what Contraction and InnerReduction both begin with."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = _anchor_and_epilogue(sch, vector_lanes(target, "float32"), keep_pads=MATERIALIZE_PADS)
    if infos is None:
        return None
    block = sch.get(infos[0].block_rv)
    return sch, infos, infos[0], block, vector_lanes(target, str(block.writes[0].source.dtype))


def _anchor_and_epilogue(sch, lanes: int = 0, keep_pads: bool = False):
    """[reduction block, at most one injective epilogue] after inlining what inlines; None for any other
    shape. With `lanes`, injective blocks before the reduction (pad_einsum's padded operand
    copies; with `keep_pads` a conv's padded input, `_is_pad`) are scheduled as elementwise blocks and left out of
    the list."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    pads = [b for b in infos if keep_pads and _is_pad(sch, b)]
    infos = pads + try_inline_contiguous_spatial(sch, [b for b in infos if not any(b is p for p in pads)])
    if lanes:
        while infos and infos[0].is_injective():
            _vectorize_parallel(sch, infos[0].block_rv, lanes)
            infos = infos[1:]
    if not infos or infos[0].is_injective() or any(not b.is_injective() for b in infos[1:]) or len(infos) > 2:
        return None
    if any(it.kind not in "SR" for it in infos[0].iters) or len(sch.get(infos[0].block_rv).writes) != 1:
        return None
    return infos


def _is_pad(sch, info) -> bool:
    """Whether a block copies an image into a larger buffer with a constant outside it (a 2-D or 3-D conv's
    padding: if_then_else(in bounds, x[...], 0)). Kept as its own pass over the input rather than inlined, the
    conv's innermost loop reads the padded copy with no bounds check (inlined, each multiply-add of a 3 x 3 conv's
    tile tested four bounds: PLCMOS's convs 1.5-1.8 -> 0.9-1.0 ms, ddddocr 10.1 -> 9.4 ms a call). Not for conv1d:
    silero's convs over a few frames took 9-18% longer with the extra pass (2 bounds a tap inlined)."""
    writes = sch.get(info.block_rv).writes
    if not info.is_injective() or len(writes) != 1 or len(writes[0].region) < 4:
        return False
    value = getattr(sch.get(info.block_rv).body, "value", None)
    return isinstance(value, tvm.ir.Call) and getattr(value.op, "name", "") == "prim.if_then_else" \
        and isinstance(value.args[2], (tirx.FloatImm, tirx.IntImm)) \
        and isinstance(value.args[1], tvm.ir.expr.TensorLoad)


def _tile_contraction(sch, anchor, epilogues, vec_iter, width: int, lanes: int, padded: bool) -> None:
    """Register tile (rows x columns) accumulated in a local buffer over the whole reduction, epilogue fused
    into the write-back (after padding, whose epilogue covers fewer columns than the tile: run per row tile
    instead), (column tile, row tile) pairs over threads."""
    loops = sch.get_loops(anchor.block_rv)
    spatial = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "S"]
    reduce = [lp for it, lp in zip(anchor.iters, loops) if it.kind == "R"]
    vec_loop = loops[anchor.iters.index(vec_iter)]
    others = [lp for lp in spatial if not lp.same_as(vec_loop)]
    rows = _row_candidates(sch, anchor, vec_iter, others)
    # rows of a symbolic count not padded to whole tiles (`Contraction`: pad_einsum refused): a tile of one row, as
    # wide as 4 vectors. A taller tile predicates its rows against the count inside the reduction loop, and LLVM
    # then keeps the accumulators in memory (a load and a store around every multiply-add: PP-OCR's convs and head
    # at 15 GMAC/s a core on the Zen 4)
    one_row = bool(rows) and not _whole_row_tiles(get_extent(sch, rows[-1]))
    tile_cols = _one_row_columns(width, lanes) if one_row else _column_tile(width, lanes)
    if one_row and tile_cols // _vector_part(tile_cols, lanes) < MIN_ACCUMULATORS:
        row_loop = _static_rows_instead(sch, rows, _max_tile_rows(_column_tile(width, lanes), lanes))
        if row_loop is not None:
            rows, one_row = [lp for lp in rows if not lp.same_as(row_loop)] + [row_loop], False
            tile_cols = _column_tile(width, lanes)
    max_rows = 1 if one_row else _max_tile_rows(tile_cols, lanes)
    col_o, col_i = sch.split(vec_loop, factors=[None, tile_cols])
    vec_parts = [col_i]
    vector = _vector_part(tile_cols, lanes)
    if vector < tile_cols:
        # one native vector per accumulator: LLVM keeps those in registers, a wider one goes to the stack
        vec_parts = list(sch.split(col_i, factors=[None, vector]))
    outer = [lp for lp in others if not rows or not lp.same_as(rows[-1])]
    tile_rows, row_o = [], None
    if rows:
        row_o, row_i = sch.split(rows[-1], factors=[None, _row_tile(get_extent(sch, rows[-1]), max_rows)])
        tile_rows = [row_i]
    # column tiles outside the row tiles: a thread's share of the work is a range of columns, whose slice of
    # the weight stays in its cache while every row tile passes (a few frames: the weight is read once, not
    # once per row as when rows were outermost)
    sch.reorder(*outer, col_o, *([row_o] if row_o is not None else []), *reduce, *tile_rows, *vec_parts)
    # a static number of row tiles joins the threads' loop; a symbolic one stays a serial loop inside it (fused,
    # its symbolic divisor reached a constant fold as zero: silero v5's Gemm with a symbolic batch)
    static_rows = row_o is not None and isinstance(get_extent(sch, row_o), int)
    head = outer + [col_o] + ([row_o] if static_rows else [])
    symbolic = [lp for lp in head if not isinstance(get_extent(sch, lp), int)]
    if len(symbolic) > 1:
        # two symbolic loops fused (PP-OCR's batch and image height): the tile's region below is no longer
        # bounded by constants (its write-back loops cannot unroll); all but the last stay serial outside, the
        # last goes first in the fused loop (divided by constants only)
        head = symbolic[-1:] + [lp for lp in head if isinstance(get_extent(sch, lp), int)]
        sch.reorder(*symbolic[:-1], *head)
    par = sch.fuse(*head) if len(head) > 1 else head[0]
    if _static_product(sch, anchor.block_rv) >= PARALLEL_MIN_MACS:
        sch.parallel(par)
    tile = row_o if row_o is not None and not static_rows else par    # the loop of one register tile
    acc = sch.cache_write(anchor.block_rv, 0, "local")
    if not padded:
        for epi in epilogues:
            sch.reverse_compute_inline(epi.block_rv)
    sch.reverse_compute_at(acc, tile)
    if padded:
        for epi in epilogues:
            sch.reverse_compute_at(epi.block_rv, tile)
    sch.vectorize(vec_parts[-1])        # before decompose_reduction: the init inherits the loop kinds
    for lp in tile_rows + vec_parts[:-1]:
        sch.unroll(lp)
    sch.decompose_reduction(anchor.block_rv, reduce[0])
    inner = sch.get_loops(acc)
    _columns_innermost(sch, anchor, vec_iter, rows, others, inner, tile)
    inner = sch.get_loops(acc)
    if vector < tile_cols:
        _, last = sch.split(inner[-1], factors=[None, vector])
        inner = sch.get_loops(acc)
    sch.vectorize(inner[-1])
    for lp in inner[:-1]:
        if _below(sch, lp, tile) and get_extent(sch, lp) != 1:
            sch.unroll(lp)


def _columns_innermost(sch, anchor, vec_iter, rows, others, acc_loops, tile) -> None:
    """The write-back of a tile whose columns are not the output's last axis (a conv's output channels in
    NCHW): its loops follow the output's axes, rows innermost; the columns go innermost instead, so it reads the
    accumulators as the vectors they are (vectorized along the rows, predicated, the accumulators went to the
    stack, and every multiply-add of the tile loaded and stored them: 10x slower), and stores them strided."""
    region = sch.get(anchor.block_rv).writes[0].region
    dims = [i for i, rng in enumerate(region) if isinstance(rng.min, tirx.Var)]
    vec_dim = next(i for i in dims if region[i].min.same_as(vec_iter.var))
    if vec_dim == len(region) - 1:
        return
    # the accumulators' local buffer with the columns last: one vector each
    order = [d for d in range(len(region)) if d != vec_dim] + [vec_dim]
    sch.transform_layout(anchor.block_rv, ("write", 0), lambda *idx: [idx[d] for d in order])
    loops = [lp for lp in acc_loops if _below(sch, lp, tile) and get_extent(sch, lp) != 1]
    if len(loops) != 2:
        return
    spatial_iters = [it for it in anchor.iters if it.kind == "S" and it is not vec_iter]
    row_iter = next(it for it, lp in zip(spatial_iters, others) if lp.same_as(rows[-1]))
    row_dim = next(i for i in dims if region[i].min.same_as(row_iter.var))
    if vec_dim < row_dim:
        sch.reorder(loops[1], loops[0])


def _row_candidates(sch, anchor, vec_iter, others) -> list:
    """The loops a register tile's rows may run along, the preferred one last: non-unit loops, those that
    the vector-loaded operands do not index first (a vector loaded once then serves every row of the tile: a
    conv's output channels, whose weights are scalars, rather than its output rows)."""
    block = sch.get(anchor.block_rv)
    vec_reads = [r for r in block.reads if any(_uses(rng.min, vec_iter.var) for rng in r.region)]
    spatial_iters = [it for it in anchor.iters if it.kind == "S" and it is not vec_iter]
    rows = [(it, lp) for it, lp in zip(spatial_iters, others) if get_extent(sch, lp) != 1]

    def reuses_vectors(it) -> bool:
        return not any(_uses(rng.min, it.var) for r in vec_reads for rng in r.region)

    return [lp for it, lp in rows if not reuses_vectors(it)] + [lp for it, lp in rows if reuses_vectors(it)]


def _row_tile(height, max_rows: int = MAX_TILE_ROWS) -> int:
    """Rows of a register tile: a divisor of a static height up to `max_rows`, else `max_rows` with a
    partial last tile (its rows are predicated, outside the vector loop): a height of 5, 37 or a symbolic
    number of frames got 1-row tiles, which read the weight once per row."""
    if isinstance(height, int) and height <= max_rows:
        return height
    if isinstance(height, int):
        exact = _tile(height, tuple(range(max_rows, 1, -1)), fallback=0)
        if exact >= max_rows // 2:
            return exact
    return max_rows


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


def _symbolic_row_iter(sch, anchor, vec_iter):
    """The iterator a register tile's rows would run along (`_row_candidates`' choice) when its extent is
    symbolic, else None."""
    loops = sch.get_loops(anchor.block_rv)
    pairs = [(it, lp) for it, lp in zip(anchor.iters, loops) if it.kind == "S" and it is not vec_iter]
    rows = _row_candidates(sch, anchor, vec_iter, [lp for _, lp in pairs])
    if not rows or isinstance(get_extent(sch, rows[-1]), int):
        return None
    return next(it for it, lp in pairs if lp.same_as(rows[-1]))


def _max_tile_rows(tile_cols: int, lanes: int) -> int:
    """Rows of a register tile at most: as many accumulators whether its columns are one vector or more."""
    return MAX_TILE_ROWS if tile_cols > lanes else 2 * MAX_TILE_ROWS


def _static_rows_instead(sch, rows, max_rows: int):
    """A loop of static extent among the row candidates (a conv's output height) that whole tiles of 2 to
    `max_rows` rows cover, else None: the rows of a register tile where the preferred one (its output width) is
    symbolic and a one-row tile would hold fewer than MIN_ACCUMULATORS vectors. ddddocr's 24-channel conv on AVX2
    (8 lanes) had one accumulator, every multiply-add waiting for the one before it: 0.87 ms a call for the two
    (2-core Zen 3, 2026-11-28). A partial tile is not taken: its rows' predicate would sit in the reduction."""
    def whole_tiles(extent) -> bool:
        return isinstance(extent, int) and extent >= 2 and extent % _row_tile(extent, max_rows) == 0

    return next((lp for lp in reversed(rows[:-1]) if whole_tiles(get_extent(sch, lp))), None)


def _whole_row_tiles(extent) -> bool:
    """Whether a row extent splits into row tiles without a bounds check: static, or a multiple of ROW_PAD."""
    return isinstance(extent, int) or Analyzer().can_prove_equal(tirx.floormod(extent, ROW_PAD), 0)


def _one_row_columns(width: int, lanes: int) -> int:
    """Columns of a one-row tile: 4, 2 or 1 whole vectors dividing `width`, else `_column_tile`'s choice."""
    return next((v * lanes for v in (4, 2, 1) if width % (v * lanes) == 0), _column_tile(width, lanes))


def _vector_part(tile_cols: int, lanes: int) -> int:
    """Columns of one vector of a tile: whole native vectors, else half vectors where they divide the tile. A
    24-channel conv's tile as one <24 x float> (or <24 x i32> of sign-extended int16 weights) had LLVM take its
    accumulators apart lane by lane (vinsertps / vextract around every multiply-add); as 3 x 8 lanes ddddocr's
    24 -> 24 3x3 conv over a 32 x 60 image took 0.35 ms, not 1.24 (onnxruntime 0.19; Zen 4, 2026-11-27), and
    ddddocr-old-int8's int16 convs ran 5x faster."""
    if tile_cols > lanes and tile_cols % lanes == 0:
        return lanes
    if tile_cols > lanes and tile_cols % (lanes // 2) == 0:
        return lanes // 2
    return tile_cols


def _below(sch, loop, ancestor) -> bool:
    """Whether `loop` is nested (strictly) inside `ancestor`."""
    target = sch.get(ancestor)
    parent = sch.get_sref(loop).parent
    while parent is not None:
        if parent.stmt is not None and parent.stmt.same_as(target):
            return True
        parent = parent.parent
    return False


def _contiguous_axis(block, anchor, lanes: int = 0):
    """The spatial iter that indexes the output's last axis alone, provided every read either ignores it or
    uses it only in its last index with coefficient 1 (stride 1 along the vector); else None. With `lanes`,
    when that last axis is symbolic or read through a conv's window (`_windowed`): another output axis of at least
    half a vector that qualifies (a conv's output channels with its weight in HWIO, tvmseq.cpu_layout: the stores
    are strided, the loads are not)."""
    if not block.writes[0].region:      # a rank-0 result (a full reduction): no axis to vectorize along
        return None
    region = block.writes[0].region
    spatial = {it.var: it for it in anchor.iters if it.kind == "S"}

    def alone(index):
        return next((it for var, it in spatial.items() if isinstance(index, tirx.Var) and index.same_as(var)), None)

    last = alone(region[-1].min)
    if last is None:
        return None
    if lanes and (not isinstance(last.dom, (int, tirx.IntImm)) or _windowed(block, anchor, last.var)):
        for rng in reversed(region[:-1]):
            it = alone(rng.min)
            if it is not None and isinstance(it.dom, (int, tirx.IntImm)) and 2 * int(it.dom) >= lanes \
                    and _read_contiguously(block, it.var):
                return it
    return last if _read_contiguously(block, last.var) else None


def _windowed(block, anchor, var) -> bool:
    """Whether a read indexes along `var` through a reduction iter too, of more than one step (a conv's window,
    x[w + kw]): vectors along such an axis load a vector shifted by one element at every tap, where vectors of
    output channels load the weight's contiguous rows (PLCMOS's convs after their pads became passes of their own:
    along the padded width of 257, 0.4 -> 4.4 ms; along the channels 0.34). With the pad inlined (conv1d), the
    bounds check along the window's axis also differs from lane to lane, and VectorizeLoop scalarized the tile (a
    3 x 3 conv over a static width of 80 at 2.7 GMAC/s)."""
    reduce = [it.var for it in anchor.iters if it.kind == "R" and not (isinstance(it.dom, (int, tirx.IntImm))
                                                                       and int(it.dom) == 1)]
    return any(_uses(rng.min, var) and any(_uses(rng.min, r) for r in reduce)
               for read in block.reads for rng in read.region)


def _read_contiguously(block, var) -> bool:
    """Whether every read of `block` either ignores `var` or uses it only in its last index, coefficient 1."""
    for read in block.reads:
        for dim, rng in enumerate(read.region):
            if not _uses(rng.min, var):
                continue
            if dim != len(read.region) - 1:
                return False
            coeff = detect_linear_equation(rng.min, [var])
            if len(coeff) != 2 or not isinstance(coeff[0], tirx.IntImm) or coeff[0].value != 1:
                return False
    return True


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
        opened = _open_blocks(self, func, target)
        if opened is None:
            return None
        sch, infos = opened
        changed = False
        for info in infos:
            block = sch.get(info.block_rv)
            if not block.writes:
                continue
            lanes = vector_lanes(target, str(block.writes[0].source.dtype))
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
        fused = _fused(sch, head)
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
    fused = _fused(sch, loops[:lead])
    if get_extent(sch, fused) == 1:
        return False
    sch.parallel(fused)
    return True


def _fused(sch, loops):
    """The loops fused into one, or the outermost alone where TVM cannot fuse them: with symbolic extents its
    iter-map check can fail to prove what holds (PLCMOS: "(T * 64 - 128) * 64 is not divisible by T * 64 - 128")
    and raises an internal error that would end the whole build."""
    if len(loops) == 1:
        return loops[0]
    try:
        return sch.fuse(*loops)
    except (tvm.error.InternalError, RuntimeError, ValueError):     # InternalError; a ScheduleError
        return loops[0]
