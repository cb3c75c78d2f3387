"""ONNX -> Relax: TVM's Relax ONNX frontend for every op it knows, plus tvmseq's converters.

TVM's frontend keeps its converters in a map built by `_get_convert_map()` and offers no hook, so
`TvmseqGraphImporter` subclasses its graph importer and consults `CONVERTERS` first. A converter
follows the frontend's convention: a class with `_impl_vN(cls, bb, inputs, attr, params)` classmethods
(`get_converter(opset)` picks the newest N <= opset); it emits tvmseq kernels through `emit_kernel`.

`emit_kernel` is the one place where a converter's kernel enters the model. Compiling for a GPU (or
with `artifacts=DIR` / `$TVMSEQ_ARTIFACTS` set), it first asks `tvmseq.artifacts.find_kernel` for a
prebuilt kernel of the same op, sizes, dtype and attributes (`tvmseq build` makes them) and, when one
fits, emits `call_dps_packed` of that artifact's function (registered by tvmseq.runtime) instead of
adding the TIR function, which then is not compiled at all. A missing, corrupt, mismatched (arch, TVM
version, file hash) or stale artifact (its schedule hash differs from the kernel the converter would
emit now) gives an ArtifactWarning and the TIR function is compiled as usual. `tvmseq build` runs the
importer with `record_kernels=[...]` to learn which kernels a model needs.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import TvmseqError, UnsupportedOnnxError

# op_type -> converter class (an OnnxOpConverter subclass); filled by `register_converter`.
CONVERTERS: dict[str, type] = {}


# importer options of the node being converted (for emit_kernel)
_OPTIONS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tvmseq_importer_options", default=None)
_DEFAULT = object()          # from_onnx(artifacts=...) not given
ARTIFACTS_OPTION = "artifacts_root"      # Path or None (lookup off)
RECORD_OPTION = "record_kernels"         # a list: `tvmseq build` collects KernelRequests, no lookup


def register_converter(op_type: str):
    """Class decorator: route ONNX nodes of `op_type` to this converter instead of TVM's."""

    def wrap(cls):
        CONVERTERS[op_type] = cls
        return cls

    return wrap


def add_input_check(attr, input_name: str, check: dict):
    """Record a value check on a graph input; `tvmseq.runtime.Model` runs it before the model."""
    attr["tvm_custom"]["importer_options"].setdefault("input_checks", {}).setdefault(input_name, []).append(check)


# ---------------------------------------------------------------------------------------------------
# Kernels: prebuilt artifact or compiled TIR (emit_kernel)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelKey:
    """What a kernel is built for, as the artifact manifest records it: the static sizes by name, the
    dtype, the other attributes the kernel depends on (JSON values), and the size names left symbolic
    (the kernel takes any value of them; they are not in `shapes`)."""

    shapes: dict
    dtype: str
    attrs: dict = field(default_factory=dict)
    dynamic: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "dtype", str(self.dtype))    # a relax dtype object is fine too
        object.__setattr__(self, "dynamic", tuple(self.dynamic))

    def manifest_attrs(self) -> dict:
        return json.loads(json.dumps({**self.attrs, "dynamic": sorted(self.dynamic)}))

    def manifest_shapes(self) -> dict:
        return {k: int(v) for k, v in self.shapes.items()}


@dataclass
class KernelRequest:
    """A kernel a model needs (recorded for `tvmseq build`)."""

    op: str
    key: KernelKey
    func: object                  # the PrimFunc the converter emits (global_symbol stripped)
    signature: dict               # inputs/outputs: {"name", "shape" (ints, symbolic names), "dtype"}
    name_hint: str

    @property
    def artifact_name(self) -> str:
        """Stable file/function name: op, sizes, dtype and a digest of everything in the key."""
        blob = json.dumps([self.op, self.key.manifest_shapes(), self.key.dtype, self.key.manifest_attrs()],
                          sort_keys=True)
        sizes = "_".join(f"{k}{v}" for k, v in sorted(self.key.manifest_shapes().items()))
        parts = [self.op, sizes, *(f"{d}dyn" for d in sorted(self.key.dynamic)), self.key.dtype,
                 hashlib.sha1(blob.encode()).hexdigest()[:8]]
        return "_".join(p for p in parts if p)


def schedule_hash(func) -> str:
    """Hash of a kernel's TIR (compute + schedule) as printed: an artifact built from other kernel code
    (an edited tvmseq/kernels/ module, another TVM printer) does not match."""
    text = func.without_attr("global_symbol").script()
    return "tir:" + hashlib.sha1(text.encode()).hexdigest()[:16]


def resolve_artifacts_root(target, artifacts=_DEFAULT) -> Path | None:
    """Where the importer looks for prebuilt kernels: `artifacts` when given (None: nowhere), else
    $TVMSEQ_ARTIFACTS when set ("", "0", "off": nowhere), else the checkout's artifacts/ for GPU
    targets and nowhere for CPU targets."""
    if artifacts is None:
        return None
    if artifacts is not _DEFAULT:
        return Path(artifacts)
    env = os.environ.get("TVMSEQ_ARTIFACTS")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "none") else Path(env)
    if target.kind.name == "cuda":
        return Path(__file__).resolve().parents[2] / "artifacts"
    return None


def _describe(ty) -> dict:
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in ty.shape.values]
    return {"shape": shape, "dtype": str(ty.dtype)}


