"""Streaming (tvmseq.Stream): a GRU model exported for whole sequences, its state exposed by
`expose_state`, run frame by frame and in chunks on the CPU == the whole sequence at once (and onnxruntime)."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmseq.errors import TvmseqError

FEAT, HIDDEN, OUT, BATCH, SEQ = 7, 10, 5, 3, 9


def _denoiser_like(conv_kernel: int = 0, direction: str = "forward") -> onnx.ModelProto:
    """X [seq, batch, FEAT] -> MatMul -> GRU (no initial_h) -> Squeeze -> MatMul -> Sigmoid -> mask;
    with conv_kernel > 0 a Conv over time first (carries frames across calls)."""
    rng = np.random.default_rng(3)
    D = 2 if direction == "bidirectional" else 1
    inits = {"w_in": rng.uniform(-0.5, 0.5, (FEAT, FEAT)), "W": rng.uniform(-0.4, 0.4, (D, 3 * HIDDEN, FEAT)),
             "R": rng.uniform(-0.4, 0.4, (D, 3 * HIDDEN, HIDDEN)), "B": rng.uniform(-0.3, 0.3, (D, 6 * HIDDEN)),
             "w_out": rng.uniform(-0.5, 0.5, (D * HIDDEN, OUT))}
    nodes, x = [], "X"
    if conv_kernel:
        inits["k"] = rng.uniform(-0.5, 0.5, (FEAT, FEAT, conv_kernel))
        nodes += [helper.make_node("Transpose", ["X"], ["x_bct"], perm=[1, 2, 0]),
                  helper.make_node("Conv", ["x_bct", "k"], ["c"], kernel_shape=[conv_kernel],
                                   pads=[conv_kernel - 1, 0]),
                  helper.make_node("Transpose", ["c"], ["x_conv"], perm=[2, 0, 1])]
        x = "x_conv"
    inits["sq_axes"] = np.array([1], np.int64)
    inits["shape2"] = np.array([0, 0, D * HIDDEN], np.int64)
    nodes += [helper.make_node("MatMul", [x, "w_in"], ["proj"]),
              helper.make_node("GRU", ["proj", "W", "R", "B"], ["Y"], hidden_size=HIDDEN, linear_before_reset=1,
                               direction=direction, name="gru"),
              helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["Yt", "shape2"], ["y2"]),
              helper.make_node("MatMul", ["y2", "w_out"], ["logits"]),
              helper.make_node("Sigmoid", ["logits"], ["mask"])]
    graph = helper.make_graph(
        nodes, "denoiser", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["seq", BATCH, FEAT])],
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["seq", BATCH, OUT])],
        [numpy_helper.from_array(np.asarray(v, np.float32 if k not in ("sq_axes", "shape2") else np.int64), k)
         for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def streamed():
    from tvmseq.build import compile_onnx

    return compile_onnx(_denoiser_like(), target="llvm", expose_state=True)


def _x(seq, seed=0):
    return np.random.default_rng(seed).standard_normal((seq, BATCH, FEAT)).astype(np.float32)


def test_expose_state_adds_state_io_and_keeps_whole_sequence_result():
    import onnxruntime as ort

    from tvmseq.onnx.expose_state import expose_state

    model = _denoiser_like()
    exposed, pairs = expose_state(model)
    assert [(p.input, p.output) for p in pairs] == [("gru.initial_h", "gru.Y_h")]
    assert [i.name for i in exposed.graph.input] == ["X", "gru.initial_h"]
    assert [o.name for o in exposed.graph.output] == ["mask", "gru.Y_h"]
    x = _x(SEQ)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    got = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"X": x, "gru.initial_h": np.zeros((1, BATCH, HIDDEN), np.float32)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_stream_frame_by_frame_equals_whole_sequence(streamed):
    import tvmseq

    x = _x(SEQ, seed=1)
    whole, last_h = streamed(X=x, **{"gru.initial_h": np.zeros((1, BATCH, HIDDEN), np.float32)})
    stream = tvmseq.Stream(streamed)
    frames = [stream(X=x[t:t + 1]) for t in range(SEQ)]
    np.testing.assert_allclose(np.concatenate(frames), whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stream.state["gru.initial_h"].numpy(), last_h, rtol=1e-5, atol=1e-6)
    # chunks of uneven length, then a reset starts from zero state again
    stream.reset()
    chunks = [stream(x[a:b]) for a, b in ((0, 4), (4, 5), (5, SEQ))]
    np.testing.assert_allclose(np.concatenate(chunks), whole, rtol=1e-5, atol=1e-6)


def test_stream_keeps_state_on_device_and_returns_device_outputs(streamed):
    import tvm

    stream = streamed.stream(output="device")
    x = _x(3, seed=2)
    first = stream(X=x[:1])
    state = stream.state["gru.initial_h"]
    assert isinstance(first, tvm.runtime.Tensor) and isinstance(state, tvm.runtime.Tensor)
    stream(X=x[1:2])
    assert stream.state["gru.initial_h"] is not state      # the new state tensor returned by the model


def test_stream_refuses_a_model_without_state():
    from tvmseq.build import compile_onnx
    from tvmseq.stream import Stream

    model = compile_onnx(_denoiser_like(), target="llvm")
    with pytest.raises(TvmseqError, match="no recurrent state"):
        Stream(model)


@pytest.mark.parametrize("kwargs, what", [(dict(conv_kernel=3), "Conv"), (dict(direction="bidirectional"), "bidirectional")])
def test_expose_state_warns_on_ops_that_mix_time(kwargs, what):
    from tvmseq.onnx.expose_state import StreamingWarning, expose_state

    with pytest.warns(StreamingWarning, match=what):
        expose_state(_denoiser_like(**kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamingWarning)
        expose_state(_denoiser_like())        # nothing but a forward GRU carries state: no warning
