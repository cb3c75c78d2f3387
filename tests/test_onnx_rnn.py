"""ONNX RNN through tvmseq (per-step path) against onnxruntime and tvmseq.reference."""
import itertools
import unittest

import numpy as np
import pytest
from onnx import numpy_helper

import tvmseq
from tvmseq import TvmseqError, models, reference

ort = pytest.importorskip("onnxruntime")
FP32 = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("direction,with_seq_lens,layout,acts", [
    (d, sl, lay, acts) for (d, sl, lay), acts in zip(
        itertools.product(["forward", "reverse", "bidirectional"], [False, True], [0, 1]),
        itertools.cycle([None, "Relu", "LeakyRelu"]))])
@pytest.mark.parametrize("hidden,batch", [(1, 1), (9, 3)])
def test_rnn_matches_onnxruntime_and_reference(direction, with_seq_lens, layout, acts, hidden, batch):
    D = 2 if direction == "bidirectional" else 1
    activations = None if acts is None else [acts] * D
    model, feeds = models.rnn_node_model("RNN", seq=6, batch=batch, input_size=5, hidden=hidden,
                                         direction=direction, with_seq_lens=with_seq_lens, layout=layout,
                                         with_initial_h=True, activations=activations, clip=0.9 if acts else None,
                                         seed=hidden)
    out = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    if layout == 0:  # onnxruntime's CPU provider does not implement layout=1
        for got, want in zip(out, ort.InferenceSession(model.SerializeToString(),
                                                       providers=["CPUExecutionProvider"]).run(None, feeds)):
            np.testing.assert_allclose(got, want, **FP32)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    want = reference.rnn(feeds["X"], w["W"], w["R"], w["B"], feeds.get("sequence_lens"), feeds["initial_h"],
                         direction=direction, layout=layout, clip=0.9 if acts else None, activations=activations)
    for got, ref in zip(out, want):
        np.testing.assert_allclose(got, ref, **FP32)


def test_onnx_backend_rnn_node_tests():
    import onnx.backend.test

    from tvmseq.onnx.backend import TvmseqBackend

    backend_test = onnx.backend.test.BackendTest(TvmseqBackend, __name__)
    backend_test.include(r"^test_(rnn|simple_rnn)_.*_cpu$")
    suite = unittest.TestSuite()
    for case in backend_test.test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    assert result.testsRun - len(result.skipped) >= 4
    assert result.wasSuccessful(), [str(e) for e in result.failures + result.errors]


def test_rnn_rejects_gru_only_attribute():
    from onnx import helper

    model, _ = models.rnn_node_model("RNN")
    model.graph.node[0].attribute.append(helper.make_attribute("linear_before_reset", 1))
    with pytest.raises(TvmseqError, match="rnn0.*linear_before_reset"):
        tvmseq.compile_onnx(model, target="llvm")
