"""tvmseq.reference.lstm against onnxruntime (layout 0) and onnx's ReferenceEvaluator (layout 1) on random
inputs of odd sizes, for every attribute that changes the numbers. Also holds `lstm_node_model`, the
single-node LSTM model the other LSTM tests build."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmseq import reference
from tvmseq.kernels.activations import Activation

_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
TOL64 = dict(rtol=1e-5, atol=1e-6)   # float64 reference vs onnxruntime's float32


def lstm_node_model(*, seq: int | str = 7, batch: int = 3, input_size: int = 11, hidden: int = 37,
                    direction: str = "forward", opset: int = 14, layout: int = 0, clip: float | None = None,
                    activations=None, activation_alpha=None, activation_beta=None, input_forget: int | None = None,
                    with_bias: bool = True, with_seq_lens: bool = False, with_initial_h: bool = False,
                    with_initial_c: bool = False, with_peepholes: bool = False, outputs=("Y", "Y_h", "Y_c"),
                    dtype: str = "float32", weights_as_inputs: bool = False, zero_length_row: bool = True,
                    seed: int = 0, name: str = "lstm0"):
    """One ONNX LSTM node with random weights (initializers, or graph inputs with `weights_as_inputs`):
    (model, feeds, inputs) where feeds are the runtime inputs and `inputs` every input by its ONNX name
    (X, W, R, B, sequence_lens, initial_h, initial_c, P; absent ones None), for the reference.
    A string `seq` makes the time axis symbolic (feeds then have 7 steps)."""
    rng = np.random.default_rng(seed)
    D = 2 if direction == "bidirectional" else 1
    npdt = np.dtype(dtype)
    T = seq if isinstance(seq, int) else 7
    # weights ~ 1/sqrt(fan-in): gates stay out of saturation, so the comparison tests the arithmetic
    weights = {"W": rng.uniform(-1, 1, (D, 4 * hidden, input_size)) / np.sqrt(input_size),
               "R": rng.uniform(-1, 1, (D, 4 * hidden, hidden)) / np.sqrt(hidden)}
    if with_bias:
        weights["B"] = rng.uniform(-0.5, 0.5, (D, 8 * hidden))
    if with_peepholes:
        weights["P"] = rng.uniform(-0.7, 0.7, (D, 3 * hidden))
    weights = {k: v.astype(npdt) for k, v in weights.items()}
    x_shape = [seq, batch, input_size] if layout == 0 else [batch, seq, input_size]
    state_shape = [D, batch, hidden] if layout == 0 else [batch, D, hidden]
    feeds = {"X": rng.standard_normal([T if d == seq else d for d in x_shape]).astype(npdt)}
    graph_inputs = [helper.make_tensor_value_info("X", _ONNX_DTYPE[dtype], x_shape)]
    if with_seq_lens:
        lens = rng.integers(1, T + 1, batch).astype(np.int32)
        lens[0] = T                       # a full-length row
        if zero_length_row and batch > 2:
            lens[-1] = 0                  # and an empty one
        feeds["sequence_lens"] = lens
        graph_inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    for flag, state in ((with_initial_h, "initial_h"), (with_initial_c, "initial_c")):
        if flag:
            feeds[state] = rng.standard_normal(state_shape).astype(npdt)
            graph_inputs.append(helper.make_tensor_value_info(state, _ONNX_DTYPE[dtype], state_shape))
    slots = ["X", "W", "R", "B" if with_bias else "", "sequence_lens" if with_seq_lens else "",
             "initial_h" if with_initial_h else "", "initial_c" if with_initial_c else "",
             "P" if with_peepholes else ""]
    while slots[-1] == "":
        slots.pop()
    attrs = {"hidden_size": hidden, "direction": direction}
    for key, val in (("layout", layout or None), ("clip", clip), ("activations", activations),
                     ("activation_alpha", activation_alpha), ("activation_beta", activation_beta),
                     ("input_forget", input_forget)):
        if val is not None:
            attrs[key] = val
    node_outputs = [o if o in outputs else "" for o in ("Y", "Y_h", "Y_c")]
    while node_outputs[-1] == "":
        node_outputs.pop()
    node = helper.make_node("LSTM", slots, node_outputs, name=name, **attrs)
    y_shape = [seq, D, batch, hidden] if layout == 0 else [batch, seq, D, hidden]
    graph_outputs = [helper.make_tensor_value_info(o, _ONNX_DTYPE[dtype], y_shape if o == "Y" else state_shape)
                     for o in ("Y", "Y_h", "Y_c") if o in outputs]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    if weights_as_inputs:
        graph_inputs += [helper.make_tensor_value_info(k, _ONNX_DTYPE[dtype], v.shape) for k, v in weights.items()]
        feeds.update(weights)
        inits = []
    graph = helper.make_graph([node], "lstm_model", graph_inputs, graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    everything = {**weights, **feeds}
    inputs = {k: everything.get(k) for k in ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")}
    return model, feeds, inputs


def reference_outputs(inputs, **attrs):
    """tvmseq.reference.lstm on the `inputs` of `lstm_node_model` (attrs: the node's attributes)."""
    return reference.lstm(*(inputs[k] for k in ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c",
                                                "P")), **attrs)


