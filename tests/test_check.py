"""`tvmseq check`: tvmseq vs onnxruntime on small models built here (target llvm), through cli.main."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tvmseq import check, cli


def _save(tmp_path, model, name="model.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return str(path)


def _make(nodes, inputs, outputs, inits=(), opset=14):
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def matmul_gru_model(hidden=5, features=3, batch=2):
    """X [seq, batch, features] -> MatMul -> GRU (linear_before_reset=1) -> Y, Y_h; seq symbolic."""
    rng = np.random.default_rng(0)
    init = lambda name, *shape: numpy_helper.from_array(rng.uniform(-0.5, 0.5, shape).astype(np.float32), name)  # noqa: E731
    nodes = [helper.make_node("MatMul", ["X", "P"], ["Xp"]),
             helper.make_node("GRU", ["Xp", "W", "R", "B"], ["Y", "Y_h"], hidden_size=hidden, linear_before_reset=1)]
    return _make(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["seq", batch, features])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["seq", 1, batch, hidden]),
                  helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [1, batch, hidden])],
                 [init("P", features, features), init("W", 1, 3 * hidden, features),
                  init("R", 1, 3 * hidden, hidden), init("B", 1, 6 * hidden)])


def depthwise_time_model(channels=5):
    """Depthwise Conv1d (kernel 3, pad 1) + bias over a symbolic time axis, then Relu."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["X", "W", "B"], ["C"], group=channels, kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Relu", ["C"], ["Y"])]
    return _make(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", channels, "time"])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", channels, "time"])],
                 [numpy_helper.from_array(rng.uniform(-1, 1, (channels, 1, 3)).astype(np.float32), "W"),
                  numpy_helper.from_array(rng.uniform(-1, 1, channels).astype(np.float32), "B")])


def scalar_and_number_name_model():
    """Inputs named `31` (a vector) and `scale` (rank 0): Y = `31` * scale + 1."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [helper.make_node("Mul", ["31", "scale"], ["m"]), helper.make_node("Add", ["m", "one"], ["Y"])]
    return _make(nodes, [helper.make_tensor_value_info("31", TensorProto.FLOAT, [7]),
                         helper.make_tensor_value_info("scale", TensorProto.FLOAT, [])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [7])], [one])


def test_gru_model_matches_at_two_lengths(tmp_path, capsys):
    path = _save(tmp_path, matmul_gru_model())
    out_json = tmp_path / "report.json"
    assert cli.main(["check", path, "--target", "llvm", "--lengths", "seq=3,9", "--repeats", "1",
                     "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "all outputs match" in table and table.count("PASS") == 4      # Y and Y_h at seq 3 and 9
    report = json.loads(out_json.read_text())
    assert report["ok"] and [c["sizes"] for c in report["cases"]] == [{"seq": 3}, {"seq": 9}]
    shapes = [o["shape"] for c in report["cases"] for o in c["outputs"]]
    assert shapes == [[3, 1, 2, 5], [1, 2, 5], [9, 1, 2, 5], [1, 2, 5]]
    assert all(o["max_abs"] < 1e-5 for c in report["cases"] for o in c["outputs"])


def test_symbolic_time_and_batch_default_lengths():
    report = check.check(depthwise_time_model(), target="llvm", repeats=1)
    assert report.ok
    assert [c.sizes for c in report.cases] == [{"batch": 3, "time": 3}, {"batch": 7, "time": 7}]
    assert report.cases[1].outputs[0].shape == [7, 5, 7]


def test_rank0_input_and_non_identifier_name(tmp_path):
    scale = tmp_path / "scale.npy"
    np.save(scale, np.array(2.5, np.float32))
    report = check.check(scalar_and_number_name_model(), target="llvm", inputs={"scale": np.load(scale)}, repeats=1)
    assert report.ok and report.cases[0].outputs[0].max_abs < 1e-6


def test_given_input_fixes_its_dims():
    x = np.random.default_rng(3).uniform(-1, 1, (2, 5, 11)).astype(np.float32)
    report = check.check(depthwise_time_model(), target="llvm", inputs={"X": x}, repeats=1)
    assert report.ok and [c.sizes for c in report.cases] == [{}]
    assert report.cases[0].outputs[0].shape == [2, 5, 11]


def test_compiled_model_is_checked_without_compiling(tmp_path, monkeypatch, capsys):
    from tvmseq.build import compile_onnx, export

    model = depthwise_time_model()
    path = _save(tmp_path, model)
    export(compile_onnx(model, target="llvm"), tmp_path / "model.so")

    def no_compiling(*_, **__):
        raise AssertionError("compiled although --compiled was given")

    monkeypatch.setattr("tvmseq.build.compile_onnx", no_compiling)
    assert cli.main(["check", path, "--compiled", str(tmp_path / "model.so"), "--lengths", "time=13",
                     "--lengths", "batch=1", "--repeats", "1"]) == 0
    assert "batch=1,time=13" in capsys.readouterr().out


def test_mismatch_exits_1(tmp_path, monkeypatch, capsys):
    path = _save(tmp_path, depthwise_time_model())
    real = check.run_tvmseq

    def off_by_a_bit(model, feeds, names):
        return {k: v + 1e-3 for k, v in real(model, feeds, names).items()}

    monkeypatch.setattr(check, "run_tvmseq", off_by_a_bit)
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", path, "--target", "llvm", "--repeats", "1"])
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "MISMATCH" in out
    # the same error passes with a looser tolerance
    assert cli.main(["check", path, "--target", "llvm", "--repeats", "1", "--atol", "2e-3"]) == 0


def test_bad_models_exit_2_with_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07not a model")
    assert cli.main(["check", str(garbage), "--target", "llvm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tvmseq: error:") and err.count("\n") == 1

    unknown_op = _make([helper.make_node("NoSuchOp", ["X"], ["Y"])],
                       [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3])],
                       [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3])])
    assert cli.main(["check", _save(tmp_path, unknown_op, "unknown.onnx"), "--target", "llvm"]) == 2
    err = capsys.readouterr().err
    assert "NoSuchOp" in err and err.count("\n") == 1

    assert cli.main(["check", _save(tmp_path, depthwise_time_model(), "dw.onnx"), "--target", "llvm",
                     "--lengths", "frames=3"]) == 2
    assert "no such dynamic axis" in capsys.readouterr().err


def test_compare_reports_shape_and_nan_mismatches():
    want = np.array([1.0, np.nan, 3.0], np.float32)
    assert not check.compare("y", want[:2], want, None, None).ok
    assert not check.compare("y", np.array([1.0, 2.0, 3.0], np.float32), want, None, None).ok
    same = check.compare("y", want.copy(), want, None, None)
    assert same.ok and same.max_abs == 0.0
    ints = check.compare("i", np.array([1, 2]), np.array([1, 3]), None, None)
    assert not ints.ok and ints.max_abs == 1.0
