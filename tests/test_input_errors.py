"""Bad inputs that once passed silently or crashed: each is fed and must give one line (TvmseqError)
naming the node or the option, at import where the value is known then, else when the model runs.
Valid inputs through the same paths are compared with onnxruntime. CPU (llvm)."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm

if getattr(tvm.base, "_RUNTIME_ONLY", False):  # importing ONNX models needs TVM's compiler
    pytest.skip("TVM runtime only: the ONNX importer needs TVM's compiler", allow_module_level=True)

import tvmseq  # noqa: E402
from tvmseq import TvmseqError, UnsupportedOnnxError  # noqa: E402

ort = pytest.importorskip("onnxruntime")

SEQ, BATCH, INPUT, HIDDEN = 5, 3, 4, 6
GATES = {"GRU": 3, "RNN": 1, "LSTM": 4}
FLOAT, INT32, INT64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def recurrent_model(op="GRU", lens=None, lens_input=None, seq=SEQ, hidden_attr=HIDDEN, r_hidden=HIDDEN,
                    extra_nodes=(), extra_inputs=(), seed=0):
    """One GRU/RNN/LSTM node 'rec' on X [seq, BATCH, INPUT]. sequence_lens: the constant `lens`, or the
    tensor named `lens_input` (a graph input or the output of `extra_nodes`)."""
    rng = np.random.default_rng(seed)
    g = GATES[op]
    inits = [numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, g * r_hidden, INPUT)).astype("float32"), "W"),
             numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, g * r_hidden, r_hidden)).astype("float32"), "R")]
    node_inputs = ["X", "W", "R", "", ""]
    if lens is not None:
        inits.append(numpy_helper.from_array(np.asarray(lens), "lens"))
        node_inputs[4] = "lens"
    elif lens_input is not None:
        node_inputs[4] = lens_input
    attrs = {} if hidden_attr is None else {"hidden_size": hidden_attr}
    outputs = ["Y", "Y_h"]
    node = helper.make_node(op, node_inputs, outputs, name="rec", **attrs)
    graph = helper.make_graph(list(extra_nodes) + [node], "g",
                              [helper.make_tensor_value_info("X", FLOAT, [seq, BATCH, INPUT]), *extra_inputs],
                              [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def x_of(seq=SEQ, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (seq, BATCH, INPUT)).astype("float32")


# ------------------------------------------------------------------------------ sequence_lens
@pytest.mark.parametrize("op", ["GRU", "RNN", "LSTM"])
@pytest.mark.parametrize("lens,bad", [([2, 9, 5], 9), ([2, -1, 5], -1)])
def test_constant_sequence_lens_out_of_range_refused_at_import(op, lens, bad):
    with pytest.raises(UnsupportedOnnxError) as err:
        tvmseq.from_onnx(recurrent_model(op, lens=np.array(lens, np.int32)), target="llvm")
    assert f"ONNX node 'rec' ({op}): constant input 'sequence_lens' holds {bad}, outside [0, {SEQ}]" in one_line(err)


@pytest.mark.parametrize("how", ["graph input", "constant"])
def test_float_sequence_lens_refused_at_import(how):
    if how == "constant":
        model = recurrent_model(lens=np.array([2.7, 5.0, 1.2], np.float32))
    else:
        model = recurrent_model(lens_input="lens_f",
                                extra_inputs=[helper.make_tensor_value_info("lens_f", FLOAT, [BATCH])])
    with pytest.raises(UnsupportedOnnxError) as err:
        tvmseq.from_onnx(model, target="llvm")
    assert "ONNX node 'rec' (GRU): input 'sequence_lens' has dtype float32; it must be int32" in one_line(err)


def test_sequence_lens_through_a_cast_checked_when_the_model_runs():
    """lengths = Cast(float lengths): valid values match onnxruntime; out-of-range ones are refused,
    naming the node, before the recurrence runs."""
    cast = helper.make_node("Cast", ["lens_f"], ["lens_i"], to=INT32)
    model = recurrent_model(lens_input="lens_i", extra_nodes=[cast],
                            extra_inputs=[helper.make_tensor_value_info("lens_f", FLOAT, [BATCH])])
    compiled = tvmseq.compile_onnx(model, target="llvm")
    x = x_of()
    good = {"X": x, "lens_f": np.array([2, 5, 0], np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, good)
    for got, ref in zip(compiled(**good), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    for bad in ([2, 6, 0], [-1, 2, 3]):
        with pytest.raises(TvmseqError) as err:
            compiled(X=x, lens_f=np.array(bad, np.float32))
        assert "ONNX node 'rec' (GRU): input 'sequence_lens' (computed in the graph) has values outside" \
            in one_line(err)


def test_constant_sequence_lens_against_a_symbolic_time_axis_checked_when_the_model_runs():
    model = recurrent_model("RNN", lens=np.array([4, 1, 3], np.int32), seq="time")
    compiled = tvmseq.compile_onnx(model, target="llvm")
    x = x_of(seq=4)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    for got, ref in zip(compiled(X=x), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(TvmseqError) as err:
        compiled(X=x_of(seq=3))
    assert "ONNX node 'rec' (RNN): input 'sequence_lens' holds 4, more than X's sequence length" in one_line(err)


# ------------------------------------------------------------------------------ hidden_size
@pytest.mark.parametrize("op", ["GRU", "RNN", "LSTM"])
@pytest.mark.parametrize("hidden_attr,r_hidden,match", [
    (0, HIDDEN, "attribute 'hidden_size' = 0 must be positive"),
    (-3, HIDDEN, "attribute 'hidden_size' = -3 must be positive"),
    (HIDDEN + 1, HIDDEN, f"attribute 'hidden_size' = {HIDDEN + 1} does not match input 'R'"),
    (None, 0, "hidden size 0 must be positive"),
])
def test_bad_hidden_size_names_the_node(op, hidden_attr, r_hidden, match):
    with pytest.raises(UnsupportedOnnxError) as err:
        tvmseq.from_onnx(recurrent_model(op, hidden_attr=hidden_attr, r_hidden=r_hidden), target="llvm")
    text = one_line(err)
    assert f"ONNX node 'rec' ({op}):" in text and match in text


# ------------------------------------------------------------------------------ TopK K
def topk_model(k=None):
    """TopK 'topk' over axis 1 of x [2, 10]; K constant `k`, else K = k_in + 1 computed in the graph."""
    nodes, inputs, inits = [], [helper.make_tensor_value_info("x", FLOAT, [2, 10])], []
    if k is None:
        nodes.append(helper.make_node("Add", ["k_in", "one"], ["k"]))
        inputs.append(helper.make_tensor_value_info("k_in", INT64, [1]))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "one"))
    else:
        inits.append(numpy_helper.from_array(np.array([k], np.int64), "k"))
    nodes.append(helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk", axis=1))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("v", FLOAT, None),
                                                   helper.make_tensor_value_info("i", INT64, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_topk_k_computed_in_the_graph_checked_when_the_model_runs():
    model = topk_model()
    compiled = tvmseq.compile_onnx(model, target="llvm")
    x = np.random.default_rng(3).permutation(20).reshape(2, 10).astype("float32")
    feeds = {"x": x, "k_in": np.array([3], np.int64)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, ref in zip(compiled(**feeds), want):
        np.testing.assert_array_equal(got, ref)
    for k_in in (10, -2):        # K = 11 and K = -1
        with pytest.raises(TvmseqError) as err:
            compiled(x=x, k_in=np.array([k_in], np.int64))
        assert "ONNX node 'topk' (TopK): input 'K' (computed in the graph) is outside [0, 10]" in one_line(err)


@pytest.mark.parametrize("k", [11, -1])
def test_topk_constant_k_out_of_range_refused_at_import(k):
    with pytest.raises(UnsupportedOnnxError) as err:
        tvmseq.from_onnx(topk_model(k), target="llvm")
    assert f"ONNX node 'topk' (TopK): K = {k} is outside [0, 10]" in one_line(err)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("entry", ["from_onnx", "compile_onnx"])
def test_misspelled_option_is_refused(entry):
    with pytest.raises(TvmseqError) as err:
        getattr(tvmseq, entry)(recurrent_model(), target="llvm", recurence="per_step")
    text = one_line(err)
    assert "unknown option 'recurence' (did you mean 'recurrence'?)" in text
    assert "sparse_threshold" in text and "gru_stack" in text     # the valid ones are listed


def test_misspelled_compile_option_is_suggested():
    with pytest.raises(TvmseqError, match="unknown option 'cuda_grpah' \\(did you mean 'cuda_graph'\\?\\)"):
        tvmseq.compile_onnx(recurrent_model(), target="llvm", cuda_grpah=True)



def test_a_compile_option_given_to_from_onnx_says_where_it_belongs():
    with pytest.raises(TvmseqError) as err:
        tvmseq.from_onnx(recurrent_model(), target="llvm", expose_state=True)
    assert "option 'expose_state' belongs to compile_onnx" in one_line(err)

# ------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.compiles
def test_run_time_checks_on_the_gpu():
    """The checks compiled into a CUDA model read the values on the host (the assert is in host code):
    valid values give onnxruntime's results, bad ones the same one-line TvmseqError as on the CPU, and
    the model still runs afterwards."""
    cast = helper.make_node("Cast", ["lens_f"], ["lens_i"], to=INT32)
    gru = recurrent_model(lens_input="lens_i", extra_nodes=[cast],
                          extra_inputs=[helper.make_tensor_value_info("lens_f", FLOAT, [BATCH])])
    topk = topk_model()
    x = np.random.default_rng(3).permutation(20).reshape(2, 10).astype("float32")
    cases = [(gru, {"X": x_of(), "lens_f": np.array([2, 5, 0], np.float32)},
              {"lens_f": np.array([2, 6, 0], np.float32)},
              "ONNX node 'rec' (GRU): input 'sequence_lens' (computed in the graph)"),
             (topk, {"x": x, "k_in": np.array([3], np.int64)}, {"k_in": np.array([10], np.int64)},
              "ONNX node 'topk' (TopK): input 'K' (computed in the graph)")]
    for model, good, bad, message in cases:
        compiled = tvmseq.compile_onnx(model, target="cuda")
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, good)
        with pytest.raises(TvmseqError) as err:
            compiled(**{**good, **bad})
        assert message in one_line(err)
        for got, ref in zip(compiled(**good), want):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
