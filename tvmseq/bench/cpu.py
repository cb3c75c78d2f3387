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
"""
from __future__ import annotations

import itertools
import os
import platform
import time

import numpy as np

from .common import print_table, ratio_bar_plot, save

GRID = dict(cell=("GRU", "RNN", "LSTM"), hidden=(128, 256, 512, 1024), batch=(1, 8, 64))
QUICK = dict(cell=("GRU", "RNN", "LSTM"), hidden=(128, 512), batch=(1, 8))
CORPUS_RUNS = 2          # input sets of each corpus model timed (its test's sizes, in order)
STEPS = 100
DENOISER_FRAMES = 37
COLUMNS = ["case", "cell", "hidden", "batch", "steps", "tvmseq_ms", "ort_ms", "speedup", "tvmseq_cpu_ms", "ort_cpu_ms",
           "speedup_cpu", "max_err"]
CORPUS_COLUMNS = ["case", "model", "shapes", "tvmseq_ms", "ort_ms", "speedup", "tvmseq_cpu_ms", "ort_cpu_ms",
                  "speedup_cpu", "max_err"]


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="hidden {128, 512} x batch {1, 8} only")
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each side (alternated)")
    parser.add_argument("--no-model", action="store_true", help="skip the denoiser model")
    parser.add_argument("--cells", default=None, help="comma-separated cells of the grid (GRU,RNN,LSTM)")
    parser.add_argument("--no-nodes", action="store_true", help="skip the node grid")
    parser.add_argument("--no-corpus", action="store_true", help="skip the real-model corpus")
    parser.add_argument("--models", default=None, help="comma-separated corpus model ids (default: all)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of both sides (TVM_NUM_THREADS and onnxruntime's intra-op threads); "
                             "default: TVM's and onnxruntime's own (the cores)")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")


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


def compare(model, feeds: dict, reps: int, threads: int | None = None) -> dict:
    """Compile `model` for llvm, check it against onnxruntime, time both: {tvmseq_ms, ort_ms, speedup, max_err}.
    threads: onnxruntime's intra-op threads (TVM's come from TVM_NUM_THREADS, see `run`)."""
    compiled, sess = _compile_with_peer(model, threads)
    return _compare_compiled(compiled, sess, feeds, reps)


def _compile_with_peer(model, threads: int | None):
    """(tvmseq's model compiled for llvm, onnxruntime's CPU session) of one ONNX model."""
    import onnxruntime as ort

    from ..build import compile_onnx

    compiled = compile_onnx(model, target="llvm")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return compiled, sess


def _compare_compiled(compiled, sess, feeds: dict, reps: int) -> dict:
    got, want = compiled(**feeds), sess.run(None, feeds)
    got = got if isinstance(got, tuple) else (got,)
    err = max(float(np.max(np.abs(np.asarray(g, np.float64) - w), initial=0.0)) for g, w in zip(got, want))
    t_tvm, t_ort, c_tvm, c_ort = alternate(lambda: compiled(**feeds), lambda: sess.run(None, feeds), reps)
    return {"tvmseq_ms": t_tvm, "ort_ms": t_ort, "speedup": t_ort / t_tvm, "tvmseq_cpu_ms": c_tvm,
            "ort_cpu_ms": c_ort, "speedup_cpu": c_ort / max(c_tvm, 1e-9), "max_err": err}


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


def corpus_rows(ids, reps: int, threads: int | None) -> list[dict]:
    """One row per corpus model that passes on the CPU and timed input set: compiled once, compared with
    onnxruntime and timed alternately at its test's sizes (`CORPUS_RUNS` input sets of the first sample rate)."""
    modules = corpus_modules()
    if modules is None:
        print("no tests/corpus.py here (not a source checkout): corpus skipped")
        return []
    corpus, test_corpus = modules
    import onnx

    rows = []
    for entry in corpus.CORPUS:
        if entry.expect != "pass" or (ids and entry.id not in ids):
            continue
        try:
            path = corpus.fetch(entry)
        except corpus.FetchError as err:
            print(f"{entry.id}: not fetched ({err})")
            continue
        model = onnx.load(str(path), load_external_data=False)
        feeds_runs = test_corpus.input_sets(entry, model)[:CORPUS_RUNS]
        compiled = sessions = None
        for feeds in feeds_runs:
            shapes = " ".join(f"{k}{list(v.shape)}" for k, v in feeds.items() if v.ndim)
            row = {"case": "corpus", "model": entry.id, "shapes": shapes}
            try:
                if compiled is None:
                    compiled, sessions = _compile_with_peer(model, threads)
                row.update(_compare_compiled(compiled, sessions, feeds, reps))
            except Exception as err:  # noqa: BLE001 - recorded, the rest of the corpus still runs
                row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
            rows.append(row)
            print_table([row], CORPUS_COLUMNS)
    return rows


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
    onnx.checker.check_model(model)
    return model, {"X": rng.standard_normal((frames, 1, 161)).astype(np.float32)}


