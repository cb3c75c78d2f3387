"""`tvmseq build` and prebuilt kernels in the importer (tvmseq.prebuild, importer.emit_kernel,
tvmseq.runtime's artifact registration).

CPU (CI): the kernels of an ONNX TopK model and of a sparse MatMul/Gemm model are built for llvm into a
temporary artifact root; importing the models with that root must call the artifacts
(`call_dps_packed`, no TIR function in the module) and give the numpy reference's results, also from
an exported model loaded in a fresh process. A corrupt `.so`, a manifest entry for another arch or TVM
version, or a stale schedule hash gives an ArtifactWarning and the kernel is compiled instead (still
correct). GPU (`pytest -m gpu`, with TVMSEQ_ARTIFACTS pointing at artifacts built for this GPU, e.g.
by `tvmseq build $(python tests/test_prebuild.py out/prebuilt_models) --tuned --out out/prebuilt`):
every artifact is loaded in a fresh process and checked against tvmseq.reference.

`python tests/test_prebuild.py DIR` writes the test models to DIR and prints their paths.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
GPU_ARTIFACTS = os.environ.get("TVMSEQ_ARTIFACTS")   # read before the CPU tests clear it


# --------------------------------------------------------------------------------------------------
# the models (no TVM needed to make them)
# --------------------------------------------------------------------------------------------------
def topk_model(rows=6, n=500, k=4) -> onnx.ModelProto:
    """TopK-11 of a [rows, n] input, K a constant initializer (the hierarchical kernel)."""
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], name="topk", axis=-1)], "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, n])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("indices", TensorProto.INT64, None)],
        initializer=[numpy_helper.from_array(np.array([k], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    return model


def sparse_weight(rows, cols, density, seed):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.1, 1.0, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols))
    mask = rng.random((rows, cols)) < density
    mask[rows // 2, cols // 2] = True
    return np.where(mask, w, 0.0).astype("float32")


def sparse_model():
    """Y = Gemm(MatMul(X, W1), W2, transB=1): a sparse_initializer W1 (-> spmm_t) and a Constant with
    sparse_value W2 (-> spmm), the batch symbolic (kernels built for any number of columns)."""
    w1, w2 = sparse_weight(96, 40, 0.05, 1), sparse_weight(24, 40, 0.08, 2)

    def sparse_tensor(w, name):
        flat = np.flatnonzero(w)
        return helper.make_sparse_tensor(numpy_helper.from_array(w.reshape(-1)[flat], name),
                                         numpy_helper.from_array(flat.astype(np.int64), f"{name}_indices"),
                                         list(w.shape))

    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["W2"], sparse_value=sparse_tensor(w2, "W2")),
         helper.make_node("MatMul", ["X", "W1"], ["H"], name="mm"),
         helper.make_node("Gemm", ["H", "W2"], ["Y"], name="gemm", transB=1)], "sparse",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 96])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        sparse_initializer=[sparse_tensor(w1, "W1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, w1, w2


def write_models(directory) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "topk.onnx", directory / "sparse.onnx"]
    onnx.save(topk_model(), paths[0])
    onnx.save(sparse_model()[0], paths[1])
    return paths


if __name__ == "__main__":
    print(" ".join(str(p) for p in write_models(sys.argv[1] if len(sys.argv) > 1 else "out/prebuilt_models")))
    sys.exit(0)


# --------------------------------------------------------------------------------------------------
# CPU: build for llvm, import with the artifacts
# --------------------------------------------------------------------------------------------------
import tvm  # noqa: E402

if getattr(tvm.base, "_RUNTIME_ONLY", False):
    _COMPILER = False
else:
    _COMPILER = True

from tvmseq import artifacts, cuda_toolchain, reference  # noqa: E402
from tvmseq.artifacts import ArtifactWarning  # noqa: E402
from tvmseq.errors import TvmseqError  # noqa: E402

needs_compiler = pytest.mark.skipif(not _COMPILER, reason="TVM runtime only: building needs TVM's compiler")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An artifact root with the kernels of both models, built for this CPU by `tvmseq build`."""
    if not _COMPILER:
        pytest.skip("TVM runtime only")
    from tvmseq.cli import main

    tmp = tmp_path_factory.mktemp("prebuild")
    models = write_models(tmp / "models")
    assert main(["build", *map(str, models), "--arch", "cpu", "--out", str(tmp / "root")]) == 0
    return tmp / "root", models


@pytest.fixture
def root(built, tmp_path):
    """A private copy of the artifact root that the test may damage."""
    shutil.copytree(built[0], tmp_path / "root")
    return tmp_path / "root"


