"""Expose the recurrent state of GRU/RNN/LSTM nodes as graph inputs and outputs, so a model exported for
whole sequences can be run frame by frame (`tvmseq.Stream`): each call's final state is the next call's
initial state.

`expose_state(model)` rewrites the ModelProto (a copy): every GRU/RNN/LSTM node without an `initial_h`
(LSTM: `initial_c`), or fed a zero tensor the graph builds itself (ConstantOfShape, as
torch.onnx.export writes for a state the caller leaves out), gets a new graph input `<node>.initial_h` (`<node>.initial_c`) of shape
[directions, batch, hidden] (layout 1: [batch, directions, hidden]), and its `Y_h` (`Y_c`) becomes a graph
output (named `<node>.Y_h` when the node had left it unnamed). A zero state in gives what the model gave
before, so the rewritten model still runs whole sequences as the original did.

Streaming is exact only where nothing else carries information across frames: a convolution or pooling
with a kernel or stride > 1 along the time axis, a reverse or bidirectional recurrence, a cumulative sum,
a Scan/Loop... see only the frames of one call. `time_mixing_ops` lists such nodes (the time axis is not
tracked through the graph, so any kernel > 1 counts); `expose_state` warns once, naming them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

RECURRENT_OPS = {"GRU": 1, "RNN": 1, "LSTM": 2}     # op -> number of state tensors (h; h and c)
_STATE_INPUT = {0: 5, 1: 6}                          # state index -> node input slot (initial_h, initial_c)
_STATE_OUTPUT = {0: 1, 1: 2}                         # state index -> node output slot (Y_h, Y_c)
_STATE_NAME = {0: ("initial_h", "Y_h"), 1: ("initial_c", "Y_c")}
_ALWAYS_MIXING = {"CumSum", "Scan", "Loop", "ReverseSequence", "STFT", "DFT", "LpNormalization"}
_WINDOWED = {"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "AveragePool", "MaxPool", "LpPool"}


class StreamingWarning(UserWarning):
    """The model has operators that carry information across frames: streaming it is not exact."""


@dataclass
class StatePair:
    """One recurrent state: the graph input that feeds it and the graph output that returns it."""

    node: str
    input: str
    output: str


def _node_names(graph) -> list[str]:
    seen, names = set(), []
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name += "_"
        seen.add(name)
        names.append(name)
    return names


def _attr(node, key, default=None):
    for a in node.attribute:
        if a.name == key:
            return helper.get_attribute_value(a)
    return default


def _dim_of(value_info, axis: int, fallback: str):
    """A TensorShapeProto dim of `value_info` at `axis` as int or str (a fresh symbolic name if unknown)."""
    if value_info is not None:
        dims = value_info.type.tensor_type.shape.dim
        if axis < len(dims):
            d = dims[axis]
            if d.HasField("dim_value") and d.dim_value > 0:
                return d.dim_value
            if d.HasField("dim_param") and d.dim_param:
                return d.dim_param
    return fallback


def _value_infos(model) -> dict:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        inferred = model
    g = inferred.graph
    return {v.name: v for v in list(g.input) + list(g.value_info) + list(g.output)}


def time_mixing_ops(graph) -> list[str]:
    """Nodes that carry information across frames (module doc): 'name (op: why)' for each."""
    found = []
    for name, node in zip(_node_names(graph), graph.node):
        why = None
        if node.op_type in _ALWAYS_MIXING:
            why = "mixes values along an axis across frames"
        elif node.op_type in _WINDOWED:
            kernel = list(_attr(node, "kernel_shape", []) or [])
            strides = list(_attr(node, "strides", []) or [])
            if any(k > 1 for k in kernel) or any(s > 1 for s in strides) or \
                    (not kernel and node.op_type in ("Conv", "ConvTranspose")):
                why = f"kernel {kernel or '(from the weight)'}, strides {strides or 1}"
        elif node.op_type in RECURRENT_OPS:
            direction = _attr(node, "direction", b"forward")
            direction = direction.decode() if isinstance(direction, bytes) else direction
            if direction != "forward":
                why = f"direction {direction}: the reverse pass sees only the frames of one call"
        if why:
            found.append(f"{name} ({node.op_type}: {why})")
    return found


_VIEW_OPS = {"Slice", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast", "Tile", "Transpose",
             "Gather"}


def _is_zero_state(name: str, graph) -> bool:
    """Whether `name` is a zero tensor built inside the graph (what exporters feed a recurrence whose state
    the caller does not pass: ConstantOfShape(0) of a computed shape, a zero initializer, sliced or
    reshaped): such a state is hidden and gets exposed like a missing one."""
    from onnx import numpy_helper

    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    seen = 0
    while seen < 16:
        seen += 1
        if name in inits:
            return not numpy_helper.to_array(inits[name]).any()
        node = producer.get(name)
        if node is None:
            return False
        if node.op_type == "ConstantOfShape":
            value = _attr(node, "value")
            return value is None or not numpy_helper.to_array(value).any()
        if node.op_type == "Constant":
            value = _attr(node, "value")
            return value is not None and not numpy_helper.to_array(value).any()
        if node.op_type not in _VIEW_OPS:
            return False
        name = node.input[0]
    return False


def existing_state_pairs(model: onnx.ModelProto) -> list[StatePair]:
    """State already exposed by the model: recurrent nodes whose initial_h/initial_c is a graph input
    and whose Y_h/Y_c is a graph output."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    pairs = []
    for name, node in zip(_node_names(graph), graph.node):
        for k in range(RECURRENT_OPS.get(node.op_type, 0)):
            slot_in, slot_out = _STATE_INPUT[k], _STATE_OUTPUT[k]
            if len(node.input) > slot_in and len(node.output) > slot_out and node.input[slot_in] in inputs \
                    and node.output[slot_out] in outputs:
                pairs.append(StatePair(name, node.input[slot_in], node.output[slot_out]))
    return pairs


