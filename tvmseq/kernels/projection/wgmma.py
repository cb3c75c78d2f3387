"""The float16 input projection on Hopper's warpgroup tensor cores (wgmma), hand-scheduled in TIRx.

gate_i[d, m, n] = sum_k X[m, k] W[d, n, k] + bias[d, n] over the flat m = (t, b) rows (symbolic): the
interface of `mma` (mma.sync), which reached 250 TFLOP/s, 0.40x cuBLAS, at the GRU input GEMM's
shapes. wgmma reads both operands straight from shared memory (no ldmatrix, no fragment registers) and runs
64 x BN x 16 per instruction for a whole warpgroup.

Block tile BM x BN, one consumer warpgroup (128 threads) per 64 rows; K walked 64 at a time (one 128-byte
row of fp16 per tile row) through STAGES shared-memory stages filled by 16-byte cp.async, every thread
copying. The tiles are stored in the 128-byte swizzle layout wgmma's descriptors describe (16-byte chunk c of
row r at chunk c ^ (r % 8), 8-row atoms of 1 KB, each tile 1 KB aligned); a k16 step advances the descriptor's
start address by 32 bytes. A stage's copies land through the generic proxy and wgmma reads through the async
proxy, hence the proxy fence before the barrier that publishes a stage. Accumulators: BN / 2 float32 registers
a thread, the m16n8 C-fragment layout per 8 columns; the epilogue adds the bias and stores column pairs: float32,
or with gate_dtype="float16" rounded once to half (half the bytes written here and read by the recurrence a step).

Needs N % BN == 0 and K % 64 == 0 (`supports`); sm_90a only (the caller checks the target). The CPU variant
is `mma`'s loop nest (the interface's numerics; with float16 gate_i `projection_cpu_func`); the layouts
are checked on the GPU by the float16 whole-model tests (`tests/test_gpu_models.py`) and the float16-gate_i case
of `tests/test_persistent_wgmma.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import TvmseqError
from .mma import projection_mma_func, weight_misfit

BK = 64            # k per stage: one 128-byte swizzle row of fp16
CPR = BK // 8      # 16-byte chunks a tile row (the swizzle permutes them within 8-row atoms)
SWIZZLE_128B = 3   # T.cuda.wgmma_encode_matrix_descriptor's code for the 128-byte swizzle
ATOM = 1024        # bytes of an 8-row swizzle atom: the descriptor's stride between row groups
SMEM_PER_BLOCK = 227 * 1024   # sm_90's dynamic shared memory a block


def mma_async(n, acc, da, db, accumulate, operand: str = "float16"):
    """wgmma m64n{n}k16 (f32 += f16 x f16; operand "tf32": m64n{n}k8, f32 += tf32 x tf32) on the n / 2 float32
    accumulators acc, A and B from the shared-memory matrix descriptors da[0], db[0], both K-major; accumulate
    False overwrites. Either way one instruction covers 32 bytes of k (a descriptor step)."""
    from tvm.script import tirx as T

    accs = [acc[i] for i in range(n // 2)]
    if operand == "tf32":   # no transpose immediates: tf32 operands are K-major only
        return T.ptx[f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32"](
            *accs, da[0], db[0], T.ptx.pred(accumulate), 1, 1)
    return T.ptx[f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16"](
        *accs, da[0], db[0], T.ptx.pred(accumulate), 1, 1, 0, 0)


def encode_descriptor(desc, address):
    """desc[0] <- the matrix descriptor of a 128-byte-swizzled, 1 KB-atom K-major tile starting at `address`."""
    from tvm.script import tirx as T

    return T.evaluate(T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[0]), address, 1, ATOM // 16,
                                                            SWIZZLE_128B))


def align_offset(smem):
    """Halfs from a dynamic shared buffer's start to its first 1 KB boundary (where the swizzled tiles start).
    Compute it once into a local outside any condition: ThreadSync cannot place a barrier for a read of the
    buffer's address inside one."""
    from tvm.script import tirx as T

    return (ATOM - T.Cast("int32", T.cuda.cvta_generic_to_shared(smem.access_ptr("r"))) % ATOM) % ATOM // 2


