"""Genetic search (tvmseq.tune.genetic) and the GEMM schedule template it searches (tvmseq.tune.space).

CPU: the GA's operators on toy objectives (feasibility, crossover/mutation keep genes valid, the best
never gets worse, resuming from saved state), the template's numerics on llvm for odd sizes, layouts,
bias and dtypes, the CUDA template compiled here to sm_90a SASS (no GPU needed), and the whole
build -> measure -> replay pipeline on llvm. GPU: the template's kernels against numpy on the device.
"""
from __future__ import annotations

import functools
import json
import math
import random

import numpy as np
import pytest

from tvmseq.tune import genetic, space
from tvmseq.tune.genetic import GAConfig, GeneticSearch


def gemm_ref(a, b, bias=None, b_layout="kn"):
    """Plain numpy reference, float64 accumulation."""
    bb = b.astype("float64") if b_layout == "kn" else b.astype("float64").T
    out = a.astype("float64") @ bb
    if bias is not None:
        out = out + bias.astype("float64")
    return out


TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float16": dict(rtol=1e-2, atol=3e-2)}

# --------------------------------------------------------------------------------------------------
# toy spaces and objectives
# --------------------------------------------------------------------------------------------------
TOY = {f"x{i}": (1, 2, 4, 8, 16, 32) for i in range(6)}
TOY_TARGET = {"x0": 8, "x1": 2, "x2": 16, "x3": 4, "x4": 1, "x5": 32}


def toy_feasible(g):
    # tile-like constraints: a product limit ("threads") and a divisibility rule
    return g["x0"] * g["x1"] <= 64 and g["x3"] % g["x4"] == 0


def toy_time(g):
    return 1.0 + sum((math.log2(g[k]) - math.log2(v)) ** 2 for k, v in TOY_TARGET.items())


def toy_evaluate(calls):
    def evaluate(batch):
        for g in batch:
            assert toy_feasible(g), f"an infeasible individual was measured: {g}"
        calls.append(len(batch))
        return [toy_time(g) for g in batch]

    return evaluate


def random_genes(rng, choices=TOY):
    return {k: rng.choice(v) for k, v in choices.items()}


# --------------------------------------------------------------------------------------------------
# operators
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_two_point_crossover_keeps_genes_valid(seed):
    rng = random.Random(seed)
    names = list(TOY)
    a, b = random_genes(rng), random_genes(rng)
    c1, c2 = genetic.two_point_crossover(a, b, names, rng)
    assert set(c1) == set(c2) == set(names)
    swapped = [n for n in names if c1[n] != a[n]]
    for n in names:
        assert c1[n] in TOY[n] and c2[n] in TOY[n]
        # each child takes every gene from one parent, the other child from the other parent
        assert {c1[n], c2[n]} == {a[n], b[n]}
    # genes taken from the other parent form one contiguous segment (two cut points)
    if swapped:
        idx = [names.index(n) for n in names if c1[n] == b[n] and a[n] != b[n]]
        lo, hi = min(idx), max(idx)
        assert all(c1[names[i]] == b[names[i]] for i in range(lo, hi + 1))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_mutation_keeps_genes_valid(seed, rate):
    rng = random.Random(seed)
    choices = dict(space.GENES)
    g = random_genes(rng, choices)
    m = genetic.mutate(g, choices, rate, rng)
    assert set(m) == set(g)
    assert all(m[k] in choices[k] for k in m)
    if rate == 0.0:
        assert m == g
    if rate == 1.0:   # every gene with a choice changes
        assert all(m[k] != g[k] for k in m if len(choices[k]) > 1)


def test_tournament_prefers_faster_individuals():
    rng = random.Random(0)
    population = [({"x": i}, float(t)) for i, t in enumerate(rng.sample(range(1, 101), 100))]
    times = {g["x"]: t for g, t in population}
    winners = [times[genetic.tournament_select(population, 3, rng)["x"]] for _ in range(2000)]
    picks = [times[rng.randrange(100)] for _ in range(2000)]
    assert np.mean(winners) < 0.7 * np.mean(picks)
    assert times[genetic.tournament_select(population, 400, rng)["x"]] <= 3


