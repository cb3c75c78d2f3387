"""Pipelined stack of GRU layers: every layer of a stack of L unidirectional GRUs (linear_before_reset=1,
the same hidden size) in ONE persistent kernel, layer l on its own subset of blocks, so layer l+1 works on
step t while layer l works on step t+1 (and layer l-1 on t+2, ...). Without it the layers run one after
the other and each waits for the whole sequence of the one below.

Interface:
  gate_i0 f32 [T, B, 3H]  layer 0's input projection (x W0^T + Wb0 + Rb0 for z, r; + Wb0 for h)
  R  [L, 3H, H] (dtype)   recurrent weights of every layer (gates z, r, h)
  W  [max(L-1,1), 3H, H]  input weights of layers 1..L-1 (their input is the layer below's state)
  bias_i f32 [max(L-1,1), 3H]  input biases of layers 1..L-1 (Wb + Rb for z, r; Wb for h)
  rb_h f32 [L, H], h0 f32 [L, B, H]
  ->  Y [L, T, B, H], Y_h [L, B, H] (dtype): every layer's sequence and final state.

Work split: layer l runs on blocks [l*G, (l+1)*G); block g owns units [g*U, (g+1)*U) and keeps their 3U
rows of R and (l >= 1) 3U rows of W on chip (registers, then shared memory: the engine's smem_rows). A
step of layer l >= 1 is two passes of the engine (`engine.make_engine_pass`): the input pass
reads layer l-1's state after the same step (LL words with flag s+1), the recurrent pass its own state
(flag s); then the gate math is local, as in the single-layer kernel.

Hand-off between layers: each layer's state goes through a ring of S LL slots. Within a layer two slots
suffice (see `engine`), but layer l does not wait for layer l+1, so it could lap it; before
layer l publishes step s+1 into slot (s+1) % S, which held step s+1-S, it waits until every block of
layer l+1 has finished iteration (s-S, c), the one that read that step. Blocks publish their progress
(iterations finished) with st.release after the passes' barrier; the wait polls it with ld.acquire.
With S = 8 the wait is almost never taken: it only bounds how far a faster lower layer runs ahead.
"""
from __future__ import annotations

import functools
import math

from ...errors import TvmseqError
from ...targets import is_gpu, resolve
from ..activations import Activation

_DTYPES = ("float32", "float16")
DEFAULT_SLOTS = 8

