"""ONNX LSTM (opsets 1-22) -> tvmseq kernels: the shared input-projection GEMM (4 gates, every bias folded
in) + an LSTM recurrence chosen by `lstm_recurrence_for` (today the per-step kernels of kernels/recurrent/lstm.py)."""
from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax

from ..errors import TvmseqError, UnsupportedOnnxError
from ..kernels.activations import parse_onnx_activations
from ..kernels.recurrent import gru as gru_kernels
from ..kernels.recurrent import lstm as lstm_kernels
from .gru import (_SUPPORTED_ATTRS, _int, _static_dims, as_float32, constant_value, emit_input_projection,
                  emit_layer, emit_one_step, finish_outputs, fold_biases, match_state_shape, one_step_wanted,
                  prepare_common, recurrence_path_option, recurrent_key, spec_batch, with_packed_r, zeros)
from .importer import OnnxOpConverter, emit_kernel, register_converter

_LSTM_ATTRS = (_SUPPORTED_ATTRS - {"linear_before_reset"}) | {"input_forget"}
# the inputs of an ONNX LSTM node, by position
_INITIAL_C, _P = 6, 7


def lstm_recurrence_for(spec: lstm_kernels.LstmSpec, target, path_option: str = "auto"):
    """(prim_func, path) of the recurrence for `spec` on `target` (a Target or its JSON), built once per
    spec/target/option. Every path takes the same arguments (`lstm_kernels.recurrence_func`'s signature),
    so the choice changes nothing around the call. 'auto': the persistent kernel on a GPU where it fits and is
    expected to be faster (`paths.lstm_recurrence_auto`), else the per-step kernels."""
    return _lstm_recurrence_cached(spec, str(target), path_option)


@functools.lru_cache(maxsize=64)
def _lstm_recurrence_cached(spec, target_json: str, path_option: str):
    from ..kernels.recurrent import paths

    target = tvm.target.Target(target_json)
    if path_option not in paths.PATHS:
        raise TvmseqError(f"LSTM recurrence path {path_option!r} is not available "
                          f"(use one of {paths.PATHS})")
    if path_option != "per_step":   # on a CPU 'auto' picks per_step; 'persistent' runs the engine's serial variant
        func, path, _why = paths.lstm_recurrence_auto(spec, target, path_option)
        if func is not None:
            return func, path
    return lstm_kernels.recurrence_func(spec, target), "per_step"


def _direction(attr, node):
    direction = attr.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in gru_kernels.DIRECTIONS:
        raise UnsupportedOnnxError(node, "LSTM", f"attribute 'direction' = {direction!r} is not one of "
                                                 f"{gru_kernels.DIRECTIONS}")
    return direction


def _optional_input(inputs, index):
    return inputs[index] if len(inputs) > index else None


def _initial_c(bb, inputs, c, node):
    """initial_c as float32 [D, B, H] (layout 1 permuted, as prepare_common does initial_h); zeros if absent.
    A symbolic batch (prepare_common's c["batch"]) is matched as prepare_common matches initial_h's."""
    c0 = _optional_input(inputs, _INITIAL_C)
    D, B, H = c["D"], c["batch"], c["hidden"]
    if c0 is None:
        return zeros((D, B, H), "float32")
    c0 = match_state_shape(bb, c0, [D, B, H] if c["layout"] == 0 else [B, D, H], "initial_c", node, "LSTM")
    if c["layout"] == 1:
        c0 = bb.emit(relax.op.permute_dims(c0, [1, 0, 2]))
    return as_float32(bb, c0)


def _peepholes(bb, inputs, c, node):
    """(P as float32 [D, 3H], whether the kernel must apply it): absent or constant all-zero peepholes
    give zeros and False, so the kernels skip the three products."""
    p = _optional_input(inputs, _P)
    D, H = c["D"], c["hidden"]
    no_peepholes = relax.const(np.zeros((D, 3 * H), "float32"))
    if p is None:
        return no_peepholes, False
    dims = [_int(d, "P's shape", node, "LSTM") for d in _static_dims(p, "P", node, "LSTM")]
    if dims != [D, 3 * H]:
        raise UnsupportedOnnxError(node, "LSTM", f"input 'P' has shape {dims}, expected {[D, 3 * H]}")
    value = constant_value(p)
    if value is not None:   # an initializer: as float32 at import, no per-call cast
        return (relax.const(value.astype("float32")), True) if np.any(value) else (no_peepholes, False)
    return as_float32(bb, p), True


def fold_lstm_biases(bb, c):
    """bias_i [D, 4H] = Wb + Rb of a prepared LSTM node `c`: every LSTM bias is additive, so all of them join the
    input GEMM (`gru.fold_biases`: numpy at import where B is an initializer)."""
    return fold_biases(bb, c)[0]


