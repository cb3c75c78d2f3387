"""GRU models compiled for CUDA and run on the GPU (skipped without one): `pytest -m gpu`."""
import numpy as np
import pytest
from onnx import numpy_helper

import tvmseq
from tvmseq import models, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("hidden,batch", [(1, 1), (33, 5), (130, 67)])
def test_gru_on_gpu_matches_reference(dtype, direction, lbr, hidden, batch):
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


def test_stacked_model_on_gpu():
    ort = pytest.importorskip("onnxruntime")
    model = models.stacked_gru_model()
    compiled = tvmseq.compile_onnx(model, target="cuda")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seq in (1, 13):
        x = np.random.default_rng(seq).standard_normal((seq, 2, 12)).astype(np.float32)
        np.testing.assert_allclose(compiled(X=x), sess.run(None, {"X": x})[0], rtol=1e-4, atol=1e-5)


def test_dlpack_inputs_from_torch():
    torch = pytest.importorskip("torch")
    model, feeds = models.rnn_node_model("GRU", with_initial_h=True)
    compiled = tvmseq.compile_onnx(model, target="cuda")
    want = compiled(**feeds)
    got = compiled(**{k: torch.from_numpy(v).cuda() for k, v in feeds.items()})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_demo_on_gpu():
    from tvmseq.demo import run_demo

    assert run_demo(target="cuda") < 1e-3


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_rnn_on_gpu_matches_reference(direction):
    model, feeds = models.rnn_node_model("RNN", seq=7, batch=5, input_size=11, hidden=37, direction=direction,
                                         with_seq_lens=True, with_initial_h=True, weight_scale=37 ** -0.5)
    y, y_h = tvmseq.compile_onnx(model, target="cuda")(**feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ry, ry_h = reference.rnn(feeds["X"], w["W"], w["R"], w["B"], feeds["sequence_lens"], feeds["initial_h"],
                             direction=direction)
    np.testing.assert_allclose(y, ry, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_h, ry_h, rtol=1e-4, atol=1e-5)
