"""Prebuilt kernel artifacts (tvmseq.artifacts): manifest matching, loading and calling a kernel from
numpy or DLPack tensors, and falling back (warning + None, never a crash) on missing, corrupt or
mismatched artifacts. CPU artifacts are built with llvm here; a CUDA artifact is built here with sm_90a
device code (nvcc, no GPU) and must be refused cleanly on a machine without a GPU."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tvmseq import artifacts, cuda_toolchain
from tvmseq.artifacts import ArtifactEntry, ArtifactWarning
from tvmseq.errors import TvmseqError
from tvmseq.tune import metaschedule, space

PROBLEM = space.GemmProblem(64, 96, 40, b_layout="nk", bias=True)
GENES = dict(space.DEFAULT_GENES, bm=32, bn=32, bk=8, tm=4, tn=4, warp_n=8, wm=2, wn=4)
SHAPES = {"m": 64, "n": 96, "k": 40}
ATTRS = {"b_layout": "nk", "bias": True}


def gemm_ref(a, b, bias):
    return a.astype("float64") @ b.astype("float64").T + bias


def entry(**kw):
    base = dict(op="gemm", name="g", file="g.so", dtype="float32", arch="sm_90a", shapes=dict(SHAPES),
                signature={"inputs": [], "outputs": []}, attrs=dict(ATTRS))
    return ArtifactEntry(**{**base, **kw})


# --------------------------------------------------------------------------------------------------
# matching
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,shapes,dtype,attrs,expect", [
    ("gemm", SHAPES, "float32", ATTRS, True),
    ("gemm", SHAPES, "float32", None, True),                       # attributes not asked for: any
    ("gemm", SHAPES, "float32", {"bias": True}, True),
    ("gemm", SHAPES, "float32", {"bias": False}, False),
    ("gemm", SHAPES, "float16", ATTRS, False),
    ("gru", SHAPES, "float32", ATTRS, False),
    ("gemm", {**SHAPES, "m": 65}, "float32", ATTRS, False),
    ("gemm", {"m": 64, "n": 96}, "float32", ATTRS, False),        # a size missing
    ("gemm", {**SHAPES, "t": 3}, "float32", ATTRS, False),        # a size too many
])
def test_entry_covers_exact_shapes(op, shapes, dtype, attrs, expect):
    assert entry().covers(op, shapes, dtype, attrs) is expect


@pytest.mark.parametrize("m,expect", [(1, True), (64, True), (4096, True), (0, False), (4097, False)])
def test_entry_covers_shape_ranges(m, expect):
    assert entry(shapes={**SHAPES, "m": [1, 4096]}).covers("gemm", {**SHAPES, "m": m}, "float32") is expect


@pytest.mark.parametrize("built,present,code,expect", [
    ("sm_90a", "sm_90a", "fatbin", True),
    ("sm_90a", "sm_80", "fatbin", False),
    ("sm_90a", "sm_100a", "fatbin", False),
    ("sm_80", "sm_86", "fatbin", True),         # same major, newer minor runs SASS
    ("sm_86", "sm_80", "fatbin", False),
    ("sm_80", "sm_90a", "fatbin", False),
    ("sm_80", "sm_90a", "cuda-source", True),   # source compiles for the GPU present
    ("cpu-x86_64", "cpu-x86_64", "llvm", True),
    ("cpu-x86_64", "cpu-aarch64", "llvm", False),
    ("cpu-x86_64", "sm_90a", "llvm", False),
])
def test_arch_compatibility(built, present, code, expect):
    assert cuda_toolchain.arch_compatible(built, present, code) is expect


def test_parse_ptxas_report():
    log = """ptxas info    : Compiling entry function 'gemm_kernel' for 'sm_90a'
