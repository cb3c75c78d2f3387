"""The CPU's float32 multiply-add peak, measured, and the floor it puts under a recurrent node: the node's
multiply-adds at that rate. A GRU / RNN / LSTM node's time is at least its GEMMs' (the input projection and the
step products), whichever runtime computes it; where both runtimes sit near this floor, neither can be much
faster than the other.

The peak is timed on a kernel TVM compiles for the CPU that does nothing but multiply-adds on registers:
ACCUMULATORS independent chains of the target's vectors a thread (16 lanes with AVX-512, 8 with AVX2; enough
chains to cover two FMA pipes of 4-cycle latency and few enough to stay in registers), MACS_PER_ROUND
multiply-adds a round whatever the width, one chain set per thread of TVM's pool, so what it measures is the
cores' FMA issue rate at the clock they hold while busy.
"""
from __future__ import annotations

import time

import numpy as np

ACCUMULATORS = 12
LANES = 16              # the widest vector: the output's values a thread
MACS_PER_ROUND = ACCUMULATORS * LANES
GATES = {"GRU": 3, "RNN": 1, "LSTM": 4}


def node_macs(cell: str, hidden: int, batch: int, steps: int, input_size: int | None = None,
              directions: int = 1) -> int:
    """Multiply-adds of one node's GEMMs: steps x batch x gates x hidden x (input + hidden) a direction."""
    return directions * steps * batch * GATES[cell] * hidden * ((input_size or hidden) + hidden)


def peak_func(threads: int, lanes: int = LANES):
    """prim_func(out [threads x LANES] f32, iters): each thread runs `iters` rounds of MACS_PER_ROUND multiply-adds
    (LANES / lanes passes over ACCUMULATORS vectors of `lanes`) on its own accumulators and stores their sum (so
    nothing is dead code; with fewer lanes than LANES the sum fills the thread's LANES values in copies)."""
    from tvm.script import tirx as T

    passes = LANES // lanes

    @T.prim_func
    def fma_peak(out: T.Buffer((threads * LANES,), "float32"), iters: T.int32):
        T.func_attr({"global_symbol": "fma_peak", "tirx.noalias": True})
        for t in T.parallel(threads):
            acc = T.alloc_buffer((ACCUMULATORS, lanes), "float32", scope="local")
            for a in T.unroll(ACCUMULATORS):
                for lane in T.vectorized(lanes):
                    acc[a, lane] = T.Cast("float32", t + a + lane)
            for _ in range(iters):
                for _p in T.unroll(passes):
                    for a in T.unroll(ACCUMULATORS):
                        for lane in T.vectorized(lanes):
                            acc[a, lane] = acc[a, lane] * T.float32(0.999999) + T.float32(1e-7)
            for a in T.unroll(1, ACCUMULATORS):
                for lane in T.vectorized(lanes):
                    acc[0, lane] = acc[0, lane] + acc[a, lane]
            for p in T.unroll(passes):
                for lane in T.vectorized(lanes):
                    out[t * LANES + p * lanes + lane] = acc[0, lane]

    return fma_peak


def build(threads: int, target="llvm"):
    """The peak kernel compiled for `target` in its vectors' width (`schedule_cpu.vector_lanes`; TVM's compiler
    needed). The 16-lane kernel on an AVX2 host kept 24 vectors in 16 registers and measured half the FMA rate
    (2-core Zen 3, 2026-11-28)."""
    import tvm

    from ..schedule_cpu import vector_lanes
    from ..targets import resolve, with_vector_width

    target = with_vector_width(resolve(target))
    return tvm.compile(tvm.IRModule({"fma_peak": peak_func(threads, vector_lanes(target, "float32"))}),
                       target=target)


def measure(module, threads: int, seconds: float = 0.05, reps: int = 5) -> float:
    """GMAC/s of the peak kernel in `module` on `threads` threads: the best of `reps` runs of ~`seconds` each."""
    import tvm

    func = module["fma_peak"]
    out = tvm.runtime.tensor(np.zeros(threads * LANES, np.float32))
    macs_per_iter = threads * MACS_PER_ROUND
    func(out, 1000)                                   # the pool's threads started, the code paged in
    t0 = time.perf_counter()
    func(out, 100_000)
    iters = max(1000, int(100_000 * seconds / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        func(out, iters)
        best = min(best, time.perf_counter() - t0)
    if not np.all(np.isfinite(out.numpy())):
        raise RuntimeError("fma_peak: accumulators not finite")
    return macs_per_iter * iters / best / 1e9


def floor_columns(row: dict, peak_gmacs: float) -> dict:
    """A node row's floor: floor_ms (its multiply-adds at the peak) and each side's share of that peak."""
    floor_ms = node_macs(row["cell"], row["hidden"], row["batch"], row["steps"]) / peak_gmacs / 1e6
    cols = {"floor_ms": floor_ms}
    for side in ("tvmseq", "ort"):
        if row.get(f"{side}_ms"):
            cols[f"{side}_of_peak"] = floor_ms / row[f"{side}_ms"]
    return cols
