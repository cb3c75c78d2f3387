"""GRU, RNN and LSTM nodes whose batch (and time) axes are symbolic: imported with no --shape, compiled ONCE, run at
several batches and lengths, against onnxruntime (layout 0) or tvmseq.reference (layout 1: onnxruntime's CPU
provider does not implement it). The per-step kernels take the batch as a TIR variable; on CUDA the node dispatches
on the batch at run time (`tvmseq.onnx.batch_dispatch`: the persistent kernels of batch buckets, the per-step ones
above). The CUDA build and its IR are checked here, and its run on the GPU by loading modules built here:

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
    """The model with the batch axis of X, sequence_lens, initial_h/c, Y and Y_h/c renamed to the symbol 'N'."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    axis = {"X": 1, "initial_h": 1, "initial_c": 1, "Y_h": 1, "Y_c": 1, "Y": 2, "sequence_lens": 0} if layout == 0 \
        else {"X": 0, "initial_h": 0, "initial_c": 0, "Y_h": 0, "Y_c": 0, "Y": 0, "sequence_lens": 0}
    for value in list(out.graph.input) + list(out.graph.output):
        if value.name in axis:
            dim = value.type.tensor_type.shape.dim[axis[value.name]]
            dim.ClearField("dim_value")
            dim.dim_param = "N"
    return out


def node_model(op="GRU", layout=0, outputs=("Y", "Y_h"), **kw):
    if op == "LSTM":
        from test_lstm_reference import lstm_node_model

        model, _, _ = lstm_node_model(seq="T", batch=3, input_size=INPUT, hidden=HIDDEN, layout=layout,
                                      outputs=outputs if len(outputs) > 2 else ("Y", "Y_h", "Y_c"), **kw)
        return symbolic_batch(model, layout)
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
    for state in ("initial_h", "initial_c"):
        if state in names:
            feeds[state] = rng.standard_normal((D, batch, HIDDEN) if layout == 0 else (batch, D, HIDDEN)) \
                .astype(np.float32)
    return feeds


def expected(model, feeds, op, **attrs):
    """onnxruntime's outputs for layout 0, tvmseq.reference's for layout 1."""
    if attrs.get("layout", 0) == 0 or op == "LSTM":
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
    from tvmseq.onnx import from_onnx   # the attribute tvmseq.onnx exists only once the submodule is imported

    model = node_model("GRU", linear_before_reset=1)
    with pytest.raises(TvmseqError, match=r"gru0.*static batch"):
        from_onnx(model, target="llvm", recurrence="persistent")


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
    "lstm_bi_lens_h0_c0": ("LSTM", dict(direction="bidirectional", with_seq_lens=True, with_initial_h=True,
                                        with_initial_c=True)),
}
# the batch dispatch: bucket 1, odd batches padded up (3 -> 4, 19 -> 32), a bucket's own size, and (added by
# `build`) one above the largest bucket, which runs the per-step kernels
GPU_BATCHES, GPU_STEPS = (1, 3, 8, 19), 11


def test_cuda_build_takes_the_per_step_kernels_with_the_dispatch_off():
    """batch_buckets='off': a symbolic batch builds for the H100 (no GPU needed) with the per-step recurrence for any
    batch and the flat-rows projection only; no persistent kernel, no dispatch."""
    pytest.importorskip("tvm.script")
    import tvm

    model = node_model("GRU", linear_before_reset=1, direction="bidirectional", with_seq_lens=True)
    from tvmseq.build import build_relax   # TVM's compiler: not where only its runtime is installed
    from tvmseq.onnx import from_onnx

    mod = from_onnx(model, target="cuda", artifacts=None, batch_buckets="off")
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert "gru_recurrence" in names and "gru_input_projection_flat" in names, names
    assert not [n for n in names if "dispatch" in n or "_b" in n.rsplit("recurrence", 1)[-1]], names
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


# ---- the run-time dispatch on the batch (tvmseq.onnx.batch_dispatch) ------------------------------------
H100 = "nvidia/nvidia-h100"
DISPATCH_CASES = {
    "GRU": dict(direction="bidirectional", linear_before_reset=1, with_seq_lens=True, with_initial_h=True),
    "RNN": dict(with_seq_lens=True),
    "LSTM": dict(direction="bidirectional", with_seq_lens=True, with_initial_h=True, with_initial_c=True),
}


