"""MetaSchedule's evolutionary search vs tvmseq's genetic search at equal trial budgets (64, 128, 256)
on the GEMMs of schedules/tune_gemm.py: the 2048^3 fp32 GEMM and the GRU input projection
(6400x3072x1024, B stored [N, K], + bias). Writes best-so-far curves to
artifacts/bench/search_compare.{json,png} (or --out-dir), saving after every workload and every
MetaSchedule batch.

Per workload:
  genetic       the first of: (1) a curve of >= max budget trials already in the results JSON;
                (2) a replay on a measured pool (`tune_gemm.py pool` + `measure`: --pools with
                index.json, --genetic-times with <problem>.times.json; exact, as every candidate the
                GA asks for was measured; --seeds runs, median curve); (3) the budget points of
                artifacts/bench/tune_gemm.json when it has genetic results at >= max budget (no full
                curve); (4) the genetic search online here (build a generation in parallel, measure it).
  evolutionary  MetaSchedule's tune_tir, strategy "evolutionary", cost model "random" (or "mlp";
                xgboost is not installed on the GPU machine), tvmseq's fast builder
                (tune.metaschedule.make_builder), runner 3 x 2 timings per candidate (mean). Run in
                rounds: every workload up to the smallest budget, then on to the next, each round a
                tune_tir call that resumes from the workload's database in --work-dir (MetaSchedule seeds
                its population with the measured best); no new batch after --deadline-s.
  final         (CUDA) both strategies' best schedules rebuilt and timed the same way (TVM
                time_evaluator, median of --final-repeat x --final-number runs) next to cuBLAS (torch,
                TF32 off), so the two runners' different timing does not decide the comparison.

On the GPU machine (full TVM payload, 16 cores): `bash schedules/gpu_run.sh search_compare ARGS` (one workload per call
of about 8 minutes reaches 128 trials). Smoke test here (the genetic side then runs online):
  python3 schedules/compare_search.py --target llvm --problems 64x64x64 --budgets 8 --out-dir /tmp/sc \
      --work-dir /tmp/sc/work --previous "" --population 8
Redraw the png from the JSON: --plot-only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvmseq.tune import genetic, metaschedule, space  # noqa: E402

BUDGETS = (64, 128, 256)
PROBLEMS = {
    "gemm2048": space.GemmProblem(2048, 2048, 2048),
    "gru_input": space.GemmProblem(100 * 64, 3 * 1024, 1024, b_layout="nk", bias=True),
}
BENCH = ROOT / "artifacts" / "bench"
INF = math.inf


_DEADLINE = "compare_search: deadline reached"


class DeadlineReached(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# problems, targets, results file
# --------------------------------------------------------------------------------------------------
def parse_problems(text: str) -> list[tuple[str, space.GemmProblem]]:
    """Names from PROBLEMS, or MxNxK[:nk][:bias] for any other GEMM (comma-separated; "all")."""
    out = []
    for item in (list(PROBLEMS) if text == "all" else text.split(",")):
        if item in PROBLEMS:
            out.append((item, PROBLEMS[item]))
            continue
        shape, *flags = item.split(":")
        problem = genetic.parse_problem(shape, b_layout="nk" if "nk" in flags else "kn", bias="bias" in flags)
        out.append((item, problem))
    return out


def make_target(name: str):
    import tvm

    from tvmseq import targets

    if name in ("llvm", "cpu"):   # MetaSchedule needs the core count on CPU targets
        return tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
    return targets.resolve(name)


def _finite(x):
    return x if x is not None and math.isfinite(x) else None


def _curve_json(curve_ms):
    return [None if _finite(c) is None else float(f"{c:.6g}") for c in curve_ms]


def _curve_load(curve):
    return [INF if c is None else float(c) for c in curve or []]


def at_budget(curve_ms, budget):
    """Best-so-far after `budget` trials (a search that stopped early keeps its last best); None if
    the curve has not reached the budget."""
    if not curve_ms or len(curve_ms) < budget:
        return None
    return _finite(curve_ms[budget - 1])


class Results:
    """search_compare.json: one record per workload, rewritten after every change."""

    def __init__(self, path: Path, previous: Path | None = None):
        self.path = path
        self.data = {"benchmark": "search_compare", "workloads": {}}
        for src in (path, previous):
            if src is not None and src.exists():
                try:
                    old = json.loads(src.read_text())
                    self.data["workloads"] = {**old.get("workloads", {}), **self.data["workloads"]}
                except ValueError:
                    print(f"warning: {src} is not valid JSON; starting afresh", flush=True)
                break

    def workload(self, problem) -> dict:
        return self.data["workloads"].setdefault(problem.key, {"problem": problem.to_json()})

    def save(self, meta: dict):
        from tvmseq.bench.common import environment

        self.data.update(meta)
        self.data["environment"] = environment()
        self.data["rows"] = self.rows()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        text = json.dumps(self.data, indent=1, default=str)
        # curves on one line each (the file travels with the checkout to the GPU machine: keep it small)
        text = re.sub(r"\[\s*((?:-?[0-9.e+-]+|null)(?:,\s*(?:-?[0-9.e+-]+|null))*)\s*\]",
                      lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]", text)
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def rows(self) -> list[dict]:
        rows = []
        for key, w in self.data["workloads"].items():
            problem = genetic.problem_from_json(w["problem"])
            peer = (w.get("final") or {}).get("cublas_ms") or (w.get("genetic") or {}).get("peer_ms")
            for budget in self.data.get("budgets", BUDGETS):
                row = {"problem": key, "budget": budget}
                for name in ("genetic", "random", "evolutionary"):
                    s = w.get(name) or {}
                    value = at_budget(_curve_load(s.get("curve_ms")), budget)
                    if value is None and s.get("points_ms"):
                        value = s["points_ms"].get(str(budget))
                    row[f"{name}_ms"] = value
                    row[f"{name}_tflops"] = problem.flops / (value * 1e-3) / 1e12 if value else None
                if peer:
                    row["cublas_ms"] = peer
                    for name in ("genetic", "evolutionary"):
                        row[f"{name}_vs_cublas"] = peer / row[f"{name}_ms"] if row[f"{name}_ms"] else None
                rows.append(row)
        return rows


# --------------------------------------------------------------------------------------------------
# genetic side
# --------------------------------------------------------------------------------------------------
def genetic_from_replay(problem, pools: Path, times_dir: Path, budget: int, seeds: int, population: int):
    """Replay the GA (and random search) on a measured pool; None if the pool or times are missing."""
    index_path, times_path = pools / problem.key / "index.json", times_dir / f"{problem.key}.times.json"
    if not index_path.exists() or not times_path.exists():
        return None
    index, times = json.loads(index_path.read_text()), genetic.load_times(times_path)
    choices, feasible, evaluate = genetic.pool_space(index, times)
    runs = {"genetic": [], "random": []}
    for seed in range(seeds):
        ga = genetic.GeneticSearch(choices, feasible, genetic.GAConfig(population=population, seed=seed))
        ga.run(evaluate, budget)
        runs["genetic"].append(ga)
        runs["random"].append(genetic.random_search(choices, feasible, evaluate, budget, seed))
    out = {}
    for name, searches in runs.items():
        curves = [s.curve() + s.curve()[-1:] * (budget - len(s.curve())) for s in searches if s.curve()]
        median = [statistics.median(c[i] for c in curves) for i in range(budget)]
        finals = sorted(range(len(curves)), key=lambda i: curves[i][-1])
        mid = searches[finals[len(finals) // 2]]
        report = json.loads(times_path.read_text())
        out[name] = {"source": f"replay on the measured pool {index_path.parent.name} ({len(index['candidates'])} "
                               f"candidates, times from {times_path.name}), median of {seeds} seeds",
                     "peer_ms": (report.get("peer") or {}).get("ms"),
                     "curve_ms": _curve_json(median),
                     "min_ms": _curve_json([min(c[i] for c in curves) for i in range(budget)]),
                     "max_ms": _curve_json([max(c[i] for c in curves) for i in range(budget)]),
                     "best_genes": mid.best[0] if mid.best else None, "trials": budget, "seeds": seeds,
                     "measured_on": report.get("environment")}
    return out


def genetic_from_tune_json(problem, budgets, path: Path = BENCH / "tune_gemm.json"):
    """The genetic (and random) results of tune_gemm.py compare at the budgets, if it reached the
    largest one for this workload (points only: that file keeps no per-trial curve)."""
    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text()).get("rows", []) if r.get("problem") == problem.key]
    have = {r["budget"]: r for r in rows if r.get("genetic_ms")}
    if not have or max(have) < max(budgets):
        return None
    out = {}
    for name in ("genetic", "random"):
        out[name] = {"source": f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} (replay medians; "
                               "no per-trial curve kept)",
                     "points_ms": {str(b): have[b].get(f"{name}_ms") for b in budgets if b in have},
                     "trials": max(have)}
    return out


def genetic_online(problem, target, budget: int, work: Path, jobs: int, population: int, seed: int = 0,
                   deadline: float = INF):
    """The genetic search here: each generation built in parallel (device code for the GPU present)
    and measured on this machine; resumable from work/state.json."""
    from tvmseq import cuda_toolchain

    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.json"
    feasible = lambda g: space.feasible(g, problem, target) is None  # noqa: E731
    if state_path.exists():
        ga = genetic.GeneticSearch.from_state(json.loads(state_path.read_text()), feasible)
    else:
        ga = genetic.GeneticSearch(space.GENES, feasible, genetic.GAConfig(population=population, seed=seed),
                                   seeds=[space.DEFAULT_GENES])
    gpu = target.kind.name == "cuda"
    present = cuda_toolchain.present_arch()
    arches = (present,) if gpu and present.startswith("sm_") else ("sm_90a",)
    start = time.perf_counter()

    def evaluate(batch):
        pool = work / f"gen{ga.generation:03d}"
        genetic.build_population(problem, batch, pool, target, arches if gpu else (), jobs, progress=False)
        report = genetic.measure_pool(pool, pool / "times.json", peer=False)
        return [report["results"].get(space.genes_key(g), {}).get("ms") or INF for g in batch]

    def checkpoint(s):
        state_path.write_text(json.dumps(s.state()))
        print(f"  {problem.key} genetic: generation {s.generation}, {s.trials}/{budget} trials, best "
              f"{s.best_time:.4f} ms, {time.perf_counter() - start:.0f} s", flush=True)
        if time.monotonic() > deadline:
            raise DeadlineReached

    try:
        ga.run(evaluate, budget, on_generation=checkpoint)
        stopped = None
    except DeadlineReached:
        stopped = f"deadline after {ga.trials} trials"
    return {"genetic": {"source": f"online here ({target.kind.name}), seed {seed}, population {population}",
                        "curve_ms": _curve_json(ga.curve()), "best_genes": ga.best[0] if ga.best else None,
                        "trials": ga.trials, "stopped": stopped,
                        "seconds": round(time.perf_counter() - start, 1)}}


# --------------------------------------------------------------------------------------------------
# evolutionary side (MetaSchedule)
# --------------------------------------------------------------------------------------------------
def _batch_callback(problem, budget, done: list, on_batch, deadline):
    """A MeasureCallback: one progress line per batch, `on_batch()` (save), stop after the deadline."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    @derived_object
    class Batch(PyMeasureCallback):
        def __init__(self):
            super().__init__()
            self.trials, self.failed, self.best = len(done), 0, min(done, default=INF)
            self.start = time.perf_counter()

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            for built, ran in zip(builder_results, runner_results):
                secs = metaschedule._mean_seconds(ran.run_secs) \
                    if built.error_msg is None and ran.error_msg is None else None
                self.failed += secs is None
                self.best = min(self.best, secs if secs is not None else INF)
                self.trials += 1
            tflops = problem.flops / self.best / 1e12 if math.isfinite(self.best) else 0.0
            print(f"  {problem.key} evolutionary: {self.trials}/{budget} trials, best {self.best * 1e3:.4f} ms "
                  f"({tflops:.3g} TFLOP/s), {self.failed} failed, {time.perf_counter() - self.start:.0f} s",
                  flush=True)
            on_batch()
            if time.monotonic() > deadline:
                raise DeadlineReached(f"{_DEADLINE} after {self.trials} trials")

    return Batch()


