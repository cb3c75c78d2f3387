"""tvmseq.schedule_cpu: the stock ops around tvmseq's kernels scheduled on llvm (matmul with an odd output
width, conv1d + BatchNorm + ReLU, elementwise), checked against onnxruntime; layer-norm style row sums (RowSums)
against a float64 numpy reference; the thread count."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tvmseq import schedule_cpu


def layer_norm_reference(x, gamma, beta, eps=1e-7):
    """dtln's normalization over the last axis, in float64: (x - mean) / sqrt(mean((x - mean)^2) + eps)."""
    x = x.astype(np.float64)
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + eps) * gamma + beta


def _model(nodes, x_shape, y_shape, inits):
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _linear(rows, features, out, act, seed=0):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("MatMul", ["X", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node(act, ["a"], ["Y"])]
    return _model(nodes, [rows, 1, features], [rows, 1, out],
                  {"w": rng.standard_normal((features, out)) * 0.2, "b": rng.standard_normal(out)})


def _conv_bn_relu(channels, frames, seed=0):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["X", "w", "b"], ["c"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "bb", "mu", "var"], ["n"]),
             helper.make_node("Relu", ["n"], ["Y"])]
    inits = {"w": rng.standard_normal((channels, channels, 3)) * 0.2, "b": rng.standard_normal(channels),
             "s": rng.uniform(0.5, 1.5, channels), "bb": rng.standard_normal(channels),
             "mu": rng.standard_normal(channels) * 0.1, "var": rng.uniform(0.5, 1.5, channels)}
    return _model(nodes, [1, channels, frames], [1, channels, frames], inits)


CASES = {
    "linear_relu_width_48": (lambda: _linear(7, 37, 48, "Relu"), (7, 1, 37)),       # whole vectors
    "linear_sigmoid_width_41": (lambda: _linear(5, 33, 41, "Sigmoid"), (5, 1, 33)),  # padded to vectors
    "linear_dynamic_rows": (lambda: _linear("T", 20, 32, "Tanh"), (11, 1, 20)),      # symbolic rows
    "conv_bn_relu_odd_frames": (lambda: _conv_bn_relu(12, 19), (1, 12, 19)),         # conv, odd time axis
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scheduled_model_matches_onnxruntime(name):
    ort = pytest.importorskip("onnxruntime")
    make, shape = CASES[name]
    model = make()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    got = tvmseq.compile_onnx(model, target="llvm")(X=x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["linear_relu_width_48", "linear_sigmoid_width_41", "conv_bn_relu_odd_frames"])
def test_every_stock_function_gets_a_schedule(name):
    import tvm

    from tvmseq.tune.model import fused_module

    target = tvm.target.Target("llvm")
    fused = fused_module(tvmseq.from_onnx(CASES[name][0](), target="llvm"), target)
    with target:
        scheduled = schedule_cpu.schedule_pass()(fused)
    funcs = {gv.name_hint: f for gv, f in scheduled.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert funcs and all(f.attrs["tirx.is_scheduled"] for f in funcs.values()), sorted(funcs)
    text = "\n".join(f.script() for f in funcs.values())
    assert "T.vectorized" in text


def test_threads_honour_the_environment(monkeypatch):
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert schedule_cpu.configure_threads() == 3
    monkeypatch.setenv("TVM_NUM_THREADS", "5")
    assert schedule_cpu.configure_threads() == 5
    monkeypatch.delenv("TVM_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = schedule_cpu.configure_threads()
    import os

    assert cores == schedule_cpu.physical_cores() >= 1 and os.environ["TVM_NUM_THREADS"] == str(cores)


# ---------------------------------------------------------------------------------------------------
# Row sums (a layer norm's mean and variance over its last axis): RowSums, one vectorized pass a sum
# ---------------------------------------------------------------------------------------------------
def _layer_norm(shape, seed=0):
    """dtln's export of a layer norm: ReduceMean, Sub, Mul, ReduceMean, Add eps, Sqrt, Div, Mul, Add."""
    width = shape[-1]
    rng = np.random.default_rng(seed)
    eps = np.array(1e-7)
    nodes = [helper.make_node("ReduceMean", ["X"], ["m"], axes=[-1], keepdims=1),
             helper.make_node("Sub", ["X", "m"], ["c"]), helper.make_node("Mul", ["c", "c"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["c", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
             helper.make_node("Add", ["g", "beta"], ["Y"])]
    inits = {"eps": eps, "gamma": rng.uniform(0.5, 1.5, width), "beta": rng.standard_normal(width)}
    return _model(nodes, list(shape), None, inits), inits


# (model shape, runs): widths of whole vectors (rule applies), rows static, symbolic and none
NORM_CASES = {
    "dtln-1x1x256": ((1, 1, 256), [(1, 1, 256)]),
    "symbolic-rows-48": (("T", 48), [(1, 48), (7, 48), (33, 48)]),
    "batch-rows-3x5x32": (("B", 5, 32), [(3, 5, 32)]),
    "big-rows-parallel": ((2048, 64), [(2048, 64)]),
}


@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_layer_norm_matches_reference(name):
    shape, runs = NORM_CASES[name]
    model, inits = _layer_norm(shape)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    rng = np.random.default_rng(4)
    for run in runs:
        x = (rng.standard_normal(run) * 3 + 1).astype(np.float32)
        want = layer_norm_reference(x, inits["gamma"], inits["beta"])
        np.testing.assert_allclose(compiled(X=x), want, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {run}")


def _stock_functions(model):
    import tvm

    from tvmseq.tune.model import fused_module

    target = tvm.target.Target("llvm")
    fused = fused_module(tvmseq.from_onnx(model, target="llvm"), target)
    return target, [f for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_row_sums_take_the_norms(name):
    """Every function with a mean gets RowSums' schedule: partial sums in vector lanes (rfactor), no recomputed
    sum under the elements' loop, the output vectorized."""
    target, funcs = _stock_functions(_layer_norm(NORM_CASES[name][0])[0])
    sums = [f for f in funcs if "_red" in f.script()]
    assert sums
    for func in sums:
        sch = schedule_cpu.RowSums().apply(func, target, False)
        assert sch is not None
        text = sch.mod["main"].script()
        assert "_rf" in text and text.count("T.vectorized") >= 2, text
        with target:    # and the pass picks it (no rule before it takes the function)
            scheduled = schedule_cpu.schedule_func(func, target)
        assert scheduled.script() == sch.mod["main"].with_attr("tirx.is_scheduled", True).script()


def test_row_sums_decline_other_reductions():
    """A width of no whole vectors, a softmax (max is no sum) and a mean over a leading axis (not contiguous) are
    left to the other rules."""
    odd = _layer_norm(("T", 20))[0]
    softmax = _model([helper.make_node("Softmax", ["X"], ["Y"], axis=-1)], ["T", 64], None, {})
    leading = _model([helper.make_node("ReduceMean", ["X"], ["m"], axes=[0], keepdims=1),
                      helper.make_node("Sub", ["X", "m"], ["Y"])], ["T", 64], None, {})
    for model in (odd, softmax, leading):
        target, funcs = _stock_functions(model)
        assert all(schedule_cpu.RowSums().apply(f, target, False) is None for f in funcs)
