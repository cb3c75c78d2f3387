"""`tvmseq bench cpu`: tvmseq on the CPU (llvm) against onnxruntime's CPU provider.

Grid: a GRU node (linear_before_reset 1, as PyTorch exports), an RNN node and an LSTM node alone, hidden
{128, 256, 512, 1024} x batch {1, 8, 64}, 100 steps, input size = hidden, fp32; then a 2-layer GRU
denoiser-like model (FC 161->400, GRU 400 x2, FC 600, 600, 161; batch 1, 37 frames) and its first GRU node
alone; then every model of the real-model corpus (tests/corpus.py of a source checkout, fetched into its
cache) at the sizes its test runs (first sample rate, first two input sets). Both run in this process on
numpy inputs, timed in alternating bursts (`alternate`: each runtime's pool gets time to go idle before the
other runs), medians reported; outputs are compared first. Threads: TVM's pool and onnxruntime's intra-op
pool both use the machine's cores unless TVM_NUM_THREADS / OMP_NUM_THREADS (read by TVM's runtime) say
otherwise; the number is recorded. Results: artifacts/bench/cpu_recurrent.json and cpu_corpus.json, each with
a .png (speedup = onnxruntime ms / tvmseq ms).

Two halves, for a machine with TVM's runtime only (no compiler, no network: no corpus fetch there):
`--build DIR` here compiles every case selected (--quick, --cells, --hidden, --batches, --no-nodes, --no-model,
--no-corpus, --models; corpus models over --max-model-mb left out unless named) for `--cpu-target` (default this
machine; "llvm -mcpu=x86-64-v3" or "llvm -mcpu=sapphirerapids" for another), exports each with
`tvmseq.build.export` and writes the ONNX files (a node's one file serves every batch: its batch is symbolic
for onnxruntime), the inputs (.npz) and index.json; `--prebuilt DIR` there loads each .so with
`tvmseq.runtime.load_model` and its onnxruntime session from the ONNX file, compares and times them as above,
and writes the same JSON + plot, each row tagged with that machine's CPU and cores.

Node rows also carry their floor (`fma_floor`): floor_ms, the node's multiply-adds at this machine's float32 FMA
peak (measured in the run by a kernel of nothing but register FMAs on TVM's pool), and each side's share of that
peak (tvmseq_of_peak, ort_of_peak = floor_ms / its time): where both are near 1 neither runtime can be much
faster than the other.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import fma_floor
from .common import add_build_run_arguments, build_or_run, print_table, ratio_bar_plot, save

GRID = dict(cell=("GRU", "RNN", "LSTM"), hidden=(128, 256, 512, 1024), batch=(1, 8, 64))
QUICK = dict(cell=("GRU", "RNN", "LSTM"), hidden=(128, 512), batch=(1, 8))
CORPUS_RUNS = 2          # input sets of each corpus model timed (its test's sizes, in order)
STEPS = 100
DENOISER_FRAMES = 37
COLUMNS = ["case", "cell", "hidden", "batch", "steps", "tvmseq_ms", "ort_ms", "speedup", "tvmseq_cpu_ms", "ort_cpu_ms",
           "speedup_cpu", "max_err", "floor_ms", "tvmseq_of_peak", "ort_of_peak"]
CORPUS_COLUMNS = ["case", "model", "shapes", "tvmseq_ms", "ort_ms", "speedup", "tvmseq_cpu_ms", "ort_cpu_ms",
                  "speedup_cpu", "max_err"]
MAX_MODEL_MB = 16        # --build: larger corpus models left out unless named (nsnet2-48k, ddddocr-common)
# table -> (result name, columns, plot labels, plot title, what `_summary` calls it, the rows it summarizes)
TABLES = {"recurrent": ("cpu_recurrent", COLUMNS, ("case", "cell", "hidden", "batch"),
                        "tvmseq (llvm) vs onnxruntime CPU", "nodes", "node"),
          "corpus": ("cpu_corpus", CORPUS_COLUMNS, ("model", "shapes"),
                     "real models: tvmseq (llvm) vs onnxruntime CPU", "corpus", "corpus")}


GUIDES = ((0.5, "2x slower"),)    # dashed lines of the plots (the corpus target: within 2x of onnxruntime)


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="hidden {128, 512} x batch {1, 8} only")
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each side (alternated)")
    parser.add_argument("--no-model", action="store_true", help="skip the denoiser model")
    parser.add_argument("--cells", default=None, help="comma-separated cells of the grid (GRU,RNN,LSTM)")
    parser.add_argument("--no-nodes", action="store_true", help="skip the node grid")
    parser.add_argument("--no-corpus", action="store_true", help="skip the real-model corpus")
    parser.add_argument("--models", default=None, help="comma-separated corpus model ids (default: all)")
    parser.add_argument("--hidden", default=None, help="comma-separated hidden sizes of the grid")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes of the grid")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of both sides (TVM_NUM_THREADS and onnxruntime's intra-op threads); "
                             "default: TVM's and onnxruntime's own (the cores)")
    parser.add_argument("--cpu-target", default="llvm",
                        help='llvm target to compile for (default: this machine\'s CPU); e.g. "llvm -mcpu=x86-64-v3"')
    parser.add_argument("--max-model-mb", type=float, default=MAX_MODEL_MB,
                        help=f"with --build: leave out corpus models whose ONNX file is larger (default "
                             f"{MAX_MODEL_MB}; models named in --models are always built)")
    add_build_run_arguments(parser, "compile every case for --cpu-target into DIR, with its ONNX file and inputs "
                                    "(for --prebuilt DIR on a machine with TVM's runtime only)")


def _threads() -> dict:
    return {k: os.environ.get(k) for k in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")} | {"cores": os.cpu_count()}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# Seconds each side waits before the other runs. Both runtimes' idle pool threads keep spinning after a run:
# measured on the 2-core Zen 4 (nsnet2-16k, 7 frames): run right after onnxruntime (allow_spinning on, its
# default), tvmseq's 2-thread model took 38-44 ms against 2.0-2.4 alone (its worker waits for a core held by
# onnxruntime's spinner: every parallel region costs a time slice), still 21 ms 20 ms later and 3.2 ms 100 ms
# later; with onnxruntime's spinning off it took 2.5-2.9 ms and onnxruntime 9-27 ms instead (TVM's workers
# spin up to 300000 yields). Each side therefore runs a burst, then both pools get SETTLE_S to go to sleep.
SETTLE_S = 0.2
BURST = 5


def alternate(run_a, run_b, reps: int, warmup: int = 2, burst: int = BURST, settle_s: float = SETTLE_S
              ) -> tuple[float, float, float, float]:
    """Median milliseconds of run_a and run_b, timed in alternating bursts of `burst` runs (drifting machine load
    then hits both alike) with `settle_s` between bursts (SETTLE_S: the other runtime's pool must be asleep),
    `reps` runs each after `warmup`: (wall a, wall b, CPU a, CPU b), CPU = the calling thread's CPU time, which
    on a loaded machine still measures a single-threaded run (its wall time includes the waits for a core),
    and leaves out pool threads."""
    times = {k: [] for k in ("a", "b", "ca", "cb")}
    for side, run in (("a", run_a), ("b", run_b)):
        for _ in range(warmup):
            run()
        time.sleep(settle_s)
    done = 0
    while done < reps:
        count = min(burst, reps - done)
        for side, run in (("a", run_a), ("b", run_b)):
            for _ in range(count):
                t0, c0 = time.perf_counter(), time.thread_time()
                run()
                times[side].append(time.perf_counter() - t0)
                times["c" + side].append(time.thread_time() - c0)
            time.sleep(settle_s)
        done += count
    return tuple(float(np.median(times[k])) * 1e3 for k in ("a", "b", "ca", "cb"))


def compare(model, feeds: dict, reps: int, threads: int | None = None, target="llvm") -> dict:
    """Compile `model` for llvm, check it against onnxruntime, time both: {tvmseq_ms, ort_ms, speedup, max_err}.
    threads: onnxruntime's intra-op threads (TVM's come from TVM_NUM_THREADS, see `run`)."""
    return _compare_compiled(build_case(model, target), _ort_session(model.SerializeToString(), threads), feeds, reps)


def build_case(model, target="llvm", shapes: dict | None = None):
    """tvmseq's model compiled for an llvm target (a `tvmseq.runtime.Model`), `shapes` its shape_dict."""
    from ..build import compile_onnx

    return compile_onnx(model, target=target, shape_dict=shapes)


