"""Genetic search over schedule genes, with building here and measuring on the GPU.

The search (after "GEMM tuning by parallel genetic algorithm"): an individual is one choice per gene
(tile and thread factors, see `space.GENES`); infeasible individuals get time +inf without being built;
parents are picked by tournament selection, children made by two-point crossover over the ordered
genes and per-gene mutation (a step to a neighbouring choice or a random one); the best individual
ever seen is always carried into the next population; a whole population is asked for at once, so it
can be built in parallel and measured in one go. `GeneticSearch` knows nothing about GEMMs: it takes
the gene choices and a feasibility predicate, and is driven by `ask()` / `tell(times)` or `run()`.

Building and measuring a GEMM population are separate steps so that compiling happens on the CPU
machine (all candidates of a population compiled to `.so` files carrying sm_90a code, in parallel) and
only timing happens on the GPU machine, with nothing but TVM's runtime there:

    python3 -m tvmseq.tune.genetic pool    --problem 2048x2048x2048 --space compact --out DIR   # here
    python3 -m tvmseq.tune.genetic measure DIR --out times.json                               # GPU
    python3 -m tvmseq.tune.genetic replay  DIR --times times.json --budgets 64,128,256         # here

`pool` builds every feasible point of a (compact) space, `measure` times them all in one GPU session,
and `replay` runs the genetic search (and random search) against the measured table: each trial looks
up the time the GPU measured, so the search behaves exactly as if it had measured online (the pool is
its whole search space). `propose` / `ingest` run true generations instead (one GPU call each), and
`tune` does everything in-process on a machine that has both the compiler and a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..errors import TvmseqError
from . import space   # pure Python at import time (no compiler needed where only measuring)

INF = float("inf")


# ---------------------------------------------------------------------------------------------------
# The genetic algorithm (generic)
# ---------------------------------------------------------------------------------------------------
@dataclass
class GAConfig:
    population: int = 32        # individuals measured per generation
    tournament: int = 3         # contestants per tournament
    crossover_rate: float = 0.9
    mutation_rate: float = 0.15  # per gene
    elite: int = 2              # best individuals carried over unchanged (the best ever among them)
    seed: int = 0
    max_draws: int = 20000      # children tried per generation before falling back to random immigrants


def genes_id(genes: dict, names: Sequence[str]) -> tuple:
    return tuple(int(genes[n]) for n in names)


def tournament_select(population: list[tuple[dict, float]], size: int, rng: random.Random) -> dict:
    """The fastest of `size` individuals drawn at random (with replacement) from the population."""
    contestants = [population[rng.randrange(len(population))] for _ in range(size)]
    return min(contestants, key=lambda item: item[1])[0]


def two_point_crossover(a: dict, b: dict, names: Sequence[str], rng: random.Random) -> tuple[dict, dict]:
    """Swap the genes between two cut points (in the order of `names`)."""
    i, j = sorted(rng.sample(range(len(names) + 1), 2))
    c1, c2 = dict(a), dict(b)
    for name in names[i:j]:
        c1[name], c2[name] = b[name], a[name]
    return c1, c2


def mutate(genes: dict, choices: dict, rate: float, rng: random.Random) -> dict:
    """Each gene changes with probability `rate`: half the time to a neighbouring choice (tile sizes
    are ordered), otherwise to any other choice. Values always stay within the gene's choices."""
    out = dict(genes)
    for name, values in choices.items():
        if len(values) < 2 or rng.random() >= rate:
            continue
        idx = values.index(out[name]) if out[name] in values else rng.randrange(len(values))
        if rng.random() < 0.5:
            step = rng.choice((-1, 1))
            idx = min(max(idx + step, 0), len(values) - 1) if 0 <= idx + step < len(values) else idx - step
        else:
            idx = rng.choice([k for k in range(len(values)) if k != idx])
        out[name] = values[idx]
    return out


