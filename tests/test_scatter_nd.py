"""ONNX ScatterND on a GPU target: tvmseq's kernel with a thread an updated element (`kernels.scatter.scatter_nd`),
checked on the CPU: the kernel's serial variant against a numpy ScatterND, and the CUDA build's schedule run with
its thread bindings made serial (`blocks.emulate_cuda_module`) against onnxruntime."""
import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper

from tests import blocks
from tvmseq import targets
from tvmseq.kernels.scatter.scatter_nd import scatter_nd_func


def scatter_nd_reference(data, indices, updates):
    """numpy: ONNX ScatterND, reduction "none" (index tuples distinct)."""
    out = data.copy()
    for k in np.ndindex(indices.shape[:-1]):
        out[tuple(indices[k])] = updates[k]
    return out


def _distinct_indices(rng, data_shape, indices_shape, negative: bool = False):
    m = indices_shape[-1]
    flat = rng.choice(int(np.prod(data_shape[:m])), size=int(np.prod(indices_shape[:-1])), replace=False)
    idx = np.stack(np.unravel_index(flat, data_shape[:m]), -1).reshape(indices_shape).astype("int64")
    if negative:   # every other tuple written from the end: -d + i
        idx[..., ::2] -= np.array(data_shape[:m])[::2]
    return idx


CASES = [([2, 5, 7], [3, 3, 2]), ([1, 16, 16, 33], [1, 16, 2, 33, 4]), ([9], [4, 1]), ([3, 1, 1, 16], [1, 1]),
         ([5, 3, 37], [2, 1]), ([4, 6], [7, 2])]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64"])
@pytest.mark.parametrize("data_shape,indices_shape", CASES)
def test_kernel_matches_numpy(data_shape, indices_shape, dtype):
    rng = np.random.default_rng(len(data_shape) + indices_shape[0])
    data = (rng.standard_normal(data_shape) * 10).astype(dtype)
    idx = _distinct_indices(rng, data_shape, indices_shape)
    updates = (rng.standard_normal(indices_shape[:-1] + data_shape[indices_shape[-1]:]) * 10).astype(dtype)
    func = scatter_nd_func(data_shape, indices_shape, dtype, "int64", gpu=False)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    out = tvm.runtime.tensor(np.zeros(data_shape, dtype))
    lib["main"](*(tvm.runtime.tensor(a) for a in (data, idx, updates)), out)
    np.testing.assert_array_equal(out.numpy(), scatter_nd_reference(data, idx, updates))


def test_kernel_skips_index_tuples_outside_data():
    data = np.arange(12, dtype="float32").reshape(3, 4)
    idx = np.array([[0, 1], [3, 0], [2, 3]], "int64")     # row 3 is past the data: not written
    updates = np.array([-1, -2, -3], "float32")
    func = scatter_nd_func([3, 4], [3, 2], "float32", "int64", gpu=False)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    out = tvm.runtime.tensor(np.zeros((3, 4), "float32"))
    lib["main"](*(tvm.runtime.tensor(a) for a in (data, idx, updates)), out)
    want = data.copy()
    want[0, 1], want[2, 3] = -1, -3
    np.testing.assert_array_equal(out.numpy(), want)


def _scatter_model(data_shape, indices, updates_shape, opset: int, reduction: str | None = None):
    """ONNX: out = ScatterND(data, indices (a constant), updates), data and updates graph inputs."""
    attrs = {"reduction": reduction} if reduction else {}
    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], name="scatter", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, data_shape),
                      helper.make_tensor_value_info("updates", TensorProto.FLOAT, updates_shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, data_shape)],
        [onnx.numpy_helper.from_array(indices, "indices")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _cuda_functions(model):
    import tvmseq

    mod = tvmseq.from_onnx(model, target=targets.resolve("cuda"))
    return mod, [gv.name_hint for gv, _ in mod.functions_items()]


@pytest.mark.parametrize("opset", [11, 16, 18])
@pytest.mark.parametrize("data_shape,indices_shape,negative", [([1, 16, 6, 33], [1, 16, 2, 33, 4], False),
                                                               ([5, 3, 37], [2, 1], True), ([4, 6], [7, 2], True)])
def test_gpu_import_runs_the_parallel_kernel(data_shape, indices_shape, negative, opset):
    import onnxruntime as ort

    rng = np.random.default_rng(opset)
    idx = _distinct_indices(rng, data_shape, indices_shape, negative)
    updates_shape = indices_shape[:-1] + data_shape[indices_shape[-1]:]
    model = _scatter_model(data_shape, idx, updates_shape, opset)
    mod, names = _cuda_functions(model)
    assert "scatter_nd_parallel" in names
    feeds = {"data": rng.standard_normal(data_shape).astype("float32"),
             "updates": rng.standard_normal(updates_shape).astype("float32")}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(blocks.emulate_cuda_module(mod, feeds), want)


def test_reductions_and_the_cpu_keep_tvms_scatter():
    idx = np.array([[0], [2]], "int64")
    _, names = _cuda_functions(_scatter_model([3, 4], idx, [2, 4], 16, reduction="add"))
    assert "scatter_nd_parallel" not in names
    import tvmseq

    mod = tvmseq.from_onnx(_scatter_model([3, 4], idx, [2, 4], 16), target="llvm")
    assert "scatter_nd_parallel" not in [gv.name_hint for gv, _ in mod.functions_items()]
