"""The CLI round trip (compile -> run) and its one-line errors with a non-zero exit code."""
import subprocess
import sys

import numpy as np
import onnx
import pytest

from tvmseq import models, reference
from tvmseq.cli import main


def test_compile_run_round_trip(tmp_path, capsys):
    model, feeds = models.rnn_node_model("GRU", seq="T", direction="bidirectional", with_initial_h=True)
    onnx.save(model, tmp_path / "gru.onnx")
    assert main(["compile", str(tmp_path / "gru.onnx"), "-o", str(tmp_path / "gru.so"), "--target", "llvm"]) == 0
    for name, val in feeds.items():
        np.save(tmp_path / f"{name}.npy", val)
    args = ["run", str(tmp_path / "gru.so"), "--output-dir", str(tmp_path / "out")]
    args += sum((["--input", f"{n}={tmp_path / n}.npy"] for n in feeds), [])
    assert main(args) == 0
    assert "output 0: shape [7, 2, 3, 6]" in capsys.readouterr().out
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    want_y, want_h = reference.gru(feeds["X"], w["W"], w["R"], w["B"], None, feeds["initial_h"],
                                   direction="bidirectional")
    np.testing.assert_allclose(np.load(tmp_path / "out" / "Y.npy"), want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "out" / "Y_h.npy"), want_h, rtol=1e-4, atol=1e-5)
    # the loader from Python too
    import tvmseq

    loaded = tvmseq.load(tmp_path / "gru.so")
    np.testing.assert_allclose(loaded(**feeds)[1], want_h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv,message", [
    (["compile", "missing.onnx", "-o", "x.so", "--target", "llvm"], "not found"),
    (["compile", "{bad}", "-o", "x.so", "--target", "llvm"], "could not parse"),
    (["compile", "{model}", "-o", "x.txt", "--target", "llvm"], "must end in .so"),
    (["compile", "{model}", "-o", "x.so", "--target", "nosuch"], "unknown target"),
    (["compile", "{model}", "-o", "x.so", "--shape", "X=a,b"], "--shape"),
    (["run", "missing.so"], "not found"),
    (["run", "{so}", "--input", "Q={npy}"], "no input named 'Q'"),
    (["run", "{so}", "--input", "X={bad}"], "cannot read"),
    (["run", "{so}", "--input", "X={empty}"], "the file is empty or truncated"),
])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    model, feeds = models.rnn_node_model("GRU")
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"garbage")
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "x.npy", feeds["X"])
    if any("{so}" in a for a in argv):
        assert main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.so"), "--target", "llvm"]) == 0
    subst = {"{model}": str(tmp_path / "m.onnx"), "{bad}": str(tmp_path / "bad.onnx"),
             "{so}": str(tmp_path / "m.so"), "{npy}": str(tmp_path / "x.npy"),
             "{empty}": str(tmp_path / "empty.npy")}
    argv = [a for a in argv]
    for i, a in enumerate(argv):
        for k, v in subst.items():
            a = a.replace(k, v)
        argv[i] = a.replace("x.so", str(tmp_path / "x.so")).replace("x.txt", str(tmp_path / "x.txt"))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tvmseq: error:") and "Traceback" not in err


def test_console_script_demo_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "tvmseq.cli", "demo", "--target", "llvm"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "demo OK" in out.stdout and "max abs error vs tvmseq.reference" in out.stdout
