"""`tvmseq bench model [MODEL.onnx] [--arch ...] [--batch 1,8,32] [--frames 1,100,1000]`: whole models on the
GPU through tvmseq (plain VM, CUDA graph, streaming one frame a call with the state on the device) against
onnxruntime on the CPU in the same process and, for the benchmark architectures (`architectures.py`),
PyTorch eager and PyTorch in a CUDA graph with the same weights.

Two halves, like every tvmseq benchmark: `--build DIR` (here, no GPU: exports the architectures from
torch.nn, compiles each for CUDA with sm_90a SASS, weights kept out of the .so files) and `--prebuilt DIR`
(on the GPU machine, TVM's runtime only: rebuilds the weights from their names, fills in the ONNX models,
loads the .so files, times). The built directory holds no weights (a few MB in all) so it travels in a GPU
call. Without MODEL.onnx the four architectures are built; with it, that model (weights embedded, the
model file copied in), against onnxruntime only.

What MetaSchedule tuning buys (`--tune TRIALS` and/or `--tuned DB_DIR`): each (model, batch, frames) is also
compiled with every input shape static, twice: with the default schedules (`tvmseq_static_ms`) and with the
tuning database applied (`tvmseq compile --tuned DB`: `tvmseq_tuned_ms`); both also run in a CUDA graph (the same
.so loaded with cuda_graph=True: `*_graph_ms`), and `tuned_speedup` / `tuned_graph_speedup` are static over tuned
in the same process. `--tune TRIALS` first tunes each (model, batch, frames) with `tvmseq.tune.model.tune_model`
(imported exactly as it is compiled: lifted weights, exposed state) into DB_DIR (default DIR/tuning_db), which
needs the GPU and TVM's compiler: build and run in one call there (no --build / --prebuilt). The database's
records only apply to the static shapes they were tuned at, hence the static builds. `--static-only` skips the
dynamic-shape builds (tvmseq_ms, tvmseq_graph_ms, the streaming ones) to save compile time.

Streaming columns (batch as given, one frame a call, the state kept on the GPU): `stream_ms` / `stream_graph_ms`
the builds above through `Stream`; `stream_frame_ms` the one-frame build (static shapes, CUDA graph), the frame
a torch CUDA tensor copied in each call; `stream_inplace_ms` the same with the frame already in the stream's
input buffer (`Stream.frame_buffers()`), as PyTorch's CUDA graph (`torch_stream_graph_ms`) reads its static input.
"""
from __future__ import annotations

import functools
import json
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from .common import add_build_run_arguments, build_or_run, print_table, save

_FRAMES_DEFAULT = "1,100,1000"


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", help="an ONNX model (default: the benchmark architectures)")
    parser.add_argument("--arch", default=",".join(_arches()), help="architectures to build (comma-separated)")
    parser.add_argument("--batch", default="1,8,32", help="batch sizes (comma-separated)")
    parser.add_argument("--frames", default=_FRAMES_DEFAULT, help="frames per call (comma-separated)")
    parser.add_argument("--ort-budget", type=float, default=3.0, help="seconds of onnxruntime timing per row")
    parser.add_argument("--tuned", metavar="DB_DIR", default=None,
                        help="also build each model at static shapes with the default schedules and with this "
                             "MetaSchedule database (tvmseq tune MODEL.onnx), and time both")
    parser.add_argument("--tune", metavar="TRIALS", type=int, default=None,
                        help="tune each model (and batch, frames) with this many MetaSchedule trials first, into "
                             "--tuned DB_DIR (default BUILD_DIR/tuning_db); needs the GPU and TVM's compiler")
    parser.add_argument("--tune-tasks", type=int, default=4,
                        help="with --tune: tune the N heaviest functions of each model (default 4; 0: all)")
    parser.add_argument("--tune-strategy", default="evolutionary", help="with --tune: evolutionary or replay-trace")
    parser.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                        help="with --tune: stop starting new tuning runs once this many seconds went into tuning (the "
                             "models left are still built with whatever the database holds)")
    parser.add_argument("--static-only", action="store_true",
                        help="with --tuned/--tune: skip the dynamic-shape builds (tvmseq_ms, tvmseq_graph_ms, stream)")
    add_build_run_arguments(parser)


