"""Pipelined LSTM stack (every layer in one persistent kernel, row-split schedule): its serial CPU variant
against `tvmseq.reference.lstm` applied layer by layer, the schedule checks and errors,
and CUDA code generation for the H100 (ptxas: no spills)."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvmseq.bench.lstm_stack import kernel_inputs, onnx_layers, reference_stack  # noqa: E402
from tvmseq.errors import TvmseqError  # noqa: E402
from tvmseq.kernels.activations import Activation  # noqa: E402
from tvmseq.kernels.recurrent import rows as pr  # noqa: E402
from tvmseq.kernels.recurrent import stack as ps  # noqa: E402


def run_cpu(L, B, H, T_, dtype, inputs, config=None, **kw):
    f = ps.stacked_lstm_func(L, B, H, dtype, "llvm", config=config, **kw)
    mod = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    outs = [np.full((L, T_, B, H), np.nan, dtype), np.full((L, B, H), np.nan, dtype),
            np.full((L, B, H), np.nan, dtype)]
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in (*inputs, *outs)]
    mod["lstm_stack"](*args)
    return [a.numpy() for a in args[-3:]]


def _check(L, B, H, I, T_, dtype, seed, config=None, peepholes=False, clip=None, input_forget=0, acts=None):
    layers, X, h0, c0 = onnx_layers(L, B, H, I, T_, seed, peepholes)
    want = reference_stack(layers, X, h0, c0, clip=clip, input_forget=input_forget, activations=acts)
    got = run_cpu(L, B, H, T_, dtype, kernel_inputs(layers, X, h0, c0, dtype), config, has_peepholes=peepholes,
                  clip=clip, input_forget=bool(input_forget),
                  acts=[Activation.make(a) for a in acts] if acts else None)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    for g, w, name in zip(got, want, ("Y", "Y_h", "Y_c")):
        np.testing.assert_allclose(g.astype(np.float64), w, err_msg=name, **tol)


@pytest.mark.parametrize("L,B,H,I,T_", [(2, 3, 13, 5, 6), (3, 5, 7, 9, 5), (2, 1, 37, 3, 4)])
def test_lstm_stack_matches_reference(L, B, H, I, T_):
    """The default CPU schedule (several blocks, warps and batch chunks) against the layer-by-layer reference."""
    _check(L, B, H, I, T_, "float32", seed=L * 100 + H)


@pytest.mark.parametrize("cfg", [pr.RowSplitConfig(2, 2, 2, 0), pr.RowSplitConfig(1, 3, 4, 50)])
def test_lstm_stack_schedules(cfg):
    """Weights all in shared memory / all in registers, a partial batch chunk, units not a multiple of warps."""
    _check(2, 5, 11, 4, 5, "float32", seed=7, config=cfg)


def test_lstm_stack_cell_options_and_half():
    """Peepholes, clip, input_forget and other activations (shared by every layer), then float16 weights."""
    _check(2, 3, 9, 4, 5, "float32", seed=3, peepholes=True, clip=0.9, input_forget=1,
           acts=["HardSigmoid", "Softsign", "Relu"])
    _check(3, 2, 19, 6, 4, "float16", seed=4, peepholes=True)


def test_lstm_stack_config_and_errors():
    from tvmseq.targets import resolve

    cuda = resolve("cuda")
    cfg = ps.default_lstm_config(2, 8, 512, cuda)
    assert cfg.blocks_per_layer * 2 <= 132
    geo = pr.RowGeometry(2, 8, 512, cfg, 32, "lstm")
    assert geo.NQ == 8 and geo.NS == 2 and geo.U * cfg.blocks_per_layer >= 512
    assert ps.lstm_fits_on_chip(2, 8, 512, "float32", cuda)[0]
    ok, why = ps.lstm_fits_on_chip(2, 8, 4096, "float32", cuda)
    assert not ok and "LSTM weights" in why
    assert not ps.lstm_fits_on_chip(2, 8, 64, "int8", cuda)[0]
    with pytest.raises(TvmseqError, match="RowSplitConfig"):
        ps.stacked_lstm_func(2, 2, 8, "float32", "llvm", config=ps.default_stack_config(2, 2, 8, "float32", "llvm"))
    with pytest.raises(TvmseqError, match="slots"):
        ps.stacked_lstm_func(2, 2, 8, "float32", "llvm", slots=1)
    with pytest.raises(TvmseqError, match="3 activations"):
        ps.stacked_lstm_func(2, 2, 8, "float32", "llvm", acts=[Activation.make("Tanh")])


@pytest.mark.parametrize("L,B,H,dtype", [(2, 8, 512, "float32"), (3, 5, 37, "float16")])
def test_lstm_stack_cuda_builds_without_spills(L, B, H, dtype):
    """CUDA codegen for the H100 without a GPU: cooperative launch, the LL and progress primitives, and (when
    nvcc is installed) ptxas reports no spills for sm_90a."""
    from tvmseq.cuda_toolchain import ptxas_report
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    f = ps.stacked_lstm_func(L, B, H, dtype, tgt)
    assert "tirx.use_cooperative_launch" in list(f.attrs["tirx.kernel_launch_params"])
    src = tvm.compile(tvm.IRModule({"lstm_stack": f}), target=tgt).mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "st.release.gpu.global.b32", "ld.acquire.gpu.global.b32",
                   "st.relaxed.gpu.global.b64"):
        assert needle in src, needle
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["registers"] <= 255, info


# ----------------------------------------------------------------------------------------------------
# GPU: the odd-size kernels of the benchmark payload (python3 -m tvmseq.bench.lstm_stack --build out/lstm_stack)
# ----------------------------------------------------------------------------------------------------
LSTM_STACK_PREBUILT = Path(os.environ.get("TVMSEQ_LSTM_STACK_PREBUILT",
                                          Path(__file__).resolve().parents[1] / "out" / "lstm_stack"))


@pytest.mark.gpu
def test_prebuilt_odd_lstm_stacks_on_gpu():
    from tvmseq.bench.lstm_stack import NAME, check_kernels
    from tvmseq.measure import PrebuiltModules

    if not (LSTM_STACK_PREBUILT / "index.json").exists():
        pytest.skip(f"no prebuilt payload in {LSTM_STACK_PREBUILT}")
    index = json.loads((LSTM_STACK_PREBUILT / "index.json").read_text())
    assert any(e.get("odd") for e in index["configs"]), "payload has no odd-size kernels"
    mod = PrebuiltModules(LSTM_STACK_PREBUILT).get(f"{NAME}.so")
    assert check_kernels(mod, index) == []


# ----------------------------------------------------------------------------------------------------
# Importer: LSTM -> Squeeze(axes=[1]) -> LSTM chains fused into one TvmseqLstmStack node
# ----------------------------------------------------------------------------------------------------

def lstm_stack_model(layers, seq=5, batch=2, input_size=4, hidden=6, initial_states=True, opset=14, seed=0,
                     drop_outputs=False, **attrs):
    """A multi-layer LSTM as exporters write it: X -> LSTM -> Squeeze(Y, axes=[1]) -> LSTM -> ... Outputs: the
    last layer's squeezed Y and every layer's Y_h and Y_c (drop_outputs: layer 0 leaves Y_c out and the last
    layer's Y_h is not a graph output). Returns the model and random feeds."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    H, k = hidden, hidden ** -0.5
    inits, nodes, feeds, inputs, outputs, x = [], [], {}, [], [], "X"
    inputs.append(helper.make_tensor_value_info("X", TensorProto.FLOAT, [seq, batch, input_size]))
    feeds["X"] = rng.standard_normal((seq, batch, input_size)).astype(np.float32)
    for l in range(layers):
        size = input_size if l == 0 else H
        for name, shape in ((f"W{l}", (1, 4 * H, size)), (f"R{l}", (1, 4 * H, H)), (f"B{l}", (1, 8 * H))):
            inits.append(numpy_helper.from_array(rng.uniform(-k, k, shape).astype(np.float32), name))
        states = ["", ""]
        if initial_states:
            states = [f"initial_h{l}", f"initial_c{l}"]
            for name in states:
                inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, batch, H]))
                feeds[name] = (rng.standard_normal((1, batch, H)) * 0.5).astype(np.float32)
        outs = [f"Y{l}", f"Y_h{l}", f"Y_c{l}"]
        if drop_outputs and l == 0:
            outs = outs[:2]
        nodes.append(helper.make_node("LSTM", [x, f"W{l}", f"R{l}", f"B{l}", "", *states], outs, name=f"lstm{l}",
                                      hidden_size=H, **attrs))
        outputs += [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, batch, H]) for o in outs[1:]
                    if not (drop_outputs and o == f"Y_h{layers - 1}")]
        x = f"S{l}"
        if opset >= 13:
            inits.append(numpy_helper.from_array(np.array([1], np.int64), f"axes{l}"))
            nodes.append(helper.make_node("Squeeze", [f"Y{l}", f"axes{l}"], [x]))
        else:
            nodes.append(helper.make_node("Squeeze", [f"Y{l}"], [x], axes=[1]))
    outputs.insert(0, helper.make_tensor_value_info(x, TensorProto.FLOAT, [seq, batch, H]))
    graph = helper.make_graph(nodes, "lstm_stack", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10), feeds


