"""GRU models compiled for CUDA and run on the GPU (skipped without one): `pytest -m gpu`.
`test_prebuilt_kernels_on_gpu` runs the kernels built on the CPU machine
(`python3 -m tvmseq.bench.gru --build out/gru`) where only TVM's runtime is installed."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from numpy_gru import numpy_gru

pytestmark = pytest.mark.gpu

PREBUILT = Path(os.environ.get("TVMSEQ_GRU_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "gru"))


def _prebuilt_cases():
    index = PREBUILT / "index.json"
    if not index.exists():
        return []
    return json.loads(index.read_text()).get("tests", [])


@pytest.mark.parametrize("entry", _prebuilt_cases() or [None], ids=lambda e: e["name"] if e else "no-payload")
def test_prebuilt_kernels_on_gpu(entry):
    """Input projection + recurrence from the prebuilt payload (tiled step GEMM from batch 16 on: odd
    sizes, split-K, fp16) against a float64 numpy GRU, with sequence_lens; Y/Y_h poisoned with NaN first."""
    if entry is None:
        pytest.skip(f"no prebuilt payload in {PREBUILT} (python3 -m tvmseq.bench.gru --build out/gru)")
    import tvm

    from tvmseq import cuda_toolchain

    cuda_toolchain.ensure_cuda_runtime()
    D, B, H, I, dtype = entry["D"], entry["B"], entry["H"], entry["input_size"], entry["dtype"]
    seq = 11
    rng = np.random.default_rng(H + B)
    dev = tvm.cuda(0)
    t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    mod = tvm.runtime.load_module(str(PREBUILT / entry["file"]))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    rev = [entry["direction"] == "reverse" or d == 1 for d in range(D)]
    if entry.get("op") == "RNN":
        X = rng.standard_normal((seq, B, I)).astype(dtype)
        W = rng.uniform(-0.6, 0.6, (D, H, I)).astype(dtype)
        R = (rng.uniform(-1.5, 1.5, (D, H, H)) / np.sqrt(H)).astype(dtype)
        Bias = rng.uniform(-0.5, 0.5, (D, 2 * H)).astype(np.float32)
        h0 = rng.standard_normal((D, B, H)).astype(np.float32)
        lens = rng.integers(0, seq + 1, B).astype(np.int32)
        gate_i = t(np.full((D, seq, B, H), np.nan, np.float32))
        mod[entry["proj"]](t(X), t(W), t(Bias[:, :H] + Bias[:, H:]), gate_i)
        Y, Yh = t(np.full((seq, D, B, H), np.nan, dtype)), t(np.full((D, B, H), np.nan, dtype))
        mod[entry["rec"]](gate_i, t(R), t(lens), t(h0), Y, Yh)
        dev.sync()
        rY, rYh = np.zeros((seq, D, B, H)), np.zeros((D, B, H))
        for d in range(D):
            for b in range(B):
                h = h0[d, b].astype(np.float64)
                for s in range(lens[b]):
                    ts = lens[b] - 1 - s if rev[d] else s
                    h = np.tanh(X[ts, b].astype(np.float64) @ W[d].T.astype(np.float64)
                                + h @ R[d].T.astype(np.float64) + Bias[d, :H] + Bias[d, H:])
                    rY[ts, d, b] = h
                rYh[d, b] = h if lens[b] > 0 else 0
        np.testing.assert_allclose(Y.numpy().astype(np.float64), rY, **tol, err_msg=f"Y of {entry['name']}")
        np.testing.assert_allclose(Yh.numpy().astype(np.float64), rYh, **tol, err_msg=f"Y_h of {entry['name']}")
        return
    lbr = entry["lbr"]
    X = rng.standard_normal((seq, B, I)).astype(dtype)
    W = rng.uniform(-0.6, 0.6, (D, 3 * H, I)).astype(dtype)
    R = (rng.uniform(-2, 2, (D, 3 * H, H)) / np.sqrt(H)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    lens = rng.integers(0, seq + 1, B).astype(np.int32)
    lens[0] = seq
    bias_i = Bias[:, :3 * H] + np.concatenate([Bias[:, 3 * H:5 * H], (1 - lbr) * Bias[:, 5 * H:]], 1)
    gate_i = t(np.full((D, seq, B, 3 * H), np.nan, np.float32))
    mod[entry["proj"]](t(X), t(W), t(bias_i.astype(np.float32)), gate_i)
    Y, Yh = t(np.full((seq, D, B, H), np.nan, dtype)), t(np.full((D, B, H), np.nan, dtype))
    mod[entry["rec"]](gate_i, t(R), t(Bias[:, 5 * H:]), t(lens), t(h0), Y, Yh)
    dev.sync()
    sig, tanh = (lambda x: 1 / (1 + np.exp(-x))), np.tanh
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, rev, lbr, None, [(sig, tanh)] * D)
    np.testing.assert_allclose(Y.numpy().astype(np.float64), rY, **tol, err_msg=f"Y of {entry['name']}")
    np.testing.assert_allclose(Yh.numpy().astype(np.float64), rYh, **tol, err_msg=f"Y_h of {entry['name']}")


@pytest.mark.compiles
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("hidden,batch", [(1, 1), (33, 5), (130, 67)])
def test_gru_on_gpu_matches_reference(dtype, direction, lbr, hidden, batch):
    from onnx import numpy_helper

    import tvmseq
    from tvmseq import models, reference

    model, feeds = models.rnn_node_model("GRU", seq=9, batch=batch, input_size=19, hidden=hidden,
                                         direction=direction, linear_before_reset=lbr, with_seq_lens=True,
                                         with_initial_h=True, dtype=dtype, weight_scale=hidden ** -0.5,
                                         seed=hidden + batch)
    y, y_h = tvmseq.compile_onnx(model, target="cuda")(**feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ry, ry_h = reference.gru(feeds["X"], w["W"], w["R"], w["B"], feeds["sequence_lens"], feeds["initial_h"],
                             direction=direction, linear_before_reset=lbr)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(y.astype(np.float64), ry, **tol)
    np.testing.assert_allclose(y_h.astype(np.float64), ry_h, **tol)


@pytest.mark.compiles
def test_stacked_model_on_gpu():
    import tvmseq
    from tvmseq import models

    ort = pytest.importorskip("onnxruntime")
    model = models.stacked_gru_model()
    compiled = tvmseq.compile_onnx(model, target="cuda")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (1, 13):
        x = np.random.default_rng(seq).standard_normal((seq, 2, 12)).astype(np.float32)
        np.testing.assert_allclose(compiled(X=x), sess.run(None, {"X": x})[0], rtol=1e-4, atol=1e-5)


@pytest.mark.compiles
def test_dlpack_inputs_from_torch():
    import tvmseq
    from tvmseq import models

    torch = pytest.importorskip("torch")
    model, feeds = models.rnn_node_model("GRU", with_initial_h=True)
    compiled = tvmseq.compile_onnx(model, target="cuda")
    want = compiled(**feeds)
    got = compiled(**{k: torch.from_numpy(v).cuda() for k, v in feeds.items()})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.compiles
def test_demo_on_gpu():
    from tvmseq.demo import run_demo

    assert run_demo(target="cuda") < 1e-3


@pytest.mark.compiles
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_rnn_on_gpu_matches_reference(direction):
    from onnx import numpy_helper

    import tvmseq
    from tvmseq import models, reference

    model, feeds = models.rnn_node_model("RNN", seq=7, batch=5, input_size=11, hidden=37, direction=direction,
                                         with_seq_lens=True, with_initial_h=True, weight_scale=37 ** -0.5)
    y, y_h = tvmseq.compile_onnx(model, target="cuda")(**feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ry, ry_h = reference.rnn(feeds["X"], w["W"], w["R"], w["B"], feeds["sequence_lens"], feeds["initial_h"],
                             direction=direction)
    np.testing.assert_allclose(y, ry, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_h, ry_h, rtol=1e-4, atol=1e-5)