def _arches():
    from .architectures import ARCHITECTURES

    return ARCHITECTURES


def _ints(text) -> list[int]:
    return [int(v) for v in str(text).split(",") if v]


def run(args) -> None:
    from ..errors import TvmseqError

    if getattr(args, "unavailable", None):
        raise TvmseqError(f"tvmseq bench model needs {args.unavailable}")
    if not args.build:
        from ..measure import cuda_available

        if not cuda_available():
            raise TvmseqError("tvmseq bench model runs on a GPU and needs PyTorch with CUDA (build here with "
                              "--build DIR, run there with --prebuilt DIR)")
    if args.static_only and not _tuning(args):
        raise TvmseqError("--static-only goes with --tuned DB_DIR or --tune TRIALS")
    if args.tune is not None and args.tune < 1:
        raise TvmseqError(f"--tune {args.tune}: must be a positive number of trials")
    if args.tune is not None and args.prebuilt:
        raise TvmseqError("--tune tunes while building: not with --prebuilt (the database is applied at build time)")
    if args.tuned and args.tune is None and not args.prebuilt:
        from ..tune.model import _database_dir

        _database_dir(args.tuned)      # a bad --tuned is one line before anything is built
    rows = build_or_run(args, lambda d: build(d, args), lambda d, out: run_prebuilt(d, out, args), "tvmseq_model_")
    if rows:
        columns = ["model", "batch", "frames"]
        if not args.static_only:
            columns += ["tvmseq_ms", "tvmseq_graph_ms", "stream_ms", "stream_graph_ms", "stream_frame_ms",
                        "stream_inplace_ms", "torch_stream_graph_ms"]
        if any("tvmseq_tuned_ms" in r for r in rows):
            columns += TUNED_COLUMNS
        print_table(rows, columns + ["torch_eager_ms", "torch_graph_ms", "ort_cpu_ms", "max_err"])


TUNED_COLUMNS = ["tvmseq_static_ms", "tvmseq_tuned_ms", "tuned_speedup", "tvmseq_static_graph_ms",
                 "tvmseq_tuned_graph_ms", "tuned_graph_speedup", "tuned_functions"]


def _tuning(args) -> bool:
    return bool(getattr(args, "tuned", None) or getattr(args, "tune", None))


# ---- build (no GPU needed) -----------------------------------------------------------------------------
def _compile(onnx_bytes, out: Path, stem: str, *, graph: bool, bounds: dict, expose: bool, weights: str,
             shapes: dict | None = None, suffix: str = "", tuned=None) -> str:
    from .. import cuda_toolchain
    from ..build import compile_onnx, export

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cuda_toolchain.device_binaries(("sm_90a",)):
            model = compile_onnx(onnx_bytes, target="cuda", shape_dict=shapes, cuda_graph=graph,
                                 cuda_graph_bounds=bounds if graph else None, expose_state=expose, weights=weights,
                                 tuned=str(tuned) if tuned is not None else None)
    name = f"{stem}{'_graph' if graph else ''}{suffix}.so"
    export(model, out / name)
    return name


def _static_shapes(name, batch: int, frames: int) -> dict:
    """The architecture's input shapes at this batch and frame count (every dim static)."""
    from . import architectures as A

    return {k: list(v.shape) for k, v in A.inputs(name, batch, frames).items()}


def _user_static_shapes(model_bytes, frames: int) -> dict:
    """A user model's inputs with every symbolic dim at `frames` (as `_feeds` fills them when timing)."""
    import onnx

    shapes = {}
    proto = onnx.load_from_string(model_bytes)
    inits = {t.name for t in proto.graph.initializer}
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value <= 0 for d in dims):
            shapes[inp.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else frames for d in dims]
    return shapes


