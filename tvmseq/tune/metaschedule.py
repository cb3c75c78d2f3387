"""MetaSchedule for tvmseq: evolutionary search with builder settings that do not time out, a progress
bar, resuming from an existing database, best-so-far curves, and tuning-database access shared with
the genetic search (both write MetaSchedule JSON databases; `tvmseq build` and the importer read them).

Where MetaSchedule's build time goes (numbers in notes/tuning.md): its LocalBuilder starts a fresh
process pool for every batch, and the first build in every fresh worker runs MetaSchedule's
`default_build`, which imports `tvm.s_tir.tensor_intrin`: that parses hundreds of TVMScript tensor
intrinsics and takes ~16 s (11 s of it CUDA's) before the first candidate is even lowered. Lowering
itself takes 0.07 s a candidate, the device compile 1.5 s (nvcc) / 2.3 s (NVRTC) because the
candidates are explicitly unrolled (up to ~2000 lines of CUDA). With 16 workers importing at once and
a 30 s timeout, many first candidates of a batch fail as "Timeout". `make_builder` uses `fast_build`
(no tensor_intrin import: SIMT candidates need none), raises the timeout, picks the CUDA compiler, and
can embed SASS on a machine without a GPU (tvmseq.cuda_toolchain), so builds can also run here.

Databases: `schedules/<op>/` holds `database_workload.json` + `database_tuning_record.json`. A
workload is `workload_mod(problem)` (the normalised IRModule of `space.gemm_func`); records carry
the schedule trace, so any strategy's result is applied the same way (`best_schedule`).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import space

SCHEDULES_ROOT = Path(__file__).resolve().parents[2] / "schedules"


@dataclass
class BuilderSettings:
    workers: int | None = None          # default: all cores
    timeout_s: float = 300.0            # MetaSchedule's default 30 s kills slow (large-tile) candidates
    compile_mode: str = "nvcc"          # TVM_CUDA_COMPILE_MODE in the workers: "nvcc" or "nvrtc"
    device_code_arches: tuple = ()      # e.g. ("sm_90a",): embed SASS via tvmseq.cuda_toolchain (no GPU needed)


@dataclass
class RunnerSettings:
    number: int = 10
    repeat: int = 3
    min_repeat_ms: int = 50
    timeout_s: float = 60.0


def _builder_init(compile_mode: str, arches: tuple) -> None:
    """Runs once in every LocalBuilder worker."""
    from tvmseq import cuda_toolchain

    if compile_mode == "nvcc" and cuda_toolchain.find_nvcc() is None:
        compile_mode, arches = "nvrtc", ()     # no nvcc on this machine: TVM's NVRTC path
    os.environ["TVM_CUDA_COMPILE_MODE"] = compile_mode
    if arches:
        cuda_toolchain.enable_device_binaries(arches)
    else:
        import tvm.support.nvcc  # noqa: F401 - registers tvm_callback_cuda_compile


def fast_build(mod, target, _params):
    """MetaSchedule's default_build without `import tvm.s_tir.tensor_intrin` (16 s per fresh worker):
    the lowered candidates already hold any tensorized code, the registry is not needed to build them.
    cp.async pipelines get the PassContext they need."""
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with tvm.transform.PassContext(opt_level=3, config=_pass_config_for(mod, target)):
        return tvm.tirx.build(mod, target)     # a runtime Module, as default_export expects


def make_builder(settings: BuilderSettings | None = None, fast: bool = True):
    """LocalBuilder with tvmseq's settings (`fast`: use fast_build instead of MetaSchedule's)."""
    from tvm.s_tir import meta_schedule as ms

    settings = settings or BuilderSettings()
    _workers_can_import_tvmseq()
    return ms.builder.LocalBuilder(
        max_workers=settings.workers, timeout_sec=settings.timeout_s, f_build=fast_build if fast else None,
        initializer=functools.partial(_builder_init, settings.compile_mode, tuple(settings.device_code_arches)))


def _workers_can_import_tvmseq() -> None:
    """Popen workers start a fresh interpreter: put this checkout on their PYTHONPATH."""
    root = str(Path(__file__).resolve().parents[2])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])


def make_runner(settings: RunnerSettings | None = None):
    from tvm.s_tir import meta_schedule as ms

    settings = settings or RunnerSettings()
    config = ms.runner.EvaluatorConfig(number=settings.number, repeat=settings.repeat,
                                       min_repeat_ms=settings.min_repeat_ms, enable_cpu_cache_flush=False)
    return ms.runner.LocalRunner(timeout_sec=settings.timeout_s, evaluator_config=config)


# ---------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------
def make_progress_callback(total: int, already: int = 0, best_s: float = math.inf, desc: str = "tune"):
    """A MeasureCallback that drives a tqdm bar (trials done, best time so far) and keeps the
    best-so-far curve in `callback.curve` (seconds, one entry per trial)."""
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class Progress(PyMeasureCallback):
        def __init__(self):
            super().__init__()
            self.curve: list[float] = []
            self.best = best_s
            self.failed = 0
            self.bar = _progress_bar(total, already, desc)

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            for built, ran in zip(builder_results, runner_results):
                secs = _mean_seconds(ran.run_secs) if built.error_msg is None and ran.error_msg is None else None
                if secs is None:
                    self.failed += 1
                else:
                    self.best = min(self.best, secs)
                self.curve.append(self.best)
            self.bar.update(len(runner_results))
            self.bar.set_postfix_str(f"best {self.best * 1e3:.4f} ms, failed {self.failed}")

    return Progress()


def _progress_bar(total: int, initial: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="trial")
    except ImportError:   # a bar that prints one line per update
        class Plain:
            n = initial

            def update(self, k):
                self.n += k

            def set_postfix_str(self, s):
                print(f"{desc}: {self.n}/{total} trials, {s}", flush=True)

            def close(self):
                pass

        return Plain()


def _mean_seconds(run_secs) -> float | None:
    values = [float(x) for x in run_secs or []]
    good = [v for v in values if 0 < v < 1e9]
    return sum(good) / len(good) if good else None


# ---------------------------------------------------------------------------------------------------
# Workloads, databases, curves
# ---------------------------------------------------------------------------------------------------
def workload_mod(problem: space.GemmProblem):
    """The IRModule MetaSchedule keys a GEMM workload by (what tune_tir normalises a PrimFunc to)."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(space.gemm_func(problem))


