"""tvmseq.runtime.Model's inputs and outputs on the CPU: rank-0 inputs and Python scalars, ONNX input names
that are not identifiers, outputs by their ONNX names (Python and `tvmseq run`), DLPack inputs that TVM
refuses as they are (misaligned offset views, strided views) copied once instead of refused, device
outputs, and model .so files checked against the size and sha256 in their .so.json before loading."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tvmseq.errors import TvmseqError


def _model() -> onnx.ModelProto:
    """'31' [5, 7] * 'scale' (rank 0) + 'shift' [7] -> 'out.y' [5, 7]; 'total' = sum(out.y) (rank 0)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["31", "scale"], ["m"]), helper.make_node("Add", ["m", "shift"], ["out.y"]),
         helper.make_node("ReduceSum", ["out.y"], ["total"], keepdims=0)], "io",
        [helper.make_tensor_value_info("31", TensorProto.FLOAT, [5, 7]),
         helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("shift", TensorProto.FLOAT, [7])],
        [helper.make_tensor_value_info("out.y", TensorProto.FLOAT, [5, 7]),
         helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def compiled():
    from tvmseq.build import compile_onnx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # TVM's importer says it renames '31'
        return compile_onnx(_model(), target="llvm")


@pytest.fixture(scope="module")
def feeds():
    rng = np.random.default_rng(0)
    return {"31": rng.standard_normal((5, 7)).astype(np.float32), "scale": np.array(1.75, np.float32),
            "shift": rng.standard_normal(7).astype(np.float32)}


def _want(f):
    y = f["31"] * f["scale"] + f["shift"]
    return y, y.sum()


class _DLPackOnly:
    """A foreign tensor that offers DLPack only (what torch.from_numpy views or CuPy slices look like)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __array_namespace__(self):
        return np


def test_names_that_are_not_identifiers_and_rank0_inputs(compiled, feeds):
    assert compiled.input_names == ["31", "scale", "shift"]
    assert compiled.output_names == ["out.y", "total"]
    want_y, want_total = _want(feeds)
    for call in (lambda: compiled(**feeds), lambda: compiled(feeds),
                 lambda: compiled(feeds["31"], feeds["scale"], feeds["shift"]),
                 lambda: compiled(input_31=feeds["31"], scale=feeds["scale"], shift=feeds["shift"])):
        y, total = call()
        np.testing.assert_allclose(y, want_y, rtol=1e-6)
        assert total.shape == ()
        np.testing.assert_allclose(total, want_total, rtol=1e-5)
    named = compiled.named(compiled(feeds))
    assert list(named) == ["out.y", "total"]


@pytest.mark.parametrize("scale", [1.75, 2, np.float32(1.75), np.array(1.75, np.float32)])
def test_scalars_feed_rank0_inputs(compiled, feeds, scale):
    y, _ = compiled({**feeds, "scale": scale})
    np.testing.assert_allclose(y, feeds["31"] * np.float32(scale) + feeds["shift"], rtol=1e-6)


def test_misaligned_and_strided_dlpack_inputs_are_copied_not_refused(compiled, feeds):
    import tvm

    base = np.zeros(5 * 7 + 1, np.float32)
    base[1:] = feeds["31"].ravel()
    offset_view = base[1:].reshape(5, 7)                    # 4 bytes past an aligned start
    with pytest.raises(Exception, match="aligned"):
        tvm.runtime.from_dlpack(offset_view)                # what TVM itself does with it
    wide = np.zeros((5, 14), np.float32)
    wide[:, ::2] = feeds["31"]
    strided = wide[:, ::2]                                  # non-contiguous
    want_y, _ = _want(feeds)
    for x in (_DLPackOnly(offset_view), _DLPackOnly(strided), offset_view, strided):
        y, _ = compiled({**feeds, "31": x})
        np.testing.assert_allclose(y, want_y, rtol=1e-6)
    # a shift of rank 1 viewed at an odd offset: same
    shift = np.concatenate([[0.0], feeds["shift"]]).astype(np.float32)[1:]
    y, _ = compiled({**feeds, "shift": _DLPackOnly(shift)})
    np.testing.assert_allclose(y, want_y, rtol=1e-6)


def test_aligned_device_tensors_are_used_in_place_and_outputs_stay_on_device(compiled, feeds):
    import tvm

    x = tvm.runtime.tensor(feeds["31"], compiled.device)
    assert compiled._prepare(compiled._feed_specs[0], x, {}) is x          # no copy
    out = compiled({**feeds, "31": x}, output="device")
    assert all(isinstance(o, tvm.runtime.Tensor) for o in out)
    np.testing.assert_allclose(np.from_dlpack(out[0]), _want(feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(scale=1.5, extra=1), "no input named 'extra'"),
    (dict(scale=np.zeros(2, np.float32)), "input 'scale' has shape \\[2\\]"),
    (dict(scale=np.array(1, np.int64)), "input 'scale' has dtype int64"),
    (dict(output="host"), "output='host'"),
])
def test_bad_inputs_are_one_line_errors(compiled, feeds, bad, message):
    with pytest.raises(TvmseqError, match=message) as err:
        compiled(**{**feeds, **bad})
    assert "\n" not in str(err.value)



def test_repeated_calls_take_the_fast_path_with_the_same_results_and_errors(compiled, feeds):
    """Calls of one shape after the first keep their checks in a per-shape entry (runtime._FastEntry): the
    results of every input form stay those of the generic path, device outputs stay device tensors, and bad
    inputs still get the generic one-line errors."""
    import tvm

    want_y, want_total = _want(feeds)
    for _ in range(3):
        for scale in (1.75, np.array(1.75, np.float32)):
            y, total = compiled({**feeds, "scale": scale})
            np.testing.assert_allclose(y, want_y, rtol=1e-6)
            np.testing.assert_allclose(total, want_total, rtol=1e-5)
    assert compiled._fast
    out = compiled(**feeds, output="device")
    assert all(isinstance(o, tvm.runtime.Tensor) for o in out)
    np.testing.assert_allclose(np.from_dlpack(out[0]), want_y, rtol=1e-6)
    y2, _ = compiled({**feeds, "scale": 2})
    np.testing.assert_allclose(y2, feeds["31"] * 2 + feeds["shift"], rtol=1e-6)
    np.testing.assert_allclose(np.from_dlpack(out[0]), want_y, rtol=1e-6)   # not overwritten by the later call
    for bad, message in [(dict(scale=np.array(1, np.int64)), "input 'scale' has dtype int64"),
                         (dict(scale=np.zeros(2, np.float32)), "input 'scale' has shape \\[2\\]"),
                         (dict(shift=np.zeros((1, 7), np.float32)), "input 'shift' has shape \\[1, 7\\] \\(rank 2\\)")]:
        with pytest.raises(TvmseqError, match=message) as err:
            compiled(**{**feeds, **bad})
        assert "\n" not in str(err.value)

def test_integer_rank0_input_refuses_a_fractional_scalar():
    from tvmseq.runtime import _as_host_or_tensor

    with pytest.raises(TvmseqError, match="expects an integer"):
        _as_host_or_tensor(2.5, {"dtype": "int64"}, "k")
    assert _as_host_or_tensor(3.0, {"dtype": "int64"}, "k")[0].dtype == np.int64


# ---- exported models: names through the CLI, and damaged files -----------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory, compiled):
    from tvmseq.build import export

    path = tmp_path_factory.mktemp("io") / "io.so"
    export(compiled, path)
    return path


def test_cli_run_feeds_onnx_names_and_writes_outputs_by_name(exported, feeds, tmp_path, capsys):
    from tvmseq.cli import main

    args = ["run", str(exported), "--output-dir", str(tmp_path / "out")]
    for name, value in feeds.items():
        np.save(tmp_path / f"{name}.npy", value)
        args += ["--input", f"{name}={tmp_path / name}.npy"]
    assert main(args) == 0
    want_y, want_total = _want(feeds)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "out.y.npy"), want_y, rtol=1e-6)
    total = np.load(tmp_path / "out" / "total.npy")
    assert total.shape == ()
    np.testing.assert_allclose(total, want_total, rtol=1e-5)
    assert "(out.y)" in capsys.readouterr().out


def test_output_file_names_are_safe_and_unique():
    from tvmseq.cli import _output_files

    assert _output_files(["/model/Sigmoid_output_0", "a b", "a_b", "..x"]) == {
        "/model/Sigmoid_output_0": "_model_Sigmoid_output_0.npy", "a b": "a_b.npy", "a_b": "a_b_1.npy",
        "..x": "x.npy"}


def _damage(path, kind):
    data = path.read_bytes()
    meta = path.with_name(path.name + ".json")
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif kind == "flipped-byte":
        pos = len(data) // 2
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x5A]) + data[pos + 1:])
    elif kind == "json-garbage":
        meta.write_text("{not json")
    elif kind == "json-no-signature":
        meta.write_text(json.dumps({"target": "llvm"}))


@pytest.mark.parametrize("kind, message", [
    ("truncated", "is truncated or was replaced"), ("flipped-byte", "does not match the sha256"),
    ("json-garbage", "is not valid JSON"), ("json-no-signature", "is damaged"),
])
def test_damaged_model_files_are_one_line_errors(exported, tmp_path, kind, message, capsys):
    import shutil

    import tvmseq
    from tvmseq.cli import main

    path = tmp_path / "m.so"
    shutil.copy(exported, path)
    shutil.copy(str(exported) + ".json", str(path) + ".json")
    _damage(path, kind)
    with pytest.raises(TvmseqError, match=message) as err:
        tvmseq.load(path)
    assert "\n" not in str(err.value)
    assert main(["run", str(path)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and message.split()[0] in err_lines[0]


def test_export_records_size_and_hash(exported):
    from tvmseq.runtime import file_digest

    meta = json.loads((exported.parent / (exported.name + ".json")).read_text())
    assert (meta["size"], meta["sha256"]) == file_digest(exported)


# ---- weights kept out of the executable, uploaded once ---------------------------------------------------------
def test_weights_as_inputs_are_uploaded_once_and_keep_the_so_small(tmp_path):
    import sys
    from pathlib import Path

    from tvmseq.build import compile_onnx, export
    from tvmseq.runtime import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_stream import _denoiser_like

    onnx_model = _denoiser_like()
    embedded = compile_onnx(onnx_model, target="llvm")
    lifted = compile_onnx(onnx_model, target="llvm", weights="inputs", weights_min_elements=200)
    assert set(lifted.weight_names) == {"W", "R"}       # the smaller tensors stay constants
    x = np.random.default_rng(5).standard_normal((6, 3, 7)).astype(np.float32)
    np.testing.assert_allclose(lifted(X=x), embedded(X=x), rtol=1e-5, atol=1e-6)
    uploaded = lifted._device_weights()
    lifted(X=x)
    assert all(a is b for a, b in zip(uploaded, lifted._device_weights()))
    export(lifted, tmp_path / "lifted.so")
    loaded = load_model(tmp_path / "lifted.so")
    with pytest.raises(TvmseqError, match="set_weights"):
        loaded(X=x)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in onnx_model.graph.initializer}
    with pytest.raises(TvmseqError, match="weights missing: R"):
        loaded.set_weights({k: v for k, v in weights.items() if k != "R"})
    loaded.set_weights(weights)
    np.testing.assert_allclose(loaded(X=x), embedded(X=x), rtol=1e-5, atol=1e-6)
    for _ in range(3):                                  # calls kept on the fast path (runtime._FastEntry) ...
        np.testing.assert_allclose(loaded(X=x), embedded(X=x), rtol=1e-5, atol=1e-6)
    assert loaded._fast
    loaded.set_weights({**weights, "W": weights["W"] * 0})   # ... pass the new weights after set_weights
    zeroed = loaded(X=x)
    assert not np.allclose(zeroed, embedded(X=x), rtol=1e-5, atol=1e-6)
    for _ in range(3):
        np.testing.assert_array_equal(loaded(X=x), zeroed)
    loaded.set_weights(weights)
    np.testing.assert_allclose(loaded(X=x), embedded(X=x), rtol=1e-5, atol=1e-6)


def test_cuda_graph_needs_a_cuda_target():
    from tvmseq.build import compile_onnx

    with pytest.raises(TvmseqError, match="cuda_graph=True needs a CUDA target"):
        compile_onnx(_model(), target="llvm", cuda_graph=True)


def test_input_names_that_break_generated_code_are_renamed_and_still_fed_by_onnx_name():
    from tvmseq.build import compile_onnx, safe_input_names

    model = _model()
    for value in model.graph.input:
        if value.name == "shift":
            value.name = "/enc/shift.0"
    for node in model.graph.node:
        node.input[:] = ["/enc/shift.0" if n == "shift" else n for n in node.input]
    renamed, original = safe_input_names(model)
    assert original == {"input_enc_shift_0": "/enc/shift.0", "input_31": "31"}
    assert [i.name for i in renamed.graph.input] == ["input_31", "scale", "input_enc_shift_0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = compile_onnx(model, target="llvm")
    assert compiled.input_names == ["31", "scale", "/enc/shift.0"]
    x, shift = np.ones((5, 7), np.float32), np.arange(7, dtype=np.float32)
    y, _ = compiled({"31": x, "scale": 2.0, "/enc/shift.0": shift})
    np.testing.assert_allclose(y, 2 * x + shift)


def _at_offset(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `values` whose data starts `offset` bytes past a 64-byte boundary."""
    raw = np.empty(values.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = np.ndarray(values.shape, values.dtype, raw, start)
    out[...] = values
    return out


def test_large_inputs_read_only_by_tvmseq_kernels_are_passed_in_place():
    """An LSTM node's input X (327 KB) is read only by tvmseq's CPU projection, which takes data at any 16-byte
    boundary: repeated calls pass it in place (the entry's aligned buffer is never written), at a 16-byte offset
    too; at a 4-byte offset, or non-contiguous, it is copied. Outputs equal onnxruntime's in every case. A model
    whose input a stock op reads (the denoiser's MatMul) keeps the copy."""
    import onnxruntime as ort

    from tvmseq.bench.cpu import denoiser_model, node_case
    from tvmseq.build import compile_onnx

    model, feeds = node_case("LSTM", 32, 64, 40)
    compiled = compile_onnx(model, target="llvm")
    assert compiled.signature["inputs"][0].get("in_place") == 16   # the CPU projection's X boundary
    assert compile_onnx(denoiser_model(3)[0], target="llvm").signature["inputs"][0].get("in_place") is None
    x = feeds["X"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    for _ in range(3):
        compiled(x)
    (entry,) = compiled._fast.values()
    assert entry.in_place == ((0, 16),)
    for offset, in_place in ((0, True), (16, True), (4, False)):
        entry.views[0][...] = np.nan
        got = compiled(_at_offset(x, offset))
        assert np.isnan(entry.views[0]).all() == in_place, offset
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    strided = np.empty((40, 64, 64), np.float32)[:, :, ::2]
    strided[...] = x
    entry.views[0][...] = np.nan
    np.testing.assert_allclose(compiled(strided)[0], want[0], rtol=1e-5, atol=1e-5)