@pytest.fixture(autouse=True)
def _no_env_artifacts(monkeypatch):
    monkeypatch.delenv("TVMSEQ_ARTIFACTS", raising=False)


def _entries(root):
    return artifacts.read_manifest(Path(root) / cuda_toolchain.cpu_arch())


def _kinds(mod) -> tuple[int, int]:
    """(number of TIR functions, number of artifact calls) in an imported module."""
    tir = sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values())
    return tir, mod.script().count("R.call_dps_packed(\"tvmseq_artifact.")


def _check_topk(model_fn):
    x = np.random.default_rng(3).standard_normal((6, 500)).astype("float32")
    values, indices = model_fn(x=x)
    want_v, want_i = reference.topk(x, 4)
    np.testing.assert_array_equal(values, want_v)
    np.testing.assert_array_equal(indices, want_i)


def _check_sparse(model_fn, w1, w2):
    for batch in (1, 5):
        x = np.random.default_rng(batch).uniform(-1, 1, (batch, 96)).astype("float32")
        want = (x.astype(np.float64) @ w1.astype(np.float64)) @ w2.astype(np.float64).T
        np.testing.assert_allclose(model_fn(X=x), want, rtol=1e-4, atol=1e-4)


@needs_compiler
def test_build_writes_the_kernels_the_models_need(built, capsys):
    root, _ = built
    entries = _entries(root)
    assert sorted(e.op for e in entries) == ["spmm", "spmm_t", "topk"]
    for e in entries:
        assert e.arch == cuda_toolchain.cpu_arch() and e.device_code == "llvm" and e.tvm == tvm.__version__
        assert e.schedule_hash.startswith("tir:") and (root / e.arch / e.file).exists()
    spmm_t = next(e for e in entries if e.op == "spmm_t")
    assert spmm_t.shapes == {"rows": 96, "cols": 40} and spmm_t.attrs["dynamic"] == ["n"]


@needs_compiler
def test_import_calls_the_artifacts_and_results_match(built):
    import tvmseq

    root, _ = built
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # good artifacts load without any warning
        mod = tvmseq.from_onnx(topk_model(), target="llvm", artifacts=root)
        assert _kinds(mod) == (0, 1)        # the artifact is called, no TIR function is compiled
        _check_topk(tvmseq.compile_onnx(topk_model(), target="llvm", artifacts=root))
        model, w1, w2 = sparse_model()
        assert _kinds(tvmseq.from_onnx(model, target="llvm", artifacts=root)) == (0, 2)
        _check_sparse(tvmseq.compile_onnx(model, target="llvm", artifacts=root), w1, w2)


@needs_compiler
def test_lookup_is_off_for_cpu_by_default_and_follows_the_environment(built, monkeypatch):
    import tvmseq

    root, _ = built
    assert _kinds(tvmseq.from_onnx(topk_model(), target="llvm")) == (1, 0)
    monkeypatch.setenv("TVMSEQ_ARTIFACTS", str(root))
    assert _kinds(tvmseq.from_onnx(topk_model(), target="llvm")) == (0, 1)
    assert _kinds(tvmseq.from_onnx(topk_model(), target="llvm", artifacts=None)) == (1, 0)
    monkeypatch.setenv("TVMSEQ_ARTIFACTS", "off")
    assert _kinds(tvmseq.from_onnx(topk_model(), target="llvm")) == (1, 0)


@needs_compiler
def test_exported_model_finds_its_artifacts_in_a_fresh_process(root, tmp_path):
    import tvmseq

    model, w1, w2 = sparse_model()
    compiled = tvmseq.compile_onnx(model, target="llvm", artifacts=root)
    tvmseq.build.export(compiled, tmp_path / "m.so")
    meta = json.loads((tmp_path / "m.so.json").read_text())
    assert len(meta["signature"]["artifacts"]) == 2
    np.save(tmp_path / "x.npy", np.random.default_rng(0).uniform(-1, 1, (3, 96)).astype("float32"))
    code = f"""
import numpy as np, tvmseq
y = tvmseq.load({str(tmp_path / 'm.so')!r})(X=np.load({str(tmp_path / 'x.npy')!r}))
np.save({str(tmp_path / 'y.npy')!r}, y)
"""
    env = {k: v for k, v in os.environ.items() if k != "TVMSEQ_ARTIFACTS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,  # noqa: E731
                                 timeout=120)
    proc = run()
    assert proc.returncode == 0, proc.stderr
    x = np.load(tmp_path / "x.npy")
    want = (x.astype(np.float64) @ w1.astype(np.float64)) @ w2.astype(np.float64).T
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-4)
    for rec in meta["signature"]["artifacts"]:   # the artifacts moved away: a clear error, not a crash
        rec["arch_dir"] = str(tmp_path / "gone")
    (tmp_path / "m.so.json").write_text(json.dumps(meta))
    proc = run()
    assert proc.returncode != 0 and "prebuilt kernel" in proc.stderr and "TVMSEQ_ARTIFACTS" in proc.stderr


