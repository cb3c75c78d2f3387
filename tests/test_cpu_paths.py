"""The CPU paths of issue #23: the LSTM's vectorized gate loop (polynomial exp, one SIMD vector of units a block)
against the float64 reference, the step GEMM's run-time choice between its parallel and serial loops for a
symbolic batch, the parallel guard of the stock-op schedules (a symbolic size picks the loop at run time), the
strided conv whose reduction is vectorized, and the runtime's CPU input/output path (aligned copies, no
aliasing). Odd sizes everywhere."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # CPU kernels built here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tvmseq  # noqa: E402
from tvmseq import schedule_cpu  # noqa: E402
from tvmseq.kernels.activations import Activation  # noqa: E402
from tvmseq.kernels.recurrent import lstm, step_gemm  # noqa: E402
from tvmseq.targets import resolve  # noqa: E402

LLVM = resolve("llvm")


@pytest.mark.parametrize("kw", [
    dict(hidden=48, batch=3, direction="bidirectional", with_seq_lens=True, with_peepholes=True),
    dict(hidden=32, batch=2, direction="reverse", clip=0.9, input_forget=1, with_initial_c=True,
         activations=["HardSigmoid", "Tanh", "Softsign"]),
    dict(hidden=37, batch=4, with_initial_h=True),     # 37 units: no SIMD vector divides it (scalar blocks)
], ids=["bidir-peepholes-lens", "reverse-clip-input_forget-acts", "odd-hidden"])
def test_lstm_cpu_gates_match_reference(kw):
    from test_lstm_reference import lstm_node_model, reference_outputs

    kw = dict(kw)
    acts = kw.pop("activations", None)
    model, feeds, inputs = lstm_node_model(seq=9, input_size=19, activations=acts, **kw)
    attrs = {"direction": kw.get("direction", "forward"), "clip": kw.get("clip"),
             "input_forget": kw.get("input_forget", 0)}
    if acts:
        attrs["activations"] = acts
    got = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    want = reference_outputs(inputs, **attrs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


def test_lstm_cpu_gate_loop_is_vectorized():
    """hidden 64: the gate loop runs 16 units a vector, with the polynomial exp (no call to expf in a loop)."""
    spec = lstm.LstmSpec(1, None, 64, 24)
    text = lstm.recurrence_func(spec, LLVM).script()
    assert "T.vectorized(16)" in text
    acts = [Activation.make("Sigmoid"), Activation.make("Tanh")]
    assert all(a.name in ("Sigmoid", "Tanh") for a in acts) and "T.exp(" not in text


def test_step_gemm_symbolic_batch_decides_threads_at_run_time(monkeypatch):
    """A symbolic-batch step GEMM big enough at CPU_M_BLOCK rows carries both loops and picks by the actual
    batch; both give the same sums."""
    monkeypatch.setattr(step_gemm, "CPU_PARALLEL_MIN_MACS", 3 * 37 * 43 * 2)   # batch >= 3 goes parallel
    D, N, K = 2, 37, 43
    func = step_gemm.cpu_gemm_func(D, None, N, K)
    text = func.script()
    serial = step_gemm.cpu_gemm_func(D, 5, N, K, parallel=False).script()
    assert "T.parallel" in text and text.count("for ") == 2 * serial.count("for ")    # both loop nests
    mod = tvm.compile(func, target=LLVM)
    rng = np.random.default_rng(3)
    R = rng.standard_normal((D, N, K)).astype(np.float32)
    for M in (1, 2, 5, 9):
        h = rng.standard_normal((D, M, K)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((1, D, M, N), np.nan, np.float32))
        mod["cpu_step_gemm"](tvm.runtime.tensor(h), tvm.runtime.tensor(R), out)
        np.testing.assert_allclose(out.numpy()[0], np.einsum("dmk,dnk->dmn", h, R), rtol=1e-5, atol=1e-4)


def test_gate_loop_symbolic_batch_decides_threads_at_run_time():
    """A symbolic-batch LSTM (hidden 48, any batch) carries its gate loop twice, split over threads and serial,
    and picks by D * batch * H each step (CPU_GATE_PARALLEL_MIN_UNITS): batch 1 (48 units) and batch 67 (3216)
    both match the float64 reference; a static batch keeps one loop."""
    from test_lstm_reference import lstm_node_model, reference_outputs
    from tvmseq.kernels.recurrent import gru

    hidden = 48
    assert hidden < gru.CPU_GATE_PARALLEL_MIN_UNITS <= 67 * hidden
    symbolic = lstm.recurrence_func(lstm.LstmSpec(1, None, hidden, 19), LLVM).script()
    static = lstm.recurrence_func(lstm.LstmSpec(1, 1, hidden, 19), LLVM).script()
    check = f"if batch * {hidden} >= {gru.CPU_GATE_PARALLEL_MIN_UNITS}:"   # the gate loop's choice, each step
    blocks = hidden // gru.cpu_unit_chunk(hidden, gru.StepSchedule.for_batch(None), LLVM)   # 3 of 16, 6 of 8 units
    assert check in symbolic and f"T.parallel(batch * {blocks})" in symbolic
    assert check not in static and "T.parallel" not in static
    model = lstm_node_model(seq=5, input_size=19, hidden=hidden, batch=1)[0]
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "batch"   # one build for every batch
    for output in model.graph.output:
        output.type.tensor_type.ClearField("shape")
    compiled = tvmseq.compile_onnx(model, target="llvm")
    for batch in (1, 67):   # the same seed: the same weights, drawn before the input
        _, feeds, inputs = lstm_node_model(seq=5, input_size=19, hidden=hidden, batch=batch)
        for g, w in zip(compiled(**feeds), reference_outputs(inputs, direction="forward")):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cores,threshold", [(None, None), (2, step_gemm.CPU_PARALLEL_MIN_MACS),
                                              (16, step_gemm.CPU_MANY_CORES_MIN_MACS)])
def test_step_split_threshold_follows_the_cores(monkeypatch, cores, threshold):
    """The split threshold is the machine's (up to 7 cores CPU_PARALLEL_MIN_MACS, from 8 cores
    CPU_MANY_CORES_MIN_MACS: the target's num-cores, else the threads of this process's pool; each measured on such
    a machine): a batch-1 hidden-512 LSTM step (1M multiply-adds) is split over threads, a hidden-64 one (16K) is not."""
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    target = resolve(f"llvm -num-cores={cores}") if cores else LLVM
    assert step_gemm.cpu_parallel_min_macs(target) == (threshold or step_gemm.CPU_PARALLEL_MIN_MACS)
    for hidden, split in ((512, True), (64, False)):
        spec = lstm.LstmSpec(1, 1, hidden, hidden, "float32", direction="forward")
        assert ("T.parallel" in lstm.recurrence_func(spec, target).script()) == split, hidden


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "m", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ort(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_parallel_guard_on_symbolic_sizes(monkeypatch):
    """An elementwise op over symbolic (batch, time): its parallel loop gets a serial twin chosen at run time
    (`guard_parallel_pass`), small and large inputs both right."""
    from tvmseq.tune.model import fused_module

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "T", 129])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "T", 129])
    model = _model([helper.make_node("Mul", ["X", "s"], ["m"]), helper.make_node("Add", ["m", "X"], ["Y"])],
                   [x], [y], {"s": np.linspace(0.5, 1.5, 129).astype(np.float32)})
    target = tvm.target.Target("llvm")
    with target:
        scheduled = schedule_cpu.schedule_pass()(fused_module(tvmseq.from_onnx(model, target="llvm"), target))
    texts = [f.script() for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    guarded = [t for t in texts if "T.parallel" in t]
    assert guarded and all(f">= T.int64({schedule_cpu.PARALLEL_MIN_MACS})" in t for t in guarded)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    rng = np.random.default_rng(0)
    for shape in ((1, 3, 129), (3, 700, 129)):      # 387 and 270900 elements: serial, then parallel
        feeds = {"X": rng.standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(compiled(**feeds), _ort(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_strided_conv_reduction_is_vectorized():
    """A conv with stride 64 (an STFT as a conv): no output axis is contiguous, the kernel axis is; the
    InnerReduction rule sums a vector of lanes, results match onnxruntime at two lengths."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", 1, "S"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", 34, "F"])
    rng = np.random.default_rng(1)
    model = _model([helper.make_node("Conv", ["X", "w"], ["Y"], strides=[64])], [x], [y],
                   {"w": rng.standard_normal((34, 1, 256)).astype(np.float32)})
    func = next(f for f in _scheduled_funcs(model) if "conv" in f.script())
    assert "conv1d_ncw_rf" in func.script() and "T.vectorized(" in func.script()
    compiled = tvmseq.compile_onnx(model, target="llvm")
    for shape in ((1, 1, 512), (3, 1, 1088)):
        feeds = {"X": rng.uniform(-1, 1, shape).astype(np.float32)}
        np.testing.assert_allclose(compiled(**feeds), _ort(model, feeds)[0], rtol=1e-5, atol=1e-5)


