"""`tvmseq bench cpu` in two halves: `--build DIR` (here, TVM's compiler, an explicit `--cpu-target`) and
`--prebuilt DIR` (TVM's runtime only: a subprocess with TVM_USE_RUNTIME_LIB=1, as on a machine without the
compiler), and the llvm target strings they take."""
import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# the run half, in a process whose TVM has no compiler; what it imported is printed last
RUN_HALF = """
import argparse, json, sys
from tvmseq.bench import cpu
parser = argparse.ArgumentParser()
cpu.add_arguments(parser)
rows = cpu.run(parser.parse_args(sys.argv[1:]))
import tvm
print(json.dumps({"runtime_only": bool(tvm.base._RUNTIME_ONLY), "rows": len(rows),
                  "modules": sorted(m for m in sys.modules if m == "onnx" or m.startswith((
                      "tvm.relax", "tvm.meta_schedule", "onnx.", "tvmseq.build", "tvmseq.onnx", "tvmseq.targets")))}))
"""


def _target() -> str:
    return "llvm -mcpu=x86-64-v3" if platform.machine() in ("x86_64", "AMD64") else "llvm"


def test_build_then_prebuilt_without_compiler(tmp_path, monkeypatch):
    from tvmseq.bench import cpu

    monkeypatch.setattr(cpu, "QUICK", dict(cell=("GRU", "LSTM"), hidden=(16,), batch=(2, 3)))
    monkeypatch.setattr(cpu, "STEPS", 5)
    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    build_dir, out = tmp_path / "build", tmp_path / "out"
    assert cpu.run(parser.parse_args(["--build", str(build_dir), "--quick", "--cells", "GRU", "--no-model",
                                      "--no-corpus", "--cpu-target", _target()])) == []
    index = json.loads((build_dir / "index.json").read_text())
    assert [e["runs"][0]["row"]["batch"] for e in index["cases"]] == [2, 3] and "error" not in index["cases"][0]
    assert index["cases"][0]["onnx"] == index["cases"][1]["onnx"] == "node_GRU_h16_s5.onnx"   # one file, both batches
    if _target() != "llvm":
        assert '"vector-width":256' in index["target"] and "x86-64-v3" in index["target"]
    for entry in index["cases"]:
        assert (build_dir / entry["so"]).exists() and (build_dir / entry["runs"][0]["feeds"]).exists()

    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", RUN_HALF, "--prebuilt", str(build_dir), "--reps", "2",
                           "--batches", "3", "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["runtime_only"] and report["modules"] == [] and report["rows"] == 1, report
    saved = json.loads((out / "cpu_recurrent.json").read_text())
    row = saved["rows"][0]
    assert (row["cell"], row["batch"], row["cores"]) == ("GRU", 3, os.cpu_count()) and row["cpu"], row
    assert row["max_err"] < 1e-4 and row["tvmseq_ms"] > 0 and row["ort_ms"] > 0, row
    assert saved["target"] == index["target"] and (out / "cpu_recurrent.png").exists()
    # the FMA floor: the peak kernel exported by the build half, timed by the run half
    assert (build_dir / cpu.FMA_PEAK_SO).exists() and saved["fma_peak_gmacs"] > 1, saved.get("fma_peak_gmacs")
    macs = 5 * 3 * 3 * 16 * (16 + 16)     # steps x batch x GRU gates x hidden x (input + hidden)
    assert row["floor_ms"] == pytest.approx(macs / saved["fma_peak_gmacs"] / 1e6)
    assert 0 < row["tvmseq_of_peak"] < 1.5 and 0 < row["ort_of_peak"] < 1.5, row


def test_fma_floor_counts_and_peak():
    from tvmseq.bench import fma_floor

    assert fma_floor.node_macs("LSTM", 256, 8, 100) == 100 * 8 * 4 * 256 * 512
    assert fma_floor.node_macs("GRU", 400, 1, 37, input_size=161, directions=2) == 2 * 37 * 3 * 400 * 561
    peak = fma_floor.measure(fma_floor.build(1), 1, seconds=0.01, reps=2)
    # one core of anything this runs on: above 1 GMAC/s, below 64 lanes of FMA a cycle at 10 GHz
    assert 1 < peak < 640, peak


