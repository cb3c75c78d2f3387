"""`tvmseq compile | run | demo | bench | tune | build`: every user error is one line and exit code 2."""
from __future__ import annotations

import argparse
import sys
import time

from .errors import TvmseqError

BENCHMARKS = ("gru", "persistent_gru", "persistent_rnn", "gru_stack", "input_projection", "recurrent_gemm", "spmm", "topk")


def _parse_shapes(items) -> dict:
    shapes = {}
    for item in items or []:
        name, sep, dims = item.partition("=")
        try:
            if not sep:
                raise ValueError
            shapes[name] = [int(d) for d in dims.replace("x", ",").split(",")]
        except ValueError:
            raise TvmseqError(f"--shape {item!r}: expected name=d1,d2,... (e.g. X=100,8,64)") from None
    return shapes


def cmd_compile(args):
    from . import build

    t0 = time.perf_counter()
    model = build.compile_onnx(args.model, target=args.target, shape_dict=_parse_shapes(args.shape))
    path = build.export(model, args.output)
    print(f"compiled {args.model} for {model.target_kind} in {time.perf_counter() - t0:.1f} s -> {path}")


def cmd_run(args):
    import numpy as np

    from .runtime import load_model

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
    outputs = model(**feeds)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for i, out in enumerate(outputs):
        line = f"output {i}: shape {list(out.shape)} dtype {out.dtype}"
        if args.output_dir:
            from pathlib import Path

            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            path = Path(args.output_dir) / f"output_{i}.npy"
            np.save(path, out)
            line += f" -> {path}"
        print(line)


def cmd_demo(args):
    from .demo import run_demo

    run_demo(target=args.target)


def cmd_bench(args):
    import importlib

    module = importlib.import_module(f".bench.{args.op}", __package__)
    module.run(args)


def cmd_tune(args):
    """Run schedules/tune_<op>.py (a checkout file, not part of the wheel) with the remaining arguments."""
    import importlib.util
    from pathlib import Path

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
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run a compiled model on .npy inputs")
    p.add_argument("model")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    p.add_argument("--output-dir", default=None, help="save outputs as output_<i>.npy here")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="compile and run a built-in GRU model, check it, time it")
    p.add_argument("--target", default=None)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("tune", help="tune an operator's schedules: gemm (genetic search / MetaSchedule), or "
                       "measured sweeps of the hand-scheduled kernels (build here, run on the GPU, merge here)")
    p.add_argument("op", choices=["gemm", "persistent_gru", "persistent_mma", "step_gemm", "recurrent_gemm", "spmm",
                                  "topk"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for schedules/tune_<op>.py")
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
