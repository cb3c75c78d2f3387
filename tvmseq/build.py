"""Compile: Relax IRModule (from the importer) -> executable for cuda or llvm; export to one .so.

`compile_onnx` options of the whole model (the importer's options pass through):
- `cuda_graph=True` (CUDA targets): the model is recorded as one to run in CUDA graphs: `tvmseq.runtime.Model`
  captures each call, whole (`tvmseq.cuda_graph`: every kernel, the per-step recurrences' launch loops
  included), once per input shape and replays it as one launch. (`tvmseq.load(path, cuda_graph=True)` does
  the same for any CUDA model.) `cuda_graph_bounds` ({"seq": 1000}) caps symbolic dims: a call above the
  cap is refused in one line, so a stream of ever-new lengths cannot capture without end. TVM's own Relax
  rewrite (`relax.backend.use_cuda_graph`) is not used: it leaves out of the graph every kernel whose
  output size is symbolic and every host loop, which were most of the call's time.
- `expose_state=True`: every GRU/RNN/LSTM state becomes a graph input/output (`tvmseq.onnx.expose_state`),
  for `tvmseq.Stream`.
- `weights="inputs"`: float initializers of `weights_min_elements` (1024) elements or more become parameters of
  `main` instead of constants in the executable, so the exported `.so` stays small (benchmarks ship
  models to the GPU machine this way); `Model.set_weights` uploads them once. Except the biases and peepholes
  of GRU/RNN/LSTM nodes (a few KB): the importer folds them into the biases its kernels take, at import.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from . import targets
from .errors import TvmseqError

WEIGHTS_MODES = ("embedded", "inputs")
WEIGHT_MIN_ELEMENTS = 1024
_FLOAT_TYPES = (1, 10, 11, 16)    # TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16


def build_relax(mod: tvm.IRModule, target, tuned=None) -> tvm.runtime.Executable:
    """TVM's default Relax pipeline for the target (dlight schedules every stock op on CUDA; tvmseq's
    kernels are marked scheduled and left as they are). llvm: tvmseq.schedule_cpu's rules schedule the stock ops; `tuned`: a MetaSchedule database
    directory (`tvmseq tune`) applied first (tvmseq.tune.model)."""
    target = targets.resolve(target)
    from .tune.model import relax_pipeline  # schedule_gpu's pipeline on GPUs; CPU rules on llvm; the database

    with target, tvm.transform.PassContext(opt_level=3):
        try:
            return tvm.compile(mod, target=target, relax_pipeline=relax_pipeline(target, tuned))
        except TvmseqError:
            raise
        except Exception as err:  # noqa: BLE001 - TVM raises ValueError, RuntimeError, InternalError...
            # a TVM pass that cannot take the model: one line (where it failed and why), not TVM's traceback
            raise TvmseqError(f"TVM could not compile the model for {target.kind.name}: "
                              f"{type(err).__name__}: {_last_line(err)}") from err


def _last_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


def _dim_name(dim) -> str:
    # a symbolic dim's own name: printing renames a var called "T" to "T_1" (T is the TIR script prefix)
    return dim.name if isinstance(dim, tvm.tirx.Var) else str(dim)


def symbolic_dims(mod: tvm.IRModule) -> list[str]:
    """Names of the symbolic dims of main's parameters."""
    names = []
    for p in mod["main"].params:
        shape = getattr(p.ty, "shape", None)
        for d in (shape.values if shape is not None else []):
            if not isinstance(d, tvm.tirx.IntImm) and _dim_name(d) not in names:
                names.append(_dim_name(d))
    return names


def check_cuda_graph_bounds(mod: tvm.IRModule, bounds: dict | None) -> dict:
    """`cuda_graph_bounds` checked against main's symbolic dims: {dim name: largest size a call may have}."""
    bounds = dict(bounds or {})
    dims = symbolic_dims(mod)
    unknown = sorted(set(bounds) - set(dims))
    if unknown:
        raise TvmseqError(f"cuda_graph_bounds names {', '.join(unknown)}, which are not symbolic dims of the "
                          f"model's inputs ({', '.join(dims) or 'none'})")
    for name, value in bounds.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TvmseqError(f"cuda_graph_bounds[{name!r}] = {value!r}: must be a positive int")
    return bounds