def _edit(root, op, **changes):
    path = Path(root) / cuda_toolchain.cpu_arch() / MANIFEST
    data = json.loads(path.read_text())
    for e in data["entries"]:
        if e["op"] == op:
            e.update(changes)
    path.write_text(json.dumps(data))


def _damage(root, kind):
    arch_dir = Path(root) / cuda_toolchain.cpu_arch()
    entry = next(e for e in _entries(root) if e.op == "topk")
    so = arch_dir / entry.file
    if kind == "corrupt-so":
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])
    elif kind == "corrupt-so-hash-ok":         # the manifest agrees with the file, but it is no library
        so.write_bytes(b"\x7fELF garbage" * 100)
        _edit(root, "topk", sha256=artifacts.file_sha256(so))
    elif kind == "wrong-arch":
        _edit(root, "topk", arch="sm_90a")
    elif kind == "wrong-tvm":
        _edit(root, "topk", tvm="0.19.0")
    elif kind == "stale-schedule":
        _edit(root, "topk", schedule_hash="tir:0123456789abcdef")
    elif kind == "corrupt-manifest":
        (arch_dir / MANIFEST).write_text("{not json")


WARNED = {"corrupt-so": "does not match its manifest hash", "corrupt-so-hash-ok": "could not be loaded",
          "wrong-arch": "built for sm_90a", "wrong-tvm": "built with TVM 0.19.0",
          "stale-schedule": "is stale", "corrupt-manifest": "corrupt artifact manifest"}


@needs_compiler
@pytest.mark.parametrize("kind", list(WARNED))
def test_damaged_artifact_warns_and_compiles_instead(root, kind):
    import tvmseq

    _damage(root, kind)
    with pytest.warns(ArtifactWarning, match=WARNED[kind]):
        mod = tvmseq.from_onnx(topk_model(), target="llvm", artifacts=root)
    assert _kinds(mod) == (1, 0)             # the TIR function is back, no artifact call
    with pytest.warns(ArtifactWarning):
        _check_topk(tvmseq.compile_onnx(topk_model(), target="llvm", artifacts=root))