ptxas info    : Function properties for gemm_kernel
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 127 registers, used 1 barriers, 16896 bytes smem"""
    assert cuda_toolchain.parse_ptxas(log) == {"gemm_kernel": {"registers": 127, "spill_stores": 8,
                                                               "spill_loads": 12, "smem": 16896}}


# --------------------------------------------------------------------------------------------------
# a CPU artifact: export, find, call
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory):
    """An artifacts root with one llvm GEMM (the tuned path: genes committed to a database)."""
    import tvm

    tmp = tmp_path_factory.mktemp("artifacts")
    target = tvm.target.Target("llvm")
    metaschedule.commit_records(tmp / "db", PROBLEM, target, [(GENES, 1e-5)])
    (e,) = metaschedule.export_tuned([PROBLEM], target, root=tmp / "root", work_dir=tmp / "db")
    assert e.device_code == "llvm" and e.schedule_hash.startswith("trace:")
    return tmp / "root"


@pytest.fixture
def root(cpu_root, tmp_path):
    """A private copy the test may damage."""
    shutil.copytree(cpu_root, tmp_path / "root")
    return tmp_path / "root"


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(-1, 1, (64, 40)).astype("float32"), rng.uniform(-1, 1, (96, 40)).astype("float32"),
            rng.uniform(-1, 1, 96).astype("float32"))


def find(root, **kw):
    return artifacts.find_kernel("gemm", SHAPES, "float32", ATTRS, root=root, **kw)


def test_find_and_call_with_numpy(root):
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a good artifact loads without any warning
        kernel = find(root)
    assert kernel is not None and kernel.entry.arch == cuda_toolchain.cpu_arch()
    a, b, bias = inputs()
    out = kernel(a, b, bias)
    assert isinstance(out, np.ndarray) and out.shape == (64, 96)
    np.testing.assert_allclose(out, gemm_ref(a, b, bias), rtol=1e-5, atol=1e-5)


def test_call_with_dlpack_tensors(root):
    import tvm

    kernel = find(root)
    a, b, bias = inputs(1)
    out = kernel(*(tvm.runtime.tensor(x) for x in (a, b, bias)))
    assert not isinstance(out, np.ndarray)
    np.testing.assert_allclose(np.from_dlpack(out), gemm_ref(a, b, bias), rtol=1e-5, atol=1e-5)
    torch = pytest.importorskip("torch")
    out = kernel(*(torch.from_numpy(x) for x in (a, b, bias)))
    np.testing.assert_allclose(torch.from_dlpack(out).numpy(), gemm_ref(a, b, bias), rtol=1e-5, atol=1e-5)


def test_call_with_misaligned_and_strided_dlpack_views(root):
    """A DLPack view at an offset that is not 64-byte aligned (what torch.from_numpy of a slice gives) and a
    strided one are copied once into a compact, aligned buffer, never refused."""
    import tvm_ffi

    kernel = find(root)
    a, b, bias = inputs(1)
    shifted = np.empty(a.size + 1, a.dtype)[1:].reshape(a.shape)      # 4 bytes past an aligned buffer
    shifted[...] = a
    strided = np.empty((b.shape[0], 2 * b.shape[1]), b.dtype)[:, ::2]
    strided[...] = b
    views = [tvm_ffi.from_dlpack(x) for x in (shifted, strided, bias)]
    assert views[0].data_ptr() % 64 != 0 and not views[1].is_contiguous()
    np.testing.assert_allclose(np.from_dlpack(kernel(*views)), gemm_ref(a, b, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (lambda a, b, c: (a, b), "takes 3 inputs"),
    (lambda a, b, c: (a[:32], b, c), "axis 0 must be 64"),
    (lambda a, b, c: (a, b.T.copy(), c), "axis 0 must be 96"),
    (lambda a, b, c: (a.astype("float64"), b, c), "dtype float64"),
    (lambda a, b, c: (a, b, c[None]), "rank"),
])
def test_bad_inputs_raise_before_running(root, bad, match):
    kernel = find(root)
    with pytest.raises(TvmseqError, match=match):
        kernel(*bad(*inputs()))


def test_no_entry_is_silent(root):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert artifacts.find_kernel("gemm", {**SHAPES, "m": 128}, "float32", root=root) is None
        assert artifacts.find_kernel("gemm", SHAPES, "float32", root=root / "nowhere") is None


# --------------------------------------------------------------------------------------------------
# fallback: warning + None, and kernel_or_compile compiles instead
# --------------------------------------------------------------------------------------------------
def _arch_dir(root):
    return root / cuda_toolchain.cpu_arch()


def _edit_manifest(root, **changes):
    path = _arch_dir(root) / artifacts.MANIFEST
    data = json.loads(path.read_text())
    data["entries"][0].update(changes)
    path.write_text(json.dumps(data))


def _damage(kind, root):
    arch_dir = _arch_dir(root)
    so = arch_dir / f"{PROBLEM.key}.so"
    if kind == "manifest-garbage":
        (arch_dir / artifacts.MANIFEST).write_text("{not json")
    elif kind == "manifest-format":
        (arch_dir / artifacts.MANIFEST).write_text(json.dumps({"format": 99, "entries": []}))
    elif kind == "manifest-fields":
        (arch_dir / artifacts.MANIFEST).write_text(json.dumps({"format": 1, "entries": [{"op": "gemm"}]}))
    elif kind == "file-missing":
        so.unlink()
    elif kind == "file-truncated":
        so.write_bytes(so.read_bytes()[:1000])
    elif kind == "file-garbage-hash-ok":      # the manifest agrees with the file, but it is no library
        so.write_bytes(b"\x7fELF garbage" * 100)
        _edit_manifest(root, sha256=artifacts.file_sha256(so))
    elif kind == "tvm-version":
        _edit_manifest(root, tvm="0.19.0")
    elif kind == "wrong-arch":
        _edit_manifest(root, arch="cpu-sparc")
    return kind


WARNED = {"manifest-garbage": "corrupt artifact manifest", "manifest-format": "format 99",
          "manifest-fields": "corrupt artifact manifest", "file-missing": "is missing",
          "file-truncated": "does not match its manifest hash", "file-garbage-hash-ok": "could not be loaded",
          "tvm-version": "built with TVM 0.19.0", "wrong-arch": "built for cpu-sparc"}


@pytest.mark.parametrize("kind", list(WARNED))
def test_damaged_artifact_warns_and_falls_back(root, kind):
    _damage(kind, root)
    with pytest.warns(ArtifactWarning, match=WARNED[kind]):
        assert find(root) is None
    compiled = []
    with pytest.warns(ArtifactWarning):
        result = artifacts.kernel_or_compile("gemm", SHAPES, "float32", lambda: compiled.append(1) or "built",
                                             ATTRS, root=root)
    assert result == "built" and compiled == [1]


def test_kernel_or_compile_prefers_the_artifact(root):
    result = artifacts.kernel_or_compile("gemm", SHAPES, "float32", lambda: pytest.fail("compiled"), ATTRS,
                                         root=root)
    assert isinstance(result, artifacts.Kernel)


def test_manifest_replaces_entry_of_same_name(root, tmp_path):
    arch_dir = _arch_dir(root)
    entries = artifacts.read_manifest(arch_dir)
    artifacts.write_manifest(arch_dir, entries + [entry(name="other", arch=cuda_toolchain.cpu_arch())])
    assert [e.name for e in artifacts.read_manifest(arch_dir)] == [PROBLEM.key, "other"]
    with pytest.raises(artifacts.ArtifactError, match="no artifact manifest"):
        artifacts.read_manifest(tmp_path / "empty")


# --------------------------------------------------------------------------------------------------
# CUDA artifacts built here
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_root(tmp_path_factory):
    if cuda_toolchain.find_nvcc() is None:
        pytest.skip("nvcc not installed")
    import tvm

    tmp = tmp_path_factory.mktemp("cuda_artifacts")
    problem = space.GemmProblem(256, 256, 128)
    target = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    (e,) = metaschedule.export_tuned([problem], target, root=tmp, work_dir=tmp / "no-db", arch="sm_90a")
    return tmp, e


def test_cuda_artifact_carries_sm90a_code(cuda_root):
    root, e = cuda_root
    assert e.arch == "sm_90a" and e.device_code == "fatbin" and e.schedule_hash.startswith("default:")
    data = (root / "sm_90a" / e.file).read_bytes()
    assert b"\x50\xed\x55\xba" in data          # fatbin magic
    assert b"__global__" not in data            # no CUDA source left for a compiler to need


def test_cuda_artifact_refused_cleanly_without_gpu(cuda_root):
    """In a fresh process on this GPU-less machine: the sm_90a artifact is not picked for the CPU, and
    asked for explicitly it gives a warning and None (no crash)."""
    from tvmseq import targets

    if targets.has_gpu():
        pytest.skip("a GPU is present")
    root, e = cuda_root
    code = f"""