def _ort_session(model_bytes: bytes, threads: int | None):
    """onnxruntime's CPU session of one ONNX model (serialized)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _compare_compiled(compiled, sess, feeds: dict, reps: int) -> dict:
    got, want = compiled(**feeds), sess.run(None, feeds)
    got = got if isinstance(got, tuple) else (got,)
    err = max(float(np.max(np.abs(np.asarray(g, np.float64) - w), initial=0.0)) for g, w in zip(got, want))
    t_tvm, t_ort, c_tvm, c_ort = alternate(lambda: compiled(**feeds), lambda: sess.run(None, feeds), reps)
    return {"tvmseq_ms": t_tvm, "ort_ms": t_ort, "speedup": t_ort / t_tvm, "tvmseq_cpu_ms": c_tvm,
            "ort_cpu_ms": c_ort, "speedup_cpu": c_ort / max(c_tvm, 1e-9), "max_err": err}


def _time_row(stub: dict, compiled, sess, feeds: dict, reps: int, error: str | None = None) -> dict:
    """One result row: `stub` + `_compare_compiled`, or + its error (a case that failed to build, load or run is
    recorded; the rest still runs). Printed."""
    row = dict(stub)
    if error is None:
        try:
            row.update(_compare_compiled(compiled, sess, feeds, reps))
        except Exception as err:  # noqa: BLE001
            error = _error_line(err)
    if error is not None:
        row["error"] = error
        print(f"{stub.get('model') or stub['case']}: {error}")
    print_table([row], CORPUS_COLUMNS if "model" in stub else COLUMNS)
    return row


def _error_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]


def node_case(cell: str, hidden: int, batch: int, steps: int = STEPS, input_size: int | None = None):
    from .. import models

    if cell == "LSTM":
        return lstm_node_model(steps, batch, input_size or hidden, hidden)
    kw = {"linear_before_reset": 1} if cell == "GRU" else {}
    return models.rnn_node_model(cell, seq=steps, batch=batch, input_size=input_size or hidden, hidden=hidden,
                                 weight_scale=hidden ** -0.5, **kw)


def lstm_node_model(steps: int, batch: int, input_size: int, hidden: int, seed: int = 0):
    """One forward ONNX LSTM node (biases, outputs Y and Y_h; weights ~ 1/sqrt(hidden), so the gates stay out of
    saturation): (model, feeds)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    scale = hidden ** -0.5
    inits = [numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name) for name, shape in
             (("W", (1, 4 * hidden, input_size)), ("R", (1, 4 * hidden, hidden)), ("B", (1, 8 * hidden)))]
    node = helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=hidden)
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                            [steps, batch, input_size])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [steps, 1, batch, hidden]),
                               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, batch, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8      # as tvmseq.models writes: an older onnxruntime (1.30) refuses this onnx's default IR
    onnx.checker.check_model(model)
    return model, {"X": rng.standard_normal((steps, batch, input_size)).astype(np.float32)}