def expose_state(model: onnx.ModelProto, warn: bool = True) -> tuple[onnx.ModelProto, list[StatePair]]:
    """(rewritten copy of `model`, every state pair: the new ones and those the model already had)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    infos = _value_infos(model)
    outputs = {o.name for o in graph.output}
    names = _node_names(graph)
    pairs = existing_state_pairs(model)
    for name, node in zip(names, graph.node):
        states = RECURRENT_OPS.get(node.op_type, 0)
        if not states:
            continue
        hidden = _attr(node, "hidden_size")
        direction = _attr(node, "direction", b"forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        layout = _attr(node, "layout", 0)
        dirs = 2 if direction == "bidirectional" else 1
        x_info = infos.get(node.input[0])
        batch = _dim_of(x_info, 1 if layout == 0 else 0, f"{name}.batch")
        if hidden is None:
            r_info = infos.get(node.input[2]) if len(node.input) > 2 else None
            hidden = _dim_of(r_info, 2, None)
        if hidden is None:
            hidden = next((t.dims[2] for t in graph.initializer if len(node.input) > 2 and t.name == node.input[2]),
                          f"{name}.hidden")
        shape = [dirs, batch, hidden] if layout == 0 else [batch, dirs, hidden]
        elem = (x_info.type.tensor_type.elem_type if x_info is not None and x_info.type.tensor_type.elem_type
                else TensorProto.FLOAT)
        for k in range(states):
            in_name, out_name = _STATE_NAME[k]
            slot_in, slot_out = _STATE_INPUT[k], _STATE_OUTPUT[k]
            if len(node.input) > slot_in and node.input[slot_in] and not _is_zero_state(node.input[slot_in], graph):
                continue   # the model feeds this state itself (a graph input already paired, or computed)
            while len(node.input) <= slot_in:
                node.input.append("")
            state_in = f"{name}.{in_name}"
            node.input[slot_in] = state_in
            graph.input.append(helper.make_tensor_value_info(state_in, elem, shape))
            while len(node.output) <= slot_out:
                node.output.append("")
            if not node.output[slot_out]:
                node.output[slot_out] = f"{name}.{out_name}"
            state_out = node.output[slot_out]
            if state_out not in outputs:
                graph.output.append(helper.make_tensor_value_info(state_out, elem, shape))
                outputs.add(state_out)
            pairs.append(StatePair(name, state_in, state_out))
    if warn:
        mixing = time_mixing_ops(graph)
        if mixing:
            warnings.warn("streaming this model frame by frame is not exact: these nodes carry information "
                          f"across frames, which the exposed recurrent state does not hold: {'; '.join(mixing)}",
                          StreamingWarning, stacklevel=2)
    return model, pairs
