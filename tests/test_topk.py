"""tvmseq.kernels.topk.topk (hierarchical top-k) and tvmseq.beam_search_step against numpy.

CPU tests build the kernels for llvm: the same block program as on CUDA (threads emulated by a serial
loop), including the GPU-sized configurations and the exact fallback. GPU tests (`-m gpu`) load the
CUDA kernels from TVMSEQ_TOPK_PREBUILT (written by `python3 -m tvmseq.bench.topk --build-only DIR`)
or build them when TVM's compiler is present.
Tolerances: indices and values exact for every dtype (selection copies values); beam-step scores
fp32 rtol 1e-5 / atol 1e-5 against a float64 reference (fp16 logits: the same, computed from them).
"""
from __future__ import annotations

import functools
import importlib
import os

import numpy as np
import pytest
import tvm

from tvmseq import targets
from tvmseq.errors import TvmseqError

reference = importlib.import_module("tvmseq.reference.topk")  # (the package re-exports a function `topk`)


class _Lazy:
    """Imported on first use: where only TVM's runtime is (the GPU machine) tvm.script is missing, and
    the GPU tests below must still be collected."""

    def __init__(self, module: str):
        self._module, self._mod = module, None

    def __getattr__(self, name):
        if self._mod is None:
            import importlib

            self._mod = importlib.import_module(self._module)
        return getattr(self._mod, name)


tk = _Lazy("tvmseq.kernels.topk.topk")
beam = _Lazy("tvmseq.beam")


def numpy_topk(x: np.ndarray, k: int, largest: bool = True):
    """Plain reference: stable argsort (equal values keep index order) of -x or x, first k."""
    keyed = -x.astype(np.float64) if largest else x.astype(np.float64)
    idx = np.argsort(keyed, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, axis=-1), idx.astype(np.int64)


def make_rows(rows: int, n: int, dtype: str, mode: str, seed: int = 0) -> np.ndarray:
    """Random rows, never all zeros: 'normal', 'ties' (few distinct values), 'neginf' (a third -inf)."""
    rng = np.random.default_rng(seed)
    if mode == "ties":
        return rng.integers(-3, 3, (rows, n)).astype(dtype)
    x = rng.standard_normal((rows, n)).astype(dtype)
    if mode == "neginf":
        x[rng.random((rows, n)) < 0.33] = -np.inf
    return x


def run_kernel(x: np.ndarray, k: int, largest: bool = True, cfg: dict | None = None):
    """The kernel on the CPU; `cfg`: TopKConfig fields (default: the CPU configuration)."""
    return tk.topk(x, k, axis=-1, largest=largest, target="llvm", cfg=tk.TopKConfig(**cfg) if cfg else None)


def assert_exact(got, want):
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])


# ----------------------------------------------------------------------------------------- CPU tests
@pytest.mark.parametrize("mode", ["normal", "ties", "neginf"])
@pytest.mark.parametrize("rows,n,k,dtype,largest", [
    (3, 1, 1, "float32", True),  # rows of length 1
    (2, 7, 7, "float16", False),  # k = row length
    (4, 777, 5, "float32", False), (4, 777, 5, "float16", True),
    (1, 1000, 1, "float32", True),  # k = 1
    (3, 2049, 8, "float32", True), (3, 2049, 8, "float16", False),
    (2, 5001, 64, "float32", False),  # several level-0 blocks per row, then merges
])
def test_topk_matches_numpy(rows, n, k, dtype, largest, mode):
    x = make_rows(rows, n, dtype, mode, seed=rows * n + k)
    assert_exact(run_kernel(x, k, largest), numpy_topk(x, k, largest))


@pytest.mark.parametrize("mode", ["normal", "ties", "neginf"])
@pytest.mark.parametrize("cfg", [
    # GPU-sized blocks, emulated: 256 threads with warp-sized groups, merge blocks of 256
    dict(threads=256, values_per_thread=4, merge_threads=256, merge_values_per_thread=2),
    # tiny blocks: many levels (k=16 lists merged 4 at a time)
    dict(threads=32, values_per_thread=2, merge_threads=32, merge_values_per_thread=2, candidate_capacity=64,
         merge_threads_large_k=32),
    # group-maxima threshold at level 0 for every k (kth_min_k above the k tested)
    dict(threads=64, values_per_thread=4, merge_threads=64, merge_values_per_thread=4, kth_min_k=1000),
    # the exact fallback (bitwise search of the k-th key, then of the tie index) in every block
    dict(threads=32, values_per_thread=8, merge_threads=32, merge_values_per_thread=4, force_exact_fallback=True),
], ids=["gpu-sized", "multi-level", "group-threshold", "exact-fallback"])
def test_configs_match_numpy(cfg, mode):
    x = make_rows(2, 3001, "float32", mode, seed=7)
    for k in (1, 16):
        assert_exact(run_kernel(x, k, True, cfg), numpy_topk(x, k, True))


