"""`tvmseq demo`: a bidirectional GRU model built in memory, compiled for the GPU if there is one (else
the CPU), run, checked against tvmseq.reference (and onnxruntime when installed), and timed."""
from __future__ import annotations

import time

import numpy as np
from onnx import numpy_helper

from . import models, reference, targets
from .build import compile_onnx


def _median_ms(run, count: int = 20) -> float:
    run()      # warm-up (first call allocates)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def _ort_threads() -> str:
    import os

    return os.environ.get("OMP_NUM_THREADS") or "default"


def run_demo(target=None, seq: int = 50, batch: int = 4, input_size: int = 64, hidden: int = 128) -> float:
    target = targets.resolve(target)
    model, feeds = models.demo_model(seq, batch, input_size, hidden)
    print(f"demo: ONNX GRU, bidirectional, linear_before_reset=1, seq {seq} batch {batch} input {input_size} "
          f"hidden {hidden}; target {target.kind.name}")
    t0 = time.perf_counter()
    compiled = compile_onnx(model, target=target)
    print(f"compiled in {time.perf_counter() - t0:.1f} s")
    y, y_h = compiled(**feeds)
    w = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ref_y, ref_y_h = reference.gru(feeds["X"], w["W"], w["R"], w["B"], None, feeds["initial_h"],
                                   direction="bidirectional", linear_before_reset=1)
    err = max(np.abs(y - ref_y).max(), np.abs(y_h - ref_y_h).max())
    print(f"max abs error vs tvmseq.reference (float64): {err:.2e}")
    sess = None
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        ort_y, ort_y_h = sess.run(None, feeds)
        print(f"max abs error vs onnxruntime: {max(np.abs(y - ort_y).max(), np.abs(y_h - ort_y_h).max()):.2e}")
    except ImportError:
        print("onnxruntime not installed: skipped that comparison")
    inputs = compiled._bind((), feeds)

    def run_tvmseq():
        compiled._vm["main"](*inputs)
        compiled.device.sync()

    if sess is not None and target.kind.name == "llvm":
        # both in this process, alternating bursts with pauses between them (bench.cpu.alternate: each
        # runtime's idle pool threads spin for a while after a run and would slow the other)
        from .bench.cpu import alternate

        median_ms, ort_ms, _, _ = alternate(run_tvmseq, lambda: sess.run(None, feeds), reps=20)
        print(f"time: {median_ms:.3f} ms per run (median of 20, wall clock) = {median_ms * 1e3 / seq:.1f} us per step")
        print(f"onnxruntime (CPU, {_ort_threads()} threads): {ort_ms:.3f} ms per run (median of 20, alternated in this "
              f"process); tvmseq / onnxruntime = {median_ms / ort_ms:.2f}x")
    else:
        median_ms = _median_ms(run_tvmseq)
        print(f"time: {median_ms:.3f} ms per run (median of 20, wall clock) = {median_ms * 1e3 / seq:.1f} us per step")
    if err > 1e-3:
        raise SystemExit(f"demo FAILED: error {err:.2e} exceeds 1e-3")
    print("demo OK")
    return err