def _signature(func, args, out_ty) -> dict:
    outs = list(out_ty) if isinstance(out_ty, (list, tuple)) else [out_ty]
    names = [p.name for p in func.params]
    inputs = [{"name": names[i] if i < len(names) else f"in{i}", **_describe(a.ty)} for i, a in enumerate(args)]
    outputs = [{"name": names[len(args) + i] if len(args) + i < len(names) else f"out{i}", **_describe(t)}
               for i, t in enumerate(outs)]
    return {"inputs": inputs, "outputs": outputs}


def _find_artifact(op: str, key: KernelKey, root: Path, target, make_func: Callable[[], object]):
    """A loaded, current artifact for this kernel, or None (with an ArtifactWarning when one was found
    but cannot be used)."""
    from .. import artifacts, targets

    gpu = target.kind.name == "cuda"
    if gpu and not targets.has_gpu():
        return None, None       # nothing to load a GPU artifact on here: compile
    arch = artifacts.present_arch() if gpu else artifacts.cpu_arch()
    kernel = artifacts.find_kernel(op, key.manifest_shapes(), key.dtype, key.manifest_attrs(), root=root, arch=arch)
    if kernel is None:
        return None, None
    want = schedule_hash(make_func())
    if kernel.entry.schedule_hash.startswith("tir:") and kernel.entry.schedule_hash != want:
        warnings.warn(f"artifact {kernel.entry.file} ({kernel.entry.name}) is stale: built from kernel code with "
                      f"schedule hash {kernel.entry.schedule_hash}, the importer's kernel has {want}; "
                      "compiling instead (rebuild with `tvmseq build`)", artifacts.ArtifactWarning, stacklevel=4)
        return None, None
    arch_dir = next((d for d in (root / kernel.entry.arch, root / arch) if (d / kernel.entry.file).exists()),
                    root / kernel.entry.arch)
    return kernel, arch_dir


def emit_kernel(bb, op: str, key: KernelKey, prim_func_factory: Callable[[], object], args, out_sinfo, *,
                name_hint: str | None = None, signature: dict | None = None, options: dict | None = None):
    """Emit one tvmseq kernel call on `args` with outputs `out_sinfo` (a TensorType or a list of them,
    destination-passing style: the kernel's parameters are args then outputs) and return the emitted
    call. `prim_func_factory()` makes the kernel's PrimFunc (called only when it is needed).

    With an artifact for (op, key) on this machine: `call_dps_packed` of the artifact's function, no
    TIR added. Otherwise: the PrimFunc is added (global_symbol stripped, named `name_hint`) and called
    with `call_tir`. `signature` (for the artifact's manifest: {"inputs": [...], "outputs": [...]} of
    {"name", "shape", "dtype"}, shapes in ints and size names) defaults to the shapes of `args` and
    `out_sinfo`: pass it where the kernel takes more than this call's shapes (e.g. any nnz).
    `options` default to the importer options of the node being converted."""
    from ..runtime import register_artifact

    options = options if options is not None else (_OPTIONS.get() or {})
    target = options.get("target")
    made: list = []

    def func():
        if not made:
            made.append(prim_func_factory())
        return made[0]

    record = options.get(RECORD_OPTION)
    root = options.get(ARTIFACTS_OPTION)
    if record is None and root is not None and target is not None:
        kernel, arch_dir = _find_artifact(op, key, Path(root), target, func)
        if kernel is not None:
            name = register_artifact(kernel, arch_dir)
            return bb.emit(relax.call_dps_packed(relax.ExternFunc(name), list(args), out_sinfo))
    prim = func().without_attr("global_symbol")
    gv = bb.add_func(prim, name_hint or f"tvmseq_{op}")
    if record is not None:
        record.append(KernelRequest(op, key, prim, signature or _signature(prim, args, out_sinfo), gv.name_hint))
    return bb.emit(relax.call_tir(gv, list(args), out_sinfo))


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
        token = _OPTIONS.set(self.options)
        try:
            sym = CONVERTERS[op_name].get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
        finally:
            _OPTIONS.reset(token)
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
    """Import an ONNX model into a Relax IRModule with tvmseq kernels inserted as call_tir calls (or
    call_dps_packed of prebuilt artifacts, see `emit_kernel`).

    `target` (a name or tvm Target, default: the GPU if present else llvm) chooses which schedule the
    inserted kernels get; `options` reach the converters (e.g. sparse_threshold=0.9).
    `artifacts=DIR` looks for prebuilt kernels in DIR/<arch>/, `artifacts=None` never; not given:
    $TVMSEQ_ARTIFACTS if set, else the checkout's artifacts/ for GPU targets, none for CPU targets.
    `record_kernels=[]` (what `tvmseq build` passes) collects a KernelRequest per kernel instead."""
    from .. import targets

    from .sparse import preprocess_sparse

    artifacts = options.pop("artifacts", _DEFAULT)
    model = load_model(model)
    # sparse_initializer / Constant(sparse_value): TVM's importer reads neither; tvmseq records them as CSR
    model, options = preprocess_sparse(model, options)
    if model.ir_version < 3:
        raise TvmseqError(f"ONNX IR version {model.ir_version} is too old (need 3 or newer)")
    options["target"] = targets.resolve(target)
    from .stack import fuse_gru_stacks

    model = fuse_gru_stacks(model, options)   # GRU -> Squeeze -> GRU chains -> one pipelinable node
    options[ARTIFACTS_OPTION] = resolve_artifacts_root(options["target"], artifacts)
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
