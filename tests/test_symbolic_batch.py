"""GRU and RNN nodes whose batch (and time) axes are symbolic: imported with no --shape, compiled ONCE, run at
several batches and lengths, against onnxruntime (layout 0) or tvmseq.reference (layout 1: onnxruntime's CPU
provider does not implement it). The per-step kernels take the batch as a TIR variable; the CUDA build is
checked here, and its run on the GPU by loading modules built here:

    python tests/test_symbolic_batch.py out/symbatch          # here: .so files, feeds, expected outputs
    TVMSEQ_SYMBATCH_PREBUILT=out/symbatch pytest -m gpu tests/test_symbolic_batch.py   # on the GPU machine
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tvmseq
from tvmseq import TvmseqError, models, reference
from tvmseq.targets import resolve

ort = pytest.importorskip("onnxruntime")

FP32 = dict(rtol=1e-4, atol=1e-5)
PREBUILT = Path(os.environ.get("TVMSEQ_SYMBATCH_PREBUILT",
                               Path(__file__).resolve().parents[1] / "out" / "symbatch"))
INPUT, HIDDEN = 5, 7


def symbolic_batch(model: onnx.ModelProto, layout: int = 0) -> onnx.ModelProto:
    """The model with the batch axis of X, sequence_lens, initial_h, Y and Y_h renamed to the symbol 'N'."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    axis = {"X": 1, "initial_h": 1, "Y_h": 1, "Y": 2, "sequence_lens": 0} if layout == 0 else \
        {"X": 0, "initial_h": 0, "Y_h": 0, "Y": 0, "sequence_lens": 0}
    for value in list(out.graph.input) + list(out.graph.output):
        if value.name in axis:
            dim = value.type.tensor_type.shape.dim[axis[value.name]]
            dim.ClearField("dim_value")
            dim.dim_param = "N"
    return out


def node_model(op="GRU", layout=0, outputs=("Y", "Y_h"), **kw):
    model, _ = models.rnn_node_model(op, seq="T", batch=3, input_size=INPUT, hidden=HIDDEN, layout=layout,
                                     outputs=outputs, weight_scale=0.5, **kw)
    return symbolic_batch(model, layout)


def feeds_for(model, batch: int, steps: int, seed: int) -> dict:
    """Random inputs of the model at this batch and length (lengths in [0, steps], one full)."""
    rng = np.random.default_rng(seed)
    names = {i.name for i in model.graph.input}
    layout = next((a.i for a in model.graph.node[0].attribute if a.name == "layout"), 0)
    D = 2 if any(a.name == "direction" and a.s == b"bidirectional" for a in model.graph.node[0].attribute) else 1
    x_shape = (steps, batch, INPUT) if layout == 0 else (batch, steps, INPUT)
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    if "sequence_lens" in names:
        lens = rng.integers(0, steps + 1, batch).astype(np.int32)
        lens[0] = steps
        feeds["sequence_lens"] = lens
    if "initial_h" in names:
        feeds["initial_h"] = rng.standard_normal((D, batch, HIDDEN) if layout == 0 else (batch, D, HIDDEN)) \
            .astype(np.float32)
    return feeds


def expected(model, feeds, op, **attrs):
    """onnxruntime's outputs for layout 0, tvmseq.reference's for layout 1."""
    if attrs.get("layout", 0) == 0:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    fn = reference.gru if op == "GRU" else reference.rnn
    return fn(feeds["X"], w["W"], w["R"], w.get("B"), feeds.get("sequence_lens"), feeds.get("initial_h"), **attrs)


