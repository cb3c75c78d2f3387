"""`tvmseq tune model.onnx`: MetaSchedule for a whole model's stock operators, and the Relax pipeline that
applies the database (`tvmseq compile --tuned DB`, `compile_onnx(..., tuned=DB)`).

Tasks: the model is imported as `tvmseq compile` imports it, then legalized and fused exactly as the
compile pipeline does (library dispatch, LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps, FuseTIR);
every resulting PrimFunc is a task except tvmseq's own kernels (already scheduled: `tirx.is_scheduled`).
The database is a MetaSchedule JSON database (`DB/database_workload.json` + `database_tuning_record.json`)
keyed by each function's structure, so compiling applies a record to a function only when it is
identical to the tuned one: same shapes, dtypes and fusion.

Symbolic dims: MetaSchedule tunes static shapes. Each dynamic input dim is tuned at its `--shape` value or,
when none is given, at REPRESENTATIVE_DIM. A model compiled with those same static shapes uses the tuned
schedules; compiled with other sizes or left dynamic, its functions differ from the tuned ones, find no
record, and get the default schedules (dlight on CUDA, tvmseq.schedule_cpu on llvm).

Pipeline (`relax_pipeline`): TVM's default for the target, with MetaScheduleApplyDatabase right after
FuseTIR (before the default schedules, which skip what the database scheduled) and, on llvm, the CPU rules
of tvmseq.schedule_cpu as the default schedules.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TvmseqError

REPRESENTATIVE_DIM = 64     # a dynamic dim without --shape is tuned at this size
COST_MODELS = ("auto", "xgb", "mlp", "random")
STRATEGIES = ("evolutionary", "replay-trace")


def auto_trials_per_iter(trials: int, tasks: int) -> int:
    """Candidates a task gets per visit when not given: the budget split evenly over the tasks, 8 to 64."""
    return max(8, min(64, trials // max(1, tasks)))


# ---------------------------------------------------------------------------------------------------
# The compile pipeline
# ---------------------------------------------------------------------------------------------------
def relax_pipeline(target, tuned=None):
    """The Relax pipeline `tvmseq.build.build_relax` compiles with (module doc). `tuned`: a database
    directory (None: no database). GPU targets without a database: tvmseq.schedule_gpu's pipeline as is."""
    import tvm

    from .. import empty_constants, schedule_gpu, targets

    database = _database_dir(tuned) if tuned is not None else None
    gpu = targets.is_gpu(target)
    if gpu and database is None:
        return schedule_gpu.pipeline(target)
    if not gpu:
        from .. import schedule_cpu

        schedule_cpu.configure_threads()

    @tvm.transform.module_pass(opt_level=0, name="TvmseqPipeline")
    def _pipeline(mod, _ctx):
        stock = _backend(target)
        with target:
            passes = list(stock.library_dispatch_passes(target)) + _legalize_passes(target, database)
            passes += list(stock.dataflow_lower_passes(target)) + [empty_constants.pass_()]
            passes += list(stock.finalize_passes(target))
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


_SCHEDULING_PASSES = ("ApplyDefaultSchedule", "TvmseqScheduleEach")


def _legalize_passes(target, database: Path | None) -> list:
    """Legalize + fuse, the database applied after FuseTIR, then the default schedules (tvmseq.schedule_gpu's
    on GPUs, tvmseq.schedule_cpu's on llvm), which leave what the database scheduled as it is."""
    from tvm import relax

    from .. import schedule_gpu, targets

    stock = _backend(target)
    if targets.is_gpu(target):
        passes = list(schedule_gpu.legalize_passes(target))
    else:
        from ..cpu_layout import weight_layouts_pass
        from ..cpu_ops import cpu_ops_pass
        from ..schedule_cpu import schedule_pass

        # the branches of an ONNX `If` are functions the importer builds outside a dataflow block, so FuseOps left
        # every op of them a kernel of its own (silero v4: 155 kernels, ~1000 VM instructions a branch): as dataflow
        # their pure ops fuse (50 kernels; one thread, a 512-sample call 0.141 -> 0.091 ms in the VM). Then conv /
        # matmul weights take the layouts the CPU rules vectorize (tvmseq.cpu_layout); reductions whose loops all
        # have extent 1 become plain elementwise blocks: an epilogue inlined into such a reduction is otherwise
        # added in its init AND its update (tvmseq.schedule_gpu's doc); softmax and integer convs / matmuls run as
        # tvmseq's kernels (tvmseq.cpu_ops: before the weight layouts, which would transpose the weights it packs)
        passes = [relax.transform.ConvertToDataflow(), cpu_ops_pass(target), weight_layouts_pass(target),
                  *stock.legalize_passes(target),
                  schedule_gpu.unit_reductions_pass(), schedule_pass()]
    at = next((i for i, p in enumerate(passes) if p.info.name in _SCHEDULING_PASSES), len(passes))
    if database is not None:
        passes.insert(at, relax.transform.MetaScheduleApplyDatabase(str(database)))
    return passes