def evolutionary(problem, target, budget: int, work: Path, args, on_batch, deadline: float):
    """MetaSchedule evolutionary search up to `budget` trials in `work` (resumes); its curve."""
    from tvm.s_tir import meta_schedule as ms

    from tvmseq import cuda_toolchain

    work = Path(work)
    done = metaschedule.records_for(work, problem)
    remaining = budget - len(done)
    start = time.perf_counter()
    stopped = None
    gpu = target.kind.name == "cuda"
    if remaining > 0:
        arches = (cuda_toolchain.present_arch(),) if gpu and cuda_toolchain.find_nvcc() and \
            cuda_toolchain.present_arch().startswith("sm_") else ()
        builder = metaschedule.BuilderSettings(workers=args.workers, timeout_s=args.build_timeout,
                                               compile_mode="nvcc" if arches else "nvrtc", device_code_arches=arches)
        runner = metaschedule.RunnerSettings(number=args.runner_number, repeat=args.runner_repeat,
                                             min_repeat_ms=args.runner_min_repeat_ms)
        callback = _batch_callback(problem, budget, done, on_batch, deadline)
        ms_builder, ms_runner = metaschedule.make_builder(builder), metaschedule.make_runner(runner)
        try:
            ms.tune_tir(metaschedule.workload_mod(problem), target, str(work), max_trials_global=remaining,
                        num_trials_per_iter=min(args.trials_per_iter, remaining),
                        builder=ms_builder, runner=ms_runner,
                        cost_model=args.cost_model, strategy="evolutionary",
                        measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [callback],
                        seed=args.seed)
        except Exception as err:  # noqa: BLE001 - the deadline (raised inside TVM) or a tuning failure
            if _DEADLINE in str(err):      # TVM hands the callback's exception back as a RuntimeError
                stopped = f"deadline after {callback.trials} trials"
            else:
                raise
    curve = [t * 1e3 for t in metaschedule.best_so_far(metaschedule.records_for(work, problem))]
    return {"source": f"MetaSchedule tune_tir, strategy evolutionary, cost model {args.cost_model}, "
                      f"{args.trials_per_iter} trials per batch, runner number {args.runner_number} x repeat "
                      f"{args.runner_repeat} (mean), tvmseq fast_build, seed {args.seed}",
            "curve_ms": _curve_json(curve), "trials": len(curve), "stopped": stopped,
            "seconds": round(time.perf_counter() - start, 1), "work_dir": str(work)}


