"""Softmax over the last axis on the CPU (`kernels.softmax.rows` through `tvmseq.cpu_ops`): the kernel against a
float64 numpy softmax at odd row lengths (vector tails, rows shorter than a vector's worth), and the Relax rewrite
in whole models against onnxruntime: taken for a float32 last axis of static length (symbolic leading axes kept),
left to TVM for another axis."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

from onnx import TensorProto, helper  # noqa: E402

import tvmseq  # noqa: E402
from tvmseq import cpu_ops  # noqa: E402
from tvmseq.kernels.softmax.rows import cpu_softmax_func  # noqa: E402
from tvmseq.targets import resolve  # noqa: E402


def softmax_reference(x, axis=-1):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("rows,columns", [(1, 9), (3, 37), (5, 16), (2, 6625), (7, 100)])
@pytest.mark.parametrize("parallel", [True, False])
def test_softmax_rows_kernel_matches_numpy(rows, columns, lanes, parallel):
    mod = tvm.compile(tvm.IRModule({"main": cpu_softmax_func(columns, lanes, parallel).with_attr(
        "global_symbol", "main")}), target=resolve("llvm"))
    x = (np.random.default_rng(rows * columns).standard_normal((rows, columns)) * 6).astype(np.float32)
    y = tvm.runtime.tensor(np.full_like(x, np.nan))
    mod["main"](tvm.runtime.tensor(x), y)
    np.testing.assert_allclose(y.numpy(), softmax_reference(x), rtol=2e-5, atol=1e-7)


def _softmax_model(shape, axis, opset=13, dtype=TensorProto.FLOAT):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    graph = helper.make_graph([node], "softmax", [helper.make_tensor_value_info("x", dtype, shape)],
                              [helper.make_tensor_value_info("y", dtype, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("shape,axis,feed,taken", [
    (["batch", "time", 6625], -1, (2, 5, 6625), True),      # PP-OCR's head: symbolic leading axes
    ([3, 37], 1, (3, 37), True),
    ([4, 37, 5], 1, (4, 37, 5), False),                       # not the last axis: TVM's softmax
])
def test_softmax_in_a_model_matches_onnxruntime(shape, axis, feed, taken):
    ort = pytest.importorskip("onnxruntime")
    model = _softmax_model(shape, axis)
    x = (np.random.default_rng(1).standard_normal(feed) * 4).astype(np.float32)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(compiled(x=x), want[0], rtol=2e-5, atol=1e-7)
    from tvmseq.build import kernel_calls

    assert any(name.startswith("softmax_rows") for name in kernel_calls(compiled)) == taken


def test_rewrite_leaves_float16_and_short_rows():
    """float16 and rows shorter than MIN_COLUMNS stay relax.nn.softmax (TVM legalizes them)."""
    from tvm import relax

    for dtype, columns in (("float16", 64), ("float32", cpu_ops.MIN_COLUMNS - 1)):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType([4, columns], dtype))
        with bb.function("main", [x]):
            with bb.dataflow():
                out = bb.emit_output(bb.emit(relax.op.nn.softmax(x, axis=-1)))
            bb.emit_func_output(out)
        mod = bb.get()
        assert cpu_ops.cpu_ops(mod) is mod