def h100():
    import tvm

    return tvm.target.Target(H100, host="llvm")


def expected_plan(op, kw) -> dict:
    """{bucket: path} the node's chooser answers at each candidate bucket (per_step ones left out), asked here
    directly: paths.choose_path for GRU/RNN, paths.choose_lstm_path for LSTM."""
    from tvmseq.kernels.recurrent import paths
    from tvmseq.onnx import batch_dispatch

    D = 2 if kw.get("direction") == "bidirectional" else 1
    plan = {}
    for b in batch_dispatch.candidates("auto"):
        if op == "LSTM":
            path = paths.choose_lstm_path(D, b, HIDDEN, "float32", h100())[0]
        else:
            path = paths.choose_path(D, b, HIDDEN, "float32", h100(), None, op.lower(),
                                              kw.get("linear_before_reset", 1))[0]
        plan[b] = path
    return {b: p for b, p in plan.items() if p != "per_step"}


_IMPORTED: dict = {}


def dispatch_module(op):
    """The CUDA (H100) Relax module of DISPATCH_CASES[op], imported once per process."""
    from tvmseq.onnx import from_onnx

    if op not in _IMPORTED:
        _IMPORTED[op] = from_onnx(node_model(op, **DISPATCH_CASES[op]), target=h100(), artifacts=None,
                                  batch_buckets="auto")
    return _IMPORTED[op]


def _calls(func) -> set:
    """Names of the functions `func` (Relax) calls, call_tir's PrimFuncs included."""
    import tvm
    from tvm import relax

    names = set()

    def visit(expr):
        if isinstance(expr, relax.Call):
            if isinstance(expr.op, tvm.ir.GlobalVar):
                names.add(expr.op.name_hint)
            for arg in expr.args:
                if isinstance(arg, tvm.ir.GlobalVar):
                    names.add(arg.name_hint)

    relax.analysis.post_order_visit(func.body, visit)
    return names


@pytest.mark.parametrize("op", list(DISPATCH_CASES))
def test_cuda_module_dispatches_on_the_batch(op):
    """The H100 module of a symbolic-batch node: main calls <cell>_batch_dispatch, an If chain on the batch
    (N <= b for each bucket the chooser sends to a persistent kernel), each bucket a function of its own calling
    the persistent recurrence built for that static batch (the chooser's path, structurally the kernel the
    importer builds for a model of that batch), the rest the per-step recurrence for any batch."""
    import re

    import tvm
    import tvm_ffi
    from tvmseq.kernels.recurrent import gru as gru_k, lstm as lstm_k, rnn as rnn_k
    from tvmseq.onnx import batch_dispatch
    from tvmseq.onnx.gru import build_kernels
    from tvmseq.onnx.lstm import lstm_recurrence_for

    kw = DISPATCH_CASES[op]
    cell = op.lower()
    plan = expected_plan(op, kw)
    assert plan and max(plan) == max(batch_dispatch.candidates("auto")), plan   # H7: persistent up to the cap
    mod = dispatch_module(op)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert f"{cell}_batch_dispatch" in _calls(mod["main"])
    # one function per level of the If chain (each If's branches are single calls: TVM's memory planner)
    levels = sorted(n for n in names if n.startswith(f"{cell}_batch_dispatch"))
    conds = sorted(int(b) for n in levels for b in re.findall(r"if \w+ <= (\d+):", mod[n].script()))
    assert conds == sorted(plan), (conds, plan)
    assert len(levels) == len(plan)
    called = set().union(*(_calls(mod[n]) for n in levels)) - set(levels)
    assert called == {f"{cell}_b{b}" for b in plan} | {f"{cell}_any_batch"}
    assert {n for n in names if re.fullmatch(rf"{cell}_b\d+", n)} == {f"{cell}_b{b}" for b in plan}
    D = 2 if kw.get("direction") == "bidirectional" else 1
    for b, path in plan.items():
        assert path.startswith("persistent")
        rec_name = f"{cell}_recurrence_b{b}"
        assert rec_name in _calls(mod[f"{cell}_b{b}"])
        rec = mod[rec_name]
        assert [int(d) for d in rec.params[0].ty.shape[:1]] == [D] and int(rec.params[0].ty.shape[2]) == b  # gate_i
        if op == "LSTM":
            spec = lstm_k.LstmSpec(D, b, HIDDEN, INPUT, "float32", kw.get("direction", "forward"),
                                   tuple(mod_acts(op, D)), None, True, 0, False)
            want = lstm_recurrence_for(spec, h100(), path)
        else:
            spec = (gru_k.GruSpec(D, b, HIDDEN, INPUT, "float32", kw.get("linear_before_reset", 0),
                                  kw.get("direction", "forward"), tuple(mod_acts(op, D)), None, True)
                    if op == "GRU" else rnn_k.RnnSpec(D, b, HIDDEN, INPUT, "float32", kw.get("direction", "forward"),
                                                     tuple(mod_acts(op, D)), None, True))
            want = build_kernels(spec, str(h100()), path)
        assert want[1] == path
        assert tvm_ffi.structural_equal(rec, want[0].without_attr("global_symbol")), \
            f"{rec_name} is not the {path} kernel"
    per_step = mod[f"{cell}_recurrence"]
    assert f"{cell}_recurrence" in _calls(mod[f"{cell}_any_batch"])
    assert isinstance(per_step.params[0].ty.shape[2], tvm.tirx.Var)     # gate_i's batch: any


