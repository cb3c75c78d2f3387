"""tvmseq.sparse: CSR construction/validation, the transpose index map, and the spmm / spmm_t kernels
against scipy/numpy (CPU here; the same cases on the GPU with `pytest -m gpu`)."""
import functools
import os

import numpy as np
import pytest
import scipy.sparse as sp

from tvmseq import TvmseqError, sparse
from tvmseq.reference.sparse import csr_to_dense, spmm_reference, spmm_t_reference

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float16": dict(rtol=1e-2, atol=1e-2)}


def reference(transposed, S, D):
    """Plain numpy in float64: S @ D or S^T @ D."""
    dense = csr_to_dense(S.indptr, S.indices, S.data, S.shape)
    return (dense.T if transposed else dense) @ D.astype(np.float64)


def random_csr(rows, cols, density, dtype="float32", index_dtype="int32", seed=0, empty_rows=(), empty_cols=()):
    """Random values in [-1, -0.1] u [0.1, 1] (never ~0) at `density`, with chosen empty rows/cols."""
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, cols)) < density
    mask[list(empty_rows), :] = False
    mask[:, list(empty_cols)] = False
    values = rng.uniform(0.1, 1.0, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols))
    m = sp.csr_matrix(np.where(mask, values, 0.0))  # scipy has no float16
    return sparse.CSR(m.indptr.astype(index_dtype), m.indices.astype(index_dtype), m.data.astype(dtype), m.shape)


def random_dense(rows, n, dtype, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.1, 1.0, (rows, n)) * rng.choice([-1.0, 1.0], (rows, n))).astype(dtype)


# ------------------------------------------------------------------------------------------------
# CSR construction and validation


def test_from_scipy_dense_dlpack_agree():
    m = sp.random(13, 7, density=0.3, format="coo", dtype=np.float32, random_state=3)
    a = sparse.CSR.from_scipy(m)
    b = sparse.CSR.from_dense(m.toarray())
    c = sparse.CSR.from_dlpack(a.indptr, a.indices, a.data, a.shape)  # numpy arrays speak DLPack
    d = sparse.as_csr((a.indptr, a.indices, a.data), shape=a.shape)
    for x in (b, c, d):
        np.testing.assert_array_equal(x.indptr, a.indptr)
        np.testing.assert_array_equal(x.indices, a.indices)
        np.testing.assert_array_equal(x.data, a.data)
    np.testing.assert_array_equal(a.to_dense(), m.toarray())


def test_from_scipy_canonicalises_unsorted_and_duplicates():
    m = sp.csr_matrix((np.array([1.0, 2.0, 3.0], np.float32), np.array([2, 0, 2]), np.array([0, 3])), shape=(1, 3))
    S = sparse.CSR.from_scipy(m)
    np.testing.assert_array_equal(S.indices, [0, 2])
    np.testing.assert_array_equal(S.data, [2.0, 4.0])


def test_from_torch_sparse_csr():
    torch = pytest.importorskip("torch")
    dense = torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, -3.0]])
    S = sparse.as_csr(dense.to_sparse_csr())
    np.testing.assert_array_equal(S.to_dense(), dense.numpy())


def test_dtype_conversion_is_explicit():
    m = sp.random(5, 4, density=0.5, format="csr", random_state=0)  # float64
    with pytest.raises(TvmseqError, match="data must be float32 or float16"):
        sparse.CSR.from_scipy(m)
    assert sparse.CSR.from_scipy(m, dtype="float16").dtype == "float16"