def _describe(ty):
    if isinstance(ty, relax.TupleType):
        return [_describe(f) for f in ty.fields]
    shape = None if ty.shape is None else [int(d) if isinstance(d, tvm.tirx.IntImm) else _dim_name(d)
                                              for d in ty.shape.values]
    return {"shape": shape, "dtype": str(ty.dtype)}


def signature_of(mod: tvm.IRModule, onnx_model=None, weight_names=(), state_pairs=(), original_names=None) -> dict:
    """Names, shapes (symbolic dims as strings) and dtypes of main's parameters and outputs. With the
    ONNX model: each parameter's ONNX input name (TVM's importer renames names that are not identifiers,
    e.g. "31" -> "input_31", and "a.b" -> "a_b"), which are weights, the graph's output names, and the
    recurrent state pairs (input -> output) for streaming."""
    main = mod["main"]
    checks = json.loads(str(main.attrs["tvmseq_input_checks"])) if main.attrs and \
        "tvmseq_input_checks" in main.attrs else {}
    inputs = [{"name": p.name, **_describe(p.ty), "checks": checks.get(p.name, [])} for p in main.params]
    from .kernels.projection.gemm import IN_PLACE_ALIGN

    for spec, in_place in zip(inputs, in_place_inputs(mod)):
        if in_place:   # the byte boundary a call may pass it at: the runtime checks the array's address against it
            spec["in_place"] = IN_PLACE_ALIGN
    sig = {"inputs": inputs, "outputs": _describe(main.ret_ty)}
    if onnx_model is not None:
        graph = onnx_model.graph
        inits = {t.name for t in graph.initializer}
        original_names = original_names or {}
        onnx_inputs = [original_names.get(i.name, i.name) for i in graph.input if i.name not in inits]
        if len(onnx_inputs) == len(inputs):
            weights = set(weight_names)
            for spec, onnx_name in zip(inputs, onnx_inputs):
                spec["onnx_name"] = onnx_name
                if onnx_name in weights:
                    spec["weight"] = True
        sig["output_names"] = [o.name for o in graph.output]
        if state_pairs:
            sig["state"] = [{"node": p.node, "input": p.input, "output": p.output} for p in state_pairs]
    return sig


def in_place_inputs(mod: tvm.IRModule) -> list[bool]:
    """Per parameter of main: whether a call may pass it in place at any 16-byte boundary instead of copying it into
    a 64-byte aligned buffer: everything that reads it, directly or through reshapes (views), is a tvmseq kernel
    whose PrimFunc lists that argument in `IN_PLACE_ATTR` (the CPU input projection). Any other use (a stock op,
    an output, a branch, a match_cast) keeps the copy."""
    from tvm.relax.analysis import free_vars

    from .kernels.projection.gemm import IN_PLACE_ATTR

    main = mod["main"]
    reshape, call_tir = tvm.ir.Op.get("relax.reshape"), tvm.ir.Op.get("relax.call_tir")
    origin = {p: i for i, p in enumerate(main.params)}     # a param, or a reshape of one -> the param's index
    ok = [True] * len(main.params)

    def taken_in_place(call, position: int) -> bool:
        func = mod[call.args[0]] if isinstance(call.args[0], tvm.ir.GlobalVar) else None
        return func is not None and func.attrs is not None and IN_PLACE_ATTR in func.attrs and \
            position in [int(i) for i in func.attrs[IN_PLACE_ATTR]]

    body = main.body
    for block in body.blocks:
        for binding in block.bindings:
            value, used = binding.value, [v for v in free_vars(binding.value) if v in origin]
            if not used:
                continue
            if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call):
                if value.op.same_as(reshape) and value.args[0] in origin:
                    origin[binding.var] = origin[value.args[0]]
                    continue
                if value.op.same_as(call_tir) and isinstance(value.args[1], relax.Tuple):
                    args = list(value.args[1].fields)
                    if all(taken_in_place(value, i) for i, a in enumerate(args) if a in origin) and \
                            not any(v in origin for a in value.args[2:] for v in free_vars(a)):
                        continue
            for v in used:
                ok[origin[v]] = False
    for v in free_vars(body.body):
        if v in origin:
            ok[origin[v]] = False
    return ok


