"""Top-k along the last axis: hierarchical selection (LightSeq) in TensorIR, for CUDA and the CPU.

Every item is turned into an integer *key* whose integer order is the wanted order (floats: their bits
with the sign-magnitude flipped, -0 folded onto +0, NaN onto one quiet NaN above +inf; `largest=0`: the
bitwise complement), and items compare by (key descending, index ascending): a total order, so ties
go to the lower index exactly as ONNX asks, and no two items ever compare equal.

Hierarchical pass (k small against the row, the common case), one kernel per level:
  level 0: grid = rows x chunks; a block holds `threads x values_per_thread` items in registers;
    1. threshold (LightSeq): split the block's threads into k' >= k groups, take each group's maximum
       key and their minimum: at least k items are >= it. One butterfly reduction whose first levels
       take max and the rest min.
    2. the items >= threshold (typically ~k ln k) are compacted into shared memory (block-wide scan);
       if more than `candidate_capacity` pass (many ties, adversarial order), an exact fallback finds
       the k-th key by a bitwise search of block-wide counts, then the lowest indices among the keys
       equal to it, and compacts exactly k items.
    3. each candidate's rank = number of candidates better than it; ranks < k are written in order.
  levels 1..: the same block program over the previous level's candidate lists (rows x chunks*k),
    until one list per row is left; the last level writes values (re-read from x by index, so they
    are the exact inputs) and int64 indices.
Large k (> `max_hierarchical_k`) or a K only known at run time: a bitonic sort of the whole row in
global memory (host loop over the stages), then the first k.

One kernel body serves both targets: on CUDA `blockIdx`/`threadIdx` loops, registers for per-thread
state and warp shuffles for reductions; on the CPU the block loop is parallel, the thread loop serial,
per-thread state becomes an array indexed by the thread and reductions go through a scratch array.
Block-level code is written as a sequence of *phases* (one thread loop each); TVM's ThreadSync pass
puts the `__syncthreads()` between them on CUDA.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from ...errors import TvmseqError

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SUPPORTED_DTYPES = FLOAT_DTYPES + INT_DTYPES
_FULL_MASK = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------
# keys: an integer per item whose integer order is the selection order
# ----------------------------------------------------------------------------------------------------
def key_dtype(dtype: str) -> str:
    """int64 keys for 64-bit inputs, int32 for everything else."""
    return "int64" if dtype in ("float64", "int64", "uint64") else "int32"


def _key_min(kd: str):
    return tirx.const(-(2 ** (64 if kd == "int64" else 32) // 2), kd)


def _let(value, body, name: str):
    """`body(var)` with `var` bound once to `value` (a TIR Let, so the value is computed once)."""
    var = tirx.Var(name, value.ty if hasattr(value, "ty") else value.dtype)
    return tirx.Let(var, value, body(var))


def encode_key(v, dtype: str, largest: bool):
    """TIR expression: the ordered integer key of value `v` (of `dtype`)."""
    flip = (lambda key: key) if largest else (lambda key: ~key)  # noqa: E731
    if dtype in ("int8", "int16", "int32", "uint8", "uint16"):
        return flip(T.Cast("int32", v))
    if dtype == "uint32":
        return flip(T.reinterpret("int32", v) ^ tirx.const(-(2 ** 31), "int32"))
    if dtype == "int64":
        return flip(v)
    if dtype == "uint64":
        return flip(T.reinterpret("int64", v) ^ tirx.const(-(2 ** 63), "int64"))
    if dtype == "bfloat16":  # its bits are the top half of the float32's (TVM's bf16 casts are lossy here)
        kd, bits = "int32", T.shift_left(T.Cast("int32", T.reinterpret("int16", v)), T.int32(16))
    elif dtype in ("float16", "float32"):
        kd, bits = "int32", T.reinterpret("int32", v if dtype == "float32" else T.Cast("float32", v))
    elif dtype == "float64":
        kd, bits = "int64", T.reinterpret("int64", v)
    else:
        raise TvmseqError(f"top-k: unsupported dtype {dtype}")
    nb = 64 if kd == "int64" else 32
    c = lambda x: tirx.const(x, kd)  # noqa: E731
    mag = 2 ** (nb - 1) - 1
    inf = 0x7FF0000000000000 if nb == 64 else 0x7F800000
    qnan = 0x7FF8000000000000 if nb == 64 else 0x7FC00000

    def from_bits(b):
        # every NaN -> one NaN above +inf; negative floats get their magnitude bits flipped (integer
        # order = float order) and move up by one, so -0.0 (bits = sign) lands on +0.0's key 0:
        # equal values must tie. (A test `b == sign` would be folded away by TVM's simplifier.)
        canon = T.if_then_else((b & c(mag)) > c(inf), c(qnan), b)
        return _let(canon, lambda k: flip(T.if_then_else(k < c(0), (k ^ c(mag)) + c(1), k)), "kcanon")

    return _let(bits, from_bits, "kbits")


def better(ka, ia, kb, ib):
    """Item (ka, ia) comes before (kb, ib): larger key, or equal key and lower index."""
    return T.Or(ka > kb, T.And(ka == kb, ia < ib))


def decode_f32_key(key):
    """Inverse of `encode_key(v, "float32", largest=True)` (-0.0 comes back as +0.0)."""
    b = T.if_then_else(key < T.int32(0), (key - T.int32(1)) ^ T.int32(0x7FFFFFFF), key)
    return T.reinterpret("float32", b)


def encode_key_numpy(x: np.ndarray, largest: bool = True) -> np.ndarray:
    """Numpy twin of `encode_key` for float16/float32 inputs."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
    b = np.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, b)
    key = np.where(b < 0, (b ^ 0x7FFFFFFF) + 1, b).astype(np.int32)
    return key if largest else ~key


