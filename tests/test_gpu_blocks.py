"""The whole-model blocks of tests/blocks.py on the GPU, compiled HERE for the H100 and run THERE with TVM's
runtime only, against onnxruntime (CPU provider; run there when installed, else its outputs stored at build).

    python -m tests.blocks build out/blocks                                   # here (no GPU needed)
    TVMSEQ_BLOCKS_DIR=out/blocks pytest -m gpu tests/test_gpu_blocks.py -rxX  # on the GPU machine

`depthwise_1x1_stock` and `linear_one_feature_stock` are built as TVM's own pipeline builds them (tvmseq's Conv
route-around and checked dlight step off): expected to fail while TVM's CUDA pipeline adds the bias twice;
their failure messages carry the errors (for the upstream report).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import blocks

ROOT = Path(os.environ.get("TVMSEQ_BLOCKS_DIR", Path(__file__).resolve().parents[1] / "out" / "blocks"))
XFAIL = {"depthwise_1x1_stock": "TVM 0.27's CUDA pipeline adds the bias of a depthwise 1x1 Conv twice",
         "linear_one_feature_stock": "TVM 0.27's CUDA pipeline adds the bias of a MatMul with K = 1 twice"}


def _cases():
    return [pytest.param(name, marks=pytest.mark.xfail(reason=XFAIL[name], strict=True)) if name in XFAIL else name
            for name in blocks.all_cases()]


def _expected(name, index, data) -> dict:
    try:
        import onnx

        model = onnx.load(str(ROOT / f"{name}.onnx"))
        return blocks.onnxruntime_outputs(model, {k: data[f"in_{k}"] for k in index["inputs"]})
    except ImportError:     # no onnxruntime on this machine: its outputs computed where the model was built
        return {k: data[f"out_{k}"] for k in index["outputs"]}


@pytest.mark.gpu
@pytest.mark.parametrize("name", _cases())
def test_block_on_gpu_matches_onnxruntime(name):
    from tvmseq.runtime import load_model

    if not (ROOT / "index.json").exists():
        pytest.skip(f"no prebuilt blocks in {ROOT} (python -m tests.blocks build {ROOT})")
    index = json.loads((ROOT / "index.json").read_text()).get(name)
    if index is None:
        # (not blocks.needs(name): it imports tvmseq's importer, which the runtime-only GPU machine lacks)
        pytest.skip(f"{name} was not built here (the build's output says why)")
    assert "error" not in index, f"{name} did not build for CUDA: {index.get('error')}"
    data = np.load(ROOT / f"{name}.npz")
    want = _expected(name, index, data)
    model = load_model(ROOT / f"{name}.so")
    got = model.named(model({k: data[f"in_{k}"] for k in index["inputs"]}))
    errors = blocks.max_errors(got, want)
    print(f"{name}: max abs error {errors}")
    blocks.assert_close(got, want, f"{name} on {model.device} (max abs errors {errors})")