# --------------------------------------------------------------------------------------------------
# the search
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("population", [8, 16])
def test_infeasible_never_measured_and_best_never_worse(seed, population):
    calls = []
    ga = GeneticSearch(TOY, toy_feasible, GAConfig(population=population, seed=seed))
    bests = []
    ga.run(toy_evaluate(calls), budget=96, on_generation=lambda s: bests.append(s.best_time))
    assert ga.trials == 96 == sum(calls)
    assert all(c <= population for c in calls)
    assert ga.infeasible > 0                      # the space has infeasible points and they were met
    assert all(not toy_feasible(dict(zip(ga.names, k))) for k, t in ga.cache.items() if t == math.inf)
    keys = [genetic.genes_id(h["genes"], ga.names) for h in ga.history]
    assert len(set(keys)) == len(keys)           # nothing measured twice
    assert all(b2 <= b1 for b1, b2 in zip(bests, bests[1:]))
    assert ga.best_time == min(h["time"] for h in ga.history)
    assert ga.curve() == sorted(ga.curve(), reverse=True)
    # elitism: the best ever is in the current population
    assert any(genetic.genes_id(g, ga.names) == genetic.genes_id(ga.best[0], ga.names) for g, _ in ga.population)


def test_failed_measurements_count_as_inf():
    ga = GeneticSearch(TOY, toy_feasible, GAConfig(population=8, seed=1))
    batch = ga.ask()
    ga.tell(batch, [None, float("nan"), -1.0, 0.0] + [toy_time(g) for g in batch[4:]])
    assert [h["time"] for h in ga.history[:4]] == [math.inf] * 4
    assert math.isfinite(ga.best_time)


def test_genetic_beats_random_on_toy_objective():
    """Same budget, same seeds: the GA's final best is better on average (deterministic seeds)."""
    ga_final, rs_final = [], []
    for seed in range(8):
        ga = GeneticSearch(TOY, toy_feasible, GAConfig(population=16, seed=seed))
        ga.run(toy_evaluate([]), budget=128)
        ga_final.append(ga.best_time)
        rs_final.append(genetic.random_search(TOY, toy_feasible, toy_evaluate([]), 128, seed).best_time)
    assert np.mean(ga_final) < np.mean(rs_final)


def test_exhausted_space_stops():
    small = {"a": (1, 2), "b": (1, 2, 3)}
    ga = GeneticSearch(small, lambda g: g["a"] * g["b"] != 6, GAConfig(population=4, seed=0))
    ga.run(lambda batch: [float(g["a"] + g["b"]) for g in batch], budget=100)
    assert ga.trials == 5 and ga.best_time == 2.0


def test_state_roundtrip_resumes_identically():
    cfg = GAConfig(population=8, seed=3)
    straight = GeneticSearch(TOY, toy_feasible, cfg)
    straight.run(toy_evaluate([]), budget=48)

    first = GeneticSearch(TOY, toy_feasible, cfg)
    first.run(toy_evaluate([]), budget=24)
    state = json.loads(json.dumps(first.state()))     # through JSON, as the CLI stores it
    resumed = GeneticSearch.from_state(state, toy_feasible)
    resumed.run(toy_evaluate([]), budget=48)
    assert [h["genes"] for h in resumed.history] == [h["genes"] for h in straight.history]
    assert resumed.best_time == straight.best_time


