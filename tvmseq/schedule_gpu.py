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

from . import targets
from .errors import TvmseqError

log = logging.getLogger(__name__)
_STOCK = {"on": False}     # `stock_pipeline()`: TVM's own pipeline, to show its bugs in tests


def default_rules():
    """dlight's GPU rules, in the order of TVM's default CUDA pipeline, then tvmseq's two last resorts."""
    from tvm.s_tir import dlight as dl

    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback(),
            UnfusedSpatial(), OneThread()]


class UnfusedSpatial:
    """For PrimFuncs dlight's Fallback cannot fuse (it raises on `zeros` of shape [t, 4 - n, 5]: an
    iter-map check on the symbolic extent): each top-level block's outer loop on blockIdx.x, its innermost
    loop split over threadIdx.x, no loop fused. Spatial blocks only (None otherwise)."""

    THREADS = 128

    def apply(self, func, target, _tunable):
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        if not blocks or any(iv.iter_type != tirx.IterVar.DataPar for b in blocks for iv in sch.get(b).iter_vars):
            return None
        for block in blocks:
            loops = sch.get_loops(block)
            if len(loops) < 2:
                loops = [sch.add_unit_loop(block), *loops]
            outer, inner = sch.split(loops[-1], [None, self.THREADS])
            sch.bind(loops[0], "blockIdx.x")
            sch.bind(inner, "threadIdx.x")
        return sch


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
                                            + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))(mod)

    return _pipeline


def legalize_passes(target: tvm.target.Target) -> list:
    """TVM's CUDA legalization passes (legalize, fuse) with `schedule_each` in place of ApplyDefaultSchedule."""
    from tvm.relax.backend.cuda import pipeline as cuda

    passes = [p for p in cuda.legalize_passes(target) if p.info.name != "ApplyDefaultSchedule"]
    return passes + [schedule_each(target)]


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
    return _symbolic_local_allocation(lowered)


def _symbolic_local_allocation(mod: tvm.IRModule) -> str | None:
    """A thread-local buffer of symbolic size, which CUDA code generation refuses ("Can only handle constant size
    stack allocation"): dlight's Matmul rule makes one for an int32 MatMulInteger over a symbolic axis."""
    found = []

    def visit(node):
        buf = node.buffer
        if buf.scope().startswith("local") and not all(isinstance(d, tvm.tirx.IntImm) for d in buf.shape):
            found.append(f"local buffer {buf.name} of symbolic size {list(buf.shape)}")
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