def lift_weights(model, min_elements: int = WEIGHT_MIN_ELEMENTS):
    """(copy of the ONNX model with its large float initializers turned into graph inputs, {name: array}).
    The biases (and LSTM peepholes) of recurrent nodes stay initializers whatever their size: the importer
    derives the biases its kernels take from them in numpy (`onnx.gru.fold_biases`), where as graph inputs they
    would be sliced and added by kernels on every call."""
    import onnx
    from onnx import helper, numpy_helper

    from .onnx.gru import folded_initializers

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    kept, values = [], {}
    folded = folded_initializers(graph)
    for init in graph.initializer:
        size = int(np.prod(init.dims)) if init.dims else 1
        if init.data_type in _FLOAT_TYPES and size >= min_elements and init.name not in folded:
            values[init.name] = numpy_helper.to_array(init)
        else:
            kept.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for inp in [i for i in graph.input if i.name in values]:
        graph.input.remove(inp)          # old exporters list initializers as inputs too
    for name, arr in values.items():
        graph.input.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype),
                                                         list(arr.shape)))
    return model, values


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def safe_input_names(model):
    """(copy of the ONNX model whose graph inputs all have names that stay C identifiers through TVM's
    importer, {new name: original name}). TVM only turns '.' into '_' and prefixes a leading digit, so an
    input named like torch's '/layer/GRU.initial_h' or 'onnx::GRU_202' reaches the generated CUDA source as
    a parameter name that does not compile."""
    import onnx

    renames = {}
    taken = {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer} | \
        {o for n in model.graph.node for o in n.output}
    for inp in model.graph.input:
        if _IDENTIFIER.fullmatch(inp.name.replace(".", "_")):
            continue
        base = "input_" + re.sub(r"[^A-Za-z0-9_]", "_", inp.name).strip("_")
        new, k = base, 1
        while new in taken:
            new, k = f"{base}_{k}", k + 1
        taken.add(new)
        renames[inp.name] = new
    if not renames:
        return model, {}
    model = onnx.ModelProto.FromString(model.SerializeToString())

    def rename(graph):
        for value in list(graph.input) + list(graph.output):
            if value.name in renames:
                value.name = renames[value.name]
        for init in graph.initializer:
            if init.name in renames:
                init.name = renames[init.name]
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = renames[name]
            for attr in node.attribute:          # If/Loop bodies read outer names
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    rename(sub)

    rename(model.graph)
    return model, {new: old for old, new in renames.items()}


def prepare_proto(model, target, expose_state: bool, weights: str, weights_min_elements: int, options: dict):
    """(ONNX model as the importer takes it, its state pairs, {lifted weight: array}): loaded, its recurrent state
    exposed when asked, and for weights="inputs" its GRU stacks fused and its large weights lifted to inputs.
    `compile_onnx` and `tune.model.import_for_tuning` import through it, so a database's records match."""
    from .onnx.expose_state import existing_state_pairs
    from .onnx.expose_state import expose_state as _expose
    from .onnx.importer import load_model

    if weights not in WEIGHTS_MODES:
        raise TvmseqError(f"weights={weights!r}: must be one of {WEIGHTS_MODES}")
    proto = load_model(model)
    if expose_state:
        proto, pairs = _expose(proto)
    else:
        pairs = existing_state_pairs(proto)
    weight_values = {}
    if weights == "inputs":
        from .onnx.stack import fuse_gru_stacks

        # stacks are found through their initializers: fuse first, then lift the weights
        proto = fuse_gru_stacks(proto, {**options, "target": target})
        proto, weight_values = lift_weights(proto, weights_min_elements)
    return proto, pairs, weight_values


