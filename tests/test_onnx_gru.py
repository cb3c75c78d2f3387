"""ONNX GRU models through tvmseq's importer, against onnxruntime (layout 0) and tvmseq.reference."""
import itertools

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import tvmseq
from tvmseq import TvmseqError, models, reference
from tvmseq.kernels.activations import Activation

ort = pytest.importorskip("onnxruntime")

FP32 = dict(rtol=1e-4, atol=1e-5)


def ort_run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def reference_run(model, feeds, **attrs):
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w.update({k: v for k, v in feeds.items() if k in ("W", "R", "B")})
    return reference.gru(feeds["X"], w["W"], w["R"], w.get("B"), feeds.get("sequence_lens"),
                         feeds.get("initial_h"), **attrs)


# every combination of direction, linear_before_reset, sequence_lens and layout; initial_h, clip and
# non-default activations toggled so each value of each occurs with every direction
CASES = [dict(direction=d, linear_before_reset=lbr, with_seq_lens=sl, layout=lay,
              with_initial_h=i % 2 == 0, clip=0.8 if i % 3 == 0 else None, custom_acts=i % 4 == 1)
         for i, (d, lbr, sl, lay) in enumerate(itertools.product(
             ["forward", "reverse", "bidirectional"], [0, 1], [False, True], [0, 1]))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_attribute_combinations(case):
    case = dict(case)
    custom = case.pop("custom_acts")
    D = 2 if case["direction"] == "bidirectional" else 1
    acts = ["HardSigmoid", "Softsign"] * D if custom else None
    alphas = [0.3] * D if custom else None
    model, feeds = models.rnn_node_model("GRU", seq=6, batch=3, input_size=5, hidden=7, activations=acts,
                                         activation_alpha=alphas, seed=len(CASES), **case)
    out = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    if case["layout"] == 0:  # onnxruntime's CPU provider does not implement layout=1
        for got, want in zip(out, ort_run(model, feeds)):
            np.testing.assert_allclose(got, want, **FP32)
    attrs = {k: case[k] for k in ("direction", "linear_before_reset", "layout", "clip")}
    ref_acts = [Activation.make("HardSigmoid", 0.3), Activation.make("Softsign")] * D if custom else None
    for got, want in zip(out, reference_run(model, feeds, activations=ref_acts, **attrs)):
        np.testing.assert_allclose(got, want, **FP32)


@pytest.mark.parametrize("opset", [7, 14, 22])
@pytest.mark.parametrize("hidden,batch", [(1, 1), (7, 4), (33, 2)])
def test_opsets_and_odd_sizes(opset, hidden, batch):
    model, feeds = models.rnn_node_model("GRU", seq=5, batch=batch, input_size=6, hidden=hidden,
                                         direction="bidirectional", opset=opset, with_initial_h=True,
                                         with_seq_lens=True, seed=hidden)
    out = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    for got, want in zip(out, ort_run(model, feeds)):
        np.testing.assert_allclose(got, want, **FP32)


@pytest.mark.parametrize("outputs", [("Y",), ("Y_h",)])
def test_optional_outputs(outputs):
    model, feeds = models.rnn_node_model("GRU", outputs=outputs, with_initial_h=True)
    got = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    want = ort_run(model, feeds)[0]
    np.testing.assert_allclose(got, want, **FP32)


def test_weights_as_graph_inputs_and_fp16():
    model, feeds = models.rnn_node_model("GRU", weights_as_inputs=True, linear_before_reset=1)
    out = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    for got, want in zip(out, ort_run(model, feeds)):
        np.testing.assert_allclose(got, want, **FP32)
    model16, feeds16 = models.rnn_node_model("GRU", dtype="float16", direction="bidirectional")
    out16 = tvmseq.compile_onnx(model16, target="llvm")(**feeds16)
    w = {t.name: numpy_helper.to_array(t) for t in model16.graph.initializer}
    want16 = reference.gru(feeds16["X"], w["W"], w["R"], w["B"], direction="bidirectional")
    for got, want in zip(out16, want16):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2, atol=2e-2)


def test_stacked_bidirectional_grus_with_dynamic_time_axis():
    model = models.stacked_gru_model()
    compiled = tvmseq.compile_onnx(model, target="llvm")
    assert compiled.signature["inputs"][0]["shape"][0] == "seq"
    rng = np.random.default_rng(3)
    for seq in (1, 5, 11):  # one compiled model, several sequence lengths
        x = rng.standard_normal((seq, 2, 12)).astype(np.float32)
        np.testing.assert_allclose(compiled(X=x), ort_run(model, {"X": x})[0], **FP32)


