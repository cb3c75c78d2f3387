"""Persistent GRU/RNN with a staged state, for large batch: all time steps in ONE kernel, each block's slice
of R on chip, the whole state h_s staged into shared memory every step. float16: the product on tensor cores
(mma.sync m16n8k16, fp16 x fp16 -> fp32 accumulation, R as B fragments in registers); float32: the same
kernel with the product on FMA units (R slice in shared memory; tensor cores would round to TF32).

Why another persistent kernel. The SIMT engine (`engine`) keeps R in registers and hands the state
over word by word (LL flags), one batch column per accumulator: at batch 64 its chunks and hand-offs cost
more than the per-step path's GEMM, which is what ran there (fp16 H1024 B64 ~23 us a step, cuDNN ~20).
Here the state moves as one 16-byte-copy block per warp and the product is a small GEMM per block.

Interface: that of `engine.persistent_gru_func` (and of the per-step `gru.recurrence_func`):
  gate_i f32 [D, T, B, NG*H] (X W^T + folded biases), R [D, NG*H, H], rb_h f32 [D, H],
  seq_lens i32 [B], h0 f32 [D, B, H]  ->  Y [T, D, B, H], Y_h [D, B, H]   (R, Y, Y_h in the model dtype).
GRU with linear_before_reset=1 (what PyTorch exports) and RNN (NG = 1); lbr=0 needs the r gate of
every unit before the h-gate product (a second hand-off per step) and stays on the other paths. LSTM (NG = 4,
cell 'lstm'): the interface of `engine.persistent_lstm_func` (P [D, 3H] and c0 in place of rb_h, Y_c out), the
cell state kept in float32 registers beside h by the thread that finishes the item (see `persistent_mma_func`).

Work split. Direction d runs on blocks [d*G*BS, (d+1)*G*BS); block (g, q) owns UB hidden units j in
[g*UB, (g+1)*UB) (the NG*UB rows of R of their gates, so the gate math is local) and every BS-th chunk of
MC batch rows from chunk q (`batch_split`: two blocks an SM when BS > 1). Its NW warps split k: warp w holds
R[rows, w*KW : (w+1)*KW]. A step, per chunk:
  1. each warp copies its k-slice of the state h_s [MC, KW] from global memory to its own region of
     shared memory (cp.async.cg: 16 B, through L2, never a stale L1 line), in two commit groups (k halves;
     `pipeline`: the next chunk's copy is in flight too);
  2. the product over the warp's k-slice (fp16: ldmatrix A fragments x register B fragments; fp32: 16-byte
     state and R reads, 4 FMAs a read): partial sums [MC, NG*UB] per warp; the first half's product
     overlaps the second half's copy;
  3. partials to shared memory, __syncthreads, each thread sums the NW partials of its (row, unit)
     items, applies the gates (state kept in float32 in registers), writes Y and publishes h_{s+1} to the
     other half of a double buffer in global memory;
then a grid barrier (cooperative launch: all blocks resident) ends the step (`flags`: per-block ready
flags instead, measured slower; `cluster_sync`: a cluster barrier, when one thread-block cluster holds a batch
group's blocks; `dsmem`: no barrier at all, the state sent block to block inside the cluster, see MmaConfig).
fp16: the state enters the product rounded to fp16 (the fp16 GEMM's input, as in cuDNN); the update itself stays
float32.

sequence_lens: as in `engine` (state kept past a row's end, Y zero there, reverse starts at
the row's last valid step, Y_h the state after the last valid step, zero for an empty row).

The CPU variant runs the same seeding, partial-sum, gate and publish code with serial loops and the
product as plain float32 sums over each warp's k-slice of the state, so CI checks the work split, the
batch split, indexing, padding and numerics; the fragment layouts (ldmatrix, mma), the copies and the
barriers only exist on the GPU and are checked there (`tests/test_persistent_mma.py -m gpu`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...errors import TvmseqError
from ...targets import is_gpu, resolve
from .cells import CELL_GATES

# weight rows a hidden unit: GRU z, r, h; RNN one; LSTM i, o, f, c (its cell state c kept beside h, see
# persistent_mma_func)
GATES = CELL_GATES

# Step hand-off by ready flags: a block publishes flag[d, q, g] = steps done (release, after its state rows are
# written); a warp about to stage its k-slice waits for the blocks owning those units (acquire, one lane a
# flag), then __syncwarp. No grid-wide barrier in the step loop.
_PUBLISH_SRC = r"""
__forceinline__ __device__ void tvmseq_flag_publish(int* flag, int value) {
  __threadfence();
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(flag), "r"(value) : "memory");
}
"""
_WAIT_SRC = r"""
__forceinline__ __device__ void tvmseq_flags_wait(const int* flags, int count, int value) {
  for (int i = threadIdx.x & 31; i < count; i += 32) {
    int v;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flags + i) : "memory");
    } while (v < value);
  }
  __syncwarp();
}
"""
# dsmem: the new state into a cluster peer's staging slot by st.async, whose complete_tx on the peer's mbarrier for
# that slot tells the peer the bytes have landed (no fence, no cluster barrier: each block waits for its own slot).
# A lane sends DSMEM_SEND_BYTES of consecutive units of one row: st.async has no 16-bit form, and each lane's store
# is a remote transaction of its own, so the group's values are gathered by shuffles into its first lane, which
# stores them as one 4-byte word (4: float32 one unit, float16 two) or one v4 of 16 bytes (float32 four units,
# float16 eight). A group never straddles a row or a k-slice (units_per_block and k-slices are multiples of 8 units;
# staging rows are 16-byte multiples). Every lane calls it (the shuffles); `store` says whether the group is sent.
# Bytes a lane sends, by dtype (H100, 2026-11-27, 35 dsmem configs, the two widths alternated in one process, outputs
# bit-identical): float32 16 B was 4-5% faster at hidden 128 batch 32-64 (LSTM 1.81 -> 1.73 us a step, bi 2.80 ->
# 2.65) and level elsewhere; float16 16 B was 1-8% slower everywhere (the gather's shuffles cost more than the
# remote stores they save), so float16 keeps a word of two units a lane.
DSMEM_SEND_BYTES = {"float32": 16, "float16": 4}
_ST_ASYNC_COMMON = r"""
#ifndef TVMSEQ_ST_ASYNC_COMMON
#define TVMSEQ_ST_ASYNC_COMMON
__forceinline__ __device__ void tvmseq_st_async_b32(void* local, void* mbar, int ranks, unsigned w) {
  unsigned a = (unsigned)__cvta_generic_to_shared(local), m = (unsigned)__cvta_generic_to_shared(mbar), ra, rm;
  for (int r = 0; r < ranks; ++r) {
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(r));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rm) : "r"(m), "r"(r));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(ra), "r"(w), "r"(rm) : "memory");
  }
}
__forceinline__ __device__ void tvmseq_st_async_v4(void* local, void* mbar, int ranks, unsigned w0, unsigned w1,
                                                   unsigned w2, unsigned w3) {
  unsigned a = (unsigned)__cvta_generic_to_shared(local), m = (unsigned)__cvta_generic_to_shared(mbar), ra, rm;
  for (int r = 0; r < ranks; ++r) {
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(r));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rm) : "r"(m), "r"(r));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(ra), "r"(w0), "r"(w1), "r"(w2), "r"(w3), "r"(rm) : "memory");
  }
}
#endif
"""
_ST_ASYNC_SRC = {
    ("float32", 4): _ST_ASYNC_COMMON + r"""
__forceinline__ __device__ void tvmseq_st_async_float32_4(float* local, void* mbar, int ranks, float v, int store) {
  if (store) tvmseq_st_async_b32(local, mbar, ranks, __float_as_uint(v));
}
""",
    ("float16", 4): _ST_ASYNC_COMMON + r"""
__forceinline__ __device__ void tvmseq_st_async_float16_4(half* local, void* mbar, int ranks, half v, int store) {
  unsigned x = __half_as_ushort(v), hi = __shfl_down_sync(0xffffffffu, x, 1);
  if (store && !(threadIdx.x & 1)) tvmseq_st_async_b32(local, mbar, ranks, (x & 0xffffu) | (hi << 16));
}
""",
    ("float32", 16): _ST_ASYNC_COMMON + r"""
__forceinline__ __device__ void tvmseq_st_async_float32_16(float* local, void* mbar, int ranks, float v, int store) {
  unsigned x = __float_as_uint(v), x1 = __shfl_down_sync(0xffffffffu, x, 1), x2 = __shfl_down_sync(0xffffffffu, x, 2),
           x3 = __shfl_down_sync(0xffffffffu, x, 3);
  if (store && !(threadIdx.x & 3)) tvmseq_st_async_v4(local, mbar, ranks, x, x1, x2, x3);
}
""",
    ("float16", 16): _ST_ASYNC_COMMON + r"""