# ----------------------------------------------------------------------------------------------------
# configuration and level plan
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopKConfig:
    """Tile/thread constants of the hierarchical kernels (data, so a tuner can search them)."""

    threads: int = 256  # threads per block, level 0 (power of two; >= 32 on CUDA)
    values_per_thread: int = 16  # items each thread holds in registers at level 0
    merge_threads: int = 256  # threads per block, merge levels
    merge_values_per_thread: int = 16  # at most; fewer when the lists fit in one block
    # k >= kth_min_k: short runs per merge thread (the k-th largest run head is then a tight threshold:
    # ~2k candidates instead of the thousands that sent every k=64 merge block to the exact fallback)
    merge_values_large_k: int = 2
    merge_threads_large_k: int = 512
    kth_min_k: int = 16  # level 0 uses the k-th-largest-thread-max threshold from this k on
    candidate_capacity: int = 512  # shared-memory slots for items >= threshold (raised to >= 2k')
    max_hierarchical_k: int = 256  # larger k: full bitonic sort of the row
    sort_threads: int = 256  # threads per block of the bitonic-sort kernels
    force_exact_fallback: bool = False  # tests: skip the threshold fast path in every block

    def validate(self, gpu: bool) -> None:
        for name in ("threads", "merge_threads", "sort_threads"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1) or (gpu and not 32 <= v <= 1024):
                raise TvmseqError(f"TopKConfig.{name}={v}: must be a power of two (32..1024 on CUDA)")
        if self.values_per_thread < 1 or self.merge_values_per_thread < 1:
            raise TvmseqError("TopKConfig: values_per_thread must be >= 1")


GPU_SMS = 132  # H100 SXM; only used to size the level-0 grid