class GeneticSearch:
    """Ask/tell genetic search. `choices` maps gene name -> ordered tuple of values; `feasible(genes)`
    says whether an individual may be measured (infeasible ones get +inf, never measured, not counted
    as trials). Times are minimised; failures are reported as +inf."""

    def __init__(self, choices: dict, feasible: Callable[[dict], bool], config: GAConfig | None = None,
                 seeds: Iterable[dict] = ()):
        self.choices = {k: tuple(v) for k, v in choices.items()}
        self.names = list(self.choices)
        self.feasible = feasible
        self.config = config or GAConfig()
        self.rng = random.Random(self.config.seed)
        self.seeds = [dict(s) for s in seeds]
        self.cache: dict[tuple, float] = {}       # every individual seen -> time (+inf: infeasible/failed)
        self.population: list[tuple[dict, float]] = []
        self.history: list[dict] = []             # measured trials in order: {"trial", "genes", "time"}
        self.best: tuple[dict, float] | None = None
        self.generation = 0
        self.infeasible = 0
        self.pending: list[dict] = []
        self._known_children: list[tuple[dict, float]] = []

    # -- bookkeeping ---------------------------------------------------------------------------------
    @property
    def trials(self) -> int:
        return len(self.history)

    @property
    def best_time(self) -> float:
        return self.best[1] if self.best else INF

    def curve(self) -> list[float]:
        """Best time after each trial (the best-so-far curve)."""
        out, best = [], INF
        for rec in self.history:
            best = min(best, rec["time"])
            out.append(best)
        return out

    def _key(self, genes: dict) -> tuple:
        return genes_id(genes, self.names)

    def _screen(self, genes: dict) -> bool:
        """True if `genes` may be measured now: feasible and never seen. Infeasible ones are recorded
        with +inf without running."""
        key = self._key(genes)
        if key in self.cache:
            return False
        if not self.feasible(genes):
            self.cache[key] = INF
            self.infeasible += 1
            return False
        return True

    def _random_new(self, want: int, taken: set) -> list[dict]:
        out = []
        for _ in range(self.config.max_draws):
            if len(out) >= want:
                break
            genes = {n: self.rng.choice(v) for n, v in self.choices.items()}
            if self._key(genes) not in taken and self._screen(genes):
                out.append(genes)
                taken.add(self._key(genes))
        return out

    # -- ask / tell ----------------------------------------------------------------------------------
    def ask(self, limit: int | None = None) -> list[dict]:
        """The next individuals to measure (at most `limit`, at most one population); [] when the
        space has nothing new left to offer."""
        if self.pending:
            return list(self.pending)
        want = min(self.config.population, limit if limit is not None else self.config.population)
        taken: set = set()
        new: list[dict] = []
        self._known_children = []
        if not self.population:
            for genes in self.seeds:
                if len(new) < want and self._key(genes) not in taken and self._screen(genes):
                    new.append(dict(genes))
                    taken.add(self._key(genes))
            new += self._random_new(want - len(new), taken)
        else:
            new = self._breed(want, taken)
            if len(new) < want:     # converged: bring in random immigrants to keep measuring new points
                new += self._random_new(want - len(new), taken)
        self.pending = new
        return list(new)

    def _breed(self, want: int, taken: set) -> list[dict]:
        cfg, new = self.config, []
        for _ in range(cfg.max_draws):
            if len(new) >= want:
                break
            p1 = tournament_select(self.population, cfg.tournament, self.rng)
            p2 = tournament_select(self.population, cfg.tournament, self.rng)
            if self.rng.random() < cfg.crossover_rate:
                children = two_point_crossover(p1, p2, self.names, self.rng)
            else:
                children = (dict(p1), dict(p2))
            for child in children:
                child = mutate(child, self.choices, cfg.mutation_rate, self.rng)
                key = self._key(child)
                if key in taken:
                    continue
                if key in self.cache:
                    if math.isfinite(self.cache[key]) and len(self._known_children) < want:
                        self._known_children.append((child, self.cache[key]))   # no new trial needed
                        taken.add(key)
                    continue
                if self._screen(child) and len(new) < want:
                    new.append(child)
                    taken.add(key)
        return new

    def tell(self, individuals: Sequence[dict], times: Sequence[float]) -> None:
        """Record measured times (+inf for a failed build or run) of the individuals `ask` returned."""
        if len(individuals) != len(times):
            raise ValueError(f"{len(individuals)} individuals but {len(times)} times")
        measured = []
        for genes, t in zip(individuals, times):
            t = float(t) if t is not None and math.isfinite(float(t)) and float(t) > 0 else INF
            self.cache[self._key(genes)] = t
            self.history.append({"trial": len(self.history) + 1, "genes": dict(genes), "time": t})
            measured.append((dict(genes), t))
            if t < self.best_time:
                self.best = (dict(genes), t)
        pool = self.population + measured + self._known_children
        elites = _unique_best(pool, self.config.elite, self._key)
        children = sorted(measured + self._known_children, key=lambda item: item[1])
        keys = {self._key(g) for g, _ in elites}
        children = [c for c in children if self._key(c[0]) not in keys]
        self.population = (elites + children)[:max(self.config.population, len(elites))]
        self.pending, self._known_children = [], []
        self.generation += 1

    def run(self, evaluate: Callable[[list[dict]], Sequence[float]], budget: int,
            on_generation: Callable[["GeneticSearch"], None] | None = None) -> tuple[dict, float] | None:
        """ask/evaluate/tell until `budget` trials are measured or the space is exhausted."""
        while self.trials < budget:
            batch = self.ask(limit=budget - self.trials)
            if not batch:
                break
            self.tell(batch, evaluate(batch))
            if on_generation:
                on_generation(self)
        return self.best

    # -- persistence ---------------------------------------------------------------------------------
    def state(self) -> dict:
        def enc(t):
            return t if math.isfinite(t) else None

        rng_state = self.rng.getstate()
        return {"config": asdict(self.config), "choices": {k: list(v) for k, v in self.choices.items()},
                "rng": [rng_state[0], list(rng_state[1]), rng_state[2]], "generation": self.generation,
                "infeasible": self.infeasible, "seeds": self.seeds,
                "cache": [[list(k), enc(t)] for k, t in self.cache.items()],
                "population": [[g, enc(t)] for g, t in self.population],
                "history": [dict(h, time=enc(h["time"])) for h in self.history],
                "pending": self.pending}

    @classmethod
    def from_state(cls, state: dict, feasible: Callable[[dict], bool]) -> "GeneticSearch":
        def dec(t):
            return INF if t is None else float(t)

        ga = cls(state["choices"], feasible, GAConfig(**state["config"]), state.get("seeds", ()))
        version, internal, gauss = state["rng"]
        ga.rng.setstate((version, tuple(internal), gauss))
        ga.generation, ga.infeasible = state["generation"], state["infeasible"]
        ga.cache = {tuple(k): dec(t) for k, t in state["cache"]}
        ga.population = [(g, dec(t)) for g, t in state["population"]]
        ga.history = [dict(h, time=dec(h["time"])) for h in state["history"]]
        ga.pending = state.get("pending", [])
        for h in ga.history:
            if ga.best is None or h["time"] < ga.best[1]:
                ga.best = (h["genes"], h["time"])
        return ga


