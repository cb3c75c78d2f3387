"""ONNX RNN (opsets 1-22) -> tvmseq kernels: the shared input-projection GEMM + the RNN recurrence."""
from __future__ import annotations

import numpy as np
from tvm import relax

from ..errors import TvmseqError, UnsupportedOnnxError
from ..kernels.activations import parse_onnx_activations
from ..kernels.recurrent import rnn as rnn_kernels
from .gru import (_SUPPORTED_ATTRS, build_kernels, choose_gru_path, emit_layer, emit_one_step, emit_recurrent_kernels,
                  finish_outputs, fold_biases, one_step_wanted, prepare_common, recurrence_path_option, spec_batch,
                  zeros)
from .importer import OnnxOpConverter, register_converter

_RNN_ATTRS = _SUPPORTED_ATTRS - {"linear_before_reset"}


def _emit_rnn_kernels(bb, c, spec, target, path_option: str = "auto"):
    bias_i, _ = fold_biases(bb, c)   # Wb + Rb: numpy at import for an initializer B
    if one_step_wanted("rnn", spec, c, target, path_option):
        return emit_one_step(bb, "rnn", spec, c, [c["x"], c["w"], c["r"], bias_i, c["h0"]], target)
    rec, path = build_kernels(spec, str(target), path_option)
    H, D, B = c["hidden"], c["D"], c["batch"]
    lens = c["lens"] if c["lens"] is not None else zeros((B,), "int32")
    # the persistent kernel shares the GRU's signature: a (zero) rb_h after R
    extra = [relax.const(np.zeros((D, H), "float32"))] if path.startswith("persistent") else []
    _, outs = emit_recurrent_kernels(bb, "rnn", spec, c, rec, path, bias_i, [c["r"], *extra, lens, c["h0"]], target)
    return outs


def emit_rnn_layer(bb, c, spec, target, path_option: str = "auto"):
    """One RNN node's kernels on the prepared inputs `c` (`prepare_common`): the (Y, Y_h) tuple, layout 0; a
    symbolic batch on a GPU dispatches on it at run time (`gru.emit_layer`)."""
    return emit_layer(bb, "rnn", c, spec, target, path_option,
                      lambda bb_, c_, spec_, path: _emit_rnn_kernels(bb_, c_, spec_, target, path),
                      lambda s: choose_gru_path(s, target), lambda s, path: build_kernels(s, str(target), path))


@register_converter("RNN")
class RNN(OnnxOpConverter):
    """ONNX RNN -> gru_input_projection (one GEMM, Wb + Rb folded in) + rnn_recurrence."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        target = attr["tvm_custom"]["importer_options"]["target"]
        c = prepare_common(bb, inputs, attr, node, "RNN", gates=1, supported=_RNN_ATTRS, symbolic_batch=True)
        acts = parse_onnx_activations(attr, 1, c["D"], ["Tanh"], f"ONNX node '{node}' (RNN)")
        spec = rnn_kernels.RnnSpec(c["D"], spec_batch(c["batch"]), c["hidden"], c["input_size"], c["dtype"],
                                   c["direction"], tuple(acts), attr.get("clip"), c["lens"] is not None)
        try:
            outs = emit_rnn_layer(bb, c, spec, target, recurrence_path_option(attr, node, "RNN"))
        except UnsupportedOnnxError:
            raise
        except TvmseqError as err:   # e.g. a persistent path asked for with any batch
            raise UnsupportedOnnxError(node, "RNN", str(err)) from None
        return finish_outputs(bb, bb.emit(relax.TupleGetItem(outs, 0)), bb.emit(relax.TupleGetItem(outs, 1)),
                              c["layout"])
