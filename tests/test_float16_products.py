"""float16 MatMul / Gemm / Conv computed in float32 and rounded to float16 once: on the CPU against onnxruntime,
as onnxruntime's CPU provider computes them (it casts around the float16 ops it has no kernel for). Summed in float16,
long products drift by many units in the last place (a Keras mixed-precision CRNN, mk8dx-table-reader's number
recognition model: 0.05 on its logits, 4 to 13 units of the largest value on these products); now they agree to one
unit of the largest value (the two float32 sums, summed in other orders, round differently only near a float16
midpoint). Batch symbolic, two sizes. On CUDA the imported products are float32 too (cuBLAS / cuDNN accumulate float16
products in float32)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq

ort = pytest.importorskip("onnxruntime")
H = TensorProto.FLOAT16


def _model(op):
    rng = np.random.default_rng(7)
    if op == "Conv":
        x = helper.make_tensor_value_info("x", H, ["n", 64, 9, 7])
        inits = [numpy_helper.from_array((rng.standard_normal((16, 64, 3, 3)) / 24).astype(np.float16), "w"),
                 numpy_helper.from_array(rng.standard_normal(16).astype(np.float16), "b")]
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])
    else:
        x = helper.make_tensor_value_info("x", H, ["n", 1280])
        w = (rng.standard_normal((1280, 48) if op == "MatMul" else (48, 1280)) / 36).astype(np.float16)
        inits = [numpy_helper.from_array(w, "w")]
        if op == "Gemm":
            inits.append(numpy_helper.from_array(rng.standard_normal(48).astype(np.float16), "b"))
        node = helper.make_node("MatMul", ["x", "w"], ["y"]) if op == "MatMul" else \
            helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", H, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "Conv"])
def test_float16_products_are_summed_in_float32(op):
    model = _model(op)
    compiled = tvmseq.compile_onnx(model.SerializeToString(), target="llvm")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 5):
        shape = (n, 64, 9, 7) if op == "Conv" else (n, 1280)
        x = np.random.default_rng(n).standard_normal(shape).astype(np.float16)
        got, want = compiled(x=x), session.run(None, {"x": x})[0]
        assert got.dtype == want.dtype == np.float16 and got.shape == want.shape
        unit = float(np.spacing(np.abs(want).max()))        # float16's unit at the largest value
        off = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max()) / unit
        assert off <= 1, f"{op} n={n}: off by {off} units"          # summed in float16: 4 to 13 units here


@pytest.mark.parametrize("op", ["MatMul", "Conv"])
def test_float16_products_are_summed_in_float32_on_cuda(op):
    """The same rule on CUDA (cuBLAS / cuDNN accumulate float16 products in float32; TVM's ops sum in float16): the
    imported product is float32, its result rounded to float16 once (the GPU run is the mk8dx corpus model's)."""
    from tvmseq import targets
    from tvmseq.onnx import from_onnx

    mod = from_onnx(_model(op), target=targets.resolve("cuda"))
    bindings = [ln.strip() for ln in mod["main"].script().splitlines() if ": R.Tensor(" in ln and " = " in ln]
    assert bindings
    for line in bindings:       # every float16 value is the input's or a rounding of a float32 result
        annotation, value = line.split(" = ", 1)
        assert '"float16"' not in annotation or value.startswith("R.astype("), line
