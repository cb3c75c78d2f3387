"""The per-step recurrent GEMM at large batch: a shared-memory tiled SIMT GEMM in TensorIR (TIRx).

One time step of the per-step GRU/RNN path computes gh[d, b, n] = sum_k h[d, b, k] R[d, off + n, k]
(M = batch, N = gate rows, K = hidden), float32 accumulation, R stored in the model's dtype. The warp-per-row
kernel of `gru.step_gemm_macro` re-reads h for every output row (~3.2 GB of L2 traffic a step at batch 256,
hidden 1024); this kernel is the classic SIMT SGEMM instead:

* a block computes a `bm x bn` tile of (batch rows x gate rows); its `(bm/tm) x (bn/tn)` threads each hold a
  `tm x tn` float32 accumulator tile in registers, made of `wm x wn` chunks (wm = min(4, tm)) spaced a
  thread-grid apart, so fragments are read from shared memory as float4 vectors without bank conflicts
  (the layout of `tvmseq.tune.space`'s template);
* K is walked in `bk`-deep slices: h and R tiles are staged in shared memory transposed to [bk][bm] and
  [bk][bn] (float32; fp16 R is converted as it is loaded), double buffered with the next slice's global
  loads (float4 / 4 x fp16 when K allows) held in registers while the current slice is computed, one
  __syncthreads per slice;
* `split_k` > 1 splits K over blocks too (more blocks for small M x N); split s writes its partial sums to
  slice s of the workspace gh[S, D, B, N], and the gate kernel that reads gh adds the S partials.

Why not `tune.space.TiledGemm` itself: it is an s_tir schedule of a standalone PrimFunc that needs tiles
dividing M, N and K (batch 17, hidden 37 do not), and the recurrence is one TIRx function with a host time
loop (s_tir refuses it), into which this kernel is emitted as a macro. Its layout choices are reused.

Tile sizes are data (`GemmTile`), picked per problem by `choose_tile` (a dlight-style rule: a small family
of tiles ranked by a cost model of the H100: waves over the SMs, warps per SM, shared-memory traffic per FMA,
L2 traffic, split-K partial sums). On the CPU the same macro runs with the thread loop serialised phase by
phase (`gpu=False`), so CI checks the tiling, bounds and pipelining numerically.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM: nothing is built here
    T = None

from ...errors import TvmseqError

# Batch sizes from which the per-step path uses this tiled GEMM (below it the warp-per-row kernel wins:
# with batch <= 8 every R row is read once per step anyway and the GEMM is latency-bound).
TILED_MIN_BATCH = 16

# floats added to each shared-memory row: the transposed stores then have 2-way bank conflicts instead of
# 4-way (bk 16), and rows stay float4-aligned for the fragment loads
_PAD = 4
_MAX_STATIC_SMEM = 48 * 1024
# registers besides accumulators, fragments and staged loads (addresses, indices, loop state); the estimate
# also sets __launch_bounds__' blocks per SM, so ptxas may use up to 65536 / (threads x blocks)
_REG_OVERHEAD = 64


@dataclass(frozen=True)
class GemmTile:
    """Tile sizes of the tiled step GEMM (what a tuner would search)."""

    bm: int = 64       # batch rows per block
    bn: int = 64       # gate rows per block
    bk: int = 16       # K slice staged in shared memory per main-loop step
    tm: int = 4        # batch rows per thread (accumulator tile rows)
    tn: int = 4        # gate rows per thread
    split_k: int = 1   # blocks sharing one output tile's K (partial sums added by the gate kernel)
    vec: int = 4       # global load width in elements (used when K is a multiple of it)

    @property
    def wm(self) -> int:
        return min(4, self.tm)

    @property
    def wn(self) -> int:
        return min(4, self.tn)

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def shared_bytes(self) -> int:
        return 2 * self.bk * (self.bm + _PAD + self.bn + _PAD) * 4

    def load_width(self, K: int) -> int:
        return self.vec if K % self.vec == 0 and self.bk % self.vec == 0 else 1

    def registers(self, K: int = 4) -> int:
        v = self.load_width(K)
        staged = v * (math.ceil(self.bm * self.bk / v / self.threads) + math.ceil(self.bn * self.bk / v / self.threads))
        return self.tm * self.tn + self.tm + self.tn + staged + _REG_OVERHEAD

    def k_tiles(self, K: int) -> tuple[int, int]:
        """(slices per split, splits actually used): every split gets the same number of slices."""
        total = math.ceil(K / self.bk)
        per = math.ceil(total / self.split_k)
        return per, math.ceil(total / per)

    def check(self) -> str | None:
        """Why this tile cannot be built (None when it can)."""
        for name, tile, thread in (("m", self.bm, self.tm), ("n", self.bn, self.tn)):
            if tile % thread:
                return f"t{name}={thread} does not divide b{name}={tile}"
        if self.tm % self.wm or self.tn % self.wn:
            return "tm and tn must be multiples of 4 (or below 4)"
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            return f"{self.threads} threads per block (a multiple of 32, at most 1024)"
        if self.split_k < 1 or self.vec not in (1, 2, 4):
            return "split_k >= 1, vec in (1, 2, 4)"
        if (self.bm + self.bn) * self.bk < self.threads * self.vec:
            # most threads would only wait at the barrier
            return f"a {self.bk}-deep slice of the tiles is less than one {self.vec}-vector per thread"
        if self.shared_bytes() > _MAX_STATIC_SMEM:
            return f"{self.shared_bytes()} bytes of shared memory"
        if self.registers() > 255 or self.registers() * self.threads > 65536:
            return f"about {self.registers()} registers per thread x {self.threads} threads"
        return None


# The family choose_tile ranks: (bm, bn, tm, tn); bk and split_k are chosen with them.
TILE_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (16, 64, 2, 4), (16, 128, 2, 4), (32, 32, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4), (32, 96, 4, 4),
    (64, 32, 4, 4), (64, 64, 4, 4), (64, 96, 4, 4), (64, 128, 4, 8), (64, 64, 8, 4), (64, 128, 8, 8),
    (64, 96, 8, 4), (128, 64, 8, 4), (128, 128, 8, 8), (128, 96, 8, 4),
)
SPLITS = (1, 2, 3, 4, 6, 8)
BK_CHOICES = (8, 16)


@dataclass(frozen=True)
class _Machine:
    """The H100 numbers the cost model uses (per SM unless said otherwise)."""

    sms: int = 132
    fma_per_clk: int = 128            # fp32 lanes
    regs: int = 65536
    smem: int = 228 * 1024
    threads: int = 2048
    l2_bytes_per_clk: float = 3500.0  # whole chip (~6 TB/s at 1.75 GHz)
    l2_latency: int = 350             # cycles: a K slice's global loads must hide behind one slice of FMAs
    barrier: int = 40                 # cycles per K slice: __syncthreads + the first shared loads after it
    saturating_warps: int = 8         # warps per SM that keep its FMA pipes busy (the tile's ILP does the rest)


def _machine(target=None) -> _Machine:
    if target is None:
        return _Machine()
    try:
        from ..recurrent_gemm import gpu_facts

        return _Machine(sms=gpu_facts(target).num_sms)
    except Exception:  # noqa: BLE001 - a target without an arch: the H100 numbers
        return _Machine()


def resident_blocks(tile: GemmTile, K: int = 4, machine: _Machine | None = None) -> int:
    """Blocks of this tile an SM holds at once (registers by the estimate, shared memory, threads). The
    kernel declares it as __launch_bounds__(threads, this), so ptxas keeps to the registers it implies."""
    mc = machine or _Machine()
    regs = 8 * math.ceil(tile.registers(K) / 8)
    return min(mc.regs // (regs * tile.threads), mc.smem // (tile.shared_bytes() + 1024),
               mc.threads // tile.threads, 32)


def estimate_cycles(tile: GemmTile, M: int, N: int, K: int, D: int = 1, r_bytes: int = 4,
                    machine: _Machine | None = None) -> float:
    """Cost model: GPU cycles of one step GEMM plus the extra split-K partial-sum traffic; inf if infeasible.
    The busiest SM runs ceil(blocks / SMs) blocks, min(that, resident) at once; each K slice costs its
    FMAs (issue efficiency: shared loads, staging and the barrier per FMA of the thread tile; occupancy:
    warps per SM) but at least the global-load latency it must hide; L2 operand traffic overlaps it."""
    mc = machine or _Machine()
    if tile.check():
        return math.inf
    per, splits = tile.k_tiles(K)
    nbm, nbn = math.ceil(M / tile.bm), math.ceil(N / tile.bn)
    blocks = nbm * nbn * D * splits
    resident = resident_blocks(tile, K, mc)
    if resident < 1:
        return math.inf
    per_sm = math.ceil(blocks / mc.sms)
    concurrent = min(per_sm, resident)
    rounds = math.ceil(per_sm / concurrent)
    # per thread and K slice: FMAs vs vector shared loads, staging (global loads, shared stores), loop
    fma = tile.bk * tile.tm * tile.tn
    lds = tile.bk * (tile.tm // tile.wm + tile.tn // tile.wn)
    staged = (tile.bm + tile.bn) * tile.bk / tile.threads
    issue_eff = fma / (fma + 1.5 * lds + staged / tile.load_width(K) + 2 * staged + 24)
    occupancy_eff = min(1.0, concurrent * tile.threads / 32 / mc.saturating_warps)
    slice_fma = concurrent * tile.bm * tile.bn * tile.bk / (mc.fma_per_clk * issue_eff * occupancy_eff)
    compute = rounds * per * (max(slice_fma, mc.l2_latency) + mc.barrier)
    l2 = D * K * (M * nbn * 4 + N * nbm * r_bytes) / mc.l2_bytes_per_clk
    partials = 2 * (splits - 1) * D * M * N * 4 / mc.l2_bytes_per_clk   # written here, read by the gates
    return max(compute, l2) + partials


def choose_tile(M: int, N: int, K: int, D: int = 1, dtype: str = "float32", target=None,
                measured: bool = True) -> GemmTile:
    """On a GPU target the measured winner (`schedules/measured/step_gemm.json`, `schedules/tune_step_gemm.py`)
    where there is one, else the cheapest tile of TILE_SHAPES x BK_CHOICES x SPLITS by `estimate_cycles`."""
    if measured and target is not None:
        from ...tune import measured as db

        config = db.lookup("step_gemm", M=M, N=N, K=K, D=D, dtype=dtype)
        if config:
            return GemmTile(**config)
    mc = _machine(target)
    r_bytes = 2 if dtype == "float16" else 4
    best, best_cost = None, math.inf
    for bm, bn, tm, tn in TILE_SHAPES:
        for bk in BK_CHOICES:
            for split in SPLITS:
                tile = GemmTile(bm, bn, bk, tm, tn, split)
                if split > 1 and tile.k_tiles(K)[1] < split:
                    continue  # fewer slices than splits: the same tile with a smaller split exists
                cost = estimate_cycles(tile, M, N, K, D, r_bytes, mc)
                if cost < best_cost * 0.999:   # ties: the earlier (smaller, unsplit) tile
                    best, best_cost = tile, cost
    if best is None:
        raise TvmseqError(f"no feasible step-GEMM tile for M={M} N={N} K={K}")
    return best


def normalized(tile: GemmTile, K: int) -> GemmTile:
    """The tile with split_k reduced to the splits that get K slices."""
    return replace(tile, split_k=tile.k_tiles(K)[1])


def tiled_gemm_macro(gpu: bool, D: int, M: int, K: int, dt: str, tile: GemmTile, rows: int, row_offset: int,
                     out_cols: int | None = None):
    """TVMScript macro `gemm(src, R, gh)`: gh[s, d, m, row_offset + n] = sum over split s's K slices of
    src[d, m, k] * R[d, row_offset + n, k] for m < M, n < rows (s < tile.split_k, which must be normalized).
    src: float32 [D, M, K]; R: dt [D, *, K]; gh: float32 [>= split_k, D, M, out_cols] (out_cols defaults to
    row_offset + rows)."""
    reason = tile.check()
    if reason:
        raise TvmseqError(f"step GEMM tile {tile}: {reason}")
    bm, bn, bk, tm, tn = tile.bm, tile.bn, tile.bk, tile.tm, tile.tn
    wm, wn = tile.wm, tile.wn
    TY, TX = bm // tm, bn // tn
    NT = TY * TX
    per, S = tile.k_tiles(K)
    if S != tile.split_k:
        raise TvmseqError(f"step GEMM tile {tile}: normalize split_k for K={K} first ({S} splits get slices)")
    V = tile.load_width(K)
    KV = bk // V                                       # vectors per staged row
    nA, nR = bm * KV, bn * KV                          # vectors per staged tile
    LA, LR = math.ceil(nA / NT), math.ceil(nR / NT)    # per thread
    SA, SR = bm + _PAD, bn + _PAD
    nbm, nbn = math.ceil(M / bm), math.ceil(rows / bn)
    N = rows
    out_cols = row_offset + rows if out_cols is None else out_cols
    # vector stores of the accumulators when every wn-chunk is inside N and aligned in gh's rows
    vec_store = gpu and wn > 1 and N % wn == 0 and row_offset % wn == 0 and out_cols % wn == 0
    NTL = 1 if gpu else NT                 # thread-local buffers get a thread dimension on the CPU
    min_blocks = max(1, resident_blocks(tile, K))
    scope_s, scope_l = ("shared", "local") if gpu else ("global", "global")
    vec = T.vectorized if gpu else T.serial
    unroll = T.unroll if gpu else T.serial   # registers need constant indices; the CPU compiles faster rolled
    f32 = lambda v: T.Cast("float32", v)  # noqa: E731

    def block_loop(name, extent):
        return T.thread_binding(extent, thread=name) if gpu else T.serial(extent)

    @T.macro
    def init(acc, t0):
        for tt in T.serial(NTL):
            for e in unroll(tm * tn):
                acc[tt, e] = T.float32(0)

    def operand(buf, is_r, z, r, k):
        """Element (r, k) of split z's operand: src row r, or R's row row_offset + r as float32."""
        return f32(buf[z // S, row_offset + r, k]) if is_r else buf[z // S, r, k]

    @T.macro
    def fetch_operand(buf, st, is_r, L, nvec, r0, rows, tt, z, kt, t0):
        """Slice kt of split z of one operand (nvec vectors of V from row r0, rows of them valid): global ->
        registers, zero outside its rows and K."""
        for l in unroll(L):
            idx = T.meta_var(l * NT + t0 + tt)
            r = T.meta_var(r0 + idx // KV)
            k = T.meta_var(((z % S) * per + kt) * bk + (idx % KV) * V)
            if idx < nvec and r < rows and k < K:
                for v in vec(V):
                    st[tt, l * V + v] = operand(buf, is_r, z, r, k + v)
            else:
                for v in vec(V):
                    st[tt, l * V + v] = T.float32(0)

    @T.macro
    def fetch(src, R, stA, stR, z, bym, bxn, t0, kt):
        # slice kt of this split: global -> registers (zero outside M, N, K)
        for tt in T.serial(NTL):
            fetch_operand(src, stA, False, LA, nA, bym * bm, M, tt, z, kt, t0)
            fetch_operand(R, stR, True, LR, nR, bxn * bn, N, tt, z, kt, t0)

    @T.macro
    def stash_operand(st, sm, L, nvec, stride, tt, t0):
        """One operand's registers -> shared, transposed to [k][row] (`stride` floats a k)."""
        for l in unroll(L):
            idx = T.meta_var(l * NT + t0 + tt)
            if idx < nvec:
                for v in unroll(V):
                    sm[((idx % KV) * V + v) * stride + idx // KV] = st[tt, l * V + v]

    @T.macro
    def stash(stA, stR, As, Rs, t0):
        # registers -> shared, transposed to [k][row]
        for tt in T.serial(NTL):
            stash_operand(stA, As, LA, nA, SA, tt, t0)
            stash_operand(stR, Rs, LR, nR, SR, tt, t0)

    @T.macro
    def compute(As, Rs, acc, fa, fb, t0):
        for tt in T.serial(NTL):
            for kk in unroll(bk):
                for c in unroll(tm // wm):
                    for v in vec(wm):
                        fa[tt, c * wm + v] = As[kk * SA + c * (TY * wm) + ((t0 + tt) // TX) * wm + v]
                for c in unroll(tn // wn):
                    for v in vec(wn):
                        fb[tt, c * wn + v] = Rs[kk * SR + c * (TX * wn) + ((t0 + tt) % TX) * wn + v]
                for i in unroll(tm):
                    for j in unroll(tn):
                        acc[tt, i * tn + j] = acc[tt, i * tn + j] + fa[tt, i] * fb[tt, j]

    @T.macro
    def store(gh, acc, z, bym, bxn, t0):
        for tt in T.serial(NTL):
            for i in unroll(tm):
                m = T.meta_var(bym * bm + (i // wm) * (TY * wm) + ((t0 + tt) // TX) * wm + i % wm)
                for c in unroll(tn // wn):
                    n = T.meta_var(bxn * bn + c * (TX * wn) + ((t0 + tt) % TX) * wn)
                    if vec_store:
                        if m < M and n < N:
                            for v in vec(wn):
                                gh[z % S, z // S, m, row_offset + n + v] = acc[tt, i * tn + c * wn + v]
                    else:
                        for v in unroll(wn):
                            if m < M and n + v < N:
                                gh[z % S, z // S, m, row_offset + n + v] = acc[tt, i * tn + c * wn + v]

    @T.macro
    def sync():
        if gpu:
            T.tvm_storage_sync("shared")

    @T.macro
    def kernel(src, R, gh, z, bym, bxn, t0):
        # two buffers per operand (distinct buffers: TVM's sync planner then keeps one
        # barrier per K slice); tile j of the split sits in buffer j % 2. Flat [bk][SA]
        # with explicit strides: a 2-D buffer would be compacted to [bk][bm], losing the pad
        As0 = T.alloc_buffer((bk * SA,), "float32", scope=scope_s)
        As1 = T.alloc_buffer((bk * SA,), "float32", scope=scope_s)
        Rs0 = T.alloc_buffer((bk * SR,), "float32", scope=scope_s)
        Rs1 = T.alloc_buffer((bk * SR,), "float32", scope=scope_s)
        acc = T.alloc_buffer((NTL, tm * tn), "float32", scope=scope_l)
        fa = T.alloc_buffer((NTL, tm), "float32", scope=scope_l)
        fb = T.alloc_buffer((NTL, tn), "float32", scope=scope_l)
        stA = T.alloc_buffer((NTL, LA * V), "float32", scope=scope_l)
        stR = T.alloc_buffer((NTL, LR * V), "float32", scope=scope_l)  # converted on load
        init(acc, t0)
        fetch(src, R, stA, stR, z, bym, bxn, t0, 0)
        stash(stA, stR, As0, Rs0, t0)
        sync()
        for p in range(per // 2):
            fetch(src, R, stA, stR, z, bym, bxn, t0, 2 * p + 1)
            compute(As0, Rs0, acc, fa, fb, t0)
            stash(stA, stR, As1, Rs1, t0)
            sync()
            if 2 * p + 2 < per:
                fetch(src, R, stA, stR, z, bym, bxn, t0, 2 * p + 2)
            compute(As1, Rs1, acc, fa, fb, t0)
            if 2 * p + 2 < per:
                stash(stA, stR, As0, Rs0, t0)
            sync()
        if per % 2 == 1:
            compute(As0, Rs0, acc, fa, fb, t0)
        store(gh, acc, z, bym, bxn, t0)

    @T.macro
    def gemm(src, R, gh):
        for z in block_loop("blockIdx.z", D * S):
            for bym in block_loop("blockIdx.y", nbm):
                for bxn in block_loop("blockIdx.x", nbn):
                    for t0 in block_loop("threadIdx.x", NT if gpu else 1):
                        if gpu:
                            # __launch_bounds__(NT, blocks per SM of the cost model): with (NT) alone
                            # ptxas capped some 384-thread tiles at 56 registers and spilled
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", min_blocks):
                                kernel(src, R, gh, z, bym, bxn, t0)
                        else:
                            kernel(src, R, gh, z, bym, bxn, t0)

    return gemm


def gemm_func(D: int, M: int, N: int, K: int, dtype: str = "float32", tile: GemmTile | None = None,
              target=None, name: str = "step_gemm"):
    """The tiled step GEMM alone as a PrimFunc (tests, ptxas checks, GEMM-only timing):
    gh[s, d, m, n] (float32 partial sums, s < split_k) = h[d, m, :] . R[d, n, :] over split s's K slices.
    Arguments: h float32 [D, M, K], R dtype [D, N, K], gh float32 [split_k, D, M, N]."""
    from tvm import tirx  # noqa: F401 - the compiler must be importable

    gpu = target is not None and getattr(getattr(target, "kind", None), "name", "") == "cuda"
    tile = normalized(tile or choose_tile(M, N, K, D, dtype, target if gpu else None), K)
    S = tile.split_k
    gemm = tiled_gemm_macro(gpu, D, M, K, dtype, tile, N, 0)

    @T.prim_func
    def step_gemm(h: T.handle, r_w: T.handle, g: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        Hs = T.match_buffer(h, (D, M, K), "float32")
        R = T.match_buffer(r_w, (D, N, K), dtype)
        GH = T.match_buffer(g, (S, D, M, N), "float32")
        gemm(Hs, R, GH)

    return step_gemm.with_attr("tirx.is_scheduled", True)


# ---------------------------------------------------------------------------------------------------
# The CPU step GEMM: the reduction over k in SIMD lanes, a register tile of rows x batch rows
# ---------------------------------------------------------------------------------------------------
# R is stored [rows, K] with K contiguous, which is the layout a k-lane reduction wants, so fp32 weights
# need no packing; each (row, batch row) pair of a CPU_ROW_TILE x CPU_BATCH_TILE tile accumulates `lanes`
# partial sums in one vector register, added across lanes once at the end. Row blocks are split over the
# threads of TVM's pool (TVM_NUM_THREADS, else OMP_NUM_THREADS, else the cores) when a step has
# CPU_PARALLEL_MIN_MACS multiply-adds or more: each thread then keeps the same rows of R in its own cache
# from step to step.
CPU_ROW_TILE = 4
CPU_BATCH_TILE = 4
# storage of a register tile's accumulators (the k-in-lanes and the panel GEMM): "global" so that TVM makes these
# small constant-size buffers stack arrays, which LLVM keeps in registers. As "local" they were allocated from
# TVM's workspace pool (TVMBackendAllocWorkspace / FreeWorkspace), once a call on one thread but, inside a
# T.parallel loop, once per row block: 4 allocations and 4 frees per 4 rows. Batch-1 GEMV, rows 3H, 2 threads,
# same process (us): H256 15.0 -> 5.5, H512 38.6 -> 19.0, H1024 115 -> 74 (165-170 GB/s of R from L3); one thread
# unchanged (7.6, 37, 158). Sums are unchanged (same operations).
CPU_TILE_SCOPE = "global"
# batch rows whose src a pass over R's row blocks reuses (64 x K floats: L2-resident)
CPU_M_BLOCK = 64
# below this a step stays on one thread: splitting it costs a launch and a join of TVM's pool every step (~1-2 us
# on idle cores; more when other processes hold them: a thread that lost its core holds up the join). Measured
# on the 2-core Zen 4, 2026-11-27, 100-step recurrences split / serial in one process (quiet machine): GRU / LSTM
# hidden 256 batch 1 (197K, 262K) 0.76 / 0.72, hidden 512 batch 1 (0.8M, 1M) 0.60 / 0.63, RNN hidden 512 batch 1
# (262K) 0.79; RNN hidden 256 batch 1 (66K) 1.67 (slower). Before the tile's accumulators were on the stack
# (CPU_TILE_SCOPE) every row block of a split step allocated them from TVM's workspace pool and a split step was no
# faster than a serial one below ~3M, hence the former 2M here. With one other busy process on the 2 cores the
# split hidden-256 steps took 1.1-1.3x the serial time, hidden 512 the same, hidden 1024 0.3-0.65x.
CPU_PARALLEL_MIN_MACS = 5 << 15
# ... with many cores a step of a few hundred thousand multiply-adds is already memory-bound on one core (R past
# its L2) while the others idle: a 16-core Xeon ran batch-1 hidden-512 GRU / LSTM steps (0.8-1M MACs) serially in
# 15.6 / 19.7 ms per 100 steps against onnxruntime's 2.75 / 3.13 on 16 threads (both ~15 ms on one thread);
# a launch over 16 threads costs more than over 2, so this stays at 256K. Tried at 128K (2026-11-27): the batch-1
# hidden-256 GRU (197K a step) took 1.88 ms serial against 1.11 split with the two builds alternated in one
# process, but 2.3-3.2 ms split in three runs of `tvmseq bench cpu` (alternating with onnxruntime's 16 threads)
# against 1.67 serial in the run before: not kept
CPU_MANY_CORES, CPU_MANY_CORES_MIN_MACS = 8, 1 << 18


def cpu_cores(target=None) -> int:
    """The threads a CPU kernel built for `target` will run on: its "num-cores" attribute (e.g. "llvm
    -mcpu=sapphirerapids -num-cores=16" for another machine), else the threads this process's pool will use."""
    cores = target.attrs.get("num-cores") if target is not None else None
    if not cores:
        from ...schedule_cpu import configure_threads

        cores = configure_threads()
    return int(cores)


def cpu_parallel_min_macs(target=None) -> int:
    """Multiply-adds from which a CPU step GEMM is split over threads, for the cores of `target` (`cpu_cores`)."""
    return CPU_MANY_CORES_MIN_MACS if cpu_cores(target) >= CPU_MANY_CORES else CPU_PARALLEL_MIN_MACS


def cpu_lanes(target=None) -> int:
    """fp32 lanes of the CPU step GEMM's accumulators: 8 (one AVX2 register; two SSE registers on a generic
    x86-64 target). Measured on a Zen 4 (AVX-512) with one thread, 2026-11-26: 8 lanes 36-99 GFLOP/s on step
    GEMMs of batch 1-64, hidden 256-1024; 16 lanes 33-94 (the wider tree of lane sums costs more)."""
    return 8


def cpu_parallel(D: int, M, rows: int, K: int, min_macs: int | None = None) -> bool:
    """Whether a CPU step GEMM can be large enough to split over threads (a symbolic M: at CPU_M_BLOCK rows;
    `cpu_thread_split_macro` then decides at run time with `cpu_parallel_at_run_time`); min_macs: the threshold
    (default CPU_PARALLEL_MIN_MACS; `cpu_parallel_min_macs` for a target)."""
    m = M if isinstance(M, int) else CPU_M_BLOCK
    return D * m * rows * K >= (min_macs or CPU_PARALLEL_MIN_MACS)


def cpu_parallel_at_run_time(D: int, M, rows: int, K: int, min_macs: int | None = None):
    """The condition a step GEMM of symbolic batch M checks every step before splitting over threads: a
    TIR expression. (Counted as 8 rows at build time, a batch-1 LSTM H256 stepped on the pool and paid its
    launch and join 100 times, each a time slice while other processes held the cores.)"""
    return M * (D * rows * K) >= (min_macs or CPU_PARALLEL_MIN_MACS)


def _split_or_serial(split, serial, D: int, M, rows: int, K: int, parallel: bool | None = None,
                     min_macs: int | None = None):
    """TVMScript macro `run(*operands)`: `split(*operands)` (work on TVM's thread pool) where a step of M x rows x K
    multiply-adds per direction splits from `min_macs` (`cpu_parallel`), else `serial(*operands)`; `parallel` forces
    one. Decided at build time for an int M and, for a symbolic M that can reach the threshold, each time the macro
    runs (`cpu_parallel_at_run_time`): at a small batch the pool's launch and join would cost more than the split
    saves."""
    splits = cpu_parallel(D, M, rows, K, min_macs) if parallel is None else parallel
    decided_at_run_time = splits and parallel is None and not isinstance(M, int)

    @T.macro
    def run(*operands):
        if decided_at_run_time:
            if cpu_parallel_at_run_time(D, M, rows, K, min_macs):
                split(*operands)
            else:
                serial(*operands)
        elif splits:
            split(*operands)
        else:
            serial(*operands)

    return run


def cpu_thread_split_macro(blocks_macro, D: int, M, rows: int, K: int, parallel: bool | None = None,
                           min_macs: int | None = None):
    """TVMScript macro `blocks(*operands)`: the work loop `blocks_macro(loop)` builds, on TVM's thread pool
    (loop T.parallel) or on this thread (T.serial), chosen by `_split_or_serial` (for a symbolic M every step)."""
    return _split_or_serial(blocks_macro(T.parallel), blocks_macro(T.serial), D, M, rows, K, parallel, min_macs)


def cpu_barrier(stage):
    """`stage` (a macro whose work is one T.parallel loop) followed by TVM's parallel barrier: a stage of
    `cpu_one_launch_loop`'s step."""
    @T.macro
    def staged(*args):
        with T.attr(0, "pragma_parallel_barrier_when_finish", 1):
            stage(*args)

    return staged


def cpu_one_launch_loop(step_on_pool, serial_loop, D: int, M, rows: int, K: int, min_macs: int | None = None):
    """T.macro loop(W, bufs, seq) of a CPU recurrence: where its step (M x rows x K multiply-adds a direction) splits
    over threads (`_split_or_serial`, decided once a call for a symbolic M) the whole time loop is ONE launch of TVM's
    thread pool, every thread running `step_on_pool(W, bufs, s, seq)` at each step (each of its stages a T.parallel
    loop followed by a barrier, `cpu_barrier`; the pool's threads take their share of each loop; codegen's
    `pragma_parallel_launch_point` / `pragma_parallel_barrier_when_finish`), else `serial_loop(W, bufs, seq)`. A
    barrier costs 0.29 us on the 2-core Zen 4 against 0.77 for a launch and join."""
    @T.macro
    def one_launch(W, bufs, seq):
        with T.attr(0, "pragma_parallel_launch_point", 1):
            for s in range(seq):            # every thread runs the loop; the work of a step is split
                step_on_pool(W, bufs, s, seq)

    return _split_or_serial(one_launch, serial_loop, D, M, rows, K, None, min_macs)


def _stored_sum(bias: bool):
    """(sum, bias_buf, d, row) -> what a CPU GEMM stores for output row `row` of direction d: the sum plus
    bias_buf[d, row] with a bias (added as the tile is stored, so the output is written once), else the sum."""
    if bias:
        return lambda value, bias_buf, d, row: value + bias_buf[d, row]
    return lambda value, bias_buf, d, row: value


def _gemm_signature(split_blocks, bias: bool):
    """The GEMM macro callers get from `split_blocks(src, W, gh, bias_buf)`: itself, called as
    `gemm(src, W, gh, bias_buf)`, with a bias; else `gemm(src, W, gh)`."""
    if bias:
        return split_blocks

    @T.macro
    def gemm(src, W, gh):
        split_blocks(src, W, gh, None)

    return gemm


def _even_m_block(M, nmb, BT: int):
    """Rows of each of the `nmb` m blocks of a CPU GEMM over M rows: M split evenly, whole batch tiles of BT each
    (100 rows: 52 + 48, not CPU_M_BLOCK's 64 + 36, which left one of 2 threads with 64% of the work: the panel
    GEMM at 100 x 256 x 1024 took 290 us (181 GFLOP/s), now 236 (222); an LSTM's input projection at hidden 128
    over 100 rows 0.166 -> 0.099 ms, H256 0.365 -> 0.314, 2-core Zen 4, 2026-11-27). An int for a static M, else
    a TIR expression (the panel GEMM binds it to a variable a work item: inlined there, its divisions were
    recomputed in the tiles' loops, and that projection at H256 took 0.47 ms)."""
    if isinstance(M, int):
        return ((M + nmb - 1) // nmb + BT - 1) // BT * BT
    blocks = T.max(nmb, 1)     # a symbolic M of 0 (the simplifier tries it) has no m block
    return ((M + blocks - 1) // blocks + BT - 1) // BT * BT


def _block_rows(MBe, M, m0):
    """Rows of the m block starting at row m0 (`_even_m_block`): rounded up to whole tiles, the blocks can cover more
    than M rows and the last ones start past M, where min(MBe, M - m0) is negative and its % BT not 0 (its tail loop
    then recomputed rows of the block before: a fused LSTM step updated their cell state twice, in place): 0 there."""
    return T.max(0, T.min(MBe, M - m0))


def cpu_gemm_macro(D: int, M, K: int, dt: str, rows: int, row_offset: int, lanes: int = 8,
                   parallel: bool | None = None, shared_src: bool = False, bias: bool = False,
                   min_macs: int | None = None):
    """TVMScript macro `gemm(src, R, gh)` for the CPU: gh[0, d, m, row_offset + r] = sum_k src[d, m, k] *
    R[d, row_offset + r, k] for m < M (an int or a TIR variable), r < rows; float32 accumulation, R in any
    float dtype (converted as loaded). shared_src: src is [M, K], the same for every direction (the input
    projection's X). bias: the macro is `gemm(src, R, gh, bias)` and adds bias[d, row_offset + r].
    The M rows go in blocks of CPU_M_BLOCK (their src stays in cache while every row block of R passes),
    each in full batch tiles of CPU_BATCH_TILE rows and then one row at a time; rows past the end of the
    last row tile are computed on a clamped row and not stored."""
    RT = min(CPU_ROW_TILE, rows)
    VL = lanes
    KV = K // lanes                                # whole vectors of k
    nrb = (rows + RT - 1) // RT
    MB = CPU_M_BLOCK
    nmb = (M + MB - 1) // MB
    MBe = _even_m_block(M, nmb, CPU_BATCH_TILE)
    f32 = lambda v: T.Cast("float32", v)  # noqa: E731
    stored = _stored_sum(bias)
    if VL not in (8, 16):
        raise TvmseqError(f"CPU step GEMM: lanes must be 8 or 16, got {VL}")

    def load_src(src, d, m, k):
        return src[m, k] if shared_src else src[d, m, k]

    def tile_macro(BT: int):
        # a one-row tile has only RT accumulator chains, too few to hide the FMA latency: KS partial sums
        # a chain (alternate k vectors), added before the lanes are
        KS = 2 if BT == 1 else 1
        KV2 = KV // KS
        K1 = KV2 * KS * VL                         # where the scalar tail starts
        E = RT * BT

        @T.macro
        def tile(src, R, gh, bias_buf, d, rb, m0):
            acc = T.alloc_buffer((E * KS * VL,), "float32", scope=CPU_TILE_SCOPE)
            red = T.alloc_buffer((E,), "float32", scope=CPU_TILE_SCOPE)
            for e in T.unroll(E * KS):
                for v in T.vectorized(VL):
                    acc[e * VL + v] = T.float32(0)
            for k0 in range(KV2):
                for ks in T.unroll(KS):
                    for i in T.unroll(RT):
                        for j in T.unroll(BT):
                            for v in T.vectorized(VL):
                                acc[((i * BT + j) * KS + ks) * VL + v] = acc[((i * BT + j) * KS + ks) * VL + v] + f32(
                                    R[d, row_offset + T.min(rb * RT + i, rows - 1), (k0 * KS + ks) * VL + v]) * f32(
                                    load_src(src, d, m0 + j, (k0 * KS + ks) * VL + v))
            # partial sums, then lanes added pairwise as vectors (halves, quarters), the last two as scalars
            for e in T.unroll(E):
                if KS == 2:
                    for v in T.vectorized(VL):
                        acc[e * KS * VL + v] = acc[e * KS * VL + v] + acc[e * KS * VL + VL + v]
                if VL >= 16:
                    for v in T.vectorized(8):
                        acc[e * KS * VL + v] = acc[e * KS * VL + v] + acc[e * KS * VL + 8 + v]
                for v in T.vectorized(4):
                    acc[e * KS * VL + v] = acc[e * KS * VL + v] + acc[e * KS * VL + 4 + v]
                for v in T.vectorized(2):
                    acc[e * KS * VL + v] = acc[e * KS * VL + v] + acc[e * KS * VL + 2 + v]
                red[e] = acc[e * KS * VL] + acc[e * KS * VL + 1]
            for kt in range(K - K1):
                for i in T.unroll(RT):
                    for j in T.unroll(BT):
                        red[i * BT + j] = red[i * BT + j] + f32(
                            R[d, row_offset + T.min(rb * RT + i, rows - 1), K1 + kt]) * f32(
                            load_src(src, d, m0 + j, K1 + kt))
            for i in T.unroll(RT):
                if rb * RT + i < rows:
                    for j in T.unroll(BT):
                        gh[0, d, m0 + j, row_offset + rb * RT + i] = stored(
                            red[i * BT + j], bias_buf, d, row_offset + rb * RT + i)

        return tile

    full_tile, one_row = tile_macro(CPU_BATCH_TILE), tile_macro(1)
    BT = CPU_BATCH_TILE

    def blocks_macro(loop):
        # MBe inlined, not bound to a variable as the panel GEMM's: bound (even inside the loop), a split step's
        # tiles came from TVM's workspace pool again (CPU_TILE_SCOPE); inlined it cost nothing measurable here
        # (the projection at hidden 512 over 100 rows 1.26 -> 1.03-1.05 ms with the even blocks)
        @T.macro
        def blocks(src, R, gh, bias_buf):
            for w in loop(nmb * D * nrb):
                # m block outermost: a thread's share of the work is a range of (m block, direction, row block)
                mb = T.meta_var(w // (D * nrb))
                d = T.meta_var(w // nrb % D)
                rb = T.meta_var(w % nrb)
                m0 = T.meta_var(mb * MBe)
                mlen = T.meta_var(_block_rows(MBe, M, m0))
                for mt in range(mlen // BT):
                    full_tile(src, R, gh, bias_buf, d, rb, m0 + mt * BT)
                for mr in range(mlen % BT):
                    one_row(src, R, gh, bias_buf, d, rb, m0 + (mlen // BT) * BT + mr)

        return blocks

    return _gemm_signature(cpu_thread_split_macro(blocks_macro, D, M, rows, K, parallel, min_macs), bias)


def cpu_gemm_func(D: int, M, N: int, K: int, dtype: str = "float32", lanes: int = 8,
                  parallel: bool | None = None, name: str = "cpu_step_gemm"):
    """The CPU step GEMM alone as a PrimFunc (tests, timing): h float32 [D, M, K], R dtype [D, N, K],
    gh float32 [1, D, M, N]; M an int or None (any batch)."""
    from tvm import tirx

    Mv = tirx.Var("batch", "int32") if M is None else M
    gemm = cpu_gemm_macro(D, Mv, K, dtype, N, 0, lanes, parallel)

    @T.prim_func
    def step_gemm(h: T.handle, r_w: T.handle, g: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        Hs = T.match_buffer(h, (D, Mv, K), "float32")
        R = T.match_buffer(r_w, (D, N, K), dtype)
        GH = T.match_buffer(g, (1, D, Mv, N), "float32")
        gemm(Hs, R, GH)

    return step_gemm.with_attr("tirx.is_scheduled", True)


# ---------------------------------------------------------------------------------------------------
# The CPU panel GEMM: outputs in SIMD lanes, R packed once into panels (MLAS's GEMV layout)
# ---------------------------------------------------------------------------------------------------
# R^T in panels of CPU_PANEL consecutive rows: Rp[d, p, k, c] = R[d, p * P + c, k] (zero past the last row),
# so step k of a panel is one contiguous P-float line. Each k broadcasts src[b, k] and adds it times that
# line into P / lanes vector accumulators per batch row: no lane sums at the end, one stream of R per panel.
CPU_PANEL = 64             # 4 AVX-512 vectors: a 4-row batch tile holds 16 accumulators, loads 4 + 4 a k
CPU_PANEL_LANES = 16
CPU_PANEL_BATCH_TILE = 4
# on AVX2 (16 registers of 8 lanes): 4 vectors of 8, a 2-row batch tile: 8 accumulators, 4 loads and a broadcast.
# The AVX-512 geometry there spilled (its 16 accumulators are 32 AVX2 registers): LSTM hidden 512, batch 8, 100
# steps 43.7 ms on the k-in-lanes GEMM, 80.9 on those panels (2-core Zen 3, 2026-11-28)
CPU_PANEL_AVX2 = 32
CPU_PANEL_BATCH_TILE_AVX2 = 2


def panel_lanes(panel: int) -> int:
    """fp32 lanes of a panel's vectors: a panel is 4 vectors (64 rows: AVX-512, 32: AVX2)."""
    return panel // 4


def panel_batch_tile(panel: int) -> int:
    """Batch rows of a panel GEMM's register tile: 4 x 4 vectors of 16 lanes in AVX-512's 32 registers, 2 x 4 of 8
    in AVX2's 16."""
    return CPU_PANEL_BATCH_TILE if panel_lanes(panel) >= CPU_PANEL_LANES else CPU_PANEL_BATCH_TILE_AVX2


def cpu_panel_size(target) -> int:
    """Rows of a panel of the packed CPU GEMM on `target`: CPU_PANEL with AVX-512, CPU_PANEL_AVX2 with AVX2 and FMA,
    0 elsewhere (no panels: the k-in-lanes GEMM on R as stored)."""
    if target is None:
        return 0
    try:
        from tvm.target import codegen

        if codegen.target_has_features("avx512f", target):
            return CPU_PANEL
        if codegen.target_has_features("avx2", target) and codegen.target_has_features("fma", target):
            return CPU_PANEL_AVX2
    except Exception:  # noqa: BLE001 - a TVM without LLVM: nothing is compiled anyway
        pass
    return 0

# KB of k a packing block copies
CPU_PACK_KB = 16
# time steps x batch rows from which a recurrence packs R before its time loop (a shorter call keeps the
# k-in-lanes GEMM on R as stored). Measured on the 2-core Zen 4, one thread, GRU rows 3H (us): packing
# H128/256/512/1024 took 14/58/238/2360 (H1024: R and its copy past the L3 share); the panel GEMM saved
# per step at batch 8 2.5/5/18/110, at batch 1 0/0.4/4.5/0-20, so packing pays from ~24 steps at batch 8
# and ~150-190 at batch 1 (both sides scale with R's size: one threshold in rows x steps)
CPU_PACK_MIN_ROW_STEPS = 192
# panels of R's rows below which nothing is packed: one panel would mostly compute lanes of zeros
CPU_PACK_MIN_PANELS = 2
# multiply-adds from which a panel GEMM step is split over threads (with fewer than CPU_MANY_CORES cores): its
# steps are shorter than the k-in-lanes GEMM's, and split pays earlier. Measured on the 2-core Zen 4 at load ~1,
# recurrences of 100 steps split / serial: GRU and LSTM hidden 256 batch 8 (1.6M, 2.1M) 1.57-1.59x faster;
# hidden 128 batch 8 (0.4M, 0.5M) 0.79x, hidden 512 batch 1 (0.8M, 1.0M) 0.80-0.87x. Since CPU_PARALLEL_MIN_MACS
# went below it (2026-11-27) the lower of the two applies: panel GEMM alone, 2 threads / 1 (us): batch 8 x 384 x
# 128 4.5 / 7.0, 8 x 768 x 256 15.0 / 27.6; recurrences GRU / LSTM hidden 128 batch 8 0.82 / 0.83 of the time
# serial steps took, RNN hidden 256 batch 8 0.86
CPU_PANEL_PARALLEL_MIN_MACS = 5 << 18


def cpu_panel_count(rows: int, panel: int = CPU_PANEL) -> int:
    """Panels of `panel` rows that hold `rows` rows."""
    return (rows + panel - 1) // panel


# weights (floats) from which `cpu_pack_macro` splits its panels over threads. It ran on one thread: on the
# 2-core Zen 4 (2026-11-27, R [G, K] -> panels, us, one -> two threads) 1024 x 256 78 -> 38, 2048 x 512 324 ->
# 159, 4096 x 1024 4658 -> 1879 (16 MB at 3.6 GB/s); an LSTM node at hidden 1024, batch 8, 100 steps packs W and R
# once a call each: 75.0 -> 70.4 ms (the two builds alternated in one process). 512 x 128 stays serial (18 us).
CPU_PACK_PARALLEL_MIN = 1 << 18


def cpu_pack_macro(D: int, G: int, K: int, panel: int = CPU_PANEL, interleave: int | None = None):
    """TVMScript macro `pack(R, Rp)`: Rp float32 [D, nP, K, panel] from R [D, G, K] (any float dtype), rows
    past G as zeros; nP = ceil(G / panel). With `interleave` U, R's rows are panel // U gates of G / gates units
    each and panel p holds units p * U .. p * U + U - 1 of every gate (U lanes a gate; nP = ceil(units / U)):
    a panel's sums are then all gates of U units, what a fused gate write-back needs (`cpu_fused_time_loop_macro`).
    Row by row in blocks of CPU_PACK_KB k: one vector read of the row, its elements stored down a
    CPU_PACK_KB-line (4 KB) block of the panel that stays in L1. (k-major order read a cache line from each of
    `panel` rows K floats apart: 4 KB aliasing in L1 at K 1024, 3x slower.)"""
    P, KB = panel, CPU_PACK_KB
    nP = Panels(interleave, P).count(G)
    loop = T.parallel if D * G * K >= CPU_PACK_PARALLEL_MIN and nP * D > 1 else T.serial

    if interleave is None:
        def value(R, d, p, c, k):
            return T.if_then_else(p * P + c < G, T.Cast("float32", R[d, T.min(p * P + c, G - 1), k]),
                                  T.float32(0))
    else:
        U = interleave
        units = G // (P // U)

        def value(R, d, p, c, k):
            unit = p * U + c % U
            return T.if_then_else(unit < units, T.Cast("float32", R[d, (c // U) * units + T.min(unit, units - 1), k]),
                                  T.float32(0))

    @T.macro
    def pack(R, Rp):
        for w in loop(D * nP):
            for kb in T.serial(K // KB):
                for c in T.serial(P):
                    for kk in T.vectorized(KB):
                        Rp[w // nP, w % nP, kb * KB + kk, c] = value(R, w // nP, w % nP, c, kb * KB + kk)
            for c in T.serial(P):
                for kt in T.serial(K % KB):
                    Rp[w // nP, w % nP, K - K % KB + kt, c] = value(R, w // nP, w % nP, c, K - K % KB + kt)

    return pack


# bytes from which TVM allocates a buffer from its workspace pool instead of the stack (runtime::kMaxStackAlloca:
# a "global" buffer of fewer bytes is a stack array). A register tile's accumulators must stay under it: LLVM keeps
# a stack array in registers, but a pool buffer only where it can prove nothing else aliases it, which it could
# not in a module that also holds a shape function (TVM then inlines the kernel into its packed wrapper and the
# `noalias` of its arguments is gone): a 4-row panel tile (1024 bytes) kept its sums in memory there, a load and a
# store around every multiply-add (a GRU's input projection at hidden 400 over 37 rows: 0.17 ms alone, 0.41 ms in
# the model; with halves of 512 bytes 0.17 in both)
CPU_STACK_BYTES = 1024


def _tile_halves(BT: int, NV: int, VL: int, KS: int) -> tuple:
    """(rows, rows) of a BT-row register tile held in two accumulator buffers, each under CPU_STACK_BYTES, or (BT, 0)
    when one buffer is under it."""
    row_bytes = KS * NV * VL * 4
    if BT * row_bytes < CPU_STACK_BYTES:
        return BT, 0
    first = (BT + 1) // 2
    if first * row_bytes >= CPU_STACK_BYTES:
        raise TvmseqError(f"CPU register tile of {BT} rows x {NV * VL} floats does not fit two stack buffers")
    return first, BT - first


def _panel_accumulate_macro(K: int, VL: int, BT: int, NV: int):
    """(macro `accumulate(acc, acc_b, src, Rp, d, p, m0)`, (floats of acc, floats of acc_b), (RA, RB)): the sums
    of one register tile of the panel GEMM, BT batch rows (src rows m0 ..) x the first NV vectors of VL rows of panel
    p: rows j < RA (`_tile_halves`) in acc[(j * NV + c) * VL + v], rows RA + j in acc_b[(j * NV + c) * VL + v]
    (CPU_TILE_SCOPE buffers the caller allocates; with RB 0, acc_b is a one-float placeholder never touched)."""
    # a 1-row tile has only NV accumulator chains, too few to cover the FMA latency: KS sets of them (k
    # alternates), added at the end
    KS = 2 if BT * NV < 8 else 1
    K1 = (K // KS) * KS
    RA, RB = _tile_halves(BT, NV, VL, KS)
    EA, EB = RA * NV * VL, RB * NV * VL            # floats of one accumulator set in acc, acc_b

    @T.macro
    def fma(acc, E, rows, src, Rp, d, p, m0, k, ks):
        for j in T.unroll(rows):
            for c in T.unroll(NV):
                for v in T.vectorized(VL):
                    acc[ks * E + (j * NV + c) * VL + v] = acc[ks * E + (j * NV + c) * VL + v] + Rp[
                        d, p, k, c * VL + v] * src[d, m0 + j, k]

    @T.macro
    def accumulate(acc, acc_b, src, Rp, d, p, m0):
        for e in T.unroll(KS * RA * NV):
            for v in T.vectorized(VL):
                acc[e * VL + v] = T.float32(0)
        if RB > 0:
            for e in T.unroll(RB * NV):
                for v in T.vectorized(VL):
                    acc_b[e * VL + v] = T.float32(0)
        for k0 in range(K // KS):
            for ks in T.unroll(KS):
                fma(acc, EA, RA, src, Rp, d, p, m0, k0 * KS + ks, ks)
                if RB > 0:
                    fma(acc_b, EB, RB, src, Rp, d, p, m0 + RA, k0 * KS + ks, ks)
        for kt in range(K - K1):
            fma(acc, EA, RA, src, Rp, d, p, m0, K1 + kt, 0)
            if RB > 0:
                fma(acc_b, EB, RB, src, Rp, d, p, m0 + RA, K1 + kt, 0)
        if KS == 2:
            for e in T.unroll(RA * NV):
                for v in T.vectorized(VL):
                    acc[e * VL + v] = acc[e * VL + v] + acc[EA + e * VL + v]

    return accumulate, (KS * EA, max(EB, 1)), (RA, RB)


def _panel_tile_macro(K: int, rows: int, row_offset: int, P: int, VL: int, BT: int, NV: int, bias: bool):
    """One register tile of the panel GEMM: BT batch rows x the first NV vectors of VL rows of panel p (all
    P / VL of them but in a last panel that needs fewer), plus the bias as it is stored (`bias`)."""
    accumulate, (size, size_b), (RA, RB) = _panel_accumulate_macro(K, VL, BT, NV)
    stored = _stored_sum(bias)

    @T.macro
    def store(acc, gh, bias_buf, d, p, m0, n_rows):
        # a panel inside [row_offset, row_offset + rows) stores whole vectors; an edge panel row by row
        if p * P >= row_offset and p * P + NV * VL <= row_offset + rows:
            for j in T.unroll(n_rows):
                for c in T.unroll(NV):
                    for v in T.vectorized(VL):
                        gh[0, d, m0 + j, p * P + c * VL + v] = stored(
                            acc[(j * NV + c) * VL + v], bias_buf, d, p * P + c * VL + v)
        else:
            for j in T.unroll(n_rows):
                for c in T.serial(NV * VL):
                    if p * P + c >= row_offset and p * P + c < row_offset + rows:
                        gh[0, d, m0 + j, p * P + c] = stored(acc[j * NV * VL + c], bias_buf, d, p * P + c)

    @T.macro
    def tile(src, Rp, gh, bias_buf, d, p, m0):
        acc = T.alloc_buffer((size,), "float32", scope=CPU_TILE_SCOPE)
        acc_b = T.alloc_buffer((size_b,), "float32", scope=CPU_TILE_SCOPE)
        accumulate(acc, acc_b, src, Rp, d, p, m0)
        store(acc, gh, bias_buf, d, p, m0, RA)
        if RB > 0:
            store(acc_b, gh, bias_buf, d, p, m0 + RA, RB)

    return tile


def cpu_panel_gemm_macro(D: int, M, K: int, rows: int, row_offset: int, panel: int = CPU_PANEL,
                         parallel: bool | None = None, min_macs: int | None = None, bias: bool = False):
    """TVMScript macro `gemm(src, Rp, gh)`: gh[0, d, m, row_offset + r] = sum_k src[d, m, k] *
    R[d, row_offset + r, k] for m < M (an int or a TIR variable), r < rows, with Rp = R packed by
    `cpu_pack_macro` (panels of all of R's rows: this GEMM runs the panels that overlap its rows and stores
    only its rows). bias: the macro is `gemm(src, Rp, gh, bias)` and adds bias[d, row_offset + r] as it
    stores. Blocks, batch tiles and the thread split as `cpu_gemm_macro`'s."""
    P, VL, BT, MB = panel, panel_lanes(panel), panel_batch_tile(panel), CPU_M_BLOCK
    if P % 4 or VL not in (8, CPU_PANEL_LANES):
        raise TvmseqError(f"CPU panel GEMM: panel {P} is not a multiple of 4 vectors of 8 or 16 lanes")
    p0 = row_offset // P
    npn = cpu_panel_count(row_offset + rows, P) - p0
    nmb = (M + MB - 1) // MB
    MBe = _even_m_block(M, nmb, BT)
    # the last panel computes only the vectors holding rows of this GEMM (130 rows: 3 panels, the last
    # one vector, not 4: 1.0 -> 1.3x faster than the k-in-lanes GEMM at batch 8 on the Zen 4)
    p_last = (row_offset + rows - 1) // P
    nv_last = (row_offset + rows - p_last * P + VL - 1) // VL
    full_tile, one_row = (_panel_tile_macro(K, rows, row_offset, P, VL, bt, P // VL, bias) for bt in (BT, 1))
    last_tile, last_row = (_panel_tile_macro(K, rows, row_offset, P, VL, bt, nv_last, bias) for bt in (BT, 1))

    def tiles_of(tile, row):
        """A panel's batch rows: whole tiles of BT rows, then the rest one row at a time."""
        @T.macro
        def tiles(src, Rp, gh, bias_buf, d, p, m0, mlen):
            for mt in range(mlen // BT):
                tile(src, Rp, gh, bias_buf, d, p, m0 + mt * BT)
            for mr in range(mlen % BT):
                row(src, Rp, gh, bias_buf, d, p, m0 + (mlen // BT) * BT + mr)
        return tiles

    panel_tiles, last_panel_tiles = tiles_of(full_tile, one_row), tiles_of(last_tile, last_row)

    def blocks_macro(loop):
        @T.macro
        def blocks(src, Rp, gh, bias_buf):
            for w in loop(nmb * D * npn):
                mbe = T.bind(MBe)       # bound once a work item (`_even_m_block`, cpu_gemm_macro), a register
                # m block outermost: a thread's share is a range of (m block, direction, panel)
                mb = T.meta_var(w // (D * npn))
                d = T.meta_var(w // npn % D)
                p = T.meta_var(p0 + w % npn)
                m0 = T.meta_var(mb * mbe)
                mlen = T.meta_var(_block_rows(mbe, M, m0))
                if nv_last < P // VL and p == p_last:
                    last_panel_tiles(src, Rp, gh, bias_buf, d, p, m0, mlen)
                else:
                    panel_tiles(src, Rp, gh, bias_buf, d, p, m0, mlen)

        return blocks

    return _gemm_signature(cpu_thread_split_macro(blocks_macro, D, M, rows, K, parallel, min_macs), bias)


# units of one gate in a panel of the fused step (`cpu_fused_time_loop_macro`): one vector of lanes
CPU_FUSED_UNITS = CPU_PANEL_LANES


# work items (m block x direction x panel) per thread the fused step aims for: with 16 threads an LSTM at hidden
# 128, batch 64 had 8 items (one 64-row m block x 8 panels), half the threads idle; m blocks of 16 rows (32 items)
# took its recurrence from 3.0-4.1 to 1.9-2.0 ms (16-core Xeon, 2026-11-27; m blocks of 32: 2.3)
CPU_FUSED_ITEMS_PER_THREAD = 2


def _fused_m_blocks(M, D: int, nP: int, threads: int):
    """m blocks of the fused step: CPU_M_BLOCK rows each, or more (down to a batch tile each) where that leaves
    fewer than CPU_FUSED_ITEMS_PER_THREAD work items a thread. An int for a static M, else a TIR expression."""
    BT, MB = CPU_PANEL_BATCH_TILE, CPU_M_BLOCK
    wanted = (CPU_FUSED_ITEMS_PER_THREAD * threads + D * nP - 1) // (D * nP)
    if isinstance(M, int):
        return max((M + MB - 1) // MB, min(wanted, (M + BT - 1) // BT))
    return T.max((M + MB - 1) // MB, T.min(wanted, (M + BT - 1) // BT))


def cpu_fused_time_loop_macro(D: int, M, K: int, gates: int, write_back, min_macs: int | None = None,
                              threads: int = 1, prefetch_next=None):
    """TVMScript macro `loop(Rp, (h, h_next, ops), seq)`: the time loop of a cell whose `gates` x K recurrent
    weights are packed with `cpu_pack_macro(..., interleave=CPU_FUSED_UNITS)` (a panel: CPU_FUSED_UNITS units of
    every gate). At each step s, each work item (m block, direction, panel) computes the panel GEMM's register tiles
    on the state src [D, M, K] and hands each tile straight to the cell, `write_back(BT)` -> macro
    `wb(acc, ops, src, dst, s, d, p, m0)` with the gate sums of batch rows m0 .. m0 + BT - 1 and units p * U .. in
    acc[(j * gates + g) * U + v]; the cell writes the new state to dst. src / dst are h / h_next at even steps and
    h_next / h at odd ones (after the loop the last state is in h_next when seq is odd).
    The gate math runs on the thread that computed its sums (the per-step path launches a GEMM and a gate loop,
    and writes and reads back gh). Where the step is large enough to split (`min_macs`) the whole loop is ONE
    launch of TVM's thread pool with a barrier a step (`cpu_one_launch_loop`). m blocks smaller than CPU_M_BLOCK
    where `threads` would otherwise idle (`_fused_m_blocks`). prefetch_next: macro `prefetch(ops, s, seq, d, m0, mlen)`
    that prefetches what step s + 1 of rows m0 .. m0 + mlen - 1 reads (the split by batch rows calls it before step s)."""
    U = CPU_FUSED_UNITS
    BT = CPU_PANEL_BATCH_TILE
    units = K
    nP = cpu_panel_count(units, U)
    nmb = _fused_m_blocks(M, D, nP, threads)
    MBe = _even_m_block(M, nmb, BT)
    acc_tile, (tile_size, tile_size_b), (RA, RB) = _panel_accumulate_macro(K, U, BT, gates)
    acc_row, (row_size, _), _ = _panel_accumulate_macro(K, U, 1, gates)
    wb_tile, wb_tile_b, wb_row = write_back(RA), write_back(max(RB, 1)), write_back(1)

    @T.macro
    def block(src, dst, Rp, ops, s, d, p, m0, mlen):
        # step s of panel p for batch rows m0 .. m0 + mlen - 1: whole batch tiles, then single rows
        for mt in range(mlen // BT):
            acc = T.alloc_buffer((tile_size,), "float32", scope=CPU_TILE_SCOPE)
            acc_b = T.alloc_buffer((tile_size_b,), "float32", scope=CPU_TILE_SCOPE)
            acc_tile(acc, acc_b, src, Rp, d, p, m0 + mt * BT)
            wb_tile(acc, ops, src, dst, s, d, p, m0 + mt * BT)
            if RB > 0:
                wb_tile_b(acc_b, ops, src, dst, s, d, p, m0 + mt * BT + RA)
        for mr in range(mlen % BT):
            acc1 = T.alloc_buffer((row_size,), "float32", scope=CPU_TILE_SCOPE)
            acc_row(acc1, acc1, src, Rp, d, p, m0 + (mlen // BT) * BT + mr)
            wb_row(acc1, ops, src, dst, s, d, p, m0 + (mlen // BT) * BT + mr)

    def blocks_macro(loop):
        @T.macro
        def blocks(src, dst, Rp, ops, s):
            for w in loop(nmb * D * nP):
                mbe = T.bind(MBe)       # bound once a work item, as the panel GEMM's
                mb = T.meta_var(w // (D * nP))
                d = T.meta_var(w // nP % D)
                p = T.meta_var(w % nP)
                m0 = T.meta_var(mb * mbe)
                mlen = T.meta_var(_block_rows(mbe, M, m0))
                block(src, dst, Rp, ops, s, d, p, m0, mlen)

        return blocks

    def step_of(blocks):
        """step s from h into h_next at even steps, back at odd ones (bufs = (h, h_next, ops))"""
        @T.macro
        def step(Rp, bufs, s, seq):
            h, h_next, ops = T.meta_var(bufs)
            if s % 2 == 0:
                blocks(h, h_next, Rp, ops, s)
            else:
                blocks(h_next, h, Rp, ops, s)

        return step

    serial_step = step_of(blocks_macro(T.serial))

    @T.macro
    def on_this_thread(Rp, bufs, seq):
        for s in range(seq):
            serial_step(Rp, bufs, s, seq)

    by_panels = cpu_one_launch_loop(cpu_barrier(step_of(blocks_macro(T.parallel))), on_this_thread, D, M,
                                    gates * units, K, min_macs)
    if threads < CPU_MANY_CORES or 4 * gates * units * K > CPU_ROW_SPLIT_MAX_R_BYTES:
        return by_panels
    by_rows = _fused_rows_loop(D, M, nP, threads, block, prefetch_next)

    @T.macro
    def loop(Rp, bufs, seq):
        if M * D >= BT * threads:
            by_rows(Rp, bufs, seq)
        else:
            by_panels(Rp, bufs, seq)

    return loop


# R's bytes up to which a many-core fused step splits its batch rows instead of R's panels (`_fused_rows_loop`):
# each thread then reads all of R every step, which must stay in its core's L2 (2 MB on the 16-core Xeon)
CPU_ROW_SPLIT_MAX_R_BYTES = 1 << 20


def _fused_rows_loop(D: int, M, nP: int, threads: int, block, prefetch_next=None):
    """The fused time loop (`cpu_fused_time_loop_macro`) split by batch rows: one launch of the thread pool, each work
    item (a block of whole batch tiles, a direction) runs every step over all panels for its own rows (`block`: one
    panel's tiles of a step), so no step waits for another thread (the rows of an LSTM are independent). The same
    tiles, in the same order of k, as the split by panels: bit-identical outputs. Where every thread gets a tile and
    R stays in its L2; with 16 threads at batch 64 the split by panels spent ~40 us a step against ~23 of
    multiply-adds, its barrier and the state's hand-over between cores. Before each step a thread prefetches what
    its rows read at the next one (`prefetch_next`: the LSTM's gate_i rows, written by the projection on other
    cores)."""
    BT = CPU_PANEL_BATCH_TILE
    per_direction = max(1, threads // D)
    nmb = per_direction if isinstance(M, int) else T.max(1, T.min(per_direction, M // BT))
    MBe = _even_m_block(M, nmb, BT)

    @T.macro
    def rows_step(src, dst, Rp, ops, s, d, m0, mlen):
        for p in range(nP):
            block(src, dst, Rp, ops, s, d, p, m0, mlen)

    @T.macro
    def loop(Rp, bufs, seq):
        h, h_next, ops = T.meta_var(bufs)
        for w in T.parallel(nmb * D):
            mbe = T.bind(MBe)
            m0 = T.meta_var(w // D * mbe)
            d = T.meta_var(w % D)
            mlen = T.meta_var(_block_rows(mbe, M, m0))
            for s in range(seq):
                if prefetch_next is not None:
                    prefetch_next(ops, s, seq, d, m0, mlen)
                if s % 2 == 0:
                    rows_step(h, h_next, Rp, ops, s, d, m0, mlen)
                else:
                    rows_step(h_next, h, Rp, ops, s, d, m0, mlen)

    return loop


def cpu_panel_gemm_func(D: int, M, N: int, K: int, panel: int = CPU_PANEL, parallel: bool | None = None,
                        name: str = "cpu_panel_gemm", row_offset: int = 0, rows: int | None = None):
    """The panel GEMM alone as a PrimFunc (tests, timing): h float32 [D, M, K], Rp float32 [D, nP, K, panel]
    (`pack_numpy` of R [D, N, K]), gh float32 [1, D, M, N], columns row_offset .. row_offset + rows written
    (default all N); M an int or None (any batch)."""
    from tvm import tirx

    Mv = tirx.Var("batch", "int32") if M is None else M
    nP = cpu_panel_count(N, panel)
    gemm = cpu_panel_gemm_macro(D, Mv, K, N - row_offset if rows is None else rows, row_offset, panel, parallel)

    @T.prim_func
    def panel_gemm(h: T.handle, r_p: T.handle, g: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        Hs = T.match_buffer(h, (D, Mv, K), "float32")
        Rp = T.match_buffer(r_p, (D, nP, K, panel), "float32")
        GH = T.match_buffer(g, (1, D, Mv, N), "float32")
        gemm(Hs, Rp, GH)

    return panel_gemm.with_attr("tirx.is_scheduled", True)


def cpu_pack_func(D: int, G: int, K: int, dtype: str = "float32", panel: int = CPU_PANEL,
                  name: str = "cpu_pack", interleave: int | None = None):
    """`cpu_pack_macro` alone as a PrimFunc (tests, timing): R dtype [D, G, K] -> Rp float32 [D, nP, K, panel]."""
    nP = Panels(interleave, panel).count(G)
    pack = cpu_pack_macro(D, G, K, panel, interleave)

    @T.prim_func
    def pack_func(r: T.handle, r_p: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        R = T.match_buffer(r, (D, G, K), dtype)
        Rp = T.match_buffer(r_p, (D, nP, K, panel), "float32")
        pack(R, Rp)

    return pack_func.with_attr("tirx.is_scheduled", True)


def pack_numpy(R, panel: int = CPU_PANEL, interleave: int | None = None):
    """numpy `cpu_pack_macro`: R [D, G, K] -> float32 [D, nP, K, panel], nP = ceil(G / panel); with `interleave` U
    (R's rows: panel // U gates of G // (panel // U) units each) panel p holds units p * U .. p * U + U - 1 of
    every gate, nP = ceil(units / U)."""
    import numpy as np

    D, G, K = R.shape
    if interleave is None:
        nP = cpu_panel_count(G, panel)
        padded = np.zeros((D, nP * panel, K), np.float32)
        padded[:, :G] = R
        return np.ascontiguousarray(padded.reshape(D, nP, panel, K).transpose(0, 1, 3, 2))
    gates = panel // interleave
    units = G // gates
    nP = cpu_panel_count(units, interleave)
    padded = np.zeros((D, gates, nP * interleave, K), np.float32)
    padded[:, :, :units] = R.reshape(D, gates, units, K)
    # [D, gate, p, u, K] -> [D, p, K, gate, u]: column gate * U + u of panel p is unit p * U + u of that gate
    by_panel = padded.reshape(D, gates, nP, interleave, K).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(by_panel.reshape(D, nP, K, panel))


@dataclass(frozen=True)
class Panels:
    """A weight as the CPU panel GEMM reads it (`cpu_pack_macro`'s layout, `interleave` as there): what a
    recurrence or projection kernel takes in place of R [D, G, K] when the importer packed a constant R once
    (`pack`), instead of the kernel packing it in every call."""

    interleave: int | None = None
    panel: int = CPU_PANEL

    def count(self, G: int) -> int:
        """Panels that hold G rows."""
        if self.interleave is None:
            return cpu_panel_count(G, self.panel)
        return cpu_panel_count(G // (self.panel // self.interleave), self.interleave)

    def shape(self, D: int, G: int, K: int) -> tuple:
        return (D, self.count(G), K, self.panel)

    def pack(self, R):
        """R [D, G, K] (numpy, any float dtype) -> float32 panels of `shape(D, G, K)`."""
        return pack_numpy(R, self.panel, self.interleave)


def cpu_pack_worthwhile(G: int, target=None) -> bool:
    """Whether a recurrence whose R has G rows gets the panel GEMM (when its call is long enough:
    `cpu_pack_at_run_time`) on `target`: an x86 CPU with AVX-512 or AVX2 (`cpu_panel_size`), R of
    CPU_PACK_MIN_PANELS panels or more."""
    panel = cpu_panel_size(target)
    return panel > 0 and G >= CPU_PACK_MIN_PANELS * panel


def cpu_pack_at_run_time(seq, M):
    """The condition (a TIR expression of the time steps and batch rows of a call) under which a recurrence
    packs R and steps with the panel GEMM: packing costs about one pass over R, paid back per step."""
    return seq * M >= CPU_PACK_MIN_ROW_STEPS


def cpu_step_gemm_macro(D: int, M, K: int, dt: str, rows: int, row_offset: int, panel: int, lanes: int = 8,
                        min_macs: int | None = None, parallel: bool | None = None):
    """TVMScript macro `gemm(src, weights, gh)`, weights = (R, Rp, packed): the panel GEMM on Rp (R packed
    by `cpu_pack_macro`) where `packed` (a Python bool: the caller's time loop comes in a packed and an
    unpacked copy) is True, else `cpu_gemm_macro`'s on R as stored. Both compute gh[0, d, m, row_offset + r]
    for r < rows. The panel GEMM splits over threads from CPU_PANEL_PARALLEL_MIN_MACS (or `min_macs` if lower);
    `parallel` forces both GEMMs' choice (`cpu_thread_split_macro`)."""
    lanes_gemm = cpu_gemm_macro(D, M, K, dt, rows, row_offset, lanes, parallel=parallel, min_macs=min_macs)
    panel_min = min(min_macs or CPU_PARALLEL_MIN_MACS, CPU_PANEL_PARALLEL_MIN_MACS)
    panel_gemm = cpu_panel_gemm_macro(D, M, K, rows, row_offset, panel, parallel=parallel, min_macs=panel_min)

    @T.macro
    def gemm(src, weights, gh):
        R, Rp, packed = T.meta_var(weights)
        if packed:
            panel_gemm(src, Rp, gh)
        else:
            lanes_gemm(src, R, gh)

    return gemm
