"""One time step of a GRU, RNN or LSTM node as ONE kernel, its input projection included: what a model compiled
for exactly one frame a call (streaming, static shapes) runs instead of the input-projection GEMV followed by the
recurrence kernel (two launches, the recurrence a cooperative persistent one that loads R on chip for one step).

A block per (direction d, hidden unit j), K_SPLIT warps: each warp's lanes stride over its share of k and sum, for
every batch row b, the unit's gate rows of W against x[b] and of R against h0[b] (both read once, coalesced, for
all rows), the sums reduced across the warp by shuffles and across the warps through shared memory; thread 0 then
applies the cell's math (`cells`: the same activations, clip and LSTM update as every other path) for each batch
row and writes Y, Y_h (and Y_c). No state is handed between blocks, so no grid synchronisation and an ordinary
launch. The CPU variant (tests) is the same code with serial loops.

H100, one-frame builds of `tvmseq bench model` (2026-11-26, GPU time of the whole captured call, replays back to
back): denoiser (2 GRU layers, H 400) 22.5 -> 17.6 us against the GEMV + persistent recurrence per layer; VAD
(LSTM H 128) 15.5 -> 13.0 us.

Interface (layout 0, seq = 1, every dim static; biases as the converter folds them, `onnx.gru.fold_biases`):
  GRU (linear_before_reset = 1): X [1, B, I], W [D, 3H, I], R [D, 3H, H] (dtype), bias_i f32 [D, 3H],
    rb_h f32 [D, H], h0 f32 [D, B, H] -> Y [1, D, B, H], Y_h [D, B, H] (dtype)
  RNN: X, W [D, H, I], R [D, H, H], bias_i f32 [D, H], h0 -> Y, Y_h
  LSTM: X, W [D, 4H, I], R [D, 4H, H], bias_i f32 [D, 4H] (gates i, o, f, c), P f32 [D, 3H], h0, c0 f32 [D, B, H]
    -> Y, Y_h, Y_c
No sequence_lens (the converter keeps the other paths for them) and no GRU with linear_before_reset = 0 (its h
gate needs r * h of every unit: a second pass over all units).
"""
from __future__ import annotations

import functools
import math

import tvm

from ...errors import TvmseqError
from ...targets import is_gpu, resolve

# batch rows one kernel takes (each lane keeps 2 x gates x B running sums in registers)
MAX_BATCH = 8
K_SPLIT = 4                   # warps a unit: each sums a quarter of k (more warps an SM keep more loads in flight)
MAX_UNROLLED_LOADS = 64       # weight loads a lane issues back to back in one k loop


def applies(cell: str, spec) -> str | None:
    """None when the one-step kernel computes `spec` (a GruSpec / RnnSpec / LstmSpec of a seq-1 node), else why
    not."""
    if spec.batch is None:
        return "the batch is symbolic"
    if spec.batch > MAX_BATCH:
        return f"batch {spec.batch} > {MAX_BATCH}"
    if spec.has_seq_lens:
        return "sequence_lens is given"
    if cell == "gru" and spec.linear_before_reset != 1:
        return "linear_before_reset = 0"
    return None