# --------------------------------------------------------------------------------------------------
# final: both bests timed the same way, next to cuBLAS
# --------------------------------------------------------------------------------------------------
def final_check(problem, target, genes, ms_work: Path, number: int, repeat: int) -> dict:
    import numpy as np
    import tvm

    from tvmseq import cuda_toolchain

    gpu = target.kind.name == "cuda"
    if gpu and not cuda_toolchain.ensure_cuda_runtime():
        return {"error": "no usable GPU"}
    if gpu and not (cuda_toolchain.find_nvcc()
                    and cuda_toolchain.enable_device_binaries((cuda_toolchain.present_arch(),))):
        import tvm.support.nvcc  # noqa: F401 - TVM's own compile callback (NVRTC)
    dev = tvm.cuda(0) if gpu else tvm.cpu(0)
    host, ref = genetic._problem_data(problem)
    args = [tvm.runtime.tensor(x, dev) for x in host]
    out = {}
    candidates = {}
    if genes:
        candidates["genetic"] = lambda: space.build(genes, problem, target)
    if (ms_work / "database_workload.json").exists():
        candidates["evolutionary"] = lambda: metaschedule.compile_tuned(problem, target, ms_work)[0]
    for name, make in candidates.items():
        try:
            module = make()
            module = getattr(module, "mod", module)    # tvm.compile's Executable -> its runtime Module
            fn = module["main"]
            c = tvm.runtime.empty((problem.m, problem.n), problem.dtype, dev)
            fn(*args, c)
            err = float(np.abs(c.numpy().astype(np.float64) - ref).max())
            timer = module.time_evaluator("main", dev, number=number, repeat=repeat)
            runs = sorted(timer(*args, c).results)
            out[f"{name}_ms"] = runs[len(runs) // 2] * 1e3
            out[f"{name}_max_err"] = err
        except Exception as e:  # noqa: BLE001 - recorded, the other side still runs
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
    if gpu:
        peer = genetic._peer_time(problem, number, repeat)
        if peer:
            out["cublas_ms"], out["cublas"] = peer["ms"], peer["name"]
    out["method"] = f"TVM time_evaluator median of {repeat} x mean of {number} runs; cuBLAS via torch CUDA events"
    return out


# --------------------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------------------
def plot(results: Results, budgets, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workloads = list(results.data["workloads"].values())
    if not workloads:
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        problem = genetic.problem_from_json(w["problem"])
        tf = lambda ms: problem.flops / (np.asarray(ms, dtype=float) * 1e-3) / 1e12  # noqa: E731
        for name, color in (("genetic", "tab:green"), ("random", "tab:gray"), ("evolutionary", "tab:blue")):
            s = w.get(name) or {}
            curve = _curve_load(s.get("curve_ms"))
            label = {"genetic": "tvmseq genetic", "random": "random search",
                     "evolutionary": "MetaSchedule evolutionary"}[name]
            if curve and any(math.isfinite(c) for c in curve):
                x = np.arange(1, len(curve) + 1)
                ax.plot(x, tf(curve), color=color, label=label + (" (median)" if s.get("seeds") else ""))
                if s.get("min_ms") and s.get("max_ms"):
                    ax.fill_between(x, tf(_curve_load(s["max_ms"])), tf(_curve_load(s["min_ms"])), color=color, alpha=0.15)
            elif s.get("points_ms"):
                pts = sorted((int(b), v) for b, v in s["points_ms"].items() if v)
                ax.plot([b for b, _ in pts], tf([v for _, v in pts]), "o--", color=color, label=label + " (points)")
        final = w.get("final") or {}
        peer = final.get("cublas_ms") or (w.get("genetic") or {}).get("peer_ms")
        if peer:
            ax.axhline(tf(peer), color="black", ls="--", lw=1, label="cuBLAS fp32")
        for name, marker in (("genetic", "^"), ("evolutionary", "v")):
            if final.get(f"{name}_ms"):     # at the trial count that strategy reached
                x = len((w.get(name) or {}).get("curve_ms") or []) or max(budgets)
                ax.plot([x], [tf(final[f"{name}_ms"])], marker, color="black", ms=6,
                        label=f"{name} best, re-timed")
        for b in budgets:
            ax.axvline(b, color="0.85", lw=0.8, zorder=0)
        ax.set_xlabel("measured trials")
        ax.set_ylabel("best TFLOP/s so far")
        where = results.data.get("environment", {}).get("gpu") or \
            ((w.get("genetic") or {}).get("measured_on") or {}).get("gpu") or results.data.get("target", "")
        ax.set_title(f"{problem.key} ({where})", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


# --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", default="all", help=f"comma list of {', '.join(PROBLEMS)} or MxNxK[:nk][:bias]")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="trial budgets compared")
    parser.add_argument("--strategies", default="genetic,evolutionary")
    parser.add_argument("--target", default="cuda", help="cuda (the GPU present) or llvm (smoke test)")
    parser.add_argument("--out-dir", default=str(BENCH), help="search_compare.json/.png go here")
    parser.add_argument("--previous", default=str(BENCH / "search_compare.json"),
                        help="earlier results whose genetic curves may be reused")
    parser.add_argument("--work-dir", default=str(ROOT / "out" / "search_compare"),
                        help="MetaSchedule databases and online genetic state (both resumable)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop starting new batches after this many seconds (all workloads together)")
    parser.add_argument("--no-final", action="store_true", help="skip re-timing both bests and cuBLAS")
    parser.add_argument("--plot-only", action="store_true", help="redraw the png from the JSON in --out-dir")
    g = parser.add_argument_group("genetic")
    g.add_argument("--genetic", default="auto", choices=("auto", "reuse", "replay", "online"),
                   help="auto: the first available of reuse / replay / tune_gemm.json / online")
    g.add_argument("--pools", default=str(ROOT / "out" / "gemm_pool"), help="measured pools (index.json)")
    g.add_argument("--genetic-times", default=None, help="directory with <problem>.times.json of the pools")
    g.add_argument("--seeds", type=int, default=10, help="replay seeds")
    g.add_argument("--population", type=int, default=32)
    g.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel builds (online)")
    e = parser.add_argument_group("MetaSchedule")
    e.add_argument("--cost-model", default="random", choices=("random", "mlp", "xgb"))
    e.add_argument("--trials-per-iter", type=int, default=64)
    e.add_argument("--workers", type=int, default=None, help="builder processes (default: all cores)")
    e.add_argument("--build-timeout", type=float, default=300.0)
    # MetaSchedule's samples include kernels of 30-400 ms (the fast ones take 0.4-1 ms on the H100), and
    # the runner times each one (1 + number x repeat) times: these two decide the wall time of a round
    e.add_argument("--runner-number", type=int, default=3)
    e.add_argument("--runner-repeat", type=int, default=2)
    e.add_argument("--runner-min-repeat-ms", type=int, default=0)
    e.add_argument("--seed", type=int, default=0)
    f = parser.add_argument_group("final")
    f.add_argument("--final-number", type=int, default=5)
    f.add_argument("--final-repeat", type=int, default=5)
    args = parser.parse_args(argv)

    budgets = sorted(int(b) for b in args.budgets.split(","))
    top = max(budgets)
    strategies = set(args.strategies.split(","))
    target = make_target(args.target)
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else INF
    out_dir = Path(args.out_dir)
    results = Results(out_dir / "search_compare.json", Path(args.previous) if args.previous else None)
    if args.plot_only:
        plot(results, results.data.get("budgets", budgets), out_dir / "search_compare.png")
        return 0
    meta = {"budgets": budgets, "target": target.kind.name, "target_json": json.loads(str(target))}
    save = lambda: results.save(meta)  # noqa: E731
    work_root = Path(args.work_dir)
    problems = parse_problems(args.problems)

    def report(problem):
        for row in results.rows():
            if row["problem"] == problem.key:
                print("  {key} budget {budget:>4}: genetic {g}  evolutionary {e}  random {r}".format(
                    key=problem.key, budget=row["budget"], g=_fmt(row.get("genetic_ms")),
                    e=_fmt(row.get("evolutionary_ms")), r=_fmt(row.get("random_ms"))), flush=True)
        try:
            plot(results, budgets, out_dir / "search_compare.png")
        except ImportError:
            print("matplotlib not installed: no plot", flush=True)

    # 1. genetic curves (reused, replayed or run here), one workload after the other
    for label, problem in problems:
        w = results.workload(problem)
        w["label"] = label
        if "genetic" in strategies:
            print(f"== {problem.key} ({label}): genetic, {top} trials, target {target.kind.name}", flush=True)
            w.update(genetic_side(problem, w.get("genetic") or {}, target, budgets, args, work_root, deadline))
            save()
    # 2. MetaSchedule in rounds: every workload up to the smallest budget, then on (resuming from its
    #    database) to the next, so a deadline leaves every workload with its smaller budgets done
    if "evolutionary" in strategies:
        for budget in budgets:
            for label, problem in problems:
                w = results.workload(problem)
                if time.monotonic() > deadline:
                    print(f"== {problem.key}: evolutionary up to {budget} trials skipped (deadline)", flush=True)
                    continue
                print(f"== {problem.key} ({label}): MetaSchedule evolutionary up to {budget} trials", flush=True)
                ms_work = work_root / f"ms_{problem.key}"

                def on_batch(w=w, ms_work=ms_work, problem=problem):
                    w["evolutionary"] = dict(w.get("evolutionary") or {}, source="in progress", work_dir=str(ms_work),
                                             curve_ms=_curve_json([t * 1e3 for t in metaschedule.best_so_far(
                                                 metaschedule.records_for(ms_work, problem))]))
                    save()

                before = (w.get("evolutionary") or {}).get("seconds") or 0.0
                w["evolutionary"] = evolutionary(problem, target, budget, ms_work, args, on_batch, deadline)
                w["evolutionary"].update(target=target.kind.name, seconds=round(before + w["evolutionary"]["seconds"], 1))
                save()
    # 3. both bests re-timed the same way, next to cuBLAS
    for label, problem in problems:
        w = results.workload(problem)
        if not args.no_final:
            genes = (w.get("genetic") or {}).get("best_genes")
            ms_work = Path((w.get("evolutionary") or {}).get("work_dir") or work_root / f"ms_{problem.key}")
            w["final"] = final_check(problem, target, genes, ms_work, args.final_number, args.final_repeat)
            print(f"== {problem.key}: final {json.dumps(w['final'])}", flush=True)
            save()
        report(problem)
    print(f"wrote {results.path}", flush=True)
    return 0


def genetic_side(problem, old: dict, target, budgets, args, work_root: Path, deadline: float) -> dict:
    """{"genetic": ..., maybe "random": ...} for this workload (see the module doc for the order)."""
    top = max(budgets)
    if len(old.get("curve_ms") or []) >= top and args.genetic in ("auto", "reuse") \
            and old.get("target", "cuda") == target.kind.name:
        print(f"  genetic: reusing {old.get('trials')} trials ({old.get('source')})", flush=True)
        return {}
    found = None
    if args.genetic in ("auto", "replay") and args.genetic_times and target.kind.name == "cuda":
        found = genetic_from_replay(problem, Path(args.pools), Path(args.genetic_times), top, args.seeds,
                                    args.population)
    if found is None and args.genetic == "auto" and target.kind.name == "cuda":
        found = genetic_from_tune_json(problem, budgets)
    if found is None and args.genetic in ("auto", "online"):
        print(f"  genetic: running online, {top} trials", flush=True)
        found = genetic_online(problem, target, top, work_root / f"ga_{problem.key}", args.jobs, args.population,
                               deadline=deadline)
    if found is None:
        print(f"  genetic: no source for {problem.key} with --genetic {args.genetic}", flush=True)
        return {}
    for rec in found.values():
        rec["target"] = target.kind.name
    print(f"  genetic: {found['genetic']['source']}", flush=True)
    return found


def _fmt(ms):
    return f"{ms:.4f} ms" if ms else "-"


if __name__ == "__main__":
    sys.exit(main())
