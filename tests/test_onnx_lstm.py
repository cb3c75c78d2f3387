"""ONNX LSTM models through tvmseq's importer (target llvm, the per-step kernels) against onnxruntime,
tvmseq.reference.lstm and, for layout 1, onnx's ReferenceEvaluator; onnx's `test_lstm_*` backend node
tests; the CUDA build of the recurrence (no GPU needed)."""
import itertools
import re
import shutil

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tvmseq import TvmseqError
from test_lstm_reference import (_attrs, _case_model, layout0_twin, lstm_node_model, ort_run, reference_outputs,
                                 to_layout1)

pytest.importorskip("onnxruntime")
FP32 = dict(rtol=1e-4, atol=1e-5)
FP16 = dict(rtol=2e-2, atol=2e-2)


def _compile(model):
    return tvmseq.compile_onnx(model, target="llvm")


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# direction x peepholes x input_forget, sequence_lens / clip / activations (with alpha/beta) / bias /
# initial states toggled so that each value of each meets every direction (sizes H 37, batch 3, input 11)
CASES = [dict(direction=d, with_peepholes=p, input_forget=f, with_seq_lens=i % 2 == 1,
              clip=1.3 if i % 3 == 0 else None, acts=i % 4, with_bias=i % 3 != 1, with_initial_h=i % 3 != 2,
              with_initial_c=i % 2 == 0)
         for i, (d, p, f) in enumerate(itertools.product(["forward", "reverse", "bidirectional"], [False, True],
                                                         [0, 1]))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_attribute_combinations_match_onnxruntime_and_reference(case):
    model, feeds, inputs = _case_model(case, seed=7)
    out = _compile(model)(**feeds)
    for name, got, want in zip(("Y", "Y_h", "Y_c"), out, ort_run(model, feeds)):
        np.testing.assert_allclose(got, want, **FP32, err_msg=name)
    for name, got, want in zip(("Y", "Y_h", "Y_c"), out, reference_outputs(inputs, **_attrs(model))):
        np.testing.assert_allclose(got, want, **FP32, err_msg=name)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_layout1_every_attribute(direction):
    """layout 1 with sequence_lens, states, peepholes, clip and activations: onnxruntime runs the transposed
    layout-0 twin (it does not implement layout 1), the reference runs layout 1 itself."""
    case = dict(direction=direction, with_peepholes=True, input_forget=int(direction == "reverse"), with_seq_lens=True,
                clip=1.1, acts=2, with_bias=True, with_initial_h=True, with_initial_c=True)
    model, feeds, inputs = _case_model(case, layout=1, batch=5, seed=3)
    out = _compile(model)(**feeds)
    twin, twin_feeds = layout0_twin(model, feeds)
    for got, want in zip(out, to_layout1(ort_run(twin, twin_feeds), ("Y", "Y_h", "Y_c"))):
        np.testing.assert_allclose(got, want, **FP32)
    for got, want in zip(out, reference_outputs(inputs, **_attrs(model))):
        np.testing.assert_allclose(got, want, **FP32)


def test_layout1_matches_onnx_reference_evaluator():
    from onnx.reference import ReferenceEvaluator

    model, feeds, _ = lstm_node_model(layout=1, direction="bidirectional", with_initial_h=True, with_initial_c=True,
                                      with_peepholes=True, seed=5)
    for got, want in zip(_compile(model)(**feeds), ReferenceEvaluator(model).run(None, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **FP32)


@pytest.mark.parametrize("opset", [1, 7, 22])   # 14: every other test
def test_opsets(opset):
    model, feeds, inputs = lstm_node_model(seq=5, batch=2, input_size=6, hidden=13, direction="bidirectional",
                                           opset=opset, with_seq_lens=True, with_initial_h=True, with_peepholes=True,
                                           seed=opset)
    out = _compile(model)(**feeds)
    want = reference_outputs(inputs, **_attrs(model)) if opset == 1 else ort_run(model, feeds)
    for got, w in zip(out, want):   # onnxruntime implements LSTM from opset 7 on
        np.testing.assert_allclose(got, w, **FP32)


def test_float16_matches_reference():
    model, feeds, inputs = lstm_node_model(dtype="float16", direction="bidirectional", with_seq_lens=True,
                                           with_initial_h=True, with_initial_c=True, with_peepholes=True, seed=9)
    out = _compile(model)(**feeds)
    for got, want in zip(out, reference_outputs(inputs, **_attrs(model))):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, **FP16)


@pytest.mark.parametrize("outputs", [("Y",), ("Y_c",), ("Y_h", "Y_c")])
def test_optional_outputs(outputs):
    model, feeds, _ = lstm_node_model(outputs=outputs, with_initial_c=True, hidden=9, seed=1)
    got = _as_tuple(_compile(model)(**feeds))
    want = ort_run(model, feeds)
    assert len(got) == len(want) == len(outputs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **FP32)


def test_weights_and_peepholes_as_graph_inputs():
    model, feeds, _ = lstm_node_model(weights_as_inputs=True, with_peepholes=True, direction="reverse", hidden=8,
                                      seed=4)
    assert {"W", "R", "B", "P"} <= set(feeds)
    for got, want in zip(_compile(model)(**feeds), ort_run(model, feeds)):
        np.testing.assert_allclose(got, want, **FP32)


def _stacked_lstm_model(I=11, H1=37, H2=19, batch=3, seed=0):
    """X [seq, batch, I] -> bidirectional LSTM with peepholes -> Transpose + Reshape [seq, batch, 2 H1] ->
    LSTM (clip) -> Y, Y_h, Y_c; the time axis symbolic."""
    rng = np.random.default_rng(seed)

    def init(name, *shape, scale=None):
        scale = scale or 1 / np.sqrt(shape[-1])
        return numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name)

    inits = [init("W1", 2, 4 * H1, I), init("R1", 2, 4 * H1, H1), init("B1", 2, 8 * H1, scale=0.5),
             init("P1", 2, 3 * H1, scale=0.5), init("W2", 1, 4 * H2, 2 * H1), init("R2", 1, 4 * H2, H2),
             init("B2", 1, 8 * H2, scale=0.5),
             numpy_helper.from_array(np.array([0, batch, 2 * H1], np.int64), "shape1")]
    nodes = [helper.make_node("LSTM", ["X", "W1", "R1", "B1", "", "", "", "P1"], ["Y1"], name="lstm1",
                              hidden_size=H1, direction="bidirectional"),
             helper.make_node("Transpose", ["Y1"], ["Y1t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["Y1t", "shape1"], ["X2"]),
             helper.make_node("LSTM", ["X2", "W2", "R2", "B2"], ["Y", "Y_h", "Y_c"], name="lstm2", hidden_size=H2,
                              clip=2.0)]
    graph = helper.make_graph(nodes, "stacked_lstm", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                                     ["seq", batch, I])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["seq", 1, batch, H2]),
                               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, batch, H2]),
                               helper.make_tensor_value_info("Y_c", TensorProto.FLOAT, [1, batch, H2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model


def test_stacked_lstms_with_symbolic_time_axis():
    model = _stacked_lstm_model()
    compiled = _compile(model)
    assert compiled.signature["inputs"][0]["shape"][0] == "seq"
    rng = np.random.default_rng(2)
    for seq in (4, 9):   # one compiled model, two lengths
        x = rng.standard_normal((seq, 3, 11)).astype(np.float32)
        for got, want in zip(compiled(X=x), ort_run(model, {"X": x})):
            np.testing.assert_allclose(got, want, **FP32)


def test_symbolic_time_axis_with_sequence_lens_checked():
    model, feeds, _ = lstm_node_model(seq="T", direction="bidirectional", with_seq_lens=True, hidden=10, seed=6)
    compiled = _compile(model)
    rng = np.random.default_rng(0)
    for seq in (3, 8):
        x = rng.standard_normal((seq, 3, 11)).astype(np.float32)
        lens = np.array([seq, 1, 0], np.int32)
        for got, want in zip(compiled(X=x, sequence_lens=lens), ort_run(model, {"X": x, "sequence_lens": lens})):
            np.testing.assert_allclose(got, want, **FP32)
    with pytest.raises(TvmseqError, match="sequence_lens of LSTM node 'lstm0'"):
        compiled(X=x, sequence_lens=np.array([seq + 1, 1, 0], np.int32))


def _lstm_node_test_cases():
    """onnx's `test_lstm_*` backend node cases. Importing their module generates just them (into onnx's shared
    case list, which stays complete for other tests); `BackendTest` would first generate every node test
    of every op (13 s here)."""
    import onnx.backend.test.case.node.lstm  # noqa: F401 - generates the LSTM cases on import
    from onnx.backend.test.case.node import _NodeTestCases

    return [case for case in _NodeTestCases if case.name.startswith("test_lstm_")]


def test_onnx_backend_lstm_node_tests():
    """Every case through tvmseq's onnx Backend, compared as onnx's backend test runner compares them."""
    from onnx.backend.test.runner import Runner

    from tvmseq.onnx.backend import TvmseqBackend

    cases = _lstm_node_test_cases()
    assert {c.name for c in cases} >= {"test_lstm_defaults", "test_lstm_with_initial_bias", "test_lstm_with_peepholes",
                                       "test_lstm_batchwise", "test_lstm_reverse", "test_lstm_bidirectional"}
    for case in cases:
        rep = TvmseqBackend.prepare(case.model, "CPU")
        for inputs, ref_outputs in case.data_sets:
            Runner.assert_similar_outputs(ref_outputs, rep.run(inputs), rtol=case.rtol, atol=case.atol)


# --- errors: one line naming the node and the attribute or input, before anything runs ----------------------
def _lstm_with(**attrs):
    model, _, _ = lstm_node_model(hidden=5)
    node = model.graph.node[0]
    for key, val in attrs.items():
        existing = [a for a in node.attribute if a.name == key]
        for a in existing:
            node.attribute.remove(a)
        node.attribute.append(helper.make_attribute(key, val))
    return model


@pytest.mark.parametrize("attrs,match", [
    (dict(input_forget=2), r"'lstm0' \(LSTM\).*input_forget"),
    (dict(activations=["Sigmoid", "Tanh", "Gelu"]), r"'lstm0' \(LSTM\).*activations.*Gelu"),
    (dict(activations=["Sigmoid", "Tanh"]), r"'lstm0' \(LSTM\).*activations.*2 entries, expected 3"),
    (dict(linear_before_reset=1), r"'lstm0' \(LSTM\).*linear_before_reset"),
    (dict(direction="sideways"), r"'lstm0' \(LSTM\).*direction"),
    (dict(layout=3), r"'lstm0' \(LSTM\).*layout"),
    (dict(clip=-1.0), r"'lstm0' \(LSTM\).*clip"),
])
def test_bad_attributes_are_one_line_errors(attrs, match):
    with pytest.raises(TvmseqError, match=match) as err:
        _compile(_lstm_with(**attrs))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name,shape,match", [("P", [1, 5], "'P' has shape"),
                                              ("initial_c", [2, 3, 5], "'initial_c' has shape")])