# ---------------------------------------------------------------------------------------------------
# The real-model corpus (tests/corpus.py of a source checkout)
# ---------------------------------------------------------------------------------------------------
def corpus_modules():
    """(tests/corpus.py, tests/test_corpus.py) as modules, or None outside a source checkout."""
    import importlib.util
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[2] / "tests"
    if not (tests / "corpus.py").exists() or not (tests / "test_corpus.py").exists():
        return None
    if str(tests) not in sys.path:   # test_corpus imports corpus as a top-level module, as pytest runs it
        sys.path.insert(0, str(tests))
    loaded = []
    for name in ("corpus", "test_corpus"):
        spec = importlib.util.spec_from_file_location(name, tests / f"{name}.py")
        module = sys.modules.get(name) or importlib.util.module_from_spec(spec)
        if name not in sys.modules:
            sys.modules[name] = module
            spec.loader.exec_module(module)
        loaded.append(module)
    return tuple(loaded)


@dataclass
class Case:
    """One model of the benchmark: compiled once, timed on each input set of `runs` ([(row stub, feeds)])."""
    table: str                     # "recurrent" or "corpus" (TABLES)
    stem: str                      # its files' name in a build directory
    model: object                  # onnx.ModelProto
    runs: list
    min_reps: int = 0              # timed runs at least (the denoiser's and the corpus's: 15)
    onnx_stem: str | None = None   # one ONNX file for several cases (the grid's batches, `_batch_symbolic`)
    source: Path | None = None     # the ONNX file it came from (a corpus model: copied as it is)
    shapes: dict | None = None     # dims fixed at compile time (a corpus entry's `shapes`)


