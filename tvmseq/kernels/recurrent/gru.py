"""GRU in TensorIR, the per-step path (the Ingenic patent's structure).

Pipeline of one GRU node (both directions in every launch):
1. `input_projection_func` (projection/gemm.py): ONE GEMM for all time steps,
   gate_i[d, t, b, :] = X[t, b, :] W[d]^T + bias[d] with W = [W_z, W_r, W_h] stored together and the
   biases that do not depend on r folded in; on CUDA the tiled SGEMM template where it applies.
2. `recurrence_func`: a host loop over the (symbolic) time steps; per step one GEMM kernel for
   gate_h = h R^T (both directions in one launch) and one fused kernel for the gate math and the state
   update, grid (batch, directions) with 512-thread blocks. With linear_before_reset=0 the h-gate GEMM
   needs r*h first, so a step is GEMM(z,r) -> gates(r) -> GEMM(h) -> gates(update).
   The step GEMM is a warp per output row for batch < `step_gemm.TILED_MIN_BATCH` and the shared-memory
   tiled GEMM of `step_gemm.py` from there on (its split-K partial sums are added by the gate kernels).

The state lives in a float32 workspace; Y and Y_h are written in the model's dtype. `sequence_lens` is
honoured per batch row: the reverse direction starts at the row's last valid step, outputs past a row's
end are zero, Y_h is the state at the last valid step (zero for a zero-length row, as onnxruntime does).
Lengths are clamped to [0, T] inside the kernels so no value can index out of bounds; the runtime
rejects out-of-range lengths given as model inputs before anything runs.
The CPU variants run the same gate math with serial loops so CI checks the numerics on llvm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import tvm
from tvm import tirx
try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (a deployment box): shapes and schedules still import, no building
    T = None

from ...errors import TvmseqError
from ..activations import Activation
from ..projection.gemm import input_projection_func, schedule_input_projection  # noqa: F401 - re-exported
from .step_gemm import (TILED_MIN_BATCH, GemmTile, Panels, choose_tile, cpu_barrier, cpu_gemm_macro, cpu_lanes,
                        cpu_one_launch_loop, cpu_panel_size, cpu_pack_at_run_time, cpu_pack_macro, cpu_pack_worthwhile,
                        cpu_parallel_min_macs, cpu_step_gemm_macro, cpu_thread_split_macro, normalized, panel_lanes,
                        tiled_gemm_macro)

DIRECTIONS = ("forward", "reverse", "bidirectional")


@dataclass(frozen=True)
class GruSpec:
    """Everything that selects a GRU kernel variant (static shapes; the time axis stays symbolic, and the
    batch too when `batch` is None: the per-step kernels then take any batch)."""

    num_directions: int
    batch: int | None
    hidden: int
    input_size: int
    dtype: str = "float32"
    linear_before_reset: int = 0
    direction: str = "forward"
    activations: tuple[Activation, ...] = ()
    clip: float | None = None
    has_seq_lens: bool = False
    gates: ClassVar[int] = 3  # rows of W per hidden unit: z, r, h

    def __post_init__(self):
        check_spec(self, "GRU", ("Sigmoid", "Tanh"))


def check_spec(spec, cell: str, default_acts: tuple[str, ...]) -> None:
    """The checks of a GruSpec / RnnSpec (`cell` names it in the errors): batch, direction against num_directions,
    dtype (a relax dtype stored as its name: specs key caches and schedule databases) and activations, the ONNX
    defaults `default_acts` (one direction's) when none are given."""
    check_batch(spec.batch)
    if spec.direction not in DIRECTIONS:
        raise TvmseqError(f"direction must be one of {DIRECTIONS}, got {spec.direction!r}")
    if spec.num_directions != (2 if spec.direction == "bidirectional" else 1):
        raise TvmseqError(f"direction {spec.direction} needs num_directions "
                          f"{2 if spec.direction == 'bidirectional' else 1}, got {spec.num_directions}")
    object.__setattr__(spec, "dtype", str(spec.dtype))
    if spec.dtype not in ("float32", "float16"):
        raise TvmseqError(f"{cell} supports float32 and float16, got {spec.dtype}")
    if not spec.activations:
        acts = tuple(Activation.make(name) for name in default_acts) * spec.num_directions
        object.__setattr__(spec, "activations", acts)
    if len(spec.activations) != len(default_acts) * spec.num_directions:
        raise TvmseqError(f"{cell} needs {len(default_acts) * spec.num_directions} activations, "
                          f"got {len(spec.activations)}")


def check_batch(batch) -> None:
    """A spec's batch: a positive int, or None for any batch (symbolic)."""
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise TvmseqError(f"batch must be a positive int or None (any batch), got {batch!r}")


def batch_extent(batch):
    """The batch of a kernel as its TIR extent: the int, or for None (any batch) a fresh int32 variable,
    to be bound by the first match_buffer that names it (the recurrences: gate_i's shape)."""
    return tirx.Var("batch", "int32") if batch is None else batch


@dataclass(frozen=True)
class StepSchedule:
    """Tile constants of the per-step CUDA kernels (data, so a tuner can search them)."""

    gemm_warps: int = 8        # output rows per GEMM block, one warp per row
    gemm_batch_tile: int = 4   # batch rows each warp accumulates at once (registers per lane)
    # threads of a gate-kernel block, grid (batch, directions, hidden / gate_threads): 512 threads and no unit split
    # put 64 blocks on the H100's 132 SMs at batch 64 and took 8.7 us of a 26.6 us fp32 H1024 B64 step (ncu)
    gate_threads: int = 256
    # the tiled step GEMM (step_gemm.py): None = on CUDA from batch TILED_MIN_BATCH on (the CPU keeps its
    # plain loop nest); True/False force it (True on the CPU runs its serialised variant, for tests)
    tiled: bool | None = None
    tile: GemmTile | None = None   # None: step_gemm.choose_tile per GEMM shape

    @classmethod
    def for_batch(cls, batch: int | None) -> "StepSchedule":
        # R is read once per batch tile each step: larger tiles for larger batches (16 accumulators per
        # lane still fit in registers); measured on the H100, tile 4 made batch 256 read R 64 times a step.
        # Any batch (None): tile 8, correct for every batch (rows past it are predicated off)
        if batch is None:
            return cls(gemm_batch_tile=8)
        return cls(gemm_batch_tile=4 if batch <= 4 else 8 if batch <= 8 else 16)

    def use_tiled(self, gpu: bool, batch: int | None) -> bool:
        """Whether the step GEMM is the tiled one of step_gemm.py (which needs a static batch)."""
        if batch is None or not isinstance(batch, int):
            if self.tiled:
                raise TvmseqError("the tiled step GEMM needs a static batch")
            return False
        return (gpu and batch >= TILED_MIN_BATCH) if self.tiled is None else self.tiled


# ---------------------------------------------------------------------------------------------------
# 1. the input projection: one GEMM over all time steps
# ---------------------------------------------------------------------------------------------------
# input_projection_func / schedule_input_projection live in projection/gemm.py (imported above): the
# GEMM block over (d, t, b, j, k) and, on CUDA, the tiled SGEMM template of tvmseq.tune.space where an
# M tile divides the batch (dlight's Matmul rule otherwise).


# ---------------------------------------------------------------------------------------------------
# 2. the recurrence: host loop over time, per step GEMM kernel(s) + fused gate kernel(s)
# ---------------------------------------------------------------------------------------------------
def _ceildiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _loop_kinds(gpu: bool):
    """Loop constructors: thread bindings on CUDA, plain serial loops on the CPU (same kernel bodies)."""
    if gpu:
        return {name: (lambda n, _t=name: T.thread_binding(n, thread=_t))
                for name in ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y")}
    return {name: (lambda n: T.serial(n)) for name in
            ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y")}


def _per_direction(spec: GruSpec, which: int, cpu: bool = False):
    """x -> activation `which` (0: f, 1: g) of direction d, as a TIR expression of (d, x); cpu: Sigmoid and
    Tanh as `cpu_activation` computes them (vectorizable)."""
    acts = [spec.activations[2 * d + which] for d in range(spec.num_directions)]
    fns = [cpu_activation(a) if cpu else a.expr for a in acts]
    if len(set(acts)) == 1:
        return lambda d, x: fns[0](x)
    return lambda d, x: T.if_then_else(d == 0, fns[0](x), fns[1](x))


# ---------------------------------------------------------------------------------------------------
# CPU activations: exp as a polynomial, so a vectorized gate loop stays in SIMD registers (LLVM turns a
# vector exp into one libm call per lane); Cephes' expf (range reduction by ln 2, degree-7 polynomial,
# 2^n built in the exponent bits), about 2 ulp
# ---------------------------------------------------------------------------------------------------
_LN2_HI, _LN2_LO, _LOG2E = 0.693359375, -2.12194440e-4, 1.44269504088896341
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
             5.0000001201e-1)
_EXP_MIN, _EXP_MAX = -87.33654, 88.37626   # 2^n stays a normal float32


def _let(value, body):
    """body(v) with v bound to `value` once (an expression used several times is computed once)."""
    var = tirx.Var("v", "float32")
    return tirx.Let(var, value, body(var))


def fast_exp(x):
    """exp(x) for float32 TIR expressions, from arithmetic only (vectorizes); inputs clamped into the range
    where the result is a normal float32."""
    f = T.float32

    def reduced(xc):
        def poly(n):
            def on_r(r):
                p = f(_EXP_POLY[0])
                for c in _EXP_POLY[1:]:
                    p = p * r + f(c)
                scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
                return (p * r * r + r + f(1)) * scale

            return _let(xc - n * f(_LN2_HI) - n * f(_LN2_LO), on_r)

        return _let(T.floor(xc * f(_LOG2E) + f(0.5)), poly)

    return _let(T.max(T.min(x, f(_EXP_MAX)), f(_EXP_MIN)), reduced)


# Sigmoid and Tanh as rational functions of x^2 (the minimax fits of Eigen's float tanh and of onnxruntime's MLAS
# logistic): clamped x, an odd numerator, an even denominator, one division. Against 1 / (1 + e^-x) and
# 1 - 2 / (1 + e^2x) on `fast_exp` (same ~1e-7 error) they took an LSTM's gate math from 1.5 ms to 0.1 ms of a 100-step
# batch-64 hidden-128 recurrence (6.02 -> 4.52 ms, the GEMM alone 4.43; 2-core Zen 4, 2026-11-28): the exp's
# floor, shifts and the dependent division sat on the critical path, the polynomials pipeline.
_TANH_BOUND = 9.0     # tanh(9) = 1 - 3e-8
_TANH_NUM = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
             1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_TANH_DEN = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_SIGMOID_BOUND = 18.0
_SIGMOID_NUM = (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03,
                2.48287947061529e-01)
_SIGMOID_DEN = (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03,
                1.16817656904453e-01, 9.93151921023180e-01)


def _rational(bound: float, num: tuple, den: tuple, offset: float, low: float):
    """x -> offset + x' num(x'^2) / den(x'^2) with x' = x clamped to +-bound, the result kept within [low, 1]."""
    f = T.float32

    def horner(coefs, x2):
        p = f(coefs[0])
        for c in coefs[1:]:
            p = p * x2 + f(c)
        return p

    def on_clamped(xc):
        return _let(xc * xc, lambda x2: T.max(T.min(f(offset) + xc * horner(num, x2) / horner(den, x2), f(1)), f(low)))

    return lambda x: _let(T.max(T.min(x, f(bound)), f(-bound)), on_clamped)


def cpu_activation(act: Activation):
    """x -> act(x) for the CPU kernels: Sigmoid and Tanh as rational functions (`_rational`, absolute error < 4e-7,
    arithmetic only so a vectorized loop stays in SIMD registers); every other activation as `Activation.expr`."""
    if act.name == "Sigmoid":
        return _rational(_SIGMOID_BOUND, _SIGMOID_NUM, _SIGMOID_DEN, 0.5, 0.0)
    if act.name == "Tanh":
        return _rational(_TANH_BOUND, _TANH_NUM, _TANH_DEN, 0.0, -1.0)
    return act.expr


def _clip_fn(clip: float | None):
    if clip is None:
        return lambda x: x
    c = float(clip)
    return lambda x: T.min(T.max(x, T.float32(-c)), T.float32(c))


def reverse_fn(direction: str):
    """d -> whether direction d runs backwards in time (a Python bool or a TIR condition)."""
    if direction == "reverse":
        return lambda d: True
    if direction == "bidirectional":
        return lambda d: d == 1
    return lambda d: False


def step_gemm_macro(gpu: bool, D: int, B: int, H: int, sched: StepSchedule):
    """The per-step GEMM at small batch as a TVMScript macro:
    gh[0, d, b, row_offset + r] = src[d, b, :] . R[d, row_offset + r, :].
    CUDA: one warp per output row, BT batch rows accumulated per lane, shuffle reduction; grid
    (rows / warps, batch tiles, directions). CPU: a plain loop nest."""
    L = _loop_kinds(gpu)
    WARPS, BT = sched.gemm_warps, sched.gemm_batch_tile
    f32 = lambda v: T.Cast("float32", v)  # noqa: E731

    @T.macro
    def gemm(src, R, gh, row_offset: T.int32, rows: T.int32):
        # gh[0, d, b, row_offset + r] = sum_k src[d, b, k] * R[d, row_offset + r, k] for r < rows
        if gpu:
            for d in L["blockIdx.z"](D):
                for bt in L["blockIdx.y"](_ceildiv(B, BT)):
                    for rb in L["blockIdx.x"](_ceildiv(rows, WARPS)):
                        for warp in L["threadIdx.y"](WARPS):
                            for lane in L["threadIdx.x"](32):
                                acc = T.alloc_buffer((BT,), "float32", scope="local")
                                row = rb * WARPS + warp
                                for i in T.unroll(BT):
                                    acc[i] = T.float32(0)
                                if row < rows:  # uniform across the warp
                                    for k0 in range(_ceildiv(H, 32)):
                                        if k0 * 32 + lane < H:
                                            for i in T.unroll(BT):
                                                if bt * BT + i < B:
                                                    acc[i] = acc[i] + f32(R[d, row_offset + row, k0 * 32 + lane]) * src[d, bt * BT + i, k0 * 32 + lane]
                                    for i in T.unroll(BT):
                                        for sh in T.unroll(5):
                                            # full mask: the whole warp is here (row is warp-uniform)
                                            acc[i] = acc[i] + T.tvm_warp_shuffle_down(
                                                T.uint32(0xFFFFFFFF), acc[i], 16 >> sh, 32, 32)
                                        if lane == 0 and bt * BT + i < B:
                                            gh[0, d, bt * BT + i, row_offset + row] = acc[i]
        else:
            for d, b, r in T.grid(D, B, rows):
                acc = T.alloc_buffer((1,), "float32", scope="local")
                acc[0] = T.float32(0)
                for k in range(H):
                    acc[0] = acc[0] + f32(R[d, row_offset + r, k]) * src[d, b, k]
                gh[0, d, b, row_offset + r] = acc[0]

    return gemm


def step_gemm_plan(gpu: bool, D: int, B: int, H: int, dt: str, sched: StepSchedule, rows: int, row_offset: int,
                   out_cols: int, target=None, parallel: bool | None = None):
    """One per-step GEMM, gh[s, d, b, row_offset + r] for r < rows (gh: [S, D, B, out_cols]): (macro
    gemm(src, R, gh), S) where S is the number of partial-sum slices its consumers must add (1 unless the
    tiled GEMM splits K). B is an int or a TIR variable (any batch). On the CPU (unless `sched.tiled` forces
    the tiled GEMM's serial variant) the SIMD GEMM of `step_gemm.cpu_gemm_macro`, or with `cpu_packs_r` the
    one of `step_gemm.cpu_step_gemm_macro` (panels of packed R in long calls, that GEMM in short ones)."""
    if cpu_packs_r(gpu, sched, out_cols, target):   # R as (R, panels, packed): `time_loop` packs it
        return cpu_step_gemm_macro(D, B, H, dt, rows, row_offset, cpu_panel_size(target), cpu_lanes(target),
                                   min_macs=cpu_parallel_min_macs(target), parallel=parallel), 1
    if not gpu and not sched.tiled:
        return cpu_gemm_macro(D, B, H, dt, rows, row_offset, cpu_lanes(target), parallel=parallel,
                              min_macs=cpu_parallel_min_macs(target)), 1
    if sched.use_tiled(gpu, B):
        tile = normalized(sched.tile or choose_tile(B, rows, H, D, dt, target if gpu else None), H)
        return tiled_gemm_macro(gpu, D, B, H, dt, tile, rows, row_offset, out_cols), tile.split_k
    warp_gemm = step_gemm_macro(gpu, D, B, H, sched)

    @T.macro
    def gemm(src, R, gh):
        warp_gemm(src, R, gh, row_offset, rows)

    return gemm, 1


def partial_sum(gh, S: int, d, b, col):
    """gh[0, d, b, col] + ... + gh[S - 1, d, b, col]: the step GEMM's split-K partial sums (a TIR expression)."""
    value = gh[0, d, b, col]
    for s in range(1, S):
        value = value + gh[s, d, b, col]
    return value


def row_length_fn(has_lens: bool):
    """(Lens, b, seq) -> the number of valid steps of batch row b: sequence_lens[b] clamped into [0, seq],
    so no length can index out of bounds (the runtime rejects out-of-range lengths before this runs);
    seq for every row when the node has no sequence_lens."""
    if has_lens:
        return lambda lens, b, seq: T.max(T.min(lens[b], seq), 0)
    return lambda lens, b, seq: seq


def state_macros(gpu: bool, D: int, B: int, H: int, NT: int, has_lens: bool, dt: str):
    """The first and last kernels of a recurrence, grid (batch, directions): state <- h0, and
    Y_h <- state (zero for a zero-length row, as onnxruntime does)."""
    L = _loop_kinds(gpu)
    row_length = row_length_fn(has_lens)

    @T.macro
    def load_state(state, H0):
        for b in L["blockIdx.x"](B):
            for d in L["blockIdx.y"](D):
                for tx in L["threadIdx.x"](NT):
                    for j0 in range(_ceildiv(H, NT)):
                        if j0 * NT + tx < H:
                            state[d, b, j0 * NT + tx] = H0[d, b, j0 * NT + tx]

    @T.macro
    def store_final_state(Yh, state, Lens, seq):
        for b in L["blockIdx.x"](B):
            for d in L["blockIdx.y"](D):
                for tx in L["threadIdx.x"](NT):
                    for j0 in range(_ceildiv(H, NT)):
                        if j0 * NT + tx < H:
                            length = row_length(Lens, b, seq)
                            Yh[d, b, j0 * NT + tx] = T.Cast(dt, T.if_then_else(length > 0, state[d, b, j0 * NT + tx], T.float32(0)))

    return load_state, store_final_state


# Units of one CPU gate kernel from which its loop splits over threads (vectorized, a unit costs 1-3 ns: the
# LSTM's five activations ~2.4 ns a unit on Zen 4). Measured on the 2-core Zen 4, 2026-11-27, 100 steps, one
# process, serial vs split alternated: LSTM H128 B8 (1024 units) 1.04-1.05x faster, B64 1.17x, H256 B8 1.05x,
# H512 B8 1.04x; GRU H128 B64 1.13x, H256 B8 / B64 1.08 / 1.09x, H128 B8 1.01x; batch 1 at 512-1024 units
# 0.98-1.00x (the threshold sat at 65536 units before: every node of the grid ran its gates on one thread).
CPU_GATE_PARALLEL_MIN_UNITS = 1024


def unit_loops(gpu: bool, D: int, B, H: int, NT: int, unit, parallel: bool | None = None):
    """The launch of a per-unit kernel: unit(b, d, jc, tx) for every batch row, direction and unit
    j = jc * NT + tx (unit checks j < H). CUDA: grid (batch, directions, unit chunks of NT), NT threads a
    block. CPU: the blocks as one loop, split over TVM's thread pool from CPU_GATE_PARALLEL_MIN_UNITS units."""
    L = _loop_kinds(gpu)
    NJ = _ceildiv(H, NT)
    # whole vectors of units when NT divides H (unit's j < H check then folds away before vectorizing)
    inner = T.vectorized if H % NT == 0 and NT in (4, 8, 16) else T.serial

    if gpu:
        @T.macro
        def launch(*args):
            for b in L["blockIdx.x"](B):
                for d in L["blockIdx.y"](D):
                    for jc in L["blockIdx.z"](NJ):
                        for tx in L["threadIdx.x"](NT):
                            unit(*args, b, d, jc, tx)
    else:
        def blocks(loop):
            @T.macro
            def run(*args):
                for w in loop(B * D * NJ):
                    for tx in inner(NT):
                        unit(*args, w // (D * NJ), w // NJ % D, w % NJ, tx)
            return run

        # the step GEMM's split (`step_gemm.cpu_thread_split_macro`, D * B * H units as multiply-adds): a symbolic
        # batch is checked every step, since at batch 1 the pool's launch and join cost more than a few hundred units
        launch = cpu_thread_split_macro(blocks, D, B, H, 1, parallel=parallel, min_macs=CPU_GATE_PARALLEL_MIN_UNITS)

    return launch


def cpu_one_launch_steps(step_on_pool, steps, D: int, B, G: int, H: int, target=None):
    """`step_gemm.cpu_one_launch_loop` of a per-step recurrence whose step GEMM is B x G x H a direction: one launch
    a call where that GEMM splits over threads on `target` (`cpu_parallel_min_macs`), else `steps`."""
    return cpu_one_launch_loop(step_on_pool, steps, D, B, G, H, cpu_parallel_min_macs(target))


def cpu_steps_on_pool(gpu: bool, sched: StepSchedule) -> bool:
    """Whether a recurrence's time loop can be one launch of the thread pool (`cpu_one_launch_steps`): on the CPU with
    the SIMD step GEMMs, whose work is a parallel loop. (A forced tiled GEMM, `sched.tiled`, runs its serial variant:
    inside a parallel region every thread would run all of it.)"""
    return not gpu and not sched.tiled


def gemm_then_units_steps(gpu: bool, sched: StepSchedule, gemm, update, unpack, pool_stages, D: int, B, G: int,
                          H: int, target=None):
    """T.macro steps(R, bufs, seq) of a cell whose step is the step GEMM, then one unit kernel (RNN, LSTM): at step s
    gemm(state, R, gh), then update(Lens, Y, unit_bufs, s, seq), with (state, gh, Lens, Y, unit_bufs) = unpack(bufs).
    Where `cpu_steps_on_pool`, `pool_stages()` gives the two built with parallel=True, for the one-launch loop of
    `cpu_one_launch_steps`."""
    def step_of(gemm_, update_):
        @T.macro
        def step(R, bufs, s, seq):
            state, gh, Lens, Y, unit_bufs = T.meta_var(unpack(bufs))
            gemm_(state, R, gh)
            update_(Lens, Y, unit_bufs, s, seq)

        return step

    step = step_of(gemm, update)

    @T.macro
    def launch_a_loop(R, bufs, seq):
        for s in range(seq):
            step(R, bufs, s, seq)

    if not cpu_steps_on_pool(gpu, sched):
        return launch_a_loop
    gemm_on_pool, update_on_pool = pool_stages()
    return cpu_one_launch_steps(step_of(cpu_barrier(gemm_on_pool), cpu_barrier(update_on_pool)), launch_a_loop,
                                D, B, G, H, target)


def unit_update(gpu: bool, NT: int, H: int, dt: str, row_length, is_reverse, step):
    """The unit of a per-step gate kernel (`unit_loops`), the same for every cell: unit(Lens, Y, bufs, s, seq, b,
    d, jc, tx) for unit j = jc * NT + tx of batch row b, direction d at step s: within the row's length
    step(*bufs, Y, d, t, b, j), the cell's macro (its gate math from its buffers `bufs`, the new state(s) and Y[t],
    t the time step direction d handles); past the row's end Y[s] = 0. CUDA: length, t and j are variables; CPU:
    indices as meta_var (the unit loop is vectorized, and a TIRx assignment declares a one-element local buffer,
    which cannot hold a vector)."""
    if gpu:
        @T.macro
        def unit(Lens, Y, bufs, s, seq, b, d, jc, tx):
            if jc * NT + tx < H:
                length = row_length(Lens, b, seq)
                t = T.if_then_else(is_reverse(d), length - 1 - s, s)
                j = jc * NT + tx
                if s < length:
                    step(*bufs, Y, d, t, b, j)
                else:
                    Y[s, d, b, j] = T.Cast(dt, T.float32(0))

        return unit

    @T.macro
    def unit(Lens, Y, bufs, s, seq, b, d, jc, tx):
        j = T.meta_var(jc * NT + tx)
        if j < H:
            if s < row_length(Lens, b, seq):
                t = T.meta_var(T.if_then_else(is_reverse(d), row_length(Lens, b, seq) - 1 - s, s))
                step(*bufs, Y, d, t, b, j)
            else:
                Y[s, d, b, j] = T.Cast(dt, T.float32(0))

    return unit


def cpu_unit_chunk(H: int, sched: "StepSchedule", target=None) -> int:
    """Units of one block of a CPU gate loop: a SIMD vector (16, 8 or 4 lanes, the widest dividing H and no wider
    than `target`'s vectors), else the schedule's gate_threads (a scalar loop). With AVX2 a 16-unit block's values
    each took two of its 16 registers: the LSTM's gate math spilled (H128 B8 2.80 -> 2.22 ms a node call with 8,
    B64 16.3 -> 15.5, H512 B8 28.0 -> 26.0; GRU level; 2-core Zen 3, 2026-11-28)."""
    panel = cpu_panel_size(target)
    widest = panel_lanes(panel) if panel else 16
    return next((v for v in (16, 8, 4) if v <= widest and H % v == 0), sched.gate_threads)


def cpu_weights_fp32(gpu: bool, dt: str) -> bool:
    """Whether a recurrence converts R to float32 once before its time loop: float16 models on the CPU
    (computed in float32; the step GEMM's SIMD loop then loads float32 rows)."""
    return not gpu and dt == "float16"


def cpu_packs_r(gpu: bool, sched: StepSchedule | None, G: int, target=None) -> bool:
    """Whether a CPU recurrence with G gate rows packs R into panels before a long enough time loop
    (`step_gemm.cpu_pack_at_run_time`) for the panel step GEMM; its step GEMMs then take (R, panels, packed)."""
    return not gpu and sched is not None and not sched.tiled and cpu_pack_worthwhile(G, target)


def time_loop(steps, gpu: bool, dt: str, D: int, G: int, H: int, B=None, sched: StepSchedule | None = None,
              target=None, interleave: int | None = None, packed_r: bool = False):
    """T.macro run(R, bufs, seq) of a per-step recurrence (GRU, RNN, LSTM): its T.macro steps(R', bufs, seq) on
    the weights R [D, G, H] as the step GEMM reads them, R itself or (`cpu_weights_fp32`) a float32 copy; with
    `cpu_packs_r`, R' = (that, R packed in panels, whether this call packed it); `interleave`: the panels hold
    that many units of every gate (`step_gemm.cpu_pack_macro`), for a step that fuses its gate math. packed_r:
    R comes packed (`cpu_r_panels`, by the importer), every call steps on its panels."""
    convert_r = cpu_weights_fp32(gpu, dt)
    if packed_r:
        if not cpu_packs_r(gpu, sched, G, target):
            raise TvmseqError("a recurrence takes packed R only where it would pack R itself (`cpu_r_panels`)")

        @T.macro
        def run_packed(R, bufs, seq):
            steps((R, R, True), bufs, seq)

        return run_packed
    if cpu_packs_r(gpu, sched, G, target):
        return _packing_time_loop(steps, convert_r, D, G, H, B, interleave, cpu_panel_size(target))

    @T.macro
    def run(R, bufs, seq):
        if convert_r:   # float16 on the CPU: R converted once, the step GEMM loads float32 rows
            Rf = T.alloc_buffer((D, G, H), "float32")
            for d, g, k in T.grid(D, G, H):
                Rf[d, g, k] = T.Cast("float32", R[d, g, k])
            steps(Rf, bufs, seq)
        else:
            steps(R, bufs, seq)

    return run


def _packing_time_loop(steps, convert_r: bool, D: int, G: int, H: int, B, interleave: int | None,
                       panel: int):
    """time_loop's CPU variant for the panel GEMM: R packed once before a long time loop (a float16 R straight
    into float32 panels of `panel` rows), a short one on R (float16: converted) as before."""
    pack = cpu_pack_macro(D, G, H, panel, interleave)
    panels = Panels(interleave, panel)

    # two copies of the time loop, each with one step GEMM (packed is a Python constant in each): with one
    # loop choosing its GEMM every step and the panels allocated in every call, batch-1 calls (which never
    # pack) took 2-5% longer than before (RNN hidden 512: 1.05 -> 1.09 ms)
    @T.macro
    def run(R, bufs, seq):
        if cpu_pack_at_run_time(seq, B):
            Rp = T.alloc_buffer(panels.shape(D, G, H), "float32")
            pack(R, Rp)
            steps((R, Rp, True), bufs, seq)
        elif convert_r:
            Rf = T.alloc_buffer((D, G, H), "float32")
            for d, g, k in T.grid(D, G, H):
                Rf[d, g, k] = T.Cast("float32", R[d, g, k])
            steps((Rf, Rf, False), bufs, seq)
        else:
            steps((R, R, False), bufs, seq)

    return run


def cpu_r_panels(gpu: bool, sched: StepSchedule | None, G: int, target=None, interleave: int | None = None):
    """The panels (`step_gemm.Panels`) a CPU recurrence with G gate rows steps on when it packs R
    (`cpu_packs_r`), else None: the layout in which the importer packs a constant R once (the kernel built with
    packed_r then takes R that way and never packs it; a call of any length, batch 1 included, steps on the
    panels)."""
    return Panels(interleave, cpu_panel_size(target)) if cpu_packs_r(gpu, sched, G, target) else None


def r_buffer(D: int, G: int, H: int, dt: str, panels=None) -> tuple:
    """(shape, dtype) of a recurrence's R argument: [D, G, H] in the model's dtype, or float32 `panels`."""
    return (panels.shape(D, G, H), "float32") if panels is not None else ((D, G, H), dt)


def r_panels(spec: GruSpec, target, sched: StepSchedule | None = None) -> Panels | None:
    """How `recurrence_func(spec, target, sched, packed_r=True)` takes R (`cpu_r_panels`), else None (R as stored);
    the same `sched` as that call (None: the batch's default there and here)."""
    return cpu_r_panels(target.kind.name == "cuda", sched or StepSchedule.for_batch(spec.batch), 3 * spec.hidden,
                        target)


def recurrence_func(spec: GruSpec, target: tvm.target.Target, sched: StepSchedule | None = None,
                    packed_r: bool = False) -> tirx.PrimFunc:
    """The time loop of a GRU node. Inputs: gate_i [D, T, B, 3H] f32, R [D, 3H, H] (packed_r: float32 panels,
    `r_panels`), rb_h [D, H] f32, seq_lens [B] i32, h0 [D, B, H] f32. Outputs: Y [T, D, B, H], Y_h [D, B, H]
    (model dtype). With spec.batch None, B is a variable bound from gate_i's shape: one kernel for every batch."""
    gpu = target.kind.name == "cuda"
    D, B, H, dt = spec.num_directions, batch_extent(spec.batch), spec.hidden, spec.dtype
    G = 3 * H
    lbr = bool(spec.linear_before_reset)
    sched = sched or StepSchedule.for_batch(spec.batch)
    NT = sched.gate_threads if gpu else cpu_unit_chunk(H, sched, target)
    f_act, g_act, clip = _per_direction(spec, 0, not gpu), _per_direction(spec, 1, not gpu), _clip_fn(spec.clip)
    has_lens = spec.has_seq_lens
    is_reverse = reverse_fn(spec.direction)

    # lbr=1: one GEMM over all 3H rows; lbr=0: z,r rows first, then the h rows on r*h
    gemm_zr, S1 = step_gemm_plan(gpu, D, B, H, dt, sched, G if lbr else 2 * H, 0, G, target)
    gemm_h, S2 = (gemm_zr, S1) if lbr else step_gemm_plan(gpu, D, B, H, dt, sched, H, 2 * H, G, target)
    load_state, store_final_state = state_macros(gpu, D, B, H, NT, has_lens, dt)
    row_length = row_length_fn(has_lens)

    @T.macro
    def reset_gate(GateI, Lens, state, gh, rh, s, seq, b, d, jc, tx):
        # r, then r*h for the h-gate GEMM (lbr=0)
        if jc * NT + tx < H:
            length = row_length(Lens, b, seq)
            t = T.if_then_else(is_reverse(d), length - 1 - s, s)
            j = jc * NT + tx
            if s < length:
                rh[d, b, j] = f_act(d, clip(GateI[d, t, b, H + j] + partial_sum(gh, S1, d, b, H + j))) * state[d, b, j]

    @T.macro
    def step_unit(GateI, RbH, state, gh, Y, d, t, b, j):
        # fused gate math and state update of unit j
        z = f_act(d, clip(GateI[d, t, b, j] + partial_sum(gh, S1, d, b, j)))
        # lbr=1: r scales (h R_h^T + Rb_h); lbr=0: the GEMM already saw r*h
        r = f_act(d, clip(GateI[d, t, b, H + j] + partial_sum(gh, S1, d, b, H + j)))
        h_lin = r * (partial_sum(gh, S2, d, b, 2 * H + j) + RbH[d, j]) if lbr else partial_sum(gh, S2, d, b, 2 * H + j)
        hh = g_act(d, clip(GateI[d, t, b, 2 * H + j] + h_lin))
        hn = (T.float32(1) - z) * hh + z * state[d, b, j]
        state[d, b, j] = hn
        Y[t, d, b, j] = T.Cast(dt, hn)

    # The CPU variants compute the same math as one expression per unit (intermediates as Let expressions,
    # indices substituted with meta_var): a TIRx assignment declares a one-element local buffer, which
    # cannot hold the vector a vectorized unit loop gives it
    @T.macro
    def reset_gate_cpu(GateI, Lens, state, gh, rh, s, seq, b, d, jc, tx):
        j = T.meta_var(jc * NT + tx)
        if j < H:
            if s < row_length(Lens, b, seq):
                t = T.meta_var(T.if_then_else(is_reverse(d), row_length(Lens, b, seq) - 1 - s, s))
                rh[d, b, j] = f_act(d, clip(GateI[d, t, b, H + j] + partial_sum(gh, S1, d, b, H + j))) * state[d, b, j]

    def new_state(GateI, RbH, state, gh, d, t, b, j):
        r = f_act(d, clip(GateI[d, t, b, H + j] + partial_sum(gh, S1, d, b, H + j)))
        h_lin = r * (partial_sum(gh, S2, d, b, 2 * H + j) + RbH[d, j]) if lbr else partial_sum(gh, S2, d, b, 2 * H + j)
        hh = g_act(d, clip(GateI[d, t, b, 2 * H + j] + h_lin))
        return _let(f_act(d, clip(GateI[d, t, b, j] + partial_sum(gh, S1, d, b, j))),
                    lambda z: (T.float32(1) - z) * hh + z * state[d, b, j])

    @T.macro
    def step_unit_cpu(GateI, RbH, state, gh, Y, d, t, b, j):
        state[d, b, j] = new_state(GateI, RbH, state, gh, d, t, b, j)
        Y[t, d, b, j] = T.Cast(dt, state[d, b, j])

    reset_launch = unit_loops(gpu, D, B, H, NT, reset_gate if gpu else reset_gate_cpu)
    update_launch = unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse,
                                                             step_unit if gpu else step_unit_cpu))

    def step_of(zr_gemm, reset, h_gemm, update):
        @T.macro
        def step(R, bufs, s, seq):
            GateI, RbH, Lens, Y, state, gh, rh = T.meta_var(bufs)
            zr_gemm(state, R, gh)
            if not lbr:
                reset(GateI, Lens, state, gh, rh, s, seq)
                h_gemm(rh, R, gh)
            update(Lens, Y, (GateI, RbH, state, gh), s, seq)

        return step

    step = step_of(gemm_zr, reset_launch, gemm_h, update_launch)

    @T.macro
    def launch_a_loop(R, bufs, seq):
        for s in range(seq):
            step(R, bufs, s, seq)

    steps = launch_a_loop
    if cpu_steps_on_pool(gpu, sched):   # the same stages in one launch a call where the GEMM splits over threads
        pool_stages = (step_gemm_plan(gpu, D, B, H, dt, sched, G if lbr else 2 * H, 0, G, target, parallel=True)[0],
                       unit_loops(gpu, D, B, H, NT, reset_gate_cpu, parallel=True),
                       step_gemm_plan(gpu, D, B, H, dt, sched, H, 2 * H, G, target, parallel=True)[0],
                       unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse, step_unit_cpu),
                                  parallel=True))
        steps = cpu_one_launch_steps(step_of(*(cpu_barrier(stage) for stage in pool_stages)), launch_a_loop,
                                     D, B, G if lbr else 2 * H, H, target)

    run_steps = time_loop(steps, gpu, dt, D, G, H, B, sched, target, packed_r=packed_r)
    r_shape, r_dtype = r_buffer(D, G, H, dt, cpu_r_panels(gpu, sched, G, target) if packed_r else None)

    from .cells import per_step_check

    check_steps = per_step_check(f"GRU recurrence (hidden {H}, {D} direction(s))", D, B, G)

    @T.prim_func
    def gru_recurrence(gate_i: T.handle, r_w: T.handle, rb_h: T.handle, lens: T.handle, h0: T.handle,
                       y: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "gru_recurrence", "tirx.noalias": True})
        seq = T.int32()
        GateI = T.match_buffer(gate_i, (D, seq, B, G), "float32")
        R = T.match_buffer(r_w, r_shape, r_dtype)
        RbH = T.match_buffer(rb_h, (D, H), "float32")
        Lens = T.match_buffer(lens, (B,), "int32")
        H0 = T.match_buffer(h0, (D, B, H), "float32")
        Y = T.match_buffer(y, (seq, D, B, H), dt)
        Yh = T.match_buffer(y_h, (D, B, H), dt)
        state = T.alloc_buffer((D, B, H), "float32")
        gh = T.alloc_buffer((max(S1, S2), D, B, G), "float32")   # split-K partial sums, added below
        rh = T.alloc_buffer((D, B, H), "float32")
        check_steps(seq)
        load_state(state, H0)
        run_steps(R, (GateI, RbH, Lens, Y, state, gh, rh), seq)
        store_final_state(Yh, state, Lens, seq)

    return gru_recurrence.with_attr("tirx.is_scheduled", True)
