"""Tune the GEMMs tvmseq runs: the 2048^3 fp32 GEMM and the GRU input projection (all time steps at
once: [T*B, I] x [3H, I]^T + bias, T=100, B=64, I=H=1024). Results go into the MetaSchedule database
`schedules/gemm/` (committed; `tvmseq build` and the importer apply it) and the strategy comparison into
`artifacts/bench/tune_gemm.{json,png}` (best-so-far curves of the genetic search, random search and
MetaSchedule's evolutionary search at equal trial budgets, with cuBLAS as the line to reach).

Steps (compile here, measure there; `python3 schedules/tune_gemm.py <step> --help`):
  pool          here:  build every candidate of the compact space with sm_90a SASS (parallel over the
                       cores) into out/gemm_pool/<problem>/, packed as out/gemm_pool.tar.xz to carry
  measure       GPU:   time every candidate + cuBLAS (TVM runtime only) -> <out>/<problem>.times.json
  evolutionary  GPU:   MetaSchedule evolutionary search (needs TVM's compiler there), resumable
  compare       here:  replay the genetic and random search on the measured pools, add MetaSchedule's
                       curves, write the plot, commit the best schedules to schedules/gemm/
  genetic       GPU with compiler: the genetic search online (build + measure each generation there)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvmseq.tune import genetic, metaschedule, space  # noqa: E402

DB_DIR = ROOT / "schedules" / "gemm"
POOL_DIR = ROOT / "out" / "gemm_pool"
BUDGETS = (64, 128, 256)

# The shapes users run. The GRU input GEMM: gate_i = X W_i^T + b_i for all T*B rows (W_i stored [3H, I]).
PROBLEMS = {
    "gemm2048": space.GemmProblem(2048, 2048, 2048),
    "gru_input": space.GemmProblem(100 * 64, 3 * 1024, 1024, b_layout="nk", bias=True),
}


def _target():
    from tvmseq import targets

    return targets.resolve("cuda")


def _problems(names: str):
    chosen = list(PROBLEMS) if names == "all" else names.split(",")
    unknown = [n for n in chosen if n not in PROBLEMS]
    if unknown:
        raise SystemExit(f"unknown problem(s) {unknown}; known: {', '.join(PROBLEMS)}")
    return [PROBLEMS[n] for n in chosen]


# --------------------------------------------------------------------------------------------------
def cmd_pool(args):
    target = _target()
    for problem in _problems(args.problems):
        points = space.enumerate_feasible(problem, target, space.COMPACT_GENES)
        out = Path(args.out) / problem.key
        print(f"{problem.key}: {len(points)} feasible candidates in the compact space -> {out}", flush=True)
        index = genetic.build_population(problem, points, out, target, tuple(args.arch.split(",")), args.jobs)
        index.update(exhaustive=True, choices={k: list(v) for k, v in space.COMPACT_GENES.items()})
        (out / "index.json").write_text(json.dumps(index, indent=1))
        print(json.dumps(index["build"]), flush=True)
    if args.pack:
        pack = Path(args.out).with_suffix(".tar.xz")
        with tarfile.open(pack, "w:xz") as tar:
            for problem in _problems(args.problems):
                tar.add(Path(args.out) / problem.key, arcname=problem.key)
        print(f"packed {pack} ({pack.stat().st_size / 2**20:.1f} MiB)")


def cmd_measure(args):
    src = Path(args.pools)
    if src.suffix == ".xz":
        dest = Path(args.unpack_to)
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(src, "r:xz") as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        src = dest
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for problem in _problems(args.problems):
        pool = src / problem.key
        if not (pool / "index.json").exists():
            print(f"{problem.key}: no pool in {src}, skipped")
            continue
        start = time.perf_counter()
        genetic.measure_pool(pool, out / f"{problem.key}.times.json", number=args.number, repeat=args.repeat)
        print(f"{problem.key}: measured in {time.perf_counter() - start:.1f} s", flush=True)


def cmd_evolutionary(args):
    from tvmseq import cuda_toolchain

    target = _target()
    out = Path(args.out)
    # nvcc through tvmseq's callback (explicit arch, SASS for this GPU); NVRTC through TVM's own
    arches = (cuda_toolchain.present_arch(),) if args.compile_mode == "nvcc" and cuda_toolchain.find_nvcc() else ()
    for problem in _problems(args.problems):
        work = out / f"ms_{problem.key}"
        builder = metaschedule.BuilderSettings(workers=args.workers, timeout_s=args.build_timeout,
                                               compile_mode=args.compile_mode, device_code_arches=arches)
        result = metaschedule.tune(problem, target, work, args.trials, cost_model=args.cost_model,
                                   builder=builder, seed=args.seed)
        curve = [t * 1e3 for t in result.curve_s]
        (out / f"{problem.key}.evolutionary.json").write_text(json.dumps(
            {"problem": problem.to_json(), "strategy": "metaschedule-evolutionary", "cost_model": args.cost_model,
             "curve_ms": [c if math.isfinite(c) else None for c in curve], "new_trials": result.new_trials,
             "seconds": round(result.seconds, 1)}, indent=1))
        print(f"{problem.key}: {len(curve)} trials, best {curve[-1] if curve else None} ms, "
              f"{result.seconds:.0f} s", flush=True)


def cmd_genetic(args):
    """Online: each generation is built in parallel here and measured on this machine's GPU."""
    from tvmseq import cuda_toolchain

    target = _target()
    out = Path(args.out)
    for problem in _problems(args.problems):
        work = out / f"ga_{problem.key}"
        state_path = work / "state.json"
        feasible = lambda g: space.feasible(g, problem, target) is None  # noqa: E731
        if state_path.exists():
            ga = genetic.GeneticSearch.from_state(json.loads(state_path.read_text()), feasible)
        else:
            ga = genetic.GeneticSearch(space.GENES, feasible, genetic.GAConfig(population=args.population, seed=args.seed),
                                       seeds=[space.DEFAULT_GENES])

        def evaluate(batch):
            pool = work / f"gen{ga.generation:03d}"
            genetic.build_population(problem, batch, pool, target, (cuda_toolchain.present_arch(),), args.jobs,
                                     progress=False)
            report = genetic.measure_pool(pool, pool / "times.json", peer=False)
            return [report["results"].get(space.genes_key(g), {}).get("ms") or math.inf for g in batch]

        def checkpoint(s):
            work.mkdir(parents=True, exist_ok=True)
            state_path.write_text(json.dumps(s.state()))
            print(f"{problem.key}: generation {s.generation}, {s.trials}/{args.trials} trials, "
                  f"best {s.best_time:.4f} ms", flush=True)

        ga.run(evaluate, args.trials, on_generation=checkpoint)
        metaschedule.commit_records(DB_DIR, problem, target, [(h["genes"], h["time"] / 1e3)
                                                              for h in sorted(ga.history, key=lambda h: h["time"])[:4]])