def mod_acts(op, D):
    from tvmseq.kernels.activations import Activation

    names = {"GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}[op]
    return [Activation.make(n) for n in names * D]


@pytest.mark.parametrize("op", list(DISPATCH_CASES))
def test_cuda_build_of_the_dispatch(op):
    """The dispatching module compiles for the H100 (here, without a GPU): the bucket kernels and the per-step
    ones in one device module."""
    from tvmseq.build import build_relax

    exe = build_relax(dispatch_module(op), h100())
    sources, pending = [], [exe.mod]
    while pending:
        m = pending.pop()
        pending += list(m.imports)
        sources.append(m.inspect_source())
    src = "\n".join(s for s in sources if "__global__" in s)
    cell = op.lower()
    for b in expected_plan(op, DISPATCH_CASES[op]):
        assert f"{cell}_recurrence_b{b}" in src, b
    assert "__shfl_down_sync" in src          # the per-step step GEMM (any batch)


def test_dispatch_options():
    """recurrence='per_step' and batch_buckets='off' turn the dispatch off; a list of buckets replaces the
    candidates (a bucket the chooser sends to per_step is left out); a bad value is a one-line error."""
    from tvmseq.onnx import batch_dispatch, from_onnx

    model = node_model("RNN", with_seq_lens=True)
    for options in (dict(recurrence="per_step"), dict(batch_buckets="off"), dict(batch_buckets=0)):
        names = {gv.name_hint for gv in from_onnx(model, target=h100(), artifacts=None, **options).get_global_vars()}
        assert "rnn_batch_dispatch" not in names and "rnn_recurrence" in names, (options, names)
    mod = from_onnx(model, target=h100(), artifacts=None, batch_buckets=[3, 8])
    assert {n for n in (gv.name_hint for gv in mod.get_global_vars()) if n.startswith("rnn_b")} == \
        {"rnn_b3", "rnn_b8", "rnn_batch_dispatch", "rnn_batch_dispatch_from_b8"}
    assert batch_dispatch.candidates(20) == [1, 2, 4, 8, 16]
    for bad in ("sometimes", [0, 4], 2.5, True):
        with pytest.raises(TvmseqError, match="batch_buckets"):
            batch_dispatch.candidates(bad)
    with pytest.raises(TvmseqError, match="batch_buckets"):
        from_onnx(model, target=h100(), artifacts=None, batch_buckets="sometimes")
    with pytest.raises(TvmseqError, match=r"rnn0.*static batch"):   # a forced persistent path: as before
        from_onnx(model, target=h100(), artifacts=None, recurrence="persistent")


def test_no_dispatch_where_the_batch_is_not_an_input_dim():
    """X [T, 2*N, I] (a Reshape of [T, N, 2, I]): the branches could not be functions of the node's tensors, so the
    node keeps the per-step kernels for any batch, and still imports for CUDA."""
    from onnx import TensorProto, helper

    from tvmseq.onnx import from_onnx

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("W", (1, 3 * HIDDEN, INPUT)), ("R", (1, 3 * HIDDEN, HIDDEN)))]
    inits.append(numpy_helper.from_array(np.array([0, -1, INPUT], np.int64), "shape"))
    nodes = [helper.make_node("Reshape", ["X0", "shape"], ["X"]),
             helper.make_node("GRU", ["X", "W", "R"], ["Y", "Y_h"], hidden_size=HIDDEN, linear_before_reset=1,
                              name="gru0")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X0", TensorProto.FLOAT, ["T", "N", 2, INPUT])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "Y_h")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    names = {gv.name_hint for gv in from_onnx(model, target=h100(), artifacts=None,
                                              batch_buckets="auto").get_global_vars()}
    assert "gru_recurrence" in names and not any("dispatch" in n or "_b" in n for n in names), names