def test_ga_over_the_gemm_space_asks_only_feasible_points():
    problem = space.GemmProblem(2048, 2048, 2048)
    target = {"max_threads_per_block": 1024}

    class Target:   # the attribute surface feasible() reads
        attrs = target
        kind = type("K", (), {"name": "cuda"})

    feasible = lambda g: space.feasible(g, problem, Target) is None  # noqa: E731
    ga = GeneticSearch(space.GENES, feasible, GAConfig(population=16, seed=0), seeds=[space.DEFAULT_GENES])
    first = ga.ask()
    assert space.DEFAULT_GENES in first
    # a cost model standing in for the GPU: prefers 8x8 per thread and 128x128 tiles
    ga.tell(first, [abs(g["tm"] * g["tn"] - 64) + abs(g["bm"] - 128) / 8 + 1 for g in first])
    for _ in range(3):
        batch = ga.ask()
        assert batch and all(feasible(g) for g in batch)
        ga.tell(batch, [abs(g["tm"] * g["tn"] - 64) + abs(g["bm"] - 128) / 8 + 1 for g in batch])
    assert ga.best_time == 1.0


# --------------------------------------------------------------------------------------------------
# the GEMM template
# --------------------------------------------------------------------------------------------------
def test_feasibility_reasons():
    p = space.GemmProblem(2048, 2048, 2048)
    g = dict(space.DEFAULT_GENES)
    assert space.feasible(g, p) is None
    assert "does not divide m" in space.feasible(space.DEFAULT_GENES, space.GemmProblem(2000, 2048, 2048))
    assert "threads" in space.feasible(dict(g, tm=2, tn=2, wm=2, wn=2), p)     # 64x64 = 4096 threads
    assert "shared memory" in space.feasible(dict(g, bk=32, stages=3), p)
    assert "spill" in space.feasible(dict(g, bm=256, bn=256, tm=16, tn=16), p)
    assert "warp" in space.feasible(dict(g, warp_n=32), p)                       # 16 threads along N
    assert "stages" in space.feasible(dict(g, async_copy=1, stages=1), p)
    assert "missing" in space.feasible({"bm": 128}, p)
    with pytest.raises(Exception, match="infeasible"):
        space.apply(dict(g, tm=2, tn=2, wm=2, wn=2), p, "llvm")


@functools.lru_cache(maxsize=None)
def _cpu_kernel(problem, genes_items):
    return space.build(dict(genes_items), problem, "llvm")


SMALL_GENES = [
    dict(space.DEFAULT_GENES, bm=32, bn=32, bk=8, tm=4, tn=4, warp_n=8, wm=2, wn=4),
    dict(space.DEFAULT_GENES, bm=16, bn=32, bk=4, tm=2, tn=4, wm=1, wn=2, warp_n=4, vec=2, stages=3,
         async_copy=1, pad=0),
    dict(space.DEFAULT_GENES, bm=32, bn=16, bk=8, tm=8, tn=1, wm=4, wn=1, warp_n=16, vec=1, stages=1, pad=4),
]


