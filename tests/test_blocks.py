"""The whole-model blocks of tests/blocks.py on the CPU (target llvm) against onnxruntime, and CUDA schedules
run on the CPU (blocks.emulate_cuda_schedule): TVM's own where it is wrong (bias added twice), tvmseq's where
it routes around TVM's bugs (notes/tvm_depthwise_conv_cuda.md)."""
from __future__ import annotations

import numpy as np
import pytest

import blocks
import tvm
from tvm.script import relax as R, tirx as T


@pytest.mark.parametrize("name", list(blocks.BLOCKS))
def test_block_matches_onnxruntime_on_cpu(name):
    from tvmseq.build import compile_onnx

    why = blocks.needs(name)
    if why:
        pytest.skip(why)
    model, feeds = blocks.BLOCKS[name]()
    compiled = compile_onnx(model, target="llvm")
    blocks.assert_close(compiled.named(compiled(feeds)), blocks.onnxruntime_outputs(model, feeds), name)


def test_stock_depthwise_1x1_cuda_schedule_is_wrong_and_both_routes_are_exact():
    model, feeds = blocks.depthwise_1x1()
    want = blocks.onnxruntime_outputs(model, feeds)["Y"]
    bias = np.abs([np.frombuffer(i.raw_data, np.float32) for i in model.graph.initializer if i.name == "B"][0])
    stock = blocks.emulate_cuda_schedule(model, feeds, stock_schedule=True, stock_conv=True)
    # TVM's CUDA schedule computes x*w + 2*bias: off by exactly |bias| of each channel
    np.testing.assert_allclose(np.abs(stock - want).max(axis=(0, 2, 3)), bias, rtol=1e-5)
    # tvmseq's Conv conversion (no reduction left), and TVM's conversion under tvmseq's schedule step
    # (the unit reduction folded into a spatial block before dlight)
    for options in ({}, {"stock_conv": True}):
        np.testing.assert_allclose(blocks.emulate_cuda_schedule(model, feeds, **options), want, **blocks.TOL)


def test_stock_cuda_schedule_of_a_matmul_with_k_1_is_wrong_and_tvmseqs_is_exact():
    model, feeds = blocks.linear_one_feature()
    want = blocks.onnxruntime_outputs(model, feeds)["Y"]
    bias = np.abs([np.frombuffer(i.raw_data, np.float32) for i in model.graph.initializer if i.name == "B"][0])
    stock = blocks.emulate_cuda_schedule(model, feeds, stock_schedule=True)
    np.testing.assert_allclose(np.abs(stock - want).max(axis=(0, 1)), bias, rtol=1e-5)
    np.testing.assert_allclose(blocks.emulate_cuda_schedule(model, feeds), want, **blocks.TOL)


def _grouped_conv_two_channels_a_group():
    """Conv 6 -> 6 channels in 3 groups, kernel 3: TVM's Reduction rule's schedule fails in
    LowerCrossThreadReduction (tvmseq's importer splits groups; this is TVM's conversion)."""
    return blocks._conv("Conv", [1, 6, 11], [6, 2, 3], [1, 6, 11], seed=19, group=3, kernel_shape=[3])


# model, importer options, the dlight rule that fails on it in TVM's pipeline (raises, or does not lower)
ROUTED = {"dilated_conv1d": (blocks.dilated_conv1d, {}, "Matmul"),
          "if_block": (blocks.if_block, {}, "Reduction"),
          "depthwise_conv_transpose1d": (blocks.depthwise_conv_transpose1d, {}, "GEMV"),
          "depthwise_conv1d_stock_conv": (blocks.depthwise_conv1d, {"stock_conv": True}, "GEMV"),
          "grouped_conv_stock_conv": (_grouped_conv_two_channels_a_group, {"stock_conv": True}, "Reduction")}


@pytest.mark.parametrize("case", list(ROUTED))
def test_cuda_schedule_routed_around_a_failing_dlight_rule_is_exact(case, caplog, monkeypatch):
    """tvmseq.schedule_gpu takes the next rule where TVM's fails; what that schedule computes, run on the CPU."""
    from tvmseq import schedule_gpu

    # these blocks are small reductions, which tvmseq's SmallReduction takes before any dlight rule (the test
    # below): off here, so that dlight's rule runs, fails and is routed around
    monkeypatch.setattr(schedule_gpu.SmallReduction, "MAX_PRODUCTS", 0)
    make, options, rule = ROUTED[case]
    model, feeds = make()
    runs = [feeds]
    if case == "if_block":          # both branches: mean(X) > 0 and mean(-X) < 0
        runs.append({"X": -feeds["X"]})
    with caplog.at_level("DEBUG", logger="tvmseq.schedule_gpu"):
        for run in runs:
            want = blocks.onnxruntime_outputs(model, run)["Y"]
            np.testing.assert_allclose(blocks.emulate_cuda_schedule(model, run, **options), want, **blocks.TOL)
    assert f"dlight {rule}" in caplog.text        # the route was taken