@pytest.mark.parametrize("make", [
    lambda m: m,                                             # scipy's default float64
    lambda m: m.toarray(),                                   # numpy float64
    lambda m: (m.indptr, m.indices, m.data),                 # a float64 triple
    lambda m: (m.toarray() != 0).astype(np.int64) * 3,       # integer values
])
def test_as_csr_takes_float64_and_integer_values_as_float32(make):
    """as_csr, the convenience entry, converts what the kernels lack to float32 (values kept to float32 rounding);
    float16 stays float16 and dtype= still decides."""
    m = sp.random(9, 7, density=0.4, format="csr", random_state=1)
    x = make(m)
    shape = dict(shape=m.shape) if isinstance(x, tuple) else {}
    S = sparse.as_csr(x, **shape)
    assert S.dtype == "float32"
    want = x if isinstance(x, np.ndarray) and x.dtype.kind == "i" else m.toarray()
    np.testing.assert_allclose(S.to_dense(), want.astype(np.float32), rtol=0)
    assert sparse.as_csr(x, **shape, dtype="float16").dtype == "float16"
    assert sparse.as_csr(m.toarray().astype(np.float16)).dtype == "float16"
    with pytest.raises(TvmseqError, match="data must be float32 or float16, got complex128"):
        sparse.as_csr(m.toarray() * 1j)


GOOD = dict(indptr=np.array([0, 2, 2, 3], np.int32), indices=np.array([0, 3, 1], np.int32),
            data=np.array([1.0, 2.0, 3.0], np.float32), shape=(3, 4))


@pytest.mark.parametrize("change,match", [
    (dict(indptr=np.array([0, 2, 1, 3], np.int32)), "indptr is not monotone"),
    (dict(indptr=np.array([1, 2, 2, 3], np.int32)), r"indptr\[0\] must be 0"),
    (dict(indptr=np.array([0, 2, 3], np.int32)), "indptr has length 3, expected rows"),
    (dict(indices=np.array([0, 4, 1], np.int32)), r"indices out of range \[0, 4\): indices\[1\] = 4 \(row 0\)"),
    (dict(indices=np.array([0, 3, -1], np.int32)), r"out of range.*indices\[2\] = -1 \(row 2\)"),
    (dict(indices=np.array([3, 0, 1], np.int32)), "not sorted .* in row 0"),
    (dict(indices=np.array([3, 3, 1], np.int32)), "not sorted .* in row 0"),
    (dict(data=np.array([1.0, 2.0], np.float32)), "lengths disagree"),
    (dict(indices=np.array([0, 3], np.int32)), "lengths disagree"),
    (dict(data=np.array([1, 2, 3], np.int32)), "data must be float32 or float16"),
    (dict(indices=np.array([0, 3, 1], np.uint8)), "indices must be int32 or int64"),
    (dict(indices=np.array([[0, 3, 1]], np.int32)), "indices must be 1-D"),
    (dict(shape=(3, -4)), "shape must be two non-negative integers"),
])
def test_invalid_csr_is_rejected_with_the_array_named(change, match):
    args = {**GOOD, **change}
    with pytest.raises(TvmseqError, match=match):
        sparse.CSR(args["indptr"], args["indices"], args["data"], args["shape"])


def test_rows_restart_lower_is_fine():
    """Sortedness is per row: a row may start at a lower column than the previous one ended."""
    S = sparse.CSR(GOOD["indptr"], GOOD["indices"], GOOD["data"], GOOD["shape"])
    assert S.nnz == 3


def test_mixed_index_dtypes_promote_to_int64():
    S = sparse.CSR(GOOD["indptr"].astype(np.int64), GOOD["indices"], GOOD["data"], GOOD["shape"])
    assert S.index_dtype == "int64" and S.indptr.dtype == np.int64


# ------------------------------------------------------------------------------------------------
# transpose index map


@pytest.mark.parametrize("rows,cols,density", [(1, 1, 1.0), (17, 9, 0.3), (40, 301, 0.02), (5, 8, 0.0)])
def test_transpose_map_is_the_csc_permutation(rows, cols, density):
    S = random_csr(rows, cols, density, seed=rows)
    tm = S.transpose_map
    csc = S.to_scipy().tocsc()
    csc.sort_indices()
    np.testing.assert_array_equal(tm.col_ptr, csc.indptr)
    np.testing.assert_array_equal(tm.rows(), csc.indices)
    np.testing.assert_array_equal(S.data[tm.csr_positions(S.indptr)], csc.data)
    # the position each non-zero takes in column-major order, read the other way round
    pos = tm.transposed_positions(S.indptr)
    np.testing.assert_array_equal(np.sort(pos), np.arange(S.nnz))
    np.testing.assert_array_equal(csc.data[pos], S.data)
    np.testing.assert_array_equal(tm.nonempty_columns, np.flatnonzero(np.diff(csc.indptr)))
    assert S.transpose_map is tm  # built once