def _unique_best(pool, count, key):
    out, seen = [], set()
    for genes, t in sorted(pool, key=lambda item: item[1]):
        k = key(genes)
        if k not in seen and math.isfinite(t):
            out.append((genes, t))
            seen.add(k)
        if len(out) >= count:
            break
    return out


def random_search(choices: dict, feasible: Callable[[dict], bool], evaluate, budget: int, seed: int = 0):
    """Baseline at the same trial budget: feasible individuals drawn uniformly without repeats."""
    ga = GeneticSearch(choices, feasible, GAConfig(seed=seed, population=budget))
    batch = ga._random_new(budget, set())
    ga.tell(batch, evaluate(batch) if batch else [])
    return ga


# ---------------------------------------------------------------------------------------------------
# GEMM populations: build here (parallel, .so with device code), measure on the GPU
# ---------------------------------------------------------------------------------------------------
def parse_problem(text: str, b_layout: str = "kn", bias: bool = False, dtype: str = "float32"):
    """"2048x2048x2048" (MxNxK) -> GemmProblem."""
    try:
        m, n, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise TvmseqError(f"--problem {text!r}: expected MxNxK, e.g. 2048x2048x2048") from None
    return space.GemmProblem(m, n, k, dtype=dtype, b_layout=b_layout, bias=bias)


def problem_from_json(data: dict):
    return space.GemmProblem(**data)