def _backend(target):
    """TVM's per-backend pass lists (tvm.relax.pipeline's dispatcher misses cpu_generic's lowering passes)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.backend.cuda import pipeline as cuda

    return cuda if target.kind.name == "cuda" else cpu


def fused_module(mod, target):
    """The Relax module after legalization and fusion, as the compile pipeline has it just before the
    database is applied: its PrimFuncs are what the database is keyed by."""
    import tvm

    stock = _backend(target)
    prefix = []
    for p in _legalize_passes(target, None):
        if p.info.name in _SCHEDULING_PASSES:
            break
        prefix.append(p)
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(list(stock.library_dispatch_passes(target)) + prefix)(mod)


def _database_dir(tuned) -> Path:
    path = Path(tuned)
    if not (path / "database_workload.json").is_file() or not (path / "database_tuning_record.json").is_file():
        raise TvmseqError(f"--tuned {tuned}: not a tuning database (expected database_workload.json and "
                          f"database_tuning_record.json in it; `tvmseq tune MODEL.onnx -o {tuned}` writes them)")
    return path


def scheduled_by_database(mod, target, tuned) -> list[str]:
    """Names of the PrimFuncs of `mod` (a Relax module from the importer) that the database schedules."""
    import tvm
    from tvm import relax, tirx
    from tvm_ffi import structural_equal

    fused = fused_module(mod, target)
    with target, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase(str(_database_dir(tuned)))(fused)
    names = []
    for gv, func in fused.functions.items():
        if isinstance(func, tirx.PrimFunc) and not _is_scheduled(func):
            after = applied[gv.name_hint]
            if _is_scheduled(after) and not structural_equal(after, func):
                names.append(gv.name_hint)
    return sorted(names)


def _is_scheduled(func) -> bool:
    return bool(func.attrs is not None and "tirx.is_scheduled" in func.attrs and func.attrs["tirx.is_scheduled"])


# ---------------------------------------------------------------------------------------------------
# Tuning
# ---------------------------------------------------------------------------------------------------
@dataclass
class TuneReport:
    database: Path
    target: str
    trials: int
    tasks: list = field(default_factory=list)          # names of the tuned functions
    skipped: list = field(default_factory=list)        # tvmseq's kernels (already scheduled)
    left_out: list = field(default_factory=list)       # stock functions past max_tasks (default schedules)
    shapes: dict = field(default_factory=dict)         # input name -> the shape tuned at
    representative: dict = field(default_factory=dict)  # dynamic dim -> the size it was tuned at
    seconds: float = 0.0
    best_ms: dict = field(default_factory=dict)        # task -> best measured time (ms)
    trials_per_iter: int = 0


def static_shapes(proto, shapes: dict | None) -> tuple[dict, dict]:
    """Input shapes for tuning: the `shapes` given, every other dynamic dim at REPRESENTATIVE_DIM.
    Returns ({input: shape}, {dim name: size chosen})."""
    shapes = dict(shapes or {})
    inits = {t.name for t in proto.graph.initializer}
    chosen = {}
    for value in proto.graph.input:
        if value.name in inits or value.name in shapes:
            continue
        dims, dynamic = [], False
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(d.dim_value)
            else:
                name = d.dim_param or f"{value.name}_dim{len(dims)}"
                chosen.setdefault(name, REPRESENTATIVE_DIM)
                dims.append(chosen[name])
                dynamic = True
        if dynamic:
            shapes[value.name] = dims
    return shapes, chosen


def extract_tasks(mod, target):
    """(tasks to tune, names of the already-scheduled functions left out) of an imported model. The tasks come
    heaviest first (floating-point work x calls, `task_flops`): MetaSchedule's task scheduler visits them in
    order, one round of `trials_per_iter` each, so a budget too small for every task goes to the heavy ones."""
    from tvm.s_tir import meta_schedule as ms

    fused = fused_module(mod, target)
    tasks, skipped = [], []
    for task in ms.relax_integration.extract_tasks(fused, target):
        if _is_scheduled(task.dispatched[0]["main"]):
            skipped.append(task.task_name)
        else:
            tasks.append(task)
    tasks.sort(key=lambda t: -task_flops(t))
    return tasks, skipped


def task_flops(task) -> float:
    """Estimated floating-point operations of one extracted task, times how often the model calls it (0 where
    TVM cannot estimate, e.g. data movement only)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    try:
        flops = float(estimate_tir_flops(task.dispatched[0]))
    except Exception:  # noqa: BLE001 - symbolic extents or unsupported constructs: treat as cheap
        flops = 0.0
    return flops * max(1, int(task.weight))