def _scheduled_funcs(model):
    from tvmseq.tune.model import fused_module

    target = tvm.target.Target("llvm")
    with target:
        scheduled = schedule_cpu.schedule_pass()(fused_module(tvmseq.from_onnx(model, target="llvm"), target))
    return [f for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]


def test_cpu_inputs_and_outputs_are_copies():
    """Inputs reach the kernels as 64-byte aligned copies (a misaligned view works), outputs come back as
    arrays the caller owns: writing into one changes neither the model nor the next result."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [5, 7])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [5, 7])
    model = _model([helper.make_node("Add", ["X", "b"], ["Y"])], [x], [y],
                   {"b": np.arange(35, dtype=np.float32).reshape(5, 7)})
    compiled = tvmseq.compile_onnx(model, target="llvm")
    base = np.random.default_rng(2).standard_normal(36).astype(np.float32)
    view = base[1:].reshape(5, 7)          # 4 bytes past numpy's alignment
    first = compiled(X=view)
    np.testing.assert_array_equal(first, view + np.arange(35, dtype=np.float32).reshape(5, 7))
    first[:] = -1
    np.testing.assert_array_equal(compiled(X=view), view + np.arange(35, dtype=np.float32).reshape(5, 7))
    assert first.flags.owndata or first.base is not None and np.all(first == -1)


def _kernel_weight_ranks(mod, suffixes=("_recurrence", "_input_projection_flat")) -> dict:
    """{kernel name: rank of its second argument (W or R)} over main's call_tir calls of the recurrent kernels."""
    ranks = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if isinstance(call, tvm.relax.Call) and getattr(call.op, "name", "") == "relax.call_tir":
                name = call.args[0].name_hint
                if name.endswith(suffixes):
                    ranks[name] = len(call.args[1].fields[1].ty.shape)
    return ranks


