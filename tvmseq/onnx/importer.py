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

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..errors import TvmseqError, UnsupportedOnnxError
from . import graph_prep
from .loop import LoopConverter, with_dims, with_sizes

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
    from .. import artifacts, cuda_toolchain, targets

    gpu = target.kind.name == "cuda"
    if gpu and not targets.has_gpu():
        return None, None       # nothing to load a GPU artifact on here: compile
    arch = cuda_toolchain.present_arch() if gpu else cuda_toolchain.cpu_arch()
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


# ops whose TVM converters take a relax.ShapeExpr input as it is (the stock importer's list); every other
# op gets such an input as an int64 tensor
_SHAPE_COMPATIBLE_OPS = {"Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand",
                         "Concat", "Equal", "Where", "Cast", "CastLike", "Squeeze"}
# float16 ops computed in float32 (TvmseqGraphImporter._float16_in_float32), on these targets
_FLOAT16_IN_FLOAT32 = {"MatMul", "Gemm", "Conv"}
_FLOAT16_IN_FLOAT32_TARGETS = ("llvm", "cuda")
_TUPLE_RESULT_OPS = {"Optional", "OptionalGetElement", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
                     "SequenceInsert", "ConcatFromSequence", "SplitToSequence"}


_STATIC_OPS = {"relax.equal": np.equal, "relax.not_equal": np.not_equal, "relax.less": np.less,
               "relax.less_equal": np.less_equal, "relax.greater": np.greater,
               "relax.greater_equal": np.greater_equal, "relax.logical_and": np.logical_and,
               "relax.logical_or": np.logical_or, "relax.logical_not": np.logical_not, "relax.where": np.where,
               "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
               "relax.divide": lambda a, b: _divide(a, b)}


def _divide(a, b):
    """ONNX / TVM division: integers truncate toward zero (numpy's // floors)."""
    if np.issubdtype(np.result_type(a, b), np.integer):
        return (np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)).astype(np.result_type(a, b))
    return np.divide(a, b)


def _static_value(bb, expr, depth: int = 0):
    """A numpy value of `expr` where it follows from constants and static dims alone (shape_to_tensor of a shape,
    take of it at constant indices, arithmetic, comparisons and logic of such values), else None. A shape's
    symbolic dims are None in an object array until a take leaves only numbers."""
    if depth > 32:
        return None
    if isinstance(expr, relax.Var):
        bound = bb.lookup_binding(expr)
        return None if bound is None else _static_value(bb, bound, depth + 1)
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    if isinstance(expr, relax.ShapeExpr):
        dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in expr.values]
        return np.array(dims, "int64") if None not in dims else np.array(dims, object)
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    if expr.op.name == "relax.shape_of":     # the shape its operand's type knows, whatever its values
        shape = getattr(getattr(expr.args[0], "ty", None), "shape", None)
        return _static_value(bb, shape, depth + 1) if isinstance(shape, relax.ShapeExpr) else None
    if expr.op.name == "relax.where":      # the branch a static condition takes (a Gather's negative-index fix)
        cond = _static_value(bb, expr.args[0], depth + 1)
        if cond is not None and cond.dtype != object and (cond.all() or not cond.any()):
            return _static_value(bb, expr.args[1 if cond.all() else 2], depth + 1)
    args = [_static_value(bb, a, depth + 1) for a in expr.args]
    if any(a is None for a in args):
        return None
    name = expr.op.name
    if name == "relax.shape_to_tensor":
        return args[0]
    if name == "relax.take":
        axis = expr.attrs.axis
        taken = np.take(args[0], args[1].astype("int64"), axis=None if axis is None else int(axis))
        return None if taken.dtype == object and any(v is None for v in taken.reshape(-1)) else taken.astype("int64")
    if any(a.dtype == object for a in args):
        return None
    if name == "relax.astype":
        return args[0].astype(str(expr.attrs.dtype))
    return _STATIC_OPS[name](*args) if name in _STATIC_OPS else None


_SYMBOLIC_OPS = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
                 "relax.divide": np.vectorize(lambda a, b: tvm.tirx.truncdiv(a, b), otypes=[object]),
                 "relax.floor_divide": np.vectorize(lambda a, b: tvm.tirx.floordiv(a, b), otypes=[object]),
                 "relax.maximum": np.vectorize(lambda a, b: tvm.tirx.max(a, b), otypes=[object]),
                 "relax.minimum": np.vectorize(lambda a, b: tvm.tirx.min(a, b), otypes=[object])}