def test_plan_has_several_levels():
    cfg = tk.TopKConfig(threads=32, values_per_thread=2, merge_threads=32, merge_values_per_thread=2,
                        merge_threads_large_k=32)
    levels = tk.plan_levels(3001, 16, cfg)
    assert len(levels) >= 3 and levels[-1].segments == 1


def test_large_k_merges_use_short_runs():
    # k >= kth_min_k: merge blocks of merge_threads_large_k threads x merge_values_large_k items
    cfg = tk.TopKConfig()
    levels = tk.plan_levels(128256, 64, cfg, min_threads=32)
    assert all((lv.threads, lv.values) == (512, 2) for lv in levels[1:-1])
    assert levels[-1].segments == 1 and levels[-1].values == 2


def test_overflowing_candidates_take_the_fallback():
    # all-equal rows: every item reaches the threshold, more than the candidate buffer holds
    cfg = dict(threads=32, values_per_thread=8, merge_threads=32, merge_values_per_thread=8, candidate_capacity=32)
    assert cfg["threads"] * cfg["values_per_thread"] > max(cfg["candidate_capacity"], 2 * 8)
    for x in (np.zeros((2, 1000), "float32"), np.full((2, 1000), -np.inf, "float32")):
        assert_exact(run_kernel(x, 5, True, cfg), numpy_topk(x, 5, True))
    x = np.zeros((2, 1000), "float32")
    x[:, 500:] = 1
    assert_exact(run_kernel(x, 16, False, cfg), numpy_topk(x, 16, False))


def test_signed_zeros_tie_by_index():
    rng = np.random.default_rng(3)
    x = np.where(rng.random((2, 301)) < 0.5, 0.0, -0.0).astype("float32")
    x[:, ::7] = rng.standard_normal((2, 43)).astype("float32")
    for largest in (True, False):
        assert_exact(run_kernel(x, 10, largest), numpy_topk(x, 10, largest))


def test_sorted_rows():
    x = np.sort(make_rows(3, 3000, "float32", "normal"), axis=-1)
    for data in (x, x[:, ::-1].copy()):
        assert_exact(run_kernel(data, 6), numpy_topk(data, 6))


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "uint32", "uint64", "float64"])
def test_other_dtypes(dtype):
    rng = np.random.default_rng(5)
    if dtype.startswith("u"):
        x = rng.integers(0, np.iinfo(dtype).max, (3, 333), dtype=dtype, endpoint=True)
        x[:, :20] = x[:, 20:40]  # ties
    elif dtype.startswith("int"):
        x = rng.integers(-50, 50, (3, 333)).astype(dtype)
    else:
        x = rng.standard_normal((3, 333))
    largest = dtype in ("int32", "uint8", "uint64")
    assert_exact(run_kernel(x, 6, largest), reference.topk(x, 6, largest=largest))


def test_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = make_rows(3, 500, "float32", "ties").astype(ml_dtypes.bfloat16)
    v, i = run_kernel(x, 4)
    want_v, want_i = numpy_topk(x.astype("float32"), 4)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(v.astype("float32"), want_v)


def test_large_k_uses_the_sort_path():
    x = make_rows(2, 3001, "float32", "ties", seed=11)
    cfg = tk.choose_config(2, 3001, 300, False)
    assert not tk.uses_hierarchy(3001, 300, cfg)
    assert_exact(run_kernel(x, 300), numpy_topk(x, 300))
    assert_exact(run_kernel(x, 3001, False), numpy_topk(x, 3001, False))


@pytest.mark.parametrize("axis", [0, 1, -3])
def test_axis(axis):
    x = make_rows(1, 5 * 37 * 3, "float32", "ties", seed=2).reshape(5, 37, 3)
    v, i = tk.topk(x, 3, axis=axis, largest=True, target="llvm")
    moved = np.moveaxis(x, axis, -1)
    rv, ri = numpy_topk(moved, 3, True)
    np.testing.assert_array_equal(i, np.moveaxis(ri, -1, axis))
    np.testing.assert_array_equal(v, np.moveaxis(rv, -1, axis))


