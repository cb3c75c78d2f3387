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
"""
from __future__ import annotations

import json
import shutil
import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from .common import add_build_run_arguments, build_or_run, print_table, save


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", help="an ONNX model (default: the benchmark architectures)")
    parser.add_argument("--arch", default=",".join(_arches()), help="architectures to build (comma-separated)")
    parser.add_argument("--batch", default="1,8,32", help="batch sizes (comma-separated)")
    parser.add_argument("--frames", default="1,100,1000", help="frames per call (comma-separated)")
    parser.add_argument("--ort-budget", type=float, default=3.0, help="seconds of onnxruntime timing per row")
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
    rows = build_or_run(args, lambda d: build(d, args), lambda d, out: run_prebuilt(d, out, args), "tvmseq_model_")
    if rows:
        print_table(rows, ["model", "batch", "frames", "tvmseq_ms", "tvmseq_graph_ms", "stream_ms",
                           "stream_graph_ms", "stream_frame_ms", "torch_stream_graph_ms", "torch_eager_ms", "torch_graph_ms",
                           "ort_cpu_ms", "max_err"])


# ---- build (no GPU needed) -----------------------------------------------------------------------------
def _compile(onnx_bytes, out: Path, stem: str, *, graph: bool, bounds: dict, expose: bool, weights: str,
             shapes: dict | None = None, suffix: str = "") -> str:
    from .. import cuda_toolchain
    from ..build import compile_onnx, export

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cuda_toolchain.device_binaries(("sm_90a",)):
            model = compile_onnx(onnx_bytes, target="cuda", shape_dict=shapes, cuda_graph=graph,
                                 cuda_graph_bounds=bounds if graph else None, expose_state=expose, weights=weights)
    name = f"{stem}{'_graph' if graph else ''}{suffix}.so"
    export(model, out / name)
    return name


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
    batches, frames = _ints(args.batch), _ints(args.frames)
    index = {"batches": batches, "frames": frames, "models": {}}
    if args.model:
        names = [Path(args.model).stem]
    else:
        names = [a for a in str(args.arch).split(",") if a]
    for name in names:
        t0 = time.time()
        entry = {"builds": {}, "failed": None}
        try:
            if args.model:
                _build_user_model(Path(args.model), out, entry, batches, frames)
            else:
                _build_architecture(name, out, entry, batches, frames)
        except Exception as err:  # noqa: BLE001 - one architecture failing (e.g. LSTM) must not stop the rest
            entry["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        index["models"][name] = entry
        print(f"{name}: {'FAILED ' + entry['failed'] if entry['failed'] else 'built'} in {time.time() - t0:.0f} s",
              flush=True)
        (out / "index.json").write_text(json.dumps(index, indent=1))
    return out


def _build_architecture(name, out: Path, entry: dict, batches, frames) -> None:
    from . import architectures as A

    real, sources, literal = A.initializer_sources(name, batches[0])
    np.savez_compressed(out / f"{name}.sources.npz", **A.pack_sources(sources))
    entry.update(kind="architecture", streams=name in A.STREAMING, sources=f"{name}.sources.npz")
    for batch in batches:
        model_bytes = real if batch == batches[0] else A.export_onnx(name, A.build(name), batch)
        (out / f"{name}_b{batch}.onnx").write_bytes(A.skeleton(model_bytes, set(literal)))
        dim = _time_dim(model_bytes)
        bound = max(frames) * (4 if name == "crnn" else 1)
        build = {"onnx": f"{name}_b{batch}.onnx"}
        for graph in (False, True):
            build["graph" if graph else "plain"] = _compile(
                model_bytes, out, f"{name}_b{batch}", graph=graph, bounds={dim: bound} if dim else {},
                expose=name == "denoiser", weights="inputs")
        if name in A.STREAMING:   # what a streaming user compiles: one frame a call, every dim static
            build["frame"] = _compile(model_bytes, out, f"{name}_b{batch}", graph=True, bounds={},
                                      expose=name == "denoiser", weights="inputs",
                                      shapes=_one_frame_shapes(model_bytes, batch), suffix="_frame")
        entry["builds"][str(batch)] = build


def _build_user_model(path: Path, out: Path, entry: dict, batches, frames) -> None:
    from ..onnx.importer import load_model

    model_bytes = load_model(path).SerializeToString()
    shutil.copy(path, out / path.name)
    dim = _time_dim(model_bytes)
    entry.update(kind="onnx", streams=False, onnx=path.name)
    build = {"onnx": path.name}
    for graph in (False, True):
        build["graph" if graph else "plain"] = _compile(model_bytes, out, path.stem, graph=graph,
                                                        bounds={dim: max(frames)} if dim else {}, expose=False,
                                                        weights="embedded")
    entry["builds"]["any"] = build


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

    from ..runtime import load_model
    from ..measure import time_cuda

    root = Path(root)
    index = json.loads((root / "index.json").read_text())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    arches, batches, frame_counts = str(args.arch).split(","), _ints(args.batch), _ints(args.frames)
    for name, entry in index["models"].items():
        if name not in arches and not args.model:
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
            plain = load_model(root / files["plain"])
            graph = load_model(root / files["graph"])
            frame = load_model(root / files["frame"]) if files.get("frame") else None
            for m in (plain, graph, frame):
                if m is not None and m.weight_names:
                    m.set_weights({k: weights[k] for k in m.weight_names})
            for frames in [f for f in index["frames"] if f in frame_counts]:
                batch = int(batch_key) if batch_key != "any" else None
                feeds = _feeds(name, entry, sess, batch, frames)
                rows.append(_measure(name, entry, batch, frames, feeds, sess, plain, graph, module, args, time_cuda,
                                     frame))
                print(json.dumps(rows[-1]), flush=True)
            del plain, graph, frame
    save("model", rows, meta={"batches": index["batches"], "frames": index["frames"]}, plot=_plot(rows),
         out_dir=out_dir)
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


def _measure(name, entry, batch, frames, feeds, sess, plain, graph, module, args, time_cuda, frame=None) -> dict:
    import torch

    row = {"model": name, "batch": batch, "frames": frames}
    want = sess.run(None, feeds)
    row["ort_cpu_ms"] = _time_ort(sess, feeds, args.ort_budget)
    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
    tv_feeds = dict(dev)
    if name == "denoiser":   # tvmseq's build exposes the GRU states: zero state in for a whole call
        for n in plain.input_names:
            if n not in tv_feeds:
                spec = next(s for s in plain.signature["inputs"] if s.get("onnx_name") == n)
                tv_feeds[n] = torch.zeros(spec["shape"], device="cuda")
    errs = []
    for label, m in (("tvmseq_ms", plain), ("tvmseq_graph_ms", graph)):
        got = m(tv_feeds)
        got = got if isinstance(got, tuple) else (got,)
        errs.append(_max_err(got[: len(want)], want))
        row[label] = time_cuda(lambda m=m: m.run(tv_feeds))
    row["max_err"] = max(errs)
    sync = torch.cuda.synchronize
    row["tvmseq_wall_ms"] = _median_wall(lambda: plain.run(tv_feeds), 50, sync)
    if module is not None:
        with torch.no_grad():
            row["torch_err"] = _max_err([t.cpu().numpy() for t in _as_tuple(_torch_call(name, module, dev))], want)
            row["torch_eager_ms"] = time_cuda(lambda: _torch_call(name, module, dev))
            replay = _torch_graph(lambda: _torch_call(name, module, dev))
            row["torch_graph_ms"] = time_cuda(replay)
    if entry.get("streams") and frames == 1:
        row.update(_measure_stream(name, batch, feeds, plain, graph, module, time_cuda, frame))
    for peer in ("torch_eager_ms", "torch_graph_ms", "ort_cpu_ms"):
        if row.get(peer):
            row[f"speedup_vs_{peer[:-3]}"] = row[peer] / min(row["tvmseq_ms"], row["tvmseq_graph_ms"])
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
    for label, m in (("stream_ms", plain), ("stream_graph_ms", graph), ("stream_frame_ms", frame_model)):
        if m is None:
            continue
        stream = Stream(m, state=pairs, output="device")
        stream(**frame)
        res[label] = time_cuda(lambda s=stream: s(**frame))
        res[label.replace("_ms", "_wall_ms")] = _median_wall(lambda s=stream: s(**frame), 100, torch.cuda.synchronize)
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
        res["torch_stream_eager_ms"] = time_cuda(step)
        res["torch_stream_graph_ms"] = time_cuda(_torch_graph(step))
    return res


def _plot(rows):
    def plot(path):
        import matplotlib.pyplot as plt

        keys = [k for k in ("tvmseq_ms", "tvmseq_graph_ms", "stream_graph_ms", "torch_eager_ms", "torch_graph_ms",
                            "ort_cpu_ms") if any(r.get(k) for r in rows)]
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
