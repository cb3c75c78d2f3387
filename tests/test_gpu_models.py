"""Whole ONNX models through the importer's GPU paths, end to end: compiled HERE for the H100 (the importer
picks the persistent GRU/RNN, the per-step path with the tiled input projection, the pipelined row-split
GRU stack), exported with sm_90a SASS, and run THERE with TVM's runtime only, against onnxruntime's outputs
computed here.

    python tests/test_gpu_models.py out/gpu_models [names]  # here: models, .so files, feeds, expected outputs
    TVMSEQ_GPU_MODELS=out/gpu_models pytest -m gpu tests/test_gpu_models.py    # on the GPU machine

The CPU test below checks the case list itself: each case's path is what the importer picks for a GPU.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(os.environ.get("TVMSEQ_GPU_MODELS", Path(__file__).resolve().parents[1] / "out" / "gpu_models"))

# name -> (builder, kwargs, importer path expected on an H100)
CASES = {
    "gru_b8_h1024": ("rnn_node_model", dict(op="GRU", seq=40, batch=8, input_size=256, hidden=1024,
                                            linear_before_reset=1), "persistent"),
    "gru_bi_b4_h512_lbr0_lens": ("rnn_node_model", dict(op="GRU", seq=23, batch=4, input_size=100, hidden=512,
                                                        direction="bidirectional", linear_before_reset=0,
                                                        with_seq_lens=True, with_initial_h=True), "persistent"),
    "gru_b96_h512": ("rnn_node_model", dict(op="GRU", seq=20, batch=96, input_size=128, hidden=512,
                                            linear_before_reset=1), "per_step"),
    "gru_bi_b64_h256_lens": ("rnn_node_model", dict(op="GRU", seq=21, batch=64, input_size=80, hidden=256,
                                                    direction="bidirectional", linear_before_reset=1,
                                                    with_seq_lens=True), "persistent_mma"),   # fp32: FMA product
    "rnn_bi_b8_h256_lens": ("rnn_node_model", dict(op="RNN", seq=31, batch=8, input_size=64, hidden=256,
                                                   direction="bidirectional", with_seq_lens=True),
                            "persistent"),   # the SIMT engine, one pass of 8 columns (1.16 us; staged kernel 1.40)
    "rnn_bi_b67_h300_lens": ("rnn_node_model", dict(op="RNN", seq=17, batch=67, input_size=40, hidden=300,
                                                    direction="bidirectional", with_seq_lens=True), "per_step"),
    "gru_stack_4x512_b8": ("gru_stack_model", dict(layers=4, seq=30, batch=8, input_size=64, hidden=512),
                           "pipelined"),
    # float16: tensor-core projection (flat rows) + tensor-core persistent recurrence; onnxruntime's CPU GRU/RNN
    # has no float16 kernel, so the expected outputs are its float32 run of the same (fp16-valued) weights
    "gru_fp16_b64_h1024": ("rnn_node_model", dict(op="GRU", seq=20, batch=64, input_size=256, hidden=1024,
                                                  linear_before_reset=1, dtype="float16"), "persistent_mma"),
    "rnn_fp16_bi_b32_h512_lens": ("rnn_node_model", dict(op="RNN", seq=17, batch=32, input_size=96, hidden=512,
                                                         direction="bidirectional", with_seq_lens=True,
                                                         with_initial_h=True, dtype="float16"), "persistent_mma"),
    "gru_fp16_bi_b8_h256_lens": ("rnn_node_model", dict(op="GRU", seq=25, batch=8, input_size=48, hidden=256,
                                                        direction="bidirectional", linear_before_reset=1,
                                                        with_seq_lens=True, with_initial_h=True, dtype="float16"),
                                 "persistent_mma"),   # batch 8 routed by the database (dsmem)
    "gru_fp16_bi_b130_h256_lens": ("rnn_node_model", dict(op="GRU", seq=19, batch=130, input_size=72, hidden=256,
                                                          direction="bidirectional", linear_before_reset=1,
                                                          with_seq_lens=True, with_initial_h=True, dtype="float16"),
                                   "persistent_wgmma"),
}
TOL = {"float32": dict(rtol=1e-3, atol=1e-4), "float16": dict(rtol=1e-2, atol=5e-3)}


def _model(name):
    from tvmseq import models

    builder, kwargs, _ = CASES[name]
    kwargs = dict(kwargs)
    if builder == "rnn_node_model":
        kwargs["weight_scale"] = kwargs["hidden"] ** -0.5   # a non-chaotic recurrence: fp32 can match it
    return getattr(models, builder)(**kwargs)


def _path_on_h100(name) -> str:
    from tvmseq.kernels.recurrent import paths
    from tvmseq.onnx import stack
    from tvmseq.targets import resolve

    builder, kw, _ = CASES[name]
    cuda = resolve("cuda")
    if builder == "gru_stack_model":
        return "pipelined" if stack.pipelined(kw["layers"], kw["batch"], kw["hidden"], "float32", cuda, "auto") \
            else "layer_by_layer"
    D = 2 if kw.get("direction") == "bidirectional" else 1
    cell = "rnn" if kw["op"] == "RNN" else "gru"
    return paths.choose_path(D, kw["batch"], kw["hidden"], kw.get("dtype", "float32"), cuda, cell=cell,
                             lbr=kw.get("linear_before_reset", 0))[0]


def _float32_twin(model, feeds):
    """The model with every float16 initializer, input and output as float32 (same values), and its feeds."""
    import onnx
    from onnx import numpy_helper

    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for init in twin.graph.initializer:
        if init.data_type == onnx.TensorProto.FLOAT16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    for value in list(twin.graph.input) + list(twin.graph.output):
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return twin, {k: (v.astype(np.float32) if v.dtype == np.float16 else v) for k, v in feeds.items()}


def build(out_dir, names=None) -> None:
    """Compile the cases (default all) for the H100 (sm_90a SASS embedded); store feeds + onnxruntime outputs."""
    import onnxruntime as ort

    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name in names or CASES:
        model, feeds = _model(name)
        ref_model, ref_feeds = _float32_twin(model, feeds)
        sess = ort.InferenceSession(ref_model.SerializeToString(), providers=["CPUExecutionProvider"])
        expected = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, ref_feeds)))
        with cuda_toolchain.device_binaries(("sm_90a",)):
            compiled = compile_onnx(model, target="cuda")
        export(compiled, out / f"{name}.so")
        np.savez(out / f"{name}.npz", **{f"in_{k}": v for k, v in feeds.items()},
                 **{f"out_{k}": v for k, v in expected.items()})
        index[name] = {"path": _path_on_h100(name), "inputs": list(feeds), "outputs": list(expected),
                       "dtype": CASES[name][1].get("dtype", "float32")}
        print(name, index[name]["path"], flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def test_cases_take_the_paths_they_name():
    pytest.importorskip("tvm.script")
    for name, (_, _, path) in CASES.items():
        assert _path_on_h100(name) == path, name


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_model_on_gpu_matches_onnxruntime(name):
    from tvmseq.runtime import load_model

    if not (ROOT / f"{name}.so").exists():
        pytest.skip(f"no prebuilt model in {ROOT} (python tests/test_gpu_models.py {ROOT})")
    data = np.load(ROOT / f"{name}.npz")
    index = json.loads((ROOT / "index.json").read_text())[name]
    model = load_model(ROOT / f"{name}.so")
    feeds = {k: data[f"in_{k}"] for k in index["inputs"]}
    for launch in range(2):   # twice: a persistent kernel must not see the first launch's flags
        got = model(**feeds)
        got = got if isinstance(got, tuple) else (got,)
        for out_name, value in zip(index["outputs"], got):
            want = data[f"out_{out_name}"]
            np.testing.assert_allclose(np.asarray(value, np.float64), want, **TOL[index.get("dtype", "float32")],
                                       err_msg=f"{name} ({index['path']}) output {out_name}, launch {launch}")


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else ROOT, sys.argv[2:] or None)
