"""The CPU (llvm) schedules of the recurrent kernels: the SIMD step GEMM (k in vector lanes, row blocks over
threads), the vectorized gate loops with the polynomial exp, float16 weights computed in float32, the input
projection on the flat rows, and `tvmseq bench cpu`'s plumbing. Odd sizes everywhere: row tiles, batch tiles
and k vectors all have tails."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # CPU kernels built here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

from tvmseq import models  # noqa: E402
from tvmseq.kernels.activations import Activation  # noqa: E402
from tvmseq.kernels.projection import gemm as ip
from tvmseq.kernels.recurrent import gru, step_gemm  # noqa: E402
from tvmseq.targets import resolve  # noqa: E402

LLVM = resolve("llvm")


def _tensor(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


@pytest.mark.parametrize("dtype,parallel", [("float32", False), ("float32", True), ("float16", True)])
def test_step_gemm_any_batch(dtype, parallel):
    """One module for every batch (1 .. 9: full tiles of 4 and single rows), rows 37 (a partial row tile),
    K 43 (five 8-lane vectors and a scalar tail), two directions."""
    D, N, K = 2, 37, 43
    mod = tvm.compile(step_gemm.cpu_gemm_func(D, None, N, K, dtype, parallel=parallel), target=LLVM)
    rng = np.random.default_rng(0)
    R = rng.standard_normal((D, N, K)).astype(dtype)
    for M in (1, 4, 9):
        h = rng.standard_normal((D, M, K)).astype(np.float32)
        out = _tensor(np.full((1, D, M, N), np.nan, np.float32))
        mod["cpu_step_gemm"](_tensor(h), _tensor(R), out)
        want = np.einsum("dmk,dnk->dmn", h.astype(np.float64), R.astype(np.float64))
        np.testing.assert_allclose(out.numpy()[0], want, rtol=1e-5, atol=1e-4, err_msg=f"batch {M}")


def test_projection_on_flat_rows_with_bias():
    """The CPU input projection: any number of rows (past one 64-row block), bias added as stored."""
    spec = gru.GruSpec(2, 3, 11, 19, linear_before_reset=1, direction="bidirectional")
    func, tile = ip.projection_for(spec, LLVM)
    assert tile == ip.FLAT
    mod = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=LLVM)
    rng = np.random.default_rng(1)
    W = rng.standard_normal((2, 33, 19)).astype(np.float32)
    bias = rng.standard_normal((2, 33)).astype(np.float32)
    for rows in (1, 70):
        X = rng.standard_normal((rows, 19)).astype(np.float32)
        out = _tensor(np.zeros((2, rows, 33), np.float32))
        mod["main"](_tensor(X), _tensor(W), _tensor(bias), out)
        np.testing.assert_allclose(out.numpy(), np.einsum("mk,djk->dmj", X, W) + bias[:, None], rtol=1e-5, atol=1e-5)


def test_fast_exp_and_activations():
    """exp, sigmoid and tanh of the CPU kernels against numpy over the float32 range, vectorized."""
    from tvm.script import tirx as T

    acts = {"exp": gru.fast_exp, "sigmoid": gru.cpu_activation(Activation.make("Sigmoid")),
            "tanh": gru.cpu_activation(Activation.make("Tanh"))}
    x = np.concatenate([np.linspace(-100, 100, 4000), np.linspace(-1e-3, 1e-3, 96)]).astype(np.float32)
    for name, fn in acts.items():
        @T.prim_func
        def apply(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
            for i in T.serial(256):
                for v in T.vectorized(16):
                    b[i * 16 + v] = fn(a[i * 16 + v])

        out = _tensor(np.zeros(4096, np.float32))
        tvm.compile(apply, target=LLVM)["main"](_tensor(x), out)
        x64 = x.astype(np.float64)
        if name == "exp":
            want = np.exp(x64)
            normal = (x64 > -87) & (x64 < 88)
            np.testing.assert_allclose(out.numpy()[normal], want[normal], rtol=3e-7)
            assert np.all(out.numpy()[x64 <= -87.4] < 2e-38) and np.all(np.isfinite(out.numpy()))
        else:
            want = 1 / (1 + np.exp(-x64)) if name == "sigmoid" else np.tanh(x64)
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=3e-7, err_msg=name)


ort = pytest.importorskip("onnxruntime")

CASES = [
    # hidden 48: the vectorized gate loop (16 units a vector); batch 70 x hidden 64: GEMM and gates on threads
    ("GRU", dict(seq=9, batch=5, hidden=48, linear_before_reset=0, direction="bidirectional", with_seq_lens=True)),
    ("GRU", dict(seq=6, batch=70, hidden=64, linear_before_reset=1, with_initial_h=True)),
    ("RNN", dict(seq=7, batch=3, hidden=40, direction="reverse", with_seq_lens=True, with_initial_h=True)),
    ("RNN", dict(seq=5, batch=66, hidden=64, clip=0.7)),
]


@pytest.mark.parametrize("op,kw", CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()))
def test_node_matches_onnxruntime(op, kw, monkeypatch):
    import tvmseq
    from tvmseq.onnx import gru as onnx_gru

    if kw["batch"] > 64:   # these small steps on TVM's thread pool too: the parallel GEMM and gate loops
        monkeypatch.setattr(step_gemm, "CPU_PARALLEL_MIN_MACS", 1)
        monkeypatch.setattr(gru, "CPU_GATE_PARALLEL_MIN_UNITS", 1)
        onnx_gru.build_kernels.cache_clear()
        monkeypatch.setattr(onnx_gru, "build_kernels", onnx_gru.build_kernels.__wrapped__)
    model, feeds = models.rnn_node_model(op, input_size=21, weight_scale=kw["hidden"] ** -0.5 * 2, **kw)
    got = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5)


def test_float16_node_is_computed_in_float32():
    """float16 weights and input, converted once; the result is the float32 computation of the same values
    rounded to float16 (onnxruntime's CPU GRU has no float16 kernel: its float32 run is the reference)."""
    import onnx
    from onnx import numpy_helper

    import tvmseq

    model, feeds = models.rnn_node_model("GRU", seq=8, batch=3, input_size=24, hidden=32, dtype="float16",
                                         linear_before_reset=1, with_initial_h=True, weight_scale=0.35)
    got = tvmseq.compile_onnx(model, target="llvm")(**feeds)
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for init in twin.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    for value in list(twin.graph.input) + list(twin.graph.output):
        value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    want = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {k: v.astype(np.float32) for k, v in feeds.items()})
    for g, w in zip(got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=2e-3, atol=2e-3)


def test_bench_cpu_runs_and_writes_results(tmp_path, monkeypatch):
    """`tvmseq bench cpu` end to end on a tiny grid: outputs checked against onnxruntime, both timed, the JSON
    and the denoiser model (its FC and GRU layers on llvm) included."""
    import argparse
    import json

    from tvmseq.bench import cpu

    monkeypatch.setattr(cpu, "QUICK", dict(cell=("GRU", "RNN"), hidden=(16,), batch=(2,)))
    monkeypatch.setattr(cpu, "STEPS", 5)
    monkeypatch.setattr(cpu, "DENOISER_FRAMES", 4)
    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    rows = cpu.run(parser.parse_args(["--quick", "--reps", "2", "--no-corpus", "--out", str(tmp_path)]))
    assert [r["case"] for r in rows] == ["node", "node", "denoiser_gru_node", "denoiser_model"]
    for r in rows:
        assert r["max_err"] < 1e-4 and r["tvmseq_ms"] > 0 and r["ort_ms"] > 0, r
    saved = json.loads((tmp_path / "cpu_recurrent.json").read_text())
    assert len(saved["rows"]) == 4 and "threads" in saved and rows[0]["tvmseq_cpu_ms"] > 0
