"""The real-model corpus (tests/corpus.py) on the GPU: each model compiled for CUDA on a machine with TVM's
compiler, run where only TVM's runtime is installed, against onnxruntime (CPU provider) on the same inputs as
the CPU test (tests/test_corpus.py: every listed size of every dynamic axis, every sample rate).

    python -m tests.test_gpu_corpus build DIR [ID ...]     # here: DIR/<id>.so + <id>.onnx + <id>.npz (inputs)
    TVMSEQ_CORPUS_DIR=DIR pytest -m gpu tests/test_gpu_corpus.py   # on the GPU machine

A model whose .so + .onnx do not fit one GPU call (64 MiB with TVM's runtime and the checkout) is built alone:
pass its id. When the two together pass `ONNX_BESIDE_MAX_BYTES`, the .onnx stays here and onnxruntime's outputs
(computed here, CPU provider, on the same inputs) travel instead as <id>.want.npz. A module that alone passes
`MODULE_MAX_BYTES` with its weights inside (ddddocr-common: 55 MB) is built with `weights="inputs"` instead, its
weights saved as <id>.weights.<part>.npz of at most `MODULE_MAX_BYTES` each: carry each in a call of its own and the
rest in the last, to a machine still warm (the ignored files a call brought stay there for the next).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `python -m tests.test_gpu_corpus build` too
ROOT = Path(os.environ.get("TVMSEQ_CORPUS_DIR", "out/corpus_gpu"))
ONNX_BESIDE_MAX_BYTES = 48 << 20
MODULE_MAX_BYTES = 32 << 20


def _ids() -> list[str]:
    return sorted(p.stem for p in ROOT.glob("*.so")) if ROOT.exists() else []


def _save_inputs(path: Path, input_sets: list[dict]) -> None:
    np.savez(path, **{f"{run}/{name}": value for run, feeds in enumerate(input_sets) for name, value in feeds.items()})


def load_inputs(path: Path) -> list[dict]:
    data = np.load(path)
    runs: dict[int, dict] = {}
    for key in data.files:
        run, name = key.split("/", 1)
        runs.setdefault(int(run), {})[name] = data[key]
    return [runs[r] for r in sorted(runs)]


def _save_weight_parts(out: Path, model_id: str, weights: dict) -> None:
    """<model_id>.weights.<part>.npz, each at most MODULE_MAX_BYTES of arrays (one larger array: a part alone)."""
    parts, size = [{}], 0
    for name, value in weights.items():
        if parts[-1] and size + value.nbytes > MODULE_MAX_BYTES:
            parts, size = parts + [{}], 0
        parts[-1][name] = value
        size += value.nbytes
    for index, part in enumerate(parts):
        np.savez(out / f"{model_id}.weights.{index}.npz", **part)


def _load_weight_parts(model_id: str) -> dict:
    weights = {}
    for path in sorted(ROOT.glob(f"{model_id}.weights.*.npz")):
        with np.load(path) as data:
            weights.update({k: data[k] for k in data.files})
    return weights


def build(out: Path, ids: list[str]) -> None:
    import shutil

    import onnx

    import tvmseq
    from corpus import CORPUS, fetch
    from test_corpus import input_sets

    out.mkdir(parents=True, exist_ok=True)
    for entry in CORPUS:
        if (ids and entry.id not in ids) or (not ids and entry.expect != "pass"):
            continue
        path = fetch(entry)
        model = tvmseq.compile_onnx(str(path), target="cuda", shape_dict=entry.shapes or None)
        tvmseq.build.export(model, out / f"{entry.id}.so")
        if (out / f"{entry.id}.so").stat().st_size > MODULE_MAX_BYTES:   # the weights travel apart
            model = tvmseq.compile_onnx(str(path), target="cuda", shape_dict=entry.shapes or None, weights="inputs")
            tvmseq.build.export(model, out / f"{entry.id}.so")
            _, _, weights = tvmseq.build.prepare_proto(str(path), model.target, False, "inputs",
                                                       tvmseq.build.WEIGHT_MIN_ELEMENTS, {})
            _save_weight_parts(out, entry.id, {n: weights[n] for n in model.weight_names})
        sets = input_sets(entry, onnx.load(str(path), load_external_data=False))
        _save_inputs(out / f"{entry.id}.npz", sets)
        if (out / f"{entry.id}.so").stat().st_size + path.stat().st_size <= ONNX_BESIDE_MAX_BYTES:
            shutil.copy(path, out / f"{entry.id}.onnx")
        else:
            import onnxruntime as ort

            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            _save_inputs(out / f"{entry.id}.want.npz", [dict(zip(names, session.run(None, feeds))) for feeds in sets])
        print(f"{entry.id}: built", flush=True)


@pytest.mark.gpu
@pytest.mark.parametrize("model_id", _ids() or ["none"])
def test_corpus_model_on_gpu_matches_onnxruntime(model_id):
    from corpus import BY_ID
    from test_corpus import TOLERANCE
    from tvmseq.runtime import load_model

    if model_id == "none":
        pytest.skip(f"no prebuilt corpus models in {ROOT} (python -m tests.test_gpu_corpus build {ROOT})")
    compiled = load_model(ROOT / f"{model_id}.so")
    if compiled.weight_names:   # built with weights="inputs" (a module too large for a call with them inside)
        compiled.set_weights(_load_weight_parts(model_id))
    input_sets = load_inputs(ROOT / f"{model_id}.npz")
    names, want_of, stored = _expected(model_id)
    for index, feeds in enumerate(input_sets):
        got = compiled(**feeds)
        got = got if isinstance(got, tuple) else (got,)
        want = want_of(index, feeds)
        shapes = {k: v.shape for k, v in feeds.items()}
        for name, g, w in zip(names, got, want):
            rtol, atol = BY_ID[model_id].tolerance or TOLERANCE.get(w.dtype.type, (0, 0))
            err = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
            print(f"{model_id} {name} {shapes}: max abs error {err:.3g}")
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{model_id} {name} at {shapes}")
    if stored:      # no onnxruntime time without the model: ours alone
        feeds = input_sets[0]
        compiled(**feeds)
        start = time.perf_counter()
        for _ in range(20):
            compiled(**feeds)
        print(f"{model_id} {({k: v.shape for k, v in feeds.items()})}: tvmseq "
              f"{(time.perf_counter() - start) / 20 * 1e3:.3f} ms a call (numpy in and out)")


def _expected(model_id):
    """(output names, want_of(input set index, feeds) -> onnxruntime's outputs, whether they were stored): read
    from <id>.want.npz where the build stored them, else onnxruntime run here on <id>.onnx."""
    want_path = ROOT / f"{model_id}.want.npz"
    if want_path.exists():
        sets = load_inputs(want_path)
        names = list(sets[0])
        return names, lambda index, feeds: [sets[index][n] for n in names], True
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(ROOT / f"{model_id}.onnx"))
    proto.ir_version = min(proto.ir_version, 10)      # the GPU machine's onnxruntime reads IR <= 13
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [o.name for o in session.get_outputs()], lambda index, feeds: session.run(None, feeds), False


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "build":
        sys.exit(__doc__)
    build(Path(sys.argv[2]), sys.argv[3:])