def ort_run(model, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def layout0_twin(model, feeds):
    """The layout-1 `model` as a layout-0 model with the same weights, and its feeds transposed; its outputs
    transposed back are the layout-1 answer (onnxruntime implements only layout 0)."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    node = twin.graph.node[0]
    for attr in node.attribute:
        if attr.name == "layout":
            attr.i = 0
    perms = {"X": [1, 0, 2], "initial_h": [1, 0, 2], "initial_c": [1, 0, 2], "Y": [1, 2, 0, 3],
             "Y_h": [1, 0, 2], "Y_c": [1, 0, 2]}
    for value in list(twin.graph.input) + list(twin.graph.output):
        if value.name in perms:
            dims = list(value.type.tensor_type.shape.dim)
            order = perms[value.name]
            new = [onnx.TensorShapeProto.Dimension() for _ in dims]
            for k, src in enumerate(order):
                new[k].CopyFrom(dims[src])
            del value.type.tensor_type.shape.dim[:]
            value.type.tensor_type.shape.dim.extend(new)
    twin_feeds = {k: (v.transpose(perms[k]) if k in perms else v) for k, v in feeds.items()}
    return twin, twin_feeds


def to_layout1(outputs, names):
    back = {"Y": [2, 0, 1, 3], "Y_h": [1, 0, 2], "Y_c": [1, 0, 2]}
    return [o.transpose(back[n]) for o, n in zip(outputs, names)]


# every combination of direction, peepholes, input_forget and sequence_lens; clip, activations (with
# alpha/beta), bias and initial states toggled so each value meets every direction
CUSTOM_ACTS = [(["HardSigmoid", "Tanh", "Softsign"], [0.3], [0.55]),
               (["Sigmoid", "ScaledTanh", "Affine"], [1.1, 0.9], [0.7, 0.1]),
               (["HardSigmoid", "LeakyRelu", "Elu"], [0.15, 0.2, 0.8], [0.45])]
CASES = [dict(direction=d, with_peepholes=p, input_forget=f, with_seq_lens=sl, clip=1.3 if i % 3 == 0 else None,
              acts=i % 4, with_bias=i % 5 != 4, with_initial_h=i % 2 == 0, with_initial_c=i % 3 != 1)
         for i, (d, p, f, sl) in enumerate(itertools.product(["forward", "reverse", "bidirectional"],
                                                             [False, True], [0, 1], [False, True]))]


def _case_model(case, **kw):
    case = dict(case)
    acts = case.pop("acts")
    D = 2 if case["direction"] == "bidirectional" else 1
    if acts:
        names, alpha, beta = CUSTOM_ACTS[acts - 1]
        case.update(activations=names * D, activation_alpha=alpha and alpha * D, activation_beta=beta and beta * D)
    return lstm_node_model(**case, **kw)


def _attrs(model):
    node = model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    attrs.pop("hidden_size", None)
    if "direction" in attrs:
        attrs["direction"] = attrs["direction"].decode()
    if "activations" in attrs:
        attrs["activations"] = [a.decode() for a in attrs["activations"]]
    return attrs


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_reference_matches_onnxruntime(case):
    model, feeds, inputs = _case_model(case, seed=len(CASES))
    want = ort_run(model, feeds)
    got = reference_outputs(inputs, **_attrs(model))
    for name, g, w in zip(("Y", "Y_h", "Y_c"), got, want):
        np.testing.assert_allclose(g, w, **TOL64, err_msg=name)


@pytest.mark.parametrize("opset", [7, 14, 22])
@pytest.mark.parametrize("hidden,batch,input_size", [(1, 1, 1), (5, 4, 3), (37, 3, 11)])
def test_reference_opsets_and_sizes(opset, hidden, batch, input_size):
    model, feeds, inputs = lstm_node_model(seq=6, batch=batch, input_size=input_size, hidden=hidden, opset=opset,
                                           direction="bidirectional", with_seq_lens=True, with_initial_h=True,
                                           with_initial_c=True, with_peepholes=True, seed=hidden)
    for g, w in zip(reference_outputs(inputs, **_attrs(model)), ort_run(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL64)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_reference_layout1_matches_onnx_reference_evaluator(direction):
    from onnx.reference import ReferenceEvaluator

    # onnx's reference implements layout but not sequence_lens, clip, input_forget or activations
    model, feeds, inputs = lstm_node_model(seq=5, batch=3, input_size=7, hidden=9, layout=1, direction=direction,
                                           with_initial_h=True, with_initial_c=True, with_peepholes=True, seed=4)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = reference_outputs(inputs, **_attrs(model))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, **TOL64)


@pytest.mark.parametrize("case", CASES[1::5], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_reference_layout1_matches_onnxruntime_on_transposed_twin(case):
    model, feeds, inputs = _case_model(case, layout=1, seed=11)
    twin, twin_feeds = layout0_twin(model, feeds)
    want = to_layout1(ort_run(twin, twin_feeds), ("Y", "Y_h", "Y_c"))
    for g, w in zip(reference_outputs(inputs, **_attrs(model)), want):
        np.testing.assert_allclose(g, w, **TOL64)


def test_reference_takes_activation_objects_and_one_set_for_both_directions():
    model, feeds, inputs = lstm_node_model(direction="bidirectional", activations=["HardSigmoid", "Tanh", "Relu"] * 2,
                                           activation_alpha=[0.25, 0.25], activation_beta=[0.4, 0.4], seed=2)
    want = ort_run(model, feeds)
    objects = [Activation.make("HardSigmoid", 0.25, 0.4), Activation.make("Tanh"), Activation.make("Relu")]
    got = reference.lstm(inputs["X"], inputs["W"], inputs["R"], inputs["B"], direction="bidirectional",
                         activations=objects)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL64)