def _emit_lstm_kernels(bb, c, spec, c0, peep, target, path_option: str = "auto"):
    bias_i = fold_lstm_biases(bb, c)
    if one_step_wanted("lstm", spec, c, target, path_option):
        return emit_one_step(bb, "lstm", spec, c, [c["x"], c["w"], c["r"], bias_i, peep, c["h0"], c0], target,
                             n_states=2)
    rec, path = lstm_recurrence_for(spec, target, path_option)
    D, B, H, seq = c["D"], c["batch"], c["hidden"], c["seq"]
    gate_i = emit_input_projection(bb, "lstm", spec, c, bias_i, target)
    lens = c["lens"] if c["lens"] is not None else zeros((B,), "int32")
    sizes = {"directions": D, "batch": B, "hidden": H, "input_size": c["input_size"], "gates": spec.gates}
    r, rec, attrs = with_packed_r(spec, c["r"], rec, {"spec": repr(spec), "path": path}, target)
    key = recurrent_key(sizes, c["dtype"], attrs)
    state = relax.TensorType([D, B, H], c["dtype"])
    return emit_kernel(bb, "lstm_recurrence", key, lambda: rec, [gate_i, r, peep, lens, c["h0"], c0],
                       [relax.TensorType([seq, D, B, H], c["dtype"]), state, state],
                       name_hint="lstm_recurrence" + c.get("suffix", ""))


def emit_lstm_layer(bb, c, spec, c0, peep, target, path_option: str = "auto"):
    """One LSTM node's kernels on the inputs `c` prepared by `prepare_common`: the (Y, Y_h, Y_c) call, layout 0.
    A symbolic batch on a GPU: the persistent kernels of the batch buckets where the batch fits one, else the
    per-step kernels, chosen at run time (`gru.emit_layer`)."""
    from ..kernels.recurrent import paths

    return emit_layer(bb, "lstm", c, spec, target, path_option,
                      lambda bb_, c_, spec_, path: _emit_lstm_kernels(bb_, c_, spec_, c_["c0"], c_["peep"], target, path),
                      lambda s: paths.choose_lstm_path(s.num_directions, s.batch, s.hidden, s.dtype,
                                                       tvm.target.Target(str(target)))[0],
                      lambda s, path: lstm_recurrence_for(s, target, path), extra={"c0": c0, "peep": peep})


def finish_lstm_outputs(bb, outs, layout):
    """(Y, Y_h, Y_c) in the node's layout."""
    y, y_h, y_c = (bb.emit(relax.TupleGetItem(outs, k)) for k in range(3))
    y_yh = finish_outputs(bb, y, y_h, layout)
    if layout == 1:
        y_c = bb.emit(relax.op.permute_dims(y_c, [1, 0, 2]))
    return relax.Tuple([*y_yh.fields, y_c])


@register_converter("LSTM")
class LSTM(OnnxOpConverter):
    """ONNX LSTM -> lstm_input_projection (one GEMM, Wb + Rb folded in) + lstm_recurrence."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        target = attr["tvm_custom"]["importer_options"]["target"]
        _direction(attr, node)   # checked here so the message names LSTM
        c = prepare_common(bb, inputs, attr, node, "LSTM", gates=4, supported=_LSTM_ATTRS, symbolic_batch=True)
        input_forget = attr.get("input_forget", 0)
        if input_forget not in (0, 1):
            raise UnsupportedOnnxError(node, "LSTM", f"attribute 'input_forget' = {input_forget} must be 0 or 1")
        acts = parse_onnx_activations(attr, 3, c["D"], list(lstm_kernels.DEFAULT_ACTIVATIONS),
                                      f"ONNX node '{node}' (LSTM)")
        c0 = _initial_c(bb, inputs, c, node)
        peep, has_peepholes = _peepholes(bb, inputs, c, node)
        spec = lstm_kernels.LstmSpec(c["D"], spec_batch(c["batch"]), c["hidden"], c["input_size"], c["dtype"], c["direction"],
                                     tuple(acts), attr.get("clip"), c["lens"] is not None, int(input_forget),
                                     has_peepholes)
        try:
            outs = emit_lstm_layer(bb, c, spec, c0, peep, target, recurrence_path_option(attr, node, "LSTM"))
        except UnsupportedOnnxError:
            raise
        except TvmseqError as err:   # a kernel factory's refusal, told against this node
            raise UnsupportedOnnxError(node, "LSTM", str(err)) from None
        return finish_lstm_outputs(bb, outs, c["layout"])
