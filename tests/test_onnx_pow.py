"""ONNX Pow (tvmseq.onnx.shape_ops.Pow): the result in the base's type whatever the exponent's (TVM's converter took
one type and floats only), x ** 2 as x * x, against onnx's backend node cases and onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tvmseq.onnx import from_onnx

ort = pytest.importorskip("onnxruntime")


def test_onnx_backend_pow_node_tests():
    """All twelve: float, broadcasts, and every mixed type pair (int base with float exponent, float base with an
    integer one, integer with integer)."""
    import onnx.backend.test.case.node.pow  # noqa: F401 - generates the cases on import
    from onnx.backend.test.case.node import _NodeTestCases
    from onnx.backend.test.runner import Runner

    from tvmseq.onnx.backend import TvmseqBackend

    cases = [c for c in _NodeTestCases if c.name.startswith("test_pow")]
    assert len(cases) >= 12 and any(c.name == "test_pow_types_int64_float32" for c in cases)
    for case in cases:
        rep = TvmseqBackend.prepare(case.model, "CPU")
        for inputs, ref_outputs in case.data_sets:
            Runner.assert_similar_outputs(ref_outputs, rep.run(inputs), rtol=case.rtol, atol=case.atol)


@pytest.mark.parametrize("exponent,squared", [(np.float32(2), True), (np.array([2.0], np.float32), True),
                                              (np.int64(2), True), (np.float32(3), False),
                                              (np.array([2.0, 2.0], np.float32), False)])
def test_square_is_a_multiply(exponent, squared):
    """A constant exponent of one element equal to 2 gives x * x (no powf a value), bit for bit onnxruntime's."""
    graph = helper.make_graph([helper.make_node("Pow", ["x", "e"], ["y"])], "pow",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "n", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.asarray(exponent), "e")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    text = from_onnx(model, target="llvm").script()
    assert ("R.power" not in text) == squared
    compiled = tvmseq.compile_onnx(model, target="llvm")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 5, 2)).astype(np.float32) * 10
    want = session.run(None, {"x": x})[0]
    if squared:
        np.testing.assert_array_equal(compiled(x=x), want)
    else:
        np.testing.assert_allclose(compiled(x=x), want, rtol=1e-6)