def _corpus_cases(args, max_mb: float | None = None):
    """A Case per corpus model that passes on the CPU (`CORPUS_RUNS` input sets of its test's sizes, first sample
    rate), loaded when reached; with `max_mb`, models whose file is larger are left out unless --models names
    them."""
    modules = corpus_modules()
    if modules is None:
        print("no tests/corpus.py here (not a source checkout): corpus skipped")
        return
    corpus, test_corpus = modules
    import onnx

    ids = _names(getattr(args, "models", None))
    for entry in corpus.CORPUS:
        if entry.expect != "pass" or (ids and entry.id not in ids):
            continue
        try:
            path = corpus.fetch(entry)
        except corpus.FetchError as err:
            print(f"{entry.id}: not fetched ({err})")
            continue
        if max_mb is not None and not ids and path.stat().st_size > max_mb * 1e6:
            print(f"{entry.id}: left out ({path.stat().st_size / 1e6:.1f} MB > --max-model-mb {max_mb:g})")
            continue
        model = onnx.load(str(path), load_external_data=False)
        runs = [({"case": "corpus", "model": entry.id, "shapes": " ".join(f"{k}{list(v.shape)}" for k, v in
                                                                      feeds.items() if v.ndim)}, feeds)
                for feeds in test_corpus.input_sets(entry, model)[:CORPUS_RUNS]]
        yield Case("corpus", f"corpus_{entry.id}", model, runs, 15, source=path, shapes=entry.shapes or None)