def test_reference_module_agrees_with_plain_numpy():
    x = make_rows(4, 500, "float32", "ties", seed=9)
    for largest in (True, False):
        assert_exact(reference.topk(x, 17, largest=largest), numpy_topk(x, 17, largest))


@pytest.mark.parametrize("k", [5, None])
def test_symbolic_rows(k):
    """rows (and K for the sort path) read from the tensors at run time."""
    ex = tvm.compile(tvm.IRModule({"topk": tk.topk_func(None, 400, k, "float32", True, "llvm")}), target="llvm")
    for rows, kk in [(1, 5), (6, 5)] + ([(3, 400), (2, 1)] if k is None else []):
        x = make_rows(rows, 400, "float32", "ties", seed=rows)
        vals = tvm.runtime.tensor(np.zeros((rows, kk), "float32"))
        inds = tvm.runtime.tensor(np.zeros((rows, kk), "int64"))
        ex["topk"](tvm.runtime.tensor(x), vals, inds)
        assert_exact((vals.numpy(), inds.numpy()), numpy_topk(x, kk))


def test_runtime_k_too_large_is_refused():
    ex = tvm.compile(tvm.IRModule({"topk": tk.topk_func(None, 40, None, "float32", True, "llvm")}), target="llvm")
    args = [np.zeros((2, 40), "float32"), np.zeros((2, 41), "float32"), np.zeros((2, 41), "int64")]
    with pytest.raises(Exception, match="K is larger than the size of the selected axis"):
        ex["topk"](*[tvm.runtime.tensor(a) for a in args])


@pytest.mark.parametrize("k,match", [(6, "larger than axis"), (-1, "negative"), (2.0, "integer"),
                                     (True, "integer")])
def test_invalid_k(k, match):
    with pytest.raises(TvmseqError, match=match):
        tk.topk(np.ones((2, 5), "float32"), k, target="llvm")


def test_invalid_inputs():
    with pytest.raises(TvmseqError, match="axis 2 is out of range"):
        tk.topk(np.ones((2, 5), "float32"), 1, axis=2, target="llvm")
    with pytest.raises(TvmseqError, match="scalar"):
        tk.topk(np.float32(1), 1, target="llvm")
    with pytest.raises(TvmseqError, match="dtype"):
        tk.topk(np.ones((2, 5), "complex64"), 1, target="llvm")
    with pytest.raises(TvmseqError, match="power of two"):
        tk.TopKConfig(threads=48).validate(gpu=True)


def test_k_zero_gives_empty_outputs():
    v, i = tk.topk(np.ones((2, 5), "float32"), 0, target="llvm")
    assert v.shape == (2, 0) and i.shape == (2, 0) and i.dtype == np.int64


# ------------------------------------------------------------------------------------- beam step, CPU
def numpy_beam(logits, beam_scores, k):
    """Plain reference: float64 log-softmax + beam score, stable top-k over beam*vocab."""
    batch, beam = beam_scores.shape
    lg = logits.reshape(batch, beam, -1).astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lsm = lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))
    flat = (beam_scores[:, :, None] + lsm).reshape(batch, -1)
    scores, idx = numpy_topk(flat, k, True)
    return scores, idx // lg.shape[-1], idx % lg.shape[-1]


@pytest.mark.parametrize("batch,beam_width,vocab,k,dtype", [
    (2, 3, 500, None, "float32"), (3, 4, 1001, 6, "float32"), (1, 1, 77, 1, "float16"), (2, 4, 3000, 8, "float32")])
def test_beam_step_matches_numpy(batch, beam_width, vocab, k, dtype):
    rng = np.random.default_rng(batch * vocab)
    logits = (rng.standard_normal((batch, beam_width, vocab)) * 3).astype(dtype)
    logits[..., ::5] = -np.inf  # masked tokens
    beam_scores = rng.standard_normal((batch, beam_width)).astype("float32")
    scores, beam_ids, tokens = beam.beam_search_step(logits, beam_scores, beam_width, k=k, target="llvm")
    want = numpy_beam(logits, beam_scores, beam_width if k is None else k)
    np.testing.assert_array_equal(beam_ids, want[1])
    np.testing.assert_array_equal(tokens, want[2])
    np.testing.assert_allclose(scores, want[0], rtol=1e-5, atol=1e-5)
    assert scores.dtype == np.float32 and beam_ids.dtype == np.int64