def test_dispatch_is_on_by_default_and_pads_with_one_kernel():
    """No option: a CUDA module dispatches on the batch. Each bucket pads with the pad_batch kernel, never with
    zeros + concat of a symbolic number of rows (that crashed the host process on the H100:
    notes/tvm_symbolic_concat_cuda.md)."""
    from tvmseq.onnx import from_onnx

    mod = from_onnx(node_model("RNN", with_seq_lens=True), target=h100(), artifacts=None)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert "rnn_batch_dispatch" in names and "rnn_b4" in names, names
    text = mod["rnn_b4"].script()
    assert "pad_batch" in text and "take_batch" in text and "R.concat" not in text and "R.zeros" not in text


def test_cpu_target_has_no_dispatch():
    from tvmseq.onnx import from_onnx

    names = {gv.name_hint for gv in from_onnx(node_model("LSTM", with_seq_lens=True), target="llvm",
                                              batch_buckets="auto").get_global_vars()}
    assert "lstm_recurrence" in names and not any("dispatch" in n for n in names), names


DISPATCH_CPU_CASES = {**CASES, "lstm_bi_lens_h0_c0_peep": ("LSTM", dict(direction="bidirectional", with_seq_lens=True,
                                                                         with_initial_h=True, with_initial_c=True,
                                                                         with_peepholes=True))}


@pytest.mark.parametrize("name", list(DISPATCH_CPU_CASES))
def test_dispatch_is_exact_on_the_cpu(name, monkeypatch):
    """The dispatch's padding, If chain and slicing, run on llvm: buckets forced to 1 (persistent), 2 (per_step)
    and 4 (persistent; the persistent kernels' serial CPU variant), every batch 1-6 against onnxruntime."""
    from tvmseq.onnx import gru

    def plan(spec, target, path_option, choose, build):
        if spec.batch is not None or path_option != "auto":
            return []
        return [(1, "persistent"), (2, "per_step"), (4, "persistent")]

    monkeypatch.setattr(gru, "dispatch_plan", plan)     # every cell's layer goes through gru.emit_layer
    op, kw = DISPATCH_CPU_CASES[name]
    model = node_model(op, **kw)
    cell = op.lower()
    from tvmseq.onnx import from_onnx

    names = {gv.name_hint for gv in from_onnx(model, target="llvm").get_global_vars()}
    assert {f"{cell}_b1", f"{cell}_b4", f"{cell}_any_batch", f"{cell}_batch_dispatch"} <= names, names
    assert f"{cell}_b2" not in names
    compiled = tvmseq.compile_onnx(model, target="llvm")
    attrs = {k: kw[k] for k in ("direction", "linear_before_reset", "layout") if k in kw}
    for batch in range(1, 7):
        feeds = feeds_for(model, batch, 6, seed=batch)
        for g, w, out in zip(compiled(**feeds), expected(model, feeds, op, **attrs), ("Y", "Y_h", "Y_c")):
            np.testing.assert_allclose(g, w, **FP32, err_msg=f"{name} batch {batch} {out}")