def _build_tuned_variants(model_bytes, out: Path, stem: str, build: dict, frames, shapes_of, args, *,
                          expose: bool, weights: str) -> None:
    """For each frame count: tune (--tune) at the static shapes, then compile them with the default schedules
    and with the database; build["static"|"tuned"][str(frames)] = .so name, build["tuned_functions"][..] =
    the functions the database scheduled."""
    from .. import targets

    db = Path(args.tuned or Path(args.build_dir) / "tuning_db")
    build.update(static={}, tuned={}, tuned_functions={}, tune_seconds={})
    for f in frames:
        shapes = shapes_of(f)
        key = str(f)
        spent = getattr(args, "tune_spent", 0.0)
        budget = getattr(args, "tune_budget", None)
        if args.tune and budget is not None and spent >= budget:
            print(f"  {stem} f{f}: not tuned, the tuning budget ({budget:.0f} s) is spent", flush=True)
            build["tune_seconds"][key] = 0.0
        elif args.tune:
            from ..tune import model as tune_model

            t0 = time.time()
            report = tune_model.tune_model(
                model_bytes, target="cuda", trials=args.tune, shapes=shapes, work_dir=db, progress=False,
                strategy=args.tune_strategy, max_tasks=args.tune_tasks or None, weights=weights,
                expose_state=expose, log=lambda m: print(f"  {stem} f{f}: {m}", flush=True))
            build["tune_seconds"][key] = round(time.time() - t0, 1)
            args.tune_spent = spent + time.time() - t0
            print("  " + tune_model.format_report(report).replace("\n", "\n  "), flush=True)
        if not (db / "database_workload.json").is_file():    # nothing tuned yet (no stock function, no budget)
            from ..tune.metaschedule import open_database

            open_database(db)
        build["static"][key] = _compile(model_bytes, out, stem, graph=False, bounds={}, expose=expose,
                                        weights=weights, shapes=shapes, suffix=f"_f{f}_static")
        build["tuned"][key] = _compile(model_bytes, out, stem, graph=False, bounds={}, expose=expose,
                                       weights=weights, shapes=shapes, suffix=f"_f{f}_tuned", tuned=db)
        build["tuned_functions"][key] = _scheduled_by(model_bytes, shapes, db, expose, weights, targets)
        print(f"  {stem} f{f}: the database schedules {len(build['tuned_functions'][key])} function(s): "
              f"{', '.join(build['tuned_functions'][key]) or '-'}", flush=True)


def _scheduled_by(model_bytes, shapes, db, expose, weights, targets) -> list:
    from ..tune import model as tune_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = targets.resolve("cuda")
        mod, _, _ = tune_model.import_for_tuning(model_bytes, target, shapes, weights=weights, expose_state=expose,
                                                 log=lambda *_: None)
        return tune_model.scheduled_by_database(mod, target, db)


def _one_frame_shapes(model_bytes, batch: int) -> dict:
    """{input: shape} with the time dim 1 and every other symbolic dim the batch (streaming builds)."""
    import onnx

    time_dim, shapes = _time_dim(model_bytes), {}
    for inp in onnx.load_from_string(model_bytes).graph.input:
        dims = inp.type.tensor_type.shape.dim
        shapes[inp.name] = [d.dim_value if not d.dim_param else (1 if d.dim_param == time_dim else batch) for d in dims]
    return shapes


def _time_dim(model_bytes) -> str | None:
    import onnx

    for inp in onnx.load_from_string(model_bytes).graph.input:
        for d in inp.type.tensor_type.shape.dim:
            if d.dim_param:
                return d.dim_param
    return None


