"""The whole-model blocks of tests/blocks.py on the CPU (target llvm) against onnxruntime, and TVM's CUDA
schedule of the depthwise 1x1 Conv run on the CPU (stock: bias added twice; tvmseq's route: exact)."""
from __future__ import annotations

import numpy as np
import pytest

import blocks


@pytest.mark.parametrize("name", list(blocks.BLOCKS))
def test_block_matches_onnxruntime_on_cpu(name):
    from tvmseq.build import compile_onnx

    why = blocks.needs(name)
    if why:
        pytest.skip(why)
    model, feeds = blocks.BLOCKS[name]()
    compiled = compile_onnx(model, target="llvm")
    blocks.assert_close(compiled.named(compiled(feeds)), blocks.onnxruntime_outputs(model, feeds), name)


def test_stock_depthwise_1x1_cuda_schedule_is_wrong_and_the_route_is_exact():
    model, feeds = blocks.depthwise_1x1()
    want = blocks.onnxruntime_outputs(model, feeds)["Y"]
    bias = np.abs([np.frombuffer(i.raw_data, np.float32) for i in model.graph.initializer if i.name == "B"][0])
    stock = blocks.emulate_cuda_schedule(model, feeds, stock_conv=True)
    # TVM's CUDA schedule computes x*w + 2*bias: off by exactly |bias| of each channel
    np.testing.assert_allclose(np.abs(stock - want).max(axis=(0, 2, 3)), bias, rtol=1e-5)
    routed = blocks.emulate_cuda_schedule(model, feeds)
    np.testing.assert_allclose(routed, want, **blocks.TOL)


@pytest.mark.parametrize("name", ["depthwise_1x1", "depthwise_conv1d", "grouped_conv1d", "depthwise_conv2d_time"])
def test_conv_blocks_build_for_cuda(name):
    """Blocks TVM's CUDA pipeline got wrong or could not build (notes/tvm_depthwise_conv_cuda.md) build."""
    from tvmseq.build import compile_onnx

    model, _ = blocks.BLOCKS[name]()
    compiled = compile_onnx(model, target="cuda")
    source = compiled.executable.mod.imports[0].imports[0].inspect_source() \
        if compiled.executable.mod.imports and compiled.executable.mod.imports[0].imports else ""
    assert "__global__" in source