def denoiser_model(frames: int = DENOISER_FRAMES, seed: int = 0):
    """FC 161->400 (ReLU), GRU 400, GRU 400, FC 600 (ReLU), FC 600 (ReLU), FC 161 (sigmoid): a speech denoiser's
    shape, batch 1, layout 0 ([frames, 1, features]); random weights. Returns (model, feeds)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def weight(name, shape, scale):
        inits.append(numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name))
        return name

    def dense(x, n_in, n_out, act, i):
        nodes.append(helper.make_node("MatMul", [x, weight(f"fc{i}_w", (n_in, n_out), n_in ** -0.5)], [f"fc{i}_mm"]))
        nodes.append(helper.make_node("Add", [f"fc{i}_mm", weight(f"fc{i}_b", (n_out,), 0.1)], [f"fc{i}_lin"]))
        nodes.append(helper.make_node(act, [f"fc{i}_lin"], [f"fc{i}"]))
        return f"fc{i}"

    x = dense("X", 161, 400, "Relu", 0)
    H = 400
    for layer in range(2):
        nodes.append(helper.make_node(
            "GRU", [x, weight(f"gru{layer}_W", (1, 3 * H, 400), H ** -0.5), weight(f"gru{layer}_R", (1, 3 * H, H), H ** -0.5),
                    weight(f"gru{layer}_B", (1, 6 * H), 0.1)], [f"gru{layer}_y", f"gru{layer}_h"],
            name=f"gru{layer}", hidden_size=H, linear_before_reset=1))
        nodes.append(helper.make_node("Squeeze", [f"gru{layer}_y", "axis1"], [f"gru{layer}_out"]))
        x = f"gru{layer}_out"
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    x = dense(x, 400, 600, "Relu", 1)
    x = dense(x, 600, 600, "Relu", 2)
    x = dense(x, 600, 161, "Sigmoid", 3)
    graph = helper.make_graph(nodes, "denoiser", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", 1, 161])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["T", 1, 161])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8      # as lstm_node_model: onnxruntime 1.30 refuses this onnx's default IR
    onnx.checker.check_model(model)
    return model, {"X": rng.standard_normal((frames, 1, 161)).astype(np.float32)}


def run(args) -> list[dict]:
    threads = getattr(args, "threads", None)
    if threads:   # read by TVM's runtime when its thread pool starts (the first parallel kernel)
        os.environ["TVM_NUM_THREADS"] = str(threads)
    if getattr(args, "build", None) or getattr(args, "prebuilt", None):
        return build_or_run(args, lambda d: build(d, args), lambda d, out: run_prebuilt(d, out, args), "tvmseq_cpu_")
    from ..targets import resolve

    target = resolve(getattr(args, "cpu_target", None) or "llvm")
    meta = _meta(str(target))
    rows = [r for c in _recurrent_cases(args) for r in _run_case(c, args, target)]
    peak = _fma_peak(lambda threads: fma_floor.build(threads, target))
    rows = _report("recurrent", _with_floor(rows, peak), args, meta | {"fma_peak_gmacs": peak})
    if getattr(args, "no_corpus", False):
        return rows
    return rows + _report("corpus", [r for c in _corpus_cases(args) for r in _run_case(c, args, target)], args, meta)


def _pool_threads() -> int:
    return int(os.environ.get("TVM_NUM_THREADS") or os.cpu_count() or 1)


def _fma_peak(module_for, threads: int | None = None) -> float | None:
    """This machine's float32 FMA peak in GMAC/s on `threads` (default TVM's pool) threads (`fma_floor`),
    `module_for(threads)` its kernel; None (no floor columns) where it cannot be built or loaded."""
    try:
        threads = threads or _pool_threads()
        peak = fma_floor.measure(module_for(threads), threads)
    except Exception as err:  # noqa: BLE001 - the floor is an extra column, never the reason a run fails
        print(f"FMA peak not measured: {_error_line(err)}")
        return None
    print(f"float32 FMA peak, {threads} threads: {peak:.1f} GMAC/s (the floor columns: a node's multiply-adds "
          f"at this rate)")
    return peak


def _with_floor(rows: list[dict], peak: float | None) -> list[dict]:
    """Node rows with their FMA floor (`fma_floor.floor_columns`)."""
    if peak:
        for r in rows:
            if r.get("case") == "node":
                r.update(fma_floor.floor_columns(r, peak))
    return rows


def _run_case(case: Case, args, target) -> list[dict]:
    """Compile one case here, then its rows (`_time_row`)."""
    compiled = sess = error = None
    try:
        compiled = build_case(case.model, target, case.shapes)
        sess = _ort_session(case.model.SerializeToString(), getattr(args, "threads", None))
    except Exception as err:  # noqa: BLE001 - a model the CPU build cannot take yet: recorded, the rest stays
        error = _error_line(err)
    return [_time_row(stub, compiled, sess, feeds, max(args.reps, case.min_reps), error) for stub, feeds in case.runs]


def _report(table: str, rows: list[dict], args, meta: dict, out_dir=None) -> list[dict]:
    """The whole table printed, summarized and saved (JSON + plot) under its TABLES name in `out_dir` (default
    --out)."""
    if not rows:
        return rows
    threads = getattr(args, "threads", None)
    key = "speedup_cpu" if threads == 1 else "speedup"   # one thread each: the CPU time is the robust one
    name, columns, labels, title, what, case = TABLES[table]
    print()
    print_table(rows, columns)
    _summary(what, [r for r in rows if r["case"] == case], key)
    save(name + ("" if not threads else f"_t{threads}"), rows, meta,
         ratio_bar_plot([r for r in rows if key in r], labels, key, f"{title} ({key})", guides=GUIDES),
         out_dir=out_dir or getattr(args, "out", None))
    return rows


def _recurrent_cases(args):
    """The node grid's cases, then the denoiser's two (unless --no-nodes / --no-model)."""
    if not getattr(args, "no_nodes", False):
        yield from _node_cases(args)
    if not getattr(args, "no_model", False):
        for case, cell, (model, feeds) in (("denoiser_gru_node", "GRU", node_case("GRU", 400, 1, DENOISER_FRAMES)),
                                           ("denoiser_model", "GRUx2+FC", denoiser_model(DENOISER_FRAMES))):
            stub = {"case": case, "cell": cell, "hidden": 400, "batch": 1, "steps": DENOISER_FRAMES}
            yield Case("recurrent", case, model, [(stub, feeds)], 15)


def _node_cases(args):
    grid = QUICK if args.quick else GRID
    cells = _names(getattr(args, "cells", None)) or grid["cell"]
    hidden = [int(h) for h in _names(getattr(args, "hidden", None))] or grid["hidden"]
    batches = [int(b) for b in _names(getattr(args, "batches", None))] or grid["batch"]
    for cell, h, batch in itertools.product(cells, hidden, batches):
        model, feeds = node_case(cell, h, batch, STEPS)
        stub = {"case": "node", "cell": cell, "hidden": h, "batch": batch, "steps": STEPS}
        yield Case("recurrent", f"node_{cell}_h{h}_b{batch}_s{STEPS}", model, [(stub, feeds)],
                   onnx_stem=f"node_{cell}_h{h}_s{STEPS}")


def _names(text) -> list[str]:
    return [v for v in str(text).split(",") if v] if text else []


# ---------------------------------------------------------------------------------------------------
# --build DIR (here, TVM's compiler) and --prebuilt DIR (TVM's runtime only)
# ---------------------------------------------------------------------------------------------------
def build(out_dir, args) -> Path:
    """Compile and export every case selected for --cpu-target into `out_dir`, with its ONNX file and inputs;
    index.json lists them (rewritten after each case)."""
    from ..build import export
    from ..targets import resolve

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = resolve(getattr(args, "cpu_target", None) or "llvm")
    index = {"target": str(target), "cpu_target": getattr(args, "cpu_target", None) or "llvm",
             "built_on": _machine(), "cases": []}
    corpus = [] if getattr(args, "no_corpus", False) else _corpus_cases(args, getattr(args, "max_model_mb", None))
    for case in itertools.chain(_recurrent_cases(args), corpus):
        index["cases"].append(_build_case(case, out, target, export))
        (out / "index.json").write_text(json.dumps(index, indent=1))
    threads = int(getattr(args, "threads", None) or _cores_of(target))
    fma_floor.build(threads, target).export_library(str(out / FMA_PEAK_SO))
    index["fma_peak_threads"] = threads
    (out / "index.json").write_text(json.dumps(index, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out}: {len(index['cases'])} cases for {target}, {size / 1e6:.1f} MB")
    return out


FMA_PEAK_SO = "fma_peak.so"


def _cores_of(target) -> int:
    """The cores a --cpu-target names (`-num-cores`), else this machine's."""
    cores = target.attrs.get("num-cores", None) if target.attrs is not None else None
    return int(cores) if cores else (os.cpu_count() or 1)