@functools.lru_cache(maxsize=64)
def one_step_func(cell: str, spec, target_json: str):
    """prim_func for one step of `spec` (module doc) on the target (a GPU: the kernel; llvm: its serial variant)."""
    from tvm.script import tirx as T

    from ..recurrent_gemm import f32, scheduled
    from .cells import CELL_GATES, LstmCell, check_acts, clip_fn, direction_activations, fast_math_for

    why = applies(cell, spec)
    if why is not None:
        raise TvmseqError(f"one-step {cell.upper()} kernel: {why}")
    target = resolve(tvm.target.Target(target_json))
    gpu = is_gpu(target)
    NG = CELL_GATES[cell]
    D, B, H, I, dtype = spec.num_directions, int(spec.batch), spec.hidden, spec.input_size, spec.dtype
    acts = check_acts(spec.activations, D, cell)
    fns = direction_activations(acts, D, fast_math_for(dtype, gpu))
    clip = clip_fn(spec.clip)
    lstm = LstmCell(bool(getattr(spec, "input_forget", 0)), bool(getattr(spec, "has_peepholes", False)))
    WS = 32 if gpu else 1
    KS = K_SPLIT if gpu else 1                    # warps of a block, each a share of k, for one item (d, j)
    KX, KH = math.ceil(I / (WS * KS)), math.ceil(H / (WS * KS))   # k chunks of 32 a warp takes
    NA = NG * B                                   # running sums a lane keeps for x, and as many for h
    nblk = D * H
    bx = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if gpu else T.serial
    ty = (lambda n: T.thread_binding(n, thread="threadIdx.y")) if gpu else T.serial
    tx = (lambda n: T.thread_binding(n, thread="threadIdx.x")) if gpu else T.serial
    full = T.uint32(0xFFFFFFFF)
    G = NG * H
    red_scope = "shared" if gpu else "local"
    # the k loops unrolled (GPU) where short: every load of a lane is then independent and in flight at once
    unroll_x, unroll_h = (gpu and KL * NG <= MAX_UNROLLED_LOADS for KL in (KX, KH))
    WX, WH = (NG * KL if unrolled else 1 for KL, unrolled in ((KX, unroll_x), (KH, unroll_h)))

    def vec(V, d, b, k, state):
        return V[d, b, k] if state else f32(V[0, b, k], dtype)

    @T.macro
    def k_sums(A, V, acc, wv, d, j, w, lane, K, KL, unrolled, state):
        """acc[q * B + b] += A[d, qH + j, k] * V[b, k] over this lane's k (V: X[0] or h0[d]): chunk i of warp w is
        k in [(i * KS + w) * 32, +32). Unrolled: the lane's weights are loaded first, all at once (independent
        loads in flight), then multiplied."""
        if unrolled:
            for i in T.unroll(KL):
                k = T.meta_var((i * KS + w) * WS + lane)
                for q in T.unroll(NG):
                    wv[q * KL + i] = T.if_then_else(k < K, f32(A[d, q * H + j, T.min(k, K - 1)], dtype), T.float32(0))
            for i in T.unroll(KL):
                k = T.meta_var((i * KS + w) * WS + lane)
                if k < K:
                    for q in T.unroll(NG):
                        for b in T.unroll(B):
                            acc[q * B + b] = acc[q * B + b] + wv[q * KL + i] * vec(V, d, b, k, state)
        else:
            for i in T.serial(KL):
                k = T.meta_var((i * KS + w) * WS + lane)
                if k < K:
                    for q in T.unroll(NG):
                        for b in T.unroll(B):
                            acc[q * B + b] = acc[q * B + b] + f32(A[d, q * H + j, k], dtype) * vec(V, d, b, k, state)

    @T.macro
    def sums(X, W, R, H0, ax, ah, wx, wh, red, d, j, w, lane):
        """ax[q * B + b] = W[d, qH + j, :] . X[0, b, :], ah[...] = R[d, qH + j, :] . h0[d, b, :], complete in thread
        (w 0, lane 0)."""
        for a in T.unroll(NA):
            ax[a] = T.float32(0)
            ah[a] = T.float32(0)
        k_sums(W, X, ax, wx, d, j, w, lane, I, KX, unroll_x, False)
        k_sums(R, H0, ah, wh, d, j, w, lane, H, KH, unroll_h, True)
        if gpu:
            for a in T.unroll(NA):
                for o in T.unroll(5):
                    ax[a] = ax[a] + T.tvm_warp_shuffle_xor(full, ax[a], 16 >> o, 32, 32)
                    ah[a] = ah[a] + T.tvm_warp_shuffle_xor(full, ah[a], 16 >> o, 32, 32)
            if KS > 1:   # the warps' shares of k: through shared memory to warp 0
                if lane == 0:
                    for a in T.unroll(NA):
                        red[w, a] = ax[a]
                        red[w, NA + a] = ah[a]
                T.tvm_storage_sync("shared")
                if w == 0 and lane == 0:
                    for a in T.unroll(NA):
                        ax[a] = red[0, a]
                        ah[a] = red[0, NA + a]
                        for v in T.unroll(KS - 1):
                            ax[a] = ax[a] + red[v + 1, a]
                            ah[a] = ah[a] + red[v + 1, NA + a]

    def lstm_pre(ax, ah, bias, d, j, b):
        return lambda q: ax[q * B + b] + bias[d, q * H + j] + ah[q * B + b]

    def lstm_peep(P, d, j):
        return (lambda q: P[d, q * H + j]) if lstm.has_peepholes else None

    # The cell's math for batch row b of unit (d, j) from its sums ax (W . x) and ah (R . h0), writing Y and Y_h
    # (and Y_c). Every cell takes the same buffers, None where it has none: bias, RbH (GRU), P (LSTM), H0, C0
    # (LSTM), Y, Yh, Yc (LSTM).
    @T.macro
    def gru_unit(bias, RbH, P, H0, C0, Y, Yh, Yc, ax, ah, d, j, b):
        z = fns[0](d, clip(ax[b] + bias[d, j] + ah[b]))
        r = fns[0](d, clip(ax[B + b] + bias[d, H + j] + ah[B + b]))
        n = fns[1](d, clip(ax[2 * B + b] + bias[d, 2 * H + j] + r * (ah[2 * B + b] + RbH[d, j])))
        h_new = (T.float32(1) - z) * n + z * H0[d, b, j]
        Y[0, d, b, j] = T.Cast(dtype, h_new)
        Yh[d, b, j] = T.Cast(dtype, h_new)

    @T.macro
    def rnn_unit(bias, RbH, P, H0, C0, Y, Yh, Yc, ax, ah, d, j, b):
        h_new = fns[0](d, clip(ax[b] + bias[d, j] + ah[b]))
        Y[0, d, b, j] = T.Cast(dtype, h_new)
        Yh[d, b, j] = T.Cast(dtype, h_new)

    @T.macro
    def lstm_unit(bias, RbH, P, H0, C0, Y, Yh, Yc, ax, ah, d, j, b):
        c_new = lstm.cell(fns, clip, d, lstm_pre(ax, ah, bias, d, j, b), lstm_peep(P, d, j), C0[d, b, j])
        h_new = lstm.hidden(fns, clip, d, lstm_pre(ax, ah, bias, d, j, b), lstm_peep(P, d, j), c_new)
        Y[0, d, b, j] = T.Cast(dtype, h_new)
        Yh[d, b, j] = T.Cast(dtype, h_new)
        Yc[d, b, j] = T.Cast(dtype, c_new)

    unit = {"gru": gru_unit, "rnn": rnn_unit, "lstm": lstm_unit}[cell]

    @T.macro
    def one_step(X, W, R, bias, RbH, P, H0, C0, Y, Yh, Yc):
        """Every cell's kernel body: a block (warps w, lanes) per unit (d, j) sums its gate rows, thread (0, 0)
        applies the cell's `unit` math to each batch row."""
        for blk in bx(nblk):
            for w in ty(KS):
                for lane in tx(WS):
                    ax = T.alloc_buffer((NA,), "float32", scope="local")
                    ah = T.alloc_buffer((NA,), "float32", scope="local")
                    wx = T.alloc_buffer((WX,), "float32", scope="local")
                    wh = T.alloc_buffer((WH,), "float32", scope="local")
                    red = T.alloc_buffer((KS, 2 * NA), "float32", scope=red_scope)
                    item = T.meta_var(blk)
                    d = T.meta_var(item // H)
                    j = T.meta_var(item % H)
                    if item < D * H:
                        sums(X, W, R, H0, ax, ah, wx, wh, red, d, j, w, lane)
                        if w == 0 and lane == 0:
                            for b in T.serial(B):
                                unit(bias, RbH, P, H0, C0, Y, Yh, Yc, ax, ah, d, j, b)

    # the cells' signatures (module doc)
    if cell == "lstm":
        @T.prim_func
        def main(X: T.Buffer((1, B, I), dtype), W: T.Buffer((D, G, I), dtype), R: T.Buffer((D, G, H), dtype),
                 bias: T.Buffer((D, G), "float32"), P: T.Buffer((D, 3 * H), "float32"),
                 H0: T.Buffer((D, B, H), "float32"), C0: T.Buffer((D, B, H), "float32"),
                 Y: T.Buffer((1, D, B, H), dtype), Yh: T.Buffer((D, B, H), dtype), Yc: T.Buffer((D, B, H), dtype)):
            one_step(X, W, R, bias, None, P, H0, C0, Y, Yh, Yc)
    elif cell == "gru":
        @T.prim_func
        def main(X: T.Buffer((1, B, I), dtype), W: T.Buffer((D, G, I), dtype), R: T.Buffer((D, G, H), dtype),
                 bias: T.Buffer((D, G), "float32"), RbH: T.Buffer((D, H), "float32"),
                 H0: T.Buffer((D, B, H), "float32"), Y: T.Buffer((1, D, B, H), dtype),
                 Yh: T.Buffer((D, B, H), dtype)):
            one_step(X, W, R, bias, RbH, None, H0, None, Y, Yh, None)
    else:
        @T.prim_func
        def main(X: T.Buffer((1, B, I), dtype), W: T.Buffer((D, G, I), dtype), R: T.Buffer((D, G, H), dtype),
                 bias: T.Buffer((D, G), "float32"), H0: T.Buffer((D, B, H), "float32"),
                 Y: T.Buffer((1, D, B, H), dtype), Yh: T.Buffer((D, B, H), dtype)):
            one_step(X, W, R, bias, None, None, H0, None, Y, Yh, None)

    return scheduled(main, f"{cell}_one_step", cooperative=False)