CASES = {
    "gru_lbr0": ("GRU", dict(linear_before_reset=0)),
    "gru_lbr1_lens": ("GRU", dict(linear_before_reset=1, with_seq_lens=True)),
    "gru_bi_lbr0_lens_h0": ("GRU", dict(direction="bidirectional", linear_before_reset=0, with_seq_lens=True,
                                        with_initial_h=True)),
    "gru_reverse_lbr1_layout1_h0": ("GRU", dict(direction="reverse", linear_before_reset=1, with_initial_h=True,
                                                layout=1)),
    "rnn_bi_lens_h0": ("RNN", dict(direction="bidirectional", with_seq_lens=True, with_initial_h=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_build_runs_every_batch_and_length(name):
    op, kw = CASES[name]
    model = node_model(op, **kw)
    compiled = tvmseq.compile_onnx(model, target="llvm")   # no shape_dict: batch and time stay symbolic
    assert compiled.signature["inputs"][0]["shape"][:2] == (["T", "N"] if kw.get("layout", 0) == 0 else ["N", "T"])
    attrs = {k: kw[k] for k in ("direction", "linear_before_reset", "layout") if k in kw}
    for batch in (1, 3, 5):
        for steps in (4, 9):
            feeds = feeds_for(model, batch, steps, seed=batch * 10 + steps)
            got = compiled(**feeds)
            for g, w, out in zip(got, expected(model, feeds, op, **attrs), ("Y", "Y_h")):
                np.testing.assert_allclose(g, w, **FP32, err_msg=f"{name} batch {batch} steps {steps} {out}")


@pytest.mark.parametrize("outputs", [("Y",), ("Y_h",)])
def test_optional_outputs(outputs):
    model = node_model("GRU", outputs=outputs, linear_before_reset=1)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    for batch in (2, 4):
        feeds = feeds_for(model, batch, 6, seed=batch)
        got = compiled(**feeds)
        got = got if isinstance(got, tuple) else (got,)
        want = expected(model, feeds, "GRU")
        assert len(got) == len(want) == 1
        np.testing.assert_allclose(got[0], want[0], **FP32)


def test_bad_inputs_are_refused_before_running():
    model = node_model("GRU", with_seq_lens=True, with_initial_h=True, linear_before_reset=1)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    feeds = feeds_for(model, 3, 5, seed=0)
    with pytest.raises(TvmseqError, match="sequence_lens"):
        compiled(**dict(feeds, sequence_lens=np.array([5, 6, 0], np.int32)))   # 6 > the 5 steps of X
    with pytest.raises(TvmseqError, match="dimension 'N'"):
        compiled(**dict(feeds, initial_h=np.zeros((1, 4, HIDDEN), np.float32)))   # batch 4 against X's 3


def test_persistent_path_needs_a_static_batch():
    model = node_model("GRU", linear_before_reset=1)
    with pytest.raises(TvmseqError, match=r"gru0.*static batch"):
        tvmseq.onnx.from_onnx(model, target="llvm", recurrence="persistent")


def test_gru_stack_with_symbolic_batch_runs_layer_by_layer():
    model, _ = models.gru_stack_model(2, seq="T", batch=2, input_size=4, hidden=6)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        axis = 0 if len(dims) == 2 else 1        # squeezed Y [T, N, H]: axis 1; initial_h / Y_h [1, N, H]: 1
        if len(dims) >= 2 and dims[axis].HasField("dim_value") and dims[axis].dim_value == 2:
            dims[axis].ClearField("dim_value")
            dims[axis].dim_param = "N"
    compiled = tvmseq.compile_onnx(model, target="llvm", gru_stack="on")   # the fused node must fall back
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for batch in (1, 3):
        feeds = {i.name: rng.standard_normal([batch if d.dim_param == "N" else 6 if d.dim_param == "T" else d.dim_value
                                              for d in i.type.tensor_type.shape.dim]).astype(np.float32)
                 for i in model.graph.input}
        for g, w in zip(compiled(**feeds), sess.run(None, feeds)):
            np.testing.assert_allclose(g, w, **FP32)


# ---- CUDA: built here, run on the GPU machine -----------------------------------------------------------
GPU_CASES = {
    "gru_bi_lbr1_lens": ("GRU", dict(direction="bidirectional", linear_before_reset=1, with_seq_lens=True,
                                     with_initial_h=True)),
    "gru_lbr0": ("GRU", dict(linear_before_reset=0)),
    "rnn_lens": ("RNN", dict(with_seq_lens=True)),
}
GPU_BATCHES, GPU_STEPS = (1, 3, 67), 11


def test_cuda_build_takes_the_per_step_kernels():
    """A symbolic batch builds for the H100 (no GPU needed): the per-step recurrence with a batch variable and
    the flat-rows projection; the persistent kernels (built for one batch) are not chosen."""
    pytest.importorskip("tvm.script")
    import tvm

    model = node_model("GRU", linear_before_reset=1, direction="bidirectional", with_seq_lens=True)
    from tvmseq.build import build_relax   # TVM's compiler: not where only its runtime is installed
    from tvmseq.onnx import from_onnx

    mod = from_onnx(model, target="cuda", artifacts=None)
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert "gru_recurrence" in names and "gru_input_projection_flat" in names, names
    rec = mod["gru_recurrence"]
    assert any(isinstance(v, tvm.tirx.Var) and v.name == "batch" for v in rec.params[0].ty.shape)   # gate_i
    exe = build_relax(mod, resolve("cuda"))
    sources, pending = [], [exe.mod]
    while pending:
        m = pending.pop()
        pending += list(m.imports)
        sources.append(m.inspect_source())
    src = next(s for s in sources if "__global__" in s)
    assert "batch" in src and "__shfl_down_sync" in src   # warp-per-row step GEMM over any batch


def build(out_dir) -> None:
    """Compile GPU_CASES for the H100 (sm_90a SASS embedded); store feeds and onnxruntime's outputs."""
    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, (op, kw) in GPU_CASES.items():
        model = node_model(op, **kw)
        with cuda_toolchain.device_binaries(("sm_90a",)):
            compiled = compile_onnx(model, target="cuda", artifacts=None)
        export(compiled, out / f"{name}.so")
        data = {}
        for batch in GPU_BATCHES:
            feeds = feeds_for(model, batch, GPU_STEPS, seed=batch)
            data.update({f"b{batch}_in_{k}": v for k, v in feeds.items()})
            data.update({f"b{batch}_out_{i}": v for i, v in enumerate(expected(model, feeds, op))})
        np.savez(out / f"{name}.npz", **data)
        print(name, flush=True)
    (out / "index.json").write_text(json.dumps(sorted(GPU_CASES), indent=1))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_prebuilt_symbolic_batch_on_gpu(name):
    from tvmseq.runtime import load_model

    if not (PREBUILT / f"{name}.so").exists():
        pytest.skip(f"no prebuilt module in {PREBUILT} (python tests/test_symbolic_batch.py {PREBUILT})")
    model = load_model(PREBUILT / f"{name}.so")
    data = np.load(PREBUILT / f"{name}.npz")
    for batch in GPU_BATCHES:
        feeds = {k.split("_in_", 1)[1]: data[k] for k in data.files if k.startswith(f"b{batch}_in_")}
        got = model(**feeds)
        for i, value in enumerate(got):
            np.testing.assert_allclose(value, data[f"b{batch}_out_{i}"], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name} batch {batch} output {i}")


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else PREBUILT)
