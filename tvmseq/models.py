"""Small ONNX models tvmseq builds itself: the demo's GRU model and the test models (random weights)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def rnn_node_model(op: str = "GRU", *, seq: int | str = 5, batch: int = 3, input_size: int = 4,
                   hidden: int = 6, direction: str = "forward", opset: int = 14, layout: int = 0,
                   linear_before_reset: int | None = None, clip: float | None = None,
                   activations: list[str] | None = None, activation_alpha=None, activation_beta=None,
                   with_bias: bool = True, with_seq_lens: bool = False, with_initial_h: bool = False,
                   outputs=("Y", "Y_h"), dtype: str = "float32", weights_as_inputs: bool = False,
                   weight_scale: float = 0.6, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One GRU or RNN node with random weights as initializers (or graph inputs). Returns the model and a
    dict of random feeds for its runtime inputs (X, and sequence_lens / initial_h when asked for)."""
    rng = np.random.default_rng(seed)
    gates = {"GRU": 3, "RNN": 1}[op]
    D = 2 if direction == "bidirectional" else 1
    npdt = np.dtype(dtype)
    ws = weight_scale
    weights = {"W": rng.uniform(-ws, ws, (D, gates * hidden, input_size)).astype(npdt),
               "R": rng.uniform(-ws, ws, (D, gates * hidden, hidden)).astype(npdt)}
    if with_bias:
        weights["B"] = rng.uniform(-0.5, 0.5, (D, 2 * gates * hidden)).astype(npdt)
    x_shape = [seq, batch, input_size] if layout == 0 else [batch, seq, input_size]
    T = seq if isinstance(seq, int) else 7
    feeds = {"X": rng.standard_normal([T if d == seq else d for d in x_shape]).astype(npdt)}
    inputs = [helper.make_tensor_value_info("X", _ONNX_DTYPE[dtype], x_shape)]
    node_inputs = ["X", "W", "R", "B" if with_bias else ""]
    if with_seq_lens:
        feeds["sequence_lens"] = rng.integers(0, T + 1, batch).astype(np.int32)
        feeds["sequence_lens"][0] = T  # at least one full-length sequence
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    node_inputs.append("sequence_lens" if with_seq_lens else "")
    if with_initial_h:
        h_shape = [D, batch, hidden] if layout == 0 else [batch, D, hidden]
        feeds["initial_h"] = rng.standard_normal(h_shape).astype(npdt)
        inputs.append(helper.make_tensor_value_info("initial_h", _ONNX_DTYPE[dtype], h_shape))
        node_inputs.append("initial_h")
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    attrs = {"hidden_size": hidden, "direction": direction}
    if layout:
        attrs["layout"] = layout
    if linear_before_reset is not None:
        attrs["linear_before_reset"] = linear_before_reset
    if clip is not None:
        attrs["clip"] = clip
    for key, val in (("activations", activations), ("activation_alpha", activation_alpha),
                     ("activation_beta", activation_beta)):
        if val is not None:
            attrs[key] = val
    node_outputs = [o if o in outputs else "" for o in ("Y", "Y_h")]
    while node_outputs[-1] == "":
        node_outputs.pop()
    node = helper.make_node(op, node_inputs, node_outputs, name=f"{op.lower()}0", **attrs)
    y_shape = [seq, D, batch, hidden] if layout == 0 else [batch, seq, D, hidden]
    yh_shape = [D, batch, hidden] if layout == 0 else [batch, D, hidden]
    graph_outputs = [helper.make_tensor_value_info(name, _ONNX_DTYPE[dtype], shape)
                     for name, shape in (("Y", y_shape), ("Y_h", yh_shape)) if name in outputs]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    if weights_as_inputs:
        inputs += [helper.make_tensor_value_info(k, _ONNX_DTYPE[dtype], v.shape) for k, v in weights.items()]
        feeds.update(weights)
        inits = []
    graph = helper.make_graph([node], f"{op.lower()}_model", inputs, graph_outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, feeds


def stacked_gru_model(*, input_size: int = 12, hidden: int = 16, classes: int = 5, seed: int = 0,
                      opset: int = 14) -> onnx.ModelProto:
    """A model with a dynamic time axis: X [seq, batch, input] -> Transpose/MatMul/Add -> bidirectional GRU
    -> Transpose+Reshape -> bidirectional GRU -> Squeeze(Y_h concat) -> MatMul -> Softmax. Batch is 2."""
    rng = np.random.default_rng(seed)
    H, I, batch = hidden, input_size, 2
    w = lambda *s: numpy_helper.from_array(rng.uniform(-0.5, 0.5, s).astype(np.float32))  # noqa: E731

    def init(name, *shape):
        t = w(*shape)
        t.name = name
        return t

    inits = [init("proj_w", I, I), init("proj_b", I),
             init("W1", 2, 3 * H, I), init("R1", 2, 3 * H, H), init("B1", 2, 6 * H),
             init("W2", 2, 3 * H, 2 * H), init("R2", 2, 3 * H, H), init("B2", 2, 6 * H),
             init("head_w", 2 * H, classes),
             numpy_helper.from_array(np.array([0, batch, 2 * H], np.int64), "shape_y1"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0")]
    nodes = [
        helper.make_node("Transpose", ["X"], ["Xb"], perm=[1, 0, 2]),          # [batch, seq, I]
        helper.make_node("MatMul", ["Xb", "proj_w"], ["P0"]),
        helper.make_node("Add", ["P0", "proj_b"], ["P1"]),
        helper.make_node("Transpose", ["P1"], ["P"], perm=[1, 0, 2]),          # [seq, batch, I]
        helper.make_node("GRU", ["P", "W1", "R1", "B1"], ["Y1"], name="gru1", hidden_size=H,
                         direction="bidirectional", linear_before_reset=1),
        helper.make_node("Transpose", ["Y1"], ["Y1t"], perm=[0, 2, 1, 3]),     # [seq, batch, 2, H]
        helper.make_node("Reshape", ["Y1t", "shape_y1"], ["Y1r"]),             # [seq, batch, 2H]
        helper.make_node("GRU", ["Y1r", "W2", "R2", "B2"], ["", "H2"], name="gru2", hidden_size=H,
                         direction="bidirectional"),
        helper.make_node("Transpose", ["H2"], ["H2t"], perm=[1, 0, 2]),        # [batch, 2, H]
        helper.make_node("Reshape", ["H2t", "shape_h2"], ["H2r"]),             # [batch, 2H]
        helper.make_node("MatMul", ["H2r", "head_w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("Unsqueeze", ["probs", "axis0"], ["probs1"]),
        helper.make_node("Squeeze", ["probs1", "axis0"], ["out"]),
    ]
    inits.append(numpy_helper.from_array(np.array([batch, 2 * H], np.int64), "shape_h2"))
    graph = helper.make_graph(
        nodes, "stacked_gru",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["seq", batch, I])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def demo_model(seq: int = 50, batch: int = 4, input_size: int = 64, hidden: int = 128):
    """The demo's model: a bidirectional GRU (PyTorch-style linear_before_reset=1) with random weights."""
    return rnn_node_model("GRU", seq=seq, batch=batch, input_size=input_size, hidden=hidden,
                          direction="bidirectional", linear_before_reset=1, with_initial_h=True,
                          weight_scale=hidden ** -0.5, seed=1)  # PyTorch's default init range


def gru_stack_model(layers: int = 3, *, seq: int | str = 5, batch: int = 2, input_size: int = 4, hidden: int = 6,
                    with_initial_h: bool = True, linear_before_reset: int = 1, opset: int = 14,
                    seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A multi-layer GRU as exporters write it: X -> GRU -> Squeeze(Y, axes=[1]) -> GRU -> ... Outputs: the last
    layer's squeezed Y and every layer's Y_h. Returns the model and random feeds (X, initial_h_l)."""
    rng = np.random.default_rng(seed)
    H, k = hidden, hidden ** -0.5
    inits, nodes, feeds, inputs = [], [], {}, []
    x = "X"
    inputs.append(helper.make_tensor_value_info("X", TensorProto.FLOAT, [seq, batch, input_size]))
    feeds["X"] = rng.standard_normal((5 if isinstance(seq, str) else seq, batch, input_size)).astype(np.float32)
    outputs = []
    for l in range(layers):
        size = input_size if l == 0 else H
        for name, shape in ((f"W{l}", (1, 3 * H, size)), (f"R{l}", (1, 3 * H, H)), (f"B{l}", (1, 6 * H))):
            inits.append(numpy_helper.from_array(rng.uniform(-k, k, shape).astype(np.float32), name))
        h0 = ""
        if with_initial_h:
            h0 = f"initial_h{l}"
            inputs.append(helper.make_tensor_value_info(h0, TensorProto.FLOAT, [1, batch, H]))
            feeds[h0] = (rng.standard_normal((1, batch, H)) * 0.5).astype(np.float32)
        nodes.append(helper.make_node("GRU", [x, f"W{l}", f"R{l}", f"B{l}", "", h0], [f"Y{l}", f"Y_h{l}"],
                                      name=f"gru{l}", hidden_size=H, linear_before_reset=linear_before_reset))
        outputs.append(helper.make_tensor_value_info(f"Y_h{l}", TensorProto.FLOAT, [1, batch, H]))
        x = f"S{l}"
        if opset >= 13:
            inits.append(numpy_helper.from_array(np.array([1], np.int64), f"axes{l}"))
            nodes.append(helper.make_node("Squeeze", [f"Y{l}", f"axes{l}"], [x]))
        else:
            nodes.append(helper.make_node("Squeeze", [f"Y{l}"], [x], axes=[1]))
    outputs.insert(0, helper.make_tensor_value_info(x, TensorProto.FLOAT, [seq, batch, H]))
    graph = helper.make_graph(nodes, "gru_stack", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model, feeds
