"""CLI user errors refused before any work: one line on stderr, `tvmseq: error: ...`, exit code 2, nothing written.
(Errors found while compiling or running a model are tests/test_cli.py's.)"""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from tvmseq import models
from tvmseq.cli import main


@pytest.fixture
def gru_onnx(tmp_path):
    model, _ = models.rnn_node_model("GRU", seq=5, batch=3, input_size=4, hidden=6)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path


def one_line_error(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and err.startswith("tvmseq: error: "), err
    return err


@pytest.mark.parametrize("shape,message", [
    ("X=5,-3,4", "every dimension must be a positive integer"),
    ("X=5,0,4", "every dimension must be a positive integer"),      # a batch-0 export
    ("X=0,3,4", "every dimension must be a positive integer"),
    ("Q=5,3,4", "the model has no input named 'Q' (inputs: ['X'])"),
    ("W=6,18,4", "the model has no input named 'W'"),               # an initializer is not an input
    ("X=5,3", "2 dims given, the model's input has 3"),
    ("X=5,3-1,4", "expected name=d1,d2"),
])
def test_compile_refuses_bad_shapes(tmp_path, capsys, gru_onnx, shape, message):
    out = tmp_path / "m.so"
    err = one_line_error(capsys, ["compile", gru_onnx, "-o", out, "--target", "llvm", "--shape", shape])
    assert message in err and "--shape" in err
    assert not out.exists()


def test_build_refuses_a_negative_dimension(tmp_path, capsys, gru_onnx):
    err = one_line_error(capsys, ["build", gru_onnx, "--arch", "cpu", "--out", tmp_path / "a", "--shape", "X=5,-1,4"])
    assert "positive integer" in err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("output,message", [
    ("{tmp}/missing_dir/m.so", "does not exist"),
    ("{tmp}/a_file/m.so", "is not a directory"),
    ("{tmp}", "is a directory, expected a file name"),
])
def test_compile_refuses_an_output_it_cannot_write(tmp_path, capsys, gru_onnx, output, message):
    (tmp_path / "a_file").write_text("x")
    output = output.replace("{tmp}", str(tmp_path))
    err = one_line_error(capsys, ["compile", gru_onnx, "-o", output, "--target", "llvm"])
    assert message in err and "-o" in err


def test_compile_refuses_an_unwritable_directory_before_compiling(tmp_path, capsys, gru_onnx, monkeypatch):
    """A read-only directory (faked for os.access: the tests may run as root, who may write anywhere)."""
    from tvmseq import build

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    monkeypatch.setattr(build, "compile_onnx", lambda *a, **k: pytest.fail("compiled despite an unwritable -o"))
    err = one_line_error(capsys, ["compile", gru_onnx, "-o", locked / "m.so", "--target", "llvm"])
    assert "not writable" in err


def test_compile_reports_a_failed_write_in_one_line(tmp_path, capsys, gru_onnx, monkeypatch):
    """The write itself failing (disk full, a race) after compiling: one line, not a traceback."""
    from tvmseq import build

    def full_disk(model, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build, "export", full_disk)
    err = one_line_error(capsys, ["compile", gru_onnx, "-o", tmp_path / "m.so", "--target", "llvm"])
    assert "cannot write it: No space left on device" in err


def test_run_refuses_an_output_dir_that_is_a_file(tmp_path, capsys):
    """Checked before the model is even loaded (the model path here does not exist)."""
    (tmp_path / "file").write_text("x")
    err = one_line_error(capsys, ["run", tmp_path / "nothing.so", "--output-dir", tmp_path / "file"])
    assert "--output-dir" in err and "exists and is not a directory" in err
    err = one_line_error(capsys, ["run", tmp_path / "nothing.so", "--output-dir", tmp_path / "file" / "sub"])
    assert "--output-dir" in err and "cannot create it" in err


def test_bench_says_it_needs_a_gpu_and_pytorch(capsys, monkeypatch):
    from tvmseq import targets

    monkeypatch.setattr(targets, "has_gpu", lambda: False)
    err = one_line_error(capsys, ["bench", "persistent_gru"])
    assert "tvmseq bench persistent_gru needs a GPU and PyTorch" in err


def test_bench_builds_without_a_gpu(tmp_path, monkeypatch):
    """--build / --build-only / --smoke-cpu need neither a GPU nor torch: no check in their way."""
    from tvmseq import targets
    from tvmseq.bench import spmm

    monkeypatch.setattr(targets, "has_gpu", lambda: False)
    seen = []
    monkeypatch.setattr(spmm, "run", lambda args: seen.append(args.build_only))
    assert main(["bench", "spmm", "--build-only", str(tmp_path / "k")]) == 0
    assert seen == [str(tmp_path / "k")]


def test_a_named_dim_stays_symbolic(tmp_path, gru_onnx):
    """--shape X=5,B,4 fixes the sequence and input size and leaves the batch symbolic: two batch sizes run."""
    out = tmp_path / "m.so"
    assert main(["compile", str(gru_onnx), "-o", str(out), "--target", "llvm", "--shape", "X=5,B,4"]) == 0
    for batch in (2, 5):
        x = np.random.default_rng(batch).standard_normal((5, batch, 4)).astype(np.float32)
        np.save(tmp_path / "x.npy", x)
        assert main(["run", str(out), "--input", f"X={tmp_path / 'x.npy'}", "--output-dir",
                     str(tmp_path / f"o{batch}")]) == 0
        assert np.load(tmp_path / f"o{batch}" / "Y.npy").shape[2] == batch


def test_shapes_parse_as_before(tmp_path, gru_onnx):
    """Valid --shape values still reach the compiler (the model compiles and runs with them)."""
    out = tmp_path / "m.so"
    assert main(["compile", str(gru_onnx), "-o", str(out), "--target", "llvm", "--shape", "X=5x3x4"]) == 0
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(out), "--input", f"X={tmp_path / 'x.npy'}", "--output-dir", str(tmp_path / "o")]) == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir())