def build(out_dir) -> None:
    """Compile GPU_CASES for the H100 (sm_90a SASS embedded); store feeds and onnxruntime's outputs at GPU_BATCHES
    and at one batch above the largest bucket of the module's dispatch; index.json names each case's buckets and
    batches."""
    import re

    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export
    from tvmseq.onnx import from_onnx

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, (op, kw) in GPU_CASES.items():
        model = node_model(op, **kw)
        cell = op.lower()
        mod = from_onnx(model, target=H100, artifacts=None, batch_buckets="auto")
        buckets = sorted(int(m.group(1)) for gv in mod.get_global_vars()
                         if (m := re.fullmatch(rf"{cell}_b(\d+)", gv.name_hint)))
        assert buckets, f"{name}: no batch dispatch in the CUDA module"
        batches = sorted(set(GPU_BATCHES) | {max(buckets) + 37})
        with cuda_toolchain.device_binaries(("sm_90a",)):
            compiled = compile_onnx(model, target=H100, artifacts=None, batch_buckets="auto")
        export(compiled, out / f"{name}.so")
        data = {}
        attrs = {k: kw[k] for k in ("direction", "linear_before_reset", "layout") if k in kw}
        for batch in batches:
            feeds = feeds_for(model, batch, GPU_STEPS, seed=batch)
            data.update({f"b{batch}_in_{k}": v for k, v in feeds.items()})
            data.update({f"b{batch}_out_{i}": v for i, v in enumerate(expected(model, feeds, op, **attrs))})
        np.savez(out / f"{name}.npz", **data)
        index[name] = {"buckets": buckets, "batches": batches}
        print(name, "buckets", buckets, "batches", batches, flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_prebuilt_symbolic_batch_on_gpu(name):
    """The prebuilt H100 modules (`build`), one compile each, at every stored batch: bucket 1, batches padded up to
    a bucket, a bucket's own size, one above the largest bucket (per-step kernels), against onnxruntime."""
    from tvmseq.runtime import load_model

    if not (PREBUILT / f"{name}.so").exists():
        pytest.skip(f"no prebuilt module in {PREBUILT} (python tests/test_symbolic_batch.py {PREBUILT})")
    model = load_model(PREBUILT / f"{name}.so")
    data = np.load(PREBUILT / f"{name}.npz")
    batches = sorted({int(k[1:].split("_", 1)[0]) for k in data.files})
    index = json.loads((PREBUILT / "index.json").read_text())
    if isinstance(index, dict) and name in index:
        assert batches == index[name]["batches"] and max(batches) > max(index[name]["buckets"])
    for batch in batches:
        feeds = {k.split("_in_", 1)[1]: data[k] for k in data.files if k.startswith(f"b{batch}_in_")}
        got = model(**feeds)
        for i, value in enumerate(got):
            np.testing.assert_allclose(value, data[f"b{batch}_out_{i}"], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{name} batch {batch} output {i}")


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else PREBUILT)


def test_bucket_functions_have_no_reshape_copies():
    """The buckets' bodies are dataflow blocks: after TVM's lowering no reshape is left as a copy kernel (a GRU's 9
    buckets had 26). (Float32 at 3 x hidden 128: the tf32x3 projection, whose row dispatch returns rows; the SIMT
    projection's branches, odd 3 x hidden, still end in one.)"""
    import re

    from tvmseq import targets
    from tvmseq.onnx import from_onnx
    from tvmseq.schedule_gpu import pipeline

    cuda = targets.resolve("cuda")
    model, _ = models.rnn_node_model("GRU", seq="T", batch=3, input_size=64, hidden=128,
                                     direction="bidirectional", linear_before_reset=1)
    mod = from_onnx(symbolic_batch(model), target=cuda)
    assert any(gv.name_hint.startswith("gru_b") for gv in mod.get_global_vars())
    with cuda:
        text = pipeline(cuda)(mod).script(show_meta=False)
    assert not re.findall(r"cls\.reshape\w*\(", text)
