"""Persistent float16 GRU/RNN/LSTM on Hopper's warpgroup tensor cores (wgmma): all time steps in ONE kernel, each
block's slice of R resident in shared memory, the state chunk staged by bulk copies and multiplied by wgmma
with both operands in shared memory; the gate math runs on the accumulators in registers.

Why another persistent kernel. `mma` splits k over 8 warps (R as mma.sync B fragments in
registers): every chunk its warps' partial sums go through shared memory, a __syncthreads, and a 24-load
reduction per item before the gate math, and at batch 256 the SM issues an instruction every ~5 cycles with 2
warps a scheduler (ncu, fp16 H1024 B256: 13.6 us a step). Here one warpgroup multiplies a 64-row state chunk
by all NG * UB gate rows over the whole k (wgmma m64nNk16), so each thread ends with complete (z, r, h)
pre-activations of its own units: no partial sums, no reduction, no k-split.

Interface: that of `mma` (gate_i f32 [D, T, B, NG*H], R [D, NG*H, H] fp16, rb_h f32 [D, H],
seq_lens i32 [B], h0 f32 [D, B, H] -> Y [T, D, B, H], Y_h [D, B, H] fp16); GRU with linear_before_reset=1, RNN.
gate_dtype="float16" takes gate_i in half (as `projection.wgmma` can write it: half the bytes read a step); the
loads widen it to float32, so the gate math is unchanged. Measured on the H100 (2026-11-23, an A/B probe in
notes/persistent.md, seq 100, projection + recurrence us a step, float32 -> float16 gate_i): bi H1024
B256 25.1 -> 26.0, bi H512 B256 10.6 -> 11.2, H1024 B256 13.8 -> 14.1, others within 4%; the relative error
against float64 rises 2.1e-4 -> 2.6e-4. So the importer keeps float32 gate_i (the loads and the projection's
stores stay one 2- or 4-byte element a lane: half the bytes, the same number of transactions).

Work split. Direction d runs on blocks [d*G*BS, (d+1)*G*BS); block (g, q) owns UB hidden units [g*UB, (g+1)*UB)
(the NG*UB rows of R of their gates: the wgmma N) and every BS-th 64-row batch chunk from chunk q. Shared
memory holds the block's R slice as NKB k-tiles [N rows x 64] and one state chunk as NKB k-tiles [64 rows x 64],
all in the 128-byte swizzle layout of wgmma's descriptors (16-byte chunk c of row r at c ^ (r % 8)).

The state lives in global memory (double buffer, fp16) in that same layout, chunk by chunk and tile by tile
(the "image" layout: a tile is 8 KB contiguous), so a chunk arrives by NKB bulk copies (cp.async.bulk, one
thread each, completing on one mbarrier per tile); the wgmma of tile kb starts once tile kb has landed. A step,
per chunk: 4 * NKB wgmma into NG*UB/2 float32 accumulators a thread, the next chunk's gate_i loads and copies
issued (they fly during this chunk's gate math; the gate_i of a step's last chunk is the next step's first),
the gate math (state kept in float32 registers), Y and h_{s+1} written (h_{s+1} into the image of the other
buffer); a grid barrier (cooperative launch: all blocks resident, one or two an SM) ends the step, after which
the first chunk's copies go out. The wgmma descriptors are two base descriptors (kept in shared memory, read
once a chunk) plus each tile's offset: encoding one from its address took ~20 uniform instructions a wgmma.

Accumulator layout (wgmma m64nN, per warp w of the warpgroup): acc[4 j + 2 h + e] is row 16 w + lane / 4 + 8 h,
column 8 j + 2 (lane % 4) + e; with the block's gate rows ordered (z units, r units, h units), a thread holds
the three gates of units 8 j + 2 (lane % 4) + e (j < UB / 8) of its two rows: UB / 2 items.

LSTM (cell 'lstm', NG = 4: rows i, o, f, c of a block's units): the interface of `engine.persistent_lstm_func`
(gate_i f32 [D, T, B, 4H], R [D, 4H, H], P f32 [D, 3H] (peepholes i, o, f), seq_lens, h0, c0 f32 [D, B, H] -> Y,
Y_h, Y_c fp16), the update math of `cells.LstmCell`; the thread that finishes an item keeps its cell state c in float32
registers beside h for all steps (only h goes through the image) and the i, o, f peepholes of its unit. A 16-unit
LSTM block's R slice is 64 rows x H: at hidden 1024 that (128 KB) and a whole 64-row state chunk (128 KB) do not
both fit, so `state_tiles` < NKB stages the chunk through a ring of that many k-tile slots: tile kb lands in slot
kb % state_tiles (a ring of any depth: slot j takes ceil((NKB - j) / state_tiles) tiles a chunk), and once tile
kb's wgmma group is committed, the group of tile kb - 1 is waited for (one group stays in flight), the warpgroup
syncs and its thread 0 refills that slot with tile kb - 1 + state_tiles. `warpgroups` = 2 runs two warpgroups
a block on alternate chunks, each with its own slots and mbarriers (a named barrier each) over the one R slice.

The CPU variant runs the same seeding, gate math and image-layout reads and writes, with the product as a
float32 sum over the staged fp16 state (`product_cpu`), so CI checks indexing, padding and numerics; the
descriptors, copies and barriers exist on the GPU only (`tests/test_persistent_wgmma.py -m gpu`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import TvmseqError
from ...targets import is_gpu, resolve

from ..projection.wgmma import ATOM, GATE_DTYPES, align_offset, encode_descriptor, mma_async
from ..projection.wgmma import BK as KB   # k of a tile: one 128-byte swizzle row of fp16
from .mma import _LSTM_TEMPS, GATES, check_args, checked_geometry, serial_variant, staged_cell

MC = 64              # rows of a state chunk: the wgmma M of one warpgroup
NT = 128             # one warpgroup
_REG_OVERHEAD = 40
_MAX_REGS = 240


@dataclass(frozen=True)
class WgmmaRecConfig:
    """Knobs: units_per_block (a divisor of 64; N = gates x units <= 256), batch_split (blocks sharing a unit
    group, each taking every batch_split-th 64-row chunk), state_tiles, warpgroups. Up to two blocks an SM
    where the grid needs them (a batch split or 8-unit blocks) and both fit. Clusters multicasting the copies
    (as in `mma`) were tried in sweep w2: correct but not faster anywhere (H1024 B256 10.2 -> 11.0 us a
    step), and compute-sanitizer racecheck reported a write-write hazard it could not place; removed."""

    units_per_block: int = 16
    batch_split: int = 1
    state_tiles: int = 0   # shared-memory slots of the state chunk's k-tiles; 0: all NKB (no ring)
    # warpgroups a block: each walks its own share of the block's chunks (every warpgroups-th) through its own
    # state slots and mbarriers, on the block's one copy of R; two give each warp scheduler a second warp to
    # issue while the other waits on its wgmma, copies or gate math
    warpgroups: int = 1

    @classmethod
    def of(cls, knobs) -> "WgmmaRecConfig":
        return cls(*knobs)

    def knobs(self) -> tuple:
        tail = (self.state_tiles, self.warpgroups) if self.warpgroups > 1 else (
            (self.state_tiles,) if self.state_tiles else ())
        return (self.units_per_block, self.batch_split) + tail


@dataclass(frozen=True)
class WgmmaRecGeometry:
    D: int
    B: int
    H: int
    NG: int
    cfg: WgmmaRecConfig

    UB = property(lambda self: self.cfg.units_per_block)
    BS = property(lambda self: self.cfg.batch_split)
    N = property(lambda self: self.NG * self.UB)                       # gate rows a block (wgmma N)
    G = property(lambda self: math.ceil(self.H / self.UB))             # blocks a direction and batch split
    NKB = property(lambda self: math.ceil(self.H / KB))                # k tiles
    Hp = property(lambda self: self.NKB * KB)
    NCH = property(lambda self: math.ceil(math.ceil(self.B / MC) / self.BS) * self.BS)   # chunks (all blocks)
    NCB = property(lambda self: self.NCH // self.BS)                   # chunks a block
    WGS = property(lambda self: self.cfg.warpgroups)
    NCW = property(lambda self: self.NCB // self.WGS)                  # chunks a warpgroup
    NTB = property(lambda self: NT * self.WGS)                         # threads a block
    BLOCKS = property(lambda self: self.D * self.G * self.BS)
    ITEMS = property(lambda self: self.UB // 2)                        # (row, unit) items a thread
    S = property(lambda self: self.cfg.state_tiles or self.NKB)        # state k-tile slots (< NKB: a ring)
    RING = property(lambda self: self.S < self.NKB)
    R_HALFS = property(lambda self: self.NKB * self.N * KB)
    S_HALFS = property(lambda self: self.WGS * self.S * MC * KB)          # every warpgroup's slots

    def smem_bytes(self) -> int:
        return 2 * (self.R_HALFS + self.S_HALFS) + ATOM     # + slack to align the first tile to 1 KB

    def regs_estimate(self) -> int:
        # LSTM: each item's cell state beside h, its unit's i, o, f peepholes and the gate math's temporaries
        lstm = self.NCW * self.ITEMS + 3 * self.ITEMS + _LSTM_TEMPS if self.NG == 4 else 0
        # accumulators, this chunk's and the next chunk's gate_i, each item's h
        return self.N // 2 + 8 * self.ITEMS + self.NCW * self.ITEMS + lstm + _REG_OVERHEAD

    def check(self, facts) -> str | None:
        """Why this geometry cannot run (every block resident, at most two an SM), or None."""
        c = self.cfg
        if c.units_per_block < 8 or c.units_per_block % 8 or self.N > 256 or c.batch_split < 1:
            return f"config {c}: units_per_block a multiple of 8 with gates x units <= 256, batch_split >= 1"
        if KB % c.units_per_block:   # unit groups tile the padded k (G * UB <= Hp)
            return f"config {c}: units_per_block must divide {KB}"
        if c.state_tiles and not 2 <= c.state_tiles <= self.NKB:
            return f"config {c}: state_tiles must be 0 or 2 .. the {self.NKB} k-tiles"
        if c.warpgroups not in (1, 2) or self.NCB % c.warpgroups:
            return f"config {c}: warpgroups 1 or 2, dividing the {self.NCB} chunks a block"
        if facts is None:
            return None
        per_sm = self.per_sm(facts)
        if per_sm > 2:
            return f"{self.D} x {self.G} x {self.BS} blocks > 2 x {facts.num_sms} SMs: not all resident"
        # two blocks an SM share its 228 KB (each with the driver's 1 KB) and its registers
        smem_cap = facts.smem_per_block if per_sm == 1 else (facts.smem_per_block + 1024) // 2 - 1024
        if self.smem_bytes() + 256 + 8 * self.WGS * self.S > smem_cap:   # + static: descriptors, mbarriers
            return (f"{self.smem_bytes()} B shared memory (R slice {2 * self.R_HALFS} + state tiles "
                    f"{2 * self.S_HALFS}) > {smem_cap} ({per_sm} block(s) an SM)")
        cap = min(_MAX_REGS, facts.regs_per_sm // (NT * self.WGS * per_sm))
        if self.regs_estimate() > cap:
            return f"~{self.regs_estimate()} registers a thread > {cap} ({per_sm} block(s) an SM)"
        return None

    def per_sm(self, facts) -> int:
        """Blocks each SM must hold for all to be resident (the cooperative launch's grid barrier)."""
        return math.ceil(self.BLOCKS / facts.num_sms)


def default_config(D: int, B: int, H: int, target, cell: str = "gru", measured: bool = True
                   ) -> WgmmaRecConfig | None:
    """The measured winner (`schedules/measured/persistent_wgmma.json`, merged by `schedules/plstm_sweep.py`) where
    the shape was swept; else, of 8 or 16 units a block and batch splits up to the chunk count, the config that
    fits with the most blocks (SMs busy, one block an SM); a tie goes to 16 units (fewer chunks a block, walked one
    after another). Measured on the H100 (recurrence us a step, artifacts/bench/pwg_sweep.json): H1024 B256 (16, 2)
    10.2, bi H1024 B256 (16, 1) 18.5, H512 B256 (16, 4) 4.7 against (8, 1) 10.7, H256 B256 (8, 4) 3.4 against
    (16, 4) 3.8."""
    from .. import recurrent_gemm as rg
    from ...tune import measured as db

    target = resolve(target)
    if measured and is_gpu(target):
        found = db.lookup("persistent_wgmma", D=D, B=B, H=H, cell=cell)
        if found:
            return WgmmaRecConfig(**found)
    facts = rg.gpu_facts(target)
    geo = lambda c: WgmmaRecGeometry(D, B, H, GATES[cell], c)   # noqa: E731
    fits = [c for c in (WgmmaRecConfig(ub, bs, st) for ub in (16, 8) for bs in (1, 2, 4, 8)
                        for st in state_tile_options(H, cell) if bs <= max(1, math.ceil(B / MC)))
            if geo(c).check(facts) is None and geo(c).per_sm(facts) == 1]
    if not fits:
        return None
    if cell != "lstm":
        return max(fits, key=lambda c: (geo(c).BLOCKS, c.units_per_block))
    # LSTM: the GRU's order, then the largest ring (fewest refills and syncs a chunk); swept shapes take the
    # database's winner above (artifacts/bench/plstm_wgmma_sweep_2026-11-28.json.gz)
    return max(fits, key=lambda c: (geo(c).BLOCKS, c.units_per_block, geo(c).S))


def state_tile_options(H: int, cell: str) -> tuple:
    """state_tiles to try: the whole chunk (0); for the LSTM also rings of half and a quarter of the k-tiles
    (at least 2 slots), which let 16-unit blocks hold their 64-row R slice at hidden 1024. The GRU/RNN keep their
    measured configs (no ring)."""
    nkb = math.ceil(H / KB)
    if cell != "lstm":
        return (0,)
    return (0,) + tuple(nkb // div for div in (2, 4) if nkb % div == 0 and nkb // div >= 2)


# Where this kernel replaces `mma` (float16, sm_90a): batch >= WGMMA_MIN_BATCH, or bidirectional at
# hidden >= 1024 and batch >= 64. Measured on the H100 (recurrence us a step, wgmma / mma.sync kernel, the
# latter's database picks): B256 H1024 10.2 / 13.6, bi 18.5 / 24.0; B256 H512 4.7 / 6.2, bi 8.2 / 11.5; bi H1024
# B64 6.3 / 7.2; not at B64 (H1024 4.8-5.0 / 4.3, H512 3.4 / 2.9, H256 2.9 / 2.2: one 64-row chunk feeds too few
# blocks or repeats the whole state ingest per 8 units). GRU and LSTM (the LSTM by the GRU's rule: both kernels do
# 4/3 of the GRU's work a step there, as on `mma`); the RNN was not timed on it.
WGMMA_MIN_BATCH = 128


def supported(D: int, B: int, H: int, dtype: str, lbr, target, cell: str = "gru", config=None) -> tuple[bool, str]:
    """Whether the importer runs this recurrence on the warpgroup kernel, and why not."""
    from .. import recurrent_gemm as rg

    target = resolve(target)
    if not is_gpu(target) or str(target.attrs.get("arch", "")) != "sm_90a":
        return False, "wgmma needs sm_90a"
    if dtype != "float16" or cell not in ("gru", "lstm") or (cell == "gru" and not lbr):
        return False, "float16 GRU with linear_before_reset=1 or LSTM only (the RNN was not measured on it)"
    if not (B >= WGMMA_MIN_BATCH or (D == 2 and H >= 1024 and B >= 64)):
        return False, f"batch {B}: the mma.sync kernel was measured faster there"
    cfg = config or default_config(D, B, H, target, cell)
    if cfg is None:
        return False, "no warpgroup configuration fits (blocks or shared memory)"
    why = WgmmaRecGeometry(D, B, H, GATES[cell], cfg).check(rg.gpu_facts(target))
    return (why is None), (why or f"warpgroup tensor-core persistent kernel, {cfg}")


def persistent_wgmma_func(D: int, B: int, H: int, dtype: str, directions: str, acts, clip, has_seq_lens: bool,
                          target, config: WgmmaRecConfig | None = None, cell: str = "gru",
                          gate_dtype: str = "float32", lstm=None, fast_math: bool | None = None):
    """prim_func(gate_i, R, rb_h, seq_lens, h0, Y, Y_h): all steps of a float16 GRU (lbr=1) / RNN node on
    warpgroup tensor cores (see the module doc); gate_i of gate_dtype (float32 or float16).

    cell 'lstm' (`lstm`: its update math, a `cells.LstmCell`, default no peepholes / input_forget):
    prim_func(gate_i [D, T, B, 4H], R [D, 4H, H], P f32 [D, 3H], seq_lens, h0, c0 f32 [D, B, H], Y, Y_h, Y_c), the
    LSTM interface of `engine.persistent_lstm_func`."""
    from tvm.script import tirx as T

    from . import cells
    from .. import recurrent_gemm as rg

    check_args(D, B, H, dtype, directions, cell, kind="wgmma", dtypes=("float16",), cells=("gru", "rnn", "lstm"))
    if gate_dtype not in GATE_DTYPES:
        raise TvmseqError(f"persistent wgmma: gate_dtype {gate_dtype!r} not one of {GATE_DTYPES}")
    target = resolve(target)
    gpu = is_gpu(target)
    fast = cells.fast_math_for(dtype, gpu, fast_math)
    NG, acts, lstm, lstm_fns = staged_cell("wgmma", cell, acts, D, lstm, fast)
    LSTM = cell == "lstm"
    PEEP = LSTM and lstm.has_peepholes
    cfg = config or (default_config(D, B, H, target, cell) if gpu else WgmmaRecConfig(8, 1))
    geo = checked_geometry("wgmma", cell, D, B, H, cfg, lambda c: WgmmaRecGeometry(D, B, H, NG, c),
                           rg.gpu_facts(target) if gpu else None)
    UB, BS, N, G, NKB, Hp, NCH, NCB, ITEMS = (geo.UB, geo.BS, geo.N, geo.G, geo.NKB, geo.Hp, geo.NCH, geo.NCB,
                                              geo.ITEMS)
    R_HALFS, S_HALFS = geo.R_HALFS, geo.S_HALFS
    PER_SM = geo.per_sm(rg.gpu_facts(target)) if gpu else 1
    # warpgroups a block (the CPU variant emulates one: the split is a GPU schedule, the numbers are the same)
    WGS = geo.WGS if gpu else 1
    NCW, NTB = NCB // WGS, NT * WGS      # chunks a warpgroup, threads a block (geo.NCW, geo.NTB on the GPU)
    SLOTS, RING = geo.S, geo.RING    # state k-tile slots in shared memory (RING: fewer than the NKB tiles)
    JN = UB // 8                  # n8 column groups a gate
    ACC = N // 2                  # float32 accumulators a thread
    G3 = NG * H
    WORDS = D * NCH * NKB * MC * KB   # one half of the state double buffer (halfs)
    TILE_BYTES = MC * KB * 2
    unroll = T.unroll if gpu else T.serial
    f_act, g_act, clipf = cells.cell_math(acts, D, NG, clip, fast)
    length = cells.row_length(has_seq_lens, B)
    time_index = cells.time_index_fn(directions)

    def widen(v):
        # float32 gate_i is read as it was (no cast node): the default kernel's code stays what it was
        return v if gate_dtype == "float32" else T.Cast("float32", v)

    def swz(r, k):
        """Half offset of element k (< 64) of row r inside a swizzled 64-column tile."""
        return r * KB + T.bitwise_xor(k // 8, r % 8) * 8 + k % 8

    def img(buf, d, b, k):
        """The state element (row b, column k) in the image layout of buffer `buf`."""
        tile = (d * NCH + b // MC) * NKB + k // KB
        return buf * WORDS + tile * MC * KB + swz(b % MC, k % KB)

    def lane(t):
        """Thread t's index in its warpgroup (t: the block's thread)."""
        return t if WGS == 1 else t % NT

    def wg_of(t):
        """Thread t's warpgroup in its block."""
        return 0 if WGS == 1 else t // NT

    def chunk(q, t, ci):
        """The chunk that thread t's warpgroup of block (g, q) walks ci-th: every WGS-th of the block's."""
        return q + ci * BS if WGS == 1 else q + (wg_of(t) + WGS * ci) * BS

    def r_row(g, n):
        """R row of block-local gate row n = gate * UB + unit."""
        return (n // UB) * H + g * UB + n % UB

    def item(t, it):
        """(row in the chunk, unit in the block) of item `it` of thread t (the accumulator layout)."""
        h, j, e = it // (2 * JN), it // 2 % JN, it % 2
        return (t // 32) * 16 + t % 32 // 4 + 8 * h, j * 8 + (t % 32 % 4) * 2 + e

    def pre(src, t, it, gate):
        """Gate `gate`'s pre-activation (R h) of item `it`: an accumulator (GPU) or red[row, col] (CPU)."""
        h, j, e = it // (2 * JN), it // 2 % JN, it % 2
        if gpu:
            return src[((gate * JN + j) * 4 + 2 * h + e)]
        row, u = item(t, it)
        return src[row * N + gate * UB + u]

    # ---- set-up ---------------------------------------------------------------------------------
    @T.macro
    def load_r_tiles(Rw, smem, base, d, g, t):
        """The block's gate rows of R -> shared memory k-tiles [N rows x 64], swizzled, zero past H."""
        for i in T.serial(math.ceil(NKB * N * KB / NTB)):
            v = T.meta_var(i * NTB + t)
            kb = T.meta_var(v // (N * KB))
            n = T.meta_var(v // KB % N)
            k = T.meta_var(kb * KB + v % KB)
            if v < NKB * N * KB:
                smem[base + kb * N * KB + swz(n, v % KB)] = T.if_then_else(
                    g * UB + n % UB < H and k < H, Rw[d, T.min(r_row(g, n), G3 - 1), T.min(k, H - 1)],
                    T.float16(0))

    @T.macro
    def seed_state(S0, st, hbuf, hoff, d, g, q, t, to_image):
        """Own state st <- s0 (float32) on this block's rows and units (0 past B and H). to_image (h; the LSTM's c
        never leaves the chip): also buffer 0 <- h0 (fp16), buffer 1 <- 0, and the last unit group zeroes the
        padding columns [G*UB, Hp) of its rows."""
        for ci in T.serial(NCW):
            for it in unroll(ITEMS):
                row, u = item(lane(t), it)
                b = T.meta_var(chunk(q, t, ci) * MC + row)
                j = T.meta_var(g * UB + u)
                st[hoff + ci * ITEMS + it] = T.if_then_else(b < B and j < H, S0[d, T.min(b, B - 1), T.min(j, H - 1)],
                                                            T.float32(0))
                if to_image:
                    hbuf[img(0, d, b, j)] = T.Cast("float16", st[hoff + ci * ITEMS + it])
                    hbuf[img(1, d, b, j)] = T.float16(0)
            if to_image and Hp > G * UB:
                if g == G - 1:
                    for i in T.serial(math.ceil(MC * (Hp - G * UB) / NT)):
                        v = T.meta_var(i * NT + lane(t))
                        if v < MC * (Hp - G * UB):
                            hbuf[img(0, d, chunk(q, t, ci) * MC + v // (Hp - G * UB), G * UB + v % (Hp - G * UB))] = \
                                T.float16(0)
                            hbuf[img(1, d, chunk(q, t, ci) * MC + v // (Hp - G * UB), G * UB + v % (Hp - G * UB))] = \
                                T.float16(0)

    @T.macro
    def load_peepholes(Pw, ps, d, g, t):
        """LSTM: P (i, o, f) of the units of this thread's items (the same units in every chunk)."""
        for it in unroll(ITEMS):
            row, u = item(lane(t), it)
            j = T.meta_var(T.min(g * UB + u, H - 1))
            for qq in unroll(3):
                ps[it * 3 + qq] = Pw[d, qq * H + j]

    # ---- a chunk of a step ----------------------------------------------------------------------
    @T.macro
    def prefetch(GI, RbH, Lens, gi, d, g, t, s, c, seq):
        for it in unroll(ITEMS):
            row, u = item(lane(t), it)
            b = T.meta_var(T.min(c * MC + row, B - 1))
            j = T.meta_var(T.min(g * UB + u, H - 1))
            L = T.meta_var(length(Lens, b, seq))
            tt = T.meta_var(T.max(T.min(time_index(d, L, s), seq - 1), 0))
            for q in unroll(NG):
                gi[it * 4 + q] = widen(GI[d, tt, b, q * H + j])
            if NG == 3:
                gi[it * 4 + 3] = RbH[d, j]

    def cell_update(src, gi, d, t, it, h):
        if NG == 1:
            return f_act(d, clipf(gi[it * 4] + pre(src, t, it, 0)))
        z = f_act(d, clipf(gi[it * 4] + pre(src, t, it, 0)))
        r = f_act(d, clipf(gi[it * 4 + 1] + pre(src, t, it, 1)))
        hh = g_act(d, clipf(gi[it * 4 + 2] + r * (pre(src, t, it, 2) + gi[it * 4 + 3])))
        return (T.float32(1) - z) * hh + z * h

    def gate_pre(src, gi, t, it):
        """LSTM: pre(q), gate q's input projection plus its recurrent sum for item it (q: 0 i, 1 o, 2 f, 3 c)."""
        return lambda q: gi[it * 4 + q] + pre(src, t, it, q)

    def peep_of(ps, it):
        """LSTM: peep(q), the peephole of gate q (0 i, 1 o, 2 f) of item it's unit; None without peepholes."""
        return (lambda q: ps[it * 3 + q]) if PEEP else None

    @T.macro
    def finish(Y, Lens, hbuf, hst, cst, ps, hoff, src, gi, d, g, t, s, c, ci, seq):
        """Gate math of this thread's items; Y, own state and h_{s+1} (fp16, image of the other buffer). LSTM: c'
        then h' (c' a variable: the o gate's peephole and h(c') read it), c' kept in cst."""
        for it in unroll(ITEMS):
            row, u = item(lane(t), it)
            b = T.meta_var(c * MC + row)
            j = T.meta_var(g * UB + u)
            if b < B and j < H:
                L = T.meta_var(length(Lens, b, seq))
                h = T.meta_var(hst[hoff + ci * ITEMS + it])
                if LSTM:
                    cp = T.meta_var(cst[hoff + ci * ITEMS + it])
                    cn = T.if_then_else(s < L, lstm.cell(lstm_fns, clipf, d, gate_pre(src, gi, t, it),
                                                         peep_of(ps, it), cp), cp)
                    hn = T.if_then_else(s < L, lstm.hidden(lstm_fns, clipf, d, gate_pre(src, gi, t, it),
                                                           peep_of(ps, it), cn), h)
                    cst[hoff + ci * ITEMS + it] = cn
                else:
                    hn = T.if_then_else(s < L, cell_update(src, gi, d, t, it, h), h)
                if has_seq_lens:
                    Y[T.if_then_else(s < L, time_index(d, L, s), s), d, b, j] = T.Cast(
                        "float16", T.if_then_else(s < L, hn, T.float32(0)))
                else:
                    Y[time_index(d, seq, s), d, b, j] = T.Cast("float16", hn)
                hst[hoff + ci * ITEMS + it] = hn
                hbuf[img((s + 1) % 2, d, b, j)] = T.Cast("float16", hn)

    @T.macro
    def final_state(Yh, Lens, hst, hoff, d, g, q, t, seq):
        for ci in T.serial(NCW):
            for it in unroll(ITEMS):
                row, u = item(lane(t), it)
                b = T.meta_var(chunk(q, t, ci) * MC + row)
                j = T.meta_var(g * UB + u)
                if b < B and j < H:
                    Yh[d, b, j] = T.Cast("float16", T.if_then_else(length(Lens, b, seq) > 0 and seq > 0,
                                                                   hst[hoff + ci * ITEMS + it], T.float32(0)))

    def slot(t, kb):
        """Thread t's warpgroup's state slot kb (< SLOTS): its index among the block's slots and mbarriers."""
        return kb if WGS == 1 else wg_of(t) * SLOTS + kb

    @T.macro
    def wg_sync(t):
        """Every warp of thread t's warpgroup here (its wgmma reads of a slot done): the block's barrier with one
        warpgroup, a named barrier of 128 threads (1 + the warpgroup) with two."""
        if WGS == 1:
            T.tvm_storage_sync("shared")
        else:
            T.cuda.warpgroup_sync(1 + wg_of(t))

    @T.macro
    def stage(hbuf, smem, base, mbar, buf, d, c, t):
        """Lane kb < SLOTS of a warpgroup: tile kb of chunk c's state -> the warpgroup's slot kb by one bulk copy,
        completing on that slot's mbarrier. The proxy fence orders the grid barrier's acquire of the state
        (written by the other blocks through the generic proxy) before this async-proxy read of it."""
        if lane(t) < SLOTS:
            T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](T.address_of(mbar[slot(t, lane(t))]),
                                                                T.uint32(TILE_BYTES))
            T.ptx["fence.proxy.async"]()
            T.ptx["cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"](
                smem.access_ptr("w", offset=base + R_HALFS + slot(t, lane(t)) * MC * KB, extent=MC * KB),
                T.address_of(hbuf[buf * WORDS + ((d * NCH + c) * NKB + lane(t)) * MC * KB]),
                T.uint32(TILE_BYTES), T.address_of(mbar[slot(t, lane(t))]))

    @T.macro
    def operands(dR, dS, da, db, state_halfs, r_halfs):
        """da, db <- the descriptors of the state tile and the R tile at these half offsets from the first slot
        and the first R tile: their base descriptors plus the offset in 16-byte units (the start address field,
        14 bits, holds every shared address). Encoding each descriptor from its address took ~20 uniform-datapath
        instructions a wgmma, more than half of all a warp issued (ncu, fp16 bi H1024 B256: 7,000 a step)."""
        da[0] = dS[0] + T.Cast("uint64", state_halfs // 8)
        db[0] = dR[0] + T.Cast("uint64", r_halfs // 8)

    @T.macro
    def load_bases(sdesc, dR, dS):
        """The two base descriptors from shared memory into registers, once a chunk: held in registers for the
        whole kernel, ptxas derived all 4 x NKB descriptors of a chunk from them before the step loop (255
        registers and spills); a shared load is not moved across the step's barriers."""
        dR[0] = sdesc[0]
        dS[0] = sdesc[1]

    @T.macro
    def product_gpu(smem, base, mbar, acc, sdesc, dR, dS, da, db, phase, t):
        """acc <- state chunk (64 x Hp) x R slice^T (Hp x N): tile kb's 4 wgmma once tile kb has landed. The kb
        loop is not unrolled: unrolled, the 8 NKB descriptors are loop invariants of the step loop, and ptxas
        hoisted them all (255 registers and spills at B256 H1024)."""
        load_bases(sdesc, dR, dS)
        T.ptx["wgmma.fence.sync.aligned"]()
        for kb in T.serial(NKB):
            T.evaluate(T.cuda.mbarrier_wait(T.address_of(mbar[slot(t, kb)]), phase % 2))
            for kk in unroll(KB // 16):
                operands(dR, dS, da, db, slot(t, kb) * MC * KB + kk * 16, kb * N * KB + kk * 16)
                T.evaluate(mma_async(N, acc, da, db, kb * 4 + kk > 0))
        T.ptx["wgmma.commit_group.sync.aligned"]()
        T.ptx["wgmma.wait_group.sync.aligned"](0)

    @T.macro
    def refill(hbuf, smem, base, mbar, buf, d, c, kb, t):
        """Ring: tile kb of chunk c's state -> slot kb % SLOTS (whose previous tile's wgmma group has completed in
        every warp: the caller waited and synced), completing on that slot's mbarrier. Issued by thread 0, which
        ran the full proxy fence after this step's grid barrier when it staged tile 0."""
        T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](T.address_of(mbar[slot(t, kb % SLOTS)]),
                                                            T.uint32(TILE_BYTES))
        T.ptx["cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"](
            smem.access_ptr("w", offset=base + R_HALFS + slot(t, kb % SLOTS) * MC * KB, extent=MC * KB),
            T.address_of(hbuf[buf * WORDS + ((d * NCH + c) * NKB + kb) * MC * KB]),
            T.uint32(TILE_BYTES), T.address_of(mbar[slot(t, kb % SLOTS)]))

    @T.macro
    def product_ring(hbuf, smem, base, mbar, acc, sdesc, dR, dS, da, db, phase, buf, d, c, t):
        """product_gpu through a ring of SLOTS tile slots: slot j = kb % SLOTS receives fills(j) tiles a chunk
        (ceil((NKB - j) / SLOTS): the same for every slot where SLOTS divides NKB), and its mbarrier's parity
        counts them over the chunks; after tile kb's group is committed, tile kb - 1's group is waited for (one
        group stays in flight), the block syncs (every warp's reads of that slot done) and thread 0 refills the
        slot with tile kb - 1 + SLOTS."""
        load_bases(sdesc, dR, dS)
        T.ptx["wgmma.fence.sync.aligned"]()
        for kb in T.serial(NKB):
            fills = T.meta_var(NKB // SLOTS if NKB % SLOTS == 0 else (NKB - kb % SLOTS + SLOTS - 1) // SLOTS)
            T.evaluate(T.cuda.mbarrier_wait(T.address_of(mbar[slot(t, kb % SLOTS)]),
                                            (phase * fills + kb // SLOTS) % 2))
            for kk in unroll(KB // 16):
                operands(dR, dS, da, db, slot(t, kb % SLOTS) * MC * KB + kk * 16, kb * N * KB + kk * 16)
                T.evaluate(mma_async(N, acc, da, db, kb * 4 + kk > 0))
            T.ptx["wgmma.commit_group.sync.aligned"]()
            if kb >= 1 and kb - 1 + SLOTS < NKB:
                T.ptx["wgmma.wait_group.sync.aligned"](1)
                wg_sync(t)
                if lane(t) == 0:
                    refill(hbuf, smem, base, mbar, buf, d, c, kb - 1 + SLOTS, t)
        T.ptx["wgmma.wait_group.sync.aligned"](0)

    @T.macro
    def product_cpu(hbuf, Rw, red, buf, d, g, c):
        for row, n in T.grid(MC, N):
            red[row * N + n] = T.float32(0)
            for k in T.serial(H):
                if g * UB + n % UB < H:
                    red[row * N + n] = red[row * N + n] + T.Cast("float32", hbuf[img(buf, d, c * MC + row, k)]) \
                        * T.Cast("float32", Rw[d, r_row(g, n), k])

    serial_kernel = serial_variant(D, G, BS, NT, NCB, ITEMS, MC * N, LSTM, PEEP, seed_state, load_peepholes,
                                   prefetch, product_cpu, finish, final_state)

    # ---- the kernel (`gpu` picks the branch while the script is parsed), a GRU / RNN or an LSTM signature around
    # it (RbH: GRU / RNN only; Pw, C0, Yc: LSTM only, None otherwise)
    @T.macro
    def kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, seq):
        hbuf = T.alloc_buffer((2 * WORDS,), "float16", scope="global")
        if gpu:
            for gb in T.thread_binding(D * G * BS, thread="blockIdx.x"):
                for t in T.thread_binding(NTB, thread="threadIdx.x"):
                  with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", PER_SM):
                    smem = T.alloc_buffer((R_HALFS + S_HALFS + ATOM // 2,), "float16", scope="shared.dyn")
                    mbar = T.alloc_buffer((WGS * SLOTS,), "uint64", scope="shared")
                    acc = T.alloc_buffer((ACC,), "float32", scope="local")
                    hst = T.alloc_buffer((NCW * ITEMS,), "float32", scope="local")
                    gi = T.alloc_buffer((ITEMS * 4,), "float32", scope="local")
                    gn = T.alloc_buffer((ITEMS * 4,), "float32", scope="local")   # the next chunk's
                    if LSTM:
                        cst = T.alloc_buffer((NCW * ITEMS,), "float32", scope="local")
                        ps = T.alloc_buffer((3 * ITEMS,), "float32", scope="local")
                    else:
                        cst = T.meta_var(None)
                        ps = T.meta_var(None)
                    da = T.alloc_buffer((1,), "uint64", scope="local")
                    db = T.alloc_buffer((1,), "uint64", scope="local")
                    sdesc = T.alloc_buffer((2,), "uint64", scope="shared")   # R's first tile, the first slot
                    dR = T.alloc_buffer((1,), "uint64", scope="local")
                    dS = T.alloc_buffer((1,), "uint64", scope="local")
                    off = T.alloc_buffer((1,), "int32", scope="local")
                    d = T.meta_var(gb // (G * BS))
                    g = T.meta_var(gb % (G * BS) // BS)
                    q = T.meta_var(gb % BS)
                    off[0] = align_offset(smem)   # halfs to the first 1 KB boundary (where the tiles start)
                    base = T.meta_var(off[0])
                    if t == 0:
                        encode_descriptor(dR, T.address_of(smem[base]))
                        encode_descriptor(dS, T.address_of(smem[base + R_HALFS]))
                        sdesc[0] = dR[0]
                        sdesc[1] = dS[0]
                    load_r_tiles(Rw, smem, base, d, g, t)
                    # the R tiles (generic stores) before any wgmma reads them (async proxy): proxy fence and
                    # barrier right here; with only the shared::cta fence before the first grid barrier,
                    # compute-sanitizer racecheck reported write-write hazards on the tiles (H100, 2026-11-23)
                    T.ptx["fence.proxy.async"]()
                    T.tvm_storage_sync("shared")
                    seed_state(H0, hst, hbuf, 0, d, g, q, t, True)
                    if LSTM:
                        seed_state(C0, cst, None, 0, d, g, q, t, False)
                    if PEEP:
                        load_peepholes(Pw, ps, d, g, t)
                    if t < WGS * SLOTS:
                        T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(mbar[t]), T.uint32(1))
                    T.ptx["fence.mbarrier_init.release.cluster"]()
                    T.cuda.grid_sync()
                    if seq > 0:   # gate_i of step 0's first chunk (a 0-step call has none)
                        prefetch(GI, RbH, Lens, gi, d, g, t, 0, chunk(q, t, 0), seq)
                    for s in T.serial(seq):
                        stage(hbuf, smem, base, mbar, s % 2, d, chunk(q, t, 0), t)
                        for ci in unroll(NCW):   # unrolled: hst stays in registers
                            if RING:
                                product_ring(hbuf, smem, base, mbar, acc, sdesc, dR, dS, da, db, s * NCW + ci,
                                             s % 2, d, chunk(q, t, ci), t)
                            else:
                                product_gpu(smem, base, mbar, acc, sdesc, dR, dS, da, db, s * NCW + ci, t)
                            # the next chunk's gate_i (this step's next chunk, else the next step's first: an
                            # input, so across the grid barrier too) loads during this chunk's gate math and the
                            # next product; issued just before the product, its loads were still in flight when
                            # the gate math wanted them (ncu: a sixth of the samples, fp16 bi H1024 B256)
                            if ci + 1 < NCW:
                                prefetch(GI, RbH, Lens, gn, d, g, t, s, chunk(q, t, ci + 1), seq)
                            else:
                                prefetch(GI, RbH, Lens, gn, d, g, t, s + 1, chunk(q, t, 0), seq)
                            if ci + 1 < NCW:   # the next chunk's copies fly during this chunk's gate math
                                wg_sync(t)     # every warp's wgmma reads of the slots done
                                stage(hbuf, smem, base, mbar, s % 2, d, chunk(q, t, ci + 1), t)
                            finish(Y, Lens, hbuf, hst, cst, ps, 0, acc, gi, d, g, t, s, chunk(q, t, ci), ci, seq)
                            for v in unroll(ITEMS * 4):
                                gi[v] = gn[v]
                        T.cuda.grid_sync()
                    final_state(Yh, Lens, hst, 0, d, g, q, t, seq)
                    if LSTM:
                        final_state(Yc, Lens, cst, 0, d, g, q, t, seq)
        else:
            serial_kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, hbuf, seq)

    main = cells.recurrence_prim_func(kernel, cell, D, B, H, dtype, gate_dtype)
    return rg.scheduled(main, f"{cell}_recurrence_wgmma", cooperative=gpu)
