"""`tvmseq compile | run | check | demo | bench | tune | build`: every user error is one line and exit code 2."""
from __future__ import annotations

import argparse
import sys
import time

from .errors import TvmseqError

BENCHMARKS = ("gru", "persistent_gru", "persistent_rnn", "persistent_lstm", "gru_stack", "lstm_stack",
              "lstm_floor", "input_projection", "recurrent_gemm", "spmm", "topk", "model", "cpu")


def _parse_shapes(items) -> dict:
    """--shape NAME=D1,D2,...: each dim a positive integer, or a name that keeps it symbolic (X=1,T,64)."""
    shapes = {}
    for item in items or []:
        name, sep, dims = item.partition("=")
        parts = [d.strip() for d in dims.split(",")] if "," in dims else dims.split("x")
        if not sep or not all(_is_int(p) or p.isidentifier() for p in parts):
            raise TvmseqError(f"--shape {item!r}: expected name=d1,d2,... (e.g. X=100,8,64, or X=1,T,64 where T "
                              f"stays symbolic)")
        shapes[name] = [int(p) if _is_int(p) else p for p in parts]
        if any(isinstance(d, int) and d < 1 for d in shapes[name]):
            raise TvmseqError(f"--shape {item!r}: every dimension must be a positive integer or a name")
    return shapes


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def _check_shape_names(model_path: str, shapes: dict) -> None:
    """--shape names must be graph inputs of the model, each with as many dims as the input has (checked before
    compiling; a model that does not load is left to the compiler, which reports it)."""
    if not shapes:
        return
    import onnx

    try:
        graph = onnx.load(model_path, load_external_data=False).graph
    except Exception:  # noqa: BLE001 - unreadable or unparsable: compile_onnx gives the one-line error
        return
    weights = {t.name for t in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in weights]
    unknown = [name for name in shapes if name not in inputs]
    if unknown:
        raise TvmseqError(f"--shape {unknown[0]}: the model has no input named {unknown[0]!r} (inputs: {inputs})")
    for value in graph.input:
        tensor = value.type.tensor_type
        if value.name in shapes and tensor.HasField("shape") and len(tensor.shape.dim) != len(shapes[value.name]):
            raise TvmseqError(f"--shape {value.name}: {len(shapes[value.name])} dims given, the model's input has "
                              f"{len(tensor.shape.dim)}")


def _check_writable_file(path: str, flag: str) -> None:
    """The output file's directory exists and is writable (checked before the work that would produce it)."""
    import os
    from pathlib import Path

    target = Path(path)
    if target.is_dir():
        raise TvmseqError(f"{flag} {path}: is a directory, expected a file name")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise TvmseqError(f"{flag} {path}: {parent} {why}")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise TvmseqError(f"{flag} {path}: not writable")


