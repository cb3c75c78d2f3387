"""ONNX LSTM on the per-step path, sharing the GRU's pieces (gru.py).

Pipeline of one LSTM node (both directions in every launch):
1. the input projection of all time steps as ONE GEMM (`input_projection_func` with 4 gates):
   gate_i[d, t, b, :] = X[t, b, :] W[d]^T + Wb[d] + Rb[d]; every bias of an LSTM is additive, so all of
   them are folded into this GEMM and the recurrence takes none;
2. `recurrence_func`: a host loop over the (symbolic) time steps; per step ONE GEMM over all 4H gate rows,
   gh = h R^T (`gru.step_gemm_plan`: warp per row at small batch, the tiled GEMM of `step_gemm.py` from
   `TILED_MIN_BATCH` on, its split-K partial sums added here), then ONE fused kernel for the gate math
   and the state update, grid (batch, directions, unit chunks) as the GRU's. On the CPU, where R is packed
   into panels (long calls) and hidden is a multiple of 16, a step is ONE launch of the thread pool instead:
   each panel holds 16 units of all 4 gates and its register tiles go straight into the gate math
   (`step_gemm.cpu_fused_time_loop_macro`), h alternating between two buffers.

Per unit j of direction d, batch row b, with a_k = gate_i[.., kH + j] + gh[.., kH + j] (k = i, o, f, c):
    i = f(clip(a_i + P_i c)),  f_ = 1 - i if input_forget else f(clip(a_f + P_f c)),
    c' = f_ c + i g(clip(a_c)),  o = f(clip(a_o + P_o c')),  h' = o h(c')
(clip bounds each gate's whole pre-activation and not the cell state, as onnxruntime does). The hidden
state and the cell state live in float32 workspaces; Y, Y_h and Y_c are written in the model's dtype.
`sequence_lens` as for the GRU: the reverse direction starts at a row's last valid step, Y past a row's
end is zero, Y_h / Y_c are the states at the last valid step (zero for a zero-length row, as onnxruntime
does), lengths clamped into [0, T] inside the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import tvm
from tvm import tirx

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM: nothing is built here
    T = None

from ...errors import TvmseqError
from ..activations import Activation
from .gru import (DIRECTIONS, StepSchedule, _clip_fn, _let, batch_extent, check_batch, cpu_activation, cpu_packs_r,
                  cpu_r_panels, cpu_unit_chunk, gemm_then_units_steps, partial_sum, r_buffer, reverse_fn,
                  row_length_fn, state_macros, step_gemm_plan, time_loop, unit_loops, unit_update)
from .step_gemm import (CPU_FUSED_UNITS, CPU_PANEL, CPU_PANEL_PARALLEL_MIN_MACS, Panels, cpu_cores,
                        cpu_fused_time_loop_macro, cpu_panel_size, cpu_parallel_min_macs)

GATE_ORDER = ("i", "o", "f", "c")      # rows of W, R and B per direction, H each
PEEPHOLE_ORDER = ("i", "o", "f")       # entries of P per direction, H each
DEFAULT_ACTIVATIONS = ("Sigmoid", "Tanh", "Tanh")   # f (gates), g (cell input), h (cell output)


@dataclass(frozen=True)
class LstmSpec:
    """Everything that selects an LSTM kernel variant (the time axis stays symbolic, and the batch too when
    `batch` is None or a name: the kernels then take any batch)."""

    num_directions: int
    batch: int | str | None
    hidden: int
    input_size: int
    dtype: str = "float32"
    direction: str = "forward"
    activations: tuple[Activation, ...] = ()   # 3 per direction: f, g, h
    clip: float | None = None
    has_seq_lens: bool = False
    input_forget: int = 0
    has_peepholes: bool = False
    gates: ClassVar[int] = 4   # rows of W per hidden unit: i, o, f, c

    def __post_init__(self):
        if isinstance(self.batch, str):   # a symbolic name: any batch
            object.__setattr__(self, "batch", None)
        check_batch(self.batch)
        if self.direction not in DIRECTIONS:
            raise TvmseqError(f"LSTM direction must be one of {DIRECTIONS}, got {self.direction!r}")
        want_d = 2 if self.direction == "bidirectional" else 1
        if self.num_directions != want_d:
            raise TvmseqError(f"LSTM direction {self.direction} needs num_directions {want_d}, "
                              f"got {self.num_directions}")
        # a relax dtype (the importer's struct info) as its name: specs key caches and schedule databases
        object.__setattr__(self, "dtype", str(self.dtype))
        if self.dtype not in ("float32", "float16"):
            raise TvmseqError(f"LSTM supports float32 and float16, got {self.dtype}")
        if self.input_forget not in (0, 1):
            raise TvmseqError(f"LSTM input_forget must be 0 or 1, got {self.input_forget}")
        if self.clip is not None and not self.clip > 0:
            raise TvmseqError(f"LSTM clip must be positive, got {self.clip}")
        if not self.activations:
            acts = tuple(Activation.make(n) for n in DEFAULT_ACTIVATIONS) * self.num_directions
            object.__setattr__(self, "activations", acts)
        object.__setattr__(self, "activations", tuple(self.activations))
        if len(self.activations) != 3 * self.num_directions:
            raise TvmseqError(f"LSTM needs {3 * self.num_directions} activations (f, g, h per direction), "
                              f"got {len(self.activations)}")


def activation_fn(spec: LstmSpec, which: int, cpu: bool = False):
    """(d, x) -> activation `which` (0: f, 1: g, 2: h) of direction d applied to x, a TIR expression
    (a select between the two directions only when they differ); cpu: Sigmoid and Tanh on the polynomial exp
    of `gru.cpu_activation`, so a vectorized gate loop stays in SIMD registers (libm's expf is one call a lane)."""
    acts = [spec.activations[3 * d + which] for d in range(spec.num_directions)]
    fns = [cpu_activation(a) if cpu else a.expr for a in acts]
    if len(set(acts)) == 1:
        return lambda d, x: fns[0](x)
    return lambda d, x: T.if_then_else(d == 0, fns[0](x), fns[1](x))


def cpu_fuses_gates(gpu: bool, sched: StepSchedule, H: int, target=None) -> bool:
    """Whether a CPU LSTM steps with its gate math fused into the panel GEMM (`step_gemm.cpu_fused_time_loop_macro`)
    when it packs R: a packing recurrence (`gru.cpu_packs_r`) whose hidden size is whole vectors of units."""
    # AVX-512's panels only: in AVX2's 8-lane geometry TVM's common-subexpression pass failed on the fused step at
    # batch 3 with peepholes ("variable cse_v.. has been used before definition"), and the LSTM stepping on those
    # panels with its gate loop apart measured faster (2-core Zen 3, 2026-11-28)
    return (cpu_panel_size(target) == CPU_PANEL and cpu_packs_r(gpu, sched, 4 * H, target)
            and H % CPU_FUSED_UNITS == 0)


def _fused_write_back(new_cell, new_hidden, row_length, is_reverse, H: int, dt: str):
    """write_back(BT) for `step_gemm.cpu_fused_time_loop_macro`: the LSTM update at step s of CPU_FUSED_UNITS
    units of BT batch rows from the panel's gate sums, ops = (GateI, P, Lens, Y, cell, seq): within a row's length
    the cell's math (new_cell / new_hidden of recurrence_func) into cell and h_next, Y[t]; past it h carried to
    h_next and Y[s] = 0."""
    U = CPU_FUSED_UNITS

    def acc_pre(acc, GateI, d, t, b, j, jr, v):
        """gate -> its pre-activation: the tile's sum (row jr, lane v) + the input projection"""
        return lambda gate: (acc[(jr * 4 + GATE_ORDER.index(gate)) * U + v]
                             + GateI[d, t, b, GATE_ORDER.index(gate) * H + j])

    def write_back(BT: int):
        @T.macro
        def wb(acc, ops, h, h_next, s, d, p, m0):
            GateI, P, Lens, Y, cell, seq = T.meta_var(ops)
            # a loop, not unrolled: with the 4 rows' math unrolled the hidden-256 batch-8 step took 26.2 us
            # against 23.1 (2-core Zen 4, 2026-11-27)
            for jr in T.serial(BT):
                b = T.meta_var(m0 + jr)
                length = T.meta_var(row_length(Lens, b, seq))
                if s < length:
                    t = T.meta_var(T.if_then_else(is_reverse(d), length - 1 - s, s))
                    for v in T.vectorized(U):
                        j = T.meta_var(p * U + v)
                        pre_of = T.meta_var(acc_pre(acc, GateI, d, t, b, j, jr, v))
                        cell[d, b, j] = new_cell(pre_of, P, cell, d, b, j)
                        h_next[d, b, j] = new_hidden(pre_of, P, cell, d, b, j)
                        Y[t, d, b, j] = T.Cast(dt, h_next[d, b, j])
                else:
                    for v in T.vectorized(U):
                        h_next[d, b, p * U + v] = h[d, b, p * U + v]
                        Y[s, d, b, p * U + v] = T.Cast(dt, T.float32(0))

        return wb

    return write_back


# floats a 64-byte cache line holds: the prefetch stride over gate_i rows
_LINE_FLOATS = 16


def _prefetch_gate_rows(is_reverse, G: int):
    """prefetch(ops, s, seq, d, m0, mlen) for the fused time loop's split by batch rows: the gate_i rows m0 ..
    m0 + mlen - 1 of the time step after s (s + 1, or seq - 2 - s backwards: a row's own length may end it sooner,
    where the hint is wasted, never wrong), one prefetch a cache line. They are the projection's output, written by
    other cores: on the 16-core Xeon the rows' misses at each step's start took ~10% of an LSTM recurrence at batch
    64 (H256 3.5-4.1 -> 3.0-3.5 ms, H128 0.91-1.17 -> 0.86-1.01, same machine, 2026-11-28)."""
    @T.macro
    def prefetch(ops, s, seq, d, m0, mlen):
        GateI = T.meta_var(ops[0])
        if s + 1 < seq:
            t = T.meta_var(T.if_then_else(is_reverse(d), seq - 2 - s, s + 1))   # as the write-back's time index
            for i in range(mlen * G // _LINE_FLOATS):
                T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(
                    GateI[d, t, m0 + i * _LINE_FLOATS // G, i * _LINE_FLOATS % G]), 0, 3, 1))

    return prefetch


def r_panels(spec: LstmSpec, target, sched: StepSchedule | None = None) -> Panels | None:
    """How `recurrence_func(spec, target, sched, packed_r=True)` takes R (`gru.cpu_r_panels`; all 4 gates of
    CPU_FUSED_UNITS units a panel where the step fuses its gate math), else None (R as stored); the same `sched` as
    that call (None: the batch's default there and here)."""
    gpu, sched = target.kind.name == "cuda", sched or StepSchedule.for_batch(spec.batch)
    fused = cpu_fuses_gates(gpu, sched, spec.hidden, target)
    return cpu_r_panels(gpu, sched, 4 * spec.hidden, target, CPU_FUSED_UNITS if fused else None)


def recurrence_func(spec: LstmSpec, target: tvm.target.Target, sched: StepSchedule | None = None,
                    packed_r: bool = False) -> tirx.PrimFunc:
    """The time loop of an LSTM node. Inputs: gate_i [D, T, B, 4H] f32 (X W^T + Wb + Rb, gates i, o, f, c),
    R [D, 4H, H] (model dtype; packed_r: float32 panels, `r_panels`), P [D, 3H] f32 (zeros without peepholes),
    seq_lens [B] i32, h0 [D, B, H] f32, c0 [D, B, H] f32. Outputs: Y [T, D, B, H], Y_h [D, B, H], Y_c [D, B, H] (model dtype). With spec.batch
    None, B is a variable bound from gate_i's shape: one kernel for every batch."""
    gpu = target.kind.name == "cuda"
    D, B, H, dt = spec.num_directions, batch_extent(spec.batch), spec.hidden, spec.dtype
    G = 4 * H
    sched = sched or StepSchedule.for_batch(spec.batch)
    # CPU: a block of the gate loop is one SIMD vector of units (gru.cpu_unit_chunk)
    NT = sched.gate_threads if gpu else cpu_unit_chunk(H, sched, target)
    f_act, g_act, h_act = (activation_fn(spec, k, cpu=not gpu) for k in range(3))
    clip = _clip_fn(spec.clip)
    is_reverse = reverse_fn(spec.direction)
    row_length = row_length_fn(spec.has_seq_lens)
    gemm, S = step_gemm_plan(gpu, D, B, H, dt, sched, G, 0, G, target)
    load_state, store_final_state = state_macros(gpu, D, B, H, NT, spec.has_seq_lens, dt)

    def pre(gate, GateI, gh, d, t, b, j):
        """Gate `gate`'s pre-activation of unit j before peephole and clip: input projection + the step
        GEMM's partial sums."""
        col = GATE_ORDER.index(gate) * H + j
        return GateI[d, t, b, col] + partial_sum(gh, S, d, b, col)

    def peep(gate, x, P, d, j, c):
        """x + P_gate c (the peephole of gate i, o or f); x when the node has none."""
        return x + P[d, PEEPHOLE_ORDER.index(gate) * H + j] * c if spec.has_peepholes else x

    def forget(i, GateI, gh, P, d, t, b, j, c_prev):
        if spec.input_forget:
            return T.float32(1) - i
        return f_act(d, clip(peep("f", pre("f", GateI, gh, d, t, b, j), P, d, j, c_prev)))

    @T.macro
    def step_unit(GateI, P, state, cell, gh, Y, d, t, b, j):
        # the gate math and state update of unit j (f, g, h per direction; the cell state in float32)
        c_prev = cell[d, b, j]
        i = f_act(d, clip(peep("i", pre("i", GateI, gh, d, t, b, j), P, d, j, c_prev)))
        f = forget(i, GateI, gh, P, d, t, b, j, c_prev)
        c = f * c_prev + i * g_act(d, clip(pre("c", GateI, gh, d, t, b, j)))
        o = f_act(d, clip(peep("o", pre("o", GateI, gh, d, t, b, j), P, d, j, c)))
        hn = o * h_act(d, c)
        cell[d, b, j] = c
        state[d, b, j] = hn
        Y[t, d, b, j] = T.Cast(dt, hn)

    # The CPU variant: the same math as one expression per state written (intermediates as Let expressions,
    # indices as meta_var), as gru.recurrence_func's: a TIRx assignment declares a one-element local buffer,
    # which cannot hold the vector the vectorized unit loop gives it. pre_of(gate): the gate's pre-activation
    def new_cell(pre_of, P, cell, d, b, j):
        c_prev = cell[d, b, j]
        i_act = f_act(d, clip(peep("i", pre_of("i"), P, d, j, c_prev)))
        forget_of = (lambda i: T.float32(1) - i) if spec.input_forget else (
            lambda i: f_act(d, clip(peep("f", pre_of("f"), P, d, j, c_prev))))
        return _let(i_act, lambda i: forget_of(i) * c_prev + i * g_act(d, clip(pre_of("c"))))

    def new_hidden(pre_of, P, cell, d, b, j):
        c = cell[d, b, j]      # already the new cell state
        return f_act(d, clip(peep("o", pre_of("o"), P, d, j, c))) * h_act(d, c)

    def gh_pre(GateI, gh, d, t, b, j):
        return lambda gate: pre(gate, GateI, gh, d, t, b, j)

    @T.macro
    def step_unit_cpu(GateI, P, state, cell, gh, Y, d, t, b, j):
        pre_of = T.meta_var(gh_pre(GateI, gh, d, t, b, j))
        cell[d, b, j] = new_cell(pre_of, P, cell, d, b, j)
        state[d, b, j] = new_hidden(pre_of, P, cell, d, b, j)
        Y[t, d, b, j] = T.Cast(dt, state[d, b, j])

    # grid (batch, directions, unit chunks) on CUDA; on the CPU one loop over the blocks, each a vector of units
    update_launch = unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse,
                                                             step_unit if gpu else step_unit_cpu))

    def pool_stages():   # the CPU's one-launch time loop: both stages on the pool at any size
        return (step_gemm_plan(gpu, D, B, H, dt, sched, G, 0, G, target, parallel=True)[0],
                unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse, step_unit_cpu),
                           parallel=True))

    def unpack(bufs):   # gemm(state, R, gh) over all 4H gate rows, then the units on (GateI, P, state, cell, gh)
        GateI, P, Lens, Y, state, cell, gh = bufs
        return state, gh, Lens, Y, (GateI, P, state, cell, gh)

    per_step_launches = gemm_then_units_steps(gpu, sched, gemm, update_launch, unpack, pool_stages, D, B, G, H, target)

    fused = cpu_fuses_gates(gpu, sched, H, target)
    if fused:
        fused_loop = cpu_fused_time_loop_macro(
            D, B, H, 4, _fused_write_back(new_cell, new_hidden, row_length, is_reverse, H, dt),
            min_macs=min(cpu_parallel_min_macs(target), CPU_PANEL_PARALLEL_MIN_MACS), threads=cpu_cores(target),
            prefetch_next=_prefetch_gate_rows(is_reverse, G))

    @T.macro
    def steps(R, bufs, seq):
        if fused:
            R_, Rp, packed = T.meta_var(R)
            if packed:   # the gate math in the panel GEMM's write-back, h in two buffers, one launch a call
                GateI, P, Lens, Y, state, cell, gh = T.meta_var(bufs)
                h_next = T.alloc_buffer((D, B, H), "float32")
                fused_loop(Rp, (state, h_next, (GateI, P, Lens, Y, cell, seq)), seq)
                if seq % 2 == 1:
                    for d, b, j in T.grid(D, B, H):
                        state[d, b, j] = h_next[d, b, j]
            else:
                per_step_launches(R, bufs, seq)
        else:
            per_step_launches(R, bufs, seq)

    interleave = CPU_FUSED_UNITS if fused else None
    run_steps = time_loop(steps, gpu, dt, D, G, H, B, sched, target, interleave, packed_r)
    r_shape, r_dtype = r_buffer(D, G, H, dt, cpu_r_panels(gpu, sched, G, target, interleave) if packed_r else None)

    from .cells import per_step_check

    check_steps = per_step_check(f"LSTM recurrence (hidden {H}, {D} direction(s))", D, B, G)

    @T.prim_func
    def lstm_recurrence(gate_i: T.handle, r_w: T.handle, p_w: T.handle, lens: T.handle, h0: T.handle,
                        c0: T.handle, y: T.handle, y_h: T.handle, y_c: T.handle):
        T.func_attr({"global_symbol": "lstm_recurrence", "tirx.noalias": True})
        seq = T.int32()
        GateI = T.match_buffer(gate_i, (D, seq, B, G), "float32")
        R = T.match_buffer(r_w, r_shape, r_dtype)
        P = T.match_buffer(p_w, (D, 3 * H), "float32")
        Lens = T.match_buffer(lens, (B,), "int32")
        H0 = T.match_buffer(h0, (D, B, H), "float32")
        C0 = T.match_buffer(c0, (D, B, H), "float32")
        Y = T.match_buffer(y, (seq, D, B, H), dt)
        Yh = T.match_buffer(y_h, (D, B, H), dt)
        Yc = T.match_buffer(y_c, (D, B, H), dt)
        state = T.alloc_buffer((D, B, H), "float32")
        cell = T.alloc_buffer((D, B, H), "float32")
        gh = T.alloc_buffer((S, D, B, G), "float32")   # split-K partial sums, added by the gate kernel
        check_steps(seq)
        load_state(state, H0)
        load_state(cell, C0)
        run_steps(R, (GateI, P, Lens, Y, state, cell, gh), seq)
        store_final_state(Yh, state, Lens, seq)
        store_final_state(Yc, cell, Lens, seq)

    return lstm_recurrence.with_attr("tirx.is_scheduled", True)
