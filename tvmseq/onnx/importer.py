"""ONNX -> Relax: TVM's Relax ONNX frontend for every op it knows, plus tvmseq's converters.

TVM's frontend keeps its converters in a map built by `_get_convert_map()` and offers no hook, so
`TvmseqGraphImporter` subclasses its graph importer and consults `CONVERTERS` first. A converter
follows the frontend's convention: a class with `_impl_vN(cls, bb, inputs, attr, params)` classmethods
(`get_converter(opset)` picks the newest N <= opset); it emits `call_tir` calls of tvmseq kernels.
"""
from __future__ import annotations

import json

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import TvmseqError, UnsupportedOnnxError

# op_type -> converter class (an OnnxOpConverter subclass); filled by `register_converter`.
CONVERTERS: dict[str, type] = {}


def register_converter(op_type: str):
    """Class decorator: route ONNX nodes of `op_type` to this converter instead of TVM's."""

    def wrap(cls):
        CONVERTERS[op_type] = cls
        return cls

    return wrap


def add_input_check(attr, input_name: str, check: dict):
    """Record a value check on a graph input; `tvmseq.runtime.Model` runs it before the model."""
    attr["tvm_custom"]["importer_options"].setdefault("input_checks", {}).setdefault(input_name, []).append(check)


class OnnxOpConverter(_tvm_onnx.OnnxOpConverter):
    """Base for tvmseq converters (same interface as TVM's)."""

    @staticmethod
    def node_name(attr) -> str:
        return attr["tvm_custom"]["name"]


class TvmseqGraphImporter(_tvm_onnx.ONNXGraphImporter):
    """TVM's graph importer with tvmseq's converters taking precedence."""

    def __init__(self, *args, options: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = dict(options or {})

    def _check_for_unsupported_ops(self, graph):
        stock = _tvm_onnx._get_convert_map()
        missing = sorted({n.op_type for n in graph.node
                          if n.op_type not in CONVERTERS and n.op_type not in stock
                          and n.op_type not in ("If", "Constant")})
        if missing:
            raise TvmseqError("the model uses ONNX operators that neither tvmseq nor TVM's Relax "
                              f"frontend supports: {', '.join(missing)}")

    def _convert_operator(self, op_name, inputs, attrs, opset):
        if op_name not in CONVERTERS:
            return super()._convert_operator(op_name, inputs, attrs, opset)
        attrs["tvm_custom"]["importer_options"] = self.options
        sym = CONVERTERS[op_name].get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
        return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym


def _opset_of(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


def load_model(model) -> onnx.ModelProto:
    """Accept a ModelProto, a path or serialized bytes; raise TvmseqError when it does not parse."""
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, (bytes, bytearray)):
            return onnx.load_from_string(bytes(model))
        return onnx.load(str(model))
    except FileNotFoundError as err:
        raise TvmseqError(f"ONNX model file not found: {model}") from err
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise TvmseqError(f"could not parse ONNX model {model!r}: {err}") from err


def from_onnx(model, shape_dict: dict | None = None, dtype_dict=None, target=None, **options) -> tvm.IRModule:
    """Import an ONNX model into a Relax IRModule with tvmseq kernels inserted as call_tir calls.

    `target` (a name or tvm Target, default: the GPU if present else llvm) chooses which schedule the
    inserted kernels get; `options` reach the converters (e.g. sparse_threshold=0.9)."""
    from .. import targets

    from .sparse import preprocess_sparse

    model = load_model(model)
    # sparse_initializer / Constant(sparse_value): TVM's importer reads neither; tvmseq records them as CSR
    model, options = preprocess_sparse(model, options)
    if model.ir_version < 3:
        raise TvmseqError(f"ONNX IR version {model.ir_version} is too old (need 3 or newer)")
    options["target"] = targets.resolve(target)
    importer = TvmseqGraphImporter(shape_dict, dtype_dict if dtype_dict is not None else {}, options=options)
    try:
        mod = importer.from_onnx(model.graph, _opset_of(model))
    except TvmseqError:
        raise
    except tvm.error.OpNotImplemented as err:
        raise TvmseqError(str(err)) from err
    checks = importer.options.get("input_checks")
    if checks:  # value checks on graph inputs, run by tvmseq.runtime before the model
        mod["main"] = mod["main"].with_attr("tvmseq_input_checks", json.dumps(checks))
    return mod