def compile_onnx(model, target=None, shape_dict=None, dtype_dict=None, *, cuda_graph: bool = False,
                 cuda_graph_bounds: dict | None = None, expose_state: bool = False, weights: str = "embedded",
                 weights_min_elements: int = WEIGHT_MIN_ELEMENTS, max_graph_shapes: int = 8, tuned=None, **options):
    """ONNX model -> `tvmseq.runtime.Model` ready to run on the target's device (module doc for the options)."""
    from .onnx import from_onnx
    from .runtime import Model

    target = targets.resolve(target)
    proto, pairs, weight_values = prepare_proto(model, target, expose_state, weights, weights_min_elements, options)
    proto, original_names = safe_input_names(proto)
    if shape_dict or isinstance(dtype_dict, dict):
        renamed = {v: k for k, v in original_names.items()}
        shape_dict = {renamed.get(k, k): v for k, v in (shape_dict or {}).items()} or shape_dict
        if isinstance(dtype_dict, dict):
            dtype_dict = {renamed.get(k, k): v for k, v in dtype_dict.items()}
    mod = from_onnx(proto, shape_dict, dtype_dict, target=target, **options)
    signature = signature_of(mod, proto, weight_values, pairs, original_names)
    if cuda_graph:
        if not targets.is_gpu(target):
            raise TvmseqError(f"cuda_graph=True needs a CUDA target, got {target.kind.name}")
        signature["cuda_graph"] = {"bounds": check_cuda_graph_bounds(mod, cuda_graph_bounds)}
    elif cuda_graph_bounds:
        raise TvmseqError("cuda_graph_bounds is given without cuda_graph=True")
    mod = lift_weight_transforms(mod, signature)
    executable = build_relax(mod, target, tuned=tuned)
    return Model(executable, target, signature, weights=weight_values or None, max_graph_shapes=max_graph_shapes)


def lift_weight_transforms(mod: tvm.IRModule, signature: dict) -> tvm.IRModule:
    """Weights kept out of the executable (graph inputs after the feeds): what `main` computes from them alone (a
    transpose, padding, the tf32x3 split of a projection's W) moves into `main_transform_params` (TVM's
    LiftTransformParams), which `Model` runs once when the weights are set; `main` then takes its results in
    their place (signature["transform_params"]). Without it each call redid that work."""
    specs = signature["inputs"]
    feeds = sum(1 for s in specs if not s.get("weight"))
    if feeds == len(specs) or any(s.get("weight") for s in specs[:feeds]):
        return mod   # no weights kept out, or not all after the feeds (then nothing is lifted)
    mod = tvm.IRModule(dict(mod.functions), attrs=mod.attrs, global_infos=mod.global_infos)
    mod["main"] = mod["main"].with_attr("num_input", feeds)
    lifted = relax.transform.LiftTransformParams()(mod)
    if "main_transform_params" not in [gv.name_hint for gv in lifted.get_global_vars()]:
        return mod
    signature["transform_params"] = True
    return lifted


def kernel_calls(executable, function: str = "main") -> list[str]:
    """Names of the functions `function` of a built model (a `runtime.Model`, or its Relax VM executable) calls
    on every call, in order, from its VM code; the VM's own bookkeeping (`vm.builtin.*`: allocations, views,
    tuples, shape checks) left out. Each is one compiled function: a stock op (fused), or a tvmseq kernel (one
    launch; the per-step recurrences loop on the host and launch two kernels a step)."""
    executable = getattr(executable, "executable", executable)
    text = executable.as_text()
    head = f"@{function}:"
    if head not in text:
        raise TvmseqError(f"the executable has no VM function {function!r}")
    calls = []
    for line in text.split(head, 1)[1].splitlines()[1:]:
        line = line.strip()
        if not line or line.startswith("@"):
            break
        if line.startswith("call "):
            name = line.split()[1]
            if not name.startswith("vm.builtin."):
                calls.append(name)
    return calls


def export(model, path) -> Path:
    """Write the compiled model to `path` (.so) and its signature beside it (`path`.json), with the .so's
    size and sha256 (checked before it is loaded: a damaged library can crash the loading process)."""
    from .runtime import file_digest

    path = Path(path)
    if path.suffix != ".so":
        raise TvmseqError(f"output file must end in .so, got {path}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        model.executable.export_library(str(path))
    except OSError as err:
        raise TvmseqError(f"cannot write {path}: {err.strerror or err}") from None
    size, sha = file_digest(path)
    meta = {"target": str(model.target.kind.name), "target_json": str(model.target),
            "tvm": tvm.__version__, "size": size, "sha256": sha, "signature": model.signature}
    Path(str(path) + ".json").write_text(json.dumps(meta, indent=1))
    return path