def _init_build_worker(arches: tuple[str, ...]) -> None:
    from .. import cuda_toolchain

    if arches:
        cuda_toolchain.enable_device_binaries(arches)


def _build_one(job: tuple) -> dict:
    """Build one candidate and export it (runs in a worker process)."""
    problem_json, genes, target_json, out_dir = job
    import tvm

    from .. import cuda_toolchain

    problem = problem_from_json(problem_json)
    key = space.genes_key(genes)
    record = {"key": key, "genes": genes, "file": f"{key}.so", "error": None}
    start, nvcc_before = time.perf_counter(), cuda_toolchain.NVCC.seconds
    try:
        target = tvm.target.Target(target_json)
        executable = space.build(genes, problem, target)
        executable.export_library(str(Path(out_dir) / record["file"]))
        record["device_code"] = cuda_toolchain.device_code_of(executable)
        record["ptxas"] = cuda_toolchain.NVCC.last_report.get("main_kernel") or next(
            iter(cuda_toolchain.NVCC.last_report.values()), None)
    except Exception as err:  # noqa: BLE001 - a failed candidate is a result (+inf), not a crash
        record["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:500]
    record["build_s"] = round(time.perf_counter() - start, 3)
    record["nvcc_s"] = round(cuda_toolchain.NVCC.seconds - nvcc_before, 3)
    return record


def build_population(problem, population: list[dict], out_dir: Path, target=None, arches=("sm_90a",),
                     jobs: int | None = None, progress: bool = True) -> dict:
    """Compile every individual of `population` to `out_dir/<key>.so` (device code for `arches`), in
    `jobs` worker processes; write and return `out_dir/index.json`. Failed builds are recorded with
    their error (the GA gives them +inf)."""
    import concurrent.futures
    import multiprocessing

    from .. import targets

    target = targets.resolve(target or "cuda")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    done = _already_built(out_dir)     # resume an interrupted build
    work = [(problem.to_json(), dict(g), target_json_of(target), str(out_dir)) for g in population
            if space.genes_key(g) not in done]
    if progress and done:
        print(f"  {len(population) - len(work)} candidates already built in {out_dir}", flush=True)
    start = time.perf_counter()
    records: list[dict] = []
    ctx = multiprocessing.get_context("spawn")
    arches = tuple(arches) if targets.is_gpu(target) else ()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_build_worker,
                                                initargs=(arches,)) as pool:
        for i, record in enumerate(pool.map(_build_one, work), 1):
            if i % 10 == 0 or i == len(work):   # checkpoint: an interrupted build resumes from here
                _write_index(out_dir, problem, target, arches, records + [record], time.perf_counter() - start, jobs)
            records.append(record)
            if progress:
                status = "failed: " + record["error"] if record["error"] else f"{record['build_s']:.1f} s"
                print(f"  built {i}/{len(work)} {record['key']} {status}", flush=True)
    index = _write_index(out_dir, problem, target, arches, records, time.perf_counter() - start, jobs)
    return index


def _already_built(out_dir: Path) -> set:
    path = out_dir / "index.json"
    if not path.exists():
        return set()
    index = json.loads(path.read_text())
    return {c["key"] for c in index.get("candidates", []) if not c.get("error") and (out_dir / c["file"]).exists()}


def target_json_of(target) -> dict:
    """A Target as the JSON dict tvm.target.Target() accepts back (host and tag attributes included)."""
    return json.loads(str(target))


def _write_index(out_dir: Path, problem, target, arches, records, seconds, jobs) -> dict:
    import tvm

    index_path = out_dir / "index.json"
    old = json.loads(index_path.read_text()) if index_path.exists() else {}
    merged = {r["key"]: r for r in old.get("candidates", [])}
    merged.update({r["key"]: r for r in records})
    index = {"problem": problem.to_json(), "target": target_json_of(target), "arch": list(arches),
             "tvm": tvm.__version__, "device_code": sorted({r.get("device_code", "?") for r in records}),
             "build": {"candidates": len(records), "failed": sum(bool(r["error"]) for r in records),
                       "wall_s": round(seconds, 1), "jobs": jobs,
                       "candidate_s": round(sum(r["build_s"] for r in records), 1),
                       "nvcc_s": round(sum(r.get("nvcc_s", 0) for r in records), 1)},
             "candidates": list(merged.values())}
    index_path.write_text(json.dumps(index, indent=1))
    return index