def cmd_compare(args):
    """Replay the searches on the measured pools, plot them against MetaSchedule and cuBLAS, commit."""
    from tvmseq.bench.common import print_table, save

    target = _target()
    results_dir = Path(args.results)
    rows, panels = [], []
    for problem in _problems(args.problems):
        times_path = results_dir / f"{problem.key}.times.json"
        if not times_path.exists():
            print(f"{problem.key}: no measurements at {times_path}, skipped")
            continue
        pool = Path(args.pools) / problem.key
        index = json.loads((pool / "index.json").read_text())
        report = json.loads(times_path.read_text())
        times = genetic.load_times(times_path)
        run = genetic.replay(index, times, max(BUDGETS), range(args.seeds), genetic.GAConfig(population=args.population))
        ms_curve = _evolutionary_curve(results_dir, problem)
        peer_ms = (report.get("peer") or {}).get("ms")
        tflops = lambda ms: problem.flops / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) else None  # noqa: E731
        for budget in BUDGETS:
            row = {"problem": problem.key, "budget": budget}
            for name, curves in run["curves"].items():
                finals = sorted(c[min(budget, len(c)) - 1] for c in curves if c)
                row[f"{name}_ms"] = finals[len(finals) // 2]
            row["evolutionary_ms"] = ms_curve[min(budget, len(ms_curve)) - 1] if ms_curve else None
            row["cublas_ms"] = peer_ms
            best = row["genetic_ms"]
            row["genetic_tflops"] = tflops(best)
            row["genetic_vs_cublas"] = peer_ms / best if peer_ms and best else None
            rows.append(row)
        panels.append((problem, run, ms_curve, peer_ms, report.get("environment", {})))
        best_pool = sorted((t, k) for k, t in times.items() if math.isfinite(t))[:args.commit]
        by_key = {c["key"]: c["genes"] for c in index["candidates"]}
        n = metaschedule.commit_records(DB_DIR, problem, target, [(by_key[k], t / 1e3) for t, k in best_pool])
        merged = metaschedule.merge_best(results_dir / f"ms_{problem.key}", DB_DIR, problem, args.commit)
        print(f"{problem.key}: committed {n} genetic + {merged} evolutionary records to {DB_DIR}")
    if not rows:
        return
    print_table(rows, ["problem", "budget", "genetic_ms", "random_ms", "evolutionary_ms", "cublas_ms",
                       "genetic_tflops", "genetic_vs_cublas"])
    save("tune_gemm", rows, {"seeds": args.seeds, "population": args.population, "space": "compact",
                             "measured_on": [p[4] for p in panels]}, plot=_plot(panels))


def _evolutionary_curve(results_dir: Path, problem) -> list[float]:
    path = results_dir / f"{problem.key}.evolutionary.json"
    if path.exists():
        return [c if c is not None else math.inf for c in json.loads(path.read_text())["curve_ms"]]
    return [t * 1e3 for t in metaschedule.best_so_far(metaschedule.records_for(results_dir / f"ms_{problem.key}", problem))]


def _plot(panels):
    def plot(path):
        import matplotlib.pyplot as plt
        import numpy as np

        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for ax, (problem, run, ms_curve, peer_ms, env) in zip(axes[0], panels):
            to_tf = lambda ms: problem.flops / (np.asarray(ms) * 1e-3) / 1e12  # noqa: E731
            for name, color in (("genetic", "tab:green"), ("random", "tab:gray")):
                # a search that exhausted the space early keeps its best for the remaining trials
                curves = np.array([c + c[-1:] * (run["budget"] - len(c)) for c in run["curves"][name] if c])
                if len(curves):
                    tf = to_tf(curves)
                    x = np.arange(1, tf.shape[1] + 1)
                    ax.plot(x, np.median(tf, axis=0), color=color, label=f"{name} (median of {len(tf)} seeds)")
                    ax.fill_between(x, tf.min(axis=0), tf.max(axis=0), color=color, alpha=0.15)
            if ms_curve:
                ax.plot(np.arange(1, len(ms_curve) + 1), to_tf(ms_curve), color="tab:blue",
                        label="MetaSchedule evolutionary")
            if peer_ms:
                ax.axhline(to_tf(peer_ms), color="black", ls="--", lw=1, label="cuBLAS fp32")
                ax.axhline(0.85 * to_tf(peer_ms), color="black", ls=":", lw=1, label="85% of cuBLAS")
            for b in BUDGETS:
                ax.axvline(b, color="0.85", lw=0.8, zorder=0)
            ax.set_xlabel("measured trials")
            ax.set_ylabel("best TFLOP/s so far")
            ax.set_title(f"{problem.key} ({env.get('gpu', 'GPU')})", fontsize=9)
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


# --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)

    p = sub.add_parser("pool", help="build all compact-space candidates here (sm_90a SASS)")
    p.add_argument("--problems", default="all", help=f"comma list of {', '.join(PROBLEMS)}")
    p.add_argument("--out", default=str(POOL_DIR))
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--pack", action="store_true", help="also write <out>.tar.xz to carry to the GPU machine")
    p.set_defaults(func=cmd_pool)

    p = sub.add_parser("measure", help="GPU: time every pool candidate and cuBLAS")
    p.add_argument("pools", help="directory of pools, or the .tar.xz from `pool --pack`")
    p.add_argument("--problems", default="all")
    p.add_argument("--unpack-to", default="/tmp/tvmseq_gemm_pool")
    p.add_argument("--out", required=True)
    p.add_argument("--number", type=int, default=5, help="runs averaged per timing")
    p.add_argument("--repeat", type=int, default=5, help="timings (the median is kept)")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("evolutionary", help="GPU with TVM's compiler: MetaSchedule evolutionary search")
    p.add_argument("--problems", default="all")
    p.add_argument("--trials", type=int, default=max(BUDGETS))
    p.add_argument("--cost-model", default="random", choices=("random", "mlp", "xgb"))
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--build-timeout", type=float, default=300.0)
    p.add_argument("--compile-mode", default="nvcc", choices=("nvcc", "nvrtc"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="work dirs (databases, resumable) and curves go here")
    p.set_defaults(func=cmd_evolutionary)

    p = sub.add_parser("genetic", help="GPU with TVM's compiler: the genetic search online, full space")
    p.add_argument("--problems", default="all")
    p.add_argument("--trials", type=int, default=max(BUDGETS))
    p.add_argument("--population", type=int, default=32)
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_genetic)

    p = sub.add_parser("compare", help="replay + plot + commit the best schedules")
    p.add_argument("--problems", default="all")
    p.add_argument("--pools", default=str(POOL_DIR))
    p.add_argument("--results", required=True, help="directory with the measure/evolutionary outputs")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--population", type=int, default=32)
    p.add_argument("--commit", type=int, default=4, help="best records per strategy committed to schedules/gemm")
    p.set_defaults(func=cmd_compare)

    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