def test_onnx_backend_gru_node_tests():
    import onnx.backend.test

    from tvmseq.onnx.backend import TvmseqBackend

    backend_test = onnx.backend.test.BackendTest(TvmseqBackend, __name__)
    backend_test.include(r"^test_gru_.*_cpu$")
    import unittest

    suite = unittest.TestSuite()
    for case in backend_test.test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    ran = result.testsRun - len(result.skipped)
    assert ran >= 6, f"only {ran} GRU backend tests ran"
    assert result.wasSuccessful(), [str(e) for e in result.failures + result.errors]


# --- errors: clear messages naming the node, attribute or input ---------------------------------------
def _gru_with(**attrs):
    model, feeds = models.rnn_node_model("GRU")
    node = model.graph.node[0]
    for k, v in attrs.items():
        node.attribute.append(helper.make_attribute(k, v))
    return model, feeds


@pytest.mark.parametrize("attrs,match", [
    (dict(activations=["Sigmoid", "Gelu"]), "gru0.*activations.*Gelu"),
    (dict(activations=["Sigmoid"]), "gru0.*activations.*1 entries, expected 2"),
    (dict(linear_before_reset=2), "gru0.*linear_before_reset"),
    (dict(some_new_attribute=1), "gru0.*some_new_attribute"),
])
def test_unsupported_attributes_name_node_and_attribute(attrs, match):
    model, _ = _gru_with(**attrs)
    with pytest.raises(TvmseqError, match=match):
        tvmseq.compile_onnx(model, target="llvm")


def test_bad_direction_and_layout():
    model, _ = models.rnn_node_model("GRU")
    for attr in model.graph.node[0].attribute:
        if attr.name == "direction":
            attr.s = b"sideways"
    with pytest.raises(TvmseqError, match="gru0.*direction"):
        tvmseq.compile_onnx(model, target="llvm")
    model, _ = models.rnn_node_model("GRU", layout=1)
    model.graph.node[0].attribute[-1].i = 3
    with pytest.raises(TvmseqError, match="gru0.*layout"):
        tvmseq.compile_onnx(model, target="llvm")


def test_runtime_input_errors():
    model, feeds = models.rnn_node_model("GRU", seq="T", with_seq_lens=True)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    with pytest.raises(TvmseqError, match="no input named 'x'"):
        compiled(x=feeds["X"], sequence_lens=feeds["sequence_lens"])
    with pytest.raises(TvmseqError, match="missing model input.*sequence_lens"):
        compiled(X=feeds["X"])
    with pytest.raises(TvmseqError, match="'X' has dtype float64"):
        compiled(X=feeds["X"].astype(np.float64), sequence_lens=feeds["sequence_lens"])
    with pytest.raises(TvmseqError, match=r"'X' has shape .*\(axis 1 must be 3\)"):
        compiled(X=feeds["X"][:, :2], sequence_lens=feeds["sequence_lens"])
    with pytest.raises(TvmseqError, match="'X' has shape .*rank 2"):
        compiled(X=feeds["X"][0], sequence_lens=feeds["sequence_lens"])
    bad_lens = feeds["sequence_lens"].copy()
    bad_lens[1] = feeds["X"].shape[0] + 1
    with pytest.raises(TvmseqError, match=r"sequence_lens.*must lie in \[0, 7\]"):
        compiled(X=feeds["X"], sequence_lens=bad_lens)
    bad_lens[1] = -1
    with pytest.raises(TvmseqError, match="sequence_lens"):
        compiled(X=feeds["X"], sequence_lens=bad_lens)


def test_model_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    with pytest.raises(TvmseqError, match="could not parse ONNX model"):
        tvmseq.compile_onnx(str(bad), target="llvm")
    with pytest.raises(TvmseqError, match="not found"):
        tvmseq.compile_onnx(str(tmp_path / "missing.onnx"), target="llvm")


def test_unknown_operator_is_named():
    model, _ = models.rnn_node_model("GRU")
    model.graph.node.append(helper.make_node("FancyOp", ["Y_h"], ["Z"]))
    with pytest.raises(TvmseqError, match="FancyOp"):
        tvmseq.compile_onnx(model, target="llvm")