def test_beam_step_exact_fallback_and_2d_logits():
    rng = np.random.default_rng(1)
    logits = rng.integers(-2, 2, (2 * 4, 3000)).astype("float32")  # many ties
    beam_scores = np.zeros((2, 4), "float32")
    cfg = tk.TopKConfig(threads=32, values_per_thread=4, merge_threads=32, merge_values_per_thread=2,
                        force_exact_fallback=True)
    scores, beam_ids, tokens = beam.beam_search_step(logits, beam_scores, 4, k=8, target="llvm", cfg=cfg)
    want = numpy_beam(logits, beam_scores, 8)
    np.testing.assert_array_equal(beam_ids * 3000 + tokens, want[1] * 3000 + want[2])
    np.testing.assert_allclose(scores, want[0], rtol=1e-5, atol=1e-5)


def test_beam_reference_module_agrees():
    rng = np.random.default_rng(4)
    logits, bs = rng.standard_normal((2, 3, 50)), rng.standard_normal((2, 3))
    for got, want in zip(reference.beam_search_step(logits, bs, 4), numpy_beam(logits, bs, 4)):
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("shape,scores,beam_width,k,match", [
    ((2, 3, 10), (2, 3), 3, 11, "k=11"),
    ((2, 3, 10), (2, 4), 3, 2, "beam_scores"),
    ((7, 10), (2, 3), 3, 2, "batch\\*beam"),
    ((2, 3, 10), (2, 3), 0, 2, "beam must be"),
])
def test_beam_step_invalid(shape, scores, beam_width, k, match):
    with pytest.raises(TvmseqError, match=match):
        beam.validate_beam_step(shape, "float32", scores, "float32", beam_width, k)
    with pytest.raises(TvmseqError, match="dtype"):
        beam.validate_beam_step((2, 3, 10), "int32", (2, 3), "float32", 3, 2)


# ----------------------------------------------------------------------------------------- GPU tests
@functools.lru_cache(maxsize=None)
def gpu_kernels():
    """name -> CUDA kernel: prebuilt (TVMSEQ_TOPK_PREBUILT) or built here when TVM's compiler is present."""
    from tvmseq.bench import topk as bench

    prebuilt = os.environ.get("TVMSEQ_TOPK_PREBUILT")
    if prebuilt:
        return bench.load_kernels(prebuilt)[0]
    if getattr(tvm.base, "_RUNTIME_ONLY", False):
        pytest.skip("TVM runtime only: set TVMSEQ_TOPK_PREBUILT to a directory built by "
                    "`python3 -m tvmseq.bench.topk --build-only DIR`")
    mod, index, target = bench.kernel_module(quick=True, smoke=True, with_tests=True)
    ex = tvm.compile(mod, target=target)
    return {name: ex[name] for name in index["kernels"]}


gpu = pytest.mark.skipif(not targets.has_gpu(), reason="no CUDA GPU visible to TVM")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", __import__("tvmseq.bench.topk", fromlist=["TEST_TOPK"]).TEST_TOPK,
                         ids=lambda c: "x".join(map(str, c)))
def test_gpu_topk(case):
    from tvmseq.bench.topk import topk_name

    rows, n, k, dtype, largest = case
    f = gpu_kernels()[topk_name(*case)]
    dev = tvm.cuda(0)
    for mode in ("normal", "ties", "neginf") if dtype != "int64" else ("ties",):
        x = make_rows(rows, n, dtype, mode, seed=n)
        vals = tvm.runtime.tensor(np.zeros((rows, k), dtype), dev)
        inds = tvm.runtime.tensor(np.zeros((rows, k), np.int64), dev)
        f(tvm.runtime.tensor(x, dev), vals, inds)
        assert_exact((vals.numpy(), inds.numpy()), numpy_topk(x, k, largest))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", __import__("tvmseq.bench.topk", fromlist=["TEST_BEAM"]).TEST_BEAM,
                         ids=lambda c: "x".join(map(str, c)))
def test_gpu_beam_step(case):
    from tvmseq.bench.topk import beam_name

    batch, beam, vocab, k, dtype = case
    f = gpu_kernels()[beam_name(*case)]
    dev = tvm.cuda(0)
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((batch * beam, vocab)) * 3).astype(dtype)
    bs = rng.standard_normal((batch, beam)).astype("float32")
    outs = [tvm.runtime.tensor(np.zeros((batch, k), dt), dev) for dt in ("float32", "int64", "int64")]
    f(tvm.runtime.tensor(logits, dev), tvm.runtime.tensor(bs, dev), *outs)
    want = numpy_beam(logits, bs, k)
    np.testing.assert_array_equal(outs[1].numpy() * vocab + outs[2].numpy(), want[1] * vocab + want[2])
    np.testing.assert_allclose(outs[0].numpy(), want[0], rtol=1e-5, atol=1e-5)