def run(args) -> list[dict]:
    threads = getattr(args, "threads", None)
    if threads:   # read by TVM's runtime when its thread pool starts (the first parallel kernel)
        os.environ["TVM_NUM_THREADS"] = str(threads)
    key = "speedup_cpu" if threads == 1 else "speedup"   # one thread each: the CPU time is the robust one
    suffix = "" if not threads else f"_t{threads}"
    rows = [] if getattr(args, "no_nodes", False) else node_rows(args, threads)
    if not args.no_model:
        rows += denoiser_rows(max(args.reps, 15), threads)
    if rows:
        print()
        print_table(rows, COLUMNS)
        _summary("nodes", [r for r in rows if r["case"] == "node"], key)
        save(f"cpu_recurrent{suffix}", rows, _meta(), ratio_bar_plot(
            [r for r in rows if key in r], ("case", "cell", "hidden", "batch"), key,
            f"tvmseq (llvm) vs onnxruntime CPU ({key})"), out_dir=args.out)
    if getattr(args, "no_corpus", False):
        return rows
    ids = set(args.models.split(",")) if getattr(args, "models", None) else None
    corpus = corpus_rows(ids, max(args.reps, 15), threads)
    if corpus:
        print()
        print_table(corpus, CORPUS_COLUMNS)
        _summary("corpus", corpus, key)
        save(f"cpu_corpus{suffix}", corpus, _meta(), ratio_bar_plot(
            [r for r in corpus if key in r], ("model", "shapes"), key,
            f"real models: tvmseq (llvm) vs onnxruntime CPU ({key})"), out_dir=args.out)
    return rows + corpus


def node_rows(args, threads) -> list[dict]:
    grid = QUICK if args.quick else GRID
    cells = args.cells.split(",") if getattr(args, "cells", None) else grid["cell"]
    rows = []
    for cell, hidden, batch in itertools.product(cells, grid["hidden"], grid["batch"]):
        model, feeds = node_case(cell, hidden, batch)
        row = {"case": "node", "cell": cell, "hidden": hidden, "batch": batch, "steps": STEPS,
               **compare(model, feeds, args.reps, threads)}
        rows.append(row)
        print_table([row], COLUMNS)
    return rows


def denoiser_rows(reps: int, threads) -> list[dict]:
    rows = []
    for case, cell, (model, feeds) in (("denoiser_gru_node", "GRU", node_case("GRU", 400, 1, DENOISER_FRAMES)),
                                       ("denoiser_model", "GRUx2+FC", denoiser_model())):
        row = {"case": case, "cell": cell, "hidden": 400, "batch": 1, "steps": DENOISER_FRAMES}
        try:
            row.update(compare(model, feeds, reps, threads))
        except Exception as err:  # noqa: BLE001 - a model the CPU build cannot take yet: recorded, the rest stays
            row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
            print(f"{case}: {row['error']}")
        rows.append(row)
    return rows


def _summary(what: str, rows: list[dict], key: str) -> None:
    speedups = [r[key] for r in rows if key in r]
    if speedups:
        print(f"{what}: onnxruntime/tvmseq {key} min {min(speedups):.2f}x, median {np.median(speedups):.2f}x, "
              f"max {max(speedups):.2f}x ({sum(s >= 1 for s in speedups)}/{len(speedups)} at least as fast, "
              f"{sum(s >= 0.5 for s in speedups)}/{len(speedups)} within 2x)")


def _meta() -> dict:
    from ..targets import resolve

    meta = {"cpu": _cpu_name(), "threads": _threads(), "target": str(resolve("llvm")),
            "protocol": f"alternating bursts of {BURST}, {SETTLE_S} s settle between sides, medians"}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    meta["load_average"] = os.getloadavg()
    return meta