def _build_case(case: Case, out: Path, target, export) -> dict:
    """One case's files in `out`: ONNX model, inputs (one .npz a run), and the .so unless it failed to build;
    its index entry."""
    t0 = time.time()
    entry = {"table": case.table, "onnx": _write_onnx(case, out), "min_reps": case.min_reps, "runs": []}
    for i, (stub, feeds) in enumerate(case.runs):
        np.savez_compressed(out / f"{case.stem}_in{i}.npz", **feeds)
        entry["runs"].append({"row": stub, "feeds": f"{case.stem}_in{i}.npz"})
    try:
        export(build_case(case.model, target, case.shapes), out / f"{case.stem}.so")
        entry["so"] = f"{case.stem}.so"
    except Exception as err:  # noqa: BLE001 - recorded; the run half reports it as the row's error
        entry["error"] = _error_line(err)
    print(f"{case.stem}: {entry.get('error') or 'built'} in {time.time() - t0:.1f} s", flush=True)
    return entry


def _write_onnx(case: Case, out: Path) -> str:
    name = f"{case.onnx_stem or case.stem}.onnx"
    if case.source is not None:
        shutil.copyfile(case.source, out / name)
    else:   # a node: written again for each batch, with the same weights (drawn before the input)
        (out / name).write_bytes((_batch_symbolic(case.model) if case.onnx_stem else case.model).SerializeToString())
    return name