def build(out_dir, args) -> Path:
    """Export, compile (plain and CUDA graph, per batch) and write index.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args.build_dir = str(out)
    batches, frames = _ints(args.batch), _ints(args.frames)
    index = {"batches": batches, "frames": frames, "models": {}}
    if _tuning(args):
        index["tuned"] = {"database": str(Path(args.tuned or out / "tuning_db").resolve()), "trials": args.tune,
                          "tasks": args.tune_tasks, "strategy": args.tune_strategy, "static_only": args.static_only,
                          "budget_s": getattr(args, "tune_budget", None)}
    if args.model:
        names = [Path(args.model).stem]
    else:
        names = [a for a in str(args.arch).split(",") if a]
    for name in names:
        t0 = time.time()
        entry = {"builds": {}, "failed": None}
        try:
            if args.model:
                _build_user_model(Path(args.model), out, entry, batches, frames, args)
            else:
                _build_architecture(name, out, entry, batches, frames, args)
        except Exception as err:  # noqa: BLE001 - one architecture failing (e.g. LSTM) must not stop the rest
            entry["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        index["models"][name] = entry
        print(f"{name}: {'FAILED ' + entry['failed'] if entry['failed'] else 'built'} in {time.time() - t0:.0f} s",
              flush=True)
        (out / "index.json").write_text(json.dumps(index, indent=1))
    return out


def _build_architecture(name, out: Path, entry: dict, batches, frames, args=None) -> None:
    from . import architectures as A

    tuning, static_only = _tuning(args), bool(getattr(args, "static_only", False))

    real, sources, literal = A.initializer_sources(name, batches[0])
    np.savez_compressed(out / f"{name}.sources.npz", **A.pack_sources(sources))
    entry.update(kind="architecture", streams=name in A.STREAMING, sources=f"{name}.sources.npz")
    for batch in batches:
        model_bytes = real if batch == batches[0] else A.export_onnx(name, A.build(name), batch)
        (out / f"{name}_b{batch}.onnx").write_bytes(A.skeleton(model_bytes, set(literal)))
        dim = _time_dim(model_bytes)
        bound = max(frames) * (4 if name == "crnn" else 1)
        build = {"onnx": f"{name}_b{batch}.onnx"}
        if tuning:
            _build_tuned_variants(model_bytes, out, f"{name}_b{batch}", build, frames,
                                  lambda f, b=batch: _static_shapes(name, b, f), args, expose=name == "denoiser",
                                  weights="inputs")
        if static_only:
            entry["builds"][str(batch)] = build
            continue
        for graph in (False, True):
            build["graph" if graph else "plain"] = _compile(
                model_bytes, out, f"{name}_b{batch}", graph=graph, bounds={dim: bound} if dim else {},
                expose=name == "denoiser", weights="inputs")
        if name in A.STREAMING and 1 in frames:   # what a streaming user compiles: one frame a call, every dim static
            build["frame"] = _compile(model_bytes, out, f"{name}_b{batch}", graph=True, bounds={},
                                      expose=name == "denoiser", weights="inputs",
                                      shapes=_one_frame_shapes(model_bytes, batch), suffix="_frame")
        entry["builds"][str(batch)] = build


def _build_user_model(path: Path, out: Path, entry: dict, batches, frames, args=None) -> None:
    from ..onnx.importer import load_model

    model_bytes = load_model(path).SerializeToString()
    shutil.copy(path, out / path.name)
    dim = _time_dim(model_bytes)
    entry.update(kind="onnx", streams=False, onnx=path.name)
    build = {"onnx": path.name}
    entry["builds"]["any"] = build
    if _tuning(args):
        _build_tuned_variants(model_bytes, out, path.stem, build, frames,
                              lambda f: _user_static_shapes(model_bytes, f), args, expose=False, weights="embedded")
    if getattr(args, "static_only", False):
        return
    for graph in (False, True):
        build["graph" if graph else "plain"] = _compile(model_bytes, out, path.stem, graph=graph,
                                                        bounds={dim: max(frames)} if dim else {}, expose=False,
                                                        weights="embedded")


# ---- run (GPU, TVM's runtime only) ----------------------------------------------------------------------
def _median_wall(fn, iters, sync) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _time_ort(sess, feeds, budget) -> float:
    t0 = time.perf_counter()
    sess.run(None, feeds)
    first = time.perf_counter() - t0
    iters = int(max(1, min(20, budget / max(first, 1e-6))))
    return _median_wall(lambda: sess.run(None, feeds), iters, lambda: None)


def _max_err(got, want) -> float:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    return float(max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)).max() for g, w in zip(got, want)))


def run_prebuilt(root, out_dir, args) -> list[dict]:
    import onnxruntime as ort
    import torch

    from ..runtime import Model, load_model
    from ..measure import time_cuda

    root = Path(root)
    index = json.loads((root / "index.json").read_text())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    arches, batches, frame_counts = str(args.arch).split(","), _ints(args.batch), _ints(args.frames)
    unbuilt = [f for f in frame_counts if f not in index["frames"]]
    if unbuilt and args.frames != _FRAMES_DEFAULT:
        print(f"bench model: frames {unbuilt} not timed: {root} was built for frames {index['frames']} "
              f"(`--build DIR --frames ...`)", file=sys.stderr)
    for name, entry in index["models"].items():
        # --arch picks among the architectures; a model built from an ONNX file (`bench model FILE --build`) runs
        # without naming it again
        if name not in arches and not args.model and entry.get("kind") == "architecture":
            continue
        if entry.get("failed"):
            rows.append({"model": name, "failed": entry["failed"]})
            continue
        for batch_key, files in entry["builds"].items():
            if batch_key != "any" and int(batch_key) not in batches:
                continue
            onnx_bytes, module, state = _onnx_and_module(root, name, entry, files)
            sess = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
            weights = _initializers(onnx_bytes)

            def load(file, graph_mode=None):
                if not file:
                    return None
                m = load_model(root / file, cuda_graph=graph_mode)
                if m.weight_names:
                    m.set_weights({k: weights[k] for k in m.weight_names})
                return m

            def in_graph(m):
                """The same loaded module run through CUDA graphs (a Model of its own, weights uploaded again)."""
                if m is None:
                    return None
                g = Model(m.executable, m.target, m.signature, cuda_graph=True)
                if g.weight_names:
                    g.set_weights({k: weights[k] for k in g.weight_names})
                return g

            plain, graph, frame = load(files.get("plain")), load(files.get("graph")), load(files.get("frame"))
            for frames in [f for f in index["frames"] if f in frame_counts]:
                batch = int(batch_key) if batch_key != "any" else None
                tuned = {}
                try:
                    feeds = _feeds(name, entry, sess, batch, frames)
                    for variant in ("static", "tuned"):
                        file = (files.get(variant) or {}).get(str(frames))
                        tuned[f"tvmseq_{variant}_ms"] = load(file, False)
                        tuned[f"tvmseq_{variant}_graph_ms"] = in_graph(tuned[f"tvmseq_{variant}_ms"])
                    rows.append(_measure(name, entry, batch, frames, feeds, sess, plain, graph, module, args,
                                         time_cuda, frame, tuned))
                except Exception as err:  # noqa: BLE001 - one build failing on the GPU must not lose the other rows
                    if not _tuning(args):
                        raise
                    rows.append({"model": name, "batch": batch, "frames": frames,
                                 "failed": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"})
                if files.get("tuned_functions"):
                    rows[-1]["tuned_functions"] = len(files["tuned_functions"].get(str(frames), []))
                    rows[-1]["tune_seconds"] = (files.get("tune_seconds") or {}).get(str(frames))
                print(json.dumps(rows[-1]), flush=True)
                del tuned
            del plain, graph, frame
    meta = {"batches": index["batches"], "frames": index["frames"]}
    if index.get("tuned"):
        meta["tuned"] = index["tuned"]
    save("model", rows, meta=meta, plot=_plot(rows), out_dir=out_dir)
    return rows


def _initializers(onnx_bytes) -> dict:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(onnx_bytes).graph.initializer}


def _onnx_and_module(root: Path, name, entry, files):
    """(ONNX bytes with weights, torch module on the GPU or None, parameters)."""
    if entry["kind"] != "architecture":
        return (root / files["onnx"]).read_bytes(), None, None
    from . import architectures as A

    module = A.build(name).cuda()
    state = A.deterministic_state(module)
    with np.load(root / entry["sources"]) as packed:
        sources = A.unpack_sources({k: packed[k] for k in packed.files})
    return A.materialize((root / files["onnx"]).read_bytes(), sources, state), module, state


def _feeds(name, entry, sess, batch, frames) -> dict:
    from . import architectures as A

    if entry["kind"] == "architecture":
        return A.inputs(name, batch, frames)
    rng = np.random.default_rng(0)
    feeds = {}
    for inp in sess.get_inputs():
        shape = [d if isinstance(d, int) else frames for d in inp.shape]
        dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}.get(inp.type, np.float32)
        feeds[inp.name] = rng.standard_normal(shape).astype(dtype) if dtype == np.float32 else np.zeros(shape, dtype)
    return feeds


def _torch_call(name, module, tensors):
    """The architecture's forward on torch tensors (by ONNX input name): its outputs in ONNX output order."""
    if name == "vad":
        return module(tensors["X"], tensors["h0"], tensors["c0"])
    out = module(tensors["X"])
    return out[0] if name == "denoiser" else out


