"""Persistent RNN (`persistent_gru_func(cell="rnn")`) kernels of `tvmseq.bench.persistent_rnn`.

CPU (CI): the benchmark's vectorised float64 reference `numpy_rnn` against `tvmseq.reference.rnn` (lengths
with a zero-length row, reverse, bidirectional, clip, per-direction activations), and the whole check path
of the prebuilt test kernels (build, export, load, marshal, compare) on an llvm build of tiny cases.
GPU (marked gpu): the prebuilt CUDA test kernels, built here with
  python3 -m tvmseq.bench.persistent_rnn --build out/prnn
and loaded from out/prnn (or $TVMSEQ_PRNN_PREBUILT) with only TVM's runtime."""
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tvmseq.bench import persistent_rnn as prnn
from tvmseq.measure import PrebuiltModules

PREBUILT = Path(os.environ.get("TVMSEQ_PRNN_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "prnn"))


def _has_compiler() -> bool:
    try:
        importlib.import_module("tvm.script.tirx")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("direction,acts,clip,lens", [
    ("forward", ["Relu"], None, True),
    ("reverse", ["Tanh"], 0.7, True),
    ("bidirectional", ["Tanh", "Relu"], None, True),
    ("bidirectional", ["Tanh", "Tanh"], 0.5, False),
])
def test_numpy_rnn_matches_onnx_reference(direction, acts, clip, lens):
    from tvmseq import reference

    D = 2 if direction == "bidirectional" else 1
    p = prnn.make_problem(D, 5, 6, 4, 7, "float32", seed=3, lens_kind="random" if lens else "full")
    assert (p["lens"] == 0).any() or not lens  # a zero-length row is part of the check
    got = prnn.numpy_rnn(p["X"], p["W"], p["R"], p["Bias"], p["lens"] if lens else None, p["h0"], direction,
                         clip, acts)
    want = reference.rnn(p["X"], p["W"], p["R"], p["Bias"], p["lens"] if lens else None, p["h0"],
                         direction=direction, clip=clip, activations=acts)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not _has_compiler(), reason="TVM compiler not available")
def test_check_path_on_llvm(tmp_path):
    """The --prebuilt test path end to end on the CPU: the same kernels (serial variant) built for llvm."""
    import tvm

    root = prnn.build_for_gpu(tmp_path, target="llvm", bench=False, tests=prnn.CPU_TEST_CASES)
    index = json.loads((root / "index.json").read_text())
    assert len(index["tests"]) == len(prnn.CPU_TEST_CASES)
    mods = PrebuiltModules(root, cuda=False)
    for entry in index["tests"]:
        res = prnn.check_test(entry, mods, tvm.cpu())
        assert res["ok"], f"{entry['name']}:\n  " + "\n  ".join(res["problems"])
    # the check catches a wrong kernel: the forward Relu kernel against a Tanh reference
    wrong = dict(index["tests"][0], acts=["Tanh"])
    assert not prnn.check_test(wrong, mods, tvm.cpu(), launches=1)["ok"]


def _gpu_cases():
    index = PREBUILT / "index.json"
    return json.loads(index.read_text())["tests"] if index.exists() else []


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _gpu_cases() or [None], ids=lambda e: e["name"] if e else "no-payload")
def test_prebuilt_kernels_on_gpu(entry):
    if entry is None:
        pytest.skip(f"no prebuilt payload in {PREBUILT} (python3 -m tvmseq.bench.persistent_rnn --build out/prnn)")
    import tvm

    why = prnn._not_resident(entry, tvm.cuda(0).multi_processor_count)
    if why:
        pytest.skip(f"the launch cannot be resident on this GPU: {why}")
    res = prnn.check_test(entry, _MODULES.setdefault(str(PREBUILT), PrebuiltModules(PREBUILT)), tvm.cuda(0))
    assert res["ok"], f"{entry['name']}:\n  " + "\n  ".join(res["problems"])


_MODULES: dict = {}
