"""Compile: Relax IRModule (from the importer) -> executable for cuda or llvm; export to one .so."""
from __future__ import annotations

import json
from pathlib import Path

import tvm
from tvm import relax

from . import targets
from .errors import TvmseqError


def build_relax(mod: tvm.IRModule, target) -> tvm.runtime.Executable:
    """TVM's default Relax pipeline for the target (dlight schedules every stock op on CUDA; tvmseq's
    kernels are marked scheduled and left as they are)."""
    target = targets.resolve(target)
    with target:
        return tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target))


def signature_of(mod: tvm.IRModule) -> dict:
    """Names, shapes (symbolic dims as strings) and dtypes of main's parameters and outputs."""
    main = mod["main"]

    def describe(ty):
        if isinstance(ty, relax.TupleType):
            return [describe(f) for f in ty.fields]
        shape = None if ty.shape is None else [int(d) if isinstance(d, tvm.tirx.IntImm) else str(d)
                                                  for d in ty.shape.values]
        return {"shape": shape, "dtype": str(ty.dtype)}

    checks = json.loads(str(main.attrs["tvmseq_input_checks"])) if main.attrs and \
        "tvmseq_input_checks" in main.attrs else {}
    return {"inputs": [{"name": p.name, **describe(p.ty), "checks": checks.get(p.name, [])}
                       for p in main.params],
            "outputs": describe(main.ret_ty)}


def compile_onnx(model, target=None, shape_dict=None, dtype_dict=None, **options):
    """ONNX model -> `tvmseq.runtime.Model` ready to run on the target's device."""
    from .onnx import from_onnx
    from .runtime import Model

    target = targets.resolve(target)
    mod = from_onnx(model, shape_dict, dtype_dict, target=target, **options)
    return Model(build_relax(mod, target), target, signature_of(mod))


def export(model, path) -> Path:
    """Write the compiled model to `path` (.so) and its signature beside it (`path`.json)."""
    path = Path(path)
    if path.suffix != ".so":
        raise TvmseqError(f"output file must end in .so, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    model.executable.export_library(str(path))
    meta = {"target": str(model.target.kind.name), "target_json": str(model.target),
            "tvm": tvm.__version__, "signature": model.signature}
    Path(str(path) + ".json").write_text(json.dumps(meta, indent=1))
    return path