def _ort(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("layers,batch,hidden,seq,opset,initial_states,drop", [
    (2, 3, 7, 6, 14, True, False), (3, 2, 5, 4, 11, False, True)])
@pytest.mark.parametrize("mode", ["on", "off"])
def test_onnx_lstm_stack_matches_onnxruntime(layers, batch, hidden, seq, opset, initial_states, drop, mode):
    import tvmseq

    model, feeds = lstm_stack_model(layers, seq=seq, batch=batch, hidden=hidden, opset=opset,
                                    initial_states=initial_states, seed=layers, drop_outputs=drop)
    mod = tvmseq.from_onnx(model, target="llvm", gru_stack=mode)
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any("lstm_stack" in n for n in names) == (mode == "on"), names
    got = tvmseq.compile_onnx(model, target="llvm", gru_stack=mode)(**feeds)
    want = _ort(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_what_lstm_stacks_fuse():
    import tvmseq
    from tvmseq.onnx import stack

    model, _ = lstm_stack_model(3)
    assert [[n.name for n in c] for c in stack.find_gru_stacks(model.graph, "LSTM")] == [["lstm0", "lstm1", "lstm2"]]
    assert stack.find_gru_stacks(model.graph) == []
    fused = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm"), "gru_stack": "on"})
    assert [n.op_type for n in fused.graph.node].count(stack.LSTM_STACK_OP) == 1
    assert "LSTM" not in [n.op_type for n in fused.graph.node]
    kept = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm")})   # auto: GPU targets only
    assert [n.op_type for n in kept.graph.node].count("LSTM") == 3
    for attrs in (dict(clip=2.0), dict(input_forget=1), dict(direction="reverse")):   # not what the kernel computes
        other, _ = lstm_stack_model(2, **attrs)
        assert stack.find_gru_stacks(other.graph, "LSTM") == [], attrs


def test_auto_pipelines_only_where_measured_faster():
    """'auto' takes the pipelined LSTM stack at batch <= 8 with layers x hidden <= 1024 (measured faster on the
    H100), the layers one by one at batch 64 and at 3 x 512 (measured slower), and never on a CPU."""
    from tvmseq.onnx.stack import lstm_pipelined
    from tvmseq.targets import resolve

    cuda = resolve("cuda")
    assert lstm_pipelined(2, 8, 512, "float32", cuda, "auto")
    assert not lstm_pipelined(2, 64, 512, "float32", cuda, "auto")
    assert not lstm_pipelined(3, 8, 512, "float32", cuda, "auto")
    assert not lstm_pipelined(2, 8, 512, "float32", resolve("llvm"), "auto")
    assert not lstm_pipelined(2, 8, 512, "float16", cuda, "auto")      # its layers one by one are faster