__forceinline__ __device__ void tvmseq_st_async_float16_16(half* local, void* mbar, int ranks, half v, int store) {
  unsigned x = __half_as_ushort(v), p = (x & 0xffffu) | (__shfl_down_sync(0xffffffffu, x, 1) << 16),
           p1 = __shfl_down_sync(0xffffffffu, p, 2), p2 = __shfl_down_sync(0xffffffffu, p, 4),
           p3 = __shfl_down_sync(0xffffffffu, p, 6);
  if (store && !(threadIdx.x & 7)) tvmseq_st_async_v4(local, mbar, ranks, p, p1, p2, p3);
}
"""}

# Below this batch the SIMT engine (one batch column per accumulator, no 16-row m tile to fill) wins.
MMA_MIN_BATCH = 16
# A database entry below those batch floors whose timed rival was the SIMT engine (`ENGINE_PICK` as its model_config,
# both timed in one process: schedules/tune_persistent_mma.py) routes that exact shape here (`beats_engine`)
ENGINE_PICK = {"engine": "persistent_gru"}
# float32 (product on FMA units): where it beat the per-step path and the SIMT engine on the H100, recurrence
# us a step (artifacts/bench/pmma_sweep.json.gz, sweep9): H512 B64 6.2 vs 10.8 (per-step), H256 B64 3.0 vs 5.3
# (engine); not at H1024 B64 (21.6 vs 20.2) or H512 B256 (19.3 vs 18.6-19.0, a tie)
SIMT_MIN_BATCH, SIMT_MAX_BATCH, SIMT_MAX_HIDDEN = 32, 64, 512
_REG_OVERHEAD = 40
_LSTM_TEMPS = 8
# one-block-an-SM blocks that launched cooperatively in clusters on the H100 (sweeps 10-11): 128 in clusters of 2,
# 64 in clusters of 4; 128 in clusters of 4 or 8 failed (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: the GPCs' SM
# counts do not divide into them). Other sizes were not measured, so they are refused.
CLUSTER_MAX_BLOCKS = {1: 1 << 30, 2: 128, 4: 64}
# cluster_sync: clusters are independent (no cooperative launch); 16 is the H100's non-portable maximum, which the
# TVM runtime opts into for a launch above 8 (any size up to it: a cluster need not be a power of two)
CLUSTER_SYNC_MAX = 16
SIMT_UNROLL = 16          # float32 product: k4 loops up to this many steps are unrolled
# float32 chunks of fewer than 16 rows (dsmem only): with 16 rows a lane each, a batch of 1 left 15 of 16 lanes
# multiplying padding rows; these chunks spread the gate rows over the lanes instead (RL rows x 32 / RL gate-row
# groups), so a batch-1 step issues 1/16 of the multiply-adds
SIMT_SMALL_CHUNKS = (1, 2, 4, 8)
_MAX_REGS = 224           # leave ptxas room under 255


@dataclass(frozen=True)
class MmaConfig:
    """Knobs of the tensor-core persistent kernel (tile constants as data).

    units_per_block: hidden units a block owns (a multiple of 8: one n8 tile per gate per 8 units)
    num_warps:       warps per block; they split k (the hidden size), each holding its slice of R
    chunk_rows:      batch rows per chunk (a multiple of 16; gate_m 8; float32 with dsmem also 1, 2, 4 or 8:
                     `SIMT_SMALL_CHUNKS`); a step walks ceil(B / chunk_rows) chunks
    pipeline:        two staging buffers: chunk c+1's state copy is in flight during chunk c's product,
                     partial sums and gate math (twice the staging shared memory)
    batch_split:     blocks sharing a unit group, each taking every batch_split-th chunk (blocks of one SM
                     then run independent chunk pipelines; R is held once per block)
    flags:           hand a step's state over by per-block ready flags (each warp waits only for the blocks
                     owning its k-slice) instead of a grid barrier
    half_stage:      float32 only: stage a warp's k-slice in two halves through one half-size buffer (the
                     second copy after the first half's product), so 32-row chunks fit beside the R slice
    early_gate:      load the next chunk's gate_i (the input projection, streamed from DRAM) as soon as this
                     chunk's gate math is done, so the last chunk's loads for step s + 1 are in flight across the
                     grid barrier instead of issued after it
    bulk:            sm_90: stage the state by bulk copies (cp.async.bulk, the TMA unit) completing on per-slot,
                     per-warp mbarriers, instead of 16-byte cp.async; not with half_stage. Alone, one copy per row
                     and k half: correct but measured SLOWER everywhere (sweep 8: fp16 H1024 B64 4.89 -> 6.31 us a
                     step, H512 B64 2.82 -> 4.11: 64-256-byte copies cost more than the 16-byte ones); with `image`,
                     one copy per warp's k half
    image:           (with bulk) keep the state in global memory in the staging image layout (chunk, warp, k half,
                     row, padded columns: exactly what a warp's staging region holds), so each region arrives by
                     ONE bulk copy (MC rows x one k half, 2-9 KB) instead of one per row; writers scatter into it
    cluster:         (with image, sm_90) thread-block clusters of this many blocks with the same batch chunks and
                     consecutive unit groups: each block copies 1/cluster of the regions and multicasts them to
                     every block of its cluster (L2 -> SM traffic / cluster); with several chunks a step, a
                     cluster barrier keeps a block from refilling a peer's slot before the peer has read it
    cluster_sync:    end a step with a cluster barrier instead of the grid barrier: one cluster is the G blocks of a
                     batch group (cluster == G, up to 16 blocks; G <= 16 means H <= 16 x units), whose rows depend
                     on no other block, so clusters run independently, the launch is not cooperative, and the
                     step's hand-off costs a cluster barrier (cluster-scope release/acquire of the state written to
                     global memory) instead of a grid-wide one; with image, the state copies multicast over it
    n_split:         (float16 with dsmem) warps split the gate rows n_split ways as well as k: num_warps / n_split
                     k-groups of n_split warps, each warp holding the B fragments of its k-slice for 1 / n_split of
                     the block's n8 tiles, so a block of many units (32: an LSTM's 128 gate rows at hidden 512 in a
                     cluster of 16) keeps R in registers without every warp accumulating all its gate rows
    dsmem:           (with cluster_sync, one chunk a block a step) no state in global memory and no barrier a step:
                     a block sends each new state element straight into the staging slot of every block of its
                     cluster by st.async (distributed shared memory), which completes on the receiver's mbarrier of
                     that slot (two slots by step parity, each armed with the bytes it receives a step); a block
                     waits only for its own slot. No fence: the first version (remote st.shared::cluster stores,
                     then a cluster barrier) stalled on the barrier's release (ncu: membar 3.7 stalls an issue) and
                     was slower than the global round trip for fp32 (sweep 15); with st.async (sweep 16) GRU fp16
                     H256 B64 2.12 -> 1.48 us a step, B8 3.04 (SIMT engine) -> 1.15, RNN fp32 H256 B64 1.92 -> 1.74.
                     No overwrite hazard without a barrier: a peer sends h_{s+2} into a slot only after it received
                     this block's h_{s+1}, which this block sends after it has read the slot for step s
    gate_m:          float16: the block's gate rows as the mma's M (R held as A fragments, m16 tiles of gate rows) and
                     the chunk's batch rows as its N (the staged state as B fragments, n8 tiles of rows), chunks of
                     8 rows: at batch <= 8 an m16n8k16 is then all real work, where with the batch as M a 16-row chunk
                     is half padding (half the mmas, state loads and accumulators); needs an even number of n8
                     tiles a warp (m16 pairs)
    k_chains:        (gate_m) accumulators a C tile: 2 alternates the k16 tiles between two, so two dependent mma
                     chains of half the length run interleaved, summed before the partials are stored
    early_gate won only at some shapes (H1024 B256 14.6 -> 13.9, RNN H256 B64 2.21 -> 2.10) and lost at others
    (H1024 B64 4.88 -> 5.04), so only the database turns it on; so do image and cluster (sweeps 10-12).
    """

    units_per_block: int = 8
    num_warps: int = 8
    chunk_rows: int = 64
    pipeline: bool = False
    batch_split: int = 1
    flags: bool = False
    half_stage: bool = False
    early_gate: bool = False
    bulk: bool = False
    image: bool = False
    cluster: int = 1
    cluster_sync: bool = False
    dsmem: bool = False
    n_split: int = 1
    gate_m: bool = False
    k_chains: int = 1

    # the compact form the sweeps, the tuning script and the GPU test cases write a config in: (units, warps,
    # rows[, pipeline[, batch_split[, flags[, half_stage[, early_gate[, bulk[, image[, cluster[, cluster_sync[,
    # dsmem[, n_split[, gate_m[, k_chains]]]]]]]]]]]]]), 0/1 switches
    _OPTIONAL = (("pipeline", False), ("batch_split", 1), ("flags", False), ("half_stage", False),
                 ("early_gate", False), ("bulk", False), ("image", False), ("cluster", 1), ("cluster_sync", False),
                 ("dsmem", False), ("n_split", 1), ("gate_m", False), ("k_chains", 1))

    @classmethod
    def of(cls, knobs) -> "MmaConfig":
        units, warps, rows, *rest = knobs
        return cls(units, warps, rows, **{name: type(default)(value)
                                          for (name, default), value in zip(cls._OPTIONAL, rest)})

    def knobs(self) -> tuple:
        """The compact tuple `of` reads back, trailing defaults left out (pipeline always kept)."""
        rest = [int(getattr(self, name)) for name, _ in self._OPTIONAL]
        while len(rest) > 1 and rest[-1] == int(self._OPTIONAL[len(rest) - 1][1]):
            rest.pop()
        return (self.units_per_block, self.num_warps, self.chunk_rows, *rest)


@dataclass(frozen=True)
class MmaGeometry:
    D: int
    B: int
    H: int
    NG: int
    cfg: MmaConfig
    dtype: str = "float16"   # float32: the product on FMA units (`product_simt`), R slice in shared memory

    UB = property(lambda self: self.cfg.units_per_block)
    NW = property(lambda self: self.cfg.num_warps)
    NT = property(lambda self: 32 * self.NW)
    G = property(lambda self: math.ceil(self.H / self.UB))              # blocks per direction
    NS = property(lambda self: self.cfg.n_split)                       # warps sharing a k-slice (n split)
    KG = property(lambda self: self.NW // self.NS)                     # k-groups (warps of one k-slice)
    Hp = property(lambda self: math.ceil(self.H / (16 * self.KG)) * 16 * self.KG)  # k padded to k-groups x 16
    KW = property(lambda self: self.Hp // self.KG)                     # k per warp (per k-group)
    KTW = property(lambda self: self.KW // 16)                         # k16 tiles per warp
    NGU = property(lambda self: self.NG * self.UB)                     # gate rows (n) per block
    NN = property(lambda self: self.NGU // 8)                          # n8 tiles per block
    NNW = property(lambda self: self.NN // self.NS)                    # n8 tiles per warp
    GM = property(lambda self: self.cfg.gate_m)                        # gate rows as M, batch rows as N
    # chunk row quantum: the batch's mma dim (16; gate_m 8); float32 chunks of fewer rows (`SIMT_SMALL_CHUNKS`) as set
    RQ = property(lambda self: 8 if self.cfg.gate_m else (
        self.cfg.chunk_rows if self.dtype == "float32" and self.cfg.chunk_rows in SIMT_SMALL_CHUNKS else 16))
    MC = property(lambda self: min(self.cfg.chunk_rows, math.ceil(self.B / self.RQ) * self.RQ))
    MT = property(lambda self: self.MC // 16)                          # m16 tiles per chunk (batch as M)
    NB8 = property(lambda self: self.MC // 8)                          # n8 tiles per chunk (gate_m)
    NMW = property(lambda self: self.NNW // 2)                         # m16 gate tiles per warp (gate_m)
    # accumulators a lane: C fragments (4 floats) of MT x NNW tiles, or (gate_m) of NMW x NB8: the same count
    # for the same chunk rows; gate_m's gain is the 8-row chunk
    ACC = property(lambda self: self.MC * self.NNW // 4 * self.cfg.k_chains)
    BS = property(lambda self: self.cfg.batch_split)
    # chunks per step (a multiple of BS: a block's last chunk may be all padding rows) and per block
    NCH = property(lambda self: math.ceil(math.ceil(self.B / self.MC) / self.BS) * self.BS)
    NCB = property(lambda self: self.NCH // self.BS)
    BLOCKS = property(lambda self: self.D * self.G * self.BS)
    Bp = property(lambda self: self.NCH * self.MC)
    SIMT = property(lambda self: self.dtype == "float32")
    ESZ = property(lambda self: 4 if self.SIMT else 2)                 # bytes of a state element
    # a warp's k-slice is copied in PARTS commit groups (k halves when KTW is even) of KP columns
    PARTS = property(lambda self: 2 if self.KTW % 2 == 0 else 1)
    KP = property(lambda self: self.KW // self.PARTS)
    HALF = property(lambda self: self.cfg.half_stage)
    IMAGE = property(lambda self: self.cfg.image)
    # staged row stride (elements): 16 B of padding, so ldmatrix rows / float4 rows fall on distinct banks.
    # A warp's staging region holds MC rows of its k-slice, or (image) PARTS blocks of MC rows of one k half
    SROW = property(lambda self: (self.KP if self.HALF or self.IMAGE else self.KW) + 16 // self.ESZ)
    REGION = property(lambda self: (self.PARTS if self.IMAGE else 1) * self.MC * self.SROW)
    CPL = property(lambda self: self.MC * self.NGU // 32)              # SIMT: sums a lane accumulates
    # SIMT lanes: RL rows of the chunk (lane % RL) x 32 / RL groups of CW gate rows (lane / RL), RPL rows a lane
    RL = property(lambda self: min(self.MC, 16))
    RPL = property(lambda self: self.MC // self.RL)
    CW = property(lambda self: self.NGU * self.RL // 32)
    # SIMT accumulator sets a lane alternates over the k steps: a small chunk's lane holds 1-3 sums, each one long
    # chain of dependent FMAs over its k-slice; with KC sets the chains are KC times shorter (summed at the end)
    KC = property(lambda self: max(1, 4 // (self.RPL * self.CW)) if self.SIMT and self.MC < 16 else 1)
    # SIMT: W row stride in shared memory (floats). Hp is a multiple of 128, so unpadded, the two lane halves'
    # rows (j and NGU/2 + j) fall on the same banks: every 16-byte W read was a 2-way bank conflict
    WROW = property(lambda self: self.Hp + 4)
    # staging buffers (dsmem: one a step parity, written by the peers during the step before)
    SLOTS = property(lambda self: 2 if self.cfg.pipeline or self.cfg.dsmem else 1)
    ITEMS = property(lambda self: self.MC * self.UB)                   # (row, unit) items per chunk
    FI = property(lambda self: math.ceil(self.ITEMS / self.NT))        # items a thread finishes

    def regs_estimate(self) -> int:
        if self.SIMT:   # accumulators, the state operands (4 a row) and the W operands (4 a gate row)
            product = self.CPL * self.KC + 4 * self.RPL + 4 * self.CW
        else:           # B fragments (R), accumulators, the A fragment
            product = self.KTW * self.NNW * 2 + self.ACC + (8 if self.GM else 4)
        # LSTM: the cell state of each item beside h, the i, o, f peepholes of its unit and the gate math's
        # temporaries (ptxas, sm_90a: 16-unit blocks at hidden 1024 estimated 215 took 254 registers without
        # spills, estimated 219 and 227 spilled; _LSTM_TEMPS puts those two over the cap)
        lstm = self.NCB * self.FI + 3 * self.FI + _LSTM_TEMPS if self.NG == 4 else 0
        return product + 4 * self.FI + self.NCB * self.FI + lstm + _REG_OVERHEAD

    def smem_bytes(self) -> int:
        weights = 4 * self.NGU * self.WROW if self.SIMT else 0
        return self.ESZ * self.SLOTS * self.KG * self.REGION + 4 * self.KG * self.MC * self.NGU + weights

    def check(self, facts) -> str | None:
        """Why this geometry cannot run (one resident block per SM), or None."""
        c = self.cfg
        if c.units_per_block < 8 or c.units_per_block % 8 or c.num_warps < 1 or c.chunk_rows < self.RQ \
                or c.chunk_rows % self.RQ or c.batch_split < 1:
            return (f"config {c}: units_per_block must be a multiple of 8, chunk_rows of {self.RQ}, "
                    f"batch_split >= 1")
        if c.gate_m and (self.SIMT or self.NNW % 2):
            return (f"config {c}: gate_m is for the float16 product with an even number of n8 tiles a warp "
                    f"({self.NNW} here)")
        if c.k_chains not in (1, 2) or (c.k_chains > 1 and not c.gate_m):
            return f"config {c}: k_chains is 1 or 2, and 2 only with gate_m"
        if c.n_split < 1 or self.NW % c.n_split or self.NN % c.n_split:
            return f"config {c}: n_split must divide the warps ({self.NW}) and the block's n8 tiles ({self.NN})"
        if c.n_split > 1 and (self.SIMT or not c.dsmem):
            return f"config {c}: n_split is for the float16 product with the state handed over in dsmem"
        if self.SIMT and self.MC not in (16, 32) + SIMT_SMALL_CHUNKS:
            return f"config {c}: the float32 product needs 1, 2, 4, 8, 16 or 32 chunk rows (lanes x rows)"
        if self.SIMT and self.MC < 16 and not (c.dsmem and self.NGU * self.MC % 32 == 0):
            return (f"config {c}: float32 chunks of fewer than 16 rows only with dsmem (the staging copies are whole "
                    f"rounds of 16 rows) and 32 / rows dividing the {self.NGU} gate rows")
        if c.bulk and self.HALF:
            return f"config {c}: bulk staging copies whole k halves (no half_stage)"
        if c.image and not c.bulk:
            return f"config {c}: the image layout is staged by bulk copies (bulk)"
        if c.cluster_sync:
            if c.cluster != self.G or not 2 <= c.cluster <= CLUSTER_SYNC_MAX or c.flags:
                return (f"config {c}: cluster_sync needs the cluster to be the {self.G} unit groups (2 to "
                        f"{CLUSTER_SYNC_MAX} of them) and no flags")
            if c.dsmem and (self.NCB != 1 or c.bulk or c.pipeline or self.HALF):
                return (f"config {c}: dsmem keeps one chunk a block (batch_split x chunk_rows >= batch; {self.NCB} "
                        f"here) in two slots, with no copies (no bulk, pipeline or half_stage)")
        elif c.dsmem:
            return f"config {c}: dsmem hands the state over inside a cluster (cluster_sync)"
        elif c.cluster not in CLUSTER_MAX_BLOCKS or (c.cluster > 1 and not c.image):
            return f"config {c}: cluster must be one of {tuple(CLUSTER_MAX_BLOCKS)}, and > 1 only with the image layout"
        if self.G % c.cluster:
            return f"config {c}: {self.G} unit groups do not split into clusters of {c.cluster}"
        if not c.cluster_sync and self.BLOCKS > CLUSTER_MAX_BLOCKS[c.cluster]:
            return (f"{self.BLOCKS} blocks in clusters of {c.cluster}: more than the "
                    f"{CLUSTER_MAX_BLOCKS[c.cluster]} measured to be co-resident (cooperative launch)")
        if self.HALF and (not self.SIMT or c.pipeline or self.KTW % 2):
            return f"config {c}: half_stage is for float32, without pipeline, with an even number of k16 tiles"
        if facts is None:
            return None
        per_sm = math.ceil(self.BLOCKS / facts.num_sms)   # blocks each SM must hold (all resident)
        if per_sm > (2 if self.BS > 1 else 1):   # two blocks an SM only for a batch split
            return f"{self.D} x {self.G} x {self.BS} blocks > {facts.num_sms} SMs: not all resident"
        if self.NT * per_sm > 2048 or self.NT > facts.max_threads_per_block:
            return f"{self.NT} threads x {per_sm} blocks per SM: too many"
        cap = min(_MAX_REGS, facts.regs_per_sm // (self.NT * per_sm))
        if self.regs_estimate() > cap:
            what = (f"{self.CPL} accumulators, {4 * self.CW} W operands" if self.SIMT else
                    f"R fragments {self.KTW}x{self.NNW}, {self.ACC} accumulators")
            return f"~{self.regs_estimate()} registers per thread ({what}) > {cap} ({per_sm} block(s) per SM)"
        smem_cap = facts.smem_per_block if per_sm == 1 else (facts.smem_per_block + 1024) // per_sm - 1024
        if self.smem_bytes() > smem_cap:
            return f"{self.smem_bytes()} B shared memory per block > {smem_cap} ({per_sm} block(s) per SM)"
        return None


def candidate_configs(dtype: str = "float16"):
    """One block an SM, in order of preference: fewest units per block (most SMs busy), 8 warps before 16
    and 4, the largest batch chunk (fewest chunks a step) first."""
    for ub in (8, 16, 32):
        for nw in (8, 16, 4):
            for mc in ((32, 16) if dtype == "float32" else (64, 48, 32, 16)):
                yield MmaConfig(ub, nw, mc)


# gate_m (gate rows as the mma's M, 8-row chunks) at batch <= 8, from this hidden size: float16 LSTM recurrence us a
# step on an H200 (2026-11-28, schedules/plstm_sweep.py, artifacts/bench/plstm_gate_m_2026-11-28.json.gz), the pick
# with 16-row chunks -> the same config with gate_m: H512 B8 1.801 -> 1.645, bi 1.790 -> 1.626, H1024 B8 (the grid
# barrier) 3.500 -> 3.223; at hidden 128 / 256 level (the hand-off is the step there: best of each within 2%)
GATE_M_MIN_HIDDEN, GATE_M_MAX_BATCH, GATE_M_CELLS = 512, 8, ("lstm",)


def with_gate_m(cfg: MmaConfig | None, D: int, B: int, H: int, cell: str, dtype: str, facts) -> MmaConfig | None:
    """cfg with the gate rows as M and 8-row chunks where the rule above applies and that fits, else cfg."""
    if cfg is None or cfg.gate_m or dtype != "float16" or cell not in GATE_M_CELLS or B > GATE_M_MAX_BATCH \
            or H < GATE_M_MIN_HIDDEN:
        return cfg
    swapped = replace(cfg, chunk_rows=8, gate_m=True)
    return swapped if MmaGeometry(D, B, H, GATES[cell], swapped, dtype).check(facts) is None else cfg


def default_config(D: int, B: int, H: int, target, cell: str = "gru", measured: bool = True,
                   dtype: str = "float16") -> MmaConfig | None:
    """The measured winner (`schedules/measured/persistent_mma.json`, `schedules/tune_persistent_mma.py`) where
    there is one, else the rules below in order (`wide_block_config`, `batch_split_config`), else the first
    candidate that fits the target's GPU, or None; float16 at batch <= 8 from hidden 512 with the gate rows as
    the mma's M (`with_gate_m`)."""
    from .. import recurrent_gemm as rg

    target = resolve(target)
    cfg = _default_config(D, B, H, target, cell, measured, dtype)
    return with_gate_m(cfg, D, B, H, cell, dtype, rg.gpu_facts(target)) if is_gpu(target) else cfg


