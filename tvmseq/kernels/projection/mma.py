"""The float16 input projection on tensor cores, hand-scheduled in TIRx: mma.sync m16n8k16 (fp16 x fp16 ->
fp32), ldmatrix fragments, a multi-stage cp.async pipeline.

gate_i[d, m, n] = sum_k X[m, k] W[d, n, k] + bias[d, n] over the flat m = (t, b) rows (symbolic), the
interface of `gemm.flat_projection_func`. Why not the wmma rule (`TensorCoreProjection`, dlight's
MatmulTensorization with its tiles as data): its nine tiles measured 150-207 TFLOP/s on the H100, 0.25-0.32x
cuBLAS, at the GRU input GEMM's shapes (H100, 2026-11-22; notes/persistent.md); wmma fragments go
through shared memory on the way out and the rule's pipeline is fixed.

Block tile BM x BN (rows x gate rows), K walked BK at a time through STAGES shared-memory stages filled by
16-byte cp.async (rows of the last M tile clamped to the last row: computed, never stored); warps_m x
warps_n warps, each a (BM / warps_m) x (BN / warps_n) tile of m16n8 accumulators. A fragments: one
ldmatrix.x4 per m16 tile and k16; B fragments (W rows are the n axis, k contiguous: already the "col"
operand): one ldmatrix.x4 per pair of n8 tiles and k16. Shared rows are padded by 8 halfs so the eight
16-byte rows of an ldmatrix phase fall on distinct banks. Needs N % BN == 0 and K % BK == 0 (the GRU/RNN
shapes: 3H and I multiples of 128 and 32); `supports` says so, and the caller falls back to the wmma rule.

The CPU variant is the plain loop nest (the numerics of the interface); the fragment layouts and the
epilogue are checked on the GPU by the float16 whole-model tests (`tests/test_gpu_models.py`); the tile sweep
against cuBLAS that chose the default tile is in notes/step_gemm.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import TvmseqError


@dataclass(frozen=True)
class MmaGemmTile:
    """Tile constants of the tensor-core projection (what a tuner would search)."""

    bm: int = 128
    bn: int = 128
    bk: int = 32
    warps_m: int = 2
    warps_n: int = 4
    stages: int = 3

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def smem_bytes(self) -> int:
        return 2 * self.stages * (self.bm + self.bn) * (self.bk + 8)


def supports(N: int, K: int, tile: MmaGemmTile = MmaGemmTile()) -> str | None:
    """Why the kernel cannot run an N x K weight (None: it can)."""
    wm, wn = tile.bm // tile.warps_m, tile.bn // tile.warps_n
    if wm % 16 or wn % 16 or tile.bk % 16 or tile.bm % tile.warps_m or tile.bn % tile.warps_n:
        return f"tile {tile}: warp tiles must be multiples of 16 and bk of 16"
    if tile.bm * tile.bk // 8 % tile.threads or tile.bn * tile.bk // 8 % tile.threads:
        # the A and the W copies are two separate loops of whole rounds over the threads
        return f"tile {tile}: the 16-byte copies of a stage do not split evenly over {tile.threads} threads"
    return weight_misfit(N, K, tile.bn, tile.bk)


def weight_misfit(N: int, K: int, bn: int, bk: int) -> str | None:
    """Why an N x K weight does not split into whole bn-row, bk-column tiles (None: it does); the tensor-core
    projections (this one and `wgmma`) take whole tiles only."""
    if N % bn or K % bk:
        return f"N={N} (gate rows) must be a multiple of {bn} and K={K} (input size) of {bk}"
    return None


def projection_mma_func(D: int, N: int, K: int, gpu: bool = True, tile: MmaGemmTile = MmaGemmTile()):
    """prim_func(X [rows, K] fp16, W [D, N, K] fp16, bias [D, N] f32, gate_i [D, rows, N] f32)."""
    from tvm.script import tirx as T

    why = supports(N, K, tile)
    if why:
        raise TvmseqError(f"tensor-core projection: {why}")
    BM, BN, BK, S, NT = tile.bm, tile.bn, tile.bk, tile.stages, tile.threads
    WM, WN = BM // tile.warps_m, BN // tile.warps_n
    MT, NT8 = WM // 16, WN // 8              # m16 tiles and n8 tiles per warp
    SR = BK + 8                              # padded shared row (halfs)
    KT = K // BK
    A_CH = BM * BK // 8                      # 16-byte chunks of an A stage (B: BN * BK // 8)
    B_OFF = S * BM * SR                      # B stages after the A stages
    unroll = T.unroll

    @T.macro
    def load_stage(Xb, Wb, smem, rows, d, m0, n0, kt, st, t):
        """Stage st <- A rows [m0, m0 + BM) and W rows [n0, n0 + BN) of k slice kt (nothing past the last
        slice, but the group is committed: the waits count one group per slice)."""
        if kt < KT:
            for i in unroll(A_CH // NT):
                q = T.meta_var(i * NT + t)
                r = T.meta_var(q // (BK // 8))
                c = T.meta_var((q % (BK // 8)) * 8)
                T.evaluate(T.s_tir.cp_async_raw.legacy(
                    smem.access_ptr("w"), (st * BM + r) * SR + c,
                    Xb.data, T.min(m0 + r, rows - 1) * K + kt * BK + c, 16, dtype="float16"))
            for i in unroll(BN * BK // 8 // NT):
                q = T.meta_var(i * NT + t)
                r = T.meta_var(q // (BK // 8))
                c = T.meta_var((q % (BK // 8)) * 8)
                T.evaluate(T.s_tir.cp_async_raw.legacy(
                    smem.access_ptr("w"), B_OFF + (st * BN + r) * SR + c,
                    Wb.data, (d * N + n0 + r) * K + kt * BK + c, 16, dtype="float16"))
        T.evaluate(T.ptx["cp.async.commit_group"]())

    @T.macro
    def compute_stage(smem, afrag, bfrag, acc, st, wm, wn, lane):
        for kk in unroll(BK // 16):
            for mt in unroll(MT):
                T.evaluate(T.ptx_legacy.ldmatrix(
                    False, 4, ".b16", afrag.data, mt * 8, smem.access_ptr("r"),
                    (st * BM + wm * WM + mt * 16 + lane % 16) * SR + kk * 16 + 8 * (lane // 16), dtype="float16"))
            for np_ in unroll(NT8 // 2):
                # matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): n8 tile
                # 2 np_ gets halfs 0-3 (b0 b1, b2 b3), tile 2 np_ + 1 halfs 4-7
                T.evaluate(T.ptx_legacy.ldmatrix(
                    False, 4, ".b16", bfrag.data, np_ * 8, smem.access_ptr("r"),
                    B_OFF + (st * BN + wn * WN + np_ * 16 + lane % 8 + 8 * (lane // 16)) * SR
                    + kk * 16 + 8 * ((lane // 8) % 2), dtype="float16"))
            for mt in unroll(MT):
                for nt in unroll(NT8):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", "fp16", "fp16", "fp32", afrag.data, mt * 8, bfrag.data, nt * 4,
                        acc.data, (mt * NT8 + nt) * 4, False, dtype="float32"))

    from ...onnx.checks import index_limit_check

    check_rows = index_limit_check(f"mma input projection (K {K}, {D} x {N} gate rows)", max(K, D * N), "row")

    @T.prim_func
    def main(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        rows = T.int32()
        Xb = T.match_buffer(x, (rows, K), "float16")
        Wb = T.match_buffer(w, (D, N, K), "float16")
        Bias = T.match_buffer(bias, (D, N), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, N), "float32")
        check_rows(rows)
        if gpu:   # a compile-time branch: one signature for both variants
            for bz in T.thread_binding(D, thread="blockIdx.z"):
                for by in T.thread_binding(N // BN, thread="blockIdx.y"):
                    for bx in T.thread_binding((rows + BM - 1) // BM, thread="blockIdx.x"):
                        for t in T.thread_binding(NT, thread="threadIdx.x"):
                            smem = T.alloc_buffer((S * (BM + BN) * SR,), "float16", scope="shared.dyn")
                            afrag = T.alloc_buffer((MT * 8,), "float16", scope="local")
                            bfrag = T.alloc_buffer((NT8 * 4,), "float16", scope="local")
                            acc = T.alloc_buffer((MT * NT8 * 4,), "float32", scope="local")
                            wm = T.meta_var(t // 32 // tile.warps_n)
                            wn = T.meta_var(t // 32 % tile.warps_n)
                            lane = T.meta_var(t % 32)
                            for v in unroll(MT * NT8 * 4):
                                acc[v] = T.float32(0)
                            for st in unroll(S - 1):
                                load_stage(Xb, Wb, smem, rows, bz, bx * BM, by * BN, st, st, t)
                            for kt in T.serial(KT):
                                T.evaluate(T.ptx["cp.async.wait_group"](S - 2))
                                T.tvm_storage_sync("shared")
                                # slice kt + S - 1 refills the stage slice kt - 1 used: everyone is past it
                                load_stage(Xb, Wb, smem, rows, bz, bx * BM, by * BN, kt + S - 1, (kt + S - 1) % S, t)
                                compute_stage(smem, afrag, bfrag, acc, kt % S, wm, wn, lane)
                            # a lane's C fragment holds column pairs (n, n + 1): one 8-byte store each
                            for mt in unroll(MT):
                                for nt in unroll(NT8):
                                    for h in unroll(2):
                                        r = T.meta_var(bx * BM + wm * WM + mt * 16 + lane // 4 + 8 * h)
                                        n = T.meta_var(by * BN + wn * WN + nt * 8 + (lane % 4) * 2)
                                        if r < rows:
                                            GateI[bz, r, T.ramp(n, 1, 2)] = (acc[T.ramp((mt * NT8 + nt) * 4 + 2 * h, 1, 2)]
                                                                             + Bias[bz, T.ramp(n, 1, 2)])
        else:
            for d, m, n in T.grid(D, rows, N):
                GateI[d, m, n] = Bias[d, n]
                for k in T.serial(K):
                    GateI[d, m, n] = GateI[d, m, n] + T.Cast("float32", Xb[m, k]) * T.Cast("float32", Wb[d, n, k])

    return main.with_attrs({"tirx.is_scheduled": True, "global_symbol": "gru_input_projection",
                            "tirx.noalias": True})