def _torch_graph(fn):
    """fn captured in a CUDA graph (static inputs are the tensors fn closes over); returns replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _measure(name, entry, batch, frames, feeds, sess, plain, graph, module, args, time_cuda, frame=None,
             tuned=None) -> dict:
    """One row: every tvmseq build given (`tuned`: {column: model or None} of the static-shape default and tuned
    builds) checked against onnxruntime and timed, then the peers."""
    import torch

    row = {"model": name, "batch": batch, "frames": frames}
    want = sess.run(None, feeds)
    row["ort_cpu_ms"] = _time_ort(sess, feeds, args.ort_budget)
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    variants = {"tvmseq_ms": plain, "tvmseq_graph_ms": graph, **(tuned or {})}
    variants = {k: m for k, m in variants.items() if m is not None}
    any_model = next(iter(variants.values()))
    tv_feeds = dict(dev)
    if name == "denoiser":   # tvmseq's build exposes the GRU states: zero state in for a whole call
        for n in any_model.input_names:
            if n not in tv_feeds:
                spec = next(s for s in any_model.signature["inputs"] if s.get("onnx_name") == n)
                tv_feeds[n] = torch.zeros(spec["shape"], device="cuda")
    errs = []
    for label, m in variants.items():
        got = m(tv_feeds)
        got = got if isinstance(got, tuple) else (got,)
        errs.append(_max_err(got[: len(want)], want))
        row[label.replace("_ms", "_err")] = errs[-1]
        row[label] = time_cuda(lambda m=m: m.run(tv_feeds))
    row["max_err"] = max(errs)
    for plain_key, tuned_key, ratio in (("tvmseq_static_ms", "tvmseq_tuned_ms", "tuned_speedup"),
                                        ("tvmseq_static_graph_ms", "tvmseq_tuned_graph_ms", "tuned_graph_speedup")):
        if row.get(plain_key) and row.get(tuned_key):
            row[ratio] = row[plain_key] / row[tuned_key]
    sync = torch.cuda.synchronize
    if plain is not None:
        row["tvmseq_wall_ms"] = _median_wall(lambda: plain.run(tv_feeds), 50, sync)
    if module is not None:
        with torch.no_grad():
            row["torch_err"] = _max_err([t.cpu().numpy() for t in _as_tuple(_torch_call(name, module, dev))], want)
            row["torch_eager_ms"] = time_cuda(lambda: _torch_call(name, module, dev))
            replay = _torch_graph(lambda: _torch_call(name, module, dev))
            row["torch_graph_ms"] = time_cuda(replay)
    if entry.get("streams") and frames == 1 and plain is not None and graph is not None:
        row.update(_measure_stream(name, batch, feeds, plain, graph, module, time_cuda, frame))
    ours = min(row[k] for k in variants)
    for peer in ("torch_eager_ms", "torch_graph_ms", "ort_cpu_ms"):
        if row.get(peer):
            row[f"speedup_vs_{peer[:-3]}"] = row[peer] / ours
    return row


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _measure_stream(name, batch, feeds, plain, graph, module, time_cuda, frame_model=None) -> dict:
    """One frame a call, state on the GPU: tvmseq's Stream (plain and CUDA-graph builds of the model as
    exported, and the one-frame build in a CUDA graph: `stream_frame_ms`) against the torch module stepping
    its own state, eager and in a CUDA graph (state copied back in the graph)."""
    import torch

    from ..stream import Stream

    frame = {"X": torch.from_numpy(feeds["X"]).cuda()}
    res = {}
    pairs = {"h0": "h_n", "c0": "c_n"} if name == "vad" else None    # its own state in/out
    # a call is tens of us: 500 calls a median (50 moved it by 30% between runs, the GPU clocking down between rows)
    timed = functools.partial(time_cuda, warmup=100, iters=500)
    for label, m in (("stream_ms", plain), ("stream_graph_ms", graph), ("stream_frame_ms", frame_model)):
        if m is None:
            continue
        stream = Stream(m, state=pairs, output="device")
        stream(**frame)
        res[label] = timed(lambda s=stream: s(**frame))
        res[label.replace("_ms", "_wall_ms")] = _median_wall(lambda s=stream: s(**frame), 100, torch.cuda.synchronize)
        if label == "stream_frame_ms":   # the frame already in the stream's input buffer, as torch's graph reads it
            res["stream_inplace_ms"] = timed(stream)
    if module is None:
        return res
    with torch.no_grad():
        if name == "vad":
            h = torch.zeros(1, batch, 128, device="cuda")
            c = torch.zeros(1, batch, 128, device="cuda")

            def step():
                _, h_n, c_n = module(frame["X"], h, c)
                h.copy_(h_n)
                c.copy_(c_n)
        else:
            h = torch.zeros(2, batch, 400, device="cuda")

            def step():
                _, h_n = module(frame["X"], h)
                h.copy_(h_n)
        res["torch_stream_eager_ms"] = timed(step)
        res["torch_stream_graph_ms"] = timed(_torch_graph(step))
    return res


def _plot(rows):
    def plot(path):
        import matplotlib.pyplot as plt

        keys = [k for k in ("tvmseq_ms", "tvmseq_graph_ms", "tvmseq_static_ms", "tvmseq_tuned_ms",
                            "tvmseq_static_graph_ms", "tvmseq_tuned_graph_ms", "stream_graph_ms", "torch_eager_ms",
                            "torch_graph_ms", "ort_cpu_ms") if any(r.get(k) for r in rows)]
        good = [r for r in rows if not r.get("failed")]
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(good)), 4.5))
        width = 0.8 / max(1, len(keys))
        for i, key in enumerate(keys):
            ax.bar([j + i * width for j in range(len(good))], [r.get(key) or 0 for r in good], width, label=key[:-3])
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 for j in range(len(good))],
                      [f"{r['model']} b{r['batch']} f{r['frames']}" for r in good], rotation=90, fontsize=7)
        ax.set_ylabel("ms per call (lower is better)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot
