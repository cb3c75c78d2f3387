"""`tvmseq build`: compile tvmseq's kernels ahead of time into `artifacts/<arch>/` + `manifest.json`.

The build/export step of the pipeline (compute -> schedule -> tune -> **build/export** -> load -> import):

* `tvmseq build MODEL.onnx [--shape X=...]`: runs the importer once in recording mode
  (`from_onnx(..., record_kernels=[...])`), so the kernels built are exactly those the importer's
  `emit_kernel` will ask `tvmseq.artifacts.find_kernel` for (same op, sizes, dtype, attributes and
  schedule hash), compiles each one alone and exports it with `artifacts.export_artifact`.
* `tvmseq build --tuned`: the GEMMs tuned in `schedules/gemm/`, with the database's best trace applied
  (`tune.metaschedule.compile_tuned`, as `best_schedule` / `tuned_func` do).

For a CUDA architecture (default sm_90a) the modules carry device code compiled by nvcc for it
(`cuda_toolchain.enable_device_binaries`): built on a machine without a GPU, they load on the GPU machine
without any compiler. That loads TVM's CUDA runtime against a driver stub, which cannot be undone, so
CUDA builds run in one spawned worker process. `--arch cpu` builds for this CPU (llvm).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TvmseqError


@dataclass
class BuildReport:
    arch: str
    root: str
    built: list = field(default_factory=list)       # ArtifactEntry
    failed: list = field(default_factory=list)      # (kernel, error)
    not_prebuildable: list = field(default_factory=list)   # TIR functions not emitted through emit_kernel


def default_root() -> Path:
    import os

    env = os.environ.get("TVMSEQ_ARTIFACTS", "").strip()
    if env and env.lower() not in ("0", "off", "none"):
        return Path(env)
    return Path(__file__).resolve().parents[1] / "artifacts"


def resolve_arch(arch: str | None):
    """(arch name, target JSON) for "sm_90a", "sm_80", ... (CUDA, the matching tvmseq target tag) or
    "cpu" / "llvm" / "cpu-<machine>" (this CPU)."""
    import tvm

    from . import cuda_toolchain, targets

    arch = (arch or "sm_90a").strip()
    if arch in ("cpu", "llvm") or arch.startswith("cpu-"):
        if arch.startswith("cpu-") and arch != cuda_toolchain.cpu_arch():
            raise TvmseqError(f"--arch {arch}: CPU artifacts can only be built for this machine "
                              f"({cuda_toolchain.cpu_arch()})")
        return cuda_toolchain.cpu_arch(), json.loads(str(tvm.target.Target("llvm")))
    if cuda_toolchain._sm(arch) is None:
        raise TvmseqError(f"--arch {arch!r}: expected a CUDA architecture such as sm_90a or sm_80, or cpu")
    base = arch.rstrip("af")
    tag = targets._ARCH_TAGS.get(base, targets.DEFAULT_GPU_TAG)
    return arch, json.loads(str(tvm.target.Target(tag, host="llvm")))


def kernel_requests(model, target, shape_dict=None, **options):
    """(KernelRequests the importer emits for `model`, names of tvmseq TIR functions it adds without
    emit_kernel): the first are what `tvmseq build` can prebuild."""
    import tvm

    from .onnx import from_onnx

    requests: list = []
    mod = from_onnx(model, shape_dict, target=target, record_kernels=requests, **options)
    recorded = {r.name_hint for r in requests}
    others = sorted(gv.name_hint for gv, f in mod.functions.items()
                    if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint not in recorded)
    unique, seen = [], set()
    for r in requests:
        if r.artifact_name not in seen:
            seen.add(r.artifact_name)
            unique.append(r)
    return unique, others


def _describe(request) -> str:
    sizes = " ".join(f"{k}={v}" for k, v in request.key.manifest_shapes().items())
    dyn = "".join(f" {d}=any" for d in request.key.dynamic)
    short = lambda v: v if len(str(v)) <= 40 else f"{str(v)[:37]}..."  # noqa: E731
    attrs = ", ".join(f"{k}={short(v)}" for k, v in request.key.attrs.items())
    return f"{request.op} {sizes}{dyn} {request.key.dtype}" + (f" ({attrs})" if attrs else "")


def build_request(request, target, arch: str, root: Path):
    """Compile one recorded kernel alone and export it as `<root>/<arch>/<artifact name>.so`."""
    import tvm

    from . import artifacts
    from .onnx.importer import schedule_hash

    name = request.artifact_name
    func = request.func.with_attr("global_symbol", name)
    with target:
        executable = tvm.compile(tvm.IRModule({name: func}), target=target)
    return artifacts.export_artifact(
        executable, root, op=request.op, name=name, shapes=request.key.manifest_shapes(), dtype=request.key.dtype,
        signature=request.signature, arch=arch, attrs=request.key.manifest_attrs(),
        schedule_hash=schedule_hash(request.func), function=name)


def _tuned_jobs(target, db: Path, problems=None):
    """(problem, why not) for the GEMMs in the tuning database; `why not` is None when buildable."""
    from .tune import metaschedule

    out = []
    database = metaschedule.open_database(db)
    for problem in metaschedule.tuned_problems(db):
        if problems and problem.key not in problems:
            continue
        top = database.get_top_k(database.commit_workload(metaschedule.workload_mod(problem)), 1)
        kind = top[0].target.kind.name if top and top[0].target is not None else None
        why = None if kind in (None, target.kind.name) else \
            f"its best schedule in {db} is for {kind}, not {target.kind.name}"
        out.append((problem, why))
    return out


def _run(job: dict) -> BuildReport:
    """The whole build (runs in a spawned worker for CUDA)."""
    import tvm

    from . import cuda_toolchain

    target = tvm.target.Target(job["target"])
    arch, root = job["arch"], Path(job["root"])
    report = BuildReport(arch, str(root))
    gpu = target.kind.name == "cuda"
    if gpu:
        if not cuda_toolchain.enable_device_binaries((arch,)):
            print(f"warning: no nvcc: the {arch} artifacts carry CUDA source (compiled where they are loaded)")
    todo, names = [], set()     # (label, build function)
    for model, model_name in job["models"]:
        t0 = time.perf_counter()
        requests, others = kernel_requests(model, target, job.get("shapes"), **job.get("options", {}))
        requests = [r for r in requests if r.artifact_name not in names]
        names.update(r.artifact_name for r in requests)
        print(f"{model_name}: {len(requests)} tvmseq kernel(s) to build for {arch} "
              f"(imported in {time.perf_counter() - t0:.1f} s)", flush=True)
        if others:
            report.not_prebuildable += others
            print(f"  not prebuildable (their converter does not go through importer.emit_kernel yet; they are "
                  f"compiled with the model): {', '.join(others)}", flush=True)
        todo += [(_describe(r), lambda r=r: build_request(r, target, arch, root)) for r in requests]
    if job.get("tuned"):
        from .tune import metaschedule

        db = Path(job.get("db") or metaschedule.SCHEDULES_ROOT / "gemm")
        jobs = _tuned_jobs(target, db, job.get("problems"))
        print(f"tuned GEMMs in {db}: {len(jobs)}", flush=True)
        for problem, why in jobs:
            if why:
                print(f"  skipped {problem.key}: {why}", flush=True)
                report.failed.append((problem.key, why))
                continue
            todo.append((f"gemm {problem.key} (tuned)", lambda p=problem: metaschedule._export_one(
                (p, json.loads(str(target)), root, arch, db))))
    for i, (label, build) in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {label} ...", end=" ", flush=True)
        start = time.perf_counter()
        try:
            entry = build()
        except Exception as err:  # noqa: BLE001 - one failed kernel does not stop the others
            msg = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            print(f"FAILED ({msg[:300]})", flush=True)
            report.failed.append((label, msg[:300]))
            continue
        report.built.append(entry)
        print(f"{time.perf_counter() - start:.1f} s -> {root / arch / entry.file} ({entry.device_code}, "
              f"{entry.schedule_hash})", flush=True)
    return report


def build(models=(), *, shapes: dict | None = None, tuned: bool = False, arch: str | None = "sm_90a",
          out=None, db=None, problems=None, **options) -> BuildReport:
    """Build the kernels of `models` (ONNX paths, bytes or ModelProtos; one alone is fine) and/or the
    tuned GEMMs into `<out>/<arch>/` (+ manifest.json). `options` reach the importer (e.g.
    sparse_threshold). Returns a BuildReport (built entries, failures, kernels not prebuildable)."""
    import concurrent.futures
    import multiprocessing

    from .onnx.importer import load_model

    if models is None or isinstance(models, (str, Path, bytes, bytearray)) or hasattr(models, "graph"):
        models = [] if models is None else [models]
    if not models and not tuned:
        raise TvmseqError("nothing to build: give an ONNX model and/or --tuned")
    arch, target_json = resolve_arch(arch)
    root = Path(out) if out is not None else default_root()
    job = {"target": target_json, "arch": arch, "root": str(root), "tuned": tuned, "db": str(db) if db else None,
           "problems": problems, "shapes": shapes, "options": options, "models": []}
    for i, model in enumerate(models):
        proto = load_model(model)      # TvmseqError for a missing or unparsable file, here and now
        name = str(model) if isinstance(model, (str, Path)) else f"model {i}"
        job["models"].append((proto.SerializeToString(), name))
    if target_json["kind"] != "cuda":
        report = _run(job)
    else:
        from .tune.metaschedule import _workers_can_import_tvmseq

        _workers_can_import_tvmseq()
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            report = pool.submit(_run, job).result()
    print(f"built {len(report.built)} artifact(s) in {Path(report.root) / report.arch}"
          + (f", {len(report.failed)} failed" if report.failed else ""), flush=True)
    return report