def _default_config(D: int, B: int, H: int, target, cell: str, measured: bool, dtype: str) -> MmaConfig | None:
    from ...tune import measured as db
    from .. import recurrent_gemm as rg

    if measured and is_gpu(target):
        config = db.lookup("persistent_mma", D=D, B=B, H=H, cell=cell, dtype=dtype)
        if config:
            return MmaConfig(**config)
    facts = rg.gpu_facts(target)
    fits = lambda cfg: cfg is not None and MmaGeometry(D, B, H, GATES[cell], cfg, dtype).check(facts) is None  # noqa: E731
    if cell == "lstm":
        cluster = lstm_cluster_config(D, B, H, facts, dtype)
        if fits(cluster):
            return cluster
        derived = next((cfg for cfg in lstm_variants(default_config(D, B, H, target, "gru", measured, dtype))
                        if fits(cfg)), None)
        if derived:
            return derived
    if dtype == "float16" and cell == "gru":
        wide = wide_block_config(D, B, H, facts)
        if fits(wide):
            return wide
    for rows in ((32, 16) if dtype == "float32" else (32,)):
        split = batch_split_config(D, B, H, facts, rows)
        if fits(split):
            return split
    for cfg in candidate_configs(dtype):
        if fits(cfg):
            return cfg
    return None


def lstm_variants(gru: MmaConfig | None):
    """LSTM configs from the GRU's pick at the same shape (its database entry or rules), in order: the pick
    itself, then with 16-row chunks, then with twice the warps (each a k-slice half as long), then both. An LSTM
    block of the same units has 4/3 the GRU's gate rows: the same blocks, state ingest and hand-off a step, 4/3
    the product, B fragments and accumulators, so the GRU's measured order of configs is taken for it where the
    registers still fit (the halvings trade fragments for chunks or warps where they do not)."""
    if gru is None:
        return []
    halved = lambda c: c if c.chunk_rows <= 16 else replace(c, chunk_rows=16)   # noqa: E731
    wider = lambda c: replace(c, num_warps=2 * c.num_warps)   # noqa: E731
    return [gru, halved(gru), wider(gru), wider(halved(gru))]


# wide blocks (16 units) are used when they occupy at least this share of the SMs
WIDE_MIN_FILL = 0.75


def wide_block_config(D: int, B: int, H: int, facts) -> MmaConfig | None:
    """float16 GRU: 16 units a block (48 gate rows), one block an SM, batch split to fill the SMs: each SM
    ingests the state once for 48 gate rows instead of twice for 2 x 24 (two 8-unit blocks), half the L2 ->
    SM traffic a step. Chunk rows 32, or 16 where that splits further; the next chunk's copy in flight
    (`pipeline`) when a block has 2+ chunks a step. None when the blocks would fill < WIDE_MIN_FILL of the
    SMs (small H x B: more, smaller blocks win), need no split, or H < 512 (not measured there). Measured on
    the H100 (recurrence us a step, artifacts/bench/pmma_sweep.json.gz, run sweep6, against two 8-unit blocks an
    SM): H1024 B64 4.85 vs 6.25, H1024 B256 15.6 vs 20.1, H512 B256 6.2 vs 7.2, H512 B64 (16 rows) 2.84 vs
    3.14, bi H512 B64 3.90 vs 4.55."""
    if H < 512:
        return None
    G = D * math.ceil(H / 16)
    best = None
    for rows in (32, 16):
        split = 1
        while G * split * 2 <= facts.num_sms and split * 2 <= math.ceil(B / rows):
            split *= 2
        if best is None or split > best.batch_split:   # more blocks; a tie keeps the larger chunk
            chunks = math.ceil(math.ceil(B / rows) / split)
            best = MmaConfig(16, 8, rows, chunks >= 2, split)
    if best.batch_split == 1 or G * best.batch_split < WIDE_MIN_FILL * facts.num_sms:
        return None
    return best