_INT_DTYPES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def _symbolic_value(bb, expr, depth: int = 0):
    """The elements of a small integer value of shape arithmetic as int64 PrimExprs (an object array of rank 0
    or 1) where they follow from dims, symbolic or static, and constants: shape_of / shape_to_tensor of a shape,
    casts between integer types (a dim's value is the same in int32: tf2onnx computes shapes so), take at
    constant indices, slices of constant bounds, concat, reshapes, add / subtract / multiply / divide (truncating) / max / min. Else None."""
    if depth > 64:
        return None
    if isinstance(expr, relax.Var):
        bound = bb.lookup_binding(expr)
        if bound is None:
            shape = getattr(expr, "ty", None)
            return np.array(list(shape.values), object) if isinstance(shape, relax.ShapeType) \
                and shape.values is not None else None
        return _symbolic_value(bb, bound, depth + 1)
    if isinstance(expr, tvm.ir.GenericConst):
        value = expr.value.numpy()
        if value.dtype.kind not in "iub" or value.ndim > 1 or value.size > 64:
            return None
        return np.array([tvm.tirx.IntImm("int64", int(v)) for v in value.reshape(-1)], object).reshape(value.shape)
    if isinstance(expr, relax.ShapeExpr):
        return np.array(list(expr.values), object)
    if isinstance(expr, relax.Tuple):
        return None
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    name = expr.op.name
    if name == "relax.shape_of":
        shape = getattr(getattr(expr.args[0], "ty", None), "shape", None)
        return np.array(list(shape.values), object) if isinstance(shape, relax.ShapeExpr) else None
    if name == "relax.concat":
        fields = expr.args[0].fields if isinstance(expr.args[0], relax.Tuple) else None
        if fields is None and isinstance(expr.args[0], relax.Var):
            bound = bb.lookup_binding(expr.args[0])
            fields = bound.fields if isinstance(bound, relax.Tuple) else None
        parts = [_symbolic_value(bb, f, depth + 1) for f in fields or [None]]
        if any(p is None or p.ndim != 1 for p in parts):
            return None
        return np.concatenate(parts).astype(object)
    value = _symbolic_value(bb, expr.args[0], depth + 1) if expr.args else None
    if value is None:
        return None
    if name in ("relax.shape_to_tensor", "relax.tensor_to_shape"):
        return value
    if name == "relax.astype":
        return value if str(expr.attrs.dtype) in _INT_DTYPES else None
    if name in ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten"):
        shape = getattr(expr.ty, "shape", None)
        if not isinstance(shape, relax.ShapeExpr) or len(shape.values) > 1 \
                or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
            return None
        return value.reshape([int(d) for d in shape.values])
    if name == "relax.strided_slice":
        bounds = [_int_tuple(a) for a in expr.args[1:5]]
        if value.ndim != 1 or any(b is None or len(b) != 1 for b in bounds) or bounds[0][0] != 0:
            return None
        return value[slice(bounds[1][0], bounds[2][0], bounds[3][0])]
    if name == "relax.take":
        index = _static_value(bb, expr.args[1])
        if index is None or index.dtype == object or value.ndim != 1 or index.ndim > 1:
            return None
        return np.take(value, index.astype("int64")).astype(object)
    if name in _SYMBOLIC_OPS:
        other = _symbolic_value(bb, expr.args[1], depth + 1)
        if other is None:
            return None
        analyzer = tvm.sym.Analyzer()
        result = np.asarray(_SYMBOLIC_OPS[name](value, other), object)
        return np.vectorize(analyzer.simplify, otypes=[object])(result) if result.size else result
    return None


def _int_tuple(expr):
    """The ints of a ShapeExpr or a tuple of PrimValues (strided_slice's axes and bounds), else None."""
    if isinstance(expr, relax.ShapeExpr):
        values = list(expr.values)
    elif isinstance(expr, relax.Tuple):
        values = [f if isinstance(f, tvm.tirx.IntImm) else getattr(f, "value", None) for f in expr.fields]
    else:
        return None
    return [int(v) for v in values] if all(isinstance(v, tvm.tirx.IntImm) for v in values) else None


