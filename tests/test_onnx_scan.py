"""ONNX Scan (opset 9+; tvmseq.onnx.scan rewrites it as a Loop) against onnx's backend node cases and onnxruntime:
an RNN written as a Scan (h' = tanh(x_t W + h U)) over a run-time length, scan inputs along other axes and
reversed, scan outputs reversed and along other axes, several states and scan inputs."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ort_compare import matches_onnxruntime, refused_in_one_line

ort = pytest.importorskip("onnxruntime")


def _scan_rnn(in_axes, in_dirs, out_axes, out_dirs, hidden=5, features=3):
    """x [batch 2, T, features] (or [T, 2, features] with axis 0), a second scan input `g` [T] of gates: per step
    h' = tanh(x_t W + h U) * g_t, outputs the final h, and every h' and x_t W as scan outputs."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(np.float32) * 0.5, "w")
    u = numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32) * 0.5, "u")
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "w"], ["xw"]), helper.make_node("MatMul", ["h_in", "u"], ["hu"]),
         helper.make_node("Add", ["xw", "hu"], ["pre"]), helper.make_node("Tanh", ["pre"], ["act"]),
         helper.make_node("Mul", ["act", "g_t"], ["h_out"]), helper.make_node("Identity", ["h_out"], ["y_t"])],
        "rnn", [helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, hidden]),
                helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [2, features]),
                helper.make_tensor_value_info("g_t", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, hidden]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, [2, hidden]),
         helper.make_tensor_value_info("xw", TensorProto.FLOAT, [2, hidden])])
    node = helper.make_node("Scan", ["h0", "x", "g"], ["h", "ys", "xws"], name="scan", body=body, num_scan_inputs=2,
                            scan_input_axes=in_axes, scan_input_directions=in_dirs, scan_output_axes=out_axes,
                            scan_output_directions=out_dirs)
    x_shape = [2, "T", features] if in_axes[0] == 1 else ["T", 2, features]
    graph = helper.make_graph([node], "scan_rnn",
                              [helper.make_tensor_value_info("h0", TensorProto.FLOAT, [2, hidden]),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
                               helper.make_tensor_value_info("g", TensorProto.FLOAT, ["T"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("h", "ys", "xws")],
                              initializer=[w, u])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("in_axes,in_dirs,out_axes,out_dirs", [
    ([0, 0], [0, 0], [0, 0], [0, 0]),
    ([1, 0], [0, 0], [1, 0], [0, 0]),          # batch-first x, its outputs batch-first too
    ([1, 0], [1, 1], [0, 1], [1, 0]),          # a reverse scan (a bidirectional RNN's backward half)
    ([0, -1], [1, 0], [-2, 2], [0, 1]),        # negative axes
])
def test_scan_rnn_matches_onnxruntime(in_axes, in_dirs, out_axes, out_dirs):
    model = _scan_rnn(in_axes, in_dirs, out_axes, out_dirs)
    feeds = []
    for steps in (1, 4, 9):
        rng = np.random.default_rng(steps)
        x_shape = (2, steps, 3) if in_axes[0] == 1 else (steps, 2, 3)
        feeds.append({"h0": rng.standard_normal((2, 5)).astype(np.float32),
                      "x": rng.standard_normal(x_shape).astype(np.float32),
                      "g": rng.uniform(0.5, 1.0, steps).astype(np.float32)})
    matches_onnxruntime(model, feeds)


def test_onnx_backend_scan_node_tests():
    """onnx's Scan cases of opset 9 and later (test_scan_sum is opset 8's form: refused, below)."""
    import onnx.backend.test.case.node.scan  # noqa: F401 - generates the cases on import
    from onnx.backend.test.case.node import _NodeTestCases
    from onnx.backend.test.runner import Runner

    from tvmseq.onnx.backend import TvmseqBackend

    cases = [c for c in _NodeTestCases if c.name.startswith("test_scan9")]
    assert {"test_scan9_sum", "test_scan9_multi_state"} <= {c.name for c in cases}
    for case in cases:
        rep = TvmseqBackend.prepare(case.model, "CPU")
        for inputs, ref_outputs in case.data_sets:
            Runner.assert_similar_outputs(ref_outputs, rep.run(inputs), rtol=case.rtol, atol=case.atol)


def test_scan_of_opset_8_is_one_line():
    import onnx.backend.test.case.node.scan  # noqa: F401
    from onnx.backend.test.case.node import _NodeTestCases

    (case,) = [c for c in _NodeTestCases if c.name == "test_scan_sum"]
    refused_in_one_line(case.model, r"\(Scan\): Scan of opset 8 .* is not supported")


def _scan_of_unknown_rank(along: str):
    """A Scan named 'scan' summing rows into a state, where ONNX shape inference cannot tell a rank the rewrite needs:
    the scan input (`along` "input": taken along axis 1) or the body's scan output (`along` "output": stacked along
    axis 1) is a Reshape to a run-time shape of run-time length."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    body_nodes = [helper.make_node("Add", ["h_in", "x_t"], ["h_out"])]
    body_nodes.append(helper.make_node("Reshape", ["h_out", "shape"], ["y_t"]) if along == "output" else
                      helper.make_node("Identity", ["h_out"], ["y_t"]))
    body = helper.make_graph(body_nodes, "body", [helper.make_tensor_value_info("h_in", f, [3]),
                                                  helper.make_tensor_value_info("x_t", f, [3])],
                             [helper.make_tensor_value_info("h_out", f, [3]),
                              helper.make_tensor_value_info("y_t", f, None)])
    axes = {"scan_input_axes": [1]} if along == "input" else {"scan_output_axes": [1]}
    scan = helper.make_node("Scan", ["h0", "xs" if along == "input" else "x"], ["h", "ys"], name="scan", body=body,
                            num_scan_inputs=1, **axes)
    nodes = ([helper.make_node("Reshape", ["x", "shape"], ["xs"])] if along == "input" else []) + [scan]
    graph = helper.make_graph(nodes, "scan", [helper.make_tensor_value_info("h0", f, [3]),
                                              helper.make_tensor_value_info("x", f, ["T", 3]),
                                              helper.make_tensor_value_info("shape", i64, ["k"])],
                              [helper.make_tensor_value_info("h", f, None),
                               helper.make_tensor_value_info("ys", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("along,value", [("input", "xs"), ("output", "y_t")])
def test_a_scan_axis_of_a_value_of_unknown_rank_is_one_line(along, value):
    refused_in_one_line(_scan_of_unknown_rank(along), rf"^ONNX node 'scan' \(Scan\): a scan {along} axis needs the "
                        rf"rank of '{value}', which shape inference does not know$")