def measure_pool(pool_dir: Path, out: Path | None = None, keys: Sequence[str] | None = None,
                 number: int = 5, repeat: int = 5, peer: bool = True, isolate: bool = True) -> dict:
    """Time every built candidate of `pool_dir` (index.json + .so files) on the GPU present; check
    each against a reference first (a wrong result counts as a failure). Needs only TVM's runtime.
    With `isolate`, candidates run in a child process that is restarted after a crash, so one bad
    kernel cannot take the others with it. Writes and returns {"results": {key: {...}}, ...}."""
    pool_dir = Path(pool_dir)
    index = json.loads((pool_dir / "index.json").read_text())
    todo = [c["key"] for c in index["candidates"] if not c.get("error") and (keys is None or c["key"] in keys)]
    out = Path(out or pool_dir / "times.json")
    results: dict = {}
    if isolate:
        results = _measure_isolated(pool_dir, todo, number, repeat)
    else:
        results = _measure_in_process(pool_dir, todo, number, repeat, lambda k, r: None)
    for c in index["candidates"]:
        if c.get("error"):
            results[c["key"]] = {"ms": None, "ok": False, "error": "build: " + c["error"]}
    report = {"problem": index["problem"], "pool": str(pool_dir), "results": results}
    report.update(_environment(index["target"]["kind"] == "cuda"))
    if peer and index["target"]["kind"] == "cuda":
        report["peer"] = _peer_time(problem_from_json(index["problem"]), number, repeat)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    ok = [r["ms"] for r in results.values() if r.get("ok")]
    best = min(ok) if ok else None
    print(f"measured {len(ok)}/{len(results)} candidates ok; best {best} ms; peer {report.get('peer')}; -> {out}")
    return report


_RESTART = 75   # exit code of a measuring child whose CUDA context is unusable after an error