def one_line(err: BaseException) -> str:
    """The gist of an exception from TVM or a converter, on one line (no IR, no C++ backtrace)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Traceback", "File ", "at ", "0:", "1:", "2:", "3:"))]
    text = lines[0] if lines else type(err).__name__
    if "Check failed:" in text and " is false: " in text:      # TVM's ICHECK: keep the explanation
        text = text.split(" is false: ", 1)[1] or text
    return text if len(text) <= 300 else text[:297] + "..."


def _walk_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk_nodes(attr.g)
            for sub in attr.graphs:
                yield from _walk_nodes(sub)


def check_onnx_ops(model: onnx.ModelProto) -> None:
    """Refuse default-domain ops that ONNX does not define (onnxruntime refuses them too), before
    folding could drop them as dead code."""
    unknown = sorted({n.op_type for n in _walk_nodes(model.graph)
                      if n.domain in ("", "ai.onnx") and n.op_type not in CONVERTERS
                      and not onnx.defs.has(n.op_type)})
    if unknown:
        raise TvmseqError(f"the model uses operators that ONNX does not define: {', '.join(unknown)}")


class TvmseqGraphImporter(_tvm_onnx.ONNXGraphImporter):
    """TVM's graph importer with tvmseq's converters taking precedence, `If` branches in scopes of
    their own (or inlined where the condition is a constant), and one UnsupportedOnnxError naming the
    node for anything a converter cannot take."""

    def __init__(self, *args, options: dict | None = None, value_shapes: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = dict(options or {})
        self.value_shapes = value_shapes or {}     # ONNX shape inference: name -> dims
        self._size_vars: dict[str, tvm.tirx.Var] = {}

    def _check_for_unsupported_ops(self, graph):
        stock = _tvm_onnx._get_convert_map()
        missing = sorted({(f"{n.domain}::" if n.domain not in ("", "ai.onnx") else "") + n.op_type
                          for n in _walk_nodes(graph)
                          if n.op_type not in CONVERTERS and n.op_type not in stock
                          and n.op_type not in ("If", "Loop", "Constant")})
        if missing:
            raise TvmseqError("the model uses ONNX operators that neither tvmseq nor TVM's Relax "
                              f"frontend supports: {', '.join(missing)}")

    def _parse_graph_input(self, graph):
        super()._parse_graph_input(graph)
        for var in self._inputs.values():       # symbolic input dims by name, for If results
            shape = getattr(var.ty, "shape", None)
            for dim in (shape.values if isinstance(shape, relax.ShapeExpr) else []):
                if isinstance(dim, tvm.tirx.Var):
                    self._size_vars.setdefault(dim.name, dim)

    def _construct_nodes(self, graph):
        for node in graph.node:
            self._convert_node(node)

    def _convert_node(self, node):
        name = node.name or (node.output[0] if node.output else node.op_type)
        try:
            if node.op_type == "If":
                self._convert_if(node, name)
            elif node.op_type == "Loop":
                results = LoopConverter(self, node, name).convert()
                for out, value in zip(node.output, results):     # dims from ONNX's inference, else fresh ones
                    value = self._with_inferred_shape(out, value)
                    self._nodes[out] = with_dims(self.bb, value, "".join(c if c.isalnum() else "_" for c in out))
            else:
                self._convert_plain(node, name)
        except TvmseqError:
            raise
        except Exception as err:  # noqa: BLE001 - TVM and its converters raise many types
            raise UnsupportedOnnxError(name, node.op_type, one_line(err)) from err

    def _node_inputs(self, node, op_name: str):
        inputs = _tvm_onnx.onnx_input()
        takes_shapes = op_name in _SHAPE_COMPATIBLE_OPS or getattr(CONVERTERS.get(op_name), "takes_shape_expr", False)
        for i in node.input:
            value = self._nodes[i] if i else None
            if value is not None and not takes_shapes and isinstance(value, relax.Expr) \
                    and isinstance(value.ty, relax.ShapeType):
                value = self.bb.normalize(relax.op.shape_to_tensor(value))
            inputs.append(value)
        return inputs

    def _convert_plain(self, node, name: str):
        attr = self._parse_attr(node.attribute)
        inputs = self._node_inputs(node, node.op_type)
        attr["tvm_custom"] = {"name": node.name, "num_outputs": len(node.output)}
        half = self._float16_in_float32(node, inputs, attr)
        op = self._convert_operator(node.op_type, inputs, attr, self.opset)
        if half:
            op = self.bb.normalize(relax.op.astype(self.bb.emit(op), "float16"))
        if node.op_type in _TUPLE_RESULT_OPS:
            results = [op]
        elif isinstance(op, relax.Tuple):
            results = list(op.fields)
        elif isinstance(op.ty, relax.TupleType):
            results = [self.bb.emit(relax.TupleGetItem(op, i)) for i in range(len(op.ty.fields))]
        else:
            results = [op]
        if len(node.output) > len(results):
            raise ValueError(f"the converter returned {len(results)} outputs, the node has {len(node.output)}")
        for out, value in zip(node.output, results):
            self._nodes[out] = self._with_inferred_shape(out, value)

    def _float16_in_float32(self, node, inputs, attr) -> bool:
        """A float16 MatMul / Gemm / Conv computed in float32 and its result rounded to float16, as onnxruntime's CPU
        provider computes it (it casts around the float16 ops it has no kernel for) and as cuBLAS / cuDNN accumulate
        float16 products: TVM's ops sum in their output dtype, and summed in float16 a Keras mixed-precision CRNN's
        1280-long products drifted by 0.05 from onnxruntime's logits on the CPU, 0.03 on the H200 (mk8dx's number
        recognition model; dlight does not put these on tensor cores on sm_90a, so the GPU loses no tensor-core
        rate). Rewrites `inputs` in place (constants converted here, so the CPU weight layouts still see constants);
        True where it did. A product with a sparse operand stays on tvmseq's float16 kernels."""
        from .sparse import _sparse_operands

        target = self.options.get("target")
        values = [v for v in inputs if isinstance(v, relax.Expr)]
        if node.op_type not in _FLOAT16_IN_FLOAT32 or target is None \
                or target.kind.name not in _FLOAT16_IN_FLOAT32_TARGETS or not values \
                or not all(isinstance(v.ty, relax.TensorType) and str(v.ty.dtype) == "float16" for v in values):
            return False
        probe = {"tvm_custom": {**attr["tvm_custom"], "importer_options": self.options}}
        if node.op_type != "Conv" and _sparse_operands(inputs, probe, node.op_type):
            return False
        for k, v in enumerate(inputs):
            if isinstance(v, tvm.ir.GenericConst):
                inputs[k] = relax.const(v.value.numpy().astype(np.float32))
            elif isinstance(v, relax.Expr):
                inputs[k] = self.bb.normalize(relax.op.astype(v, "float32"))
        return True

    # -- If ---------------------------------------------------------------------------------------
    def _constant_condition(self, cond):
        """The If condition's value where the import decides it (a constant, or a comparison of static dims the
        graph reads with Shape -> Gather: silero v3's `x.squeeze(1) if x.shape[1] == 1`, whose branches differ in
        rank), else None."""
        if isinstance(cond, tvm.tirx.IntImm):          # a relax.prim_value
            return bool(cond.value)
        values = _static_value(self.bb, cond)
        return bool(values.reshape(-1)[0]) if values is not None and values.size == 1 else None

    def _convert_if(self, node, name: str):
        attr = self._parse_attr(node.attribute)
        cond = self._nodes[node.input[0]]
        known = self._constant_condition(cond)
        if known is not None:          # decided at import: the taken branch's nodes join the graph
            results = self._inline_branch(attr["then_branch" if known else "else_branch"])
        else:
            cond = self._scalar_condition(cond)
            hint = "".join(c if c.isalnum() else "_" for c in name)
            result = self.bb.emit(relax.If(cond, self._branch(attr["then_branch"], f"{hint}_then"),
                                           self._branch(attr["else_branch"], f"{hint}_else")))
            results = [result] if len(node.output) == 1 else \
                [self.bb.emit(relax.TupleGetItem(result, i)) for i in range(len(node.output))]
        for out, value in zip(node.output, results):
            self._nodes[out] = self._with_inferred_shape(out, value)

    def _scalar_condition(self, cond):
        if isinstance(cond, relax.Expr) and isinstance(cond.ty, relax.TensorType) and cond.ty.ndim != 0:
            cond = self.bb.emit(relax.op.reshape(cond, []))       # ONNX allows a one-element tensor
        return cond

    def _branch_outputs(self, graph):
        for init in graph.initializer:
            self._nodes[init.name] = relax.const(self._parse_array(init))
        for node in graph.node:
            self._convert_node(node)
        outputs = []
        for out in graph.output:
            value = self._nodes[out.name]
            if isinstance(value, relax.Expr) and isinstance(value.ty, (relax.ShapeType, tvm.ir.PrimType)):
                value = self.bb.emit(relax.op.shape_to_tensor(value) if isinstance(value.ty, relax.ShapeType)
                                     else relax.op.full((), value, str(value.ty.dtype)))
            outputs.append(value)
        return outputs

    def _inline_branch(self, graph):
        outer = dict(self._nodes)
        try:
            return self._branch_outputs(graph)
        finally:
            self._nodes = outer

    def _branch(self, graph, hint: str):
        """A branch as a call of a function of its own, so only the branch taken runs. (Inlined into
        the If, TVM's static memory planner lets the else branch reuse storage the then branch
        allocates: a crash when the else branch runs.)"""
        outer = dict(self._nodes)
        self.bb._begin_binding_block()
        try:
            outputs = self._branch_outputs(graph)
            body = self.bb.emit(outputs[0] if len(outputs) == 1 else relax.Tuple(outputs))
        finally:
            block = self.bb._end_block()
            self._nodes = outer
        return self._as_call(relax.SeqExpr([block], body), hint)

    def _as_call(self, seq: relax.SeqExpr, hint: str):
        free = list(relax.analysis.free_vars(seq))
        params, args = with_sizes(free, list(free), seq)
        func = relax.utils.copy_with_new_vars(relax.Function(params, seq, seq.body.ty, is_pure=True))
        return relax.Call(self.bb.add_func(func, hint), args)

    # -- shapes Relax cannot derive ---------------------------------------------------------------
    def _size_var(self, dim_name: str | None) -> tvm.tirx.Var:
        if dim_name is None:
            return tvm.tirx.Var(f"dim{len(self._size_vars)}", "int64")
        if dim_name not in self._size_vars:
            safe = "".join(c if c.isalnum() else "_" for c in dim_name)
            self._size_vars[dim_name] = tvm.tirx.Var(safe, "int64")
        return self._size_vars[dim_name]

    def _with_inferred_shape(self, name: str, value):
        """A tensor whose shape Relax lost (an If whose branches differ, a data-dependent op) gets the
        rank and dims ONNX shape inference found, checked at run time by a match_cast."""
        if not isinstance(value, relax.Expr) or not isinstance(value.ty, relax.TensorType) \
                or isinstance(value.ty.shape, relax.ShapeExpr) or name not in self.value_shapes:
            return value
        dims = self.value_shapes[name]
        if value.ty.ndim not in (-1, len(dims)):
            return value
        shape = [tvm.tirx.IntImm("int64", d) if isinstance(d, int) else self._size_var(d) for d in dims]
        return self.bb.match_cast(value, relax.TensorType(shape, value.ty.dtype))

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


