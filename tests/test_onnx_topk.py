"""ONNX TopK through tvmseq's importer (tvmseq.onnx.topk) against onnxruntime, plus onnx's own
`test_top_k*` backend node tests through tvmseq.onnx.backend.TvmseqBackend (CPU, llvm).
Values and indices must match exactly (selection copies values)."""
from __future__ import annotations

import functools
import unittest
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq.onnx.topk  # noqa: F401  (registers the TopK converter)
from tvmseq.build import compile_onnx
from tvmseq.errors import TvmseqError, UnsupportedOnnxError
from tvmseq.onnx import from_onnx

ort = pytest.importorskip("onnxruntime")

ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
              "int32": TensorProto.INT32, "float64": TensorProto.DOUBLE}


def topk_model(shape, k, axis=-1, largest=None, sorted_=None, dtype="float32", k_mode="initializer",
               opset=11, batch_param=False):
    """One TopK node. k_mode: 'initializer', 'constant' (a Constant node), 'input' (graph input)."""
    dims = ["batch"] + list(shape[1:]) if batch_param else list(shape)
    inputs = [helper.make_tensor_value_info("x", ONNX_TYPES[dtype], dims)]
    nodes, inits, attrs = [], [], {"axis": axis}
    if largest is not None:
        attrs["largest"] = largest
    if sorted_ is not None:
        attrs["sorted"] = sorted_
    if opset == 1:
        attrs["k"] = k
        node_inputs = ["x"]
    else:
        node_inputs = ["x", "k"]
        k_arr = np.array([k], np.int64)
        if k_mode == "initializer":
            inits.append(numpy_helper.from_array(k_arr, "k"))
        elif k_mode == "constant":
            nodes.append(helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(k_arr)))
        else:
            inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    nodes.append(helper.make_node("TopK", node_inputs, ["values", "indices"], name="topk_node", **attrs))
    outputs = [helper.make_tensor_value_info("values", ONNX_TYPES[dtype], None),
               helper.make_tensor_value_info("indices", TensorProto.INT64, None)]
    graph = helper.make_graph(nodes, "topk", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def feeds_for(model, x, k):
    names = [i.name for i in model.graph.input]
    return {"x": x, **({"k": np.array([k], np.int64)} if "k" in names else {})}


def compare_with_onnxruntime(model, x, k):
    feeds = feeds_for(model, x, k)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = compile_onnx(model, target="llvm")(**feeds)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[0], want[0])
    return got


def random_input(shape, dtype, seed=0, ties=True):
    rng = np.random.default_rng(seed)
    if ties:
        return rng.integers(-4, 4, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape,k,axis,largest,dtype", [
    ((3, 50), 4, -1, 1, "float32"),
    ((3, 50, 5), 7, 1, 0, "float32"),  # inner axis: moved last and back
    ((2, 4, 301), 301, 2, 1, "float32"),  # k = axis size
    ((6, 1), 1, 1, 0, "float32"),  # axis of length 1
    ((4, 1000), 9, 1, 1, "float16"),
    ((5, 33), 3, 0, 0, "int64"),
])
def test_constant_k_matches_onnxruntime(shape, k, axis, largest, dtype):
    model = topk_model(shape, k, axis, largest, 1, dtype)
    compare_with_onnxruntime(model, random_input(shape, dtype, seed=k), k)


@pytest.mark.parametrize("shape,axis", [((3, 7), 1), ((3, 7, 2), 1)])
def test_k_zero_gives_empty_outputs(shape, axis):
    got = compare_with_onnxruntime(topk_model(shape, 0, axis, 1, 1), random_input(shape, "float32"), 0)
    assert got[0].shape[axis] == 0 and got[1].dtype == np.int64


@pytest.mark.parametrize("k_mode", ["constant", "input"])
def test_k_forms(k_mode):
    model = topk_model((4, 90), 6, 1, 1, None, k_mode=k_mode)
    compare_with_onnxruntime(model, random_input((4, 90), "float32", seed=1), 6)