def import_for_tuning(model, target, shapes: dict | None = None, *, weights: str = "embedded",
                      expose_state: bool = False, log=print, **options):
    """(Relax module, {input: shape tuned at}, {dynamic dim: size chosen}): the model imported exactly as
    `tvmseq.build.compile_onnx(model, target, shapes, weights=..., expose_state=..., **options)` imports it
    (state exposed, GRU stacks fused and weights lifted to inputs for weights="inputs", input names made safe),
    with every dynamic dim left in the shapes given at REPRESENTATIVE_DIM. The database's records are keyed by
    the fused functions' structure, so a build with other import options (embedded vs lifted weights: constant
    folding differs) would find no record."""
    from .. import build as tvm_build
    from ..onnx import from_onnx

    min_elements = options.pop("weights_min_elements", tvm_build.WEIGHT_MIN_ELEMENTS)
    proto, _, _ = tvm_build.prepare_proto(model, target, expose_state, weights, min_elements, options)
    tuned_shapes, chosen = static_shapes(proto, shapes)
    for dim, size in chosen.items():
        log(f"tune: dynamic dim {dim!r} tuned at {size} (pass --shape to choose); compiled at another size, "
            "or left dynamic, the functions that depend on it get the default schedules")
    proto, original_names = tvm_build.safe_input_names(proto)
    renamed = {v: k for k, v in original_names.items()}
    import_shapes = {renamed.get(k, k): v for k, v in tuned_shapes.items()}
    mod = from_onnx(proto, import_shapes or None, target=target, **options)
    return mod, tuned_shapes, chosen


def resolve_cost_model(name: str) -> str:
    if name not in COST_MODELS:
        raise TvmseqError(f"--cost-model {name!r}: must be one of {', '.join(COST_MODELS)}")
    if name == "auto":
        try:
            import xgboost  # noqa: F401 - MetaSchedule's default cost model

            return "xgb"
        except ImportError:
            return "random"
    if name == "xgb":
        try:
            import xgboost  # noqa: F401
        except ImportError:
            raise TvmseqError("--cost-model xgb needs xgboost: pip install 'tvmseq[tune]' (xgboost-cpu), or use "
                              "--cost-model random") from None
    return name