@pytest.mark.parametrize("cell,batch,weights_as_inputs", [("LSTM", 3, False), ("LSTM", 1, False), ("GRU", 3, False),
                                                       ("RNN", 3, False), ("GRU", 1, False), ("GRU", 3, True)])
def test_constant_weights_packed_once_at_import(cell, batch, weights_as_inputs):
    """W and R as initializers on an AVX2 or AVX-512 CPU: the projection gets W as float32 panels packed at import (a 4-D
    constant) and never packs it in a call; so does the recurrence R, a GRU / RNN from a static batch of 2 and an
    LSTM whose gates fuse into the panels (hidden 48) at any batch (a batch-1 GRU keeps R as stored and its kernel's
    run-time choice). W and R as graph inputs: as given (3-D), packed in long calls. Either way the node matches
    onnxruntime, at 5 steps (calls the kernels did not pack for before)."""
    from tvmseq import models
    from tvmseq.bench import cpu as bench_cpu

    if cell == "LSTM":
        model, feeds = bench_cpu.lstm_node_model(5, batch, 40, 48)
    else:
        model, feeds = models.rnn_node_model(cell, seq=5, batch=batch, input_size=40,
                                             hidden=48 if cell == "GRU" else 130,
                                             linear_before_reset=1 if cell == "GRU" else None,
                                             weights_as_inputs=weights_as_inputs, weight_scale=0.15)
    ranks = _kernel_weight_ranks(tvmseq.from_onnx(model, target="llvm"))
    packs = bool(step_gemm.cpu_panel_size(resolve("llvm"))) and not weights_as_inputs
    fused = cell == "LSTM" and step_gemm.cpu_panel_size(resolve("llvm")) == step_gemm.CPU_PANEL   # AVX-512 only
    packs_r = packs and (fused or batch >= 2)
    assert ranks == {f"{cell.lower()}_input_projection_flat": 4 if packs else 3,
                     f"{cell.lower()}_recurrence": 4 if packs_r else 3}, ranks
    got = tvmseq.compile_onnx(model, target="llvm", artifacts=None)(**feeds)
    for a, b in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mcpu,hidden,units", [("x86-64-v3", 128, 8), ("znver4", 128, 16), ("x86-64", 128, 16),
                                               ("x86-64-v3", 100, 4), ("znver4", 40, 8)])
def test_gate_loop_vector_no_wider_than_the_targets(mcpu, hidden, units):
    """A CPU gate loop's block of units is the widest vector dividing the hidden size that the target's registers
    hold (AVX2: 8; a 16-unit block spilled the LSTM's gate math there); AVX-512 and targets without panels: 16."""
    from tvmseq.kernels.recurrent import gru

    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    assert gru.cpu_unit_chunk(hidden, gru.StepSchedule.for_batch(8), target) == units
