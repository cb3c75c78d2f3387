"""The persistent SIMT engine: all time steps of a GRU, RNN or LSTM node (one or both directions) in ONE CUDA
kernel, on the engine of `recurrent_gemm` (weights on chip, LL {value, step} word hand-off, no per-step barrier).
Which path runs a node (this engine, the staged-state kernels, the per-step kernels) is `paths`.

GRU (`persistent_gru_func`; an RNN is the same kernel with one weight row a unit, cell 'rnn'):

Interface (identical to the per-step `gru.recurrence_func`, so the ONNX converter can pick either):
  gate_i f32 [D, T, B, 3H] (X W^T + biases folded in), R [D, 3H, H] (dtype), rb_h f32 [D, H],
  seq_lens i32 [B], h0 f32 [D, B, H]  ->  Y [T, D, B, H], Y_h [D, B, H] (dtype), T symbolic.

Work split. Direction d runs on blocks [d*G, (d+1)*G). Block g of a direction owns U hidden units
j in [g*U, (g+1)*U) and keeps rows j, H+j, 2H+j of R (z, r and h gates of its units, 3U rows) in
registers (the last `smem_rows` of them in shared memory) for the whole run. Inside a block each
thread owns a k-slice of the state (as in the recurrent GEMM), so the three gate sums of a unit end in
the same block and the gate math is local: the thread that finishes (unit, batch column) reads its
gate_i values (prefetched before the poll), keeps the unit's state in shared memory (float32, like the
per-step path), writes Y and publishes h'[j] as an LL word.

linear_before_reset=1: one pass (3U rows) and one hand-off per step.
linear_before_reset=0: the h-gate product needs (r*h) of every unit, so a step has two passes and two
hand-offs: pass A (z, r rows) reads h_{n-1} and publishes r*h_{n-1} to a second LL buffer; pass B (h
rows) reads it and publishes h_n. Two slots per buffer still suffice (a block writing step n of a
buffer has read step n-1 of the other from every block, which they produced after reading step n-2).

sequence_lens: the length of row b is clamp(seq_lens[b], 0, T); at step s >= length the unit keeps
(and republishes) its state and writes Y[s] = 0; the reverse direction handles t = length-1-s at step s.
Y_h is the state after the last valid step, 0 for a zero-length row (onnxruntime).

The CPU variant is the same per-thread code with serial loops (step loop outermost, passes of all
blocks before the next pass), so CI checks indexing and numerics on llvm. When the weights do not fit
on chip (`fits_on_chip`), `paths.recurrence_func_auto` returns the per-step kernel of `gru.py` instead.

LSTM (`persistent_lstm_func`): a cell of the same engine (`engine_func`), not a kernel of its own: block g of a
direction keeps rows i, o, f, c of its U units (4U rows of R) in registers / shared memory, a step is one pass of
those rows over h_{n-1}, and the thread that finishes (unit, batch column) holds that item's h AND its cell state c
in float32 registers for all steps (c never leaves the chip; only h is handed off). The update math is
`cells.LstmCell`. Interface (the same on every LSTM path, so the converter can take either):
  gate_i f32 [D, T, B, 4H] (X W^T + Wb + Rb, gates i, o, f, c), R [D, 4H, H] (dtype), P f32 [D, 3H] (peepholes
  i, o, f; zeros when none), seq_lens i32 [B], h0 f32 [D, B, H], c0 f32 [D, B, H]
  -> Y [T, D, B, H], Y_h [D, B, H], Y_c [D, B, H] (dtype), T symbolic.
"""
from __future__ import annotations

import functools
import math

from ...errors import TvmseqError
from ...targets import is_gpu, resolve
from .cells import (CELL_GATES, GATES, LstmCell, cell_math, check_acts, direction_activations, fast_math_for,
                    lstm_activations, recurrence_prim_func, row_length)

DIRECTIONS = ("forward", "reverse", "bidirectional")
_DTYPES = ("float32", "float16")


def _num_directions(directions: str) -> int:
    if directions not in DIRECTIONS:
        raise TvmseqError(f"persistent GRU: direction must be one of {DIRECTIONS}, got {directions!r}")
    return 2 if directions == "bidirectional" else 1


def default_gru_config(D: int, B: int, H: int, dtype: str, target, cell: str = "gru", measured: bool = True):
    """Engine schedule for a GRU (3 weight rows per unit) or an RNN (1), D recurrences on disjoint block
    subsets: the measured winner (`schedules/measured/persistent_gru.json`, `schedules/tune_persistent_gru.py`)
    where there is one, else the cost model's pick."""
    from ...tune import measured as db
    from .. import recurrent_gemm as rg

    ng = CELL_GATES[cell]
    if measured and is_gpu(resolve(target)):
        config = db.lookup("persistent_gru", D=D, B=B, H=H, dtype=dtype, cell=cell)
        if config:
            return rg.PersistentConfig(**config)
    return rg.default_config(H, B, dtype, target, rows_per_unit=ng, directions=D, rows_total=ng * H,
                             step_cost=fitted_step_us)


# Time of one step (us) as a linear function of step_features, least squares over the engine sweep on the H100
# (schedules/engine_cost_fit.py on artifacts/bench/pgru_sweep.json.gz, 2026-11-23: 387 configs of 32 GRU/RNN cells,
# rms residual 0.89 us). Its picks were 0-79% slower than the best config timed (mean 7%, each cell left out of
# its own fit) where `recurrent_gemm.estimate_step_cycles`'s were 0-110% (mean 43%): each pass of a step pays
# its own hand-off (~0.3 us + its issue time), which the cycle model overlaps.
STEP_FIT_US = (0.305, 0.332, 0.651, 0.052, 0.205)