def _batch_symbolic(model):
    """A node model ([steps, batch, input] X) with its batch a symbol and its output shapes left to onnxruntime,
    so that one file (the weights) serves every batch."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    x = next(i for i in copy.graph.input if i.name == "X")
    x.type.tensor_type.shape.dim[1].dim_param = "batch"
    for output in copy.graph.output:
        output.type.tensor_type.ClearField("shape")
    return copy


def run_prebuilt(root, out_dir, args) -> list[dict]:
    """Every case of a --build directory selected by this call's options: loaded (TVM's runtime only), compared
    with onnxruntime and timed; the tables saved as in-process runs save them."""
    from ..runtime import load_model

    root = Path(root)
    index = json.loads((root / "index.json").read_text())
    meta = _meta(index["target"]) | {"built_on": index.get("built_on"), "cpu_target": index.get("cpu_target")}
    rows, peak = [], None
    if (root / FMA_PEAK_SO).exists():
        import tvm

        peak = _fma_peak(lambda threads: tvm.runtime.load_module(str(root / FMA_PEAK_SO)),
                         index.get("fma_peak_threads"))
        meta["fma_peak_gmacs"] = peak
    for table in TABLES:
        entries = [e for e in index["cases"] if e["table"] == table and _selected(e["runs"][0]["row"], args)]
        rows += _report(table, _with_floor([r for e in entries for r in _run_entry(root, e, args, load_model)],
                                           peak), args, meta, out_dir)
    return rows


def _run_entry(root: Path, entry: dict, args, load_model) -> list[dict]:
    compiled = sess = None
    error = entry.get("error")
    if error is None:
        try:
            compiled = load_model(root / entry["so"])
            sess = _ort_session(_onnx_bytes(root, entry), getattr(args, "threads", None))
        except Exception as err:  # noqa: BLE001
            error = _error_line(err)
    rows = []
    for run in entry["runs"]:
        feeds = _feeds(root, run)
        rows.append(_time_row(run["row"], compiled, sess, feeds, max(args.reps, entry["min_reps"]), error)
                    | _machine())
    return rows


# A node's ONNX file and inputs, when absent from a build directory, are drawn again from their seed (the same bytes
# `build` wrote), so the directory can travel with its modules alone: at hidden 1024, batch 64, an LSTM's file and
# inputs are as large as its module.
def _onnx_bytes(root: Path, entry: dict) -> bytes:
    path, row = root / entry["onnx"], entry["runs"][0]["row"]
    if path.exists() or row["case"] != "node":
        return path.read_bytes()
    return _batch_symbolic(_drawn_node(row["cell"], row["hidden"], row["batch"], row["steps"])[0]).SerializeToString()


def _feeds(root: Path, run: dict) -> dict:
    path, row = root / run["feeds"], run["row"]
    if path.exists() or row["case"] != "node":
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    return _drawn_node(row["cell"], row["hidden"], row["batch"], row["steps"])[1]


@functools.lru_cache(maxsize=1)      # an entry's ONNX file and then its inputs: the node drawn once
def _drawn_node(cell: str, hidden: int, batch: int, steps: int):
    return node_case(cell, hidden, batch, steps)


def _selected(row: dict, args) -> bool:
    """Whether this call's options (--no-nodes, --cells, --hidden, --batches, --no-model, --no-corpus, --models)
    keep a built case."""
    if row["case"] == "corpus":
        ids = _names(getattr(args, "models", None))
        return not getattr(args, "no_corpus", False) and (not ids or row["model"] in ids)
    if row["case"] != "node":
        return not getattr(args, "no_model", False)
    wanted = {"cell": _names(getattr(args, "cells", None)), "hidden": _names(getattr(args, "hidden", None)),
              "batch": _names(getattr(args, "batches", None))}
    return not getattr(args, "no_nodes", False) and all(not v or str(row[k]) in v for k, v in wanted.items())


def _machine() -> dict:
    return {"cpu": _cpu_name(), "cores": os.cpu_count()}


def _summary(what: str, rows: list[dict], key: str) -> None:
    speedups = [r[key] for r in rows if key in r]
    if speedups:
        print(f"{what}: onnxruntime/tvmseq {key} min {min(speedups):.2f}x, median {np.median(speedups):.2f}x, "
              f"max {max(speedups):.2f}x ({sum(s >= 1 for s in speedups)}/{len(speedups)} at least as fast, "
              f"{sum(s >= 0.5 for s in speedups)}/{len(speedups)} within 2x)")


def _meta(target: str) -> dict:
    meta = {"cpu": _cpu_name(), "threads": _threads(), "target": target,
            "protocol": f"alternating bursts of {BURST}, {SETTLE_S} s settle between sides, medians"}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    meta["load_average"] = os.getloadavg()
    return meta