def _close_blocks(bb) -> None:
    """End the binding block TVM's function scope leaves open when a conversion fails (else TVM warns
    "BlockBuilder destroyed with remaining blocks" on stderr)."""
    for _ in range(8):
        try:
            bb._end_block()
        except Exception:  # noqa: BLE001 - no block left
            return


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

    from .checks import check_options
    from .sparse import preprocess_sparse

    check_options(options)     # a misspelled option is an error, not silently ignored
    artifacts = options.pop("artifacts", _DEFAULT)
    model = load_model(model)
    # sparse_initializer / Constant(sparse_value): TVM's importer reads neither; tvmseq records them as CSR
    model, options = preprocess_sparse(model, options)
    if model.ir_version < 3:
        raise TvmseqError(f"ONNX IR version {model.ir_version} is too old (need 3 or newer)")
    options["target"] = targets.resolve(target)
    from .stack import fuse_gru_stacks

    check_onnx_ops(model)
    # shape arithmetic and If on static sizes folded, symbolic dims kept (graph_prep's doc)
    model = graph_prep.prepare(model, options, shape_dict)
    model = fuse_gru_stacks(model, options)   # GRU -> Squeeze -> GRU chains -> one pipelinable node
    options[ARTIFACTS_OPTION] = resolve_artifacts_root(options["target"], artifacts)
    # an input with a named (symbolic) dim keeps the dims pin_input_dims wrote into the graph: TVM's importer
    # takes a shape_dict entry as ints
    shape_dict = {k: v for k, v in (shape_dict or {}).items()
                  if all(isinstance(d, (int, np.integer)) for d in v)} or None
    importer = TvmseqGraphImporter(shape_dict, dtype_dict if dtype_dict is not None else {}, options=options,
                                   value_shapes=graph_prep.value_shapes(model))
    try:
        with warnings.catch_warnings():      # the frontend warns about every renamed or unknown input
            warnings.filterwarnings("ignore", message=r"(Renaming name|Input .* has unknown)")
            mod = importer.from_onnx(model.graph, _opset_of(model))
    except TvmseqError:
        _close_blocks(importer.bb)
        raise
    except Exception as err:  # noqa: BLE001 - graph-level failures (inputs, outputs) from TVM
        _close_blocks(importer.bb)
        raise TvmseqError(f"could not import the ONNX graph: {one_line(err)}") from err
    checks = importer.options.get("input_checks")
    if checks:  # value checks on graph inputs, run by tvmseq.runtime before the model
        mod["main"] = mod["main"].with_attr("tvmseq_input_checks", json.dumps(checks))
    return mod