@pytest.mark.parametrize("genes", range(len(SMALL_GENES)))
@pytest.mark.parametrize("b_layout,bias", [("kn", False), ("nk", True), ("nk", False)])
@pytest.mark.parametrize("m,n,k", [(64, 96, 40), (32, 32, 24)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_template_matches_numpy_on_cpu(genes, b_layout, bias, m, n, k, dtype):
    problem = space.GemmProblem(m, n, k, dtype=dtype, b_layout=b_layout, bias=bias)
    g = SMALL_GENES[genes]
    if space.feasible(g, problem) is not None:
        pytest.skip(space.feasible(g, problem))
    import tvm

    ex = _cpu_kernel(problem, tuple(sorted(g.items())))
    rng = np.random.default_rng(m * n + k)
    a = rng.uniform(-1, 1, (m, k)).astype(dtype)
    b = rng.uniform(-1, 1, problem.b_shape).astype(dtype)
    bias_v = rng.uniform(-1, 1, n).astype(dtype) if bias else None
    c = tvm.runtime.tensor(np.zeros((m, n), dtype))
    args = [tvm.runtime.tensor(a), tvm.runtime.tensor(b)] + ([tvm.runtime.tensor(bias_v)] if bias else [])
    ex["main"](*args, c)
    np.testing.assert_allclose(c.numpy(), gemm_ref(a, b, bias_v, b_layout), **TOL[dtype])


def test_problem_roundtrip_from_prim_func():
    for p in (space.GemmProblem(64, 96, 40), space.GemmProblem(128, 64, 32, "float16", "nk", True)):
        assert space._problem_of(space.gemm_func(p)) == p
    rule = space.TiledGemm(dict(SMALL_GENES[0]))
    assert rule.apply(space.gemm_func(space.GemmProblem(64, 96, 40)), None) is not None
    assert rule.apply(space.gemm_func(space.GemmProblem(60, 96, 40)), None) is None   # 32 does not divide 60


def _nvcc_available():
    from tvmseq import cuda_toolchain

    return cuda_toolchain.find_nvcc() is not None


@pytest.mark.skipif(not _nvcc_available(), reason="nvcc not installed")
def test_cuda_template_compiles_to_sass_here(tmp_path):
    """The CUDA schedule builds for sm_90a on this machine (no GPU needed) in the parallel builder's
    worker processes, and the .so files carry compiled device code: ptxas reports no spills, the
    register count the feasibility estimate allows, and exactly the shared memory it computed."""
    problem = space.GemmProblem(1024, 1024, 512)
    population = [dict(space.DEFAULT_GENES), dict(space.DEFAULT_GENES, async_copy=1, stages=3, pad=0)]
    index = genetic.build_population(problem, population, tmp_path, "cuda", ("sm_90a",), jobs=2, progress=False)
    assert index["build"]["failed"] == 0 and index["device_code"] == ["fatbin"]
    for record in index["candidates"]:
        g, report = record["genes"], record["ptxas"]
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0
        assert 0 < report["registers"] <= space.registers_estimate(g) + 16
        assert report["smem"] == space.shared_bytes(g, problem)
        data = (tmp_path / record["file"]).read_bytes()
        assert b"\x50\xed\x55\xba" in data and b"__global__" not in data     # fatbin, no CUDA source


# --------------------------------------------------------------------------------------------------
# build -> measure -> replay, on llvm
# --------------------------------------------------------------------------------------------------
def test_pool_build_measure_replay_on_cpu(tmp_path):
    problem = space.GemmProblem(32, 32, 16)
    choices = {**{k: (v,) for k, v in SMALL_GENES[0].items()}, "bk": (4, 8), "tm": (2, 4), "tn": (4,),
               "wm": (1, 2), "warp_n": (8,), "stages": (1, 2)}
    points = space.enumerate_feasible(problem, None, choices)
    assert 4 <= len(points) <= 16
    index = genetic.build_population(problem, points, tmp_path, "llvm", jobs=1, progress=False)
    assert index["build"]["failed"] == 0 and len(index["candidates"]) == len(points)
    index["choices"] = {k: list(v) for k, v in choices.items()}
    (tmp_path / "index.json").write_text(json.dumps(index))
    report = genetic.measure_pool(tmp_path, number=2, repeat=3, isolate=False)
    assert all(r["ok"] and r["ms"] > 0 for r in report["results"].values()), report["results"]
    assert all(r["max_err"] <= 1e-4 for r in report["results"].values())
    times = genetic.load_times(tmp_path / "times.json")
    run = genetic.replay(index, times, budget=len(points), seeds=range(2), config=GAConfig(population=4))
    for curves in run["curves"].values():
        for curve in curves:   # a budget as large as the pool finds the pool's best
            assert len(curve) == len(points) and curve[-1] == pytest.approx(run["pool_best_ms"])


# --------------------------------------------------------------------------------------------------
# MetaSchedule's evolutionary search through tvmseq's wrapper (llvm: runs without a GPU)
# --------------------------------------------------------------------------------------------------
def test_evolutionary_search_resumes_and_shares_the_database(tmp_path):
    import tvm

    from tvmseq.tune import metaschedule as msx

    problem = space.GemmProblem(64, 96, 40)
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    settings = dict(num_trials_per_iter=3, cost_model="random", progress=False,
                    builder=msx.BuilderSettings(workers=1, timeout_s=120),
                    runner=msx.RunnerSettings(number=1, repeat=1, min_repeat_ms=0))
    first = msx.tune(problem, target, tmp_path / "ms", 3, **settings)
    assert first.new_trials == 3 and len(first.curve_s) == 3
    again = msx.tune(problem, target, tmp_path / "ms", 5, **settings)        # resumes: 2 more
    assert again.new_trials == 2 and len(again.curve_s) == 5
    assert all(b <= a for a, b in zip(again.curve_s, again.curve_s[1:])) and math.isfinite(again.best_s)
    assert msx.tune(problem, target, tmp_path / "ms", 5, **settings).new_trials == 0

    # the genetic search's records and MetaSchedule's share one database; the best of both is applied
    genes = dict(SMALL_GENES[0])
    db = tmp_path / "db"
    assert msx.commit_records(db, problem, target, [(genes, 1e-9), (dict(genes, bm=64), math.inf)]) == 1
    assert msx.merge_best(tmp_path / "ms", db, problem, k=2) == 2
    assert msx.records_for(db, problem)[0] == 1e-9 and len(msx.records_for(db, problem)) == 3
    assert msx.tuned_problems(db) == [problem]
    executable, how = msx.compile_tuned(problem, target, db)
    assert how == "database"
    a = np.random.default_rng(0).uniform(-1, 1, (64, 40)).astype("float32")
    b = np.random.default_rng(1).uniform(-1, 1, (40, 96)).astype("float32")
    c = tvm.runtime.tensor(np.zeros((64, 96), "float32"))
    executable["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), gemm_ref(a, b), **TOL["float32"])


def test_default_genes_fit_any_tileable_problem():
    for p in (space.GemmProblem(2048, 2048, 2048), space.GemmProblem(64, 96, 40), space.GemmProblem(32, 32, 8)):
        assert space.feasible(space.default_genes(p), p) is None
    for untileable in (space.GemmProblem(100, 96, 40), space.GemmProblem(16, 16, 4)):
        with pytest.raises(Exception, match="cannot tile"):
            space.default_genes(untileable)


# --------------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------------
def _gpu_with_compiler():
    import tvm

    from tvmseq import targets

    return targets.has_gpu() and not tvm.base._RUNTIME_ONLY


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_with_compiler(), reason="needs a GPU and TVM's compiler")
@pytest.mark.parametrize("genes", [dict(space.DEFAULT_GENES), dict(space.DEFAULT_GENES, async_copy=1, stages=3),
                                   dict(space.DEFAULT_GENES, bm=64, bn=128, tm=8, tn=8, warp_n=4, bk=16)])
@pytest.mark.parametrize("b_layout,bias", [("kn", False), ("nk", True)])
def test_template_matches_numpy_on_gpu(genes, b_layout, bias):
    import tvm

    from tvmseq import targets

    problem = space.GemmProblem(512, 384, 256, b_layout=b_layout, bias=bias)
    target = targets.resolve("cuda")
    ex = space.build(genes, problem, target)
    dev = tvm.cuda(0)
    rng = np.random.default_rng(1)
    a = rng.uniform(-1, 1, (problem.m, problem.k)).astype("float32")
    b = rng.uniform(-1, 1, problem.b_shape).astype("float32")
    bias_v = rng.uniform(-1, 1, problem.n).astype("float32") if bias else None
    c = tvm.runtime.tensor(np.zeros((problem.m, problem.n), "float32"), dev)
    args = [tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)] + ([tvm.runtime.tensor(bias_v, dev)] if bias else [])
    ex["main"](*args, c)
    np.testing.assert_allclose(c.numpy(), gemm_ref(a, b, bias_v, b_layout), rtol=1e-4, atol=1e-4)
