"""The biases of GRU, RNN and LSTM nodes fold at import (`tvmseq.onnx.gru.fold_biases`): where B (and an LSTM's P)
is an initializer, the biases the kernels take are computed in numpy and enter the module as constants, and
`weights="inputs"` keeps B an initializer, so no kernel derives them from the weights on every call (a one-frame
streaming build of the GRU denoiser spent 4 of its 12 kernels on this). A B given as a graph input still works
(sliced and added at run time). Also: the one-step kernel a one-frame build runs (`kernels.recurrent.one_step`)."""
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import tvmseq
from tvmseq import models
from tvmseq.build import kernel_calls
from test_lstm_reference import lstm_node_model

ort = pytest.importorskip("onnxruntime")
FP32 = dict(rtol=1e-4, atol=1e-5)
# what the run-time bias derivation compiles to (slices, the concat of the GRU's folded part, the lbr multiply, casts)
BIAS_OPS = ("strided_slice", "concatenate", "multiply", "cast")


def _node_model(cell, **kw):
    """(model, feeds) of one node of `cell`: "GRU0"/"GRU1" (linear_before_reset 0/1), "RNN", "LSTM" (peepholes)."""
    if cell.startswith("GRU"):
        return models.rnn_node_model("GRU", linear_before_reset=int(cell[3]), **kw)
    if cell == "RNN":
        return models.rnn_node_model("RNN", **kw)
    model, feeds, _ = lstm_node_model(with_peepholes=True, **kw)
    return model, feeds


def _inputs_instead(model, names):
    """The model with the initializers `names` turned into graph inputs, and their values."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in names}
    kept = [t for t in model.graph.initializer if t.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for name, value in values.items():
        model.graph.input.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                                               list(value.shape)))
    return model, values


def _compile(model, target, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tvmseq.compile_onnx(model, target=target, **kw)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("cell", ["GRU0", "GRU1", "RNN", "LSTM"])
def test_one_frame_cuda_build_runs_no_bias_kernel(cell, direction):
    """A one-frame, batch-1 build for the H100 with every weight lifted (weights_min_elements=1): per call one
    kernel for the node (`kernels.recurrent.one_step`, input projection included), or for a GRU with
    linear_before_reset=0 the input projection (bias added in its epilogue) and the recurrence; nothing computed
    from the weights alone."""
    model, _ = _node_model(cell, seq=1, batch=1, input_size=10, hidden=12, direction=direction)
    built = _compile(model, "cuda", weights="inputs", weights_min_elements=1)
    assert set(built.weight_names) == {"W", "R"}          # B (and P) stay initializers: folded at import
    calls = kernel_calls(built)
    if cell == "GRU0":
        assert len(calls) == 2 and "recurrence" in calls[1], calls
    else:
        assert calls == [f"{cell.rstrip('01').lower()}_one_step"], calls
    assert not [c for c in calls if any(op in c for op in BIAS_OPS)], calls


@pytest.mark.parametrize("cell", ["GRU0", "GRU1", "RNN", "LSTM"])
def test_bias_as_graph_input_runs_and_gives_the_same_bits(cell):
    """B given as a graph input: derived at run time (the slices are there), the outputs bit for bit those of
    the same model with B an initializer (folded in numpy), with its weights embedded or lifted, and
    onnxruntime's within fp32 tolerance."""
    model, feeds = _node_model(cell, seq=3, batch=2, input_size=5, hidden=7, direction="bidirectional",
                               with_initial_h=True)
    folded = _compile(model, "llvm")
    lifted = _compile(model, "llvm", weights="inputs", weights_min_elements=1)
    as_input, values = _inputs_instead(model, {"B"})
    runtime = _compile(as_input, "llvm")
    assert any("strided_slice" in c for c in kernel_calls(runtime))
    assert not [c for c in kernel_calls(folded) + kernel_calls(lifted) if any(op in c for op in BIAS_OPS)]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    out_folded, out_lifted, out_runtime = folded(**feeds), lifted(**feeds), runtime(**feeds, **values)
    for a, b, c, w in zip(out_folded, out_lifted, out_runtime, want):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
        np.testing.assert_allclose(a, w, **FP32)


def test_lifted_gru_stack_keeps_its_biases():
    """A GRU stack fused into one node (gru_stack='on', its serial variant on the CPU) and lifted: every layer's B
    stays an initializer and folds; the result is onnxruntime's."""
    model, feeds = models.gru_stack_model(3, seq=4, batch=2, input_size=5, hidden=6)
    built = _compile(model, "llvm", gru_stack="on", weights="inputs", weights_min_elements=1)
    assert set(built.weight_names) == {f"{k}{l}" for k in "WR" for l in range(3)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, w in zip(built(**feeds), want):
        np.testing.assert_allclose(got, w, **FP32)


ONE_STEP_CASES = [(cell, d, b) for cell in ("GRU1", "RNN", "LSTM") for d in ("forward", "reverse", "bidirectional")
                  for b in (1, 3)]


@pytest.mark.parametrize("cell,direction,batch", ONE_STEP_CASES)
def test_one_step_kernel_matches_onnxruntime(cell, direction, batch):
    """recurrence='one_step' on llvm runs the kernel's serial variant (the GPU kernel's indexing and math): every
    direction, batch 1 and 3, initial states, clip (GRU), peepholes and input_forget (LSTM)."""
    kw = dict(seq=1, batch=batch, input_size=10, hidden=12, direction=direction, with_initial_h=True)
    if cell == "GRU1":
        kw["clip"] = 0.9 if batch == 3 else None
    if cell == "LSTM":
        kw.update(with_initial_c=True, input_forget=1 if batch == 3 else 0)
    model, feeds = _node_model(cell, **kw)
    got = _compile(model, "llvm", recurrence="one_step")(**feeds)
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **FP32)


def test_one_step_float16_and_the_paths_it_refuses():
    model, feeds = models.rnn_node_model("GRU", seq=1, batch=2, input_size=6, hidden=9, linear_before_reset=1,
                                         dtype="float16", with_initial_h=True)
    got = _compile(model, "llvm", recurrence="one_step")(**feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    from tvmseq import reference
    want = reference.gru(feeds["X"], w["W"], w["R"], w["B"], None, feeds["initial_h"], linear_before_reset=1)
    for g, r in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float64), r, rtol=2e-2, atol=2e-2)
    for model, match in ((models.rnn_node_model("GRU", seq=2, linear_before_reset=1)[0], "not a static 1"),
                         (models.rnn_node_model("GRU", seq=1, linear_before_reset=0)[0], "linear_before_reset"),
                         (models.rnn_node_model("RNN", seq=1, with_seq_lens=True)[0], "sequence_lens")):
        with pytest.raises(tvmseq.TvmseqError, match=match):
            _compile(model, "llvm", recurrence="one_step")