def open_database(work_dir: Path):
    from tvm.s_tir import meta_schedule as ms

    Path(work_dir).mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=str(work_dir), module_equality="structural")


def records_for(work_dir: Path, problem: space.GemmProblem) -> list[float]:
    """Mean run time (s, +inf for failures) of every record of this problem's workload, in the order
    they were committed (read straight from the JSON files: no compiler needed)."""
    work_dir = Path(work_dir)
    wl_path, rec_path = work_dir / "database_workload.json", work_dir / "database_tuning_record.json"
    if not wl_path.exists() or not rec_path.exists():
        return []
    wanted = _workload_indices(wl_path, problem)
    out = []
    for line in rec_path.read_text().splitlines():
        if not line.strip():
            continue
        wl_index, record = json.loads(line)
        if wl_index in wanted:
            secs = _mean_seconds(record[1])
            out.append(secs if secs is not None else math.inf)
    return out


@functools.lru_cache(maxsize=None)
def _workload_hash(problem: space.GemmProblem) -> str:
    from tvm_ffi import structural_hash

    return str(structural_hash(workload_mod(problem)))


def _workload_indices(wl_path: Path, problem: space.GemmProblem) -> set:
    """Indices (line numbers) of the workloads equal to this problem's: JSONDatabase stores each as
    [structural hash, serialised module]; the hash is enough to match."""
    want = _workload_hash(problem)
    return {i for i, line in enumerate(wl_path.read_text().splitlines())
            if line.strip() and str(json.loads(line)[0]) == want}


def best_so_far(times: list[float]) -> list[float]:
    out, best = [], math.inf
    for t in times:
        best = min(best, t)
        out.append(best)
    return out