def tune_model(model, target=None, trials: int = 64, shapes: dict | None = None, work_dir=None,
               cost_model: str = "auto", trials_per_iter: int | None = None, builder_timeout_s: float = 300.0,
               progress: bool = True, log=print, *, strategy: str = "evolutionary", weights: str = "embedded",
               expose_state: bool = False, max_tasks: int | None = None, **options) -> TuneReport:
    """Tune `model`'s stock operators with MetaSchedule (module doc); records go to `work_dir`.

    `trials` is the budget over all tasks. `trials_per_iter` (default: the budget split evenly over the tasks,
    8 to 64 a round) is how many candidates a task gets each time the task scheduler visits it; tasks are visited
    heaviest first. `strategy`: MetaSchedule's "evolutionary" (default) or "replay-trace" (random sampling: no
    evolutionary population of 2048 per round, for small budgets or a random cost model). `max_tasks`: tune only
    the N heaviest functions (the rest keep the default schedules: `report.left_out`). `weights`,
    `expose_state` and `**options` (the importer's): as the model will be compiled (`import_for_tuning`)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from .. import targets
    from . import metaschedule as wrap

    if not isinstance(trials, int) or trials < 1:
        raise TvmseqError(f"--trials {trials!r}: must be a positive integer")
    if strategy not in STRATEGIES:
        raise TvmseqError(f"--strategy {strategy!r}: must be one of {', '.join(STRATEGIES)}")
    if max_tasks is not None and (not isinstance(max_tasks, int) or max_tasks < 1):
        raise TvmseqError(f"--max-tasks {max_tasks!r}: must be a positive integer")
    if trials_per_iter is not None and (not isinstance(trials_per_iter, int) or trials_per_iter < 1):
        raise TvmseqError(f"--trials-per-iter {trials_per_iter!r}: must be a positive integer")
    target = targets.resolve(target)
    if target.kind.name == "llvm":      # MetaSchedule's CPU rules size their parallel loops by it
        import json

        from ..schedule_cpu import physical_cores

        target = tvm.target.Target({**json.loads(str(target)), "num-cores": physical_cores()})
    cost = resolve_cost_model(cost_model)
    work_dir = Path(work_dir or "tuning_db")
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TvmseqError(f"-o {work_dir}: cannot create it: {err.strerror or err}") from None
    mod, tuned_shapes, chosen = import_for_tuning(model, target, shapes, weights=weights, expose_state=expose_state,
                                                  log=log, **options)
    tasks, skipped = extract_tasks(mod, target)
    left_out = [t.task_name for t in tasks[max_tasks:]] if max_tasks else []
    tasks = tasks[:max_tasks] if max_tasks else tasks
    report = TuneReport(database=work_dir, target=target.kind.name, trials=trials, shapes=tuned_shapes,
                        representative=chosen, skipped=skipped, tasks=[t.task_name for t in tasks], left_out=left_out)
    if not tasks:
        log(f"tune: nothing to tune ({len(skipped)} tvmseq kernel(s), already scheduled)")
        return report
    per_iter = trials_per_iter or auto_trials_per_iter(trials, len(tasks))
    report.trials_per_iter = per_iter
    log(f"tune: {len(tasks)} task(s) ({', '.join(report.tasks)}), {trials} trials, {min(per_iter, trials)} a "
        f"round, {strategy}, cost model {cost}; {len(skipped)} tvmseq kernel(s) left as they are"
        + (f", {len(left_out)} lighter function(s) not tuned" if left_out else ""))
    database = wrap.open_database(work_dir)
    callback = _progress(trials, progress, log)
    start = time.perf_counter()
    with _quiet_meta_schedule():
        contexts, task_weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            tasks, str(work_dir), strategy=strategy, num_threads="physical")
        ms.tune.tune_tasks(
            tasks=contexts, task_weights=task_weights, work_dir=str(work_dir), max_trials_global=trials,
            num_trials_per_iter=min(per_iter, trials),
            builder=wrap.make_builder(wrap.BuilderSettings(timeout_s=builder_timeout_s)),
            runner=wrap.make_runner(), database=database, cost_model=cost,
            measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [callback])
    callback.bar.close()
    report.seconds = time.perf_counter() - start
    for task in tasks:
        records = database.get_top_k(database.commit_workload(task.dispatched[0]), 1)
        secs = wrap._mean_seconds(records[0].run_secs) if records else None
        # None: never measured (the budget ran out before the task scheduler reached it); inf: no valid candidate
        report.best_ms[task.task_name] = None if not records else secs * 1e3 if secs else math.inf
    log(f"tune: done in {report.seconds:.0f} s; database {work_dir} (compile with --tuned {work_dir})")
    return report


def _progress(trials: int, show: bool, log):
    """MeasureCallback driving a tqdm bar (trials done, best so far, tqdm's remaining-time estimate)."""
    from .metaschedule import make_progress_callback

    callback = make_progress_callback(trials, desc="tune")
    if not show:      # no bar: one line a round through `log` (a log file gets no carriage-return clutter)
        if hasattr(callback.bar, "disable"):
            callback.bar.disable = True      # tqdm: closed without drawing
        callback.bar.close()
        callback.bar = _LogBar(trials, log)
    return callback


class _LogBar:
    """The part of tqdm's interface the progress callback uses, as one `log` line per measured round."""

    def __init__(self, total: int, log):
        self.total, self.log, self.n, self.start = total, log, 0, time.perf_counter()

    def update(self, k: int) -> None:
        self.n += k

    def set_postfix_str(self, text: str) -> None:
        self.log(f"tune: {self.n}/{self.total} trials, {text}, {time.perf_counter() - self.start:.0f} s")

    def close(self) -> None:
        pass


class _quiet_meta_schedule:
    """MetaSchedule logs every task's per-round table at INFO to stdout; the bar says what matters. Its logger's
    unnamed handlers (pytest's capture handlers, a user's own) are set aside meanwhile: MetaSchedule rebuilds its
    logging config from the handlers' names and fails on a None ("'NoneType' object has no attribute 'format'")."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("tvm.s_tir.meta_schedule")
        self.level = self.logger.level
        self.logger.setLevel(logging.WARNING)
        self.unnamed = [h for h in self.logger.handlers if h.get_name() is None]
        for handler in self.unnamed:
            self.logger.removeHandler(handler)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)
        for handler in self.unnamed:
            self.logger.addHandler(handler)


def format_report(report: TuneReport) -> str:
    lines = [f"tuned {len(report.tasks)} function(s) for {report.target} in {report.seconds:.0f} s "
             f"({report.trials} trials) -> {report.database}"
             + (f"; not tuned (lighter): {', '.join(report.left_out)}" if report.left_out else "")]
    for name in report.tasks:
        best = report.best_ms.get(name, math.inf)
        if best is None:
            lines.append(f"  {name}: no valid measurement (not reached within the trials, or every candidate failed): "
                         "default schedule")
        else:
            lines.append(f"  {name}: best {best:.4f} ms" if math.isfinite(best) else f"  {name}: no valid candidate")
    return "\n".join(lines)