@pytest.mark.parametrize("opset", [1, 10])
def test_older_opsets(opset):
    model = topk_model((4, 9), 2, 0, opset=opset)
    compare_with_onnxruntime(model, random_input((4, 9), "float32", seed=opset, ties=False), 2)


def test_runtime_k_and_symbolic_batch():
    """K a graph input: the output's last dimension follows it at run time; batch is symbolic."""
    model = topk_model((5, 30), 3, 1, 1, None, k_mode="input", batch_param=True)
    compiled = compile_onnx(model, target="llvm")
    for batch, k in [(5, 3), (2, 30), (7, 1), (3, 0)]:
        x = random_input((batch, 30), "float32", seed=batch)
        feeds = {"x": x, "k": np.array([k], np.int64)}
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        got = compiled(**feeds)
        assert got[0].shape == (batch, k)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])


def test_constant_k_with_symbolic_batch():
    model = topk_model((5, 300), 6, 1, 1, None, batch_param=True)
    compiled = compile_onnx(model, target="llvm")
    for batch in (1, 9):
        x = random_input((batch, 300), "float32", seed=batch)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        got = compiled(x=x)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[0], want[0])


def test_runtime_k_out_of_range_is_refused_before_running():
    compiled = compile_onnx(topk_model((2, 10), 3, 1, k_mode="input"), target="llvm")
    with pytest.raises(TvmseqError, match="K of TopK node 'topk_node'"):
        compiled(x=np.zeros((2, 10), "float32"), k=np.array([11], np.int64))
    with pytest.raises(TvmseqError, match="K of TopK node 'topk_node'"):
        compiled(x=np.zeros((2, 10), "float32"), k=np.array([-1], np.int64))


@pytest.mark.parametrize("model,match", [
    (topk_model((2, 10), 11, 1), "K = 11 is outside \\[0, 10\\]"),
    (topk_model((2, 10), 3, 2), "'axis' = 2 is out of range"),
    (topk_model((2, 10), 3, 1, largest=2), "'largest' = 2 must be 0 or 1"),
    (topk_model((2, 10), 3, 1, sorted_=5), "'sorted' = 5 must be 0 or 1"),
])
def test_invalid_nodes_name_the_node(model, match):
    with pytest.raises(UnsupportedOnnxError, match=match) as err:
        from_onnx(model, target="llvm")
    assert "topk_node" in str(err.value)


def test_symbolic_axis_is_refused():
    model = topk_model((5, 30), 3, 0, batch_param=True)
    with pytest.raises(UnsupportedOnnxError, match="symbolic size"):
        from_onnx(model, target="llvm")


# ------------------------------------------------------------------------- onnx backend node tests
@functools.lru_cache(maxsize=None)
def backend_top_k_tests():
    try:
        from tvmseq.onnx.backend import TvmseqBackend
    except ImportError as err:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason=f"tvmseq.onnx.backend missing: {err}"))]
    with warnings.catch_warnings():  # onnx's generators of other ops' data warn about inf/overflow
        warnings.simplefilter("ignore", RuntimeWarning)
        import onnx.backend.test

        suite = onnx.backend.test.BackendTest(TvmseqBackend, __name__)
    suite.include(r"test_top_k")
    cases = []
    for cls in suite.test_cases.values():
        cases += [pytest.param(cls, name, id=name) for name in sorted(dir(cls))
                  if name.startswith("test_top_k") and name.endswith("_cpu")]
    return cases


@pytest.mark.parametrize("case_cls,name", backend_top_k_tests())
def test_onnx_backend_top_k(case_cls, name):
    result = unittest.TestResult()
    case_cls(name).run(result)
    problems = result.errors + result.failures
    assert not problems, problems[0][1]
    assert not result.skipped, result.skipped
    assert result.testsRun == 1


def test_backend_suite_has_the_top_k_cases():
    names = [p.id for p in backend_top_k_tests()]
    assert {"test_top_k_cpu", "test_top_k_smallest_cpu", "test_top_k_uint64_cpu",
            "test_top_k_same_values_2d_cpu"} <= set(names), names