# the smallest LSTM batch `lstm_cluster_config` was measured at
LSTM_CLUSTER_MIN_BATCH = 8
# its 32-unit blocks with the n split: measured at batch 8 (fp16 H512 B8 recurrence 2.17 us a step on the SIMT engine,
# 1.81 in a cluster of 16 such blocks; schedules/plstm_sweep.py's harness, 2026-11-27)
N_SPLIT_UNITS, N_SPLIT_MAX_BATCH = 32, 16
# float16 cluster blocks by units a block: (warps, n_split), the warps k-groups of n_split warps each splitting the
# gate rows (H100, 2026-11-27, recurrence us a step, 14-18 variants a cell timed in one process, against the rule's
# 4 warps without the split: 8 units H128 B64 1.20 (8 warps, the database's) -> 0.91, H128 B256 1.52 -> 1.49, H37
# B67 0.74 -> 0.67, bi H100 B19 0.95 -> 0.86; 16 units H256 B8 1.21 -> 1.13 (4 warps split 2: 1.07), H200 B9 1.40
# -> 1.10, bi H128 B256 1.98 -> 1.68; 32 units H512 B8 1.75 (8 warps split 8: 1.85))
N_SPLIT_WARPS = {8: (4, 4), 16: (8, 4), 32: (8, 4)}


def lstm_cluster_config(D: int, B: int, H: int, facts, dtype: str = "float16") -> MmaConfig | None:
    """LSTM, hidden <= 256, batch >= 8: each batch group's unit blocks form one cluster that hands the state over
    in distributed shared memory (`dsmem`), one 16-row chunk a block (the batch split over clusters), 8 units a
    block where that needs at most 2 blocks an SM, else 16; float32 4 warps, float16 the warps of
    `N_SPLIT_WARPS` splitting the gate rows as well as k. Measured on the H100 against every engine config and the
    GRU-derived staged picks (schedules/plstm_sweep.py, artifacts/bench/plstm_sweep.json.gz, recurrence us a step,
    the best other kernel in brackets): fp16 H128 B8 0.81 (engine 1.70), B64 1.21 (2.40), B256 1.54 (2.85), bi
    B256 1.99 (3.85); fp32 H128 B8 1.59 (engine 1.69), B32 1.88 (2.96), B64 1.89 (2.89), bi B64 2.89 (3.91); fp16
    H256 B8 1.27 (1.86). Past 16 groups of 16 units (hidden 257-512) at batch <= 16: 32-unit blocks, float16 only
    (the check refuses the n split in float32, whose other rules then apply), fp16 H512 B8 1.81 (engine 2.17).
    None where it does not apply or fit. float32 at batch <= 8: `row_cluster_config`."""
    row = row_cluster_config(D, B, H, facts) if dtype == "float32" else None
    if row is not None:
        return row
    if B < LSTM_CLUSTER_MIN_BATCH:
        return None
    split = math.ceil(B / 16)

    def config(units, groups):
        warps, n_split = N_SPLIT_WARPS[units] if dtype == "float16" else (4, 1)
        return MmaConfig(units, warps, 16, batch_split=split, cluster=groups, cluster_sync=True, dsmem=True,
                         n_split=n_split)

    for units in (8, 16):
        groups = math.ceil(H / units)
        if 2 <= groups <= CLUSTER_SYNC_MAX and D * groups * split <= 2 * facts.num_sms:
            return config(units, groups)
    groups = math.ceil(H / N_SPLIT_UNITS)
    if dtype == "float16" and B <= N_SPLIT_MAX_BATCH and 2 <= groups <= CLUSTER_SYNC_MAX \
            and D * groups * split <= 2 * facts.num_sms:
        return config(N_SPLIT_UNITS, groups)
    return None


# float32 LSTM at batch <= 8, hidden <= 128 (8-unit blocks, one cluster of up to 16 a batch row): each batch row a
# cluster of its own, 1-row chunks (`SIMT_SMALL_CHUNKS`), the batch split over the clusters, all resident at once.
# Measured on an H200 (2026-11-29, `schedules/plstm_sweep.py`, recurrence us a step, the SIMT engine's best in
# brackets): H128 B1 0.565 (0.853), B2 0.555 (1.047), B4 0.558 (1.127), B8 0.630 (1.399; one 8-row cluster 1.222),
# bidirectional B4 0.669 (0.983; the database's 2-row chunks 0.637). GPU cases at H37 B3 and bidirectional H100 B3
# (`tests/test_gpu_lstm.py`) run it; compute-sanitizer memcheck and racecheck clean at H37 B3 and H128 B8
ROW_CLUSTER_MAX_BATCH, ROW_CLUSTER_UNITS, ROW_CLUSTER_WARPS = 8, 8, 4


def row_cluster_config(D: int, B: int, H: int, facts) -> MmaConfig | None:
    """float32 LSTM at batch <= ROW_CLUSTER_MAX_BATCH: a cluster of the G = ceil(H / 8) unit blocks for each batch
    row (2 <= G <= 16), where the D x G x B blocks fit the SMs one each; else None."""
    groups = math.ceil(H / ROW_CLUSTER_UNITS)
    if B > ROW_CLUSTER_MAX_BATCH or not 2 <= groups <= CLUSTER_SYNC_MAX or D * groups * B > facts.num_sms:
        return None
    return MmaConfig(ROW_CLUSTER_UNITS, ROW_CLUSTER_WARPS, 1, batch_split=B, cluster=groups, cluster_sync=True,
                     dsmem=True)


def batch_split_config(D: int, B: int, H: int, facts, rows: int = 32) -> MmaConfig | None:
    """Two blocks an SM, each with its own 32-row chunks (8 units, 8 warps): the largest power-of-two split
    that keeps D x G x split <= 2 x SMs and gives every block a chunk; None when that is no split. Measured
    on the H100 (artifacts/bench/pmma_sweep.json.gz, fp16 recurrence, us a step): H512 B256 12.6 -> 7.0 (split 4),
    H256 B64 3.16 -> 2.33, H512 B64 3.67 -> 3.05, H1024 B256 22.4 -> 20.1, H1024 B64 6.34 -> 6.22 (split 2)."""
    blocks = D * math.ceil(H / 8)
    split = 1
    while blocks * split * 2 <= 2 * facts.num_sms and split * 2 <= math.ceil(B / rows):
        split *= 2
    return MmaConfig(8, 8, rows, False, split) if split > 1 else None


def beats_engine(D: int, B: int, H: int, cell: str, dtype: str, target) -> bool:
    """Whether the database has this exact shape timed faster here than on the SIMT engine (small batch)."""
    from ...tune import measured as db

    if not is_gpu(resolve(target)):
        return False
    found = db.entry("persistent_mma", D=D, B=B, H=H, cell=cell, dtype=dtype)
    return bool(found) and found.get("model_config") == ENGINE_PICK


def _cluster_fits(D: int, B: int, H: int, dtype: str, target) -> bool:
    """Whether `lstm_cluster_config` applies to this LSTM and its config fits the GPU at this dtype."""
    from .. import recurrent_gemm as rg

    facts = rg.gpu_facts(target)
    cfg = lstm_cluster_config(D, B, H, facts, dtype)
    return cfg is not None and MmaGeometry(D, B, H, GATES["lstm"], cfg, dtype).check(facts) is None


def supported(D: int, B: int, H: int, dtype: str, lbr, target, cell: str = "gru", config=None) -> tuple[bool, str]:
    """Whether the tensor-core kernel runs this recurrence, and why not."""
    from .. import recurrent_gemm as rg

    target = resolve(target)
    if not is_gpu(target):
        return False, "CPU target"
    from ..projection.gemm import sm_version

    if sm_version(target) < 80:
        return False, f"{target.attrs.get('arch')}: mma.sync m16n8k16 with ldmatrix and cp.async needs sm_80+"
    if dtype not in ("float16", "float32"):
        return False, f"{dtype}: float16 (tensor cores) or float32 (FMA units: tensor cores would round to TF32)"
    if cell == "gru" and not lbr:
        return False, "linear_before_reset=0 needs every unit's r gate before the h-gate product"
    # LSTM: its own timings where the database has them, else the GRU's at the same shape order the two kernels
    # (both do 4/3 of the GRU's work a step)
    # ... and an LSTM small enough for one cluster a batch group was measured faster than the engine at every
    # such shape timed, where that cluster config fits (`lstm_cluster_config`)
    measured_faster = config is None and (beats_engine(D, B, H, cell, dtype, target)
                                          or (cell == "lstm" and beats_engine(D, B, H, "gru", dtype, target))
                                          or (cell == "lstm" and _cluster_fits(D, B, H, dtype, target)))
    if dtype == "float32" and not (SIMT_MIN_BATCH <= B <= SIMT_MAX_BATCH and H <= SIMT_MAX_HIDDEN) \
            and not measured_faster:
        return False, (f"float32 batch {B} hidden {H}: the staged FMA kernel was measured faster only for batch "
                       f"{SIMT_MIN_BATCH}-{SIMT_MAX_BATCH} at hidden <= {SIMT_MAX_HIDDEN}")
    if B < MMA_MIN_BATCH and not measured_faster:
        return False, f"batch {B} < {MMA_MIN_BATCH}: the SIMT engine is faster there"
    cfg = config or default_config(D, B, H, target, cell, dtype=dtype)
    if cfg is None:
        return False, "no staged-state configuration fits (blocks, registers or shared memory)"
    why = MmaGeometry(D, B, H, GATES[cell], cfg, dtype).check(rg.gpu_facts(target))
    kind = "tensor-core" if dtype == "float16" else "float32 FMA"
    return (why is None), (why or f"{kind} persistent kernel (staged state), {cfg}")


def check_args(D, B, H, dtype, directions, cell, kind="mma", dtypes=("float16", "float32"), cells=tuple(GATES)):
    """The argument checks of the staged-state kernels (`mma`, `wgmma`: kind names it)."""
    nd = 2 if directions == "bidirectional" else 1
    if directions not in ("forward", "reverse", "bidirectional") or nd != D:
        raise TvmseqError(f"persistent {kind} {cell.upper()}: direction {directions!r} does not match D={D}")
    if dtype not in dtypes:
        raise TvmseqError(f"persistent {kind} {cell.upper()}: dtype must be {' or '.join(dtypes)}, got {dtype}")
    if min(B, H) < 1:
        raise TvmseqError(f"persistent {kind} {cell.upper()}: batch and hidden must be >= 1, got B={B} H={H}")
    if cell not in cells:
        raise TvmseqError(f"persistent {kind}: cell must be one of {tuple(cells)}, got {cell!r}")


def staged_cell(kind, cell, acts, D, lstm, fast: bool = False):
    """(NG, acts, lstm, lstm_fns) of a staged-state kernel's cell (`mma`, `wgmma`: kind names it): its gate rows a
    unit, its checked activations and, for an LSTM, its update math (default `cells.LstmCell()`) and the f, g, h
    activations of each direction (None for a GRU / RNN; `fast`: `fast_math_for`)."""
    from . import cells

    if (lstm is not None) and cell != "lstm":
        raise TvmseqError(f"persistent {kind} {cell.upper()}: LSTM update math given for cell {cell!r}")
    acts = cells.check_acts(acts, D, cell)
    if cell != "lstm":
        return GATES[cell], acts, None, None
    return GATES[cell], acts, lstm or cells.LstmCell(), cells.direction_activations(acts, D, fast)


