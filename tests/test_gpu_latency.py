"""Whole models on the GPU through the CUDA-graph build, device-resident I/O and streaming: built HERE for
the H100 (sm_90a SASS embedded, TVM's compiler), run THERE with TVM's runtime only.

    python tests/test_gpu_latency.py out/gpu_latency            # here: .so files, feeds, onnxruntime outputs
    TVMSEQ_GPU_LATENCY=out/gpu_latency pytest -m gpu tests/test_gpu_latency.py -s   # on the GPU machine

Each case is compiled twice, plainly and with `cuda_graph=True` (time axis bounded), and checked against
onnxruntime at several lengths, each twice (capture, then replay), and again after other lengths (the graph
captured for a shape must read that shape's input buffers). The cases cover the three recurrence paths a
graph must hold: the persistent SIMT engine (a cooperative launch), the per-step path (a host time loop of
launches inside one PrimFunc) and a two-layer stack with state exposed for streaming. Every call of every
case must be captured whole (`Model.graph_fallbacks` empty).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(os.environ.get("TVMSEQ_GPU_LATENCY", Path(__file__).resolve().parents[1] / "out" / "gpu_latency"))
LENGTHS = (1, 7, 32)
BOUND = 32
# name -> (rnn_node_model kwargs or "denoiser", importer path expected on an H100)
CASES = {
    "gru_persistent_b8_h256": dict(op="GRU", seq="T", batch=8, input_size=64, hidden=256, linear_before_reset=1),
    "gru_per_step_b96_h512": dict(op="GRU", seq="T", batch=96, input_size=48, hidden=512, linear_before_reset=1),
    "denoiser_b1": "denoiser",
    "denoiser_frame": "denoiser",     # built for exactly one frame (static shapes, as a streaming user would)
}
FRAME_SHAPES = {"X": [1, 3, 7]}


def _model(name):
    from tvmseq import models

    spec = CASES[name]
    if spec == "denoiser":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from test_stream import _denoiser_like

        return _denoiser_like(), "seq"
    kwargs = dict(spec, weight_scale=spec["hidden"] ** -0.5)
    return models.rnn_node_model(**kwargs)[0], "T"


def _feeds(sess, length, seed):
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([length if isinstance(d, str) else d for d in i.shape]).astype(np.float32)
            for i in sess.get_inputs()}


def build(out_dir, names=None) -> None:
    import onnxruntime as ort

    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export
    from tvmseq.onnx.expose_state import expose_state

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() else {}
    for name in names or CASES:
        model, dim = _model(name)
        expose = CASES[name] == "denoiser"
        frame = name.endswith("_frame")
        lengths = (1,) if frame else LENGTHS
        ref = expose_state(model, warn=False)[0] if expose else model
        sess = ort.InferenceSession(ref.SerializeToString(), providers=["CPUExecutionProvider"])
        data = {}
        for length in lengths:
            feeds = _feeds(sess, length, seed=length)
            outs = sess.run(None, feeds)
            data.update({f"in{length}_{k}": v for k, v in feeds.items()})
            data.update({f"out{length}_{i}": v for i, v in enumerate(outs)})
        np.savez(out / f"{name}.npz", **data)
        files = {}
        for graph in (False, True):
            with warnings.catch_warnings(), cuda_toolchain.device_binaries(("sm_90a",)):
                warnings.simplefilter("ignore")
                compiled = compile_onnx(model, target="cuda", shape_dict=FRAME_SHAPES if frame else None,
                                        cuda_graph=graph, cuda_graph_bounds={dim: BOUND} if graph and not frame else None,
                                        expose_state=expose)
            files["graph" if graph else "plain"] = export(compiled, out / f"{name}{'_graph' if graph else ''}.so").name
        index[name] = {**files, "inputs": [i.name for i in sess.get_inputs()], "outputs": len(sess.get_outputs()),
                       "stream": expose, "lengths": list(lengths)}
        print(name, "built", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _load(name):
    from tvmseq.runtime import load_model

    index_path = ROOT / "index.json"
    if not index_path.exists() or name not in json.loads(index_path.read_text()):
        pytest.skip(f"no prebuilt models in {ROOT} (python tests/test_gpu_latency.py {ROOT})")
    entry = json.loads(index_path.read_text())[name]
    return entry, load_model(ROOT / entry["plain"]), load_model(ROOT / entry["graph"]), np.load(ROOT / f"{name}.npz")


def _check(model, entry, data, length, tol=dict(rtol=1e-3, atol=1e-4)):
    feeds = {k: data[f"in{length}_{k}"] for k in entry["inputs"]}
    got = model(feeds)
    got = got if isinstance(got, tuple) else (got,)
    for i in range(entry["outputs"]):
        np.testing.assert_allclose(got[i], data[f"out{length}_{i}"], **tol, err_msg=f"output {i}, length {length}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_model_matches_onnxruntime_per_shape(name):
    entry, plain, graph, data = _load(name)
    assert graph.cuda_graph and not plain.cuda_graph
    lengths = tuple(entry.get("lengths", LENGTHS))
    for length in lengths + lengths[::-1]:      # capture, then replay after other shapes were captured
        _check(plain, entry, data, length)
        _check(graph, entry, data, length)
        _check(graph, entry, data, length)
    assert not graph.graph_fallbacks, graph.graph_fallbacks
    assert all(e["call"] is not None and e["call"].nodes > 0 for e in graph._graphs.values())
    print(f"\n{name}: captured nodes per length", {k[0][0][0]: e["call"].nodes for k, e in graph._graphs.items()})


@pytest.mark.gpu
def test_a_plain_model_loaded_with_cuda_graph_replays_right():
    from tvmseq.runtime import load_model

    entry, _, _, data = _load("gru_per_step_b96_h512")
    model = load_model(ROOT / entry["plain"], cuda_graph=True)
    for length in LENGTHS + LENGTHS:
        _check(model, entry, data, length)
    assert not model.graph_fallbacks and len(model._graphs) == len(LENGTHS)


@pytest.mark.gpu
def test_cuda_graph_cache_drops_old_captures_and_stays_right():
    entry, _, graph, data = _load("gru_persistent_b8_h256")
    graph.max_graph_shapes = 2
    for length in LENGTHS + LENGTHS:
        _check(graph, entry, data, length)
    assert len(graph._graphs) <= 2


@pytest.mark.gpu
def test_torch_inputs_through_dlpack_misaligned_strided_and_device_outputs():
    torch = pytest.importorskip("torch")
    entry, plain, graph, data = _load("gru_persistent_b8_h256")
    x = data["in7_X"]
    base = torch.zeros(x.size + 1, device="cuda")
    base[1:] = torch.from_numpy(x.ravel()).cuda()
    misaligned = base[1:].view(x.shape)                               # TVM refuses it as it is
    strided = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))).cuda().transpose(0, 1)
    for model in (plain, graph):
        for xin in (misaligned, strided, torch.from_numpy(x).cuda()):
            y, y_h = model(X=xin, output="device")
            np.testing.assert_allclose(torch.from_dlpack(y).cpu().numpy(), data["out7_0"], rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(torch.from_dlpack(y_h).cpu().numpy(), data["out7_1"], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_inputs_given_in_place_are_read_where_they_lie():
    """The same torch tensor three calls in a row: the third call on replays a capture reading it in place (no copy
    in); values written into it between calls are what the next replay reads (checked against the plain model)."""
    torch = pytest.importorskip("torch")
    entry, plain, graph, data = _load("gru_persistent_b8_h256")
    x = data["in7_X"]
    x_dev = torch.from_numpy(x).cuda()
    for _ in range(3):
        y, _ = graph(X=x_dev, output="device")
        np.testing.assert_allclose(torch.from_dlpack(y).cpu().numpy(), data["out7_0"], rtol=1e-3, atol=1e-4)
    assert any(isinstance(k[1], tuple) and x_dev.data_ptr() in k[1] for k in graph._graphs), list(graph._graphs)
    x2 = np.random.default_rng(7).standard_normal(x.shape).astype(np.float32)
    x_dev.copy_(torch.from_numpy(x2))
    y, _ = graph(X=x_dev, output="device")
    np.testing.assert_allclose(torch.from_dlpack(y).cpu().numpy(), plain(X=x2)[0], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_stream_on_gpu_equals_whole_sequence_and_reports_latency():
    import time

    import tvm

    from tvmseq.stream import Stream

    entry, plain, graph, data = _load("denoiser_b1")
    x = data["in32_X"]
    zeros = {k: np.zeros_like(data[f"in32_{k}"]) for k in entry["inputs"] if k != "X"}
    want = plain(X=x, **zeros)[0]
    times = {}
    models = [("plain", plain), ("graph", graph)]
    if "denoiser_frame" in json.loads((ROOT / "index.json").read_text()):   # the same weights, one frame a call
        models.append(("one-frame build in a CUDA graph", _load("denoiser_frame")[2]))
    for label, model in models:
        stream = Stream(model, output="device")
        frames = [stream(X=x[t:t + 1]).numpy() for t in range(x.shape[0])]
        np.testing.assert_allclose(np.concatenate(frames), want, rtol=1e-4, atol=1e-5)
        assert all(isinstance(v, tvm.runtime.Tensor) for v in stream.state.values())
        frame = tvm.runtime.tensor(x[:1], model.device)
        for _ in range(20):
            stream(X=frame)
        tvm.cuda(0).sync()
        t0 = time.perf_counter()
        for _ in range(200):
            stream(X=frame)
        tvm.cuda(0).sync()
        times[label] = (time.perf_counter() - t0) / 200 * 1e6
    print("\nstreaming denoiser_b1, one frame a call, state on the GPU: " +
          ", ".join(f"{label} {us:.1f} us" for label, us in times.items()))
    assert times["graph"] <= 1.25 * times["plain"]


def test_cuda_graph_is_recorded_in_the_signature_and_checked_here():
    """Compiler only, no GPU: cuda_graph=True records the mode (the runtime captures whole calls) and
    checks its bounds."""
    pytest.importorskip("tvm.script")
    from tvmseq import TvmseqError
    from tvmseq.build import compile_onnx

    model, dim = _model("gru_persistent_b8_h256")
    compiled = compile_onnx(model, target="cuda", cuda_graph=True, cuda_graph_bounds={dim: BOUND})
    assert compiled.cuda_graph and compiled.signature["cuda_graph"] == {"bounds": {dim: BOUND}}
    with pytest.raises(TvmseqError, match="not symbolic dims"):
        compile_onnx(model, target="cuda", cuda_graph=True, cuda_graph_bounds={"nope": 4})
    with pytest.raises(TvmseqError, match="without cuda_graph=True"):
        compile_onnx(model, target="cuda", cuda_graph_bounds={dim: 4})


def test_a_one_frame_build_projects_its_inputs_as_a_gemv():
    """Compiler only: a one-frame build (batch 3 here) runs each GRU node as one kernel, its input projection
    included (`kernels.recurrent.one_step`); on the other paths, at 4 rows or fewer the GRU input projection is
    an einsum over W as stored, which dlight schedules with its GEMV rule, not the row-tiled kernel built for many
    rows."""
    pytest.importorskip("tvm.script")
    from tvmseq import from_onnx, targets

    model, _ = _model("denoiser_frame")
    mod = from_onnx(model, {"X": FRAME_SHAPES["X"]}, target=targets.resolve("cuda"))
    names = [gv.name_hint for gv in mod.functions]
    assert "gru_one_step" in names and not any("input_projection" in n or "recurrence" in n for n in names)
    mod = from_onnx(model, {"X": FRAME_SHAPES["X"]}, target=targets.resolve("cuda"), recurrence="persistent")
    names = [gv.name_hint for gv in mod.functions]
    assert not any("input_projection" in n for n in names) and "einsum" in mod["main"].script()
    dynamic = from_onnx(model, target=targets.resolve("cuda"))
    assert any("gru_input_projection" in gv.name_hint for gv in dynamic.functions)


def test_a_length_known_at_run_time_chooses_the_projection_by_its_rows():
    """Compiler only: with a symbolic length (and a static batch) the GRU input projection is a function whose `If`
    on seq x batch calls the stock matmul (few rows) or the row-tiled kernels (many; a chain of such functions over
    the tiles' row ranges); a static length gets one of them and no `If`."""
    pytest.importorskip("tvm.script")
    from tvmseq import from_onnx, targets
    from tvmseq.onnx import gru

    model, _ = _model("denoiser_b1")
    mod = from_onnx(model, target=targets.resolve("cuda"))
    names = {gv.name_hint for gv in mod.functions}
    assert {"gru_projection_by_rows", "gru_projection_stock", "gru_projection_tiled"} <= names
    script = mod["gru_projection_by_rows"].script()
    assert f"< {gru.STOCK_PROJECTION_MAX_ROWS + 1}" in script and "if " in script
    assert "einsum" in mod["gru_projection_stock"].script()
    static = from_onnx(model, {"X": [50, 1, FRAME_SHAPES["X"][2]]}, target=targets.resolve("cuda"))
    assert not any("projection_by_rows" in gv.name_hint for gv in static.functions)
    # a length computed from an input's dim (X [2N, 1, 8] reshaped to [N, 1, 16], as a CRNN's width / 4): X is
    # given a var of its own for the choice, and gate_i the node's length back
    computed = from_onnx(_reshaped_gru(), target=targets.resolve("cuda"))
    assert "gru_projection_by_rows" in {gv.name_hint for gv in computed.functions}
    assert "R.match_cast" in computed["main"].script()


def _reshaped_gru():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    H, I = 16, 16
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in
             (("W", rng.standard_normal((1, 3 * H, I)) * 0.2), ("R", rng.standard_normal((1, 3 * H, H)) * 0.2),
              ("B", rng.standard_normal((1, 6 * H)) * 0.1))]
    inits.append(numpy_helper.from_array(np.array([-1, 1, I], np.int64), "shape"))
    nodes = [helper.make_node("Reshape", ["X", "shape"], ["Xr"]),
             helper.make_node("GRU", ["Xr", "W", "R", "B"], ["Y"], hidden_size=H, linear_before_reset=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T2", 1, 8])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else ROOT, sys.argv[2:] or None)