def _output_dir(path: str):
    """--output-dir as a directory, created if missing; a one-line error when it cannot be."""
    from pathlib import Path

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise TvmseqError(f"--output-dir {path}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise TvmseqError(f"--output-dir {path}: cannot create it: {err.strerror or err}") from None
    import os

    if not os.access(out, os.W_OK | os.X_OK):
        raise TvmseqError(f"--output-dir {path}: not writable")
    return out


def cmd_compile(args):
    from . import build

    shapes = _parse_shapes(args.shape)
    _check_writable_file(args.output, "-o")
    _check_shape_names(args.model, shapes)
    t0 = time.perf_counter()
    model = build.compile_onnx(args.model, target=args.target, shape_dict=shapes, tuned=args.tuned)
    try:
        path = build.export(model, args.output)
    except OSError as err:
        raise TvmseqError(f"-o {args.output}: cannot write it: {err.strerror or err}") from None
    print(f"compiled {args.model} for {model.target_kind} in {time.perf_counter() - t0:.1f} s -> {path}")


def cmd_run(args):
    import numpy as np

    from .runtime import load_model

    if args.output_dir:   # refused before the model runs
        _output_dir(args.output_dir)
    model = load_model(args.model)
    feeds = {}
    for item in args.input or []:
        name, sep, path = item.partition("=")
        if not sep:
            raise TvmseqError(f"--input {item!r}: expected name=file.npy")
        try:
            feeds[name] = np.load(path)
        except EOFError:
            raise TvmseqError(f"--input {name}: cannot read {path}: the file is empty or truncated") from None
        except (OSError, ValueError) as err:
            raise TvmseqError(f"--input {name}: cannot read {path}: {err}") from None
    outputs = model.named(model(**feeds))
    files = _output_files(list(outputs))
    for i, (name, out) in enumerate(outputs.items()):
        line = f"output {i}: shape {list(out.shape)} dtype {out.dtype} ({name})"
        if args.output_dir:
            from pathlib import Path

            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            path = Path(args.output_dir) / files[name]
            np.save(path, out)
            line += f" -> {path}"
        print(line)


def _output_files(names) -> dict:
    """`<ONNX output name>.npy` for each output, with characters a file name cannot hold (or should not:
    '/', spaces) replaced by '_', made unique."""
    import re

    files, used = {}, set()
    for name in names:
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "output"
        candidate, n = stem, 1
        while candidate in used:
            candidate, n = f"{stem}_{n}", n + 1
        used.add(candidate)
        files[name] = f"{candidate}.npy"
    return files


def cmd_demo(args):
    from .demo import run_demo

    run_demo(target=args.target)


CPU_BENCHMARKS = ("cpu",)   # benchmarks that need neither a GPU nor PyTorch's CUDA


def _require_gpu_and_torch(op: str) -> None:
    hint = "(its kernels build without one: --build DIR here, --prebuilt DIR on the GPU machine)"
    try:
        import torch  # noqa: F401 - the peer every GPU benchmark times against
    except ImportError:
        raise TvmseqError(f"tvmseq bench {op} needs a GPU and PyTorch: PyTorch is not installed {hint}") from None
    from .targets import has_gpu

    if not has_gpu():
        raise TvmseqError(f"tvmseq bench {op} needs a GPU and PyTorch: no CUDA GPU visible {hint}")


def cmd_bench(args):
    import importlib

    if getattr(args, "unavailable", None):
        raise TvmseqError(f"tvmseq bench {args.op}: cannot load the benchmark: {args.unavailable}")
    only_builds = any(getattr(args, flag, None) for flag in ("build", "build_only", "smoke_cpu"))
    if args.op not in CPU_BENCHMARKS and not only_builds:
        _require_gpu_and_torch(args.op)
    module = importlib.import_module(f".bench.{args.op}", __package__)
    module.run(args)


TUNE_OPS = ("gemm", "persistent_gru", "persistent_mma", "persistent_lstm", "step_gemm", "recurrent_gemm", "spmm",
            "topk")


def _tune_model(args) -> None:
    """`tvmseq tune MODEL.onnx --target T --trials N [--shape ..] [-o DB]` (tvmseq.tune.model)."""
    parser = argparse.ArgumentParser(prog="tvmseq tune MODEL.onnx", description="tune a model's stock operators "
                                     "with MetaSchedule (tvmseq's kernels are left as they are)")
    parser.add_argument("--target", default=None, help="cuda or llvm (default: cuda if a GPU is present)")
    parser.add_argument("--trials", type=int, default=64, help="measured candidates in all (default 64)")
    parser.add_argument("--shape", action="append", metavar="NAME=D1,D2,...",
                        help="tune at this input shape (dynamic dims default to 64)")
    parser.add_argument("-o", "--output", default="tuning_db", metavar="DB_DIR", help="database directory")
    parser.add_argument("--cost-model", default="auto", help="auto (xgb if installed, else random), xgb, mlp, random")
    parser.add_argument("--strategy", default="evolutionary",
                        help="evolutionary (MetaSchedule's default) or replay-trace (random sampling, less overhead)")
    parser.add_argument("--max-tasks", type=int, default=None, metavar="N",
                        help="tune only the N heaviest functions (FLOPs x calls); the rest keep the default schedules")
    parser.add_argument("--trials-per-iter", type=int, default=None, metavar="K",
                        help="candidates per task each round (default: trials / tasks, 8 to 64)")
    opts = parser.parse_args(args.rest)
    from .tune import model as tune_model

    shapes = _parse_shapes(opts.shape)
    _check_shape_names(args.op, shapes)
    report = tune_model.tune_model(args.op, target=opts.target, trials=opts.trials, shapes=shapes,
                                   work_dir=opts.output, cost_model=opts.cost_model, strategy=opts.strategy,
                                   max_tasks=opts.max_tasks, trials_per_iter=opts.trials_per_iter)
    print(tune_model.format_report(report))


def cmd_tune(args):
    """`tvmseq tune MODEL.onnx ...` tunes a model; `tvmseq tune OP ...` runs schedules/tune_<op>.py (a checkout
    file, not part of the wheel) with the remaining arguments."""
    import importlib.util
    from pathlib import Path

    if args.op.endswith(".onnx") or Path(args.op).is_file():
        if not Path(args.op).is_file():
            raise TvmseqError(f"tune {args.op}: no such file")
        return _tune_model(args)
    if args.op not in TUNE_OPS:
        raise TvmseqError(f"tune {args.op!r}: expected a model (.onnx) or one of {', '.join(TUNE_OPS)}")
    script = Path(__file__).resolve().parents[1] / "schedules" / f"tune_{args.op}.py"
    if not script.exists():
        raise TvmseqError(f"no tuning script {script} (tuning runs from a source checkout)")
    spec = importlib.util.spec_from_file_location(f"tune_{args.op}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(args.rest)
    if code:
        raise SystemExit(code)


def cmd_build(args):
    from . import prebuild

    report = prebuild.build(args.models, shapes=_parse_shapes(args.shape), tuned=args.tuned, arch=args.arch,
                            out=args.out, db=args.db)
    if report.failed:
        raise TvmseqError(f"{len(report.failed)} kernel(s) not built: "
                          + "; ".join(f"{k}: {why}" for k, why in report.failed))



def _parse_lengths(items) -> dict:
    lengths = {}
    for item in items or []:
        name, sep, values = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            lengths[name] = [int(v) for v in values.split(",")]
        except ValueError:
            raise TvmseqError(f"--lengths {item!r}: expected AXIS=v1,v2,... (e.g. seq=5,50)") from None
        if any(v < 1 for v in lengths[name]):
            raise TvmseqError(f"--lengths {item!r}: every size must be a positive integer")
    return lengths


def _read_inputs(items) -> dict:
    import numpy as np

    feeds = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            raise TvmseqError(f"--input {item!r}: expected name=file.npy")
        try:
            feeds[name] = np.load(path)
        except EOFError:
            raise TvmseqError(f"--input {name}: cannot read {path}: the file is empty or truncated") from None
        except (OSError, ValueError) as err:
            raise TvmseqError(f"--input {name}: cannot read {path}: {err}") from None
    return feeds


def cmd_check(args):
    """Compare with onnxruntime; exit 1 on a mismatch (user errors: 2, through main)."""
    from . import check

    shapes = _parse_shapes(args.shape)
    if args.json:
        _check_writable_file(args.json, "--json")
    report = check.check(args.model, target=args.target, shapes=shapes, inputs=_read_inputs(args.input),
                         lengths=_parse_lengths(args.lengths), compiled=args.compiled, rtol=args.rtol,
                         atol=args.atol, repeats=args.repeats)
    print(check.format_table(report))
    if args.json:
        check.write_json(report, args.json)
    if not report.ok:
        raise SystemExit(1)

def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        args.func(args)
    except TvmseqError as err:
        print(f"tvmseq: error: {err}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvmseq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile an ONNX model into one .so")
    p.add_argument("model")
    p.add_argument("-o", "--output", required=True, help="output .so (a .so.json with its signature is written beside)")
    p.add_argument("--target", default=None, help="cuda or llvm (default: cuda if a GPU is present)")
    p.add_argument("--shape", action="append", metavar="NAME=D1,D2,...", help="fix an input's shape")
    p.add_argument("--tuned", default=None, metavar="DB_DIR", help="apply a MetaSchedule database (tvmseq tune MODEL)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run a compiled model on .npy inputs")
    p.add_argument("model")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    p.add_argument("--output-dir", default=None, help="save each output as <its ONNX name>.npy here")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("check", help="compare a model's outputs through tvmseq with onnxruntime's (CPU) on random "
                       "or given inputs at several sizes of each dynamic axis; exit 1 on a mismatch")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("--target", default=None, help="cuda or llvm (default: cuda if a GPU is present)")
    p.add_argument("--shape", action="append", metavar="NAME=D1,D2,...", help="fix an input's shape")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="feed this input instead of random data")
    p.add_argument("--lengths", action="append", metavar="AXIS=V1,V2,...",
                   help="sizes to try for a dynamic axis (default: 3,7)")
    p.add_argument("--compiled", default=None, metavar="MODEL.so",
                   help="check this exported tvmseq model (tvmseq compile) instead of compiling here")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: 1e-4 fp32, 1e-2 fp16)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: 1e-5 fp32, 1e-3 fp16)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (median reported)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("demo", help="compile and run a built-in GRU model, check it, time it")
    p.add_argument("--target", default=None)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("tune", help="tune a model's stock operators (tvmseq tune MODEL.onnx --target T --trials N "
                       "[--shape ..] [-o DB_DIR]), or an operator's schedules: gemm (genetic search / MetaSchedule), "
                       "or measured sweeps of the hand-scheduled kernels (build here, run on the GPU, merge here)")
    p.add_argument("op", metavar="MODEL.onnx|OP", help=f"an ONNX model, or one of: {', '.join(TUNE_OPS)}")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options (model) or arguments for schedules/tune_<op>.py")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("build", help="prebuild kernels (a model's, and/or the tuned GEMMs) into "
                       "artifacts/<arch>/ + manifest.json, for the importer and direct use")
    p.add_argument("models", nargs="*", metavar="MODEL.onnx", help="ONNX model(s) whose tvmseq kernels to build")
    p.add_argument("--shape", action="append", metavar="NAME=D1,D2,...", help="fix an input's shape")
    p.add_argument("--tuned", action="store_true", help="also build the tuned GEMMs of schedules/gemm/")
    p.add_argument("--arch", default="sm_90a", help="sm_90a (default), sm_80, ... or cpu (this machine, llvm)")
    p.add_argument("--out", default=None, metavar="ROOT",
                   help="artifact root: files go to ROOT/<arch>/ (default: $TVMSEQ_ARTIFACTS or artifacts/)")
    p.add_argument("--db", default=None, help="tuning database for --tuned (default: schedules/gemm)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("bench", help="benchmark a kernel against its peer (needs a GPU and torch)")
    bench_sub = p.add_subparsers(dest="op", required=True)
    for op in BENCHMARKS:
        bp = bench_sub.add_parser(op)
        try:
            import importlib

            importlib.import_module(f".bench.{op}", __package__).add_arguments(bp)
        except ImportError as err:
            bp.set_defaults(unavailable=str(err))
    p.set_defaults(func=cmd_bench)
    return parser


if __name__ == "__main__":
    sys.exit(main())