def checked_geometry(kind, cell, D, B, H, cfg, make_geometry, facts):
    """make_geometry(cfg) of a staged-state kernel, raising when no configuration fits (cfg None) or the geometry
    does not (`facts`: the GPU's, None on the CPU)."""
    if cfg is None:
        raise TvmseqError(f"persistent {kind} {cell.upper()} D={D} B={B} H={H}: no configuration fits")
    geo = make_geometry(cfg)
    why = geo.check(facts)
    if why:
        raise TvmseqError(f"persistent {kind} {cell.upper()} D={D} B={B} H={H}: {why}")
    return geo


def serial_variant(D, G, BS, NT, NCB, FI, red_words, LSTM, PEEP, seed_state, load_peepholes, prefetch,
                   product_cpu, finish, final_state):
    """The CPU variant of a staged-state kernel (`persistent_mma_func`, `wgmma.persistent_wgmma_func`), a T.macro
    (GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, hbuf, seq): the GPU kernel's threads (d, g, q, t) in serial loops
    around the kernel's own seed, product, gate math and final-state macros, each thread's registers (FI items a
    chunk, NCB chunks) a row of buffers covering the grid; red (red_words) holds one block's partial sums."""
    from tvm.script import tirx as T

    @T.macro
    def emulate(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, hbuf, seq):
        red = T.alloc_buffer((red_words,), "float32")
        hst = T.alloc_buffer((D * G * BS * NT * NCB * FI,), "float32")
        gi = T.alloc_buffer((FI * 4,), "float32")
        if LSTM:
            cst = T.alloc_buffer((D * G * BS * NT * NCB * FI,), "float32")
            ps = T.alloc_buffer((3 * FI,), "float32")
        else:
            cst = T.meta_var(None)
            ps = T.meta_var(None)
        for d, g, q, t in T.grid(D, G, BS, NT):
            seed_state(H0, hst, hbuf, (((d * G + g) * BS + q) * NT + t) * NCB * FI, d, g, q, t, True)
            if LSTM:
                seed_state(C0, cst, None, (((d * G + g) * BS + q) * NT + t) * NCB * FI, d, g, q, t, False)
        for s, ci in T.grid(seq, NCB):
            for d, g, q in T.grid(D, G, BS):
                product_cpu(hbuf, Rw, red, s % 2, d, g, q + ci * BS)
                for t in T.serial(NT):
                    prefetch(GI, RbH, Lens, gi, d, g, t, s, q + ci * BS, seq)
                    if PEEP:
                        load_peepholes(Pw, ps, d, g, t)
                    finish(Y, Lens, hbuf, hst, cst, ps, (((d * G + g) * BS + q) * NT + t) * NCB * FI, red, gi, d,
                           g, t, s, q + ci * BS, ci, seq)
        for d, g, q, t in T.grid(D, G, BS, NT):
            final_state(Yh, Lens, hst, (((d * G + g) * BS + q) * NT + t) * NCB * FI, d, g, q, t, seq)
            if LSTM:
                final_state(Yc, Lens, cst, (((d * G + g) * BS + q) * NT + t) * NCB * FI, d, g, q, t, seq)

    return emulate


