"""ONNX Slice with a start or end of +-INT64_MAX / INT64_MIN ("to the end", "flip") over an axis of
symbolic size (tvmseq.onnx.shape_ops.Slice): compiled with the axis left symbolic and checked against
onnxruntime at two sizes, values exactly. TVM's own converter keeps the literal in the extent and the
static memory planner overflows int64 on it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tvmseq
from tvmseq.onnx import from_onnx

ort = pytest.importorskip("onnxruntime")

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
SIZES = (5, 12)


def _slices(specs, if_branch=False):
    """x [3, n] -> a chain of Slice nodes, each (starts, ends, axes, steps); with if_branch the chain is
    the then branch of an If on the input `cond` (the else branch: x unchanged)."""
    nodes, inits, value = [], [], "x"
    for i, spec in enumerate(specs):
        names = [f"s{i}_{part}" for part in ("starts", "ends", "axes", "steps")]
        inits += [numpy_helper.from_array(np.array(v, np.int64), n) for v, n in zip(spec, names)]
        nodes.append(helper.make_node("Slice", [value, *names], [f"y{i}"], name=f"slice{i}"))
        value = f"y{i}"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "n"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])]
    if if_branch:
        then = helper.make_graph([*[helper.make_node("Constant", [], [t.name], value=t) for t in inits], *nodes,
                                  helper.make_node("Identity", [value], ["then_y"])],
                                 "then", [], [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, [None, None])])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["else_y"])], "else", [],
                                  [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, [None, None])])
        nodes, inits = [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], []
        inputs.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    else:
        nodes.append(helper.make_node("Identity", [value], ["y"]))
    graph = helper.make_graph(nodes, "slices", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


CASES = {
    "to_end": [([2], [INT64_MAX], [1], [1])],
    "negative_start_to_end": [([-3], [INT64_MAX], [-1], [1])],
    "whole_axis": [([0], [INT64_MAX], [1], [1])],
    "step2_to_end": [([1], [INT64_MAX], [1], [2])],
    "flip": [([-1], [-INT64_MAX], [-1], [-1])],              # torch.flip
    "flip_int64_min": [([INT64_MAX], [INT64_MIN], [1], [-1])],
    "step_minus2_from_3": [([3], [INT64_MIN], [1], [-2])],
    "step_minus3_from_minus2": [([-2], [-INT64_MAX], [1], [-3])],
    "from_before_start_backward": [([-INT64_MAX], [-INT64_MAX], [1], [-1])],   # x[0] only
    "backward_to_bounded_end": [([INT64_MAX], [1], [1], [-1])],
    "empty_forward": [([1], [-INT64_MAX], [1], [1])],
    "two_axes": [([0, -1], [2, -INT64_MAX], [0, 1], [1, -1])],
    # silero v4: a slice of a slice over the symbolic axis, flipped
    "slice_then_flip": [([-4], [-1], [1], [1]), ([-1], [-INT64_MAX], [1], [-1])],
}


@pytest.mark.parametrize("case", CASES)
def test_slice_to_int64_max_matches_onnxruntime(case):
    model = _slices(CASES[case])
    compiled = tvmseq.compile_onnx(model.SerializeToString(), target="llvm")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in SIZES:
        x = np.arange(3 * n, dtype=np.float32).reshape(3, n)
        want = session.run(None, {"x": x})[0]
        got = compiled(x=x)
        assert got.shape == want.shape, f"n={n}: {got.shape} != {want.shape}"
        np.testing.assert_array_equal(got, want)


def test_slice_extent_is_written_in_the_axis_size():
    """No INT64_MAX-derived literal in any shape: the flip of a slice keeps the slice's extent."""
    text = from_onnx(_slices(CASES["slice_then_flip"]).SerializeToString(), target="llvm").script()
    assert "922337203685477580" not in text
    assert "if_then_else" not in text


def test_flip_inside_if_branch():
    """A branch becomes a function of its own (importer._as_call): its slice types must copy."""
    model = _slices(CASES["slice_then_flip"], if_branch=True)
    compiled = tvmseq.compile_onnx(model.SerializeToString(), target="llvm")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n, cond in zip(SIZES, (True, False)):
        feeds = {"x": np.arange(3 * n, dtype=np.float32).reshape(3, n), "cond": np.array(cond)}
        np.testing.assert_array_equal(compiled(**feeds), session.run(None, feeds)[0])


def test_backward_from_inside_to_int64_max_is_empty():
    """Step < 0 with end INT64_MAX: the ONNX spec clamps the end to n - 1, so x[n-2:n-1:-1] is empty
    (onnx's reference implementation agrees; onnxruntime instead reads INT64_MAX as 'to the beginning')."""
    model = _slices([([-2], [INT64_MAX], [1], [-1])])
    compiled = tvmseq.compile_onnx(model.SerializeToString(), target="llvm")
    reference = ReferenceEvaluator(model)
    for n in SIZES:
        x = np.arange(3 * n, dtype=np.float32).reshape(3, n)
        want = reference.run(None, {"x": x})[0]
        assert want.shape == (3, 0)
        np.testing.assert_array_equal(compiled(x=x), want)


def _thirds_of_static_channels():
    """x [1, n, 48] -> q, k, v = three Slices of the channels, their bounds computed in the graph from the static
    dim of a shape whose other dims are symbolic (silero v3's attention: Shape -> Gather at [-1] -> Add 2 -> Div 3 -> Mul
    k: the 50 channels' thirds of 16 rounded up, the last one short)."""
    consts = {"last": np.array([-1], np.int64), "two": np.array(2, np.int64), "three": np.array(3, np.int64),
              "axis": np.array([2], np.int64), "c0": np.array([0], np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "last"], ["c"], axis=0),
             helper.make_node("Add", ["c", "two"], ["c_"]), helper.make_node("Div", ["c_", "three"], ["third"]),
             helper.make_node("Identity", ["third"], ["t1"]),
             helper.make_node("Mul", ["t1", "two_1"], ["t2"])]
    consts["two_1"] = np.array([2], np.int64)
    consts["three_1"] = np.array([3], np.int64)
    nodes.append(helper.make_node("Mul", ["t1", "three_1"], ["t3"]))
    for name, start, end in (("q", "c0", "t1"), ("k", "t1", "t2"), ("v", "t2", "t3")):
        nodes.append(helper.make_node("Slice", ["x", start, end, "axis"], [name], name=f"slice_{name}"))
    nodes.append(helper.make_node("Concat", ["v", "q", "k"], ["y"], axis=2))
    graph = helper.make_graph(nodes, "thirds", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", 50])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_bounds_computed_from_static_dims_are_constants():
    """Such bounds are constants at import: TVM's converter sent them to its dynamic slice, whose bound vectors
    are filled by scatter_elements, a TIR function without blocks that no GPU schedule takes (silero v3 did not
    build for CUDA). The ONNX-level folding is off: it folds these bounds where onnx's shape inference knows the
    dims, which in silero v3 it had lost (a Reshape to a target computed from a shape). Values against onnxruntime
    at two lengths."""
    model = _thirds_of_static_channels()
    text = from_onnx(model.SerializeToString(), target="llvm", fold=False).script()
    assert "dynamic_strided_slice" not in text and "scatter_elements" not in text
    compiled = tvmseq.compile_onnx(model.SerializeToString(), target="llvm", fold=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in SIZES:
        x = np.arange(50 * n, dtype=np.float32).reshape(1, n, 50)
        np.testing.assert_array_equal(compiled(x=x), session.run(None, {"x": x})[0])
