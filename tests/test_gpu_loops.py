"""ONNX Loop and Scan (tvmseq.onnx.loop, tvmseq.onnx.scan) on the GPU: the models of tests/test_onnx_loop.py and
tests/test_onnx_scan.py compiled HERE for CUDA, run THERE with TVM's runtime only, against onnxruntime's outputs
stored at build (the GPU machine runs onnxruntime too where installed; the stored ones keep the test self-contained).

    python -m tests.test_gpu_loops build out/gpu_loops                    # here (no GPU needed)
    TVMSEQ_LOOPS_DIR=out/gpu_loops pytest -m gpu tests/test_gpu_loops.py  # on the GPU machine
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # `python -m tests.test_gpu_loops build` too

ROOT = Path(os.environ.get("TVMSEQ_LOOPS_DIR", "out/gpu_loops"))
NAMES = ("map_over_batch", "growing_cache", "until_converged", "nested_with_if", "scan_rnn_reversed")


def _cases():
    """name -> (model, list of feeds)."""
    from tests import test_onnx_loop as loop
    from tests import test_onnx_scan as scan

    rng = np.random.default_rng(0)
    converge = [{"x": np.array([0.1, 0.2, 0.3], np.float32), "limit": np.array(v, np.float32), "go": np.array(True),
                 "max_steps": np.array(6, np.int64)} for v in (5.0, 40.0, 1e6)]
    rnn_feeds = [{"h0": rng.standard_normal((2, 5)).astype(np.float32),
                  "x": rng.standard_normal((2, t, 3)).astype(np.float32),
                  "g": rng.uniform(0.5, 1, t).astype(np.float32)} for t in (1, 7)]
    return {
        "map_over_batch": (loop._map_over_batch(), [{"x": loop._x(b, 7, seed=b)} for b in (1, 5)]),
        "growing_cache": (loop._growing_cache(), [{"steps": np.array(n, np.int64), "state0": loop._x(1, 1, 4, seed=n)}
                                                  for n in (1, 6)]),
        "until_converged": (loop._until_converged(True), converge),
        "nested_with_if": (loop._nested(), [{"n": np.array(n, np.int64), "x": loop._x(4, seed=n)} for n in (1, 5)]),
        "scan_rnn_reversed": (scan._scan_rnn([1, 0], [1, 1], [0, 1], [1, 0]), rnn_feeds),
    }


def build(out: Path) -> None:
    import onnxruntime as ort

    import tvmseq

    out.mkdir(parents=True, exist_ok=True)
    for name, (model, feeds_list) in _cases().items():
        tvmseq.build.export(tvmseq.compile_onnx(model.SerializeToString(), target="cuda"), out / f"{name}.so")
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        stored = {}
        for run, feeds in enumerate(feeds_list):
            stored.update({f"{run}/in/{k}": v for k, v in feeds.items()})
            stored.update({f"{run}/out/{k}": v for k, v in enumerate(session.run(None, feeds))})
        np.savez(out / f"{name}.npz", **stored)
        print(f"{name}: built")


def _runs(path: Path) -> list[tuple[dict, list]]:
    data = np.load(path)
    runs = sorted({int(k.split("/")[0]) for k in data.files})
    out = []
    for run in runs:
        feeds = {k.split("/", 2)[2]: data[k] for k in data.files if k.startswith(f"{run}/in/")}
        outs = [data[f"{run}/out/{i}"] for i in range(sum(k.startswith(f"{run}/out/") for k in data.files))]
        out.append((feeds, outs))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_loop_on_gpu_matches_onnxruntime(name):
    from tvmseq.runtime import load_model

    if not (ROOT / f"{name}.so").exists():
        pytest.skip(f"no prebuilt {name} in {ROOT} (python -m tests.test_gpu_loops build {ROOT})")
    model = load_model(ROOT / f"{name}.so")
    for feeds, want in _runs(ROOT / f"{name}.npz"):
        got = model(**feeds)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want):
            assert g.shape == w.shape, f"{name} at { {k: v.shape for k, v in feeds.items()} }"
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name} on {model.device}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit(__doc__)
    build(Path(sys.argv[2]))