def test_bad_input_shapes_name_the_input(name, shape, match):
    model, _, _ = lstm_node_model(hidden=5, with_peepholes=True, with_initial_c=True)
    if name == "P":
        model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.zeros(shape, np.float32), "P"))
    else:
        dims = model.graph.input[-1].type.tensor_type.shape.dim
        for d, v in zip(dims, shape):
            d.dim_value = v
    with pytest.raises(TvmseqError, match=rf"'lstm0' \(LSTM\).*{match}"):
        _compile(model)


def test_unavailable_recurrence_path_is_an_error():
    """The warpgroup kernel takes fp16 only: asked for on an fp32 node, one line naming the node and why."""
    model, _, _ = lstm_node_model(hidden=5)
    with pytest.raises(TvmseqError, match=r"'lstm0' \(LSTM\).*wgmma.*float16") as err:
        tvmseq.compile_onnx(model, target="llvm", recurrence="persistent_wgmma")
    assert "\n" not in str(err.value)


# --- the recurrence kernel on its own: any batch ----------------------------------------------------------
def test_recurrence_for_any_batch(dtype="float32"):
    """One kernel (LstmSpec batch None) run at two batch sizes, peepholes, clip and sequence_lens on, against
    the reference; Y, Y_h and Y_c poisoned with NaN first, so every element must be written."""
    import tvm

    from tvmseq import reference, targets
    from tvmseq.kernels.recurrent import lstm

    D, H, I, seq = 2, 21, 6, 5
    spec = lstm.LstmSpec(D, None, H, I, dtype, "bidirectional", clip=1.7, has_seq_lens=True, has_peepholes=True)
    llvm = targets.resolve("llvm")
    rec = tvm.compile(tvm.IRModule({"main": lstm.recurrence_func(spec, llvm)}), target=llvm)["lstm_recurrence"]
    rng = np.random.default_rng(1)
    W, R = rng.uniform(-0.4, 0.4, (D, 4 * H, I)), rng.uniform(-0.2, 0.2, (D, 4 * H, H)).astype(dtype)
    bias, P = rng.uniform(-0.5, 0.5, (D, 8 * H)), rng.uniform(-0.7, 0.7, (D, 3 * H))
    tensor = lambda a, dt="float32": tvm.runtime.tensor(np.ascontiguousarray(a).astype(dt))  # noqa: E731
    for B in (2, 5):
        X, h0, c0 = rng.standard_normal((seq, B, I)), rng.standard_normal((D, B, H)), rng.standard_normal((D, B, H))
        lens = rng.integers(0, seq + 1, B).astype(np.int32)
        gate_i = np.einsum("tbi,dgi->dtbg", X, W) + (bias[:, :4 * H] + bias[:, 4 * H:])[:, None, None]
        outs = [tensor(np.full(shape, np.nan), dtype) for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
        rec(tensor(gate_i), tensor(R, dtype), tensor(P), tensor(lens, "int32"), tensor(h0), tensor(c0), *outs)
        want = reference.lstm(X, W, R, bias, lens, h0, c0, P, direction="bidirectional", clip=1.7)
        for got, w in zip(outs, want):
            np.testing.assert_allclose(got.numpy().astype(np.float64), w, **(FP32 if dtype == "float32" else FP16))


def test_spec_rejects_bad_values():
    from tvmseq.kernels.recurrent import lstm

    for kwargs, match in [(dict(num_directions=2), "num_directions"), (dict(input_forget=2), "input_forget"),
                          (dict(dtype="int8"), "float32 and float16"), (dict(clip=0.0), "clip"),
                          (dict(activations=(lstm.Activation.make("Tanh"),)), "3 activations"),
                          (dict(batch=0), "batch")]:
        with pytest.raises(TvmseqError, match=match):
            lstm.LstmSpec(**{**dict(num_directions=1, batch=3, hidden=5, input_size=4), **kwargs})
    assert lstm.LstmSpec(1, "N", 5, 4).batch is None   # a symbolic name: any batch


# --- CUDA: the recurrence builds for the H100 without a GPU -------------------------------------------------
def test_gpu_recurrence_builds_for_cuda():
    """Built for nvidia/nvidia-h100 here: per step one GEMM kernel (warp per row at small batch, the tiled
    shared-memory GEMM from batch 16) and one gate kernel; nvcc (when installed) compiles the source for
    sm_90a without spills."""
    import tvm

    from tvmseq import targets
    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.recurrent import lstm

    cuda = targets.resolve("cuda")
    acts = (Activation.make("HardSigmoid", 0.3, 0.5), Activation.make("Tanh"), Activation.make("Softsign"))
    specs = {"small": lstm.LstmSpec(1, 3, 37, 11, has_peepholes=True, clip=2.0),
             "bi_odd": lstm.LstmSpec(2, 19, 100, 40, "float32", "bidirectional", has_seq_lens=True, input_forget=1),
             "fp16": lstm.LstmSpec(1, 67, 257, 33, "float16", "reverse", acts, has_seq_lens=True, has_peepholes=True),
             "anybatch": lstm.LstmSpec(2, None, 100, 20, "float32", "bidirectional", has_seq_lens=True)}
    funcs = {f"rec_{n}": lstm.recurrence_func(s, cuda).with_attr("global_symbol", f"rec_{n}") for n, s in specs.items()}
    src = tvm.compile(tvm.IRModule(funcs), target=cuda).mod.imports[0].inspect_source()
    kernels = {}
    for chunk in src.split('extern "C" __global__')[1:]:
        head, brace, _ = chunk.partition("{")
        if brace and ";" not in head:
            kernels[re.search(r"(\w+)\(", head.split(")", 1)[1]).group(1)] = chunk
    for name in specs:
        mine = [k for n, k in kernels.items() if n.startswith(f"rec_{name}")]
        # h0, c0 loads, GEMM, gates, Y_h and Y_c stores
        assert len(mine) == 6, (name, sorted(kernels))
    assert not any("__shared__" in k for n, k in kernels.items() if n.startswith("rec_small"))
    assert any("__shared__" in k for n, k in kernels.items() if n.startswith("rec_fp16"))   # tiled GEMM
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    report = ptxas_report(src)
    assert len(report) >= 6 * len(specs)
    for kernel, info in report.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, (kernel, info)


def test_persistent_path_through_the_importer_matches_onnxruntime():
    """recurrence='persistent' on llvm runs the persistent engine's serial variant (the GPU kernel's indexing,
    peepholes, lengths and both directions) behind the same converter."""
    case = dict(direction="bidirectional", with_peepholes=True, input_forget=0, with_seq_lens=True, clip=None,
                acts=0, with_bias=True, with_initial_h=True, with_initial_c=True)
    model, feeds, _ = _case_model(case, seed=11)
    out = tvmseq.compile_onnx(model, target="llvm", recurrence="persistent")(**feeds)
    for name, got, want in zip(("Y", "Y_h", "Y_c"), out, ort_run(model, feeds)):
        np.testing.assert_allclose(got, want, **FP32, err_msg=name)


def test_symbolic_batch_and_time_one_compile():
    """X [T, N, I] with both axes symbolic, initial_h/initial_c [D, N, H] as graph inputs: one compile, run at
    two (T, N), against onnxruntime."""
    from onnxruntime import InferenceSession

    rng = np.random.default_rng(4)
    H, I, D = 13, 7, 2
    weights = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
               for n, s in (("W", (D, 4 * H, I)), ("R", (D, 4 * H, H)), ("B", (D, 8 * H)))]
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "", "h0", "c0"], ["Y", "Y_h", "Y_c"], hidden_size=H,
                            direction="bidirectional", name="lstm0")
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", I]),
              helper.make_tensor_value_info("h0", TensorProto.FLOAT, [D, "N", H]),
              helper.make_tensor_value_info("c0", TensorProto.FLOAT, [D, "N", H])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("Y", "Y_h", "Y_c")]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 14)], ir_version=10)
    compiled = _compile(model)
    session = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for T, N in ((5, 1), (3, 4)):
        feeds = {"X": rng.standard_normal((T, N, I)).astype(np.float32),
                 "h0": rng.standard_normal((D, N, H)).astype(np.float32),
                 "c0": rng.standard_normal((D, N, H)).astype(np.float32)}
        for name, got, want in zip(("Y", "Y_h", "Y_c"), compiled(**feeds), session.run(None, feeds)):
            np.testing.assert_allclose(got, want, **FP32, err_msg=f"{name} at T={T} N={N}")