import warnings, json
from tvmseq import artifacts, cuda_toolchain
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    cpu = artifacts.find_kernel("gemm", {{"m": 256, "n": 256, "k": 128}}, "float32", root={str(root)!r})
    gpu = artifacts.find_kernel("gemm", {{"m": 256, "n": 256, "k": 128}}, "float32", root={str(root)!r}, arch="sm_90a")
print(json.dumps([cpu is None, gpu is None, [str(x.message) for x in w]]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr
    cpu_none, gpu_none, messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cpu_none and gpu_none
    assert any("needs CUDA" in m or "could not be loaded" in m for m in messages), messages


@pytest.mark.gpu
def test_cuda_artifact_runs_on_gpu(cuda_root):
    from tvmseq import targets

    if not targets.has_gpu():
        pytest.skip("no GPU")
    root, e = cuda_root
    kernel = artifacts.find_kernel("gemm", {"m": 256, "n": 256, "k": 128}, "float32", root=root)
    if cuda_toolchain.present_arch() != "sm_90a":
        assert kernel is None
        return
    rng = np.random.default_rng(0)
    a, b = rng.uniform(-1, 1, (256, 128)).astype("float32"), rng.uniform(-1, 1, (128, 256)).astype("float32")
    np.testing.assert_allclose(kernel(a, b), a.astype("float64") @ b, rtol=1e-4, atol=1e-4)