def persistent_mma_func(D: int, B: int, H: int, dtype: str, directions: str, acts, clip, has_seq_lens: bool,
                        target, config: MmaConfig | None = None, cell: str = "gru", lstm=None,
                        fast_math: bool | None = None):
    """prim_func(gate_i, R, rb_h, seq_lens, h0, Y, Y_h): all steps of a float16 GRU (lbr=1) / RNN node on
    tensor cores (see the module doc).

    cell 'lstm' (`lstm`: its update math, a `cells.LstmCell`, default no peepholes / input_forget):
    prim_func(gate_i [D, T, B, 4H], R [D, 4H, H], P f32 [D, 3H], seq_lens, h0, c0 f32 [D, B, H], Y, Y_h, Y_c), the
    LSTM interface of `engine.persistent_lstm_func`. A block owns rows i, o, f, c of its units (4 gate rows a unit,
    the same product); the thread that finishes an item keeps its cell state c in float32 registers beside h for all
    steps (only h is handed over) and the i, o, f peepholes of its unit."""
    from tvm.script import tirx as T

    from . import cells
    from .. import recurrent_gemm as rg

    check_args(D, B, H, dtype, directions, cell)
    target = resolve(target)
    gpu = is_gpu(target)
    fast = cells.fast_math_for(dtype, gpu, fast_math)
    NG, acts, lstm, lstm_fns = staged_cell("mma", cell, acts, D, lstm, fast)
    LSTM = cell == "lstm"
    PEEP = LSTM and lstm.has_peepholes
    cfg = config or (default_config(D, B, H, target, cell, dtype=dtype) if gpu else MmaConfig(chunk_rows=32))
    geo = checked_geometry("mma", cell, D, B, H, cfg, lambda c: MmaGeometry(D, B, H, NG, c, dtype),
                           rg.gpu_facts(target) if gpu else None)
    UB, NW, NT, G, Hp, KW, KTW = geo.UB, geo.NW, geo.NT, geo.G, geo.Hp, geo.KW, geo.KTW
    KG, NS, NNW = geo.KG, geo.NS, geo.NNW   # k-groups, warps of a k-group (n split), n8 tiles a warp
    GM, NB8, NMW = geo.GM, geo.NB8, geo.NMW   # gate_m: gate rows as M (m16 tiles a warp), n8 tiles of rows
    NGU, NN, MC, MT, NCH, Bp, SROW, ITEMS, FI = (geo.NGU, geo.NN, geo.MC, geo.MT, geo.NCH, geo.Bp, geo.SROW,
                                                 geo.ITEMS, geo.FI)
    BS, NCB = geo.BS, geo.NCB
    SIMT, CPL, WROW, EPC = geo.SIMT, geo.CPL, geo.WROW, 16 // geo.ESZ     # EPC: state elements per 16-byte copy
    SEND_BYTES = DSMEM_SEND_BYTES[dtype]
    SEND = SEND_BYTES // geo.ESZ   # dsmem: units a lane sends (`_ST_ASYNC_SRC`)
    PER_SM = math.ceil(geo.BLOCKS / rg.gpu_facts(target).num_sms) if gpu else 1
    unroll = T.unroll if gpu else T.serial
    G3 = NG * H
    PARTS, KP, IMAGE, REGION, HALF, CS = geo.PARTS, geo.KP, geo.IMAGE, geo.REGION, geo.HALF, cfg.cluster
    # MCS: blocks a state copy is multicast to (the image layout's copies; cluster_sync without image: none)
    MCS, CSYNC = (CS if IMAGE else 1), cfg.cluster_sync
    DSMEM = cfg.dsmem and gpu   # the CPU variant has no staging: the same numerics through hbuf
    # one half of the state double buffer (dtype): [D, Bp, Hp], or the staging image [D, NCH, NW, PARTS, MC, SROW]
    buf_words = D * Bp * (KG * PARTS * SROW if IMAGE else Hp)

    f_act, g_act, clipf = cells.cell_math(acts, D, NG, clip, fast)

    time_index = cells.time_index_fn(directions)
    length = cells.row_length(has_seq_lens, B)

    def r_row(g, col):
        """R row of block-local gate row col = gate * UB + unit."""
        return (col // UB) * H + g * UB + col % UB

    def hidx(buf, d, b, k):
        if IMAGE:   # row b % MC of chunk b // MC, column k % KP of k half (k % KW) // KP of warp k // KW's slice
            region = (d * NCH + b // MC) * KG + k // KW
            return buf * buf_words + ((region * PARTS + k % KW // KP) * MC + b % MC) * SROW + k % KP
        return buf * buf_words + (d * Bp + b) * Hp + k

    def soff(slot, w, row, part):
        """Offset in the staging buffer of row `row`, k half `part` of k-group w's region in slot `slot`
        (half_stage: both halves go to column 0 in turn; without an n split a k-group is a warp)."""
        if IMAGE:
            return (slot * KG + w) * REGION + (part * MC + row) * SROW
        return (slot * KG + w) * REGION + row * SROW + (0 if HALF else part * KP)

    def k_group(w):
        """Warp w's k-group: its k-slice is columns [k_group * KW, (k_group + 1) * KW) (n split: NS warps a group)."""
        return w // NS

    def first_n8(w):
        """Warp w's first n8 tile of the block's gate rows; its NNW tiles follow (all of them without an n split)."""
        return w % NS * NNW

    def r_value(Rw, d, g, col, k):
        """R at block-local gate row col, column k, zero past H (padding units and k)."""
        return T.if_then_else(T.And(g * UB + col % UB < H, k < H),
                              Rw[d, T.min(r_row(g, col), G3 - 1), T.min(k, H - 1)], T.float16(0))

    # ---- set-up ---------------------------------------------------------------------------------
    @T.macro
    def load_b_fragments(Rw, bfrag, d, g, w, lane):
        """bfrag[(kt * NNW + nt) * 4 + i]: the m16n8k16 B fragment (k x n = R^T) of k tile kt, n tile nt of warp
        w's share (k-group w / NS, n tiles from (w % NS) * NNW): lane holds n = lane / 4, k = 2 (lane % 4) + i % 2 +
        8 (i / 2)."""
        for kt in unroll(KTW):
            for nt in unroll(NNW):
                for i in unroll(4):
                    col = T.meta_var((first_n8(w) + nt) * 8 + lane // 4)
                    k = T.meta_var(k_group(w) * KW + kt * 16 + (lane % 4) * 2 + i % 2 + 8 * (i // 2))
                    bfrag[(kt * NNW + nt) * 4 + i] = r_value(Rw, d, g, col, k)

    @T.macro
    def load_a_fragments(Rw, bfrag, d, g, w, lane):
        """gate_m: bfrag[(kt * NMW + mt) * 8 + i]: the m16n8k16 A fragment (m x k = R) of k tile kt, m16 tile mt
        (n8 tiles 2 mt, 2 mt + 1) of warp w's share: lane holds m = lane / 4 + 8 ((i / 2) % 2), k = 2 (lane % 4)
        + i % 2 + 8 (i / 4)."""
        for kt in unroll(KTW):
            for mt in unroll(NMW):
                for i in unroll(8):
                    col = T.meta_var((first_n8(w) + 2 * mt) * 8 + lane // 4 + 8 * (i // 2 % 2))
                    k = T.meta_var(k_group(w) * KW + kt * 16 + (lane % 4) * 2 + i % 2 + 8 * (i // 4))
                    bfrag[(kt * NMW + mt) * 8 + i] = r_value(Rw, d, g, col, k)

    PADC = Hp - G * UB     # padding columns past the last block's units

    @T.macro
    def load_w_slice(Rw, wsm, d, g, t):
        """SIMT: the block's gate rows of R in shared memory, wsm[col * WROW + k] (zero past H)."""
        for i in T.serial(math.ceil(NGU * Hp / NT)):
            v = T.meta_var(i * NT + t)
            col = T.meta_var(v // Hp)
            k = T.meta_var(v % Hp)
            if v < NGU * Hp:
                wsm[col * WROW + k] = T.if_then_else(g * UB + col % UB < H and k < H,
                                        Rw[d, T.min(r_row(g, col), G3 - 1), T.min(k, H - 1)], T.float32(0))

    @T.macro
    def push_state(stage, dmbar, hst, slot, c, g, t):
        """dsmem: this thread's items of the block's state (hst, float32) -> staging slot `slot` of every block of
        the cluster (all of them read every unit), at the offset the product reads it from, completing on each
        peer's mbarrier of that slot; rows past the batch and units past H are not sent (they stay zero)."""
        for i in unroll(FI):
            v = T.meta_var(i * NT + t)
            j = T.meta_var(g * UB + v % UB)
            at = T.meta_var(soff(slot, T.min(j, Hp - 1) // KW, T.min(v // UB, MC - 1), 0) + T.min(j, Hp - 1) % KW)
            # the lane of a group's first unit sends the group (SEND units; units past H are zero in hst)
            T.evaluate(T.cuda.func_call(f"tvmseq_st_async_{dtype}_{SEND_BYTES}", T.address_of(stage[at]),
                                        T.address_of(dmbar[slot]), CS, T.Cast(dtype, hst[i]),
                                        T.Cast("int32", v < ITEMS and c * MC + v // UB < B and j < H),
                                        source_code=_ST_ASYNC_SRC[dtype, SEND_BYTES]))

    @T.macro
    def seed_state(S0, st, hbuf, hoff, d, g, q, t, to_image):
        """Own state st <- s0 (float32; item i of this block's chunk ci at st[hoff + ci * FI + i]). to_image (h; the
        LSTM's c never leaves the chip): also both halves of the fp16 buffer <- h0 / zeros on this block's units and
        rows, zero on padding rows and units, and the last unit group zeroes the padding columns [G*UB, Hp) of its
        rows."""
        for ci in T.serial(NCB):
            for i in unroll(FI):
                v = T.meta_var(i * NT + t)
                b = T.meta_var((q + ci * BS) * MC + v // UB)
                j = T.meta_var(g * UB + v % UB)
                if v < ITEMS:
                    st[hoff + ci * FI + i] = T.if_then_else(
                        b < B and j < H, S0[d, T.min(b, B - 1), T.min(j, H - 1)], T.float32(0))
                    if to_image:
                        if j < Hp and not DSMEM:   # dsmem: `push_state` after the seeding
                            hbuf[hidx(0, d, b, j)] = T.Cast(dtype, st[hoff + ci * FI + i])
                            hbuf[hidx(1, d, b, j)] = T.Cast(dtype, 0)
            if to_image and PADC > 0 and not DSMEM:
                if g == G - 1:
                    for i in T.serial(math.ceil(MC * PADC / NT)):
                        v = T.meta_var(i * NT + t)
                        if v < MC * PADC:
                            hbuf[hidx(0, d, (q + ci * BS) * MC + v // PADC, G * UB + v % PADC)] = T.Cast(dtype, 0)
                            hbuf[hidx(1, d, (q + ci * BS) * MC + v // PADC, G * UB + v % PADC)] = T.Cast(dtype, 0)

    @T.macro
    def load_peepholes(Pw, ps, d, g, t):
        """LSTM: P (i, o, f) of the units this thread finishes (the same units in every chunk)."""
        for i in unroll(FI):
            j = T.meta_var(T.min(g * UB + (i * NT + t) % UB, H - 1))
            for qq in unroll(3):
                ps[i * 3 + qq] = Pw[d, qq * H + j]

    # ---- a chunk of a step ----------------------------------------------------------------------
    @T.macro
    def prefetch(GI, RbH, Lens, gi, d, g, t, s, c, seq):
        """gate_i of the items this thread finishes (issued before the product, consumed after it)."""
        for i in unroll(FI):
            v = T.meta_var(i * NT + t)
            b = T.meta_var(T.min(c * MC + v // UB, B - 1))
            j = T.meta_var(T.min(g * UB + v % UB, H - 1))
            L = T.meta_var(length(Lens, b, seq))
            tt = T.meta_var(T.max(T.min(time_index(d, L, s), seq - 1), 0))
            for q in unroll(NG):
                gi[i * 4 + q] = GI[d, tt, b, q * H + j]
            if NG == 3:
                gi[i * 4 + 3] = RbH[d, j]

    # The copy of a warp's k-slice goes in PARTS commit groups (k halves when KTW is even): the product of
    # the first half starts while the second is still in flight.

    SLOTS = geo.SLOTS
    PENDING = PARTS if SLOTS == 2 else 0   # groups of the next chunk's copy issued before this chunk's waits
    BULK, ESZ = cfg.bulk, geo.ESZ

    @T.macro
    def proxy_fences(c):
        if c < BS:   # the first copy of a step: global and shared memory (one full fence measured faster than two)
            T.ptx["fence.proxy.async"]()
        elif MCS == 1:
            T.ptx["fence.proxy.async.shared::cta"]()
        else:   # the multicast writes into the peers' slots too (their reads: ordered by the cluster barrier)
            T.ptx["fence.proxy.async.shared::cluster"]()

    @T.macro
    def step_barrier():
        """The end of a step (and of the seeding): every block that reads this block's state rows has them."""
        if CSYNC:   # those are the blocks of this cluster; release/acquire at cluster scope covers global memory
            T.ptx["barrier.cluster.arrive.release"]()
            T.ptx["barrier.cluster.wait.acquire"]()
        else:
            T.cuda.grid_sync()

    @T.macro
    def stage_bulk(hbuf, stage, mbar, buf, d, c, slot, w, lane, part, rank):
        """k half `part` of warp w's rows of chunk c, completing on mbarrier (slot, w, part), which lane 0 arms
        with the byte count. Nothing (no arm, no copy) past the block's last chunk, so a barrier's phases are
        exactly the chunks staged through its slot. Per row: one cp.async.bulk a row (KP elements). Image: the
        k half's MC padded rows are contiguous in hbuf, one copy; in a cluster, block `rank` copies the halves
        with (w * PARTS + part) % cluster == rank and multicasts them (data and byte count land at the same
        offsets in every block of the cluster, each arming its own barrier). Proxy fences: a shared-memory one
        orders this lane's earlier generic reads of the slot (ldmatrix) before the async-proxy write into it; the
        grid barrier's acquire of the state must also be ordered before the async-proxy read of it, once a step
        (the block's first chunk, c < batch_split): a full fence there, the shared-memory one for later chunks.
        A full fence.proxy.async before every copy (sweep 10) made chunks wait for this thread's global stores of
        the previous chunk: fp16 H1024 B256, 16-row chunks, 22.1 us a step, 15.3 with the fences split (sweep 11).
        The image copy names its destination by access_ptr with the extent written: shared memory merging sizes
        each buffer by the accesses it sees, and a byte count is not one (an address_of destination left the
        float32 staging buffer 16 bytes short, caught by compute-sanitizer memcheck)."""
        if c < NCH:
            if IMAGE:
                if lane == 0:
                    T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](
                        T.address_of(mbar[(slot * NW + w) * PARTS + part]), T.uint32(MC * SROW * ESZ))
                    if (w * PARTS + part) % MCS == rank:
                        proxy_fences(c)
                        if MCS == 1:
                            T.ptx["cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"](
                                stage.access_ptr("w", offset=soff(slot, w, 0, part), extent=MC * SROW),
                                T.address_of(hbuf[hidx(buf, d, c * MC, w * KW + part * KP)]),
                                T.uint32(MC * SROW * ESZ), T.address_of(mbar[(slot * NW + w) * PARTS + part]))
                        else:
                            T.ptx["cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"](
                                stage.access_ptr("w", offset=soff(slot, w, 0, part), extent=MC * SROW),
                                T.address_of(hbuf[hidx(buf, d, c * MC, w * KW + part * KP)]),
                                T.uint32(MC * SROW * ESZ), T.address_of(mbar[(slot * NW + w) * PARTS + part]),
                                T.uint16((1 << MCS) - 1))
            else:
                if lane == 0:
                    T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](
                        T.address_of(mbar[(slot * NW + w) * PARTS + part]), T.uint32(MC * KP * ESZ))
                T.evaluate(T.call_extern("void", "__syncwarp"))
                proxy_fences(c)
                for i in unroll(math.ceil(MC / 32)):
                    if i * 32 + lane < MC:
                        T.ptx["cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes"](
                            T.address_of(stage[soff(slot, w, i * 32 + lane, part)]),
                            T.address_of(hbuf[hidx(buf, d, c * MC + i * 32 + lane, w * KW + part * KP)]),
                            T.uint32(KP * ESZ), T.address_of(mbar[(slot * NW + w) * PARTS + part]))

    COPIES = MC * KP // EPC   # 16-byte copies of a warp's k half of a chunk

    @T.macro
    def copy_piece(hbuf, stage, buf, d, c, slot, w, part, q):
        row = T.meta_var(q // (KP // EPC))
        col = T.meta_var((q % (KP // EPC)) * EPC)
        T.evaluate(T.s_tir.cp_async_raw.legacy(
            stage.access_ptr("w"), soff(slot, w, row, part) + col,
            hbuf.data, hidx(buf, d, c * MC + row, w * KW + part * KP + col), 16, dtype=dtype))

    @T.macro
    def stage_gpu(hbuf, stage, mbar, buf, d, c, slot, w, lane, rank, first=0):
        """Warp w's k-slice of chunk c's state rows -> its region of staging slot `slot` (16 B copies), one
        commit group per k half from `first` (half_stage: one half per call, at column 0 of the region).
        Nothing is copied for c >= NCH (past the block's last chunk), but the groups are still committed,
        so the waits of `product_gpu` count the same number of groups every chunk."""
        for part in unroll(first, first + 1 if HALF else PARTS):
            if BULK:
                stage_bulk(hbuf, stage, mbar, buf, d, c, slot, w, lane, part, rank)
            elif c < NCH:
                # MC a multiple of 16 and KP of 16: whole rounds of 32 lanes; gate_m's 8-row chunks may end in a
                # part round
                for i in unroll(math.ceil(COPIES / 32)):
                    if COPIES % 32 == 0:
                        copy_piece(hbuf, stage, buf, d, c, slot, w, part, i * 32 + lane)
                    elif i * 32 + lane < COPIES:
                        copy_piece(hbuf, stage, buf, d, c, slot, w, part, i * 32 + lane)
            if not BULK:
                T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def wait_part(mbar, slot, w, part, phase, pending):
        """This warp's copies of k half `part` have landed in shared memory (both staging mechanisms; `phase`:
        the chunks staged through this slot before)."""
        if BULK:
            T.evaluate(T.cuda.mbarrier_wait(T.address_of(mbar[(slot * NW + w) * PARTS + part]), phase % 2))
        else:
            T.evaluate(T.ptx["cp.async.wait_group"](pending))
            T.evaluate(T.call_extern("void", "__syncwarp"))

    def red_col(row, col):
        """Where partial sum (row, gate row col) sits in its row of `red`: columns swizzled by the row so the
        products' vector stores hit distinct banks (st.shared.v2/v4 written out: nvcc split the first of each
        group of vector stores from the C source into scalar ones). float32 (16-byte stores, lanes = rows r..r+7 at one
        column): 16-byte chunk ^ row bit 2 (rows r and r + 4 were 2-way conflicts, and the scalar stores before
        4-way); float16 (8-byte stores, lanes = 4 rows x 4 column pairs) at NGU = 16 mod 32 (16-unit GRU
        blocks): column bit 3 ^ row bit 1 (rows r and r + 2 fell on the same banks). The gate math's reads
        (a warp = whole rows of UB units, rows sharing these row bits) stay conflict-free."""
        if SIMT:   # NGU is a multiple of 8 (units a multiple of 8): the chunk pairs stay inside the row
            return T.bitwise_xor(col, (row // 4 % 2) * 4)
        if LSTM:   # NGU = 32 x units / 8: every row on the same banks; 8-column group ^ row bits 0, 1 spreads the
            # stores' 4 rows and the gate math's 2 (16 units) or 4 (8 units) rows of a warp over distinct banks
            return T.bitwise_xor(col, (row % 2) * 16 + (row // 2 % 2) * 8)
        if NGU % 32 == 16:
            return T.bitwise_xor(col, (row // 2 % 2) * 8)
        return col

    @T.macro
    def product_gpu(stage, mbar, bfrag, afrag, acc, red, slot, w, lane, phase):
        """Partial sums of warp w over its k-slice of the chunk in staging slot `slot`, for its n tiles: acc (C
        fragments) -> red[k-group, row, gate row] (k-group w / NS, n tiles from (w % NS) * NNW)."""
        for v in unroll(MT * NNW * 4):
            acc[v] = T.float32(0)
        for part in unroll(PARTS):
            if not DSMEM:   # dsmem: the slot's mbarrier was waited on at the start of the step
                wait_part(mbar, slot, w, part, phase, PARTS - 1 - part + PENDING)
            for kp in unroll(KTW // PARTS):
                for mt in unroll(MT):
                    T.evaluate(T.ptx_legacy.ldmatrix(
                        False, 4, ".b16", afrag.data, 0, stage.access_ptr("r"),
                        soff(slot, k_group(w), mt * 16 + lane % 16, part) + kp * 16 + 8 * (lane // 16), dtype="float16"))
                    for nt in unroll(NNW):
                        T.evaluate(T.ptx_legacy.mma(
                            "m16n8k16", "row", "col", "fp16", "fp16", "fp32", afrag.data, 0, bfrag.data,
                            ((part * KTW // PARTS + kp) * NNW + nt) * 4, acc.data, (mt * NNW + nt) * 4, False,
                            dtype="float32"))
        T.evaluate(T.call_extern("void", "__syncwarp"))   # this slot is refilled two chunks later
        for mt in unroll(MT):
            for nt in unroll(NNW):
                for h in unroll(2):   # C fragment halves: rows lane / 4 and + 8, columns (lane % 4) * 2 + 0, 1
                    row = T.meta_var(mt * 16 + lane // 4 + 8 * h)
                    col = T.meta_var((first_n8(w) + nt) * 8 + (lane % 4) * 2)
                    T.ptx["st.shared.v2.f32"](
                        red.access_ptr("w", offset=(k_group(w) * MC + row) * NGU + red_col(row, col), extent=2),
                        *[acc[(mt * NNW + nt) * 4 + 2 * h + e] for e in range(2)])

    KT = KTW // PARTS   # k16 tiles a commit group
    KCH, CHAIN = cfg.k_chains, NMW * NB8 * 4   # gate_m: accumulator chains, the accumulators of one

    def chain_sum(acc, v):
        return acc[v] + acc[CHAIN + v] if KCH == 2 else acc[v]

    @T.macro
    def state_tiles_gate_m(stage, bfrag, afrag, acc, slot, w, lane, part, kt, tiles, nb):
        """`tiles` (1, 2) k16 tiles from kt of n8 tile nb of the chunk's rows (ldmatrix x2 / x4: lane supplies row
        lane % 8 of 8 x 8 matrix lane / 8) into the accumulators of every m16 gate tile of the warp."""
        T.evaluate(T.ptx_legacy.ldmatrix(
            False, 2 * tiles, ".b16", afrag.data, 0, stage.access_ptr("r"),
            soff(slot, k_group(w), nb * 8 + lane % 8, part) + kt * 16 + 8 * (lane // 8 % (2 * tiles)),
            dtype="float16"))
        for e in unroll(tiles):
            for mt in unroll(NMW):
                T.evaluate(T.ptx_legacy.mma(
                    "m16n8k16", "row", "col", "fp16", "fp16", "fp32", bfrag.data,
                    ((part * KT + kt + e) * NMW + mt) * 8, afrag.data, e * 4, acc.data,
                    ((e % KCH * NMW + mt) * NB8 + nb) * 4, False, dtype="float32"))

    @T.macro
    def product_gate_m(stage, mbar, bfrag, afrag, acc, red, slot, w, lane, phase):
        """gate_m: the partial sums of `product_gpu` with the gate rows as M: R's A fragments (registers) x the
        chunk's state as B fragments, ldmatrix x4 of 8 rows x 32 k (two k16 tiles; x2 for a last odd one), C
        fragment (gate row lane / 4 (+ 8), batch rows 2 (lane % 4) + 0, 1) -> red (scalar stores: the two values a
        lane holds for one gate row are two rows of red)."""
        for v in unroll(NMW * NB8 * 4 * KCH):
            acc[v] = T.float32(0)
        for part in unroll(PARTS):
            if not DSMEM:
                wait_part(mbar, slot, w, part, phase, PARTS - 1 - part + PENDING)
            for kp in unroll(KT // 2):
                for nb in unroll(NB8):
                    state_tiles_gate_m(stage, bfrag, afrag, acc, slot, w, lane, part, 2 * kp, 2, nb)
            if KT % 2 == 1:
                for nb in unroll(NB8):
                    state_tiles_gate_m(stage, bfrag, afrag, acc, slot, w, lane, part, KT - 1, 1, nb)
        T.evaluate(T.call_extern("void", "__syncwarp"))   # this slot is refilled two chunks later
        for mt in unroll(NMW):
            for nb in unroll(NB8):
                for e in unroll(4):   # C: gate row lane / 4 + 8 (e / 2), batch row 2 (lane % 4) + e % 2
                    row = T.meta_var(nb * 8 + (lane % 4) * 2 + e % 2)
                    col = T.meta_var((first_n8(w) + 2 * mt) * 8 + lane // 4 + 8 * (e // 2))
                    red[(k_group(w) * MC + row) * NGU + red_col(row, col)] = chain_sum(
                        acc, (mt * NB8 + nb) * 4 + e)

    # SIMT: a lane's rows (lane % RL + RL i, i < RPL) and its group of CW gate rows (lane / RL)
    RL, RPL, CW, KC = geo.RL, geo.RPL, geo.CW, geo.KC

    @T.macro
    def product_simt(hbuf, stage, mbar, wsm, hv, wv, acc, red, buf, d, c, slot, w, lane, rank, phase):
        """float32: lane = (rows lane % RL + RL i for i < RPL, gate-row group lane / RL), CW gate rows (RL = 16:
        two column halves; a chunk of fewer rows spreads the gate rows over more lanes); k walked in fours: one
        16-byte state read per row and one 16-byte W read per gate row, each W read used for every row the lane
        holds (8 FMAs a load at 32 chunk rows); per commit group as product_gpu."""
        cg = T.meta_var(lane // RL)
        for v in unroll(RPL * CW * KC):
            acc[v] = T.float32(0)
        for part in unroll(PARTS):
            if HALF and part > 0:   # the region is free once this warp's product of the first half is done
                T.evaluate(T.call_extern("void", "__syncwarp"))
                stage_gpu(hbuf, stage, mbar, buf, d, c, slot, w, lane, rank, part)
            if not DSMEM:
                wait_part(mbar, slot, w, part, phase, 0 if HALF else PARTS - 1 - part + PENDING)
            # every operand of a k4 step is loaded into its own registers before its FMAs (one W register set
            # reused per gate row serialised each load behind the previous row's FMAs), and short k loops are
            # unrolled, so the loads of step k4 + 1 can issue under the FMAs of step k4
            for k4 in (unroll if KP // 4 <= SIMT_UNROLL else T.serial)(KP // 4):
                for rr in unroll(RPL):
                    hv[T.ramp(rr * 4, 1, 4)] = stage[T.ramp(soff(slot, w, lane % RL + RL * rr, part) + k4 * 4, 1, 4)]
                for j in unroll(CW):
                    wv[T.ramp(j * 4, 1, 4)] = wsm[T.ramp((cg * CW + j) * WROW + w * KW + part * KP + k4 * 4, 1, 4)]
                for j in unroll(CW):
                    for rr in unroll(RPL):
                        at = T.meta_var((k4 % KC) * RPL * CW + rr * CW + j)
                        acc[at] = (acc[at] + hv[rr * 4] * wv[j * 4] + hv[rr * 4 + 1] * wv[j * 4 + 1]
                                   + hv[rr * 4 + 2] * wv[j * 4 + 2] + hv[rr * 4 + 3] * wv[j * 4 + 3])
        for kc in unroll(1, KC):   # the chains' sums into the first set
            for v in unroll(RPL * CW):
                acc[v] = acc[v] + acc[kc * RPL * CW + v]
        T.evaluate(T.call_extern("void", "__syncwarp"))   # this slot is refilled two chunks later
        for rr in unroll(RPL):
            row = T.meta_var(lane % RL + RL * rr)
            if CW % 4 == 0:
                for j4 in unroll(CW // 4):   # 16-byte stores (red_col keeps 4-column chunks whole)
                    T.ptx["st.shared.v4.f32"](
                        red.access_ptr("w", offset=(w * MC + row) * NGU + red_col(row, cg * CW + 4 * j4), extent=4),
                        *[acc[rr * CW + 4 * j4 + e] for e in range(4)])
            else:   # a small chunk's few gate rows a lane: consecutive lanes, consecutive columns
                for j in unroll(CW):
                    red[(w * MC + row) * NGU + red_col(row, cg * CW + j)] = acc[rr * CW + j]

    @T.macro
    def product_cpu(hbuf, Rw, red, buf, d, g, c):
        """The same partial sums with serial loops (float32 products of the fp16 state and R)."""
        for w, row, col in T.grid(KG, MC, NGU):
            at = T.meta_var((w * MC + row) * NGU + red_col(row, col))
            red[at] = T.float32(0)
            for k in T.serial(KW):
                unit = T.meta_var(g * UB + col % UB)
                kk = T.meta_var(w * KW + k)
                if unit < H and kk < H:
                    red[at] = red[at] + T.Cast("float32", hbuf[hidx(buf, d, c * MC + row, kk)]) * T.Cast(
                        "float32", Rw[d, r_row(g, col), kk])

    def gate_sum(red, row, col):
        total = red[row * NGU + red_col(row, col)]
        for w in range(1, KG):
            total = total + red[(w * MC + row) * NGU + red_col(row, col)]
        return total

    def cell_update(red, gi, d, i, row, u, h):
        if NG == 1:
            return f_act(d, clipf(gi[i * 4] + gate_sum(red, row, u)))
        z = f_act(d, clipf(gi[i * 4] + gate_sum(red, row, u)))
        r = f_act(d, clipf(gi[i * 4 + 1] + gate_sum(red, row, UB + u)))
        hh = g_act(d, clipf(gi[i * 4 + 2] + r * (gate_sum(red, row, 2 * UB + u) + gi[i * 4 + 3])))
        return (T.float32(1) - z) * hh + z * h

    def gate_pre(red, gi, i, row, u):
        """LSTM: pre(q), gate q's input projection plus its recurrent sum for item i (q: 0 i, 1 o, 2 f, 3 c)."""
        return lambda q: gi[i * 4 + q] + gate_sum(red, row, q * UB + u)

    def peep_of(ps, i):
        """LSTM: peep(q), the peephole of gate q (0 i, 1 o, 2 f) of item i's unit; None without peepholes."""
        return (lambda q: ps[i * 3 + q]) if PEEP else None

    @T.macro
    def finish(Y, Lens, hbuf, hst, cst, ps, hoff, red, gi, d, g, t, s, c, ci, seq):
        """Gate math of this thread's (row, unit) items; Y, own state and h_{s+1} (fp16) written (dsmem: not
        h_{s+1}, which `push_state` sends to the peers). LSTM: c' then h' (c' a variable: the o gate's peephole
        and h(c') read it), c' kept in cst."""
        for i in unroll(FI):
            v = T.meta_var(i * NT + t)
            row = T.meta_var(v // UB)
            b = T.meta_var(c * MC + v // UB)
            u = T.meta_var(v % UB)
            j = T.meta_var(g * UB + v % UB)
            if v < ITEMS and b < B and j < H:
                L = T.meta_var(length(Lens, b, seq))
                h = T.meta_var(hst[hoff + ci * FI + i])
                if LSTM:
                    cp = T.meta_var(cst[hoff + ci * FI + i])
                    cn = T.if_then_else(s < L, lstm.cell(lstm_fns, clipf, d, gate_pre(red, gi, i, row, u),
                                                         peep_of(ps, i), cp), cp)
                    hn = T.if_then_else(s < L, lstm.hidden(lstm_fns, clipf, d, gate_pre(red, gi, i, row, u),
                                                           peep_of(ps, i), cn), h)
                    cst[hoff + ci * FI + i] = cn
                else:
                    hn = T.if_then_else(s < L, cell_update(red, gi, d, i, row, u, h), h)
                if has_seq_lens:
                    Y[T.if_then_else(s < L, time_index(d, L, s), s), d, b, j] = T.Cast(
                        dtype, T.if_then_else(s < L, hn, T.float32(0)))
                else:
                    Y[time_index(d, seq, s), d, b, j] = T.Cast(dtype, hn)
                hst[hoff + ci * FI + i] = hn
                if not DSMEM:   # dsmem: `push_state` after this
                    hbuf[hidx((s + 1) % 2, d, b, j)] = T.Cast(dtype, hn)

    @T.macro
    def final_state(Yh, Lens, hst, hoff, d, g, q, t, seq):
        for ci in T.serial(NCB):
            for i in unroll(FI):
                v = T.meta_var(i * NT + t)
                b = T.meta_var((q + ci * BS) * MC + v // UB)
                j = T.meta_var(g * UB + v % UB)
                if v < ITEMS and b < B and j < H:
                    Yh[d, b, j] = T.Cast(dtype, T.if_then_else(length(Lens, b, seq) > 0 and seq > 0,
                                                                   hst[hoff + ci * FI + i], T.float32(0)))

    FLAGS = cfg.flags
    EARLY = cfg.early_gate
    PW = math.ceil(KW / UB)    # producer blocks of a warp's k-slice

    @T.macro
    def wait_producers(flags, d, q, w, s):
        """Warp w waits until the blocks owning units [w*KW, (w+1)*KW) have finished step s - 1."""
        T.evaluate(T.cuda.func_call("tvmseq_flags_wait", T.address_of(flags[(d * BS + q) * G + T.min(w * KW // UB, G - 1)]),
                                    T.max(T.min(PW, G - w * KW // UB), 0), s, source_code=_WAIT_SRC))

    serial_kernel = serial_variant(D, G, BS, NT, NCB, FI, KG * MC * NGU, LSTM, PEEP, seed_state, load_peepholes,
                                   prefetch, product_cpu, finish, final_state)

    # ---- the kernel (`gpu` picks the branch while the script is parsed: one body for both), a GRU / RNN or an
    # LSTM signature around it (RbH: GRU / RNN only; Pw, C0, Yc: LSTM only, None otherwise)
    @T.macro
    def kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, seq):
        hbuf = T.alloc_buffer((2 * buf_words,), dtype, scope="global")
        if gpu:
            if FLAGS:
                flags = T.alloc_buffer((D * BS * G,), "int32", scope="global")
            # clusters (launch attribute) of CS consecutive blocks; extent 1 launches none
            for rank in T.thread_binding(CS, thread="clusterCtaIdx.x"):
              for gb in T.thread_binding(D * G * BS, thread="blockIdx.x"):
                  for t in T.thread_binding(NT, thread="threadIdx.x"):
                    # __launch_bounds__(NT, blocks per SM): ptxas must leave room for a second block of a split
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", PER_SM):
                      stage = T.alloc_buffer((SLOTS * KG * REGION,), dtype, scope="shared.dyn")
                      red = T.alloc_buffer((KG * MC * NGU,), "float32", scope="shared.dyn")
                      hst = T.alloc_buffer((NCB * FI,), "float32", scope="local")
                      acc = T.alloc_buffer((CPL * KC if SIMT else geo.ACC,), "float32", scope="local")
                      gi = T.alloc_buffer((FI * 4,), "float32", scope="local")
                      if LSTM:
                          cst = T.alloc_buffer((NCB * FI,), "float32", scope="local")
                          ps = T.alloc_buffer((3 * FI,), "float32", scope="local")
                      else:
                          cst = T.meta_var(None)
                          ps = T.meta_var(None)
                      mbar = T.alloc_buffer((SLOTS * NW * PARTS,), "uint64", scope="shared")
                      if DSMEM:   # an mbarrier a staging slot
                          dmbar = T.alloc_buffer((2,), "uint64", scope="shared")
                      if SIMT:
                          wsm = T.alloc_buffer((NGU * WROW,), "float32", scope="shared.dyn")
                          hv = T.alloc_buffer((4 * RPL,), "float32", scope="local")
                          wv = T.alloc_buffer((4 * CW,), "float32", scope="local")
                      else:
                          bfrag = T.alloc_buffer((KTW * NNW * 4,), "float16", scope="local")
                          afrag = T.alloc_buffer((8,), "float16", scope="local")
                      d = T.meta_var(gb // (G * BS))
                      # a cluster's blocks share the batch chunks (q) and own consecutive unit groups (g)
                      g = T.meta_var(gb % (G * BS) // BS if CS == 1 else gb % G)
                      q = T.meta_var(gb % BS if CS == 1 else gb % (G * BS) // G)
                      if SIMT:
                          load_w_slice(Rw, wsm, d, g, t)
                      elif GM:
                          load_a_fragments(Rw, bfrag, d, g, t // 32, t % 32)
                      else:
                          load_b_fragments(Rw, bfrag, d, g, t // 32, t % 32)
                      # dsmem: bytes a block receives a step (its chunk's rows x all units, from the whole cluster)
                      in_bytes = T.meta_var(T.max(T.min(B - q * MC, MC), 0) * math.ceil(H / SEND) * SEND_BYTES)
                      if DSMEM:   # slots zeroed (padding stays zero), each slot's mbarrier initialised and armed for
                          # its first state (h0 in slot 0, h1 in slot 1) before any peer sends into it
                          for i in T.serial(math.ceil(SLOTS * KG * REGION / NT)):
                              if i * NT + t < SLOTS * KG * REGION:
                                  stage[i * NT + t] = T.Cast(dtype, 0)
                          if t == 0:
                              for slot in T.serial(2):
                                  T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(dmbar[slot]), T.uint32(1))
                              T.ptx["fence.mbarrier_init.release.cluster"]()
                          T.ptx["barrier.cluster.arrive.release"]()
                          T.ptx["barrier.cluster.wait.acquire"]()
                          if t == 0 and in_bytes > 0:
                              for slot in T.serial(2):
                                  T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](T.address_of(dmbar[slot]),
                                                                                     T.Cast("uint32", in_bytes))
                      seed_state(H0, hst, hbuf, 0, d, g, q, t, True)
                      if LSTM:
                          seed_state(C0, cst, None, 0, d, g, q, t, False)
                      if PEEP:
                          load_peepholes(Pw, ps, d, g, t)
                      if DSMEM:
                          push_state(stage, dmbar, hst, 0, q, g, t)
                      if BULK:
                          if t % 32 == 0:
                              for slot, part in T.grid(SLOTS, PARTS):
                                  T.ptx["mbarrier.init.shared::cta.b64"](
                                      T.address_of(mbar[(slot * NW + t // 32) * PARTS + part]), T.uint32(1))
                              T.ptx["fence.mbarrier_init.release.cluster"]()
                          # every block's barriers initialised before any peer multicasts into it (with cluster_sync
                          # the step barrier below, itself a cluster barrier, already sees to that)
                          if MCS > 1 and not CSYNC:
                              T.ptx["barrier.cluster.arrive.release"]()
                              T.ptx["barrier.cluster.wait.acquire"]()
                      if FLAGS:
                          if t == 0:
                              flags[(d * BS + q) * G + g] = 0
                      if EARLY:
                          if seq > 0:   # gate_i of step 0 (a 0-step call has none)
                              prefetch(GI, RbH, Lens, gi, d, g, t, 0, q, seq)
                      step_barrier()
                      for s in T.serial(seq):
                          if FLAGS:
                              wait_producers(flags, d, q, t // 32, s)
                          if SLOTS == 2 and not DSMEM:
                              stage_gpu(hbuf, stage, mbar, s % 2, d, q, 0, t // 32, t % 32, rank)
                          for ci in T.serial(NCB):
                              if not EARLY:
                                  prefetch(GI, RbH, Lens, gi, d, g, t, s, q + ci * BS, seq)
                              if MCS > 1:   # the slot refilled next was read by chunk ci - 1: every peer is done
                                  if ci > 0:
                                      T.ptx["barrier.cluster.wait.acquire"]()
                              if not DSMEM:
                                  stage_gpu(hbuf, stage, mbar, s % 2, d, q + (ci + SLOTS - 1) * BS,
                                            (ci + SLOTS - 1) % SLOTS, t // 32, t % 32, rank)
                              # the chunks staged through slot ci % SLOTS before this one (bulk barrier parity)
                              phase = T.meta_var(s * ((NCB + SLOTS - 1 - ci % SLOTS) // SLOTS) + ci // SLOTS)
                              slot = T.meta_var(s % 2 if DSMEM else ci % SLOTS)   # dsmem: by step parity
                              if DSMEM:   # this step's state has landed (all peers' bytes for slot s % 2)
                                  if in_bytes > 0:
                                      T.evaluate(T.cuda.mbarrier_wait(T.address_of(dmbar[s % 2]), s // 2 % 2))
                              if SIMT:
                                  product_simt(hbuf, stage, mbar, wsm, hv, wv, acc, red, s % 2, d, q + ci * BS,
                                               slot, t // 32, t % 32, rank, phase)
                              elif GM:
                                  product_gate_m(stage, mbar, bfrag, afrag, acc, red, slot, t // 32, t % 32, phase)
                              else:
                                  product_gpu(stage, mbar, bfrag, afrag, acc, red, slot, t // 32, t % 32, phase)
                              if MCS > 1:
                                  if ci < NCB - 1:
                                      T.ptx["barrier.cluster.arrive.release"]()
                              T.tvm_storage_sync("shared")
                              if DSMEM:   # every thread is past this slot's wait: arm the slot's next phase (h_{s+2})
                                  if t == 0 and in_bytes > 0:
                                      T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](
                                          T.address_of(dmbar[s % 2]), T.Cast("uint32", in_bytes))
                              finish(Y, Lens, hbuf, hst, cst, ps, 0, red, gi, d, g, t, s, q + ci * BS, ci, seq)
                              if DSMEM:
                                  if s + 1 < seq:
                                      push_state(stage, dmbar, hst, (s + 1) % 2, q, g, t)
                              if EARLY:   # the next chunk's, or step s + 1's first (clamped past the last step)
                                  prefetch(GI, RbH, Lens, gi, d, g, t, T.if_then_else(ci + 1 < NCB, s, s + 1),
                                           q + (ci + 1) % NCB * BS, seq)
                              T.tvm_storage_sync("shared")
                          if FLAGS:
                              if t == 0:
                                  T.evaluate(T.cuda.func_call("tvmseq_flag_publish",
                                                              T.address_of(flags[(d * BS + q) * G + g]), s + 1,
                                                              source_code=_PUBLISH_SRC))
                          elif not DSMEM:   # dsmem: no barrier, each block waits on its own slot's mbarrier
                              step_barrier()
                      if DSMEM:   # no block leaves while sends into it may be in flight: every send was waited for
                          # by its receiver (the last step sends nothing), except h0's when there is no step at all
                          if seq == 0 and in_bytes > 0:
                              T.evaluate(T.cuda.mbarrier_wait(T.address_of(dmbar[0]), 0))
                          T.ptx["barrier.cluster.arrive.release"]()
                          T.ptx["barrier.cluster.wait.acquire"]()
                      final_state(Yh, Lens, hst, 0, d, g, q, t, seq)
                      if LSTM:
                          final_state(Yc, Lens, cst, 0, d, g, q, t, seq)
        else:
            serial_kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, hbuf, seq)

    main = cells.recurrence_prim_func(kernel, cell, D, B, H, dtype)
    return rg.scheduled(main, f"{cell}_recurrence_mma", cooperative=gpu and not CSYNC)