@pytest.mark.parametrize("mcpu,lanes", [("x86-64", 4), ("x86-64-v3", 8), ("skylake-avx512", 16)])
def test_fma_peak_in_the_targets_vectors(mcpu, lanes):
    """The peak kernel runs in the target's vector width (16 lanes on AVX2 kept 24 vectors in 16 registers and
    measured half the rate), MACS_PER_ROUND multiply-adds a round whatever the width."""
    import tvm

    from tvmseq.bench import fma_floor
    from tvmseq.schedule_cpu import vector_lanes
    from tvmseq.targets import with_vector_width

    target = with_vector_width(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))   # as fma_floor.build takes it
    assert vector_lanes(target, "float32") == lanes
    text = fma_floor.peak_func(2, lanes).script()
    assert f"T.vectorized({lanes})" in text


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_fma_peak_kernel_computes_its_chains(lanes):
    """Each thread's output is the sum of its ACCUMULATORS chains after `iters` rounds (numpy's float32 replay),
    copied over the LANES values where the vectors are narrower."""
    import tvm

    from tvmseq.bench import fma_floor

    threads, iters = 2, 3
    lib = tvm.compile(tvm.IRModule({"fma_peak": fma_floor.peak_func(threads, lanes)}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(threads * fma_floor.LANES, np.float32))
    lib["fma_peak"](out, iters)
    passes = fma_floor.LANES // lanes
    t, a, lane = np.meshgrid(np.arange(threads), np.arange(fma_floor.ACCUMULATORS), np.arange(lanes), indexing="ij")
    acc = (t + a + lane).astype(np.float32)
    for _ in range(iters * passes):
        acc = acc * np.float32(0.999999) + np.float32(1e-7)
    want = np.tile(acc.sum(axis=1, dtype=np.float32), (1, passes)).reshape(-1)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


def test_selection_of_built_cases():
    from tvmseq.bench import cpu

    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    args = parser.parse_args(["--prebuilt", "x", "--cells", "LSTM", "--hidden", "128,256", "--no-model",
                              "--models", "gtcrn"])
    node = {"case": "node", "cell": "LSTM", "hidden": 256, "batch": 8}
    assert cpu._selected(node, args) and not cpu._selected({**node, "cell": "GRU"}, args)
    assert not cpu._selected({**node, "hidden": 512}, args)
    assert not cpu._selected({"case": "denoiser_model"}, args)
    assert cpu._selected({"case": "corpus", "model": "gtcrn"}, args)
    assert not cpu._selected({"case": "corpus", "model": "dtln-1"}, args)


def test_llvm_target_with_explicit_cpu():
    from tvm.target.codegen import llvm_get_vector_width

    from tvmseq.errors import TvmseqError
    from tvmseq.targets import resolve

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 CPU names")
    for name, bits in (("llvm -mcpu=x86-64-v3", 256), ("llvm -mcpu=sapphirerapids", 512), ("llvm -mcpu=x86-64", 128),
                       ('{"kind": "llvm", "mcpu": "x86-64-v3"}', 256)):
        target = resolve(name)
        assert llvm_get_vector_width(target) == bits, (name, str(target))
    target = resolve("llvm -mcpu=x86-64-v3 -mattr=+avx2,+fma -vector-width=128")
    assert list(target.attrs["mattr"]) == ["+avx2", "+fma"] and llvm_get_vector_width(target) == 128
    with pytest.raises(TvmseqError, match="no such CPU"):
        resolve("llvm -mcpu=nosuchcpu")


def test_node_files_drawn_again_when_absent(tmp_path, monkeypatch):
    """A build directory may travel without its node ONNX files and inputs: the run half draws a node's model and
    inputs again from their seed, byte for byte what `--build` wrote; a missing corpus file is still an error."""
    from tvmseq.bench import cpu

    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    case = next(cpu._node_cases(parser.parse_args(["--cells", "LSTM", "--hidden", "24", "--batches", "3"])))
    monkeypatch.setattr(cpu, "build_case", lambda model, target: None)   # the files only, no module
    entry = cpu._build_case(case, tmp_path, None, lambda *a: None)
    run = entry["runs"][0]
    written = (tmp_path / entry["onnx"]).read_bytes()
    feeds = cpu._feeds(tmp_path, run)
    (tmp_path / entry["onnx"]).unlink()
    (tmp_path / run["feeds"]).unlink()
    assert cpu._onnx_bytes(tmp_path, entry) == written
    drawn = cpu._feeds(tmp_path, run)
    assert drawn.keys() == feeds.keys() and all(np.array_equal(drawn[k], feeds[k]) for k in feeds)
    corpus = {"onnx": "m.onnx", "runs": [{"row": {"case": "corpus", "model": "m"}, "feeds": "m_in0.npz"}]}
    with pytest.raises(FileNotFoundError):
        cpu._onnx_bytes(tmp_path, corpus)
    with pytest.raises(FileNotFoundError):
        cpu._feeds(tmp_path, corpus["runs"][0])