def _measure_isolated(pool_dir: Path, todo: list[str], number: int, repeat: int,
                      seconds_per_candidate: float = 20.0) -> dict:
    """Measure in child processes: a child that crashes, hangs or poisons its CUDA context (exit code
    _RESTART after recording the failure) is replaced and the rest continue in a fresh one."""
    import subprocess
    import tempfile

    results: dict = {}
    remaining = list(todo)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    while remaining:
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            log = f.name
        cmd = [sys.executable, "-m", "tvmseq.tune.genetic", "measure-worker", str(pool_dir), "--log", log,
               "--number", str(number), "--repeat", str(repeat), "--keys", ",".join(remaining)]
        try:
            rc = subprocess.run(cmd, env=env, timeout=60 + seconds_per_candidate * len(remaining)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        for line in Path(log).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                results[rec.pop("key")] = rec
        os.unlink(log)
        remaining = [k for k in remaining if k not in results]
        if rc == 0 or not remaining:
            break
        if rc != _RESTART:     # crashed or hung while measuring the next one: that one failed
            results[remaining.pop(0)] = {"ms": None, "ok": False, "error": f"measuring process died ({rc})"}
    return results


def _measure_in_process(pool_dir: Path, keys: list[str], number: int, repeat: int, emit,
                        restart_on_cuda_error: bool = False) -> dict:
    import numpy as np
    import tvm

    from .. import cuda_toolchain

    index = json.loads((pool_dir / "index.json").read_text())
    problem = problem_from_json(index["problem"])
    if index["target"]["kind"] == "cuda":
        if not cuda_toolchain.ensure_cuda_runtime():
            raise RuntimeError("no usable CUDA device for measuring")
        dev = tvm.cuda(0)
    else:
        dev = tvm.cpu(0)   # CI: the same code path on candidates built for llvm
    host_inputs, reference = _problem_data(problem)
    args = [tvm.runtime.tensor(x, dev) for x in host_inputs]
    out = tvm.runtime.empty((problem.m, problem.n), problem.dtype, dev)
    scale = float(np.abs(reference).max()) or 1.0
    poison = np.full((problem.m, problem.n), np.nan, problem.dtype)
    results = {}
    for key in keys:
        rec: dict = {"ms": None, "ok": False, "error": None}
        try:
            module = tvm.runtime.load_module(str(pool_dir / f"{key}.so"))
            func = module["main"]
            out.copyfrom(poison)      # NaN: an element the kernel never writes fails the check
            func(*args, out)
            dev.sync()
            got = out.numpy()
            err = INF if np.isnan(got).any() else float(np.abs(got - reference).max())
            rec["max_err"] = err if math.isfinite(err) else None
            if err <= 1e-3 * scale:
                timer = module.time_evaluator("main", dev, number=number, repeat=repeat)
                runs = sorted(timer(*args, out).results)
                rec.update(ms=runs[len(runs) // 2] * 1e3, ok=True)
            else:
                rec["error"] = f"wrong result (max abs error {err:.3g}, |ref| max {scale:.3g})"
        except Exception as e:  # noqa: BLE001 - recorded per candidate
            rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        results[key] = rec
        emit(key, rec)
        if rec["error"] and "CUDA" in rec["error"] and restart_on_cuda_error:
            sys.exit(_RESTART)      # CUDA errors are sticky: continue in a fresh process
        if len(results) % 25 == 0 or len(results) == len(keys):
            ok = [r["ms"] for r in results.values() if r["ok"]]
            print(f"  measured {len(results)}/{len(keys)}, best so far {min(ok, default=INF):.4f} ms", flush=True)
    return results


def _problem_data(problem):
    """Seeded random inputs (never zeros) and the float64 numpy reference."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (problem.m, problem.k)).astype(problem.dtype)
    b = rng.uniform(-1, 1, problem.b_shape).astype(problem.dtype)
    inputs = [a, b]
    ref = a.astype("float64") @ (b.astype("float64") if problem.b_layout == "kn" else b.astype("float64").T)
    if problem.bias:
        bias = rng.uniform(-1, 1, problem.n).astype(problem.dtype)
        inputs.append(bias)
        ref += bias
    return inputs, ref.astype(problem.dtype)


def _peer_time(problem, number: int, repeat: int) -> dict | None:
    """cuBLAS through torch (fp32 without TF32), timed with CUDA events; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from ..measure import time_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    dt = getattr(torch, problem.dtype)
    a = torch.rand(problem.m, problem.k, device="cuda", dtype=dt)
    b = torch.rand(*problem.b_shape, device="cuda", dtype=dt)
    bias = torch.rand(problem.n, device="cuda", dtype=dt) if problem.bias else None
    bb = b if problem.b_layout == "kn" else b.t()
    fn = (lambda: torch.addmm(bias, a, bb)) if problem.bias else (lambda: torch.mm(a, bb))
    ms = time_cuda(fn, warmup=10, iters=number * repeat)
    return {"name": "cuBLAS via torch (fp32, TF32 off)", "ms": ms, "torch": torch.__version__}


def _environment(gpu: bool) -> dict:
    env = {}
    try:
        import tvm

        from .. import cuda_toolchain

        if gpu:
            cuda_toolchain.ensure_cuda_runtime()
        env["tvm"] = tvm.__version__
        if tvm.cuda(0).exist:
            env["gpu"] = tvm.cuda(0).device_name
            env["compute_version"] = tvm.cuda(0).compute_version
    except Exception:  # noqa: BLE001
        pass
    return {"environment": env, "date": time.strftime("%Y-%m-%d %H:%M")}


def load_times(path: Path) -> dict[str, float]:
    """{candidate key: ms} from a measure report (failures as +inf)."""
    report = json.loads(Path(path).read_text())
    return {k: (r["ms"] if r.get("ok") and r.get("ms") else INF) for k, r in report["results"].items()}


# ---------------------------------------------------------------------------------------------------
# Replaying searches against a measured pool
# ---------------------------------------------------------------------------------------------------
def pool_space(index: dict, times: dict[str, float], choices: dict | None = None):
    """(choices, feasible, evaluate) for searching over a measured pool: the pool is the space."""
    problem = problem_from_json(index["problem"])
    by_key = {c["key"]: c for c in index["candidates"]}
    choices = choices or _choices_of(index)

    def feasible(genes):
        return space.genes_key(genes) in by_key and space.feasible(genes, problem, None) is None

    def evaluate(batch):
        return [times.get(space.genes_key(g), INF) for g in batch]

    return choices, feasible, evaluate


def _choices_of(index: dict) -> dict:
    """The gene choices a pool was drawn from (recorded by `pool`, else the values present)."""
    if index.get("choices"):
        return {k: tuple(v) for k, v in index["choices"].items()}
    names = list(index["candidates"][0]["genes"])
    return {n: tuple(sorted({c["genes"][n] for c in index["candidates"]})) for n in names}


def replay(index: dict, times: dict[str, float], budget: int, seeds: Sequence[int] = range(5),
           config: GAConfig | None = None) -> dict:
    """Best-so-far curves of the genetic search and of random search, `budget` trials each, per seed."""
    choices, feasible, evaluate = pool_space(index, times)
    curves = {"genetic": [], "random": []}
    for seed in seeds:
        cfg = GAConfig(**{**asdict(config or GAConfig()), "seed": seed})
        ga = GeneticSearch(choices, feasible, cfg)
        ga.run(evaluate, budget)
        curves["genetic"].append(ga.curve())
        curves["random"].append(random_search(choices, feasible, evaluate, budget, seed).curve())
    finite = [t for t in times.values() if math.isfinite(t)]
    return {"budget": budget, "seeds": list(seeds), "pool_size": len(index["candidates"]),
            "pool_best_ms": min(finite) if finite else None, "curves": curves}


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------
def _problem_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--problem", required=True, help="MxNxK, e.g. 2048x2048x2048")
    p.add_argument("--b-layout", default="kn", choices=("kn", "nk"), help="B stored [K,N] or [N,K]")
    p.add_argument("--bias", action="store_true", help="fused bias epilogue")
    p.add_argument("--target", default="cuda", help="target to build for (default: the H100 tag)")
    p.add_argument("--arch", default="sm_90a", help="comma-separated SASS architectures to embed")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel build processes")


def _cmd_pool(args) -> None:
    from .. import targets

    problem = parse_problem(args.problem, args.b_layout, args.bias)
    target = targets.resolve(args.target)
    choices = space.COMPACT_GENES if args.space == "compact" else space.GENES
    points = space.enumerate_feasible(problem, target, choices) if args.space == "compact" else []
    if args.space == "full" or (args.limit and args.limit < len(points)):
        rng = random.Random(args.seed)
        if args.space == "full":
            ga = GeneticSearch(choices, lambda g: space.feasible(g, problem, target) is None, GAConfig(seed=args.seed))
            points = ga._random_new(args.limit or 256, set())
        else:
            points = rng.sample(points, args.limit)
    out = Path(args.out)
    print(f"{problem.key}: building {len(points)} candidates into {out} with {args.jobs} processes")
    index = build_population(problem, points, out, target, tuple(args.arch.split(",")), args.jobs)
    # an exhaustive pool is the whole space of `choices`; a sample is searched over its own values
    index["exhaustive"] = args.space == "compact" and not (args.limit and args.limit < len(points))
    if index["exhaustive"]:
        index["choices"] = {k: list(v) for k, v in choices.items()}
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(json.dumps(index["build"]))


def _cmd_measure(args) -> None:
    keys = args.keys.split(",") if args.keys else None
    measure_pool(Path(args.pool), Path(args.out) if args.out else None, keys, args.number, args.repeat,
                 peer=not args.no_peer, isolate=not args.in_process)


def _cmd_measure_worker(args) -> None:
    log = open(args.log, "a", buffering=1)

    def emit(key, rec):
        log.write(json.dumps({"key": key, **rec}) + "\n")

    _measure_in_process(Path(args.pool), args.keys.split(","), args.number, args.repeat, emit,
                        restart_on_cuda_error=True)


def _cmd_replay(args) -> None:
    index = json.loads((Path(args.pool) / "index.json").read_text())
    times = load_times(Path(args.times))
    cfg = GAConfig(population=args.population)
    report = {"problem": index["problem"], "runs": []}
    for budget in (int(b) for b in args.budgets.split(",")):
        run = replay(index, times, budget, range(args.seeds), cfg)
        for name, curves in run["curves"].items():
            finals = [c[-1] for c in curves if c]
            print(f"budget {budget:4d} {name:8s}: best {min(finals):.4f} ms, median over seeds "
                  f"{sorted(finals)[len(finals) // 2]:.4f} ms (pool best {run['pool_best_ms']:.4f})")
        report["runs"].append(run)
    out = Path(args.out or Path(args.times).with_name("replay.json"))
    out.write_text(json.dumps(report, indent=1, default=lambda x: None if x == INF else x))
    print(f"wrote {out}")


def _cmd_propose(args) -> None:
    """One true GA generation: ask, then build the asked individuals into DIR (state in --state)."""
    from .. import targets

    problem = parse_problem(args.problem, args.b_layout, args.bias)
    target = targets.resolve(args.target)
    feasible = lambda g: space.feasible(g, problem, target) is None  # noqa: E731
    state_path = Path(args.state)
    if state_path.exists():
        ga = GeneticSearch.from_state(json.loads(state_path.read_text()), feasible)
    else:
        choices = space.COMPACT_GENES if args.space == "compact" else space.GENES
        ga = GeneticSearch(choices, feasible, GAConfig(population=args.population, seed=args.seed),
                           seeds=[space.DEFAULT_GENES])
    batch = ga.ask(limit=args.budget - ga.trials if args.budget else None)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(ga.state()))
    if not batch:
        print("nothing left to measure (budget reached or space exhausted)")
        return
    build_population(problem, batch, Path(args.out), target, tuple(args.arch.split(",")), args.jobs)
    print(f"generation {ga.generation}: {len(batch)} candidates in {args.out}; measure them on the GPU, "
          f"then `ingest`")


def _cmd_ingest(args) -> None:
    state_path = Path(args.state)
    state = json.loads(state_path.read_text())
    times = load_times(Path(args.times))
    ga = GeneticSearch.from_state(state, lambda g: True)
    batch = ga.pending
    ga.tell(batch, [times.get(space.genes_key(g), INF) for g in batch])
    state_path.write_text(json.dumps(ga.state()))
    print(f"generation {ga.generation}: {ga.trials} trials, best {ga.best_time:.4f} ms {ga.best[0] if ga.best else ''}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tvmseq.tune.genetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pool", help="build every feasible candidate of a space (here, no GPU needed)")
    _problem_args(p)
    p.add_argument("--space", default="compact", choices=("compact", "full"))
    p.add_argument("--limit", type=int, default=0, help="random sample of this many candidates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_pool)

    p = sub.add_parser("measure", help="time every built candidate on the GPU (TVM runtime only)")
    p.add_argument("pool")
    p.add_argument("--out", default=None, help="JSON report (default POOL/times.json)")
    p.add_argument("--keys", default=None, help="comma-separated subset")
    p.add_argument("--number", type=int, default=5)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-peer", action="store_true", help="skip the cuBLAS (torch) reference timing")
    p.add_argument("--in-process", action="store_true", help="no crash isolation (faster start)")
    p.set_defaults(func=_cmd_measure)

    p = sub.add_parser("measure-worker", help=argparse.SUPPRESS)
    p.add_argument("pool")
    p.add_argument("--log", required=True)
    p.add_argument("--keys", required=True)
    p.add_argument("--number", type=int, default=10)
    p.add_argument("--repeat", type=int, default=7)
    p.set_defaults(func=_cmd_measure_worker)

    p = sub.add_parser("replay", help="genetic vs random search over a measured pool")
    p.add_argument("pool")
    p.add_argument("--times", required=True)
    p.add_argument("--budgets", default="64,128,256")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--population", type=int, default=32)
    p.add_argument("--out", default=None)
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("propose", help="ask one generation and build it (state file keeps the GA)")
    _problem_args(p)
    p.add_argument("--state", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--space", default="full", choices=("compact", "full"))
    p.add_argument("--population", type=int, default=32)
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_propose)

    p = sub.add_parser("ingest", help="tell the GA the times measured for the last proposal")
    p.add_argument("--state", required=True)
    p.add_argument("--times", required=True)
    p.set_defaults(func=_cmd_ingest)

    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
