"""Persistent recurrent GEMM: `C_n = f(A C_{n-1} + b)` for n = 1..steps in ONE CUDA kernel.

Layout: the state is stored batch-major, `X_n = C_n^T` of shape [B, H], so a step is
`X_n = f(X_{n-1} A^T + b)`; outputs are every X_n ([steps, B, H]) or only the last ([B, H]).

The persistent engine (shared with `recurrent.engine`):
* A (or the recurrent weights of a GRU) is split by rows over `num_blocks` thread blocks, one per SM,
  all resident (cooperative launch guarantees it or fails); each block keeps its row slice in
  registers (optionally part of it in shared memory) for all steps. Inside a block every thread owns
  all the block's rows for a contiguous slice of k (`k_per_thread`), so each element of the state is
  fetched from L2 by exactly one thread per block.
* Hand-off between steps uses the low-latency protocol NCCL calls "LL": every state value travels in
  an 8-byte word {value, step} written with one store, so a consumer polls the data itself and needs no
  fence, no counter and no barrier: a step costs about one L2 round trip. Two slots (step parity) are
  enough, because a block only writes step n+1 after it has read all of step n, which every block
  only produces after reading all of step n-1. A block starts on the k-slices of step n as soon as
  their words carry flag n, while slower blocks still finish step n: SM subsets run on different
  steps at once, the pipelining of the recurrent-GEMM patent at word granularity.
* Partial sums over k are reduced inside a warp by a transposing butterfly (each shuffle stage halves
  the values a lane holds: V values cost ~V shuffles instead of 5V), then across warps in shared
  memory, double-buffered so one __syncthreads per (step, batch chunk) suffices.
* The slots are reset and seeded with the initial state at kernel start, followed by the only grid-wide
  barrier (cooperative groups).

The CPU variant runs the same per-thread code (TVMScript macros) with serial loops, the step loop
outermost, a "warp" of one lane (no shuffles) and the LL words read directly; it checks indexing,
padding and numerics in CI. When A does not fit on chip, `recurrent_gemm_func` builds the per-step
path instead (a host loop launching one GEMM+activation kernel per step): see `choose_path`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm.script import tirx as T

from ..errors import TvmseqError
from ..targets import device_for, is_gpu, resolve
from .activations import Activation

# ----------------------------------------------------------------------------------------------------
# GPU facts the engine needs that the TVM target does not carry (per SM count, register file, smem).
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuFacts:
    num_sms: int
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    smem_per_block: int = 227 * 1024  # with the dynamic shared memory opt-in
    max_threads_per_block: int = 1024


_GPU_FACTS = {"sm_90": GpuFacts(132), "sm_90a": GpuFacts(132), "sm_80": GpuFacts(108, smem_per_block=163 * 1024),
              "sm_89": GpuFacts(128, smem_per_block=99 * 1024)}


def gpu_facts(target) -> GpuFacts:
    """SM count etc. of the target's GPU (H100 SXM: 132 SMs). A kernel built for more blocks than the
    GPU it runs on can hold fails to launch (cooperative launch checks residency) rather than hang."""
    arch = str(target.attrs.get("arch", "sm_90a"))
    return _GPU_FACTS.get(arch, GpuFacts(132))


# Registers a thread needs besides its weight tile, state values and accumulators (indices, pointers,
# loop state, the LL helper's temporaries): a budget estimate checked against ptxas in the tests.
_REG_OVERHEAD = 40
# Two blocks per SM (128 + 128 blocks of a bidirectional GRU) only where the estimate is this low: ptxas
# measured 46-64 registers there (cap 128 at 256 threads); above ~120 estimated, ptxas went to 128-242.
_TWO_PER_SM_REGS = 100
# A launch may use more than 48 KB of shared memory only after cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES),
# which TVM's CUDA runtime calls only when the dynamic part alone is >= 48 KB (backend/cuda/runtime/cuda_module.cc)
_DYN_SMEM_OPT_IN = 48 * 1024
_TWO_PER_SM_MAX_BATCH = 8  # above, the step cost model cannot tell chunking against sharing an SM


# ----------------------------------------------------------------------------------------------------
# Schedule knobs
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PersistentConfig:
    """Schedule knobs of a persistent kernel (what a tuner searches).

    num_blocks:   blocks (SMs) sharing the weight rows of one recurrence (one direction)
    num_warps:    warps per block; k is split over num_warps * 32 threads
    batch_chunk:  batch columns processed per pass (accumulators per thread = rows * batch_chunk)
    smem_rows:    rows of each block's weight slice kept in shared memory instead of registers
    """

    num_blocks: int
    num_warps: int
    batch_chunk: int
    smem_rows: int = 0

    def replace(self, **kw) -> "PersistentConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class EngineGeometry:
    """Sizes derived from (rows, H, B, config) that the kernel body and the host checks share."""

    rows_total: int      # weight rows of one recurrence (H for the GEMM, 3H for a GRU)
    H: int               # reduction length (state width)
    B: int
    cfg: PersistentConfig
    warp_size: int       # 32 on CUDA, 1 for the CPU variant
    rows_per_unit: int = 1  # weight rows that belong together (3 for GRU gates: z, r, h of one unit)

    @property
    def G(self) -> int:
        return self.cfg.num_blocks

    @property
    def units(self) -> int:
        return self.rows_total // self.rows_per_unit

    @property
    def U(self) -> int:
        """Units (output state columns) per block."""
        return math.ceil(self.units / self.G)

    @property
    def R(self) -> int:
        """Weight rows per block."""
        return self.U * self.rows_per_unit

    @property
    def R_smem(self) -> int:
        return min(self.cfg.smem_rows, self.R)

    @property
    def R_reg(self) -> int:
        return self.R - self.R_smem

    @property
    def NT(self) -> int:
        return self.cfg.num_warps * self.warp_size

    @property
    def W(self) -> int:
        return self.cfg.num_warps

    @property
    def KT(self) -> int:
        return math.ceil(self.H / self.NT)

    @property
    def Hp(self) -> int:
        """State row length in the LL buffers, padded to whole thread slices."""
        return self.NT * self.KT

    @property
    def BC(self) -> int:
        return self.cfg.batch_chunk

    @property
    def NC(self) -> int:
        return math.ceil(self.B / self.BC)

    @property
    def Bp(self) -> int:
        return self.NC * self.BC

    @property
    def V(self) -> int:
        """Partial sums per thread and pass."""
        return self.R * self.BC

    @property
    def Vp(self) -> int:
        return padded_sums(self.V, self.warp_size)

    def regs_estimate(self) -> int:
        """32-bit registers per thread: weight tile + state values + accumulators + overhead."""
        return self.R_reg * self.KT + self.BC * self.KT + self.Vp + _REG_OVERHEAD

    def smem_bytes(self) -> int:
        return 4 * (2 * self.W * self.Vp + self.R_smem * self.Hp) + 4 * self.U * self.Bp * 2

    def check(self, facts: GpuFacts | None, blocks_total: int) -> str | None:
        """Why this geometry cannot run resident on the GPU, or None when it can."""
        if self.cfg.num_blocks < 1 or self.cfg.num_warps < 1 or self.cfg.batch_chunk < 1:
            return f"config {self.cfg} has a non-positive knob"
        if self.cfg.smem_rows < 0:
            return f"config {self.cfg}: smem_rows must be >= 0"
        if facts is None:
            return None
        # up to 2 blocks per SM (e.g. the two directions of a bidirectional GRU each on 128 blocks)
        per_sm = math.ceil(blocks_total / facts.num_sms)
        if per_sm > 2:
            return f"{blocks_total} blocks > 2 x {facts.num_sms} SMs: not all resident"
        if self.NT > facts.max_threads_per_block or self.NT * per_sm > 2048:
            return f"{self.NT} threads per block x {per_sm} blocks per SM: too many threads"
        regs_cap = min(facts.max_regs_per_thread, facts.regs_per_sm // (self.NT * per_sm))
        if per_sm == 2:  # the estimate undercounts by up to ~70 registers at high counts (ptxas, H1024)
            regs_cap = min(regs_cap, _TWO_PER_SM_REGS)
        if self.regs_estimate() > regs_cap:
            return (f"~{self.regs_estimate()} registers per thread needed (weights {self.R_reg}x{self.KT}, "
                    f"state {self.BC}x{self.KT}, sums {self.Vp}) > {regs_cap} available")
        smem_cap = facts.smem_per_block if per_sm == 1 else (228 * 1024) // per_sm - 1024
        if self.smem_bytes() > smem_cap:
            return f"{self.smem_bytes()} B shared memory per block > {smem_cap} ({per_sm} blocks per SM)"
        dynamic, static = 4 * self.R_smem * self.Hp, 4 * 2 * self.W * self.Vp   # weight rows; partial sums
        if 0 < dynamic < _DYN_SMEM_OPT_IN < dynamic + static:
            # measured: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (bidirectional H512 B13, 43 KB + 12 KB)
            return (f"{dynamic} B dynamic + {static} B static shared memory: over 48 KB, and TVM's runtime raises "
                    f"the kernel's limit only from 48 KB of dynamic memory, so it would not launch")
        return None


# ----------------------------------------------------------------------------------------------------
# LL protocol primitives: the only hand-written CUDA (one store, one poll), everything else is TIR.
# ----------------------------------------------------------------------------------------------------

_LL_STORE_NAME = "tvmseq_ll_store"
_LL_STORE_RELEASE_NAME = "tvmseq_ll_store_release"
_LL_STORE_RELEASE_SRC = r"""
__forceinline__ __device__ void tvmseq_ll_store_release(int* p, float v, int flag) {
  unsigned long long w = ((unsigned long long)(unsigned)flag << 32) | __float_as_uint(v);
  asm volatile("st.release.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}
"""
_LL_STORE_SRC = r"""
// One LL word = {value bits (low half), step flag (high half)}, written by one aligned 64-bit store,
// which the PTX memory model makes single-copy atomic: a reader sees both halves or neither.
__forceinline__ __device__ void tvmseq_ll_store(int* p, float v, int flag) {
  unsigned long long w = ((unsigned long long)(unsigned)flag << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}
"""


# Polls of one LL wait before it gives up (and carries on): ~2^22 L2 round trips, seconds, where a
# real wait takes microseconds. A deadlock becomes a wrong result (with PollOptions.report a printf line
# saying which word is missing) instead of a hung GPU.
_POLL_LIMIT = 1 << 22


@dataclass(frozen=True)
class PollOptions:
    """How an LL wait polls (knobs of the hand-off, not of the math).

    report:      printf a line when a poll gives up: "lane0" (lane 0 of each warp), "all" (any lane, the
                 first 32 reports of a module load), or "" (silent)
    backoff_ns:  __nanosleep between unsuccessful polls (0: spin), to thin the L2 traffic of waiting warps
    sync_warp:   __syncwarp() after the wait, so a warp is converged before its shuffles
    limit:       polls before giving up (a real wait takes a few microseconds of polls)
    warp_uniform: the whole warp polls until every lane's words are ready (__all_sync), so the lanes of a
                 warp leave the wait together. Required: a warp whose lanes leave at different times can
                 reach the block's __syncthreads (bar.sync, .aligned) diverged, which is undefined; on the
                 H100 the barrier then released the block while some lanes still polled, the block
                 published a step those lanes had not read, and the hand-off hung or went wrong
                 (notes/persistent.md)
    order:       "relaxed" (ld/st.relaxed.gpu) or "acqrel" (ld.acquire.gpu / st.release.gpu)
    """

    report: str = ""
    backoff_ns: int = 0
    sync_warp: bool = False
    limit: int = _POLL_LIMIT
    warp_uniform: bool = True
    order: str = "relaxed"

    def tag(self) -> str:
        return (f"{self.report or 'q'}{self.backoff_ns}{'s' if self.sync_warp else ''}"
                f"{'' if self.warp_uniform else 'd'}{'a' if self.order == 'acqrel' else ''}"
                f"{self.limit.bit_length() - 1}")


def _ll_wait_source(nb: int, nw: int, poll: PollOptions | None = None) -> tuple[str, str]:
    """Helper that polls nb rows x nw consecutive LL words (row stride in words) until every valid word
    carries `flag`, then writes their values to out[nb * nw] (0 for invalid words). All loads of one
    poll are issued before any is checked, so a thread waits one L2 round trip, not nb * nw of them.
    Loads are 64-bit elements (two per 16-byte vector load when nw is even): each element is
    single-copy atomic, so a value is never paired with another step's flag."""
    poll = poll or PollOptions()
    name = f"tvmseq_ll_wait_{nb}x{nw}_{poll.tag()}"
    sem = "acquire" if poll.order == "acqrel" else "relaxed"
    vec = 2 if nw % 2 == 0 and sem == "relaxed" else 1  # ld.acquire has no vector form
    if vec == 2:
        load = ("        asm volatile(\"ld.relaxed.gpu.global.v2.b64 {%0,%1}, [%2];\"\n"
                "                     : \"=l\"(wd[i]), \"=l\"(wd[i + 1]) : \"l\"(q) : \"memory\");")
    else:
        load = (f"        asm volatile(\"ld.{sem}.gpu.global.b64 %0, [%1];\"\n"
                "                     : \"=l\"(wd[i]) : \"l\"(q) : \"memory\");")
    # poll.report: "lane0" (lane 0 of each warp) or "all" (any lane, the first 32) printf the first
    # missing word
    who = ("(threadIdx.x & 31) == 0" if poll.report == "lane0"
           else f"atomicAdd(&{name}_reports, 1u) < 32u")
    report_src = """      if (WHO) {
        int bad = 0;
        unsigned seen = 0;
#pragma unroll
        for (int i = NLAST; i >= 0; --i) {  // static indices: wd stays in registers
          if ((i % NW) < nw_valid && (i / NW) < nb_valid && (unsigned)(wd[i] >> 32) != (unsigned)flag) {
            bad = i;
            seen = (unsigned)(wd[i] >> 32);
          }
        }
        printf("tvmseq LL timeout: block %d thread %d waits for flag %d at %p + row %d col %d, sees %d\\n",
               (int)blockIdx.x, (int)threadIdx.x, flag, (const void*)p, bad / NW, bad % NW, (int)seen);
      }
""".replace("NLAST", str(nb * nw - 1)).replace("NW", str(nw)).replace("WHO", who) if poll.report else ""
    counter = f"__device__ unsigned {name}_reports = 0;\n" if poll.report == "all" else ""
    backoff = f"    if (!ready) __nanosleep({poll.backoff_ns});\n" if poll.backoff_ns else ""
    sync = "  __syncwarp();\n" if poll.sync_warp else ""
    # warp-uniform: every lane sees the same `ready`, so the loop (and the give-up) is taken by the warp
    uniform = "    ready = __all_sync(0xffffffffu, ready);\n" if poll.warp_uniform else ""
    src = f"""
{counter}__forceinline__ __device__ void {name}(const int* p, int row_stride, int flag, int nw_valid,
                                          int nb_valid, float* out) {{
  unsigned long long wd[{nb * nw}];
  bool ready;
  unsigned spins = 0;
  do {{
#pragma unroll
    for (int b = 0; b < {nb}; ++b) {{
#pragma unroll
      for (int w = 0; w < {nw}; w += {vec}) {{
        const int i = b * {nw} + w;
        const int* q = p + 2 * (b * row_stride + w);
{load}
      }}
    }}
    ready = true;
#pragma unroll
    for (int b = 0; b < {nb}; ++b) {{
#pragma unroll
      for (int w = 0; w < {nw}; ++w) {{
        ready &= (w >= nw_valid) | (b >= nb_valid) | ((unsigned)(wd[b * {nw} + w] >> 32) == (unsigned)flag);
      }}
    }}
{uniform}    if (!ready && ++spins == {poll.limit}u) {{
      // A word that never arrives would hang the GPU: give up (optionally saying where) and go on with
      // what is there, so the launch ends and its results fail the check.
{report_src}      break;
    }}
{backoff}  }} while (!ready);
{sync}
#pragma unroll
  for (int b = 0; b < {nb}; ++b) {{
#pragma unroll
    for (int w = 0; w < {nw}; ++w) {{
      out[b * {nw} + w] = (w < nw_valid && b < nb_valid) ? __uint_as_float((unsigned)wd[b * {nw} + w]) : 0.0f;
    }}
  }}
}}
"""
    return name, src


def make_ll_ops(gpu: bool, nb: int, nw: int, poll: PollOptions | None = None):
    """(ll_store, ll_wait) TVMScript macros for the target.

    ll_store(ws, word, value_f32, flag): publish one value.
    ll_wait(ws, word0, row_stride, flag, nw_valid, nb_valid, out): read nb rows x nw words starting at
    `word0` into the local buffer `out` (the CPU variant reads them directly: with the step loop
    outermost they are always ready)."""
    poll = poll or PollOptions()
    wait_name, wait_src = _ll_wait_source(nb, nw, poll)
    store_name, store_src = ((_LL_STORE_RELEASE_NAME, _LL_STORE_RELEASE_SRC) if poll.order == "acqrel"
                             else (_LL_STORE_NAME, _LL_STORE_SRC))

    if gpu:
        @T.macro
        def ll_store(ws, word, value, flag):
            T.evaluate(T.cuda.func_call(store_name, T.address_of(ws[word * 2]), value, flag,
                                        source_code=store_src))

        @T.macro
        def ll_wait(ws, word0, row_stride, flag, nw_valid, nb_valid, out):
            T.evaluate(T.cuda.func_call(wait_name, T.address_of(ws[word0 * 2]), row_stride, flag, nw_valid,
                                        nb_valid, T.address_of(out[0]), source_code=wait_src))
    else:
        @T.macro
        def ll_store(ws, word, value, flag):
            ws[word * 2] = T.reinterpret("int32", value)
            ws[word * 2 + 1] = flag

        @T.macro
        def ll_wait(ws, word0, row_stride, flag, nw_valid, nb_valid, out):
            for bb, w in T.grid(nb, nw):
                out[bb * nw + w] = T.if_then_else(
                    w < nw_valid and bb < nb_valid,
                    T.reinterpret("float32", ws[(word0 + bb * row_stride + w) * 2]), T.float32(0))

    return ll_store, ll_wait


# ----------------------------------------------------------------------------------------------------
# Warp reduction that transposes while it reduces
# ----------------------------------------------------------------------------------------------------


def padded_sums(values: int, warp_size: int) -> int:
    """The partial sums a lane holds for `make_warp_reduce` when it has `values`: up to a warp's width the next
    power of two, above it the next multiple of the warp's width, so each of the five halving stages stays whole
    (96 sums = 32 x 3: stages of 48, 24, 12, 6 and 3 shuffles, 93 in all, where padding to 128 took 124; the
    engine's H1024 B8 GRU passes have 96). On the CPU (warp width 1) exactly `values`."""
    if values <= warp_size:
        return 1 << max(values - 1, 0).bit_length()
    return -(-values // warp_size) * warp_size


def reduce_plan(vp: int, warp_size: int) -> list[tuple[int, int]]:
    """Shuffle stages for reducing vp values per lane over a warp: (xor offset, half) where half > 0
    halves the values a lane keeps (it sends the other half to its partner) and half == 0 is a plain
    butterfly add of the single value left."""
    plan, m, off = [], vp, warp_size // 2
    while off >= 1:
        if m > 1:
            plan.append((off, m // 2))
            m //= 2
        else:
            plan.append((off, 0))
        off //= 2
    return plan


def reduced_layout(vp: int, warp_size: int) -> tuple[int, list[tuple[int, int]], int]:
    """After `reduce_plan`: (values each lane holds, [(lane bit, index stride)] giving the original index
    of a lane's value i as i + sum(stride * bit set), mask of lane bits that must be zero for the lane
    to be the one that writes its values)."""
    plan = reduce_plan(vp, warp_size)
    bits = [(off, half) for off, half in plan if half > 0]
    held = vp >> len(bits)
    dup_mask = sum(off for off, half in plan if half == 0)
    return held, bits, dup_mask


def xor_layout(rows: int, batch: int, warp_size: int) -> tuple[int, int] | None:
    """(h, row-group bits) where a pass's rows x batch partial sums (v = b * rows + r) can be held in the XOR
    layout that makes the transposing reduction select-free, else None. It needs exactly 32 h sums (no padding),
    rows = h * 2^k and batch = 2^(5 - k): then q = v // h = b * 2^k + r // h, and lane L holds sum v at position
    ((q ^ L) h + v % h), i.e. batch column b ^ (L >> k) and row group (r // h) ^ (L & (2^k - 1)). In that layout
    every lane keeps positions [0, half) at each stage and receives its partner's [half, 2 half) (the partner holds
    there exactly the sums this lane keeps), so a stage is acc[i] += shfl_xor(acc[i + half]) with no select, and
    lane L ends with sums L h + i as before. The engine fills it by loading each lane's weight rows in permuted
    order (once) and swapping its state columns (log2(batch) select layers a pass; 32 selects at batch 4 against
    186 saved at 96 sums)."""
    values = rows * batch
    if warp_size != 32 or values % 32:
        return None
    h = values // 32
    groups = rows // h if rows % h == 0 else 0
    if not groups or groups & (groups - 1) or batch * groups != 32:
        return None
    return h, groups.bit_length() - 1


def xor_row(slot: int, h: int, row_bits: int, lane):
    """The row (of a pass) whose weights go into row slot `slot` of this lane in the XOR layout."""
    return T.bitwise_xor(slot // h, T.bitwise_and(lane, (1 << row_bits) - 1)) * h + slot % h


def make_warp_reduce(warp_size: int, vp: int, select_free: bool = False):
    """reduce(acc, lane, red, warp): reduce acc[vp] over the warp's lanes and store the sums to the
    shared buffer red[warp, v]. Five explicit stage slots keep every register index static. select_free: the
    sums are in the XOR layout (`xor_layout`), so each stage is a shuffle and an add, no selects."""
    plan = reduce_plan(vp, warp_size)
    plan = plan + [(0, -1)] * (5 - len(plan))  # pad to five slots; (0, -1) = no stage
    held, bits, dup_mask = reduced_layout(vp, warp_size)
    bits = bits + [(0, 0)] * (5 - len(bits))
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def stage(acc, lane, off, half):
        if half > 0 and select_free:
            for i in T.unroll(half):
                acc[i] = acc[i] + T.tvm_warp_shuffle_xor(full, acc[i + half], off, 32, 32)
        elif half > 0:
            for i in T.unroll(half):
                upper = T.meta_var((lane & off) != 0)
                send = T.meta_var(T.Select(upper, acc[i], acc[i + half]))
                keep = T.meta_var(T.Select(upper, acc[i + half], acc[i]))
                acc[i] = keep + T.tvm_warp_shuffle_xor(full, send, off, 32, 32)
        elif half == 0:
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(full, acc[0], off, 32, 32)

    def base_index(lane):
        idx = 0
        for off, stride in bits:
            if off:
                idx = idx + T.Select((lane & off) != 0, stride, 0)
        return idx

    @T.macro
    def reduce(acc, lane, red, warp):
        stage(acc, lane, plan[0][0], plan[0][1])
        stage(acc, lane, plan[1][0], plan[1][1])
        stage(acc, lane, plan[2][0], plan[2][1])
        stage(acc, lane, plan[3][0], plan[3][1])
        stage(acc, lane, plan[4][0], plan[4][1])
        if (lane & dup_mask) == 0:
            for i in T.unroll(held):
                red[warp, base_index(lane) + i] = acc[i]

    return reduce


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


def f32(x, dtype):
    return x if dtype == "float32" else T.Cast("float32", x)


def rounded(x, dtype):
    """x (float32) rounded to the storage dtype and back: what the next step reads."""
    return x if dtype == "float32" else T.Cast("float32", T.Cast(dtype, x))


def scheduled(func, name: str, cooperative: bool):
    """Attributes every tvmseq hand-scheduled kernel carries; cooperative launch for grid barriers."""
    attrs = {"tirx.is_scheduled": True, "global_symbol": name}
    if cooperative:
        attrs["tirx.kernel_launch_params"] = ["tirx.use_cooperative_launch"]
    return func.with_attrs(attrs)


_DTYPES = ("float32", "float16")


def parse_activation(act) -> Activation:
    """'tanh' | 'relu' | 'sigmoid' | 'identity' | an Activation."""
    if isinstance(act, Activation):
        return act
    if not isinstance(act, str):
        raise TvmseqError(f"activation must be a name or an Activation, got {act!r}")
    if act.lower() in ("identity", "none", "linear"):
        return Activation.make("Affine", 1.0, 0.0)
    return Activation.make(act)


# ----------------------------------------------------------------------------------------------------
# Configuration choice and the on-chip test
# ----------------------------------------------------------------------------------------------------


def _pick_batch_chunk(B: int, cap: int) -> int:
    """Largest even split of B into chunks of at most `cap` columns."""
    cap = max(1, min(cap, B))
    chunks = math.ceil(B / cap)
    return math.ceil(B / chunks)


# Cycle estimates of the cost model below (H100, measured orders of magnitude, not fitted):
_HANDOFF_CYCLES = 1000   # LL store -> L2 -> a polling consumer sees it
_PASS_FIXED_CYCLES = 150  # __syncthreads, cross-warp sum, activation, stores


def pass_issue_cycles(geo: EngineGeometry) -> float:
    """Issue cycles of one pass (batch chunk): FMAs, transposing shuffles and shared-memory weight loads, spread
    over 4 schedulers, slower with too few warps to hide latencies."""
    warps_per_scheduler = max(1.0, geo.W / 4)
    latency_hiding = min(1.0, geo.W / 8)  # under 2 warps per scheduler, dependent issue stalls
    return (geo.R * geo.KT * geo.BC + 2 * geo.Vp + geo.R_smem * geo.KT) * warps_per_scheduler / latency_hiding


def estimate_step_cycles(geo: EngineGeometry) -> float:
    """Rough cycles per step of one block: the passes (batch chunks) of a step are issue-bound
    (`pass_issue_cycles`) and overlap with the hand-off latency of the previous chunk, so a step costs
    max(all passes, hand-off + one pass)."""
    one_pass = pass_issue_cycles(geo) + _PASS_FIXED_CYCLES
    return max(geo.NC * one_pass, _HANDOFF_CYCLES + one_pass)


def default_config(H: int, B: int, dtype: str, target, rows_per_unit: int = 1, directions: int = 1,
                   rows_total: int | None = None, measured: bool = True, step_cost=None) -> PersistentConfig:
    """Schedule for `directions` independent recurrences of `rows_total` weight rows (default H) and
    reduction length H, each on its own subset of blocks: up to 128/directions blocks, then the
    (warps, shared-memory rows, batch chunk) that fits the register file with the lowest
    `estimate_step_cycles`. On CPU a small config that still exercises several blocks, threads and
    chunks. For a single recurrent GEMM the measured winner (`schedules/measured/recurrent_gemm.json`,
    `schedules/tune_recurrent_gemm.py`) comes first. `step_cost(geometry)` replaces `estimate_step_cycles`
    (the GRU/RNN engine passes its fit to measured times) and adds 64/directions blocks to the choices."""
    rows_total = H * rows_per_unit if rows_total is None else rows_total
    units = rows_total // rows_per_unit
    if not is_gpu(target):
        return PersistentConfig(num_blocks=min(3, units), num_warps=min(4, H), batch_chunk=min(2, B))
    if measured and rows_per_unit == 1 and directions == 1 and rows_total == H:
        from ..tune import measured as db

        config = db.lookup("recurrent_gemm", H=H, B=B, dtype=dtype)
        if config:
            return PersistentConfig(**config)
    facts = gpu_facts(target)

    def best_on(per_dir: int, max_chunks: int | None = None):
        """(score, config) with the lowest estimate when each recurrence gets `per_dir` blocks."""
        num_blocks = min(per_dir, units)
        num_blocks = math.ceil(units / math.ceil(units / num_blocks))  # no block without rows
        max_rows = math.ceil(units / num_blocks) * rows_per_unit
        found = None
        for warps in (1, 2, 4, 8, 16, 32):
            for smem_rows in range(0, max_rows + 1, rows_per_unit):
                for chunk_cap in (1, 2, 4, 8, 16, 32):
                    cfg = PersistentConfig(num_blocks, warps, _pick_batch_chunk(B, chunk_cap), smem_rows)
                    geo = EngineGeometry(rows_total, H, B, cfg, 32, rows_per_unit)
                    if geo.check(facts, num_blocks * directions) is not None:
                        continue
                    if max_chunks is not None and geo.NC > max_chunks:
                        continue
                    score = ((step_cost or estimate_step_cycles)(geo), smem_rows, warps)
                    if found is None or score < found[0]:
                        found = (score, cfg)
        return found

    # several recurrences (directions) share the SMs: 128/directions blocks each, one per SM ...
    one_per_sm, all_blocks = max(1, min(128, facts.num_sms) // directions), min(128, facts.num_sms)
    best = best_on(one_per_sm)
    if step_cost is not None and one_per_sm > 1:
        # fewer, fuller blocks: fewer partial sums to hand off (the fit puts 64 blocks first at batch 1-8)
        half = best_on(one_per_sm // 2)
        if half is not None and (best is None or half[0] < best[0]):
            best = half
    if B <= _TWO_PER_SM_MAX_BATCH and all_blocks > one_per_sm:
        # ... or, latency-bound, 128 each at two per SM (a direction then runs as fast as a lone one), but
        # not with more batch chunks per step than one per SM needs (measured: bi H1024 B8 on 2 x 128
        # blocks with 8 chunks took 2.4x uni)
        max_chunks = EngineGeometry(rows_total, H, B, best[1], 32, rows_per_unit).NC if best else None
        shared = best_on(all_blocks, max_chunks)
        if shared is not None and (best is None or shared[0] < best[0]):
            best = shared
    if best is None:
        raise TvmseqError(f"no persistent configuration keeps the {rows_total}x{H} {dtype} weights on chip")
    return best[1]


def fit_report(target, config, default, why_not, kernel: str = "persistent") -> tuple[bool, str]:
    """(fits, why) for the `fits_on_chip` functions of the persistent kernels: always on a CPU (the serial
    variant); on a GPU `config` (None: `default()`, whose TvmseqError is the reason) checked by
    `why_not(config, gpu_facts) -> reason or None`."""
    target = resolve(target)
    if not is_gpu(target):
        return True, f"CPU: the {kernel} variant runs serially"
    try:
        config = config or default(target)
    except TvmseqError as err:
        return False, str(err)
    why = why_not(config, gpu_facts(target))
    return (why is None), (why or f"fits: {config}")


def fits_on_chip(H: int, B: int, dtype: str, target=None, config: PersistentConfig | None = None) -> tuple[bool, str]:
    """Whether the persistent kernel can hold A (H x H) on chip on the target's GPU, and why not."""
    return fit_report(target, config, lambda tgt: default_config(H, B, dtype, tgt),
                      lambda cfg, facts: EngineGeometry(H, H, B, cfg, 32).check(facts, cfg.num_blocks))


def choose_path(H: int, B: int, dtype: str, target=None, config: PersistentConfig | None = None) -> tuple[str, str]:
    """'persistent' when A stays on chip (registers + shared memory of resident blocks), else
    'per_step' (one GEMM+activation launch per step, A read from L2/HBM each step). Returns the path and
    the reason."""
    ok, why = fits_on_chip(H, B, dtype, target, config)
    return ("persistent" if ok else "per_step"), why


# ----------------------------------------------------------------------------------------------------
# The persistent recurrent GEMM kernel
# ----------------------------------------------------------------------------------------------------


def persistent_recurrent_gemm_func(H: int, B: int, steps: int, dtype: str, activation, return_sequences: bool,
                                   target, config: PersistentConfig | None = None):
    """prim_func(A [H,H], bias [H], x0 [B,H], Y) with Y [steps,B,H] or [B,H] (dtype throughout,
    float32 accumulation): X_n = f(X_{n-1} A^T + bias)."""
    target = resolve(target)
    gpu = is_gpu(target)
    act = parse_activation(activation)
    config = config or default_config(H, B, dtype, target)
    geo = EngineGeometry(H, H, B, config, 32 if gpu else 1)
    why = geo.check(gpu_facts(target) if gpu else None, config.num_blocks)
    if why:
        raise TvmseqError(f"recurrent_gemm H={H} B={B} {dtype}: {why}")
    G, W, NT, WS = geo.G, geo.W, geo.NT, geo.warp_size
    R, R_reg, R_smem, KT, Hp = geo.R, geo.R_reg, geo.R_smem, geo.KT, geo.Hp
    BC, NC, Bp, V, Vp = geo.BC, geo.NC, geo.Bp, geo.V, geo.Vp
    slot_words = Bp * Hp
    y_shape = (steps, B, H) if return_sequences else (B, H)
    unroll = T.unroll if gpu else T.serial
    ll_store, ll_wait = make_ll_ops(gpu, BC, KT)
    warp_reduce = make_warp_reduce(WS, Vp)

    seed_iters = math.ceil(R * B / NT)
    finish_iters = math.ceil(V / NT)

    def warp_total(red, v):
        # sum of the W warps' partials, unrolled at trace time (W is small)
        return functools.reduce(lambda x, y: x + y, [red[w, v] for w in range(W)])

    # -- per-thread pieces shared by the GPU kernel and its CPU variant --------------------------

    @T.macro
    def load_weights(A, a_reg, a_smem, g, t):
        """Rows [0, R_reg) of the block's slice into registers, the rest into shared memory; zero pad."""
        for r in unroll(R_reg):
            for j in unroll(KT):
                row = T.meta_var(g * R + r)
                k = T.meta_var(t * KT + j)
                a_reg[r * KT + j] = T.if_then_else(row < H and k < H, f32(A[T.min(row, H - 1), T.min(k, H - 1)], dtype),
                                                   T.float32(0))
        for r in range(R_smem):
            for j in unroll(KT):
                row = T.meta_var(g * R + R_reg + r)
                k = T.meta_var(t * KT + j)
                a_smem[r, k] = T.if_then_else(row < H and k < H, f32(A[T.min(row, H - 1), T.min(k, H - 1)], dtype),
                                              T.float32(0))

    @T.macro
    def seed_slots(x0, ws, g, t):
        """This block's rows of slot 0 <- x0 with flag 0; slot 1 flags <- -1 (stale flags from a previous
        launch could otherwise match a step of this one)."""
        for i in range(seed_iters):
            idx = T.meta_var(i * NT + t)
            row = T.meta_var(g * R + idx % R)
            b = T.meta_var(idx // R)
            if idx < R * B and row < H:
                ll_store(ws, b * Hp + row, rounded(f32(x0[b, row], dtype), dtype), 0)
                ll_store(ws, slot_words + b * Hp + row, T.float32(0), -1)

    @T.macro
    def partial_sums(ws, a_reg, a_smem, cval, acc, red, lane, warp, t, n, c):
        """Sums over this thread's k-slice for every (batch column of chunk c, block row), reduced over the
        warp into red[warp, :]. Waits for step n-1's words (slot (n-1)%2)."""
        b0 = T.meta_var(c * BC)
        ll_wait(ws, ((n - 1) % 2) * slot_words + b0 * Hp + t * KT, Hp, n - 1,
                T.max(T.min(H - t * KT, KT), 0), T.min(B - b0, BC), cval)
        for v in unroll(Vp):
            acc[v] = T.float32(0)
        for r in unroll(R_reg):
            for j in unroll(KT):
                for bb in unroll(BC):
                    acc[bb * R + r] = acc[bb * R + r] + a_reg[r * KT + j] * cval[bb * KT + j]
        for r in unroll(R_smem):  # each shared weight is read once per pass, used for BC columns
            for j in unroll(KT):
                for bb in unroll(BC):
                    acc[bb * R + R_reg + r] = acc[bb * R + R_reg + r] + a_smem[r, t * KT + j] * cval[bb * KT + j]
        warp_reduce(acc, lane, red, warp)

    @T.macro
    def load_bias(bias, bias_reg, g, t):
        """The bias of every row this thread finishes, into registers once (rows depend on v % R only)."""
        for i in unroll(finish_iters):
            row = T.meta_var(g * R + (i * NT + t) % R)
            bias_reg[i] = T.if_then_else(row < H, f32(bias[T.min(row, H - 1)], dtype), T.float32(0))

    @T.macro
    def finish(bias_reg, Y, ws, red, g, t, n, c):
        """Sum the warps' partials of (row, batch column), add bias, activate, publish step n."""
        for i in unroll(finish_iters):
            v = T.meta_var(i * NT + t)
            bb = T.meta_var(v // R)
            row = T.meta_var(g * R + v % R)
            b = T.meta_var(c * BC + bb)
            if v < V and row < H and b < B:
                y = rounded(act.expr(warp_total(red, v) + bias_reg[i]), dtype)
                if return_sequences:
                    Y[n - 1, b, row] = T.Cast(dtype, y)
                elif n == steps:
                    Y[b, row] = T.Cast(dtype, y)
                ll_store(ws, (n % 2) * slot_words + b * Hp + row, y, n)

    # -- the kernels ----------------------------------------------------------------------------
    # Iteration `it` = (step n, batch chunk c) with n = it // NC + 1. Iterations alternate between two
    # partial-sum buffers (red0, red1), unrolled by two so TVM's sync planner sees distinct buffers
    # and keeps one __syncthreads per iteration (a thread writes red0 again only after the next
    # iteration's barrier, which every reader of red0 has passed).
    iters = steps * NC
    pairs = math.ceil(iters / 2)
    smem_shape, smem_scope = ((R_smem, Hp), "shared.dyn") if R_smem else ((1, 1), "local")

    if gpu:
        @T.macro
        def iteration(ws, a_reg, a_smem, cval, acc, red, bias_reg, Y, g, t, it):
            partial_sums(ws, a_reg, a_smem, cval, acc, red, t % WS, t // WS, t, it // NC + 1, it % NC)
            T.tvm_storage_sync("shared")
            finish(bias_reg, Y, ws, red, g, t, it // NC + 1, it % NC)

        @T.prim_func
        def main(A: T.Buffer((H, H), dtype), bias: T.Buffer((H,), dtype), x0: T.Buffer((B, H), dtype),
                 Y: T.Buffer(y_shape, dtype)):
            ws = T.alloc_buffer((2 * slot_words * 2,), "int32", scope="global")
            for g in T.thread_binding(G, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32", scope="local")
                    # weight rows in shared memory (a tiny unused local placeholder when there are none)
                    a_smem = T.alloc_buffer(smem_shape, "float32", scope=smem_scope)
                    cval = T.alloc_buffer((BC * KT,), "float32", scope="local")
                    acc = T.alloc_buffer((Vp,), "float32", scope="local")
                    red0 = T.alloc_buffer((W, Vp), "float32", scope="shared")
                    red1 = T.alloc_buffer((W, Vp), "float32", scope="shared")
                    bias_reg = T.alloc_buffer((finish_iters,), "float32", scope="local")
                    load_weights(A, a_reg, a_smem, g, t)
                    load_bias(bias, bias_reg, g, t)
                    seed_slots(x0, ws, g, t)
                    T.cuda.grid_sync()
                    for p in T.serial(pairs):
                        iteration(ws, a_reg, a_smem, cval, acc, red0, bias_reg, Y, g, t, 2 * p)
                        if iters % 2 == 0:
                            iteration(ws, a_reg, a_smem, cval, acc, red1, bias_reg, Y, g, t, 2 * p + 1)
                        elif 2 * p + 1 < iters:
                            iteration(ws, a_reg, a_smem, cval, acc, red1, bias_reg, Y, g, t, 2 * p + 1)
    else:
        @T.macro
        def iteration(ws, a_reg, a_smem, cval, acc, red, bias_reg, bias, A, Y, it):
            for g in T.serial(G):
                for t in T.serial(NT):
                    load_weights(A, a_reg, a_smem, g, t)
                    partial_sums(ws, a_reg, a_smem, cval, acc, red, 0, t, t, it // NC + 1, it % NC)
                for t in T.serial(NT):
                    load_bias(bias, bias_reg, g, t)
                    finish(bias_reg, Y, ws, red, g, t, it // NC + 1, it % NC)

        @T.prim_func
        def main(A: T.Buffer((H, H), dtype), bias: T.Buffer((H,), dtype), x0: T.Buffer((B, H), dtype),
                 Y: T.Buffer(y_shape, dtype)):
            ws = T.alloc_buffer((2 * slot_words * 2,), "int32")
            red0 = T.alloc_buffer((W, Vp), "float32")
            red1 = T.alloc_buffer((W, Vp), "float32")
            a_reg = T.alloc_buffer((max(R_reg * KT, 1),), "float32")
            a_smem = T.alloc_buffer((max(R_smem, 1), Hp), "float32")
            cval = T.alloc_buffer((BC * KT,), "float32")
            acc = T.alloc_buffer((Vp,), "float32")
            bias_reg = T.alloc_buffer((finish_iters,), "float32")
            for g in T.serial(G):
                for t in T.serial(NT):
                    seed_slots(x0, ws, g, t)
            for p in T.serial(pairs):
                iteration(ws, a_reg, a_smem, cval, acc, red0, bias_reg, bias, A, Y, 2 * p)
                if 2 * p + 1 < iters:
                    iteration(ws, a_reg, a_smem, cval, acc, red1, bias_reg, bias, A, Y, 2 * p + 1)

    return scheduled(main, "recurrent_gemm", cooperative=gpu)


# ----------------------------------------------------------------------------------------------------
# The per-step path (A too large for the chip): a host loop of GEMM + activation launches
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PerStepConfig:
    rows_per_block: int = 4  # one warp per row
    batch_chunk: int = 8


def per_step_recurrent_gemm_func(H: int, B: int, steps: int, dtype: str, activation, return_sequences: bool,
                                 target, config: PerStepConfig | None = None):
    """Same interface as the persistent kernel. Each step is one launch: a warp per output row, lanes
    over k (coalesced rows of A), batch columns in chunks, state ping-ponged in a float32 workspace."""
    target = resolve(target)
    gpu = is_gpu(target)
    act = parse_activation(activation)
    config = config or PerStepConfig()
    WS = 32 if gpu else 1
    RB = config.rows_per_block
    BC = max(1, min(config.batch_chunk, B))
    NC = math.ceil(B / BC)
    KL = math.ceil(H / WS)  # k per lane
    nblk = math.ceil(H / RB)
    y_shape = (steps, B, H) if return_sequences else (B, H)
    bx = (lambda n: T.thread_binding(n, thread="blockIdx.x")) if gpu else T.serial
    ty = (lambda n: T.thread_binding(n, thread="threadIdx.y")) if gpu else T.serial
    tx = (lambda n: T.thread_binding(n, thread="threadIdx.x")) if gpu else T.serial
    full = T.uint32(0xFFFFFFFF)

    @T.prim_func
    def main(A: T.Buffer((H, H), dtype), bias: T.Buffer((H,), dtype), x0: T.Buffer((B, H), dtype),
             Y: T.Buffer(y_shape, dtype)):
        st = T.alloc_buffer((2, B, H), "float32", scope="global")
        for blk in bx(T.ceildiv(B * H, 256)):  # x0 -> slot 1, the "previous" state of step 0
            for tt in tx(256 if gpu else 1):
                for e in T.serial(1 if gpu else 256):
                    idx = T.meta_var(blk * 256 + tt + e)
                    if idx < B * H:
                        st[1, idx // H, idx % H] = rounded(f32(x0[idx // H, idx % H], dtype), dtype)
        for n in T.serial(steps):
            for blk in bx(nblk):
                for rw in ty(RB):
                    for lane in tx(WS):
                        acc = T.alloc_buffer((BC,), "float32", scope="local")
                        row = T.meta_var(blk * RB + rw)
                        for c in T.serial(NC):
                            for bb in T.unroll(BC):
                                acc[bb] = T.float32(0)
                            if row < H:
                                for i in T.serial(KL):
                                    k = T.meta_var(i * WS + lane)
                                    if k < H:
                                        a = f32(A[row, k], dtype)
                                        for bb in T.unroll(BC):
                                            b = T.meta_var(T.min(c * BC + bb, B - 1))
                                            acc[bb] = acc[bb] + a * st[(n + 1) % 2, b, k]
                            if gpu:
                                for bb in T.unroll(BC):
                                    for o in T.unroll(5):
                                        acc[bb] = acc[bb] + T.tvm_warp_shuffle_xor(full, acc[bb], 16 >> o, 32, 32)
                            if lane == 0 and row < H:
                                for bb in T.serial(BC):
                                    b = T.meta_var(c * BC + bb)
                                    if b < B:
                                        y = rounded(act.expr(acc[bb] + f32(bias[row], dtype)), dtype)
                                        st[n % 2, b, row] = y
                                        if return_sequences:
                                            Y[n, b, row] = T.Cast(dtype, y)
                                        elif n == steps - 1:
                                            Y[b, row] = T.Cast(dtype, y)

    return scheduled(main, "recurrent_gemm", cooperative=False)


# ----------------------------------------------------------------------------------------------------
# Entry points: validation, the automatic choice, build and run
# ----------------------------------------------------------------------------------------------------


def validate_inputs(A, bias, x0, steps, dtype=None) -> tuple[int, int, str]:
    """Check shapes/dtypes of numpy-like A [H,H], bias [H], x0 [B,H]; returns (H, B, dtype)."""
    for name, arr in (("A", A), ("bias", bias), ("x0", x0)):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise TvmseqError(f"recurrent_gemm: '{name}' must be an array, got {type(arr).__name__}")
    if len(A.shape) != 2 or A.shape[0] != A.shape[1]:
        raise TvmseqError(f"recurrent_gemm: 'A' must be square [H, H], got shape {tuple(A.shape)}")
    H = int(A.shape[0])
    if H < 1:
        raise TvmseqError("recurrent_gemm: 'A' is empty")
    if tuple(bias.shape) != (H,):
        raise TvmseqError(f"recurrent_gemm: 'bias' must have shape ({H},), got {tuple(bias.shape)}")
    if len(x0.shape) != 2 or x0.shape[1] != H or x0.shape[0] < 1:
        raise TvmseqError(f"recurrent_gemm: 'x0' must have shape [B, {H}], got {tuple(x0.shape)}")
    dt = str(dtype or A.dtype)
    dt = {"float": "float32"}.get(dt, dt).replace("torch.", "")
    if dt not in _DTYPES:
        raise TvmseqError(f"recurrent_gemm: dtype must be one of {_DTYPES}, got {dt}")
    for name, arr in (("A", A), ("bias", bias), ("x0", x0)):
        if str(arr.dtype).replace("torch.", "") != dt:
            raise TvmseqError(f"recurrent_gemm: '{name}' has dtype {arr.dtype}, expected {dt}")
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise TvmseqError(f"recurrent_gemm: 'steps' must be a positive int, got {steps!r}")
    return H, int(x0.shape[0]), dt


def recurrent_gemm_func(H: int, B: int, steps: int, dtype: str = "float32", activation="tanh",
                        return_sequences: bool = True, target=None, config=None, path: str = "auto"):
    """The kernel for this problem: the persistent one when A fits on chip (or path='persistent'),
    else the per-step one. Returns (prim_func, path)."""
    target = resolve(target)
    if dtype not in _DTYPES:
        raise TvmseqError(f"recurrent_gemm: dtype must be one of {_DTYPES}, got {dtype}")
    if path == "auto":
        path, _ = choose_path(H, B, dtype, target, config if isinstance(config, PersistentConfig) else None)
    if path == "persistent":
        return persistent_recurrent_gemm_func(H, B, steps, dtype, activation, return_sequences, target, config), path
    if path == "per_step":
        cfg = config if isinstance(config, PerStepConfig) else None
        return per_step_recurrent_gemm_func(H, B, steps, dtype, activation, return_sequences, target, cfg), path
    raise TvmseqError(f"recurrent_gemm: path must be auto, persistent or per_step, got {path!r}")


@functools.lru_cache(maxsize=64)
def _compiled(H, B, steps, dtype, activation, return_sequences, target_str, config, path):
    target = tvm.target.Target(target_str) if target_str in ("llvm",) else resolve(target_str)
    func, path = recurrent_gemm_func(H, B, steps, dtype, activation, return_sequences, target, config, path)
    return tvm.compile(tvm.IRModule({"recurrent_gemm": func}), target=target), path


def build(H: int, B: int, steps: int, dtype: str = "float32", activation="tanh", return_sequences: bool = True,
          target=None, config=None, path: str = "auto"):
    """Compiled executable (cached) and the path taken; call it as ex['recurrent_gemm'](A, bias, x0, Y)."""
    target = resolve(target)
    key = "llvm" if not is_gpu(target) else str(target.attrs.get("arch", "cuda"))
    act = parse_activation(activation)
    return _compiled(H, B, steps, dtype, act, return_sequences, "llvm" if key == "llvm" else "cuda", config, path)


def recurrent_gemm(A, bias, x0, steps: int, activation="tanh", return_sequences: bool = True, target=None,
                   config=None, path: str = "auto") -> np.ndarray:
    """numpy in, numpy out: every X_n ([steps, B, H]) or the last ([B, H]), X_n = f(X_{n-1} A^T + bias)."""
    A, bias, x0 = (np.ascontiguousarray(a) for a in (A, bias, x0))
    H, B, dtype = validate_inputs(A, bias, x0, steps)
    target = resolve(target)
    ex, _ = build(H, B, int(steps), dtype, activation, return_sequences, target, config, path)
    dev = device_for(target)
    y = tvm.runtime.tensor(np.zeros((steps, B, H) if return_sequences else (B, H), dtype), dev)
    args = [tvm.runtime.tensor(a, dev) for a in (A, bias, x0)]
    ex["recurrent_gemm"](*args, y)
    return y.numpy()