def warpgroup_tile_macros(BN: int, gate_dtype: str = "float32", operand: str = "float16", n_valid: int | None = None):
    """(k_slice, store_rows): the TIR macros a 64 x BN warpgroup tile of the projection is made of.
      k_slice(smem, acc, da, db, a_off, b_off, kt): the four wgmmas (m64nBNk16; tf32: k8) of k slice kt, A (64 rows)
        and B (BN gate rows) from the 128-byte-swizzled tiles at half offsets a_off and b_off (the shared buffer
        is addressed in halfs whatever the operands hold); slice 0 overwrites acc.
      store_rows(GateI, Bias, acc, d, row0, n0, rows, t): the accumulators (the m16n8 C-fragment layout per 8
        columns) plus the bias into gate_i rows [row0, row0 + 64) < rows, columns [n0, n0 + BN), as column pairs; a
        float16 gate_i gets the fp32 sum rounded once (a pair of halves: one 4-byte store). With n_valid (an N
        that BN does not divide: W's rows zero-padded to whole tiles) only the columns below it; an odd one stores
        one value at a time."""
    from tvm.script import tirx as T

    def stored(pair):
        # float32 returns the expression untouched: the default kernel's code stays what it was
        return pair if gate_dtype == "float32" else T.Cast(f"{gate_dtype}x2", pair)

    @T.macro
    def k_slice(smem, acc, da, db, a_off, b_off, kt):
        # the slice's two descriptors encoded once, then stepped 32 bytes (2 units of the 16-byte start address
        # field) an instruction: encoding each took ~20 uniform-datapath instructions a wgmma
        encode_descriptor(da, T.address_of(smem[a_off]))
        encode_descriptor(db, T.address_of(smem[b_off]))
        for kk in T.unroll(BK // 16):   # an instruction a 32-byte step: k16 of float16, k8 of tf32
            T.evaluate(mma_async(BN, acc, da, db, kt * 4 + kk > 0, operand))
            if kk + 1 < BK // 16:
                da[0] = da[0] + T.uint64(2)
                db[0] = db[0] + T.uint64(2)

    def in_bounds(r, n, rows):
        # the column test only where BN does not divide N (an even n_valid: a pair is all in or all out); without
        # it the condition is the row test alone, as it always was
        return r < rows if n_valid is None else T.And(r < rows, n < n_valid)

    def stored_one(value):
        return value if gate_dtype == "float32" else T.Cast(gate_dtype, value)

    ODD = n_valid is not None and n_valid % 2 == 1   # (a Python bool) rows of an odd length: a pair would be
                                                     # misaligned every other row, so one value a store

    @T.macro
    def store_rows(GateI, Bias, acc, d, row0, n0, rows, t):
        for j in T.unroll(BN // 8):
            for h in T.unroll(2):
                r = T.meta_var(row0 + (t % 128) // 32 * 16 + t % 32 // 4 + 8 * h)
                n = T.meta_var(n0 + j * 8 + (t % 4) * 2)
                if ODD:
                    for e in T.unroll(2):
                        if T.And(r < rows, n + e < n_valid):
                            GateI[d, r, n + e] = stored_one(acc[j * 4 + 2 * h + e] + Bias[d, n + e])
                elif in_bounds(r, n, rows):
                    GateI[d, r, T.ramp(n, 1, 2)] = stored(acc[T.ramp(j * 4 + 2 * h, 1, 2)] + Bias[d, T.ramp(n, 1, 2)])

    return k_slice, store_rows


@dataclass(frozen=True)
class WgmmaTile:
    bm: int = 128      # rows per block: 64 per consumer warpgroup
    bn: int = 128      # gate rows per block: the wgmma N (a multiple of 8, <= 256)
    stages: int = 3
    inflight: bool = False   # keep one k step's wgmma group running across the next barrier (prefetch
                             # distance stages - 2: the stage a copy refills was read two steps before)
    promote: int = 0   # k steps a chunk: the tensor cores' sum of each chunk added into float32 registers by
                       # the CUDA cores (0: never). Tensor cores truncate as they accumulate, so over a long K
                       # (tf32x3 walks it three times) their error grows with K; chunks keep it at a chunk's
                       # length. Needs BN / 2 more registers a thread.
    both_planes: bool = False   # tf32x3: a stage holds the high and low tiles of X and of W, and a k step runs
                                # the three products from that one load (else each pass over K loads its own
                                # pair of tiles: 1.5x the bytes through shared memory, 3x the k steps); the two
                                # small products summed apart over all of K (BN / 2 more registers), hi x hi in
                                # promoted chunks

    @property
    def threads(self) -> int:
        return 128 * (self.bm // 64)

    def smem_bytes(self) -> int:
        planes = 2 if self.both_planes else 1
        return self.stages * planes * (self.bm + self.bn) * BK * 2 + ATOM   # + slack to align the first tile


def supports(N: int, K: int, tile: WgmmaTile = WgmmaTile(), elem_bytes: int = 2) -> str | None:
    """Why the kernel cannot run an N x K weight of elem_bytes elements (2: float16, 4: tf32x3) (None: it can)."""
    if tile.bm % 64 or tile.bn % 8 or not 8 <= tile.bn <= 256:
        return f"tile {tile}: bm a multiple of 64, bn a multiple of 8 up to 256"
    if tile.bn * CPR % tile.threads:
        # the W copies are whole rounds over the threads (the X copies always are: bm * 8 / (2 bm) rounds);
        # a remainder would leave W rows of every stage unloaded
        return f"tile {tile}: the {tile.bn * CPR} 16-byte W copies of a stage do not split over {tile.threads} threads"
    if tile.stages < (3 if tile.inflight else 2):
        return f"tile {tile}: {3 if tile.inflight else 2}+ stages"
    if tile.promote and tile.bn > 128:
        return f"tile {tile}: promoted chunks need bn <= 128 (2 x bn / 2 float32 accumulators a thread)"
    if tile.both_planes and (elem_bytes != 4 or not tile.promote):
        return f"tile {tile}: both planes in a stage are tf32x3's, with promoted chunks"
    if tile.smem_bytes() > SMEM_PER_BLOCK:
        return f"tile {tile}: {tile.smem_bytes()} B of shared memory a block > {SMEM_PER_BLOCK}"
    return weight_misfit(N, K, tile.bn, 128 // elem_bytes)


GATE_DTYPES = ("float32", "float16")   # gate_i storage; float16 halves the epilogue's (and the recurrence's) traffic


def projection_cpu_func(D: int, N: int, K: int, gate_dtype: str):
    """The CPU variant with a gate_i of gate_dtype: the float32 sum plus the bias, rounded once (the epilogue's
    numerics). float32 is `mma`'s loop nest, as before."""
    from tvm.script import tirx as T

    if gate_dtype == "float32":
        return projection_mma_func(D, N, K, gpu=False)

    @T.prim_func
    def main(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        rows = T.int32()
        Xb = T.match_buffer(x, (rows, K), "float16")
        Wb = T.match_buffer(w, (D, N, K), "float16")
        Bias = T.match_buffer(bias, (D, N), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, N), gate_dtype)
        acc = T.alloc_buffer((1,), "float32")
        for d, m, n in T.grid(D, rows, N):
            acc[0] = T.float32(0)
            for k in T.serial(K):
                acc[0] = acc[0] + T.Cast("float32", Xb[m, k]) * T.Cast("float32", Wb[d, n, k])
            GateI[d, m, n] = T.Cast(gate_dtype, acc[0] + Bias[d, n])

    return main.with_attrs({"tirx.is_scheduled": True, "global_symbol": "gru_input_projection",
                            "tirx.noalias": True})


OPERANDS = ("float16", "tf32x3")


def projection_wgmma_func(D: int, N: int, K: int, gpu: bool = True, tile: WgmmaTile = WgmmaTile(),
                          gate_dtype: str = "float32", operands: str = "float16", w_rows: int | None = None):
    """prim_func(X, W, bias [D, N] f32, gate_i [D, rows, N] gate_dtype), float32 accumulation either way;
    gate_dtype "float16" rounds the sum plus bias to half on the store.
    operands "float16": X [rows, K], W [D, N, K] float16.
    operands "tf32x3" (float32 models): X [2, rows, K] and W [2, D, Np, K] (Np: `w_rows`, else N rounded up to
    whole tiles; the rows past N zero; any N), each float32 split into a high and a low part exact in tf32
    (`tf32x3.split_func` / `split_array`); the products lo x hi, hi x lo (summed apart) and hi x hi, three passes
    over K or, with the tile's `both_planes`, one pass of three products a k step, on tf32 wgmmas: a float32 GEMM's
    accuracy (the dropped lo x lo term and the parts' rounding are ~2^-22 of a product) at tensor-core rate."""
    from tvm.script import tirx as T

    if gate_dtype not in GATE_DTYPES:
        raise TvmseqError(f"wgmma projection: gate_dtype {gate_dtype!r} not one of {GATE_DTYPES}")
    if operands not in OPERANDS:
        raise TvmseqError(f"wgmma projection: operands {operands!r} not one of {OPERANDS}")
    split = operands == "tf32x3"
    # tf32x3: W's rows zero-padded to whole tiles (its planes are split by the caller, padded there), the stores
    # masked to the N columns
    Nt = -(-N // tile.bn) * tile.bn if split else N   # the gate rows the blocks cover
    # W's rows as stored: a narrower tile reads the split W that a wider one's padding made (`gemm.tf32x3_n`)
    Np = w_rows if split and w_rows is not None else Nt
    why = supports(Nt, K, tile, 4 if split else 2) or (
        f"W's {Np} rows do not cover N {N} in whole {tile.bn}-row tiles" if Np < Nt else None)
    if why:
        raise TvmseqError(f"wgmma projection: {why}")
    if not gpu:
        from .tf32x3 import tf32x3_cpu_func   # the kernel's numerics, here for the CPU tests

        return tf32x3_cpu_func(D, N, K, Np) if split else projection_cpu_func(D, N, K, gate_dtype)
    # the shared buffer is float16 and addressed in halfs whatever the operands are (every kernel of a module
    # declares one `extern __shared__ half smem_ptr[]`: a float one beside it would not compile); X and W are
    # addressed in their own elements, dt
    dt, EB = ("float32", 4) if split else ("float16", 2)
    SRC_BK = 128 // EB                 # X / W elements of k a stage: one 128-byte swizzle row
    SRC_CHUNK = 16 // EB               # X / W elements a 16-byte copy
    BM, BN, S, NT = tile.bm, tile.bn, tile.stages, tile.threads
    P = S - 2 if tile.inflight else S - 1    # k steps loaded ahead
    LIVE = 1 if tile.inflight else 0          # wgmma groups left running at the end of a k step
    ACC = BN // 2                      # float32 accumulators a thread
    PROMOTE = tile.promote
    PROMOTING = PROMOTE > 0            # (a Python bool: TVMScript's `if` on it is resolved here)
    TOTAL = ACC if PROMOTING else 1    # the promoted sums' registers

    def chunk_step(kt):
        """kt's k step inside its promoted chunk (the first of a chunk overwrites the tensor cores' sums)"""
        return kt % PROMOTE if PROMOTING else kt

    KT = K // SRC_BK                   # k steps over K
    PLANES = split and tile.both_planes   # (a Python bool) a stage holds both tf32 planes of X and W
    SMALL = ACC if PLANES else 1       # PLANES: the small products' sum (lo x hi + hi x lo) apart from hi x hi
    # tf32x3: three passes over K (lo x hi, hi x lo, hi x hi), or one with three products a step (PLANES)
    KSTEPS = 3 * KT if split and not PLANES else KT
    ROW = BK                           # halfs a tile row (128 bytes)
    A_ELEMS, B_ELEMS = BM * ROW, BN * ROW
    # halfs a stage (a multiple of 512 halfs = 1 KB); PLANES: X hi, X lo, then W hi, W lo
    A_PLANE, B_PLANE = A_ELEMS, B_ELEMS
    if PLANES:
        A_ELEMS, B_ELEMS = 2 * A_ELEMS, 2 * B_ELEMS
    STAGE = A_ELEMS + B_ELEMS
    unroll = T.unroll
    k_slice, store_rows = warpgroup_tile_macros(BN, gate_dtype, "tf32" if split else "float16",
                                                n_valid=N if Nt != N else None)

    def swz(r, c):
        """half offset of 16-byte chunk c of row r inside a 1 KB-aligned tile."""
        return r * ROW + T.bitwise_xor(c, r % 8) * 8

    def a_src(m, kt, rows, p):
        """X's element offset of row m at k step kt, plane p of a stage (tf32x3: plane p of X with both planes a
        stage; else pass 0 reads the low plane, passes 1-2 the high)"""
        if not split:
            return m * K + kt * SRC_BK
        if PLANES:
            return (p * rows + m) * K + kt * SRC_BK
        return (T.Select(kt < KT, rows, 0) + m) * K + kt % KT * SRC_BK

    def b_src(row, kt, p):
        """W's element offset of gate row `row` (d * N + n) at k step kt, plane p of a stage (tf32x3: plane p of W
        with both planes a stage; else pass 1 reads the low plane)"""
        if not split:
            return row * K + kt * SRC_BK
        if PLANES:
            return (p * D * Np + row) * K + kt * SRC_BK
        return (T.Select(kt // KT == 1, D * Np, 0) + row) * K + kt % KT * SRC_BK

    @T.macro
    def load_stage(Xb, Wb, smem, base, rows, d, m0, n0, kt, st, t):
        if kt < KSTEPS:
            for p in unroll(2 if PLANES else 1):   # the planes a stage holds (X [2, rows, K], W [2, D, Np, K])
                for i in unroll(BM * CPR // NT):
                    q = T.meta_var(i * NT + t)
                    T.evaluate(T.s_tir.cp_async_raw.legacy(
                        smem.access_ptr("w"), base + st * STAGE + p * A_PLANE + swz(q // CPR, q % CPR),
                        Xb.data, a_src(T.min(m0 + q // CPR, rows - 1), kt, rows, p) + (q % CPR) * SRC_CHUNK, 16,
                        dtype=dt))
                for i in unroll(BN * CPR // NT):
                    q = T.meta_var(i * NT + t)
                    T.evaluate(T.s_tir.cp_async_raw.legacy(
                        smem.access_ptr("w"), base + st * STAGE + A_ELEMS + p * B_PLANE + swz(q // CPR, q % CPR),
                        Wb.data, b_src(d * Np + n0 + q // CPR, kt, p) + (q % CPR) * SRC_CHUNK, 16, dtype=dt))
        T.evaluate(T.ptx["cp.async.commit_group"]())

    x_shape, w_shape = ((2, None, K), (2, D, Np, K)) if split else ((None, K), (D, N, K))

    from ...onnx.checks import index_limit_check

    check_rows = index_limit_check(f"warpgroup input projection (K {K}, {D} x {N} gate rows)", max(K, D * Np), "row")

    @T.prim_func
    def main(x: T.handle, w: T.handle, bias: T.handle, gate_i: T.handle):
        rows = T.int32()
        Xb = T.match_buffer(x, [rows if e is None else e for e in x_shape], dt)
        Wb = T.match_buffer(w, w_shape, dt)
        Bias = T.match_buffer(bias, (D, N), "float32")
        GateI = T.match_buffer(gate_i, (D, rows, N), gate_dtype)
        check_rows(rows)
        # blockIdx.x walks the gate-row tiles: the blocks running together share X rows (read from DRAM once)
        # and re-read W (the smaller operand) from L2; the other order streamed X once per gate-row tile
        for bz in T.thread_binding(D, thread="blockIdx.z"):
            for bx in T.thread_binding((rows + BM - 1) // BM, thread="blockIdx.y"):
                for by in T.thread_binding(Nt // BN, thread="blockIdx.x"):
                    for t in T.thread_binding(NT, thread="threadIdx.x"):
                        smem = T.alloc_buffer((S * STAGE + ATOM // 2,), "float16", scope="shared.dyn")
                        acc = T.alloc_buffer((ACC,), "float32", scope="local")
                        total = T.alloc_buffer((TOTAL,), "float32", scope="local")
                        small = T.alloc_buffer((SMALL,), "float32", scope="local")
                        da = T.alloc_buffer((1,), "uint64", scope="local")
                        db = T.alloc_buffer((1,), "uint64", scope="local")
                        wg = T.meta_var(t // 128)
                        off = T.alloc_buffer((1,), "int32", scope="local")
                        off[0] = align_offset(smem)
                        base = T.meta_var(off[0])
                        for v in unroll(ACC):
                            acc[v] = T.float32(0)
                        if PROMOTING:
                            for v in unroll(ACC):
                                total[v] = T.float32(0)
                        for st in unroll(P):
                            load_stage(Xb, Wb, smem, base, rows, bz, bx * BM, by * BN, st, st, t)
                        for kt in T.serial(KSTEPS):
                            T.evaluate(T.ptx["cp.async.wait_group"](P - 1))
                            T.ptx["fence.proxy.async.shared::cta"]()
                            T.tvm_storage_sync("shared")
                            load_stage(Xb, Wb, smem, base, rows, bz, bx * BM, by * BN, kt + P, (kt + P) % S, t)
                            T.ptx["wgmma.fence.sync.aligned"]()
                            if PLANES:
                                # X lo x W hi and X hi x W lo into their own sum, over all of K (the tensor
                                # cores truncate each add to the sum's own scale: added to the hi x hi sum
                                # they gave 1.5-5x float32's error), then X hi x W hi (plane 0: high, 1: low)
                                a_hi = T.meta_var(base + kt % S * STAGE + wg * 64 * ROW)
                                b_hi = T.meta_var(base + kt % S * STAGE + A_ELEMS)
                                k_slice(smem, small, da, db, a_hi + A_PLANE, b_hi, kt * 2)
                                k_slice(smem, small, da, db, a_hi, b_hi + B_PLANE, kt * 2 + 1)
                                k_slice(smem, acc, da, db, a_hi, b_hi, chunk_step(kt))
                            else:
                                k_slice(smem, acc, da, db, base + kt % S * STAGE + wg * 64 * ROW,
                                        base + kt % S * STAGE + A_ELEMS, chunk_step(kt))
                            T.ptx["wgmma.commit_group.sync.aligned"]()
                            T.ptx["wgmma.wait_group.sync.aligned"](LIVE)
                            if PROMOTING:
                                if kt % PROMOTE == PROMOTE - 1 or kt == KSTEPS - 1:   # a chunk's sum, rounded
                                    T.ptx["wgmma.wait_group.sync.aligned"](0)
                                    for v in unroll(ACC):
                                        total[v] = total[v] + acc[v]
                        T.ptx["wgmma.wait_group.sync.aligned"](0)
                        if PLANES:
                            for v in unroll(ACC):
                                total[v] = total[v] + small[v]
                        store_rows(GateI, Bias, total if PROMOTING else acc, bz, bx * BM + wg * 64, by * BN, rows, t)

    return main.with_attrs({"tirx.is_scheduled": True, "global_symbol": "gru_input_projection",
                            "tirx.noalias": True})