def choose_config(rows: int, n: int, k: int, gpu: bool, measured: bool = True,
                  dtype: str = "float32") -> TopKConfig:
    """Default tile sizes: on a GPU the measured winner (`schedules/tune_topk.py` ->
    schedules/measured/topk.json) where there is one; else enough level-0 blocks to keep every SM streaming
    (rows x chunks >= ~2 per SM), big chunks when k is large (the per-block selection costs ~k ln k
    regardless of chunk size)."""
    if gpu and measured:
        from ...tune import measured as db

        config = db.lookup("topk", rows=rows, n=n, k=k, dtype=dtype)
        if config:
            return TopKConfig(**config)
    if not gpu:  # CPU: emulated threads are a serial loop, blocks a parallel one
        return TopKConfig(threads=64, values_per_thread=8, merge_threads=64, merge_values_per_thread=16,
                          merge_values_large_k=4, merge_threads_large_k=64,
                          candidate_capacity=256, max_hierarchical_k=64, sort_threads=64)
    kp = _pow2_at_least(k)
    cfg = TopKConfig()
    for threads, vpt in ((256, 16), (256, 8), (128, 8), (128, 4), (64, 4)):
        if threads * vpt < 8 * kp and threads * vpt < 2 * n:
            break
        cfg = replace(cfg, threads=threads, values_per_thread=vpt)
        if rows * -(-n // (threads * vpt)) >= 2 * GPU_SMS:
            break
    # small rows: do not launch threads that only hold padding
    while cfg.threads > 32 and cfg.threads * cfg.values_per_thread >= 2 * max(n, 8 * kp):
        cfg = replace(cfg, threads=cfg.threads // 2)
    return cfg


def _pow2_at_least(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


@dataclass(frozen=True)
class Level:
    """One pass of the hierarchy: `segments` blocks per row, each selecting k of `chunk` items."""

    index: int
    threads: int
    values: int
    items: int  # items per row read by this level
    segments: int  # blocks per row
    sentinel_base: int  # index given to padding items: sentinel_base + position (unique, >= n)

    @property
    def chunk(self) -> int:
        return self.threads * self.values


def plan_levels(n: int, k: int, cfg: TopKConfig, groups: int | None = None,
                index_base: int = 0, min_threads: int = 1) -> list[Level]:
    """Level 0 over each row, then merge levels over k candidates per segment until one list is left.
    `groups` (beam step): the first merge reads the lists of `groups` consecutive level-0 rows
    (indices then live in [0, index_base)), and there is always at least one merge."""
    t0, v0 = cfg.threads, cfg.values_per_thread
    levels = [Level(0, t0, v0, n, -(-n // (t0 * v0)), 0)]
    base = max(levels[0].segments * levels[0].chunk, index_base)
    while levels[-1].segments > 1 or (groups and len(levels) == 1):
        items = levels[-1].segments * k * (groups if groups and len(levels) == 1 else 1)
        tm, vm = _merge_block(items, k, cfg, min_threads)
        lv = Level(len(levels), tm, vm, items, -(-items // (tm * vm)), base)
        base += lv.segments * lv.chunk
        levels.append(lv)
    if base >= 2 ** 31:
        raise TvmseqError(f"top-k: row of {n} items is too long for int32 indices")
    return levels


def _merge_block(items: int, k: int, cfg: TopKConfig, min_threads: int) -> tuple[int, int]:
    """(threads, values per thread) of a merge block: one block per row when the lists fit in
    `merge_threads x merge_values_per_thread` (then as few threads as hold them, >= k': fewer warps,
    cheaper reductions), else full blocks that at least halve the number of lists. Large k: more
    threads with short runs each (merge blocks take the k-th largest run head as threshold)."""
    tm, vmax, kp = cfg.merge_threads, cfg.merge_values_per_thread, _pow2_at_least(k)
    if k >= cfg.kth_min_k:
        tm, vmax = max(tm, cfg.merge_threads_large_k), cfg.merge_values_large_k
    if items <= tm * vmax:
        tm = _pow2_at_least(max(min_threads, kp, -(-items // vmax)))
        return tm, -(-items // tm)
    vm = vmax
    while tm * vm < 2 * kp:
        vm *= 2
    return tm, vm


def index_limit(levels: list[Level]) -> int:
    """Every index a level sees (sentinels included) is below this."""
    last = levels[-1]
    return max(last.sentinel_base + last.segments * last.chunk, levels[0].segments * levels[0].chunk)


def uses_hierarchy(n: int, k: int, cfg: TopKConfig) -> bool:
    """Hierarchical path when k is small enough for a block to select it; else a full sort."""
    return 1 <= k <= min(cfg.max_hierarchical_k, cfg.threads, cfg.merge_threads) and \
        k <= cfg.threads * cfg.values_per_thread


# ----------------------------------------------------------------------------------------------------
# block primitives, one implementation per target with the same data flow
# ----------------------------------------------------------------------------------------------------
class _Target:
    """Loop kinds and block-wide reductions for one target and block size.

    Per-thread state is declared `(te, ...)` and indexed with `sel(t)`: on CUDA te=1, sel(t)=0 (a
    register array per thread); on the CPU te=threads, sel(t)=t (the serial thread loop's own row)."""

    def __init__(self, gpu: bool, threads: int):
        self.gpu, self.threads = gpu, threads
        self.log_threads = threads.bit_length() - 1
        self.warps = max(1, threads // 32)
        self.log_warps = self.warps.bit_length() - 1
        if gpu:
            self.bx = lambda n: T.thread_binding(n, thread="blockIdx.x")
            self.tx = lambda n: T.thread_binding(n, thread="threadIdx.x")
            self.un = T.unroll
            self.te, self.sel = 1, (lambda t: 0)
            self.scratch = 32  # one slot per warp
        else:
            self.bx = T.parallel
            self.tx = T.serial
            self.un = T.serial
            self.te, self.sel = threads, (lambda t: t)
            self.scratch = threads
        self.tree_reduce = self._gpu_tree_reduce() if gpu else self._cpu_tree_reduce()
        self.exclusive_scan = self._gpu_scan() if gpu else self._cpu_scan()

    # A butterfly (GPU) or a binary tree (CPU) over the threads; `op(a, b, level)` may depend on the
    # level (2^level = distance of the combined threads), which is how group-max-then-min is one pass.
    def _gpu_tree_reduce(self):
        TT, NW, LW, LOGW, tx, un, sel = (self.threads, self.warps, min(5, self.log_threads),
                                         self.log_warps, self.tx, self.un, self.sel)

        @T.macro
        def tree_reduce(tr_src, tr_red, tr_res, tr_slot, tr_op, tr_dtype):
            for t in tx(TT):
                tr_v = T.alloc_buffer((1,), tr_dtype, scope="local")
                tr_v[0] = tr_src[sel(t)]
                for lv in un(LW):
                    tr_v[0] = tr_op(tr_v[0], T.tvm_warp_shuffle_xor(
                        T.uint32(_FULL_MASK), tr_v[0], 1 << lv, 32, 32), lv)
                if t % 32 == 0:
                    tr_red[t // 32] = tr_v[0]
            for t in tx(TT):
                if t < 32:
                    tr_w = T.alloc_buffer((1,), tr_dtype, scope="local")
                    tr_w[0] = tr_red[t % NW]
                    for lw in un(LOGW):
                        tr_w[0] = tr_op(tr_w[0], T.tvm_warp_shuffle_xor(
                            T.uint32(_FULL_MASK), tr_w[0], 1 << lw, NW, 32), lw + 5)
                    if t == 0:
                        tr_res[tr_slot] = tr_w[0]

        return tree_reduce

    def _cpu_tree_reduce(self):
        TT, LOGT, tx, sel = self.threads, self.log_threads, self.tx, self.sel

        @T.macro
        def tree_reduce(tr_src, tr_red, tr_res, tr_slot, tr_op, tr_dtype):
            for t in tx(TT):
                tr_red[t] = tr_src[sel(t)]
            for t in tx(TT):
                if t == 0:
                    for lv in range(LOGT):
                        for q in range(TT >> (lv + 1)):
                            tr_red[q * (2 << lv)] = tr_op(tr_red[q * (2 << lv)],
                                                          tr_red[q * (2 << lv) + (1 << lv)], lv)
                    tr_res[tr_slot] = tr_red[0]

        return tree_reduce

    # Exclusive prefix sum of one int32 per thread, in thread order, in place; total -> sc_res[slot].
    def _gpu_scan(self):
        TT, NW, tx, un, sel = self.threads, self.warps, self.tx, self.un, self.sel

        @T.macro
        def exclusive_scan(sc_cnt, sc_wsum, sc_woff, sc_res, sc_slot):
            for t in tx(TT):
                sc_v = T.alloc_buffer((1,), "int32", scope="local")
                sc_v[0] = sc_cnt[sel(t)]
                for lv in un(5):
                    sc_o = T.tvm_warp_shuffle_up(T.uint32(_FULL_MASK), sc_v[0], 1 << lv, 32, 32)
                    if t % 32 >= (1 << lv):
                        sc_v[0] = sc_v[0] + sc_o
                if t % 32 == 31:
                    sc_wsum[t // 32] = sc_v[0]
                sc_cnt[sel(t)] = sc_v[0] - sc_cnt[sel(t)]
            for t in tx(TT):
                if t < 32:
                    sc_w = T.alloc_buffer((2,), "int32", scope="local")
                    sc_w[0] = T.if_then_else(t < NW, sc_wsum[t % NW], 0)
                    sc_w[1] = sc_w[0]
                    for lv in un(5):
                        sc_p = T.tvm_warp_shuffle_up(T.uint32(_FULL_MASK), sc_w[0], 1 << lv, 32, 32)
                        if t >= (1 << lv):
                            sc_w[0] = sc_w[0] + sc_p
                    if t < NW:
                        sc_woff[t] = sc_w[0] - sc_w[1]
                    if t == 31:
                        sc_res[sc_slot] = sc_w[0]
            for t in tx(TT):
                sc_cnt[sel(t)] = sc_cnt[sel(t)] + sc_woff[t // 32]

        return exclusive_scan

    def _cpu_scan(self):
        TT, tx, sel = self.threads, self.tx, self.sel

        @T.macro
        def exclusive_scan(sc_cnt, sc_wsum, sc_woff, sc_res, sc_slot):
            for t in tx(TT):
                sc_wsum[t] = sc_cnt[sel(t)]
            for t in tx(TT):
                if t == 0:
                    sc_s = T.alloc_buffer((1,), "int32", scope="local")
                    sc_s[0] = 0
                    for q in range(TT):
                        sc_woff[q] = sc_s[0]
                        sc_s[0] = sc_s[0] + sc_wsum[q]
                    sc_res[sc_slot] = sc_s[0]
            for t in tx(TT):
                sc_cnt[sel(t)] = sc_woff[t]

        return exclusive_scan


# ----------------------------------------------------------------------------------------------------
# the block program of one hierarchy level
# ----------------------------------------------------------------------------------------------------
def _rows32(rows):
    """Row count as an int32 expression for grid sizes (`rows` may be a symbolic int64 tirx.Var)."""
    return rows if isinstance(rows, int) else T.Cast("int32", rows)


@dataclass(frozen=True)
class _Spec:
    """Everything a level program needs besides its Level (Python constants, baked into the kernel)."""

    gpu: bool
    rows: object  # rows of the level's input (batch for the beam merge); int or int64 tirx.Var
    n: int  # items of an input row (vocab for the beam step)
    k: int
    dtype: str
    largest: bool
    capacity: int
    index_limit: int
    force_exact: bool  # every index (sentinels included) is below this
    beam: int = 0  # beam step: beams per batch row
    vocab: int = 0
    kth_min_k: int = 16  # level 0: k-th-largest-thread-max threshold from this k on (merges: k > 1)

    @property
    def kd(self) -> str:
        return key_dtype(self.dtype)

    @property
    def kp(self) -> int:
        return _pow2_at_least(self.k)


def _level_program(lv: Level, spec: _Spec, src: str, dst: str, stats: bool = False):
    """Macro running `lv` for all rows: src "x" (the input), "cand" (previous level's lists) or "beam"
    (level-0 lists of a beam step, rescored by log-softmax + beam score); dst "cand", "final" (values +
    int64 indices) or "beam" (scores, beam ids, token ids). `stats`: also write each chunk's max and
    sum of exp (the beam step's log-softmax, fused into the same pass over the logits)."""
    tg = _Target(spec.gpu, lv.threads)
    bx, tx, un, sel, TE, RS = tg.bx, tg.tx, tg.un, tg.sel, tg.te, tg.scratch
    tree_reduce, scan = tg.tree_reduce, tg.exclusive_scan
    TT, V, C, S, ITEMS, BASE = lv.threads, lv.values, lv.chunk, lv.segments, lv.items, lv.sentinel_base
    K, KP, KD, N, DT, LARGEST = spec.k, spec.kp, spec.kd, spec.n, spec.dtype, spec.largest
    R = _rows32(spec.rows)
    CAP = max(spec.capacity, 2 * KP)
    FAST_MAX = -1 if spec.force_exact else CAP  # at most this many candidates take the fast path
    NR = -(-CAP // TT)  # candidates per thread in the rank phase
    KMIN = _key_min(KD)
    NB = 64 if KD == "int64" else 32  # key bits (exact fallback)
    IDXB = max(1, (spec.index_limit - 1).bit_length())  # index bits (exact fallback)
    LG = (TT // KP).bit_length() - 1  # first LG butterfly levels take max (groups of 2^LG threads)
    BEAM, VOCAB, SEG0 = spec.beam, spec.vocab, (ITEMS // max(spec.beam, 1))
    NINF = tirx.const(-math.inf, "float32")
    maxmin = lambda a, b, lvl: T.if_then_else(lvl < LG, T.max(a, b), T.min(a, b))  # noqa: E731
    kmin = lambda a, b, lvl: T.min(a, b)  # noqa: E731
    KMAX = tirx.const(2 ** (NB - 1) - 1, KD)
    # merge levels read sorted lists: a thread holds a contiguous run (its max is the run's head);
    # level 0 reads x strided (coalesced loads, and random data has no order to exploit)
    BLOCKED = src != "x"
    pos = (lambda s, t, j: s * C + t * V + j) if BLOCKED else (lambda s, t, j: s * C + j * TT + t)  # noqa: E731
    # threshold: k-th largest of the TT thread maxima (k distinct items reach it; tight: ~k..2k pass),
    # or, for small k at level 0 where that count loop costs more than it saves, LightSeq's min over
    # k' thread groups of the group maximum (one butterfly)
    KTH = (BLOCKED and KP > 1) or KP >= spec.kth_min_k
    UNR = min(8, TT)
    kmax = lambda a, b, lvl: T.max(a, b)  # noqa: E731
    add = lambda a, b, lvl: a + b  # noqa: E731
    one = tirx.const(1, KD)
    bit_of = lambda b: T.shift_left(one, T.Cast(KD, b))  # noqa: E731
    # candidate key of the bitwise search: bit NB-1 is the sign (searching from KMIN upwards)
    probe = lambda ans, b: T.if_then_else(b == NB - 1, ans ^ KMIN, ans | bit_of(b))  # noqa: E731
    # level 0 reads x in order, so an item's index is its position; later levels carry indices in `ir`
    index_of = (lambda pos, carried: pos) if src == "x" else (lambda pos, carried: carried)  # noqa: E731
    # the exact fallback's k items: key above the k-th key, or equal to it with index <= the tie limit
    selected = lambda key, kth, idx, limit: T.Or(key > kth, T.And(key == kth, idx <= limit))  # noqa: E731
    # a block-uniform branch around phases: tells ThreadSync its __syncthreads() are safe
    uniform = T.tvm_thread_invariant if spec.gpu else (lambda cond: cond)

    @T.macro
    def program(p_x, p_kin, p_iin, p_kout, p_iout, p_vals, p_inds, p_bs, p_lse, p_sm, p_ss, p_tok):
        for blk in bx(R * S):
            row = blk // S
            seg = blk % S
            kr = T.alloc_buffer((TE, V), KD, scope="local")
            ir = T.alloc_buffer((TE, V), "int32", scope="local")
            own = T.alloc_buffer((TE,), KD, scope="local")  # reduce input, then the block's threshold
            cnt = T.alloc_buffer((TE,), "int32", scope="local")
            lim = T.alloc_buffer((TE, 2), "int32", scope="local")  # fallback: need, index limit
            red = T.alloc_buffer((RS,), KD, scope="shared")
            wsum = T.alloc_buffer((RS,), "int32", scope="shared")
            woff = T.alloc_buffer((RS,), "int32", scope="shared")
            res = T.alloc_buffer((2,), KD, scope="shared")
            resi = T.alloc_buffer((2,), "int32", scope="shared")
            ck = T.alloc_buffer((CAP,), KD, scope="shared")
            ci = T.alloc_buffer((CAP,), "int32", scope="shared")
            # 1. load this block's items as keys (padding: KMIN with a unique index >= n)
            for t in tx(TT):
                own[sel(t)] = KMIN
                for j in un(V):
                    p = pos(seg, t, j)
                    if src == "x":
                        kr[sel(t), j] = T.if_then_else(
                            p < ITEMS, encode_key(p_x[row, T.min(p, N - 1)], DT, LARGEST), KMIN)
                    elif src == "cand":
                        kr[sel(t), j] = T.if_then_else(p < ITEMS, p_kin[row, T.min(p, ITEMS - 1)], KMIN)
                        ir[sel(t), j] = T.if_then_else(p < ITEMS, p_iin[row, T.min(p, ITEMS - 1)], BASE + p)
                    else:  # beam: item p of batch row `row` is slot p % SEG0 of beam p // SEG0
                        q = T.min(p, ITEMS - 1)
                        brow = row * BEAM + q // SEG0
                        tok = p_iin[brow, q % SEG0]
                        score = p_bs[row, q // SEG0] + T.Cast("float32", p_x[brow, tok]) - p_lse[brow]
                        kr[sel(t), j] = T.if_then_else(p < ITEMS, encode_key(score, "float32", True), KMIN)
                        ir[sel(t), j] = T.if_then_else(p < ITEMS, (q // SEG0) * VOCAB + tok, BASE + p)
                    own[sel(t)] = T.max(own[sel(t)], kr[sel(t), j])
            if stats:  # chunk max and sum exp(x - max) of the logits, from the same registers
                fsum = T.alloc_buffer((TE,), "float32", scope="local")
                fred = T.alloc_buffer((RS,), "float32", scope="shared")
                fres = T.alloc_buffer((1,), "float32", scope="shared")
                tree_reduce(own, red, res, 1, kmax, KD)
                for t in tx(TT):
                    fsum[sel(t)] = T.float32(0)
                    cmax = decode_f32_key(res[1])  # (conditions must not read shared memory)
                    for j in un(V):
                        if T.And(pos(seg, t, j) < ITEMS, cmax > NINF):
                            fsum[sel(t)] = fsum[sel(t)] + T.exp(decode_f32_key(kr[sel(t), j]) - cmax)
                tree_reduce(fsum, fred, fres, 0, add, "float32")
                for t in tx(TT):
                    if t == 0:
                        p_sm[row, seg] = decode_f32_key(res[1])
                        p_ss[row, seg] = fres[0]
            # 2. threshold (>= k items reach it)
            if KTH:
                tmx = T.alloc_buffer((TT,), KD, scope="shared")
                for t in tx(TT):
                    tmx[t] = own[sel(t)]
                for t in tx(TT):
                    above = T.alloc_buffer((1,), "int32", scope="local")
                    above[0] = 0
                    for u0 in range(TT // UNR):  # (unrolled by 8: independent broadcast loads)
                        for u1 in un(UNR):
                            above[0] = above[0] + T.Cast("int32", tmx[u0 * UNR + u1] > own[sel(t)])
                    # the k-th largest max is the smallest max with fewer than k maxima above it
                    own[sel(t)] = T.if_then_else(above[0] < K, own[sel(t)], KMAX)
                tree_reduce(own, red, res, 0, kmin, KD)
            else:
                tree_reduce(own, red, res, 0, maxmin, KD)
            # 3. count the items >= threshold, offsets by a block-wide scan
            for t in tx(TT):
                own[sel(t)] = res[0]
                cnt[sel(t)] = 0
                for j in un(V):
                    cnt[sel(t)] = cnt[sel(t)] + T.Cast("int32", kr[sel(t), j] >= own[sel(t)])
            scan(cnt, wsum, woff, resi, 0)
            passed = resi[0]
            if uniform(passed <= FAST_MAX):
                for t in tx(TT):
                    for j in un(V):
                        if kr[sel(t), j] >= own[sel(t)]:
                            ck[cnt[sel(t)]] = kr[sel(t), j]
                            ci[cnt[sel(t)]] = index_of(pos(seg, t, j), ir[sel(t), j])
                            cnt[sel(t)] = cnt[sel(t)] + 1
            else:
                # exact fallback: the k-th largest key, bit by bit (own = answer so far) ...
                for t in tx(TT):
                    own[sel(t)] = KMIN
                for b in range(NB):
                    for t in tx(TT):
                        cnt[sel(t)] = 0
                        for j in un(V):
                            cnt[sel(t)] = cnt[sel(t)] + T.Cast(
                                "int32", kr[sel(t), j] >= probe(own[sel(t)], NB - 1 - b))
                    tree_reduce(cnt, wsum, resi, 1, add, "int32")
                    for t in tx(TT):
                        reach = resi[1]
                        if reach >= K:
                            own[sel(t)] = probe(own[sel(t)], NB - 1 - b)
                # ... then, among keys equal to it, the `need` lowest indices (index < lim + 1)
                for t in tx(TT):
                    cnt[sel(t)] = 0
                    for j in un(V):
                        cnt[sel(t)] = cnt[sel(t)] + T.Cast("int32", kr[sel(t), j] > own[sel(t)])
                tree_reduce(cnt, wsum, resi, 1, add, "int32")
                for t in tx(TT):
                    lim[sel(t), 0] = K - resi[1]
                    lim[sel(t), 1] = 0
                for b in range(IDXB):
                    for t in tx(TT):
                        cnt[sel(t)] = 0
                        for j in un(V):
                            idx = index_of(pos(seg, t, j), ir[sel(t), j])
                            cnt[sel(t)] = cnt[sel(t)] + T.Cast("int32", T.And(
                                kr[sel(t), j] == own[sel(t)], idx < (lim[sel(t), 1] | (1 << (IDXB - 1 - b)))))
                    tree_reduce(cnt, wsum, resi, 1, add, "int32")
                    for t in tx(TT):
                        below = resi[1]
                        if below < lim[sel(t), 0]:
                            lim[sel(t), 1] = lim[sel(t), 1] | (1 << (IDXB - 1 - b))
                # exactly k items: key > kth, or key == kth and index <= lim
                for t in tx(TT):
                    cnt[sel(t)] = 0
                    for j in un(V):
                        idx = index_of(pos(seg, t, j), ir[sel(t), j])
                        cnt[sel(t)] = cnt[sel(t)] + T.Cast("int32", selected(
                            kr[sel(t), j], own[sel(t)], idx, lim[sel(t), 1]))
                scan(cnt, wsum, woff, resi, 0)
                for t in tx(TT):
                    for j in un(V):
                        idx = index_of(pos(seg, t, j), ir[sel(t), j])
                        if selected(kr[sel(t), j], own[sel(t)], idx, lim[sel(t), 1]):
                            ck[cnt[sel(t)]] = kr[sel(t), j]
                            ci[cnt[sel(t)]] = idx
                            cnt[sel(t)] = cnt[sel(t)] + 1
            # 4. rank = number of better candidates; the k best go out in order
            for t in tx(TT):
                m = resi[0]
                for r in range(NR):
                    if r * TT + t < m:
                        rk = T.alloc_buffer((3,), "int32", scope="local")  # rank, next, count
                        rk[0] = 0
                        rk[1] = 0
                        rk[2] = m
                        ki = ck[r * TT + t]
                        ii = ci[r * TT + t]
                        while T.And(rk[1] < rk[2], rk[0] < K):
                            rk[0] = rk[0] + T.Cast("int32", better(ck[rk[1]], ci[rk[1]], ki, ii))
                            rk[1] = rk[1] + 1
                        if rk[0] < K:
                            if dst == "cand":
                                if p_kout is not None:  # (the beam merge re-reads logits, not keys)
                                    p_kout[row, seg * K + rk[0]] = ki
                                p_iout[row, seg * K + rk[0]] = ii
                            elif dst == "final":
                                p_vals[row, rk[0]] = p_x[row, T.min(ii, N - 1)]
                                p_inds[row, rk[0]] = T.Cast("int64", ii)
                            else:
                                p_vals[row, rk[0]] = decode_f32_key(ki)
                                p_inds[row, rk[0]] = T.Cast("int64", ii // VOCAB)
                                p_tok[row, rk[0]] = T.Cast("int64", ii % VOCAB)

    return program


def _chain(progs: list, out_shapes: list, kd: str):
    """Macro running progs in order; each but the last writes candidate lists (global workspace of
    `out_shapes[i]`) that the next one reads."""
    head = progs[0]
    if len(progs) == 1:
        @T.macro
        def last(c_x, c_kin, c_iin, c_vals, c_inds, c_bs, c_lse, c_tok):
            head(c_x, c_kin, c_iin, None, None, c_vals, c_inds, c_bs, c_lse, None, None, c_tok)

        return last
    rest = _chain(progs[1:], out_shapes[1:], kd)
    shape = out_shapes[0]

    @T.macro
    def chain(c_x, c_kin, c_iin, c_vals, c_inds, c_bs, c_lse, c_tok):
        c_kout = T.alloc_buffer(shape, kd)
        c_iout = T.alloc_buffer(shape, "int32")
        head(c_x, c_kin, c_iin, c_kout, c_iout, c_vals, c_inds, c_bs, c_lse, None, None, c_tok)
        rest(c_x, c_kout, c_iout, c_vals, c_inds, c_bs, c_lse, c_tok)

    return chain


def _finish(func, name: str):
    """Attributes, and a root block around the body: Relax's RewriteDataflowReshape asserts that every
    call_tir callee's body is a block realize (hand-threaded bodies are not)."""
    from tvm import s_tir

    body = func.body
    if not isinstance(body, s_tir.SBlockRealize):
        body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return func.with_body(body).with_attr(
        {"global_symbol": name, "tirx.is_scheduled": True, "tirx.noalias": True})


def hierarchical_topk_func(rows: int, n: int, k: int, dtype: str, largest: bool, gpu: bool,
                           cfg: TopKConfig):
    """prim_func(x (rows, n), values (rows, k), indices (rows, k) int64) by the hierarchical method."""
    levels = plan_levels(n, k, cfg, min_threads=32 if gpu else 1)
    limit = index_limit(levels)
    spec = _Spec(gpu, rows, n, k, dtype, largest, cfg.candidate_capacity, limit, cfg.force_exact_fallback,
                  kth_min_k=cfg.kth_min_k)
    progs = [_level_program(lv, spec, "x" if lv.index == 0 else "cand",
                            "final" if lv is levels[-1] else "cand") for lv in levels]
    chain = _chain(progs, [(rows, lv.segments * k) for lv in levels], spec.kd)

    @T.prim_func
    def topk(x: T.Buffer((rows, n), dtype), values: T.Buffer((rows, k), dtype),
             indices: T.Buffer((rows, k), "int64")):
        chain(x, None, None, values, indices, None, None, None)

    return _finish(topk, "topk")


def sort_topk_func(rows: int, n: int, k: int | None, dtype: str, largest: bool, gpu: bool,
                   threads: int = 256):
    """Exact top-k by a bitonic sort of each whole row (global memory, one kernel per stage), then the
    first k. `k=None`: k is the output's (symbolic) last dimension, checked at run time."""
    tg = _Target(gpu, threads)
    bx, tx, TT = tg.bx, tg.tx, threads
    KD = key_dtype(dtype)
    KMIN = _key_min(KD)
    P = _pow2_at_least(n)
    LOGP = P.bit_length() - 1
    HALF = max(P // 2, 1)
    kk = tirx.Var("k", "int64") if k is None else tirx.const(k, "int64")
    R = _rows32(rows)
    R64 = tirx.const(rows, "int64") if isinstance(rows, int) else rows

    @T.prim_func
    def topk_sort(x_h: T.handle, v_h: T.handle, i_h: T.handle):
        x = T.match_buffer(x_h, (rows, n), dtype)
        values = T.match_buffer(v_h, (rows, kk), dtype)
        indices = T.match_buffer(i_h, (rows, kk), "int64")
        assert kk <= T.int64(n), "TopK: K is larger than the size of the selected axis"
        assert kk >= T.int64(0), "TopK: K must not be negative"
        wk = T.alloc_buffer((R * P,), KD)
        wi = T.alloc_buffer((R * P,), "int32")
        for b in bx((R * P + TT - 1) // TT):
            for t in tx(TT):
                if b * TT + t < R * P:
                    wk[b * TT + t] = T.if_then_else(
                        (b * TT + t) % P < n,
                        encode_key(x[(b * TT + t) // P, T.min((b * TT + t) % P, n - 1)], dtype, largest), KMIN)
                    wi[b * TT + t] = (b * TT + t) % P
        for s in range(LOGP):
            for q in range(s + 1):
                for b in bx((R * HALF + TT - 1) // TT):
                    for t in tx(TT):
                        if b * TT + t < R * HALF:
                            h = (b * TT + t) % HALF
                            lo = ((b * TT + t) // HALF) * P + (h >> (s - q) << (s - q + 1)) + \
                                h % (1 << (s - q))
                            hi = lo + (1 << (s - q))
                            a_k = wk[lo]
                            a_i = wi[lo]
                            b_k = wk[hi]
                            b_i = wi[hi]
                            # blocks with bit s+1 clear sort best-first, the others worst-first
                            if T.Cast("int32", better(b_k, b_i, a_k, a_i)) == T.Cast(
                                    "int32", (h >> (s - q) << (s - q + 1)) & (2 << s) == 0):
                                wk[lo] = b_k
                                wi[lo] = b_i
                                wk[hi] = a_k
                                wi[hi] = a_i
        if kk > T.int64(0):
            for b in bx(T.Cast("int32", (R64 * kk + T.int64(TT - 1)) // T.int64(TT))):
                for t in tx(TT):
                    if T.Cast("int64", b * TT + t) < R64 * kk:
                        values[T.Cast("int64", b * TT + t) // kk, T.Cast("int64", b * TT + t) % kk] = x[
                            T.Cast("int64", b * TT + t) // kk,
                            T.min(wi[T.Cast("int32", T.Cast("int64", b * TT + t) // kk) * P
                                     + T.Cast("int32", T.Cast("int64", b * TT + t) % kk)], n - 1)]
                        indices[T.Cast("int64", b * TT + t) // kk, T.Cast("int64", b * TT + t) % kk] = \
                            T.Cast("int64", wi[T.Cast("int32", T.Cast("int64", b * TT + t) // kk) * P
                                               + T.Cast("int32", T.Cast("int64", b * TT + t) % kk)])

    return _finish(topk_sort, "topk")


# ----------------------------------------------------------------------------------------------------
# validation, factory, build, call
# ----------------------------------------------------------------------------------------------------
def normalize_axis(axis: int, ndim: int, what: str = "top-k") -> int:
    if not -ndim <= axis < ndim:
        raise TvmseqError(f"{what}: axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def validate_topk(shape, dtype: str, k, axis: int = -1, what: str = "top-k") -> int:
    """Check a top-k request before any kernel runs; returns the non-negative axis."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise TvmseqError(f"{what}: input 'x' is a scalar; it needs at least one axis")
    if str(dtype) not in SUPPORTED_DTYPES:
        raise TvmseqError(f"{what}: input 'x' has dtype {dtype}; supported: {', '.join(SUPPORTED_DTYPES)}")
    axis = normalize_axis(int(axis), len(shape), what)
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise TvmseqError(f"{what}: K must be an integer, got {k!r}")
    if k < 0:
        raise TvmseqError(f"{what}: K={k} is negative")
    if k > shape[axis]:
        raise TvmseqError(f"{what}: K={k} is larger than axis {axis} of input 'x' (size {shape[axis]})")
    return axis


@functools.lru_cache(maxsize=None)
def topk_func(rows: int | None, n: int, k: int | None, dtype: str = "float32", largest: bool = True,
              target: str = "cuda", cfg: TopKConfig | None = None):
    """A ready-to-build prim_func `topk(x (rows, n), values (rows, k), indices (rows, k) int64)`:
    hierarchical when k is small, else a full bitonic sort. `rows=None`: the row count is symbolic
    (taken from x at run time); `k=None`: K is the outputs' symbolic last dimension (sort path, range
    checked at run time). `target`: "cuda" or "llvm"."""
    validate_topk((1 if rows is None else rows, n), dtype, 0 if k is None else k)
    if k == 0 or rows == 0:
        raise TvmseqError("top-k: K=0 or an empty input has no kernel; handle it before calling")
    gpu = _is_gpu_name(target)
    cfg = cfg or choose_config(64 if rows is None else rows, n, 1 if k is None else k, gpu, dtype=dtype)
    cfg.validate(gpu)
    rows_v = tirx.Var("rows", "int64") if rows is None else rows
    if k is not None and uses_hierarchy(n, k, cfg):
        return hierarchical_topk_func(rows_v, n, k, dtype, bool(largest), gpu, cfg)
    return sort_topk_func(rows_v, n, k, dtype, bool(largest), gpu, cfg.sort_threads)


def _is_gpu_name(target) -> bool:
    if isinstance(target, tvm.target.Target):
        return target.kind.name == "cuda"
    return str(target) in ("cuda", "gpu") or str(target).startswith(("nvidia/", "cuda"))


def _target_obj(target):
    from ... import targets

    return targets.resolve(target)


def target_key(target) -> str:
    """A hashable cache key for a target name or tvm Target (Targets hash by identity)."""
    from ... import targets

    return str(targets.resolve(target))


def build_topk(rows: int, n: int, k: int, dtype: str = "float32", largest: bool = True,
               target=None, cfg: TopKConfig | None = None):
    """Compiled executable of `topk_func` (call `ex["topk"](x, values, indices)`), cached."""
    return _build_topk(rows, n, k, dtype, bool(largest), target_key(target), cfg)


@functools.lru_cache(maxsize=None)
def _build_topk(rows, n, k, dtype, largest, target_json: str, cfg):
    tgt = tvm.target.Target(target_json)
    func = topk_func(rows, n, k, dtype, largest, "cuda" if tgt.kind.name == "cuda" else "llvm", cfg)
    return tvm.compile(tvm.IRModule({"topk": func}), target=tgt)


def topk(x, k: int, axis: int = -1, largest: bool = True, sorted: bool = True,  # noqa: A002
         target=None, cfg: TopKConfig | None = None):
    """Top-k of a numpy array (or anything np.asarray takes) along `axis`, ONNX semantics: values
    sorted best first, equal values by lower index, int64 indices. Returns (values, indices) numpy.
    `sorted=False` is accepted; the result is sorted anyway."""
    from ... import targets

    x = np.asarray(x)
    axis = validate_topk(x.shape, str(x.dtype), k, axis)
    moved = np.moveaxis(x, axis, -1)
    lead, n = moved.shape[:-1], moved.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    if k == 0 or rows == 0:
        return (np.moveaxis(np.zeros(lead + (k,), x.dtype), -1, axis),
                np.moveaxis(np.zeros(lead + (k,), np.int64), -1, axis))
    tgt = targets.resolve(target)
    ex = build_topk(rows, n, int(k), str(x.dtype), bool(largest), tgt, cfg)
    dev = targets.device_for(tgt)
    xs = tvm.runtime.tensor(np.ascontiguousarray(moved.reshape(rows, n)), dev)
    vals = tvm.runtime.tensor(np.zeros((rows, k), x.dtype), dev)
    inds = tvm.runtime.tensor(np.zeros((rows, k), np.int64), dev)
    ex["topk"](xs, vals, inds)
    return (np.moveaxis(vals.numpy().reshape(lead + (k,)), -1, axis),
            np.moveaxis(inds.numpy().reshape(lead + (k,)), -1, axis))


# ----------------------------------------------------------------------------------------------------
# beam-search step: log-softmax + beam score + top-k over beam x vocab, one pass over the logits
# ----------------------------------------------------------------------------------------------------
def beam_step_func(batch: int, beam: int, vocab: int, k: int, dtype: str, gpu: bool, cfg: TopKConfig):
    """prim_func(logits (batch*beam, vocab), beam_scores (batch, beam) f32 -> scores (batch, k) f32,
    beam_ids (batch, k) int64, tokens (batch, k) int64).

    Level 0 reads each beam row's logits once: its top-k candidates (by raw logit: log-softmax only
    shifts a row) and, from the same registers, each chunk's max and sum of exp. A small kernel turns
    the chunk stats into each row's logsumexp; the merge levels rescore the candidates as
    beam_score + logit - logsumexp and select the k best over beam x vocab (ties: lower beam*vocab+token)."""
    if not 1 <= k <= min(vocab, cfg.max_hierarchical_k, cfg.threads, cfg.merge_threads):
        raise TvmseqError(f"beam step: k={k} must be in [1, min(vocab={vocab}, "
                          f"{min(cfg.max_hierarchical_k, cfg.threads, cfg.merge_threads)})]")
    rows0 = batch * beam
    levels = plan_levels(vocab, k, cfg, groups=beam, index_base=beam * vocab, min_threads=32 if gpu else 1)
    limit = index_limit(levels)
    lv0 = levels[0]
    s0 = lv0.segments
    spec0 = _Spec(gpu, rows0, vocab, k, dtype, True, cfg.candidate_capacity, limit, cfg.force_exact_fallback,
                  kth_min_k=cfg.kth_min_k)
    specm = replace(spec0, rows=batch, dtype="float32", beam=beam, vocab=vocab)
    prog0 = _level_program(lv0, spec0, "x", "cand", stats=True)
    merges = [_level_program(lv, specm, "beam" if lv.index == 1 else "cand",
                             "beam" if lv is levels[-1] else "cand") for lv in levels[1:]]
    chain = _chain(merges, [(batch, lv.segments * k) for lv in levels[1:]], "int32")
    tg = _Target(gpu, 32)
    bx, tx = tg.bx, tg.tx
    ninf = tirx.const(-math.inf, "float32")

    @T.prim_func
    def beam_step(logits: T.Buffer((rows0, vocab), dtype), beam_scores: T.Buffer((batch, beam), "float32"),
                  scores: T.Buffer((batch, k), "float32"), beam_ids: T.Buffer((batch, k), "int64"),
                  tokens: T.Buffer((batch, k), "int64")):
        cand_i = T.alloc_buffer((rows0, s0 * k), "int32")
        chunk_max = T.alloc_buffer((rows0, s0), "float32")
        chunk_sum = T.alloc_buffer((rows0, s0), "float32")
        lse = T.alloc_buffer((rows0,), "float32")
        prog0(logits, None, None, None, cand_i, None, None, None, None, chunk_max, chunk_sum, None)
        for b in bx((rows0 + 31) // 32):
            for t in tx(32):
                if b * 32 + t < rows0:
                    acc = T.alloc_buffer((2,), "float32", scope="local")  # max, sum
                    acc[0] = ninf
                    for c in range(s0):
                        acc[0] = T.max(acc[0], chunk_max[b * 32 + t, c])
                    acc[1] = T.float32(0)
                    if acc[0] > ninf:
                        for c in range(s0):
                            acc[1] = acc[1] + chunk_sum[b * 32 + t, c] * T.exp(chunk_max[b * 32 + t, c] - acc[0])
                    lse[b * 32 + t] = acc[0] + T.log(acc[1])
        chain(logits, None, cand_i, scores, beam_ids, beam_scores, lse, tokens)

    return _finish(beam_step, "beam_step")
