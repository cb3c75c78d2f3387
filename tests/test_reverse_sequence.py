"""ONNX ReverseSequence (tf2onnx's backward half of a Keras Bidirectional LSTM as a Loop) against onnxruntime: both
axis layouts, ragged lengths (0, 1, partial, full), lengths as an input, a constant and computed in the graph,
batch and time symbolic; bad attributes and lengths refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ort_compare import matches_onnxruntime, refused_in_one_line
from tvmseq import TvmseqError

pytest.importorskip("onnxruntime")
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def model(batch_axis=1, time_axis=0, lens="input", extra_dims=(3,)):
    """y = ReverseSequence(x, lens): x [t, b, ...] (time_axis 0) or [b, t, ...]; lens a graph input, the
    constant [2, 0] (batch 2), or Expand(t, [b]) computed from x's shape (every row reversed whole, as
    tf2onnx writes a Bidirectional LSTM's backward direction)."""
    dims = (["t", "b"] if time_axis == 0 else ["b", "t"]) + list(extra_dims)
    if lens == "constant":
        dims[dims.index("b")] = 2
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("x", F, dims)]
    if lens == "input":
        inputs.append(helper.make_tensor_value_info("lens", I64, ["b"]))
    elif lens == "constant":
        inits.append(numpy_helper.from_array(np.array([2, 0], np.int64), "lens"))
    else:
        nodes += [helper.make_node("Shape", ["x"], ["s"]),
                  helper.make_node("Gather", ["s", "ti"], ["t"], axis=0),
                  helper.make_node("Gather", ["s", "bi"], ["b"], axis=0),
                  helper.make_node("Expand", ["t", "b"], ["lens"])]
        inits += [numpy_helper.from_array(np.array([time_axis], np.int64), "ti"),
                  numpy_helper.from_array(np.array([batch_axis], np.int64), "bi")]
    nodes.append(helper.make_node("ReverseSequence", ["x", "lens"], ["y"], name="reverse",
                                  batch_axis=batch_axis, time_axis=time_axis))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def feed(time_axis, b, t, lens=None, extra=(3,), seed=0):
    shape = ((t, b) if time_axis == 0 else (b, t)) + tuple(extra)
    feeds = {"x": np.random.default_rng(seed + b * t).standard_normal(shape).astype(np.float32)}
    if lens is not None:
        feeds["lens"] = np.array(lens, np.int64)
    return feeds


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_ragged_lengths_as_an_input(batch_axis, time_axis):
    matches_onnxruntime(model(batch_axis, time_axis), [feed(time_axis, 2, 4, [4, 1]),
                                                       feed(time_axis, 4, 7, [0, 7, 3, 2])], exact=True)


@pytest.mark.parametrize("batch_axis,time_axis", [(1, 0), (0, 1)])
def test_lengths_computed_from_the_shape(batch_axis, time_axis):
    matches_onnxruntime(model(batch_axis, time_axis, lens="computed", extra_dims=(2, 3)),
                        [feed(time_axis, 1, 5, extra=(2, 3)), feed(time_axis, 3, 8, extra=(2, 3))], exact=True)


def test_two_reversals_with_computed_lengths():
    """tf2onnx's Bidirectional LSTM reverses the input and the backward output, each by lengths computed in the
    graph: two run-time checked copies of lengths in one model (they had one global symbol: TVM refused to build)."""
    m = model(1, 0, lens="computed")
    again = helper.make_node("ReverseSequence", ["y", "lens"], ["z"], name="reverse_back", batch_axis=1, time_axis=0)
    m.graph.node.extend([helper.make_node("Mul", ["x", "y"], ["xy"]), again])
    del m.graph.output[:]
    m.graph.output.extend([helper.make_tensor_value_info(n, F, None) for n in ("z", "xy")])
    matches_onnxruntime(m, [feed(0, 1, 5), feed(0, 3, 8)], exact=True)


def test_constant_lengths_rank_two():
    matches_onnxruntime(model(0, 1, lens="constant", extra_dims=()),
                        [feed(1, 2, 3, extra=()), feed(1, 2, 6, extra=())], exact=True)


@pytest.mark.parametrize("batch_axis,time_axis", [(0, 0), (2, 0), (1, 1)])
def test_bad_axes_are_one_line(batch_axis, time_axis):
    refused_in_one_line(model(batch_axis, time_axis), rf"^ONNX node 'reverse' \(ReverseSequence\): batch_axis = "
                        rf"{batch_axis} and time_axis = {time_axis}: one must be 0, the other 1$")


def test_lengths_longer_than_the_time_axis_are_refused():
    compiled = matches_onnxruntime(model(), [feed(0, 2, 4, [3, 4])])
    with pytest.raises(TvmseqError, match=r"sequence_lens of ReverseSequence node 'reverse'.*\[0, 4\]"):
        compiled(**feed(0, 2, 4, [5, 1]))