def stack_fits(geo, facts, L: int) -> str | None:
    """Why a stack geometry cannot run resident, or None. The engine's own check counts accumulators for
    all 6U rows; a pass here accumulates 3U rows (R or W) at a time."""
    per_sm = math.ceil(geo.cfg.num_blocks * L / facts.num_sms)
    if per_sm > 2:
        return f"{geo.cfg.num_blocks * L} blocks > 2 x {facts.num_sms} SMs: not all resident"
    vp = 1 << (3 * geo.U * geo.BC - 1).bit_length()
    regs = geo.R_reg * geo.KT + geo.BC * geo.KT + vp + 48
    cap = min(facts.max_regs_per_thread, facts.regs_per_sm // (geo.NT * per_sm))
    if regs > cap:
        return f"~{regs} registers per thread > {cap} ({per_sm} blocks per SM)"
    smem = 4 * (geo.R_smem * geo.Hp + 2 * geo.W * vp)
    smem_cap = facts.smem_per_block if per_sm == 1 else (228 * 1024) // per_sm - 1024
    if smem > smem_cap:
        return f"{smem} B shared memory per block > {smem_cap} ({per_sm} blocks per SM)"
    return None


def default_stack_config(L: int, B: int, H: int, dtype: str, target):
    """Schedule of a stack: G = 128 // L blocks per layer, then the (warps, batch chunk, shared-memory rows)
    with the fewest iterations per step (each costs two hand-offs) and, among those, the fewest rows in
    shared memory. On CPU a small config that still has several blocks, threads and chunks."""
    from .. import recurrent_gemm as rg

    target = resolve(target)
    if not is_gpu(target):
        return rg.PersistentConfig(num_blocks=min(3, H), num_warps=min(4, H), batch_chunk=min(2, B))
    facts = rg.gpu_facts(target)
    G = max(1, min(128, facts.num_sms) // L)
    G = math.ceil(H / math.ceil(H / G))
    best = None
    for warps in (4, 8, 16):
        for cap in (1, 2, 4, 8, 16):
            cfg = rg.PersistentConfig(G, warps, rg._pick_batch_chunk(B, cap), 0)
            geo0 = _geometry(B, H, cfg, True)
            for smem_rows in range(0, geo0.R + 1, 3):
                geo = _geometry(B, H, cfg.replace(smem_rows=smem_rows), True)
                if stack_fits(geo, facts, L) is None:
                    score = (geo.NC, smem_rows, -warps)
                    if best is None or score < best[0]:
                        best = (score, geo.cfg)
                    break
    if best is None:
        raise TvmseqError(f"no pipelined configuration keeps {L} layers of {H}x{H} {dtype} GRU weights on chip")
    return best[1]


def default_config(L: int, B: int, H: int, dtype: str, target):
    """The schedule `stacked_gru_func` uses when none is given: for two or more layers the row-split one
    (`rows`; on the H100 4 x H512 B8 took 6.1 us a step against 14.9 for this module's k-split
    engine) when it fits, else the k-split engine's `default_stack_config`. One layer keeps the k-split
    engine, which is what the single-layer persistent GRU measured faster with."""
    from .rows import default_rows_config

    if L >= 2:
        try:
            return default_rows_config(L, B, H, target)   # only configs that pass RowGeometry.check
        except TvmseqError:
            pass
    return default_stack_config(L, B, H, dtype, target)


def _geometry(B, H, cfg, gpu):
    from .. import recurrent_gemm as rg

    return rg.EngineGeometry(6 * H, H, B, cfg, 32 if gpu else 1, rows_per_unit=6)


def fits_on_chip(L: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[bool, str]:
    """Whether the R and W weights of all L layers stay on chip for the pipelined kernel, and why not."""
    from .. import recurrent_gemm as rg
    from .rows import RowGeometry, RowSplitConfig

    def why_not(cfg, facts):
        if isinstance(cfg, RowSplitConfig):
            return RowGeometry(L, B, H, cfg, 32).check(facts)
        return stack_fits(_geometry(B, H, cfg, True), facts, L)

    return rg.fit_report(target, config, lambda tgt: default_config(L, B, H, dtype, tgt), why_not, "pipelined")


def check_stack_args(name: str, L: int, B: int, H: int, dtype: str, slots: int) -> None:
    """The argument checks of a stack kernel (`name` names it in the errors)."""
    if dtype not in _DTYPES:
        raise TvmseqError(f"{name}: dtype must be one of {_DTYPES}, got {dtype}")
    if L < 1 or min(B, H) < 1:
        raise TvmseqError(f"{name}: layers, batch and hidden must be >= 1, got L={L} B={B} H={H}")
    if slots < 2:
        raise TvmseqError(f"{name}: needs at least 2 LL slots, got {slots}")


def stacked_gru_func(L: int, B: int, H: int, dtype: str, target, acts=None, clip=None, config=None,
                     slots: int = DEFAULT_SLOTS, fast_math: bool | None = None):
    """prim_func(gate_i0, R, W, bias_i, rb_h, h0, Y, Y_h) for a pipelined stack of L GRU layers (module doc).
    acts: (f, g) Activations shared by every layer (default sigmoid, tanh); clip: shared cell clip.
    config: a recurrent_gemm.PersistentConfig (this module's k-split engine) or a
    rows.RowSplitConfig (the row-split schedule, same interface)."""
    from tvm.script import tirx as T

    from .. import recurrent_gemm as rg
    from .cells import clip_fn, fast_math_for
    from .engine import finished_item, make_engine_pass, require_fit
    from .rows import RowSplitConfig, progress_macros, stack_prim_func, stacked_gru_rows_func

    target = resolve(target)
    gpu = is_gpu(target)
    check_stack_args("stacked GRU", L, B, H, dtype, slots)
    config = config or default_config(L, B, H, dtype, target)
    if isinstance(config, RowSplitConfig):
        return stacked_gru_rows_func(L, B, H, dtype, target, acts, clip, config, slots, fast_math)
    f_act, g_act = acts or (Activation.make("Sigmoid"), Activation.make("Tanh"))
    fast = fast_math_for(dtype, gpu, fast_math)
    geo = _geometry(B, H, config, gpu)
    why = stack_fits(geo, rg.gpu_facts(target), L) if gpu else geo.check(None, 0)
    require_fit(geo, H, why, "stacked GRU", f"L={L} B={B} H={H} {dtype}")
    G, W_, NT, WS = geo.G, geo.W, geo.NT, geo.warp_size
    U, R_reg, R_smem, KT, Hp = geo.U, geo.R_reg, geo.R_smem, geo.KT, geo.Hp
    BC, NC, Bp = geo.BC, geo.NC, geo.Bp
    S, LW = slots, max(L - 1, 1)
    slot_words = Bp * Hp
    ll_words = L * S * slot_words
    reset_progress, wait_for_next_layer, publish_progress = progress_macros(L, G, S, NC, ll_words)
    UV = U * BC
    fin_iters = math.ceil(UV / NT)
    unroll = T.unroll if gpu else T.serial
    ll_store, ll_wait = rg.make_ll_ops(gpu, BC, KT, poll=rg.PollOptions(report="lane0"))
    f32 = lambda x: rg.f32(x, dtype)  # noqa: E731
    clipf = clip_fn(clip)

    def word(layer, slot):
        return (layer * S + slot) * slot_words

    pass_rec, vp = make_engine_pass(geo, H, B, 0, 3 * U, ll_wait, gpu)      # local rows [0, 3U): R
    pass_inp, _ = make_engine_pass(geo, H, B, 3 * U, 3 * U, ll_wait, gpu)   # local rows [3U, 6U): W

    def total(red, v):
        return functools.reduce(lambda x, y: x + y, [red[w, v] for w in range(W_)])

    def gate(red, q, v):
        """Reduced sum of gate q of item v = bb * U + u over a 3U-row pass."""
        return total(red, (v // U) * 3 * U + q * U + v % U)

    @T.macro
    def load_weights(Rw, Ww, a_reg, a_smem, l, g, t):
        """Local row r < 3U: R row (r // U) * H + g*U + r % U; r >= 3U: the same row of W (layers >= 1)."""
        for r in unroll(R_reg):
            for j in unroll(KT):
                unit = T.meta_var(g * U + r % U)
                k = T.meta_var(t * KT + j)
                row = T.meta_var(((r // U) % 3) * H + T.min(unit, H - 1))
                a_reg[r * KT + j] = T.if_then_else(
                    unit < H and k < H,
                    T.if_then_else(r < 3 * U, f32(Rw[l, row, T.min(k, H - 1)]),
                                   f32(Ww[T.max(l - 1, 0), row, T.min(k, H - 1)])), T.float32(0))
        for r in range(R_smem):
            for j in unroll(KT):
                rr = T.meta_var(R_reg + r)
                unit = T.meta_var(g * U + rr % U)
                k = T.meta_var(t * KT + j)
                row = T.meta_var(((rr // U) % 3) * H + T.min(unit, H - 1))
                a_smem[r, k] = T.if_then_else(
                    unit < H and k < H,
                    T.if_then_else(rr < 3 * U, f32(Rw[l, row, T.min(k, H - 1)]),
                                   f32(Ww[T.max(l - 1, 0), row, T.min(k, H - 1)])), T.float32(0))

    @T.macro
    def seed(H0, ws, hs, hrow, l, g, t):
        for c in range(NC):
            for i in unroll(fin_iters):
                v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
                hs[hrow, c * fin_iters + i] = T.if_then_else(
                    v < UV and b < B and j < H, H0[l, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))
                if v < UV and b < B and j < H:
                    ll_store(ws, word(l, 0) + b * Hp + j, H0[l, b, j], 0)
                    for sl in unroll(S - 1):
                        ll_store(ws, word(l, sl + 1) + b * Hp + j, T.float32(0), -1)

    @T.macro
    def finish(GI0, BI, RbH, Y, ws, hs, hrow, red_r, red_i, l, g, t, s, c):
        for i in unroll(fin_iters):
            v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
            if v < UV and b < B and j < H:
                # the input part of the gates: layer 0's precomputed projection, else the input pass
                gz = T.meta_var(T.if_then_else(l == 0, GI0[s, T.min(b, B - 1), T.min(j, H - 1)],
                                               BI[T.max(l - 1, 0), j] + gate(red_i, 0, v)))
                gr = T.meta_var(T.if_then_else(l == 0, GI0[s, T.min(b, B - 1), H + T.min(j, H - 1)],
                                               BI[T.max(l - 1, 0), H + j] + gate(red_i, 1, v)))
                gh = T.meta_var(T.if_then_else(l == 0, GI0[s, T.min(b, B - 1), 2 * H + T.min(j, H - 1)],
                                               BI[T.max(l - 1, 0), 2 * H + j] + gate(red_i, 2, v)))
                h = T.meta_var(hs[hrow, c * fin_iters + i])
                z = T.meta_var(f_act.expr(clipf(gz + gate(red_r, 0, v)), fast))
                r = T.meta_var(f_act.expr(clipf(gr + gate(red_r, 1, v)), fast))
                hh = T.meta_var(g_act.expr(clipf(gh + r * (gate(red_r, 2, v) + RbH[l, j])), fast))
                hn = (T.float32(1) - z) * hh + z * h
                Y[l, s, b, j] = T.Cast(dtype, hn)
                hs[hrow, c * fin_iters + i] = hn
                ll_store(ws, word(l, (s + 1) % S) + b * Hp + j, hn, s + 1)

    @T.macro
    def final_state(Yh, hs, hrow, l, g, t, seq):
        for c in range(NC):
            for i in unroll(fin_iters):
                v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
                if v < UV and b < B and j < H:
                    Yh[l, b, j] = T.Cast(dtype, T.if_then_else(seq > 0, hs[hrow, c * fin_iters + i], T.float32(0)))

    smem_shape, smem_scope = ((R_smem, Hp), "shared.dyn") if R_smem else ((1, 1), "local")

    @T.macro
    def body(GI0, Rw, Ww, cb, seq):
        BI, RbH, H0, Y, Yh = T.meta_var(cb)
        # LL words, then (GPU) one progress counter per block: the CPU variant runs layers in order, needs none
        ws = T.alloc_buffer((ll_words * 2 + (L * G if gpu else 0),), "int32", scope="global")
        if gpu:   # a compile-time branch: the GPU and CPU variants share one signature
            for gb in T.thread_binding(L * G, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32", scope="local")
                    a_smem = T.alloc_buffer(smem_shape, "float32", scope=smem_scope)
                    cval = T.alloc_buffer((BC * KT,), "float32", scope="local")
                    acc = T.alloc_buffer((vp,), "float32", scope="local")
                    red_r = T.alloc_buffer((W_, vp), "float32", scope="shared")
                    red_i = T.alloc_buffer((W_, vp), "float32", scope="shared")
                    hs = T.alloc_buffer((1, NC * fin_iters), "float32", scope="local")
                    l = T.meta_var(gb // G)
                    g = T.meta_var(gb % G)
                    load_weights(Rw, Ww, a_reg, a_smem, l, g, t)
                    seed(H0, ws, hs, 0, l, g, t)
                    reset_progress(ws, gb, t)
                    T.cuda.grid_sync()
                    for it in T.serial(seq * NC):
                        wait_for_next_layer(ws, l, t, it)
                        if l > 0:
                            pass_inp(ws, word(l - 1, (it // NC + 1) % S), it // NC + 1, a_reg, a_smem, cval, acc,
                                     red_i, t % WS, t // WS, t, it % NC)
                        pass_rec(ws, word(l, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red_r,
                                 t % WS, t // WS, t, it % NC)
                        T.tvm_storage_sync("shared")
                        publish_progress(ws, gb, t, it)
                        finish(GI0, BI, RbH, Y, ws, hs, 0, red_r, red_i, l, g, t, it // NC, it % NC)
                        T.tvm_storage_sync("shared")
                    final_state(Yh, hs, 0, l, g, t, seq)
        else:
            a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32")
            a_smem = T.alloc_buffer((max(R_smem, 1), Hp), "float32")
            cval = T.alloc_buffer((BC * KT,), "float32")
            acc = T.alloc_buffer((vp,), "float32")
            red_r = T.alloc_buffer((W_, vp), "float32")
            red_i = T.alloc_buffer((W_, vp), "float32")
            hs = T.alloc_buffer((L * G * NT, NC * fin_iters), "float32")
            for l, g, t in T.grid(L, G, NT):
                seed(H0, ws, hs, (l * G + g) * NT + t, l, g, t)
            for it in T.serial(seq * NC):
                # layer by layer, every block's passes before its gate math: each LL word is ready when read
                for l, g in T.grid(L, G):
                    for t in T.serial(NT):
                        load_weights(Rw, Ww, a_reg, a_smem, l, g, t)
                        if l > 0:
                            pass_inp(ws, word(l - 1, (it // NC + 1) % S), it // NC + 1, a_reg, a_smem, cval,
                                     acc, red_i, 0, t, t, it % NC)
                        pass_rec(ws, word(l, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red_r,
                                 0, t, t, it % NC)
                    for t in T.serial(NT):
                        finish(GI0, BI, RbH, Y, ws, hs, (l * G + g) * NT + t, red_r, red_i, l, g, t,
                               it // NC, it % NC)
            for l, g, t in T.grid(L, G, NT):
                final_state(Yh, hs, (l * G + g) * NT + t, l, g, t, seq)

    return rg.scheduled(stack_prim_func(body, "gru", L, LW, B, H, dtype), "gru_stack", cooperative=gpu)


# ---- LSTM stacks -------------------------------------------------------------------------------------
# A stack of forward LSTM layers runs on the row-split schedule only (`rows`, cell "lstm"): for
# GRU stacks it was measured 2.4x faster a step than this module's k-split engine at 4 x H512 B8, and an
# LSTM unit's 8 rows (R and W, gates i, o, f, c) would cost the k-split reduction even more.
#
# Interface:
#   gate_i0 f32 [T, B, 4H]  layer 0's input projection (x W0^T + Wb0 + Rb0, gates i, o, f, c)
#   R [L, 4H, H], W [max(L-1,1), 4H, H] (dtype), bias_i f32 [max(L-1,1), 4H] (Wb + Rb of layers 1..L-1)
#   P f32 [L, 3H] (peepholes i, o, f; read only when has_peepholes), h0, c0 f32 [L, B, H]
#   ->  Y [L, T, B, H], Y_h [L, B, H], Y_c [L, B, H] (dtype)

def default_lstm_config(L: int, B: int, H: int, target):
    """The row-split schedule of an LSTM stack (`rows.default_rows_config`, cell 'lstm')."""
    from .rows import default_rows_config

    return default_rows_config(L, B, H, target, "lstm")


def lstm_fits_on_chip(L: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[bool, str]:
    """Whether the R and W weights of all L LSTM layers stay on chip for the pipelined kernel, and why not."""
    from .rows import rows_fit

    if dtype not in _DTYPES:
        return False, f"dtype {dtype} is not one of {_DTYPES}"
    return rows_fit(L, B, H, target, config, "lstm")


def stacked_lstm_func(L: int, B: int, H: int, dtype: str, target, acts=None, clip=None, input_forget: bool = False,
                      has_peepholes: bool = False, config=None, slots: int = DEFAULT_SLOTS,
                      fast_math: bool | None = None):
    """prim_func(gate_i0, R, W, bias_i, P, h0, c0, Y, Y_h, Y_c) named "lstm_stack" for a pipelined stack of L
    forward LSTM layers (interface above). acts: [f, g, h] Activations shared by every layer (default sigmoid,
    tanh, tanh); clip: shared cell clip; input_forget / has_peepholes: `cells.LstmCell`'s options,
    shared by every layer. config: a rows.RowSplitConfig (None: `default_lstm_config`)."""
    from .cells import LstmCell
    from .rows import RowSplitConfig, stacked_lstm_rows_func

    check_stack_args("stacked LSTM", L, B, H, dtype, slots)
    if config is not None and not isinstance(config, RowSplitConfig):
        raise TvmseqError(f"stacked LSTM: config must be a rows.RowSplitConfig (the k-split engine has "
                          f"no LSTM stack), got {type(config).__name__}")
    if acts is not None and len(acts) != 3:
        raise TvmseqError(f"stacked LSTM: needs 3 activations (f, g, h), got {len(acts)}")
    return stacked_lstm_rows_func(L, B, H, dtype, target, acts, clip, config, slots,
                                  LstmCell(bool(input_forget), bool(has_peepholes)), fast_math)