def test_transpose_map_is_smaller_than_a_stored_transpose():
    S = random_csr(300, 200, 0.05)
    assert S.transpose_map.nbytes == 4 * (S.nnz + 201)
    assert S.transpose_map.nbytes < S.transpose_nbytes()
    St = S.transpose_csr()
    np.testing.assert_array_equal(St.to_dense(), S.to_dense().T)


def test_transpose_map_switches_to_int64_when_rows_and_places_need_32_bits():
    tm = sparse.build_transpose_map(np.zeros(2**11 + 2, np.int32), np.zeros(0, np.int32), (2**11 + 1, 2**20))
    assert tm.dtype == "int64" and tm.offset_bits == 20
    tm = sparse.build_transpose_map(np.zeros(2**11 + 1, np.int32), np.zeros(0, np.int32), (2**11, 2**20))
    assert tm.dtype == "int32"


# ------------------------------------------------------------------------------------------------
# kernels on the CPU


CASES = [  # rows, cols, n, densities (kernels are built per shape: densities share one build)
    (1, 1, 1),
    (37, 29, 5),
    (64, 33, 256),
    (129, 7, 33),
    (50, 301, 64),
]


@functools.lru_cache(maxsize=None)
def dense_operand(rows, n, dtype):
    return random_dense(rows, n, dtype, seed=rows * 7 + n)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", ["spmm", "spmm_t"])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
@pytest.mark.parametrize("rows,cols,n", CASES)
def test_kernels_match_numpy(rows, cols, n, density, op, dtype):
    S = random_csr(rows, cols, density, dtype, seed=rows + cols)
    transposed = op == "spmm_t"
    D = dense_operand(rows if transposed else cols, n, dtype)
    got = getattr(sparse, op)(S, D, target="llvm")
    assert got.dtype == np.dtype(dtype) and got.shape == ((cols if transposed else rows), n)
    np.testing.assert_allclose(got.astype(np.float64), reference(transposed, S, D), **TOL[dtype])


@pytest.mark.parametrize("op", ["spmm", "spmm_t"])
def test_empty_rows_columns_and_no_nonzero(op):
    transposed = op == "spmm_t"
    S = random_csr(37, 29, 0.3, empty_rows=[0, 5, 36], empty_cols=[0, 11, 28])
    D = dense_operand(37 if transposed else 29, 5, "float32")
    got = getattr(sparse, op)(S, D, target="llvm")
    np.testing.assert_allclose(got, reference(transposed, S, D), **TOL["float32"])
    empty_out = [0, 11, 28] if transposed else [0, 5, 36]
    assert not got[empty_out].any()
    Z = random_csr(37, 29, 0.0)
    assert Z.nnz == 0
    assert not getattr(sparse, op)(Z, D, target="llvm").any()


@pytest.mark.parametrize("op", ["spmm", "spmm_t"])
def test_int64_indices(op):
    S = random_csr(37, 29, 0.2, index_dtype="int64")
    transposed = op == "spmm_t"
    D = dense_operand(37 if transposed else 29, 5, "float32")
    np.testing.assert_allclose(getattr(sparse, op)(S, D, target="llvm"), reference(transposed, S, D),
                               **TOL["float32"])


