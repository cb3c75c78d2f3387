"""`tvmseq bench cpu`: tvmseq's recurrent kernels on the CPU (llvm) against onnxruntime's CPU provider.

Grid: a GRU node (linear_before_reset 1, as PyTorch exports) and an RNN node alone, hidden {128, 256, 512,
1024} x batch {1, 8, 64}, 100 steps, input size = hidden, fp32; then a 2-layer GRU denoiser-like model
(FC 161->400, GRU 400 x2, FC 600, 600, 161; batch 1, 37 frames) and its first GRU node alone. Both run in this
process on numpy inputs, each timed `--reps` times ALTERNATING with the other after warm-up, medians
reported; outputs are compared first. Threads: TVM's pool and onnxruntime's intra-op pool both use the
machine's cores unless TVM_NUM_THREADS / OMP_NUM_THREADS (read by TVM's runtime) say otherwise; the number is
recorded. Results: artifacts/bench/cpu_recurrent.json and .png (speedup = onnxruntime ms / tvmseq ms).
"""
from __future__ import annotations

import itertools
import os
import platform
import time

import numpy as np

from .common import print_table, ratio_bar_plot, save

GRID = dict(cell=("GRU", "RNN"), hidden=(128, 256, 512, 1024), batch=(1, 8, 64))
QUICK = dict(cell=("GRU", "RNN"), hidden=(128, 512), batch=(1, 8))
STEPS = 100
DENOISER_FRAMES = 37
COLUMNS = ["case", "cell", "hidden", "batch", "steps", "tvmseq_ms", "ort_ms", "speedup", "tvmseq_cpu_ms", "ort_cpu_ms",
           "speedup_cpu", "max_err"]


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="hidden {128, 512} x batch {1, 8} only")
    parser.add_argument("--reps", type=int, default=7, help="timed runs of each side (alternated)")
    parser.add_argument("--no-model", action="store_true", help="skip the denoiser model")
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


def alternate(run_a, run_b, reps: int, warmup: int = 2) -> tuple[float, float, float, float]:
    """Median milliseconds of run_a and run_b, timed one after the other `reps` times after warm-up (drifting
    machine load then hits both alike): (wall a, wall b, CPU a, CPU b), CPU = the calling thread's CPU time,
    which on a loaded machine still measures a single-threaded run (its wall time includes the waits for a
    core), and leaves out the other runtime's spinning pool threads."""
    for _ in range(warmup):
        run_a()
        run_b()
    times = {k: [] for k in ("a", "b", "ca", "cb")}
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        run_a()
        t1, c1 = time.perf_counter(), time.thread_time()
        run_b()
        t2, c2 = time.perf_counter(), time.thread_time()
        times["a"].append(t1 - t0)
        times["b"].append(t2 - t1)
        times["ca"].append(c1 - c0)
        times["cb"].append(c2 - c1)
    return tuple(float(np.median(times[k])) * 1e3 for k in ("a", "b", "ca", "cb"))


def compare(model, feeds: dict, reps: int, threads: int | None = None) -> dict:
    """Compile `model` for llvm, check it against onnxruntime, time both: {tvmseq_ms, ort_ms, speedup, max_err}.
    threads: onnxruntime's intra-op threads (TVM's come from TVM_NUM_THREADS, see `run`)."""
    import onnxruntime as ort

    from ..build import compile_onnx

    compiled = compile_onnx(model, target="llvm")
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got, want = compiled(**feeds), sess.run(None, feeds)
    got = got if isinstance(got, tuple) else (got,)
    err = max(float(np.max(np.abs(np.asarray(g, np.float64) - w))) for g, w in zip(got, want))
    t_tvm, t_ort, c_tvm, c_ort = alternate(lambda: compiled(**feeds), lambda: sess.run(None, feeds), reps)
    return {"tvmseq_ms": t_tvm, "ort_ms": t_ort, "speedup": t_ort / t_tvm, "tvmseq_cpu_ms": c_tvm,
            "ort_cpu_ms": c_ort, "speedup_cpu": c_ort / max(c_tvm, 1e-9), "max_err": err}


def node_case(cell: str, hidden: int, batch: int, steps: int = STEPS, input_size: int | None = None):
    from .. import models

    kw = {"linear_before_reset": 1} if cell == "GRU" else {}
    return models.rnn_node_model(cell, seq=steps, batch=batch, input_size=input_size or hidden, hidden=hidden,
                                 weight_scale=hidden ** -0.5, **kw)


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
    grid = QUICK if args.quick else GRID
    threads = getattr(args, "threads", None)
    if threads:   # read by TVM's runtime when its thread pool starts (the first parallel kernel)
        os.environ["TVM_NUM_THREADS"] = str(threads)
    rows = []
    for cell, hidden, batch in itertools.product(grid["cell"], grid["hidden"], grid["batch"]):
        model, feeds = node_case(cell, hidden, batch)
        row = {"case": "node", "cell": cell, "hidden": hidden, "batch": batch, "steps": STEPS,
               **compare(model, feeds, args.reps, threads)}
        rows.append(row)
        print_table([row], COLUMNS)
    if not args.no_model:
        for case, cell, (model, feeds) in (("denoiser_gru_node", "GRU", node_case("GRU", 400, 1, DENOISER_FRAMES)),
                                           ("denoiser_model", "GRUx2+FC", denoiser_model())):
            row = {"case": case, "cell": cell, "hidden": 400, "batch": 1, "steps": DENOISER_FRAMES}
            try:
                row.update(compare(model, feeds, max(args.reps, 15), threads))
            except Exception as err:  # noqa: BLE001 - a model the CPU build cannot take yet: recorded, the rest stays
                row["error"] = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
                print(f"{case}: {row['error']}")
            rows.append(row)
    print()
    print_table(rows, COLUMNS)
    key = "speedup_cpu" if threads == 1 else "speedup"   # one thread each: the CPU time is the robust one
    speedups = [r[key] for r in rows if r["case"] == "node" and key in r]
    if speedups:
        print(f"nodes: tvmseq/onnxruntime {key} min {min(speedups):.2f}x, median {np.median(speedups):.2f}x, "
              f"max {max(speedups):.2f}x ({sum(s >= 1 for s in speedups)}/{len(speedups)} at least as fast)")
    from ..targets import resolve

    meta = {"cpu": _cpu_name(), "threads": _threads(), "target": str(resolve("llvm"))}
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    meta["load_average"] = os.getloadavg()
    name = "cpu_recurrent" if not threads else f"cpu_recurrent_t{threads}"
    save(name, rows, meta, ratio_bar_plot([r for r in rows if key in r], ("case", "cell", "hidden", "batch"), key,
                                         f"tvmseq (llvm) vs onnxruntime CPU ({key})"), out_dir=args.out)
    return rows