def step_features(geo) -> list[float]:
    """1, passes a step (NC), NC x one pass's issue cycles / 1000, NC x k-values a thread, NC x blocks / 64."""
    from ..recurrent_gemm import pass_issue_cycles

    return [1.0, geo.NC, geo.NC * pass_issue_cycles(geo) / 1000, geo.NC * geo.KT, geo.NC * geo.G / 64]


def fitted_step_us(geo) -> float:
    return sum(w * f for w, f in zip(STEP_FIT_US, step_features(geo)))


def _geometry(D, B, H, cfg, gpu, cell: str = "gru"):
    from .. import recurrent_gemm as rg

    return rg.EngineGeometry(CELL_GATES[cell] * H, H, B, cfg, 32 if gpu else 1, rows_per_unit=CELL_GATES[cell])


def fits_on_chip(D: int, B: int, H: int, dtype: str, target=None, config=None, cell: str = "gru") -> tuple[bool, str]:
    """Whether the recurrent weights of all D directions (3H x H each) stay on chip for the persistent
    kernel on the target's GPU (registers + shared memory of resident blocks), and why not."""
    from .. import recurrent_gemm as rg

    def why_not(cfg, facts):
        geo = _geometry(D, B, H, cfg, True, cell)
        why = geo.check(facts, cfg.num_blocks * D)
        if why is None and cfg.num_blocks * geo.U < H:
            why = f"{cfg.num_blocks} blocks x {geo.U} units < {H} hidden units"
        return why

    return rg.fit_report(target, config, lambda tgt: default_gru_config(D, B, H, dtype, tgt, cell), why_not)


def require_fit(geo, H: int, why, name: str, shape: str) -> None:
    """Raise (`name` the kernel, `shape` its sizes) when the engine geometry cannot run (`why` from its check, None
    when it can) or its blocks do not cover the H units."""
    if why:
        raise TvmseqError(f"{name} {shape}: {why}")
    if geo.G * geo.U < H:
        raise TvmseqError(f"{name}: {geo.G} blocks x {geo.U} units do not cover H={H}")


