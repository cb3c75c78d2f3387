"""NaN in, NaN out where onnxruntime gives NaN, from how the converters write Relu, Elu, Softplus and onnxruntime's
FusedConv with Relu: TVM's relu / maximum lower to LLVM's maxnum, which returns the number (Relu(NaN) was 0), and
Elu's exp(NaN) is a number on the CPU (its polynomial exp clamps its input)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ort_compare import matches_onnxruntime

ort = pytest.importorskip("onnxruntime")

X = np.array([[np.nan, -1.5, 0.0, 0.5], [2.0, np.nan, -np.inf, np.inf]], np.float32)


@pytest.mark.parametrize("op,attrs", [("Relu", {}), ("Elu", {}), ("Elu", {"alpha": 0.3}), ("Softplus", {})])
def test_activation_keeps_nan(op, attrs):
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "nan",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    compiled = matches_onnxruntime(model, [{"x": X}])       # NaN where onnxruntime has NaN, and nowhere else
    assert np.isnan(compiled(x=X)[0, 0])


def test_fused_conv_relu_keeps_nan():
    w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    node = helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft", kernel_shape=[1, 1],
                            activation="Relu")
    graph = helper.make_graph([node], "nan", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    compiled = matches_onnxruntime(model, [{"x": X.reshape(1, 1, 2, 4)}])
    assert np.isnan(compiled(x=X.reshape(1, 1, 2, 4))[0, :, 0, 0]).all()
