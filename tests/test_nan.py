"""NaN in, NaN out where onnxruntime gives NaN: Relu (TVM's max(x, 0) lowers to LLVM's maxnum, which returned 0),
the CPU's rational Sigmoid / Tanh (their clamps were min / max: NaN became 1), onnxruntime's FusedConv with Relu,
and the activations that already kept it."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tests.ort_compare import matches_onnxruntime

ort = pytest.importorskip("onnxruntime")

X = np.array([[np.nan, -1.5, 0.0, 0.5], [2.0, np.nan, -np.inf, np.inf]], np.float32)


@pytest.mark.parametrize("op,attrs", [("Relu", {}), ("Sigmoid", {}), ("Tanh", {}), ("LeakyRelu", {"alpha": 0.1}),
                                      ("Elu", {}), ("Softplus", {})])
def test_activation_keeps_nan(op, attrs):
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "nan",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    compiled = matches_onnxruntime(model, [{"x": X}])
    assert np.isnan(compiled(x=X)[0, 0])


def test_fused_conv_relu_keeps_nan():
    w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    node = helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft", kernel_shape=[1, 1],
                            activation="Relu")
    graph = helper.make_graph([node], "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    compiled = matches_onnxruntime(model, [{"x": X.reshape(1, 1, 2, 4)}])
    assert np.isnan(compiled(x=X.reshape(1, 1, 2, 4))[0, :, 0, 0]).all()
