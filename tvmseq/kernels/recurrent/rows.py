"""Row-split schedule of the pipelined GRU stack: the same interface and hand-off as
`stack.stacked_gru_func`, a different split of the work inside a block.

Why. The engine's k-split (every thread owns a k-slice of ALL the block's weight rows) ends every pass
with a reduction of rows x batch-chunk partial sums per thread over the whole block. In the stack a block
of layer l >= 1 owns 6U rows (R and W of its U units); at 4 x H512 B8 that is ~1000 shuffles per warp per
step, as many as its FMAs, and the measured step took ~14 us against ~3.7 us for one layer alone.

Here warp w of a block owns UW units outright (their z, r, h rows of R and, for l >= 1, of W) and its
32 lanes split k (lane owns k = lane + 32 j). A step:
  1. stage: every thread polls its k-slice of the layer's own state h_{s} (LL flag s) and of the layer
     below's state after the same step (flag s+1), and writes them to shared memory (double-buffered by
     iteration parity, so one __syncthreads per iteration suffices);
  2. compute: each lane multiplies its weights (the first `reg_rows` rows of the warp in registers, the
     rest in shared memory) with the staged vectors into 4 sums per (unit, batch column): z and r
     (R h + W x fused: one reduction instead of two), R_h h and W_h x (kept apart: lbr=1);
  3. a transposing warp reduction (~4 UW BC shuffles), __syncwarp, and the gate math of the warp's own
     units, published as LL words. No reduction across warps, no second barrier.
Layer 0's input part comes precomputed (gate_i0), so its W rows are zero and its staged input is zero.

Flow control between layers (rings of S slots, progress counters) is that of `stack.stacked_gru_func`, unchanged
(its progress primitives live here, `stack` imports them).
The CPU variant runs the same per-thread code with serial loops (a warp of one lane) for CI.

The LSTM is a second cell of the same kernel (`stacked_lstm_rows_func`): a unit owns rows i, o, f, c of R
(and of W for l >= 1), every LSTM bias is additive, so R x h and W x of a gate fuse into one sum (4 sums per
item, as the GRU's); the finishing lane keeps the item's cell state c in a float32 register beside h for all
steps (`cells.LstmCell`'s update math); only h is handed off.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...errors import TvmseqError
from ...targets import is_gpu, resolve
from ..activations import Activation

_PROGRESS_STORE_SRC = r"""
// Progress of a block (iterations finished), published after the barrier that ends its passes.
__forceinline__ __device__ void tvmseq_progress_store(int* p, int n) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(n) : "memory");
}
"""
_PROGRESS_WAIT_SRC = r"""
// Warp 0 of a block waits until blocks [0, count) of the next layer (progress words at p) have each
// finished at least `need` iterations. Warp-uniform (__all_sync): the warp leaves together.
__forceinline__ __device__ void tvmseq_progress_wait(const int* p, int count, int need) {
  if (need <= 0) return;
  for (int base = 0; base < count; base += 32) {  // the same trip count in every lane
    const int i = base + (threadIdx.x & 31);
    bool ok;
    unsigned spins = 0;
    do {
      int v = need;
      if (i < count) asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p + i) : "memory");
      ok = __all_sync(0xffffffffu, v >= need);
      if (!ok && ++spins == (1u << 22)) {
        if ((threadIdx.x & 31) == 0)
          printf("tvmseq progress timeout: block %d needs %d iterations of the next layer\n", (int)blockIdx.x, need);
        break;
      }
    } while (!ok);
  }
}
"""
_SYNCWARP_SRC = r"""
__forceinline__ __device__ void tvmseq_syncwarp() { __syncwarp(); }
"""
_REG_OVERHEAD = 48
CELL_GATES = {"gru": 3, "lstm": 4}


@dataclass(frozen=True)
class RowSplitConfig:
    """Knobs of the row-split stack kernel.

    blocks_per_layer: blocks (SMs) of one layer
    num_warps:        warps per block; the block's units are split over them
    batch_chunk:      batch columns per iteration (sums per lane = 4 x units per warp x batch_chunk)
    reg_rows:         weight rows of a warp held in registers; the rest live in shared memory
    """

    blocks_per_layer: int
    num_warps: int = 8
    batch_chunk: int = 8
    reg_rows: int = 6

    def replace(self, **kw) -> "RowSplitConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class RowGeometry:
    """Sizes derived from (L, B, H, config) that the kernel body and the host checks share."""

    L: int
    B: int
    H: int
    cfg: RowSplitConfig
    warp_size: int  # 32 on CUDA, 1 for the CPU variant
    cell: str = "gru"   # "gru" (gates z, r, h; state h) or "lstm" (gates i, o, f, c; states h, c)

    G = property(lambda self: self.cfg.blocks_per_layer)
    W = property(lambda self: self.cfg.num_warps)
    NT = property(lambda self: self.W * self.warp_size)
    UW = property(lambda self: math.ceil(math.ceil(self.H / self.G) / self.W))   # units per warp
    U = property(lambda self: self.UW * self.W)                                   # units per block
    NG = property(lambda self: CELL_GATES[self.cell])     # gate rows per unit of one weight matrix
    NS = property(lambda self: 2 if self.cell == "lstm" else 1)   # state values per item: h (and c)
    NQ = property(lambda self: 2 * self.NG if self.L > 1 else self.NG)   # weight rows per unit: R's, W's
    NRW = property(lambda self: self.NQ * self.UW)          # weight rows per warp
    RR = property(lambda self: min(self.cfg.reg_rows, self.NRW))
    RS = property(lambda self: self.NRW - self.RR)
    Hp = property(lambda self: math.ceil(self.H / self.NT) * self.NT)
    KT = property(lambda self: self.Hp // self.NT)          # words a thread polls per state row
    KL = property(lambda self: self.Hp // self.warp_size)   # k values per lane
    BC = property(lambda self: min(self.cfg.batch_chunk, self.B))
    NC = property(lambda self: math.ceil(self.B / self.BC))
    Bp = property(lambda self: self.NC * self.BC)
    NA = property(lambda self: 4 * self.UW * self.BC)       # sums per lane: z, r, R_h h, W_h x / i, o, f, c
    vp = property(lambda self: 1 << (self.NA - 1).bit_length())
    XN = property(lambda self: 2 if self.L > 1 else 1)     # staged vectors: own state (and input)
    FI = property(lambda self: math.ceil(self.UW * self.BC / self.warp_size))  # items a lane finishes

    def regs_estimate(self) -> int:
        return self.RR * self.KL + self.vp + 2 * self.BC * self.KT + (self.NS - 1) * self.NC * self.FI + _REG_OVERHEAD

    def smem_bytes(self) -> int:
        return 4 * (self.W * self.RS * self.Hp + 2 * self.XN * self.BC * self.Hp + self.W * self.vp)

    def check(self, facts) -> str | None:
        """Why this geometry cannot run resident (one block per SM), or None."""
        c = self.cfg
        if min(c.blocks_per_layer, c.num_warps, c.batch_chunk) < 1 or c.reg_rows < 0:
            return f"config {c} has a non-positive knob"
        if facts is None:
            return None
        if self.L * self.G > facts.num_sms:
            return f"{self.L} layers x {self.G} blocks > {facts.num_sms} SMs: not all resident"
        if self.NT > facts.max_threads_per_block:
            return f"{self.NT} threads per block: too many"
        cap = min(facts.max_regs_per_thread, facts.regs_per_sm // self.NT)
        if self.regs_estimate() > cap:
            return (f"~{self.regs_estimate()} registers per thread (weights {self.RR}x{self.KL}, sums {self.vp}) "
                    f"> {cap}")
        if self.smem_bytes() > facts.smem_per_block:
            return f"{self.smem_bytes()} B shared memory per block > {facts.smem_per_block}"
        return None


def default_rows_config(L: int, B: int, H: int, target, cell: str = "gru") -> RowSplitConfig:
    """The most blocks per layer (up to SMs // L) that the units need, then 8, 16, 4 or 2 warps (first
    that reaches that block count), the largest batch chunk <= 8 that fits, as many register rows as fit."""
    from .. import recurrent_gemm as rg

    target = resolve(target)
    if not is_gpu(target):
        return RowSplitConfig(blocks_per_layer=min(3, H), num_warps=min(2, H), batch_chunk=min(2, B), reg_rows=2)
    facts = rg.gpu_facts(target)
    G = max(1, min(128, facts.num_sms) // L)
    candidates = []
    for rank, warps in enumerate((8, 16, 4, 2)):
        geo = RowGeometry(L, B, H, RowSplitConfig(G, warps, 1, 0), 32, cell)
        for bc in (8, 4, 2, 1):
            fits = [cfg for cfg in (RowSplitConfig(math.ceil(H / geo.U), warps, bc, rr)
                                    for rr in range(geo.NRW, -1, -1))
                    if RowGeometry(L, B, H, cfg, 32, cell).check(facts) is None]
            if fits:
                candidates.append((-fits[0].blocks_per_layer, rank, fits[0]))
                break
    if not candidates:
        raise TvmseqError(f"no row-split configuration keeps {L} layers of {H}x{H} {cell.upper()} weights on chip")
    return min(candidates, key=lambda c: c[:2])[2]


def rows_fit(L: int, B: int, H: int, target, config: RowSplitConfig | None = None,
             cell: str = "gru") -> tuple[bool, str]:
    from .. import recurrent_gemm as rg

    return rg.fit_report(target, config, lambda tgt: default_rows_config(L, B, H, tgt, cell),
                         lambda cfg, facts: RowGeometry(L, B, H, cfg, 32, cell).check(facts), "row-split")


def stacked_gru_rows_func(L: int, B: int, H: int, dtype: str, target, acts=None, clip=None, config=None,
                          slots: int = 8, fast_math: bool | None = None):
    """prim_func(gate_i0, R, W, bias_i, rb_h, h0, Y, Y_h) named "gru_stack": `stack.stacked_gru_func`'s interface
    and numerics with the row-split work division (module doc)."""
    return _rows_kernel(L, B, H, dtype, target, acts, clip, config, slots, "gru", None, fast_math)


def stacked_lstm_rows_func(L: int, B: int, H: int, dtype: str, target, acts=None, clip=None, config=None,
                           slots: int = 8, lstm=None, fast_math: bool | None = None):
    """prim_func(gate_i0, R, W, bias_i, P, h0, c0, Y, Y_h, Y_c) named "lstm_stack": a pipelined stack of L
    forward LSTM layers (`stack.stacked_lstm_func`'s interface). acts: [f, g, h] Activations shared
    by every layer; lstm: the cell's update math (`cells.LstmCell`: input_forget, peepholes)."""
    from .cells import LstmCell

    return _rows_kernel(L, B, H, dtype, target, acts, clip, config, slots, "lstm", lstm or LstmCell(), fast_math)


def stack_prim_func(body, cell: str, L: int, LW: int, B: int, H: int, dtype: str):
    """The prim_func of a stack kernel (`stack.stacked_gru_func`'s interface: gate_i0, R, W, bias_i, rb_h, h0, Y, Y_h;
    an LSTM's: gate_i0, R, W, bias_i, P, h0, c0, Y, Y_h, Y_c) around the T.macro body(GI0, Rw, Ww, cb, seq), cb
    the cell's buffers (BI, RbH, H0, Y, Yh) or (BI, Pw, H0, C0, Y, Yh, Yc). LW: the layers with an input W (L - 1)."""
    from tvm.script import tirx as T

    from ...onnx.checks import index_limit_check
    from .cells import CELL_GATES

    G3 = CELL_GATES[cell] * H
    # gate_i0 [seq, B, G3] and Y [L, seq, B, H] are indexed in 32 bits
    check_steps = index_limit_check(f"{L}-layer {cell.upper()} stack (hidden {H}, batch {B})", B * max(G3, L * H),
                                    "step")
    if cell == "gru":
        @T.prim_func
        def main(gate_i0: T.handle, r_w: T.handle, w_w: T.handle, bias_i: T.handle, rb_h: T.handle,
                 h0: T.handle, y: T.handle, y_h: T.handle):
            seq = T.int32()
            GI0 = T.match_buffer(gate_i0, (seq, B, G3), "float32")
            Rw = T.match_buffer(r_w, (L, G3, H), dtype)
            Ww = T.match_buffer(w_w, (LW, G3, H), dtype)
            BI = T.match_buffer(bias_i, (LW, G3), "float32")
            RbH = T.match_buffer(rb_h, (L, H), "float32")
            H0 = T.match_buffer(h0, (L, B, H), "float32")
            Y = T.match_buffer(y, (L, seq, B, H), dtype)
            Yh = T.match_buffer(y_h, (L, B, H), dtype)
            check_steps(seq)
            body(GI0, Rw, Ww, (BI, RbH, H0, Y, Yh), seq)

        return main

    @T.prim_func
    def main_lstm(gate_i0: T.handle, r_w: T.handle, w_w: T.handle, bias_i: T.handle, p_w: T.handle,
                  h0: T.handle, c0: T.handle, y: T.handle, y_h: T.handle, y_c: T.handle):
        seq = T.int32()
        GI0 = T.match_buffer(gate_i0, (seq, B, G3), "float32")
        Rw = T.match_buffer(r_w, (L, G3, H), dtype)
        Ww = T.match_buffer(w_w, (LW, G3, H), dtype)
        BI = T.match_buffer(bias_i, (LW, G3), "float32")
        Pw = T.match_buffer(p_w, (L, 3 * H), "float32")
        H0 = T.match_buffer(h0, (L, B, H), "float32")
        C0 = T.match_buffer(c0, (L, B, H), "float32")
        Y = T.match_buffer(y, (L, seq, B, H), dtype)
        Yh = T.match_buffer(y_h, (L, B, H), dtype)
        Yc = T.match_buffer(y_c, (L, B, H), dtype)
        check_steps(seq)
        body(GI0, Rw, Ww, (BI, Pw, H0, C0, Y, Yh, Yc), seq)

    return main_lstm


def progress_macros(L: int, G: int, S: int, NC: int, ll_words: int):
    """(reset, wait_for_next_layer, publish) T.macros of a GPU stack kernel's flow control between layers (`stack`'s
    module doc), shared by the row-split and the k-split stacks: block gb's progress counter (iterations finished)
    is int32 word ll_words * 2 + gb of ws, after the LL words; layer l's blocks are [l * G, (l + 1) * G)."""
    from tvm.script import tirx as T

    @T.macro
    def reset(ws, gb, t):
        if t == 0:
            ws[ll_words * 2 + gb] = 0

    @T.macro
    def wait_for_next_layer(ws, l, t, it):
        if l + 1 < L and t < 32:
            # before this iteration publishes step s+1 into slot (s+1) % S: layer l+1 has
            # read what that slot held (its iteration it - S*NC)
            T.evaluate(T.cuda.func_call(
                "tvmseq_progress_wait", T.address_of(ws[ll_words * 2 + (l + 1) * G]), G,
                it - S * NC + 1, source_code=_PROGRESS_WAIT_SRC))

    @T.macro
    def publish(ws, gb, t, it):
        if t == 0:  # after the barrier that ends the passes: every thread of the block has read its LL words
            T.evaluate(T.cuda.func_call(
                "tvmseq_progress_store", T.address_of(ws[ll_words * 2 + gb]), it + 1,
                source_code=_PROGRESS_STORE_SRC))

    return reset, wait_for_next_layer, publish


def _rows_kernel(L, B, H, dtype, target, acts, clip, config, slots, cell, lstm, fast_math=None):
    """The row-split stack kernel of a cell: the staging, compute, reduction and hand-off are shared; the
    cell brings its weight rows (NG per matrix), the sum each row adds into, its states, the update math
    and its prim_func signature."""
    from tvm.script import tirx as T

    from .. import recurrent_gemm as rg
    from .cells import clip_fn, direction_activations, fast_math_for

    target = resolve(target)
    gpu = is_gpu(target)
    fast = fast_math_for(dtype, gpu, fast_math)
    label = "GRU" if cell == "gru" else "LSTM"
    if cell == "gru":
        f_act, g_act = acts or (Activation.make("Sigmoid"), Activation.make("Tanh"))
    else:
        lstm_fns = direction_activations(list(acts or [Activation.make(a) for a in ("Sigmoid", "Tanh", "Tanh")]), 1,
                                         fast)
    config = config or default_rows_config(L, B, H, target, cell)
    geo = RowGeometry(L, B, H, config, 32 if gpu else 1, cell)
    why = geo.check(rg.gpu_facts(target) if gpu else None)
    if why:
        raise TvmseqError(f"row-split {label} stack L={L} B={B} H={H} {dtype}: {why}")
    G, W_, NT, WS, UW, U = geo.G, geo.W, geo.NT, geo.warp_size, geo.UW, geo.U
    RR, RS, Hp, KT, KL = geo.RR, geo.RS, geo.Hp, geo.KT, geo.KL
    BC, NC, Bp, vp, FI, XN = geo.BC, geo.NC, geo.Bp, geo.vp, geo.FI, geo.XN
    NG, NS = geo.NG, geo.NS
    S, LW = slots, max(L - 1, 1)
    slot_words = Bp * Hp
    ll_words = L * S * slot_words
    reset_progress, wait_for_next_layer, publish_progress = progress_macros(L, G, S, NC, ll_words)
    unroll = T.unroll if gpu else T.serial
    ll_store, ll_wait = rg.make_ll_ops(gpu, BC, KT, poll=rg.PollOptions(report="lane0"))
    reduce = rg.make_warp_reduce(WS, vp)
    f32 = lambda x: rg.f32(x, dtype)  # noqa: E731
    clipf = clip_fn(clip)

    def word(layer, slot):
        return (layer * S + slot) * slot_words

    def weight(Rw, Ww, l, g, w, r, k):
        """Local row r of warp w (r = q * UW + u; q < NG: R's gate-q row of unit u, else W's), column k."""
        q, u = r // UW, r % UW
        unit = g * U + w * UW + u
        row = (q % NG) * H + T.min(unit, H - 1)
        kk = T.min(k, H - 1)
        return T.if_then_else(
            T.And(T.And(unit < H, k < H), T.Or(q < NG, l > 0)),
            T.if_then_else(q < NG, f32(Rw[l, row, kk]), f32(Ww[T.max(l - 1, 0), row, kk])), T.float32(0))

    def slot_of(q):
        """Sum a row adds into. GRU: z (0) and r (1) take both R and W rows; R_h h is 2, W_h x is 3 (lbr=1).
        LSTM: every bias is additive, so gate q's R and W rows share sum q (i 0, o 1, f 2, c 3)."""
        if cell == "lstm":
            return q % 4
        return T.if_then_else(q == 5, 3, q % 3)

    def item(g, w, lane, c, i):
        v = i * WS + lane
        return v, c * BC + v // UW, g * U + w * UW + v % UW

    @T.macro
    def load_weights(Rw, Ww, a_reg, a_smem, l, g, w, lane):
        for r in unroll(RR):
            for j in unroll(KL):
                a_reg[r * KL + j] = weight(Rw, Ww, l, g, w, r, lane + WS * j)
        for r in range(RS):
            for j in unroll(KL):
                a_smem[w, r, lane + WS * j] = weight(Rw, Ww, l, g, w, RR + r, lane + WS * j)

    @T.macro
    def seed(H0, ws, hs, hrow, l, g, w, lane):
        for c in range(NC):
            for i in unroll(FI):
                v, b, j = T.meta_var(item(g, w, lane, c, i))
                hs[hrow, c * FI + i] = T.if_then_else(
                    v < UW * BC and b < B and j < H, H0[l, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))
                if v < UW * BC and b < B and j < H:
                    ll_store(ws, word(l, 0) + b * Hp + j, H0[l, b, j], 0)
                    for sl in unroll(S - 1):
                        ll_store(ws, word(l, sl + 1) + b * Hp + j, T.float32(0), -1)

    @T.macro
    def seed_c(C0, hs, crow, l, g, w, lane):
        """LSTM: the cell state <- c0, in the finishing lane's registers (it never leaves the chip)."""
        for c in range(NC):
            for i in unroll(FI):
                v, b, j = T.meta_var(item(g, w, lane, c, i))
                hs[crow, c * FI + i] = T.if_then_else(
                    v < UW * BC and b < B and j < H, C0[l, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))

    @T.macro
    def stage(ws, xs, cval, l, s, c, p, t):
        """Poll this thread's k-slice of the layer's own state (flag s) and the input (flag s+1) into xs."""
        b0 = T.meta_var(c * BC)
        nw_valid = T.meta_var(T.max(T.min(H - t * KT, KT), 0))
        ll_wait(ws, word(l, s % S) + b0 * Hp + t * KT, Hp, s, nw_valid, T.min(B - b0, BC), cval)
        for bb in unroll(BC):
            for j in unroll(KT):
                xs[p, 0, bb, t * KT + j] = cval[bb * KT + j]
        if XN == 2 and l > 0:
            ll_wait(ws, word(T.max(l - 1, 0), (s + 1) % S) + b0 * Hp + t * KT, Hp, s + 1, nw_valid,
                    T.min(B - b0, BC), cval)
            for bb in unroll(BC):
                for j in unroll(KT):
                    xs[p, 1, bb, t * KT + j] = cval[bb * KT + j]
        elif XN == 2:
            for bb in unroll(BC):
                for j in unroll(KT):
                    xs[p, 1, bb, t * KT + j] = T.float32(0)

    @T.macro
    def compute(xs, a_reg, a_smem, acc, p, w, lane):
        for v in unroll(vp):
            acc[v] = T.float32(0)
        for j in unroll(KL):
            for bb in unroll(BC):
                for r in unroll(RR):
                    a = T.meta_var((bb * UW + r % UW) * 4 + slot_of(r // UW))
                    acc[a] = acc[a] + a_reg[r * KL + j] * xs[p, (r // UW) // NG, bb, lane + WS * j]
                for r in unroll(RS):
                    rr = T.meta_var(RR + r)
                    a = T.meta_var((bb * UW + rr % UW) * 4 + slot_of(rr // UW))
                    acc[a] = acc[a] + a_smem[w, r, lane + WS * j] * xs[p, (rr // UW) // NG, bb, lane + WS * j]

    @T.macro
    def finish(GI0, BI, RbH, Y, ws, hs, hrow, red, l, g, w, lane, s, c):
        for i in unroll(FI):
            v, b, j = T.meta_var(item(g, w, lane, c, i))
            if v < UW * BC and b < B and j < H:
                a = T.meta_var(v * 4)   # item v = bb * UW + u owns sums [4v, 4v + 4)
                bq, jq, lq = T.meta_var((T.min(b, B - 1), T.min(j, H - 1), T.max(l - 1, 0)))
                gz = T.meta_var(T.if_then_else(l == 0, GI0[s, bq, jq], BI[lq, jq]))
                gr = T.meta_var(T.if_then_else(l == 0, GI0[s, bq, H + jq], BI[lq, H + jq]))
                gh = T.meta_var(T.if_then_else(l == 0, GI0[s, bq, 2 * H + jq], BI[lq, 2 * H + jq] + red[w, a + 3]))
                h = T.meta_var(hs[hrow, c * FI + i])
                z = T.meta_var(f_act.expr(clipf(gz + red[w, a]), fast))
                r = T.meta_var(f_act.expr(clipf(gr + red[w, a + 1]), fast))
                hh = T.meta_var(g_act.expr(clipf(gh + r * (red[w, a + 2] + RbH[l, jq])), fast))
                hn = (T.float32(1) - z) * hh + z * h
                Y[l, s, b, j] = T.Cast(dtype, hn)
                hs[hrow, c * FI + i] = hn
                ll_store(ws, word(l, (s + 1) % S) + b * Hp + j, hn, s + 1)

    def lstm_pre(GI0, BI, red, l, w, a, s, bq, jq):
        """pre(q): gate q's input part (layer 0's projection, else the bias) plus its fused R h + W x sum."""
        lq = T.max(l - 1, 0)
        return lambda q: T.if_then_else(l == 0, GI0[s, bq, q * H + jq], BI[lq, q * H + jq]) + red[w, a + q]

    def lstm_peep(Pw, l, jq):
        return (lambda q: Pw[l, q * H + jq]) if lstm.has_peepholes else None

    @T.macro
    def finish_lstm(GI0, BI, Pw, Y, ws, hs, hrow, crow, red, l, g, w, lane, s, c):
        for i in unroll(FI):
            v, b, j = T.meta_var(item(g, w, lane, c, i))
            if v < UW * BC and b < B and j < H:
                bq, jq = T.meta_var((T.min(b, B - 1), T.min(j, H - 1)))
                pre = T.meta_var(lstm_pre(GI0, BI, red, l, w, v * 4, s, bq, jq))
                peep = T.meta_var(lstm_peep(Pw, l, jq))
                cn = lstm.cell(lstm_fns, clipf, 0, pre, peep, hs[crow, c * FI + i])   # a variable
                hn = lstm.hidden(lstm_fns, clipf, 0, pre, peep, cn)
                Y[l, s, b, j] = T.Cast(dtype, hn)
                hs[hrow, c * FI + i] = hn
                hs[crow, c * FI + i] = cn
                ll_store(ws, word(l, (s + 1) % S) + b * Hp + j, hn, s + 1)

    @T.macro
    def final_state(Yh, hs, hrow, l, g, w, lane, seq):
        for c in range(NC):
            for i in unroll(FI):
                v, b, j = T.meta_var(item(g, w, lane, c, i))
                if v < UW * BC and b < B and j < H:
                    Yh[l, b, j] = T.Cast(dtype, T.if_then_else(seq > 0, hs[hrow, c * FI + i], T.float32(0)))

    # the cell's part of the kernel body; `cb` holds the cell's buffers (GRU: bias_i, rb_h, h0, Y, Y_h;
    # LSTM: bias_i, P, h0, c0, Y, Y_h, Y_c) and `hrows` the rows of hs that hold all states of this thread
    @T.macro
    def seed_cell(cb, ws, hs, hrow, hrows, l, g, w, lane):
        seed(cb[2], ws, hs, hrow, l, g, w, lane)
        if NS == 2:
            seed_c(cb[3], hs, hrows + hrow, l, g, w, lane)

    @T.macro
    def finish_cell(GI0, cb, ws, hs, hrow, hrows, red, l, g, w, lane, s, c):
        if NS == 2:
            finish_lstm(GI0, cb[0], cb[1], cb[4], ws, hs, hrow, hrows + hrow, red, l, g, w, lane, s, c)
        else:
            finish(GI0, cb[0], cb[1], cb[3], ws, hs, hrow, red, l, g, w, lane, s, c)

    @T.macro
    def final_cell(cb, hs, hrow, hrows, l, g, w, lane, seq):
        final_state(cb[2 + NS + 1], hs, hrow, l, g, w, lane, seq)
        if NS == 2:
            final_state(cb[6], hs, hrows + hrow, l, g, w, lane, seq)

    smem_shape, smem_scope = ((W_, RS, Hp), "shared.dyn") if RS else ((1, 1, 1), "local")
    CPU_ROWS = L * G * W_

    @T.macro
    def body(GI0, Rw, Ww, cb, seq):
        # LL words, then (GPU) one progress counter per block: the CPU variant runs layers in order, needs none
        ws = T.alloc_buffer((ll_words * 2 + (L * G if gpu else 0),), "int32", scope="global")
        if gpu:   # a compile-time branch: the GPU and CPU variants share one signature
            for gb in T.thread_binding(L * G, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    a_reg = T.alloc_buffer((max(RR * KL, 1),), "float32", scope="local")
                    a_smem = T.alloc_buffer(smem_shape, "float32", scope=smem_scope)
                    xs = T.alloc_buffer((2, XN, BC, Hp), "float32", scope="shared.dyn")
                    cval = T.alloc_buffer((BC * KT,), "float32", scope="local")
                    acc = T.alloc_buffer((vp,), "float32", scope="local")
                    red = T.alloc_buffer((W_, vp), "float32", scope="shared")
                    hs = T.alloc_buffer((NS, NC * FI), "float32", scope="local")
                    l = T.meta_var(gb // G)
                    g = T.meta_var(gb % G)
                    load_weights(Rw, Ww, a_reg, a_smem, l, g, t // WS, t % WS)
                    seed_cell(cb, ws, hs, 0, 1, l, g, t // WS, t % WS)
                    reset_progress(ws, gb, t)
                    T.cuda.grid_sync()
                    for it in T.serial(seq * NC):
                        wait_for_next_layer(ws, l, t, it)
                        stage(ws, xs, cval, l, it // NC, it % NC, it % 2, t)
                        T.tvm_storage_sync("shared")
                        publish_progress(ws, gb, t, it)
                        compute(xs, a_reg, a_smem, acc, it % 2, t // WS, t % WS)
                        reduce(acc, t % WS, red, t // WS)
                        T.evaluate(T.cuda.func_call("tvmseq_syncwarp", source_code=_SYNCWARP_SRC))
                        finish_cell(GI0, cb, ws, hs, 0, 1, red, l, g, t // WS, t % WS, it // NC, it % NC)
                    final_cell(cb, hs, 0, 1, l, g, t // WS, t % WS, seq)
        else:
            a_reg = T.alloc_buffer((max(RR * KL, 1),), "float32")
            a_smem = T.alloc_buffer((W_, max(RS, 1), Hp), "float32")
            xs = T.alloc_buffer((2, XN, BC, Hp), "float32")
            cval = T.alloc_buffer((BC * KT,), "float32")
            acc = T.alloc_buffer((vp,), "float32")
            red = T.alloc_buffer((W_, vp), "float32")
            hs = T.alloc_buffer((NS * CPU_ROWS, NC * FI), "float32")
            for l, g, w in T.grid(L, G, W_):
                seed_cell(cb, ws, hs, (l * G + g) * W_ + w, CPU_ROWS, l, g, w, 0)
            for it in T.serial(seq * NC):
                # layer by layer, block by block: every LL word a block reads is ready when it reads it
                for l, g in T.grid(L, G):
                    for t in T.serial(NT):
                        stage(ws, xs, cval, l, it // NC, it % NC, it % 2, t)
                    for w in T.serial(W_):
                        load_weights(Rw, Ww, a_reg, a_smem, l, g, w, 0)
                        compute(xs, a_reg, a_smem, acc, it % 2, w, 0)
                        reduce(acc, 0, red, w)
                        finish_cell(GI0, cb, ws, hs, (l * G + g) * W_ + w, CPU_ROWS, red, l, g, w, 0, it // NC,
                                    it % NC)
            for l, g, w in T.grid(L, G, W_):
                final_cell(cb, hs, (l * G + g) * W_ + w, CPU_ROWS, l, g, w, 0, seq)

    return rg.scheduled(stack_prim_func(body, cell, L, LW, B, H, dtype), f"{cell}_stack", cooperative=gpu)
