"""The float16 input projection on Hopper with TMA loads and warp specialization, hand-scheduled in TIRx.

gate_i[d, m, n] = sum_k X[m, k] W[d, n, k] + bias[d, n]: the interface of `projection_wgmma` (and of
`projection_mma`), whose every thread issued 16-byte cp.async copies and met at a __syncthreads each k step
(428-495 TFLOP/s, 0.69-0.73x cuBLAS at the GRU input GEMM's shapes, `artifacts/bench/tc_projection_sweep.json`).

Here a block is 1 + BM/64 warpgroups. Warpgroup 0 is the producer: one thread walks K, waits until a stage is
free (its `empty` mbarrier), arms the stage's `full` mbarrier with the stage's byte count and issues two TMA
tile loads (cp.async.bulk.tensor.2d: X rows [m0, m0 + BM) and W rows [n0, n0 + BN) of the k slice). The tensor
maps are encoded on the host (cuTensorMapEncodeTiled through TVM's runtime) with the 128-byte swizzle, so a
stage lands in exactly the layout the wgmma descriptors of `projection_wgmma` describe. Each consumer
warpgroup owns 64 rows: it waits for a stage's `full` barrier, runs the four m64nBNk16 wgmmas of the k slice,
and once the previous slice's group has retired (wgmma.wait_group 1) hands that stage back (one arrival per
warpgroup on `empty`). No block-wide barrier in the main loop: loads run STAGES - 1 slices ahead of the math.
Rows past the end of X read as zeros (the TMA's out-of-bounds fill) and are not stored.

Needs N % BN == 0, K % 64 == 0 and 16-byte aligned rows (K % 8 == 0, implied); sm_90a only. The CPU variant
is `projection_mma`'s loop nest (the interface's numerics); the layouts are checked on the GPU by
`scripts/tc_projection_sweep.py` and `tests/test_projection_tma.py -m gpu`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TvmseqError
from .projection_mma import projection_mma_func, weight_misfit
from .projection_wgmma import ATOM, BK, align_offset, warpgroup_tile_macros

SWIZZLE_128B_MAP = 3        # CU_TENSOR_MAP_SWIZZLE_128B
L2_PROMOTION_128B = 2       # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
MAX_BOX = 256               # a TMA box is at most 256 elements along each dimension
ACC_OVERHEAD = 32           # a consumer's registers besides its accumulators (descriptors, indices, the epilogue)


@dataclass(frozen=True)
class TmaTile:
    bm: int = 128      # rows per block: 64 per consumer warpgroup
    bn: int = 256      # gate rows per block: the wgmma N (a multiple of 8, <= 256)
    stages: int = 4    # shared-memory stages of (bm + bn) x 64 halfs

    @property
    def consumers(self) -> int:
        return self.bm // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * BK * 2 + ATOM   # + slack to align the first tile


def supports(N: int, K: int, tile: TmaTile = TmaTile()) -> str | None:
    """Why the kernel cannot run an N x K weight (None: it can)."""
    if tile.bm % 64 or not 64 <= tile.bm <= MAX_BOX or tile.bn % 8 or not 8 <= tile.bn <= MAX_BOX:
        return f"tile {tile}: bm a multiple of 64 up to {MAX_BOX}, bn a multiple of 8 up to {MAX_BOX}"
    if tile.bn // 2 + ACC_OVERHEAD > min(255, 65536 // tile.threads):
        # wgmma wants its BN / 2 accumulators in registers; ptxas refuses an instruction that does not fit
        return (f"tile {tile}: {tile.bn // 2} accumulators + ~{ACC_OVERHEAD} registers a thread > "
                f"{min(255, 65536 // tile.threads)} at {tile.threads} threads")
    if tile.stages < 2:
        return f"tile {tile}: 2+ stages"
    if tile.smem_bytes() > 227 * 1024:
        return f"tile {tile}: {tile.smem_bytes()} B of shared memory > 227 KB"
    return weight_misfit(N, K, tile.bn, BK)


def projection_tma_func(D: int, N: int, K: int, gpu: bool = True, tile: TmaTile = TmaTile()):
    """prim_func(X [rows, K] fp16, W [D, N, K] fp16, bias [D, N] f32, gate_i [D, rows, N] f32)."""
    from tvm.script import tirx as T

    why = supports(N, K, tile)
    if why:
        raise TvmseqError(f"TMA projection: {why}")
    if not gpu:
        return projection_mma_func(D, N, K, gpu=False)
    BM, BN, S, NT, NC = tile.bm, tile.bn, tile.stages, tile.threads, tile.consumers
    ACC = BN // 2                      # float32 accumulators a consumer thread
    KT = K // BK
    A_ELEMS, B_ELEMS = BM * BK, BN * BK
    STAGE = A_ELEMS + B_ELEMS          # halfs a stage (a multiple of 512 halfs = 1 KB)
    unroll = T.unroll
    k_slice, store_rows = warpgroup_tile_macros(BN)

    def tma_load(smem, offset, extent, tmap, k, row, bar):
        return T.ptx["cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"](
            smem.access_ptr("w", offset=offset, extent=extent), T.address_of(tmap), T.Cast("int32", k),
            T.Cast("int32", row), T.address_of(bar))

    @T.prim_func
    def main(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        rows = T.int32()
        Xb = T.match_buffer(x, (rows, K), "float16")
        Wb = T.match_buffer(w, (D, N, K), "float16")
        Bias = T.match_buffer(bias, (D, N), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, N), "float32")
        # host: the tensor maps (innermost dimension first): X as [rows][K], W as [D * N][K], boxes of 64 k x rows
        x_map: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(x_map, Xb.data, K, rows, K * 2, BK, BM, 1, 1, descriptor_dtype="float16", rank=2,
                                 interleave=0, swizzle=SWIZZLE_128B_MAP, l2_promotion=L2_PROMOTION_128B, oob_fill=0,
                                 force_cu_dtype=-1)
        w_map: T.let[T.TensorMap()] = T.tvm_stack_alloca("tensormap", 1)
        T.tensormap_encode_tiled(w_map, Wb.data, K, D * N, K * 2, BK, BN, 1, 1, descriptor_dtype="float16", rank=2,
                                 interleave=0, swizzle=SWIZZLE_128B_MAP, l2_promotion=L2_PROMOTION_128B, oob_fill=0,
                                 force_cu_dtype=-1)
        # blockIdx.x walks the gate-row tiles: the blocks running together share X rows (read from DRAM once)
        for bz in T.thread_binding(D, thread="blockIdx.z"):
            for bx in T.thread_binding((rows + BM - 1) // BM, thread="blockIdx.y"):
                for by in T.thread_binding(N // BN, thread="blockIdx.x"):
                    for t in T.thread_binding(NT, thread="threadIdx.x"):
                        smem = T.alloc_buffer((S * STAGE + ATOM // 2,), "float16", scope="shared.dyn")
                        full = T.alloc_buffer((S,), "uint64", scope="shared")
                        empty = T.alloc_buffer((S,), "uint64", scope="shared")
                        acc = T.alloc_buffer((ACC,), "float32", scope="local")
                        da = T.alloc_buffer((1,), "uint64", scope="local")
                        db = T.alloc_buffer((1,), "uint64", scope="local")
                        off = T.alloc_buffer((1,), "int32", scope="local")
                        off[0] = align_offset(smem)
                        base = T.meta_var(off[0])
                        if t == 0:
                            for s in T.serial(S):
                                T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(full[s]), T.uint32(1))
                                T.ptx["mbarrier.init.shared::cta.b64"](T.address_of(empty[s]), T.uint32(NC))
                            T.ptx["fence.mbarrier_init.release.cluster"]()
                        T.tvm_storage_sync("shared")
                        if t < 128:
                            if t == 0:   # the producer: one thread issues every load of the block
                                for kt in T.serial(KT):
                                    if kt >= S:   # round kt // S - 1 of this stage handed back by every consumer
                                        T.evaluate(T.cuda.mbarrier_wait(T.address_of(empty[kt % S]),
                                                                        (kt // S - 1) % 2))
                                    T.ptx["mbarrier.arrive.expect_tx.shared::cta.b64"](
                                        T.address_of(full[kt % S]), T.uint32(STAGE * 2))
                                    T.evaluate(tma_load(smem, base + kt % S * STAGE, A_ELEMS, x_map, kt * BK,
                                                        bx * BM, full[kt % S]))
                                    T.evaluate(tma_load(smem, base + kt % S * STAGE + A_ELEMS, B_ELEMS, w_map,
                                                        kt * BK, bz * N + by * BN, full[kt % S]))
                        else:
                            wg = T.meta_var(t // 128 - 1)
                            for v in unroll(ACC):
                                acc[v] = T.float32(0)
                            for kt in T.serial(KT):
                                T.evaluate(T.cuda.mbarrier_wait(T.address_of(full[kt % S]), kt // S % 2))
                                T.ptx["wgmma.fence.sync.aligned"]()
                                k_slice(smem, acc, da, db, base + kt % S * STAGE + wg * 64 * BK,
                                        base + kt % S * STAGE + A_ELEMS, kt)
                                T.ptx["wgmma.commit_group.sync.aligned"]()
                                T.ptx["wgmma.wait_group.sync.aligned"](1)
                                if kt > 0:   # slice kt - 1's wgmmas have retired: its stage is free
                                    if t % 128 == 0:
                                        T.ptx["mbarrier.arrive.shared::cta.b64"](T.address_of(empty[(kt - 1) % S]))
                            T.ptx["wgmma.wait_group.sync.aligned"](0)
                            store_rows(GateI, Bias, acc, bz, bx * BM + wg * 64, by * BN, rows, t)

    return main.with_attrs({"tirx.is_scheduled": True, "global_symbol": "gru_input_projection",
                            "tirx.noalias": True})