def commit_records(work_dir: Path, problem: space.GemmProblem, target, results: list[tuple[dict, float]]) -> int:
    """Store genetic-search results (genes, seconds) as MetaSchedule tuning records (the trace of the
    template schedule), so `best_schedule` applies them like any MetaSchedule result."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    db = open_database(work_dir)
    mod = workload_mod(problem)
    workload = db.commit_workload(mod)
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    count = 0
    for genes, seconds in results:
        if not math.isfinite(seconds) or space.feasible(genes, problem, target) is not None:
            continue
        sch = space._schedule(s_tir.Schedule(mod), genes, problem, gpu=target.kind.name == "cuda")
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, run_secs=[seconds], target=target,
                                                         args_info=args_info))
        count += 1
    return count


def merge_best(src_dir: Path, dst_dir: Path, problem: space.GemmProblem, k: int = 4) -> int:
    """Copy the `k` best records of this problem from one database (e.g. a tuning run's work dir) into
    another (the committed schedules/<op>/ database)."""
    src_dir = Path(src_dir)
    if not (src_dir / "database_workload.json").exists():
        return 0
    src, dst = open_database(src_dir), open_database(dst_dir)
    mod = workload_mod(problem)
    if not src.has_workload(mod):
        return 0
    workload = dst.commit_workload(mod)
    from tvm.s_tir import meta_schedule as ms

    count = 0
    for rec in src.get_top_k(src.commit_workload(mod), k):
        dst.commit_tuning_record(ms.database.TuningRecord(rec.trace, workload, run_secs=rec.run_secs,
                                                          target=rec.target, args_info=rec.args_info))
        count += 1
    return count


def best_schedule(work_dir: Path, problem: space.GemmProblem, target):
    """The best tuned s_tir Schedule of this problem in the database, or None."""
    work_dir = Path(work_dir)
    if not (work_dir / "database_workload.json").exists():
        return None
    return open_database(work_dir).query_schedule(workload_mod(problem), target, workload_name="main")


def compile_tuned(problem: space.GemmProblem, target, work_dir: Path | None = None, genes: dict | None = None):
    """Build the GEMM with its tuned schedule from the database (or `genes`, or `space.default_genes`
    when neither has one). Returns (executable, how) with how in {"database", "genes", "default"}."""
    import tvm

    sch = best_schedule(work_dir, problem, target) if work_dir and genes is None else None
    if sch is not None:
        mod = tvm.IRModule({"main": sch.mod["main"].with_attr("tirx.is_scheduled", True)})
        how = "database"
    else:
        how = "genes" if genes is not None else "default"
        mod = space.apply(genes or space.default_genes(problem, target), problem, target)
    with tvm.transform.PassContext(opt_level=3, config=_pass_config_for(mod, target)):
        return tvm.compile(mod, target=target), how


def tuned_func(problem: space.GemmProblem, target, work_dir: Path | None = None):
    """For the importer: (scheduled PrimFunc marked `tir.is_scheduled`, PassContext config it needs),
    or (None, {}) when the database has no record for this problem."""
    sch = best_schedule(Path(work_dir or SCHEDULES_ROOT / "gemm"), problem, target)
    if sch is None:
        return None, {}
    return sch.mod["main"].with_attr("tirx.is_scheduled", True), _pass_config_for(sch.mod, target)


def _pass_config_for(mod, target) -> dict:
    """cp.async pipelines (from either strategy) need tirx.use_async_copy at build time."""
    if target.kind.name == "cuda" and "software_pipeline_async_stages" in mod.script():
        return space.build_config({"async_copy": 1}, target)
    return {}


def export_tuned(problems, target, root: Path | None = None, arch: str | None = None,
                 work_dir: Path | None = None) -> list:
    """`tvmseq build` for GEMMs: compile each problem with its tuned schedule (device code for `arch`
    embedded when the target is CUDA) and write `artifacts/<arch>/<problem.key>.so` + manifest entries.
    CUDA builds run in a spawned worker process: embedding device code on a machine without a GPU
    loads TVM's CUDA runtime against a driver stub, which must not leak into the caller's process."""
    import concurrent.futures
    import multiprocessing

    from .. import cuda_toolchain

    work_dir = Path(work_dir or SCHEDULES_ROOT / "gemm")
    arch = arch or cuda_toolchain.arch_of_target(target)
    jobs = [(problem, json.loads(str(target)), root, arch, work_dir) for problem in problems]
    if target.kind.name != "cuda":
        return [_export_one(job) for job in jobs]
    _workers_can_import_tvmseq()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return list(pool.map(_export_one, jobs))


def _export_one(job):
    """Compile and export one problem (an ArtifactEntry back); runs in the export worker for CUDA."""
    import tvm

    from .. import artifacts, cuda_toolchain

    problem, target_json, root, arch, work_dir = job
    target = tvm.target.Target(target_json)
    if target.kind.name == "cuda":
        cuda_toolchain.enable_device_binaries((arch,))
    executable, how = compile_tuned(problem, target, work_dir)
    return artifacts.export_artifact(
        executable, root, op="gemm", name=problem.key, arch=arch, dtype=problem.dtype,
        shapes={"m": problem.m, "n": problem.n, "k": problem.k},
        attrs={"b_layout": problem.b_layout, "bias": problem.bias},
        signature=gemm_signature(problem), schedule_hash=_schedule_hash(work_dir, problem, target, how))


def gemm_signature(problem: space.GemmProblem) -> dict:
    b = ["k", "n"] if problem.b_layout == "kn" else ["n", "k"]
    inputs = [{"name": "A", "shape": ["m", "k"], "dtype": problem.dtype},
              {"name": "B", "shape": b, "dtype": problem.dtype}]
    if problem.bias:
        inputs.append({"name": "bias", "shape": ["n"], "dtype": problem.dtype})
    return {"inputs": inputs, "outputs": [{"name": "C", "shape": ["m", "n"], "dtype": problem.dtype}]}


def _schedule_hash(work_dir, problem, target, how) -> str:
    import hashlib

    if how != "database":
        return f"{how}:{space.genes_key(space.default_genes(problem, target))}"
    sch = best_schedule(work_dir, problem, target)
    return "trace:" + hashlib.sha1(json.dumps(sch.trace.as_json(), default=str).encode()).hexdigest()[:16]


def tuned_problems(work_dir: Path | None = None) -> list[space.GemmProblem]:
    """The GEMM problems that have workloads in the database (reconstructed from the modules)."""
    work_dir = Path(work_dir or SCHEDULES_ROOT / "gemm")
    if not (work_dir / "database_workload.json").exists():
        return []
    out = []
    for record in open_database(work_dir).get_all_tuning_records():
        problem = space._problem_of(record.workload.mod["main"])
        if problem is not None and problem not in out:
            out.append(problem)
    return out


# ---------------------------------------------------------------------------------------------------
# Evolutionary search
# ---------------------------------------------------------------------------------------------------
@dataclass
class TuneResult:
    problem: space.GemmProblem
    work_dir: Path
    curve_s: list = field(default_factory=list)   # best-so-far (s) over all records of the workload
    new_trials: int = 0
    seconds: float = 0.0

    @property
    def best_s(self) -> float:
        return self.curve_s[-1] if self.curve_s else math.inf


def tune(problem: space.GemmProblem, target, work_dir: Path, max_trials: int, *, num_trials_per_iter: int = 64,
         cost_model: str = "random", builder: BuilderSettings | None = None, runner: RunnerSettings | None = None,
         seed: int = 0, progress: bool = True) -> TuneResult:
    """MetaSchedule evolutionary search on the GEMM workload, `max_trials` in all: records already in
    `work_dir` count (resuming), so only the rest are measured. cost_model: "random" or "mlp" (xgboost,
    MetaSchedule's default, is usually not installed on GPU boxes)."""
    from tvm.s_tir import meta_schedule as ms

    work_dir = Path(work_dir)
    done = records_for(work_dir, problem)
    remaining = max_trials - len(done)
    result = TuneResult(problem, work_dir, best_so_far(done), 0)
    if remaining <= 0:
        return result
    callbacks = ms.measure_callback.MeasureCallback.create("default")
    bar = make_progress_callback(max_trials, len(done), min(done, default=math.inf), problem.key) if progress else None
    start = time.perf_counter()
    ms.tune_tir(workload_mod(problem), target, str(work_dir), max_trials_global=remaining,
                num_trials_per_iter=num_trials_per_iter, builder=make_builder(builder),
                runner=make_runner(runner), cost_model=cost_model, strategy="evolutionary",
                measure_callbacks=callbacks + ([bar] if bar else []), seed=seed)
    if bar:
        bar.bar.close()
    result.seconds = time.perf_counter() - start
    all_times = records_for(work_dir, problem)
    result.curve_s, result.new_trials = best_so_far(all_times), len(all_times) - len(done)
    return result


# ---------------------------------------------------------------------------------------------------
# Where does the build time go? (numbers for notes/tuning.md)
# ---------------------------------------------------------------------------------------------------
def sample_candidates(problem: space.GemmProblem, target, count: int, seed: int = 0) -> list:
    """`count` MetaSchedule candidates (design-space samples with postprocessing applied), as the
    evolutionary search would send to the builder."""
    from tvm.s_tir import meta_schedule as ms

    out, attempt = [], 0
    while len(out) < count and attempt < count * 20:
        ctx = ms.TuneContext(mod=workload_mod(problem), target=target, space_generator="post-order-apply",
                             search_strategy="evolutionary", rand_state=seed + attempt, num_threads=1)
        attempt += 1
        for sch in ctx.generate_design_space():    # each design space is sampled with this rand_state
            if all(post.apply(sch) for post in ctx.space_generator.postprocs):
                out.append(sch.mod)
            if len(out) >= count:
                break
    return out


def profile_build(problem: space.GemmProblem, target, count: int = 8, workers: int = 2,
                  modes=("nvcc",), timeout_s: float = 600.0) -> dict:
    """Build `count` MetaSchedule candidates three ways and time each stage: (1) in-process
    tvm.compile to CUDA source only (lowering + codegen, no device compile); (2) the device compile of
    that source with nvcc (cicc and ptxas separately, via nvcc --time) or NVRTC; (3) MetaSchedule's
    LocalBuilder end to end (pool start-up, worker TVM import, build, export) with `workers` workers."""
    import subprocess
    import tempfile

    import tvm
    from tvm.s_tir import meta_schedule as ms

    from .. import cuda_toolchain

    mods = sample_candidates(problem, target, count)
    report: dict = {"problem": problem.key, "candidates": len(mods), "stages": []}
    sources = []
    for mod in mods:     # (1) lowering + CUDA codegen; the CUDA module keeps the source (no driver here)
        start = time.perf_counter()
        ex = tvm.compile(mod, target=target)
        lower_s = time.perf_counter() - start
        src = ex.mod.imports[0].inspect_source("cuda") if ex.mod.imports else ""
        sources.append(src)
        report["stages"].append({"lower_codegen_s": round(lower_s, 3), "cuda_lines": src.count("\n")})
    nvcc = cuda_toolchain.find_nvcc()
    for i, src in enumerate(sources):     # (2) device compile
        if "nvcc" in modes and nvcc:
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "k.cu").write_text(src)
                cmd = [nvcc, "--fatbin", "-O3", "--use_fast_math", "-w", "-gencode", "arch=compute_90a,code=sm_90a",
                       "-o", f"{tmp}/k.fatbin", f"{tmp}/k.cu", "--time", f"{tmp}/t.csv"]
                start = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                report["stages"][i]["nvcc_s"] = round(time.perf_counter() - start, 3)
                for line in Path(tmp, "t.csv").read_text().splitlines()[1:]:
                    cols = [c.strip() for c in line.split(",")]
                    if cols[1] in ("cicc", "ptxas"):
                        report["stages"][i][f"{cols[1]}_s"] = round(float(cols[6]) / 1e3, 3)
        if "nvrtc" in modes:
            report["stages"][i]["nvrtc_s"] = _time_nvrtc(src)
    # (3) MetaSchedule's LocalBuilder, as tuning uses it (one fresh pool per batch): MetaSchedule's
    # default_build vs fast_build, CUDA source only vs sm_90a device code (nvcc)
    for fast, arches in ((False, ()), (True, ()), (False, ("sm_90a",)), (True, ("sm_90a",))):
        builder = make_builder(BuilderSettings(workers=workers, timeout_s=timeout_s, compile_mode="nvcc",
                                               device_code_arches=arches), fast=fast)
        start = time.perf_counter()
        results = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
        key = f"local_builder_{'fast' if fast else 'default'}_{'device_code' if arches else 'source_only'}"
        report[key] = {"wall_s": round(time.perf_counter() - start, 2), "workers": workers,
                       "errors": [r.error_msg.splitlines()[-1][:200] for r in results if r.error_msg]}
    for name, code in (("import_tvm_s", "import tvm, tvm.s_tir.meta_schedule"),
                       ("import_tensor_intrin_s", "import tvm, tvm.s_tir.tensor_intrin")):
        start = time.perf_counter()      # worker start-up alone: a fresh process importing tvm
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        report[name] = round(time.perf_counter() - start, 2)
    return report


def _time_nvrtc(src: str) -> float | None:
    """Seconds for NVRTC to compile `src` to an sm_90a cubin (None without cuda-bindings)."""
    try:
        from tvm.support.nvcc import compile_cuda
    except ImportError:
        return None
    start = time.perf_counter()
    try:
        compile_cuda(src, target_format="cubin", arch="sm_90a", compiler="nvrtc")
    except Exception:  # noqa: BLE001 - cuda-bindings/NVRTC missing
        return None
    return round(time.perf_counter() - start, 3)


def main(argv=None) -> int:
    from .. import targets

    parser = argparse.ArgumentParser(prog="python3 -m tvmseq.tune.metaschedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile-build", help="where MetaSchedule's build time goes (runs without a GPU)")
    p.add_argument("--problem", default="2048x2048x2048")
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--modes", default="nvcc", help="nvcc,nvrtc")
    p.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from .genetic import parse_problem

    report = profile_build(parse_problem(args.problem), targets.resolve("cuda"), args.count, args.workers,
                           tuple(args.modes.split(",")))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