@needs_compiler
def test_cli_build_errors_are_one_line(tmp_path, capsys):
    from tvmseq.cli import main

    for argv, message in ((["build"], "nothing to build"), (["build", str(tmp_path / "no.onnx")], "not found"),
                          (["build", "--tuned", "--arch", "sm_x"], "--arch")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tvmseq: error:") and message in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------------
# GPU: artifacts built for this GPU (TVMSEQ_ARTIFACTS), loaded in a fresh process
# --------------------------------------------------------------------------------------------------
_CHECK_ALL = r"""
import json, sys
import numpy as np
from tvmseq import artifacts, cuda_toolchain, reference
from tvmseq.sparse import CSR
from pathlib import Path

root = sys.argv[1]
arch = cuda_toolchain.present_arch()
rng = np.random.default_rng(0)
results = []
for arch_dir in artifacts._candidate_dirs(Path(root), arch):
    for e in artifacts.read_manifest(arch_dir):
        res = {"name": e.name, "op": e.op, "arch_dir": str(arch_dir)}
        results.append(res)
        dyn = set(e.attrs.get("dynamic", []))
        if e.op == "topk" and "k" in dyn:
            res["skipped"] = "K is symbolic: only the importer can call it"
            continue
        kernel = artifacts.find_kernel(e.op, e.shapes, e.dtype, e.attrs, root=root, arch=arch)
        if kernel is None or kernel.entry.name != e.name:
            res["error"] = "not found / not loadable"
            continue
        s = e.shapes
        if e.op == "topk":
            rows = s.get("rows", 5)
            x = rng.standard_normal((rows, s["n"])).astype(e.dtype)
            got, want = kernel(x), reference.topk(x, s["k"], largest=e.attrs["largest"])
            ok = all(np.array_equal(g, w) for g, w in zip(got, want))
        elif e.op in ("spmm", "spmm_t"):
            n = s.get("n", 7)
            dense = rng.uniform(0.1, 1, (s["rows"], s["cols"])) * (rng.random((s["rows"], s["cols"])) < 0.1)
            S = CSR.from_dense(dense.astype(e.dtype))
            t = e.op == "spmm_t"
            D = rng.uniform(-1, 1, (s["rows"] if t else s["cols"], n)).astype(e.dtype)
            got = kernel(*S.kernel_arrays(t), D)
            want = (dense.T if t else dense) @ D.astype(np.float64)
            ok = np.allclose(got, want, rtol=1e-3 if e.dtype == "float16" else 1e-4, atol=1e-3)
        elif e.op == "gemm":
            ins = [rng.uniform(-1, 1, [s[d] for d in spec["shape"]]).astype(spec["dtype"]) for spec in e.signature["inputs"]]
            a, b = ins[0].astype(np.float64), ins[1].astype(np.float64)
            want = a @ (b if e.attrs.get("b_layout", "kn") == "kn" else b.T) + (ins[2] if len(ins) > 2 else 0)
            got = kernel(*ins)
            ok = np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
        else:
            res["skipped"] = "no reference check for this op here"
            continue
        res["ok"] = bool(ok)
print(json.dumps({"arch": arch, "results": results}))
"""


@pytest.mark.gpu
def test_gpu_artifacts_from_env_match_the_reference():
    from tvmseq import targets

    root = GPU_ARTIFACTS
    if not targets.has_gpu() or not root:
        pytest.skip("needs a GPU and TVMSEQ_ARTIFACTS (artifacts built for it by tvmseq build)")
    proc = subprocess.run([sys.executable, "-c", _CHECK_ALL, root], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    checked = [r for r in report["results"] if "skipped" not in r]
    assert checked, f"no artifacts for {report['arch']} under {root}"
    bad = [r for r in checked if not r.get("ok")]
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_import_uses_artifacts_from_env():
    """With TVM's compiler on the GPU machine: the test models import with call_dps_packed of the
    artifacts built for them (`tvmseq build` of `python tests/test_prebuild.py DIR`) and run correctly."""
    from tvmseq import targets

    root = GPU_ARTIFACTS
    if not targets.has_gpu() or not root:
        pytest.skip("needs a GPU and TVMSEQ_ARTIFACTS")
    if not _COMPILER:
        pytest.skip("TVM runtime only: importing needs TVM's compiler")
    import tvmseq

    with warnings.catch_warnings():
        warnings.simplefilter("error", ArtifactWarning)
        mod = tvmseq.from_onnx(topk_model(), target="cuda", artifacts=root)
        if _kinds(mod)[1] == 0:
            pytest.skip(f"no artifact for the test TopK model under {root}")
        assert _kinds(mod) == (0, 1)
        _check_topk(tvmseq.compile_onnx(topk_model(), target="cuda", artifacts=root))
        model, w1, w2 = sparse_model()
        assert _kinds(tvmseq.from_onnx(model, target="cuda", artifacts=root)) == (0, 2)
        _check_sparse(tvmseq.compile_onnx(model, target="cuda", artifacts=root), w1, w2)


@needs_compiler
@pytest.mark.parametrize("op", ["GRU", "RNN"])
def test_recurrent_nodes_build_and_import_from_artifacts(op, tmp_path):
    """`tvmseq build` on a GRU/RNN model writes its input-projection and recurrence kernels; the importer
    then calls them (no TIR left) and the outputs match onnxruntime."""
    import onnx

    import tvmseq
    from tvmseq import models
    from tvmseq.cli import main

    ort = pytest.importorskip("onnxruntime")
    model, feeds = models.rnn_node_model(op, seq=5, batch=3, input_size=4, hidden=6, direction="bidirectional",
                                         with_seq_lens=True, with_initial_h=True, seed=4)
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, path)
    assert main(["build", str(path), "--arch", "cpu", "--out", str(tmp_path / "root")]) == 0
    ops = sorted(e.op for e in _entries(tmp_path / "root"))
    # on the CPU the input projection is one SIMD GEMM over the seq x batch rows (the "flat" kernel)
    assert ops == [f"{op.lower()}_input_projection_flat", f"{op.lower()}_recurrence"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _kinds(tvmseq.from_onnx(model, target="llvm", artifacts=tmp_path / "root")) == (0, 2)
        got = tvmseq.compile_onnx(model, target="llvm", artifacts=tmp_path / "root")(**feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