def make_engine_pass(geo, H: int, B: int, r0: int, nr: int, ll_wait, gpu: bool):
    """(do_pass macro, vp): a pass of the engine over local weight rows [r0, r0 + nr): poll the LL words of
    one state vector (this thread's k-slice of batch chunk c), multiply by the rows (registers first,
    then shared memory) and reduce over the block's threads into red[warp, bb * nr + row]."""
    from tvm.script import tirx as T

    from .. import recurrent_gemm as rg

    BC, KT, Hp, R_reg, WS = geo.BC, geo.KT, geo.Hp, geo.R_reg, geo.warp_size
    unroll = T.unroll if gpu else T.serial
    vp = rg.padded_sums(nr * BC, geo.warp_size)
    xor = rg.xor_layout(nr, BC, WS)   # (h, row bits): this lane's weight rows were loaded permuted (load_weights)
    reduce = rg.make_warp_reduce(WS, vp, select_free=xor is not None)
    # the state columns' XOR layers (a column bit each; five explicit slots keep the macro static, 0 = none)
    col_bits = ([1 << i for i in range(BC.bit_length() - 1)] if xor else []) + [0] * 5
    row_bits = xor[1] if xor else 0

    @T.macro
    def swap_layer(cval, lane, bit):
        """XOR layout: column slot b takes batch column b ^ (lane >> row_bits), one column bit at a time."""
        if bit > 0:
            for lo in unroll(BC // (2 * bit)):
                for m in unroll(bit):
                    for j in unroll(KT):
                        swap = T.meta_var(T.bitwise_and(T.shift_right(lane, row_bits), bit) != 0)
                        x = cval[(lo * 2 * bit + m) * KT + j]
                        y = cval[(lo * 2 * bit + m + bit) * KT + j]
                        cval[(lo * 2 * bit + m) * KT + j] = T.Select(swap, y, x)
                        cval[(lo * 2 * bit + m + bit) * KT + j] = T.Select(swap, x, y)
    reg_n = max(0, min(r0 + nr, R_reg) - r0)       # rows of this pass held in registers
    sm_lo = max(r0, R_reg)                         # first row of this pass in shared memory
    sm_n = r0 + nr - sm_lo

    @T.macro
    def do_pass(ws, base, flag, a_reg, a_smem, cval, acc, red, lane, warp, t, c):
        b0 = T.meta_var(c * BC)
        ll_wait(ws, base + b0 * Hp + t * KT, Hp, flag, T.max(T.min(H - t * KT, KT), 0),
                T.min(B - b0, BC), cval)
        swap_layer(cval, lane, col_bits[0])
        swap_layer(cval, lane, col_bits[1])
        swap_layer(cval, lane, col_bits[2])
        swap_layer(cval, lane, col_bits[3])
        swap_layer(cval, lane, col_bits[4])
        for v in unroll(vp):
            acc[v] = T.float32(0)
        if reg_n > 0:
            for r in unroll(reg_n):
                for j in unroll(KT):
                    for bb in unroll(BC):
                        acc[bb * nr + r] = acc[bb * nr + r] + a_reg[(r0 + r) * KT + j] * cval[bb * KT + j]
        if sm_n > 0:
            for r in unroll(sm_n):
                for j in unroll(KT):
                    for bb in unroll(BC):
                        acc[bb * nr + sm_lo - r0 + r] = (acc[bb * nr + sm_lo - r0 + r]
                                                         + a_smem[sm_lo - R_reg + r, t * KT + j] * cval[bb * KT + j])
        reduce(acc, lane, red, warp)

    return do_pass, vp


def finished_item(geo, g, t, c, i):
    """(v, b, j) of the i-th item that thread t of block g finishes in batch chunk c: v = bb * U + u among the
    U * BC items of a pass, b its batch row, j its hidden unit (v, b or j out of range: a padding item). Bound
    with T.meta_var, so the CUDA source inlines the expressions instead of naming them."""
    v = i * geo.NT + t
    return v, c * geo.BC + v // geo.U, g * geo.U + v % geo.U


def weight_row_of_slot(passes, WS: int, BC: int):
    """slot_row(s, lane): the local weight row a lane keeps in row slot s, given the passes [(r0, nr)] (rows of a
    pass in the XOR layout of `recurrent_gemm.xor_layout` are permuted per lane; other rows stay in place)."""
    from .. import recurrent_gemm as rg

    layouts = [(r0, nr, rg.xor_layout(nr, BC, WS)) for r0, nr in passes]

    def slot_row(s, lane):   # s: a loop variable (a TIR expression)
        from tvm import tirx
        from tvm.script import tirx as T

        row = s
        for r0, nr, xor in layouts:
            if xor:
                row = T.Select(tirx.all(r0 <= s, s < r0 + nr), r0 + rg.xor_row(s - r0, xor[0], xor[1], lane), row)
        return row
    return slot_row


def persistent_gru_func(D: int, B: int, H: int, dtype: str, lbr, directions: str, acts, clip,
                        has_seq_lens: bool, target, config=None, slots: int = 2, poll=None,
                        paired_buffers: bool = True, syncwarp_before_barrier: bool = False, cell: str = "gru",
                        fast_math: bool | None = None):
    """prim_func(gate_i, R, rb_h, seq_lens, h0, Y, Y_h) for all steps of a GRU node (see module doc).
    slots: LL slots per state buffer (2 suffice, see the module doc; more give producers slack);
    poll: recurrent_gemm.PollOptions of the hand-off waits (default: lane-0 reports); fast_math:
    `cells.fast_math_for`."""
    if cell not in GATES:
        raise TvmseqError(f"persistent recurrence: cell must be one of {tuple(GATES)}, got {cell!r}")
    return engine_func(D, B, H, dtype, lbr, directions, acts, clip, has_seq_lens, target, config, slots, poll,
                       paired_buffers, syncwarp_before_barrier, cell, fast_math=fast_math)


def engine_func(D: int, B: int, H: int, dtype: str, lbr, directions: str, acts, clip, has_seq_lens: bool,
                target, config=None, slots: int = 2, poll=None, paired_buffers: bool = True,
                syncwarp_before_barrier: bool = False, cell: str = "gru", lstm=None, fast_math: bool | None = None):
    """The engine's kernel for a cell of CELL_GATES: `persistent_gru_func`'s for a GRU or an RNN; for an LSTM
    (cell 'lstm', `lstm` the cell's update math: `cells.LstmCell`) prim_func(gate_i [D, T, B, 4H],
    R [D, 4H, H], P [D, 3H], seq_lens, h0, c0, Y, Y_h, Y_c): one pass of the 4U rows (i, o, f, c) of a block's
    units a step, the cell state c kept in float32 in the finishing thread's registers next to h."""
    from tvm.script import tirx as T

    from .. import recurrent_gemm as rg

    target = resolve(target)
    gpu = is_gpu(target)
    label = "LSTM" if cell == "lstm" else "GRU"
    if _num_directions(directions) != D:
        raise TvmseqError(f"persistent {label}: direction {directions} needs D={_num_directions(directions)}, "
                          f"got {D}")
    if dtype not in _DTYPES:
        raise TvmseqError(f"persistent {label}: dtype must be one of {_DTYPES}, got {dtype}")
    if min(B, H) < 1:
        raise TvmseqError(f"persistent {label}: batch and hidden must be >= 1, got B={B} H={H}")
    if cell not in CELL_GATES or (cell == "lstm") != (lstm is not None):
        raise TvmseqError(f"persistent recurrence: cell must be one of {tuple(CELL_GATES)} (an LSTM with its "
                          f"update math), got {cell!r}")
    NG = CELL_GATES[cell]        # weight rows per hidden unit: z, r, h gates (GRU), one (RNN), i, o, f, c (LSTM)
    acts = check_acts(acts, D, cell)
    lbr = bool(lbr) or cell != "gru"  # an RNN or LSTM step is the one-pass path (its NG rows in one pass)
    config = config or default_gru_config(D, B, H, dtype, target, cell)
    geo = _geometry(D, B, H, config, gpu, cell)
    why = geo.check(rg.gpu_facts(target) if gpu else None, config.num_blocks * D)
    require_fit(geo, H, why, f"persistent {label}", f"D={D} B={B} H={H} {dtype}")
    G, W, NT, WS = geo.G, geo.W, geo.NT, geo.warp_size
    U, R_reg, R_smem, KT, Hp = geo.U, geo.R_reg, geo.R_smem, geo.KT, geo.Hp
    BC, NC, Bp = geo.BC, geo.NC, geo.Bp
    if slots < 2:
        raise TvmseqError(f"persistent {label}: needs at least 2 LL slots, got {slots}")
    S = slots
    slot_words = Bp * Hp
    nbuf = 1 if lbr else 2       # LL buffers per direction: h (and r*h for lbr=0)
    ws_words = D * nbuf * S * slot_words
    UV = U * BC                  # (unit, batch column) items finished per pass
    fin_iters = math.ceil(UV / NT)
    unroll = T.unroll if gpu else T.serial
    poll = poll or rg.PollOptions(report="lane0")  # a lost word is printf'd, not hung on
    ll_store, ll_wait = rg.make_ll_ops(gpu, BC, KT, poll=poll)
    f32 = lambda x: rg.f32(x, dtype)  # noqa: E731

    # ---- per-direction math ---------------------------------------------------------------------
    fast = fast_math_for(dtype, gpu, fast_math)
    f_act, g_act, clipf = cell_math(acts, D, NG, clip, fast)
    if directions == "forward":
        is_rev = lambda d: False  # noqa: E731
    elif directions == "reverse":
        is_rev = lambda d: True  # noqa: E731
    else:
        is_rev = lambda d: d == 1  # noqa: E731

    fwd_only = directions == "forward"

    def word(d, buf, slot):
        """First LL word of (direction, buffer, slot)."""
        return ((d * nbuf + buf) * S + slot) * slot_words

    def warp_total(red, v):
        return functools.reduce(lambda x, y: x + y, [red[w, v] for w in range(W)])

    def make_pass(r0, nr):
        return make_engine_pass(geo, H, B, r0, nr, ll_wait, gpu)

    passes = [(0, NG * U)] if lbr else [(0, 2 * U), (2 * U, U)]   # (first local row, rows): z,r,h or z,r then h
    if lbr:
        pass_zrh, vp_max = make_pass(*passes[0])
    else:
        (pass_zr, vp_a), (pass_h, vp_b) = [make_pass(*p) for p in passes]
        vp_max = max(vp_a, vp_b)
    slot_row = weight_row_of_slot(passes, WS, BC)

    # ---- per-thread pieces ----------------------------------------------------------------------
    @T.macro
    def load_weights(Rw, a_reg, a_smem, d, g, t):
        """Local row r = gate * U + u holds R row gate * H + g * U + u (zero when that unit is >= H); row slot s
        of a lane holds local row slot_row(s, lane) (itself, or permuted in a pass of the XOR layout)."""
        for s in unroll(R_reg):
            for j in unroll(KT):
                r = T.meta_var(slot_row(s, t % WS))
                unit = T.meta_var(g * U + r % U)
                k = T.meta_var(t * KT + j)
                a_reg[s * KT + j] = T.if_then_else(
                    unit < H and k < H, f32(Rw[d, (r // U) * H + T.min(unit, H - 1), T.min(k, H - 1)]), T.float32(0))
        for s in range(R_smem):
            for j in unroll(KT):
                r = T.meta_var(slot_row(R_reg + s, t % WS))
                unit = T.meta_var(g * U + r % U)
                k = T.meta_var(t * KT + j)
                a_smem[s, k] = T.if_then_else(
                    unit < H and k < H,
                    f32(Rw[d, (r // U) * H + T.min(unit, H - 1), T.min(k, H - 1)]), T.float32(0))

    length = row_length(has_seq_lens, B)

    # The state of the units a thread finishes lives in that thread's registers (GPU: hs[0, c * fin_iters
    # + i], local scope, so no barrier protects it; the CPU variant keeps one row per (block, thread)).
    @T.macro
    def seed(H0, ws, hs, hrow, d, g, t):
        """State <- h0 (the thread's own copy and LL slot 0 with flag 0); every other slot's flags <- -1,
        so words left by an earlier launch can never match a step of this one."""
        for c in range(NC):
            for i in unroll(fin_iters):
                v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
                hs[hrow, c * fin_iters + i] = T.if_then_else(
                    v < UV and b < B and j < H, H0[d, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))
                if v < UV and b < B and j < H:
                    ll_store(ws, word(d, 0, 0) + b * Hp + j, H0[d, b, j], 0)
                    for sl in unroll(S - 1):
                        ll_store(ws, word(d, 0, sl + 1) + b * Hp + j, T.float32(0), -1)
                    if not lbr:
                        for sl in unroll(S):
                            ll_store(ws, word(d, 1, sl) + b * Hp + j, T.float32(0), -1)

    @T.macro
    def prefetch(GI, RbH, Lens, gi, d, g, t, s, c, seq):
        """gate_i (z, r, h) and rb_h of every item this thread finishes at step s, chunk c: issued
        before the poll, so the loads are in flight while the thread waits for the state."""
        for i in unroll(fin_iters):
            v = T.meta_var(i * NT + t)
            b = T.meta_var(T.min(c * BC + v // U, B - 1))
            j = T.meta_var(T.min(g * U + v % U, H - 1))
            L = T.meta_var(length(Lens, b, seq))
            tt = T.meta_var(T.max(T.min(T.if_then_else(is_rev(d), L - 1 - s, s), seq - 1), 0))
            gi[i * 4] = GI[d, tt, b, j]
            if NG == 3:
                gi[i * 4 + 1] = GI[d, tt, b, H + j]
                gi[i * 4 + 2] = GI[d, tt, b, 2 * H + j]
                gi[i * 4 + 3] = RbH[d, j] if lbr else T.float32(0)
            if NG == 4:   # LSTM gates o, f, c (i above)
                gi[i * 4 + 1] = GI[d, tt, b, H + j]
                gi[i * 4 + 2] = GI[d, tt, b, 2 * H + j]
                gi[i * 4 + 3] = GI[d, tt, b, 3 * H + j]

    @T.macro
    def publish(Y, ws, hs, hrow, idx, hn, L, d, b, j, s, n):
        """New state of (b, j) after step n = s + 1 (or the kept one past the row's end)."""
        if has_seq_lens:
            tt = T.meta_var(T.if_then_else(is_rev(d), L - 1 - s, s))
            Y[T.if_then_else(s < L, tt, s), d, b, j] = T.Cast(dtype, T.if_then_else(s < L, hn, T.float32(0)))
        elif fwd_only:
            Y[s, d, b, j] = T.Cast(dtype, hn)
        else:
            Y[T.if_then_else(is_rev(d), L - 1 - s, s), d, b, j] = T.Cast(dtype, hn)
        hs[hrow, idx] = hn
        ll_store(ws, word(d, 0, n % S) + b * Hp + j, hn, n)

    def gate_sum(red, q, nr, v):
        """Reduced sum of gate q (relative to the pass's first row) of item v = bb * U + u."""
        return warp_total(red, (v // U) * nr + q * U + v % U)

    def active(L, s):
        return (s < L) if has_seq_lens else True

    def cell_update(red, gi, d, i, v, h):
        """The new state of item v from its gate sums (GRU, linear_before_reset=1) or its sum (RNN)."""
        if NG == 1:
            return f_act(d, clipf(gi[i * 4] + gate_sum(red, 0, U, v)))
        z = f_act(d, clipf(gi[i * 4] + gate_sum(red, 0, 3 * U, v)))
        r = f_act(d, clipf(gi[i * 4 + 1] + gate_sum(red, 1, 3 * U, v)))
        hh = g_act(d, clipf(gi[i * 4 + 2] + r * (gate_sum(red, 2, 3 * U, v) + gi[i * 4 + 3])))
        return (T.float32(1) - z) * hh + z * h

    @T.macro
    def finish_lbr1(Y, Lens, ws, hs, hrow, red, gi, d, g, t, s, c, seq):
        for i in unroll(fin_iters):
            v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
            if v < UV and b < B and j < H:
                L = T.meta_var(length(Lens, b, seq))
                h = T.meta_var(hs[hrow, c * fin_iters + i])
                hn = T.if_then_else(active(L, s), cell_update(red, gi, d, i, v, h), h)  # a variable: hs changes below
                publish(Y, ws, hs, hrow, c * fin_iters + i, hn, L, d, b, j, s, s + 1)

    @T.macro
    def finish_zr(Lens, ws, hs, zs, hrow, red, gi, d, g, t, s, c, seq):
        """lbr=0, pass A: z kept for pass B, r * h_{n-1} published to the second buffer."""
        for i in unroll(fin_iters):
            v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
            if v < UV and b < B and j < H:
                zs[hrow, i] = f_act(d, clipf(gi[i * 4] + gate_sum(red, 0, 2 * U, v)))
                r = T.meta_var(f_act(d, clipf(gi[i * 4 + 1] + gate_sum(red, 1, 2 * U, v))))
                ll_store(ws, word(d, 1, (s + 1) % S) + b * Hp + j, r * hs[hrow, c * fin_iters + i], s + 1)

    @T.macro
    def finish_h(Y, Lens, ws, hs, zs, hrow, red, gi, d, g, t, s, c, seq):
        """lbr=0, pass B: h gate from (r*h) R_h^T, state update, publish h_n."""
        for i in unroll(fin_iters):
            v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
            if v < UV and b < B and j < H:
                L = T.meta_var(length(Lens, b, seq))
                h = T.meta_var(hs[hrow, c * fin_iters + i])
                z = T.meta_var(zs[hrow, i])
                hh = T.meta_var(g_act(d, clipf(gi[i * 4 + 2] + gate_sum(red, 0, U, v))))
                hn = T.if_then_else(active(L, s), (T.float32(1) - z) * hh + z * h, h)  # a variable: hs changes below
                publish(Y, ws, hs, hrow, c * fin_iters + i, hn, L, d, b, j, s, s + 1)

    @T.macro
    def final_state(Yh, Lens, hs, hrow, d, g, t, seq):
        """Y_h <- state (0 for a zero-length row)."""
        for c in range(NC):
            for i in unroll(fin_iters):
                v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
                if v < UV and b < B and j < H:
                    if has_seq_lens:
                        Yh[d, b, j] = T.Cast(dtype, T.if_then_else(length(Lens, b, seq) > 0,
                                                                   hs[hrow, c * fin_iters + i], T.float32(0)))
                    else:
                        Yh[d, b, j] = T.Cast(dtype, T.if_then_else(seq > 0, hs[hrow, c * fin_iters + i],
                                                                   T.float32(0)))

    # ---- the LSTM cell: c beside h (same items, same thread), peepholes in registers -------------------
    lstm_fns = direction_activations(acts, D, fast) if NG == 4 else None
    has_peepholes = bool(lstm and lstm.has_peepholes)

    def peephole(ps, i):
        """peep(q): the peephole weight of gate q (0 i, 1 o, 2 f) of item i, None without peepholes."""
        return (lambda q: ps[i * 3 + q]) if has_peepholes else None

    def lstm_cell(red, gi, ps, d, i, v, c_prev):
        """c' of item v from its four gate sums (rows i, o, f, c of the pass) and c."""
        return lstm.cell(lstm_fns, clipf, d, lambda q: gi[i * 4 + q] + gate_sum(red, q, 4 * U, v),
                         peephole(ps, i), c_prev)

    def lstm_hidden(red, gi, ps, d, i, v, c_new):
        """h' of item v from its o gate and c'."""
        return lstm.hidden(lstm_fns, clipf, d, lambda q: gi[i * 4 + q] + gate_sum(red, q, 4 * U, v),
                           peephole(ps, i), c_new)

    @T.macro
    def seed_cell(C0, cs, hrow, d, g, t):
        """Cell state <- c0 (float32, the finishing thread's own copy: it never leaves the chip)."""
        for c in range(NC):
            for i in unroll(fin_iters):
                v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
                cs[hrow, c * fin_iters + i] = T.if_then_else(
                    v < UV and b < B and j < H, C0[d, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))

    @T.macro
    def load_peepholes(Pw, ps, d, g, t):
        """P (i, o, f) of the units this thread finishes (the same units in every chunk), once."""
        for i in unroll(fin_iters):
            j = T.meta_var(T.min(g * U + (i * NT + t) % U, H - 1))
            for q in unroll(3):
                ps[i * 3 + q] = Pw[d, q * H + j]

    @T.macro
    def finish_lstm(Y, Lens, ws, hs, cs, hrow, red, gi, ps, d, g, t, s, c, seq):
        """c and h of every item this thread finishes (kept past the row's end), h published."""
        for i in unroll(fin_iters):
            v, b, j = T.meta_var(finished_item(geo, g, t, c, i))
            if v < UV and b < B and j < H:
                L = T.meta_var(length(Lens, b, seq))
                cp = T.meta_var(cs[hrow, c * fin_iters + i])
                cn = T.if_then_else(active(L, s), lstm_cell(red, gi, ps, d, i, v, cp), cp)  # a variable
                hn = T.if_then_else(active(L, s), lstm_hidden(red, gi, ps, d, i, v, cn), hs[hrow, c * fin_iters + i])
                cs[hrow, c * fin_iters + i] = cn
                publish(Y, ws, hs, hrow, c * fin_iters + i, hn, L, d, b, j, s, s + 1)

    # ---- the kernels ----------------------------------------------------------------------------
    def lstm_kernel():
        """The LSTM's prim_func: the paired-buffer iteration of the one-pass path with `finish_lstm`."""
        PS = max(3 * fin_iters, 1)

        @T.macro
        def iteration_lstm(GI, Lens, Y, ws, hs, cs, ps, a_reg, a_smem, cval, acc, red, gi, d, g, t, it, seq):
            s = T.meta_var(it // NC)
            c = T.meta_var(it % NC)
            prefetch(GI, GI, Lens, gi, d, g, t, s, c, seq)
            pass_zrh(ws, word(d, 0, s % S), s, a_reg, a_smem, cval, acc, red, t % WS, t // WS, t, c)
            T.tvm_storage_sync("shared")
            finish_lstm(Y, Lens, ws, hs, cs, 0, red, gi, ps, d, g, t, s, c, seq)

        @T.macro
        def kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, seq):
            ws = T.alloc_buffer((ws_words * 2,), "int32", scope="global")
            if gpu:
                for gb in T.thread_binding(D * G, thread="blockIdx.x"):
                    for t in T.thread_binding(NT, thread="threadIdx.x"):
                        a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32", scope="local")
                        a_smem = T.alloc_buffer(smem_shape, "float32", scope=smem_scope)
                        cval = T.alloc_buffer((BC * KT,), "float32", scope="local")
                        acc = T.alloc_buffer((vp_max,), "float32", scope="local")
                        gi = T.alloc_buffer((fin_iters * 4,), "float32", scope="local")
                        ps = T.alloc_buffer((PS,), "float32", scope="local")
                        red0 = T.alloc_buffer((W, vp_max), "float32", scope="shared")
                        red1 = T.alloc_buffer((W, vp_max), "float32", scope="shared")
                        hs = T.alloc_buffer((1, NC * fin_iters), "float32", scope="local")
                        cs = T.alloc_buffer((1, NC * fin_iters), "float32", scope="local")
                        d = T.meta_var(gb // G)
                        g = T.meta_var(gb % G)
                        load_weights(Rw, a_reg, a_smem, d, g, t)
                        if has_peepholes:
                            load_peepholes(Pw, ps, d, g, t)
                        seed(H0, ws, hs, 0, d, g, t)
                        seed_cell(C0, cs, 0, d, g, t)
                        T.cuda.grid_sync()
                        # iterations (step, chunk) alternate partial-sum buffers, unrolled by two: one
                        # __syncthreads per iteration
                        for p in T.serial((seq * NC + 1) // 2):
                            iteration_lstm(GI, Lens, Y, ws, hs, cs, ps, a_reg, a_smem, cval, acc, red0, gi,
                                           d, g, t, 2 * p, seq)
                            if 2 * p + 1 < seq * NC:
                                iteration_lstm(GI, Lens, Y, ws, hs, cs, ps, a_reg, a_smem, cval, acc, red1, gi,
                                               d, g, t, 2 * p + 1, seq)
                        final_state(Yh, Lens, hs, 0, d, g, t, seq)
                        final_state(Yc, Lens, cs, 0, d, g, t, seq)
            else:
                a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32")
                a_smem = T.alloc_buffer((max(R_smem, 1), Hp), "float32")
                cval = T.alloc_buffer((BC * KT,), "float32")
                acc = T.alloc_buffer((vp_max,), "float32")
                gi = T.alloc_buffer((fin_iters * 4,), "float32")
                ps = T.alloc_buffer((PS,), "float32")
                red = T.alloc_buffer((W, vp_max), "float32")
                hs = T.alloc_buffer((D * G * NT, NC * fin_iters), "float32")
                cs = T.alloc_buffer((D * G * NT, NC * fin_iters), "float32")
                for d, g, t in T.grid(D, G, NT):
                    seed(H0, ws, hs, (d * G + g) * NT + t, d, g, t)
                    seed_cell(C0, cs, (d * G + g) * NT + t, d, g, t)
                for it in T.serial(seq * NC):
                    # every block's pass before any finish of the next step: each LL word is ready when read
                    for d, g in T.grid(D, G):
                        for t in T.serial(NT):
                            load_weights(Rw, a_reg, a_smem, d, g, t)
                            pass_zrh(ws, word(d, 0, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red,
                                     0, t, t, it % NC)
                        for t in T.serial(NT):
                            if has_peepholes:
                                load_peepholes(Pw, ps, d, g, t)
                            prefetch(GI, GI, Lens, gi, d, g, t, it // NC, it % NC, seq)
                            finish_lstm(Y, Lens, ws, hs, cs, (d * G + g) * NT + t, red, gi, ps, d, g, t, it // NC,
                                        it % NC, seq)
                for d, g, t in T.grid(D, G, NT):
                    final_state(Yh, Lens, hs, (d * G + g) * NT + t, d, g, t, seq)
                    final_state(Yc, Lens, cs, (d * G + g) * NT + t, d, g, t, seq)

        return rg.scheduled(recurrence_prim_func(kernel, cell, D, B, H, dtype), "lstm_recurrence", cooperative=gpu)

    smem_shape, smem_scope = ((R_smem, Hp), "shared.dyn") if R_smem else ((1, 1), "local")
    if NG == 4:
        return lstm_kernel()

    @T.macro
    def iteration_lbr1(GI, RbH, Lens, Y, ws, hs, a_reg, a_smem, cval, acc, red, gi, d, g, t, it, seq):
        s = T.meta_var(it // NC)
        c = T.meta_var(it % NC)
        prefetch(GI, RbH, Lens, gi, d, g, t, s, c, seq)
        pass_zrh(ws, word(d, 0, s % S), s, a_reg, a_smem, cval, acc, red, t % WS, t // WS, t, c)
        if syncwarp_before_barrier:
            T.evaluate(T.call_extern("void", "__syncwarp"))
        T.tvm_storage_sync("shared")
        finish_lbr1(Y, Lens, ws, hs, 0, red, gi, d, g, t, s, c, seq)

    @T.macro
    def kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, seq):
        ws = T.alloc_buffer((ws_words * 2,), "int32", scope="global")
        if gpu:   # a compile-time branch: the GPU and CPU variants share one signature
            for gb in T.thread_binding(D * G, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32", scope="local")
                    a_smem = T.alloc_buffer(smem_shape, "float32", scope=smem_scope)
                    cval = T.alloc_buffer((BC * KT,), "float32", scope="local")
                    acc = T.alloc_buffer((vp_max,), "float32", scope="local")
                    gi = T.alloc_buffer((fin_iters * 4,), "float32", scope="local")
                    red0 = T.alloc_buffer((W, vp_max), "float32", scope="shared")
                    red1 = T.alloc_buffer((W, vp_max), "float32", scope="shared")
                    hs = T.alloc_buffer((1, NC * fin_iters), "float32", scope="local")
                    zs = T.alloc_buffer((1, fin_iters), "float32", scope="local")
                    d = T.meta_var(gb // G)
                    g = T.meta_var(gb % G)
                    load_weights(Rw, a_reg, a_smem, d, g, t)
                    seed(H0, ws, hs, 0, d, g, t)
                    T.cuda.grid_sync()
                    if lbr and not paired_buffers:
                        for it in T.serial(seq * NC):
                            iteration_lbr1(GI, RbH, Lens, Y, ws, hs, a_reg, a_smem, cval, acc, red0, gi,
                                           d, g, t, it, seq)
                            T.tvm_storage_sync("shared")
                    elif lbr:
                        # iterations (step, chunk) alternate partial-sum buffers, unrolled by two, so
                        # one __syncthreads per iteration suffices
                        for p in T.serial((seq * NC + 1) // 2):
                            iteration_lbr1(GI, RbH, Lens, Y, ws, hs, a_reg, a_smem, cval, acc, red0, gi,
                                           d, g, t, 2 * p, seq)
                            if 2 * p + 1 < seq * NC:
                                iteration_lbr1(GI, RbH, Lens, Y, ws, hs, a_reg, a_smem, cval, acc, red1, gi,
                                               d, g, t, 2 * p + 1, seq)
                    else:
                        # pass A uses red0, pass B red1: one __syncthreads per pass
                        for it in T.serial(seq * NC):
                            prefetch(GI, RbH, Lens, gi, d, g, t, it // NC, it % NC, seq)
                            pass_zr(ws, word(d, 0, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red0,
                                    t % WS, t // WS, t, it % NC)
                            T.tvm_storage_sync("shared")
                            finish_zr(Lens, ws, hs, zs, 0, red0, gi, d, g, t, it // NC, it % NC, seq)
                            pass_h(ws, word(d, 1, (it // NC + 1) % S), it // NC + 1, a_reg, a_smem, cval, acc,
                                   red1, t % WS, t // WS, t, it % NC)
                            T.tvm_storage_sync("shared")
                            finish_h(Y, Lens, ws, hs, zs, 0, red1, gi, d, g, t, it // NC, it % NC, seq)
                    final_state(Yh, Lens, hs, 0, d, g, t, seq)
        else:
            a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32")
            a_smem = T.alloc_buffer((max(R_smem, 1), Hp), "float32")
            cval = T.alloc_buffer((BC * KT,), "float32")
            acc = T.alloc_buffer((vp_max,), "float32")
            gi = T.alloc_buffer((fin_iters * 4,), "float32")
            red = T.alloc_buffer((W, vp_max), "float32")
            hs = T.alloc_buffer((D * G * NT, NC * fin_iters), "float32")
            zs = T.alloc_buffer((D * G * NT, fin_iters), "float32")
            for d, g, t in T.grid(D, G, NT):
                seed(H0, ws, hs, (d * G + g) * NT + t, d, g, t)
            for it in T.serial(seq * NC):
                # every block's pass before the next pass: each LL word is ready when it is read
                for d, g in T.grid(D, G):
                    for t in T.serial(NT):
                        load_weights(Rw, a_reg, a_smem, d, g, t)
                        if lbr:
                            pass_zrh(ws, word(d, 0, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red,
                                     0, t, t, it % NC)
                        else:
                            pass_zr(ws, word(d, 0, (it // NC) % S), it // NC, a_reg, a_smem, cval, acc, red,
                                    0, t, t, it % NC)
                    for t in T.serial(NT):
                        prefetch(GI, RbH, Lens, gi, d, g, t, it // NC, it % NC, seq)
                        if lbr:
                            finish_lbr1(Y, Lens, ws, hs, (d * G + g) * NT + t, red, gi, d, g, t, it // NC, it % NC, seq)
                        else:
                            finish_zr(Lens, ws, hs, zs, (d * G + g) * NT + t, red, gi, d, g, t, it // NC, it % NC, seq)
                if not lbr:
                    for d, g in T.grid(D, G):
                        for t in T.serial(NT):
                            load_weights(Rw, a_reg, a_smem, d, g, t)
                            pass_h(ws, word(d, 1, (it // NC + 1) % S), it // NC + 1, a_reg, a_smem, cval, acc,
                                   red, 0, t, t, it % NC)
                        for t in T.serial(NT):
                            prefetch(GI, RbH, Lens, gi, d, g, t, it // NC, it % NC, seq)
                            finish_h(Y, Lens, ws, hs, zs, (d * G + g) * NT + t, red, gi, d, g, t, it // NC, it % NC, seq)
            for d, g, t in T.grid(D, G, NT):
                final_state(Yh, Lens, hs, (d * G + g) * NT + t, d, g, t, seq)

    return rg.scheduled(recurrence_prim_func(kernel, cell, D, B, H, dtype), "gru_recurrence", cooperative=gpu)


# ----------------------------------------------------------------------------------------------------
# The LSTM on the engine
# ----------------------------------------------------------------------------------------------------


def persistent_lstm_func(D: int, B: int, H: int, dtype: str, directions: str, acts=None, clip=None,
                         has_seq_lens: bool = False, input_forget: bool = False, has_peepholes: bool = False,
                         target=None, config=None, slots: int = 2, poll=None, fast_math: bool | None = None):
    """prim_func(gate_i, R, P, seq_lens, h0, c0, Y, Y_h, Y_c) for all steps of an LSTM node (see module doc):
    the CUDA kernel on a GPU target, its serial variant (same per-thread code) on a CPU one; `fast_math`:
    `cells.fast_math_for`."""
    return engine_func(D, B, H, dtype, 1, directions, lstm_activations(acts, D), clip, has_seq_lens, target,
                       config, slots, poll, cell="lstm", lstm=LstmCell(bool(input_forget), bool(has_peepholes)),
                       fast_math=fast_math)


def lstm_spec_func(spec, target, config=None):
    """`persistent_lstm_func` for an `lstm.LstmSpec`."""
    return persistent_lstm_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                list(spec.activations), spec.clip, spec.has_seq_lens, spec.input_forget,
                                spec.has_peepholes, target, config)


def default_lstm_config(D: int, B: int, H: int, dtype: str, target):
    """The engine's schedule for 4H x H weights per direction: the measured winner where
    `schedules/measured/persistent_gru.json` has a cell 'lstm' entry (`schedules/plstm_sweep.py`), else the
    GRU/RNN step-time fit (`STEP_FIT_US`, per pass: a 4-row pass is a pass like a 3-row one) on the LSTM's
    geometry (its picks were 0-15% slower than the best engine config at the 14 LSTM shapes swept)."""
    return default_gru_config(D, B, H, dtype, resolve(target), "lstm")


def lstm_fits_on_chip(D: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[bool, str]:
    """Whether the 4H x H recurrent weights of all D directions stay on chip (registers + shared memory of
    resident blocks), and why not."""
    return fits_on_chip(D, B, H, dtype, target, config, "lstm")


def estimated_lstm_step_us(D: int, B: int, H: int, dtype: str, target=None, config=None) -> float:
    """The cost model's time of one LSTM step (us) on the engine (the GRU/RNN fit, see `default_lstm_config`)."""
    target = resolve(target)
    config = config or default_lstm_config(D, B, H, dtype, target)
    return fitted_step_us(_geometry(D, B, H, config, True, "lstm"))