@pytest.mark.parametrize("case", [c for c in ROUTED if c != "dilated_conv1d"])   # its time axis is the run-time one
def test_small_reduction_rule_takes_the_blocks_dlight_failed_on(case, caplog):
    """The same blocks scheduled as they are by default: one thread an output (SmallReduction), exact."""
    make, options, _ = ROUTED[case]
    model, feeds = make()
    with caplog.at_level("DEBUG", logger="tvmseq.schedule_gpu"):
        want = blocks.onnxruntime_outputs(model, feeds)["Y"]
        np.testing.assert_allclose(blocks.emulate_cuda_schedule(model, feeds, **options), want, **blocks.TOL)
    assert "SmallReduction scheduled" in caplog.text
    assert "dlight" not in caplog.text


@pytest.mark.parametrize("name", ["depthwise_1x1", "depthwise_conv1d", "grouped_conv1d", "depthwise_conv2d_time",
                                  "dilated_conv1d", "if_block", "depthwise_conv_transpose1d", "matmul_integer"])
def test_blocks_tvm_could_not_build_build_for_cuda(name):
    """Blocks TVM's CUDA pipeline got wrong or could not build (notes/tvm_depthwise_conv_cuda.md) build."""
    from tvmseq.build import compile_onnx

    model, _ = blocks.BLOCKS[name]()
    compiled = compile_onnx(model, target="cuda")
    source = compiled.executable.mod.imports[0].imports[0].inspect_source() \
        if compiled.executable.mod.imports and compiled.executable.mod.imports[0].imports else ""
    assert "__global__" in source


def test_a_schedule_with_a_thread_local_buffer_of_symbolic_size_is_refused():
    """CUDA code generation refuses a thread-local buffer of symbolic size ("Can only handle constant size stack
    allocation"; dlight's Matmul rule made one for the int32 MatMulInteger of an int8 OCR model over its
    symbolic width): the schedule check says so, so schedule_gpu tries the next rule."""
    from tvm.script import tirx as T

    from tvmseq import schedule_gpu
    from tvmseq.targets import resolve

    @T.prim_func
    def copy_through_local(a: T.handle, b: T.handle):
        n = T.int64()
        A = T.match_buffer(a, (n,), "float32")
        B = T.match_buffer(b, (n,), "float32")
        for i in T.thread_binding(1, thread="blockIdx.x"):
            for j in T.thread_binding(32, thread="threadIdx.x"):
                tmp = T.alloc_buffer((n,), "float32", scope="local")
                for k in range(n):
                    tmp[k] = A[k] * T.float32(2)
                for k in range(n):
                    B[k] = tmp[k]

    why = schedule_gpu.lowering_error(copy_through_local.with_attr("tirx.is_scheduled", True), resolve("cuda"))
    assert why is not None and "symbolic size" in why, why


@tvm.script.ir_module
class ZerosOfSymbolicRows:
    """A batch padded to 4 rows the obvious Relax way (zeros of 4 - n rows, concat): dlight's Fallback raises on
    the zeros kernel; left unscheduled, it ran on the host against device memory and crashed the process on the
    H100 (notes/tvm_symbolic_concat_cuda.md)."""

    @R.function
    def main(x: R.Tensor(("t", "n", 5), "float32")):
        t = T.int64()
        n = T.int64()
        with R.dataflow():
            z = R.zeros(R.shape([t, 4 - n, 5]), "float32")
            c = R.concat([x, z], axis=1)
            p = R.match_cast(c, R.Tensor((t, 4, 5), "float32"))
            a = R.add(p, R.const(1, "float32"))
            R.output(a)
        return a


def test_every_stock_kernel_gets_a_gpu_schedule():
    """Where dlight's rules all fail, tvmseq's last resorts bind the loops to GPU threads: no PrimFunc is left
    for the host, and the schedule computes the right values."""
    from tvmseq import schedule_gpu, targets

    cuda = targets.resolve("cuda")
    with cuda:
        mod = tvm.transform.Sequential(schedule_gpu.legalize_passes(cuda))(ZerosOfSymbolicRows)
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert "blockIdx.x" in func.script(), gv.name_hint
    x = np.random.default_rng(0).standard_normal((6, 3, 5)).astype("float32")
    want = np.concatenate([x, np.zeros((6, 1, 5), "float32")], axis=1) + 1
    np.testing.assert_allclose(blocks.emulate_cuda_module(ZerosOfSymbolicRows, {"x": x}), want)