def test_spmm_t_with_an_int64_index_map():
    rows, cols = 2**11 + 1, 2**20  # row << 20 bits no longer fits in 31 bits
    rng = np.random.default_rng(5)
    r = np.sort(rng.integers(0, rows, 400))
    c = rng.integers(0, cols, 400)
    m = sp.csr_matrix((rng.uniform(0.5, 1.0, 400).astype(np.float32), (r, c)), shape=(rows, cols))
    m.sum_duplicates()
    S = sparse.CSR.from_scipy(m)
    assert S.transpose_map.dtype == "int64"
    D = random_dense(rows, 2, "float32")
    got = sparse.spmm_t(S, D, target="llvm")
    want = m.T.astype(np.float64) @ D.astype(np.float64)
    np.testing.assert_allclose(got, want, **TOL["float32"])


def test_scipy_agrees_and_results_are_deterministic():
    S = random_csr(64, 33, 0.3)
    D = dense_operand(64, 256, "float32")
    first = sparse.spmm_t(S, D, target="llvm")
    np.testing.assert_allclose(first, S.to_scipy().T @ D, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(first, sparse.spmm_t(S, D, target="llvm"))


def test_degenerate_shapes_return_zeros_without_a_kernel():
    S = sparse.CSR(np.zeros(4, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), (3, 0))
    assert sparse.spmm(S, np.zeros((0, 5), np.float32), target="llvm").shape == (3, 5)
    assert sparse.spmm_t(S, np.ones((3, 5), np.float32), target="llvm").shape == (0, 5)
    T = random_csr(4, 3, 0.5)
    assert sparse.spmm(T, np.zeros((3, 0), np.float32), target="llvm").shape == (4, 0)


@pytest.mark.parametrize("D,match", [
    (np.ones((29, 5), np.float32), "D has 29 rows, the sparse operand needs 37"),
    (np.ones((37, 5), np.float16), "D has dtype float16 but S has float32"),
    (np.ones((37,), np.float32), "D must be 2-D"),
])
def test_bad_dense_operand_is_rejected(D, match):
    with pytest.raises(TvmseqError, match=match):
        sparse.spmm_t(random_csr(37, 29, 0.2), D, target="llvm")


def test_symbolic_columns_kernel():
    """A kernel built for any number of D columns (what ONNX models with a dynamic batch get)."""
    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmShape, spmm_func

    S = random_csr(37, 29, 0.2)
    target = tvm.target.Target("llvm")
    for transposed in (False, True):
        shape = SpmmShape(transposed, 37, 29, None, "float32", "int32", S.transpose_map.dtype)
        kernel = tvm.compile(tvm.IRModule({shape.name: spmm_func(shape, target)}), target=target)[shape.name]
        for n in (1, 17, 40):
            D = random_dense(37 if transposed else 29, n, "float32", seed=n)
            out = tvm.runtime.empty((29 if transposed else 37, n), "float32", tvm.cpu())
            kernel(*S.kernel_args(transposed, tvm.cpu()), tvm.runtime.tensor(D), out)
            np.testing.assert_allclose(out.numpy(), reference(transposed, S, D), **TOL["float32"])


def test_schedules_are_checked():
    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmSchedule, SpmmShape, default_schedule, spmm_func

    gpu = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    with pytest.raises(TvmseqError, match="does not divide"):
        spmm_func(SpmmShape(True, 8, 8, 6), gpu, SpmmSchedule(vec=4, lanes=1, rows_per_block=1, unroll=1))
    with pytest.raises(TvmseqError, match="1024 threads"):
        spmm_func(SpmmShape(True, 8, 8, 64), gpu, SpmmSchedule(vec=1, lanes=64, rows_per_block=4, unroll=1, split=8))
    with pytest.raises(TvmseqError, match="int64 transpose index map"):
        SpmmShape(True, 2**11 + 1, 2**20, 4, map_dtype="int32").check()
    # the GPU default keeps ~400k threads busy on S^T of a 4096-column S and stays in shared memory
    sched = default_schedule(SpmmShape(True, 4096, 4096, 256), gpu, measured=False)  # the rule, not the measured winner
    assert sched.split > 1 and sched.shared_bytes(256) <= 48 * 1024


def test_cuda_kernels_generate():
    """The CUDA schedule builds (the source is compiled where a GPU is: see tests marked gpu)."""
    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmShape, spmm_func

    gpu = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    for shape in (SpmmShape(True, 300, 200, 64, "float16"), SpmmShape(False, 300, 200, 7),
                  SpmmShape(True, 300, 200, None)):
        ex = tvm.compile(tvm.IRModule({shape.name: spmm_func(shape, gpu)}), target=gpu)
        source = ex.mod.imports[0].inspect_source()
        assert f"{shape.name}_kernel" in source and "atomic" not in source


# ------------------------------------------------------------------------------------------------
# GPU (pytest -m gpu): compiled there when TVM's compiler is present, else prebuilt kernels from
# $TVMSEQ_SPMM_PREBUILT (python -m tvmseq.bench.spmm --build-only DIR, or `bash schedules/gpu_run.sh build spmm`)


@pytest.fixture(scope="module")
def gpu_kernels():
    import tvm

    if tvm.base._RUNTIME_ONLY:
        path = os.environ.get("TVMSEQ_SPMM_PREBUILT", "out/spmm_gpu")
        if not os.path.isdir(path):
            pytest.skip(f"runtime-only TVM and no prebuilt kernels in {path}")
        sparse.load_kernels(path)
    return True


GPU_CASES = [(37, 29, 5), (129, 7, 33), (300, 200, 64), (1000, 513, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", ["spmm", "spmm_t"])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
@pytest.mark.parametrize("rows,cols,n", GPU_CASES)
def test_gpu_kernels_match_numpy(gpu_kernels, rows, cols, n, density, op, dtype):
    S = random_csr(rows, cols, density, dtype, seed=rows + cols, empty_rows=[0], empty_cols=[cols - 1])
    transposed = op == "spmm_t"
    D = dense_operand(rows if transposed else cols, n, dtype)
    got = getattr(sparse, op)(S, D, target="cuda")
    np.testing.assert_allclose(got.astype(np.float64), reference(transposed, S, D), **TOL[dtype])
    np.testing.assert_array_equal(got, getattr(sparse, op)(S, D, target="cuda"))  # bitwise deterministic


@pytest.mark.gpu
def test_gpu_dlpack_torch(gpu_kernels):
    torch = pytest.importorskip("torch")
    S = random_csr(300, 200, 0.05)
    D = dense_operand(300, 64, "float32")
    out = sparse.spmm_t(S, torch.from_numpy(D).cuda(), target="cuda")
    got = torch.from_dlpack(out).cpu().numpy()
    np.testing.assert_allclose(got, reference(True, S, D), **TOL["float32"])


RUNTIME_ONLY_SCRIPT = """
import sys
import numpy as np
import tvm
assert tvm.base._RUNTIME_ONLY, "TVM_USE_RUNTIME_LIB=1 did not take"
from tvmseq import TvmseqError, sparse
sparse.load_kernels(sys.argv[1])
S = sparse.CSR(*[np.load(sys.argv[2] + f"/{a}.npy") for a in ("indptr", "indices", "data")], (37, 29))
for op, d_rows in (("spmm", 29), ("spmm_t", 37)):
    D = np.load(sys.argv[2] + f"/D{d_rows}.npy")
    np.save(sys.argv[2] + f"/{op}.npy", getattr(sparse, op)(S, D, target="llvm"))
    out = getattr(sparse, op)(S, tvm.runtime.tensor(D, tvm.cpu()), target=None)  # no GPU here: llvm
    np.testing.assert_array_equal(out.numpy(), np.load(sys.argv[2] + f"/{op}.npy"))
try:
    sparse.spmm(S, np.ones((29, 6), np.float32), target="llvm")
except TvmseqError as err:
    assert "not prebuilt" in str(err), err
else:
    raise AssertionError("a kernel that was not prebuilt ran under runtime-only TVM")
"""


def test_prebuilt_kernels_run_under_runtime_only_tvm(tmp_path):
    """What the GPU box does (only TVM's runtime: no tvm.target.Target, no tvm.script): load
    prebuilt kernels and run spmm/spmm_t; simulated with TVM_USE_RUNTIME_LIB=1 and llvm kernels."""
    import json
    import subprocess
    import sys

    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmShape, spmm_func

    target = tvm.target.Target("llvm")
    shapes = [SpmmShape(transposed, 37, 29, 5) for transposed in (False, True)]
    funcs = {s.name: spmm_func(s, target) for s in shapes}
    tvm.compile(tvm.IRModule(funcs), target=target).export_library(str(tmp_path / "k.so"))
    (tmp_path / "index.json").write_text(json.dumps({"library": "k.so", "target_kind": "llvm",
                                                     "kernels": sorted(funcs)}))
    S = random_csr(37, 29, 0.2, empty_rows=[3], empty_cols=[7])
    for name, arr in (("indptr", S.indptr), ("indices", S.indices), ("data", S.data),
                      ("D29", dense_operand(29, 5, "float32")), ("D37", dense_operand(37, 5, "float32"))):
        np.save(tmp_path / f"{name}.npy", arr)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_SCRIPT, str(tmp_path), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for op, d_rows in (("spmm", 29), ("spmm_t", 37)):
        got = np.load(tmp_path / f"{op}.npy")
        want = reference(op == "spmm_t", S, dense_operand(d_rows, 5, "float32"))
        np.testing.assert_allclose(got, want, **TOL["float32"])


# ------------------------------------------------------------------------------------------------
# the worked example in docs/sparse_training.md and the CPU run of the benchmark's code


ROOT = next(p for p in __import__("pathlib").Path(__file__).resolve().parents if (p / "pyproject.toml").exists())


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sparse_training", ROOT / "examples" / "sparse_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sparse_training_example():
    result = _load_example().main(target="llvm", steps=5, verbose=False)
    assert result["err_w"] < 1e-5 and result["err_b"] < 1e-5
    np.testing.assert_allclose(result["losses"], result["losses_ref"], rtol=1e-5)
    assert all(a > b for a, b in zip(result["losses"], result["losses"][1:]))  # it learns


def test_docs_show_the_example_code():
    import re

    doc = (ROOT / "docs" / "sparse_training.md").read_text()
    script = (ROOT / "examples" / "sparse_training.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    shown = [b for b in blocks if b.startswith("def ")]
    assert len(shown) == 2 and all(b in script for b in shown)


def test_benchmark_code_runs_on_the_cpu(tmp_path):
    """`python -m tvmseq.bench.spmm --smoke-cpu`: the GPU benchmark's code path with llvm kernels and
    torch's CPU peers on a tiny grid (needs torch)."""
    pytest.importorskip("torch")
    import argparse

    from tvmseq.bench import spmm as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    rows = bench.run(parser.parse_args(["--smoke-cpu", "--out", str(tmp_path)]))
    assert rows and all(r["agree"] and r["deterministic"] for r in rows)
    assert (tmp_path / "spmm_smoke_cpu.json").exists() and (tmp_path / "spmm_smoke_cpu.png").exists()


def test_gpu_payload_index(tmp_path):
    """What `--build-only` would export: every kernel the benchmark and the GPU tests look up."""
    from tvmseq.bench import spmm as bench
    from tvmseq.kernels.sparse.spmm import SpmmShape

    _, index, _ = bench.kernel_module(quick=True)
    names = set(index["kernels"])
    for rows, cols, n in bench.TEST_SHAPES:
        for dtype in ("float32", "float16"):
            assert SpmmShape(True, rows, cols, n, dtype).name in names
            assert SpmmShape(False, rows, cols, n, dtype).name in names
    for name, info in index["schedules"].items():
        assert name in names and (info["variant"] == "default") == ("__" not in name)


# ------------------------------------------------------------------------------------------------
# the CUDA schedule, run on the CPU: the generated CUDA source compiled with g++, one std::thread per
# CUDA thread and a std::barrier for __syncthreads (blocks run one after another). This checks the
# GPU kernels' indexing, guards and split reduction where no GPU is.

_EMU_HEADER = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>
using std::max; using std::min;
typedef _Float16 half;
struct dim3 { int x, y, z; };
static dim3 blockIdx;
static thread_local dim3 threadIdx;
static std::barrier<>* block_barrier;
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };
struct alignas(32) ulonglong4 { unsigned long long x, y, z, w; };
template <typename T> inline T tvm_builtin_cuda_atomic_add(T* addr, T v) {
  return std::atomic_ref<T>(*addr).fetch_add(v);
}
#define __launch_bounds__(x)
#define __restrict__
"""


def emulate_cuda(source: str, grid: tuple, threads: int, args: dict, workdir) -> None:
    """Run the one kernel in TVM's CUDA `source` on the CPU; `args` maps parameter names (without
    TVM's `_ptr` suffix) to numpy arrays (written in place) or ints."""
    import ctypes
    import hashlib
    import re
    import subprocess

    body = source[source.index('extern "C" __global__'):]
    body = re.sub(r'extern "C" __global__ void __launch_bounds__\(\d+\) \w+\([^)]*\);', "", body, count=1)
    kernel, params = re.search(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\)', body).groups()
    params = [p.strip().rsplit(" ", 1) for p in params.split(",")]
    body = body.replace('extern "C" __global__', "static").replace("__shared__ alignas(64)", "alignas(64) static")
    decl = ", ".join(f"{t} {n}" for t, n in params)
    launcher = f"""
extern "C" void launch(int gx, int gy, int bx, {decl}) {{
  for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {{
    blockIdx = dim3{{x, y, 0}};
    std::barrier<> bar(bx);
    block_barrier = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < bx; ++t)
      ts.emplace_back([=]() {{ threadIdx = dim3{{t, 0, 0}}; {kernel}({", ".join(n for _, n in params)}); }});
    for (auto& th : ts) th.join();
  }}
}}"""
    code = _EMU_HEADER + body + launcher
    lib = os.path.join(str(workdir), hashlib.md5(code.encode()).hexdigest() + ".so")
    if not os.path.exists(lib):
        with open(lib[:-3] + ".cpp", "w") as f:
            f.write(code)
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", lib, lib[:-3] + ".cpp"],
                       check=True, capture_output=True)
    values = [args[n.removesuffix("_ptr")] for _, n in params]
    c_args = [ctypes.c_int(v) if isinstance(v, int) else v.ctypes.data_as(ctypes.c_void_p) for v in values]
    ctypes.CDLL(lib).launch(ctypes.c_int(grid[0]), ctypes.c_int(grid[1]), ctypes.c_int(threads), *c_args)


@pytest.fixture(scope="module")
def emulator_dir(tmp_path_factory):
    import shutil
    import subprocess

    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    d = tmp_path_factory.mktemp("cuda_emulation")
    probe = d / "probe.cpp"
    probe.write_text("#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
    if subprocess.run(["g++", "-std=c++20", "-pthread", "-o", str(d / "probe"), str(probe)]).returncode:
        pytest.skip("g++ lacks C++20 <barrier>")
    return d


@pytest.mark.parametrize("rows,cols,n,dtype,op,density,schedule", [
    (129, 40, 64, "float32", "spmm_t", 0.5, None),  # default: 8 groups split ~64 non-zeros a row
    (40, 129, 64, "float32", "spmm", 0.5, None),
    (37, 29, 5, "float16", "spmm_t", 0.3, None),  # vec 1, lanes 5: a row guard on the last block
    (61, 90, 256, "float16", "spmm", 0.05, None),  # 16-byte half8 loads
    (33, 17, 24, "float32", "spmm_t", 0.5, dict(vec=4, lanes=4, rows_per_block=3, unroll=3, split=2)),  # col guard
    (40, 30, None, "float32", "spmm_t", 0.2, None),  # symbolic columns: column tiles on blockIdx.y
    (40, 30, None, "float16", "spmm", 0.2, None),
    (37, 29, 8, "float32", "spmm_t", 0.0, None),  # no non-zero at all
])
def test_cuda_schedule_emulated_on_cpu(emulator_dir, rows, cols, n, dtype, op, density, schedule):
    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmSchedule, SpmmShape, default_schedule, spmm_func

    gpu = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    transposed = op == "spmm_t"
    S = random_csr(rows, cols, density, dtype, seed=rows, empty_rows=[0], empty_cols=[cols - 1])
    shape = SpmmShape(transposed, rows, cols, n, dtype, "int32", S.transpose_map.dtype)
    sched = SpmmSchedule(**schedule) if schedule else default_schedule(shape, gpu)
    source = tvm.compile(tvm.IRModule({shape.name: spmm_func(shape, gpu, sched)}), target=gpu).mod.imports[0]
    n_cols = n if n is not None else 45
    D = random_dense(rows if transposed else cols, n_cols, dtype)
    out = np.full((shape.out_rows, n_cols), 7, dtype=dtype)  # stale values must be overwritten
    names = ["indptr", "data", "col_ptr", "entries"] if transposed else ["indptr", "indices", "data"]
    args = {**dict(zip(names, S.kernel_arrays(transposed))), "D": D, "out": out, "n": n_cols}
    grid = (-(-shape.out_rows // sched.rows_per_block), -(-n_cols // sched.tile_width(n)))
    emulate_cuda(source.inspect_source(), grid, sched.split * sched.rows_per_block * sched.lanes, args, emulator_dir)
    np.testing.assert_allclose(out.astype(np.float64), reference(transposed, S, D), **TOL[dtype])


def test_scatter_variant_emulated_on_cpu(emulator_dir):
    """The benchmark's atomic scatter alternative to spmm_t (row order, not deterministic on a GPU)."""
    import tvm

    from tvmseq.kernels.sparse.spmm import SpmmShape, default_schedule, spmm_t_scatter_func

    gpu = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    S = random_csr(70, 45, 0.3, empty_rows=[0], empty_cols=[44])
    shape = SpmmShape(True, 70, 45, 12)
    sched = default_schedule(SpmmShape(False, 70, 45, 12), gpu)
    source = tvm.compile(tvm.IRModule({"k": spmm_t_scatter_func(shape, gpu)}), target=gpu).mod.imports[0]
    D = random_dense(70, 12, "float32")
    out = np.zeros((45, 12), np.float32)
    args = {"indptr": S.indptr, "indices": S.indices, "data": S.data, "D": D, "out": out}
    rows_per_block = sched.rows_per_block * sched.split
    emulate_cuda(source.inspect_source(), (-(-70 // rows_per_block), 1), rows_per_block * sched.lanes, args,
                 emulator_dir)
    np.testing.assert_allclose(out, reference(True, S, D), **TOL["float32"])
    with pytest.raises(TvmseqError, match="scatter variant"):
        spmm_t_scatter_func(SpmmShape(True, 70, 45, 12, "float16"), gpu)


def test_arrays_are_read_only_and_with_data_shares_the_pattern():
    import tvm

    S = random_csr(37, 29, 0.2)
    with pytest.raises(ValueError):
        S.data[0] = 1.0  # device copies and the transpose map are built from these once
    S.kernel_args(True, tvm.cpu())
    D = dense_operand(37, 5, "float32")
    T = S.with_data(S.data * 2)
    assert T.transpose_map is S.transpose_map
    np.testing.assert_allclose(sparse.spmm_t(T, D, target="llvm"), 2 * sparse.spmm_t(S, D, target="llvm"),
                               rtol=1e-6)
    np.testing.assert_allclose(sparse.spmm(T, dense_operand(29, 5, "float32"), target="llvm"),
                               reference(False, T, dense_operand(29, 5, "float32")), **TOL["float32"])
    with pytest.raises(TvmseqError, match="data must be float32/float16 of shape"):
        S.with_data(np.ones(3, np.float32))
