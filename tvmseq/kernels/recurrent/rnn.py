"""ONNX RNN (h' = f(x W^T + h R^T + Wb + Rb)) on the per-step path, sharing the GRU's pieces:
the input projection for all time steps is the GRU's one GEMM (with one gate), each step is one GEMM
kernel (`gru.step_gemm_plan`: warp per row at small batch, the tiled GEMM of `step_gemm.py` from
`TILED_MIN_BATCH` on) and one fused activation/update kernel, grid (batch, directions), which also adds
the GEMM's split-K partial sums."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import tvm
from tvm import tirx

try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM: nothing is built here
    T = None

from ..activations import Activation
from .gru import (StepSchedule, _clip_fn, batch_extent, check_spec, cpu_activation, cpu_r_panels, cpu_unit_chunk,
                  gemm_then_units_steps, partial_sum, r_buffer, reverse_fn, row_length_fn, state_macros,
                  step_gemm_plan, time_loop, unit_loops, unit_update)
from .step_gemm import Panels


@dataclass(frozen=True)
class RnnSpec:
    num_directions: int
    batch: int | None   # None: any batch (the per-step kernels take a symbolic batch)
    hidden: int
    input_size: int
    dtype: str = "float32"
    direction: str = "forward"
    activations: tuple[Activation, ...] = ()
    clip: float | None = None
    has_seq_lens: bool = False
    gates: ClassVar[int] = 1

    def __post_init__(self):
        check_spec(self, "RNN", ("Tanh",))


def r_panels(spec: RnnSpec, target, sched: StepSchedule | None = None) -> Panels | None:
    """How `recurrence_func(spec, target, sched, packed_r=True)` takes R (`gru.cpu_r_panels`), else None; the same
    `sched` as that call (None: the batch's default there and here)."""
    return cpu_r_panels(target.kind.name == "cuda", sched or StepSchedule.for_batch(spec.batch), spec.hidden, target)


def recurrence_func(spec: RnnSpec, target: tvm.target.Target, sched: StepSchedule | None = None,
                    packed_r: bool = False) -> tirx.PrimFunc:
    """Inputs: gate_i [D, T, B, H] f32 (x W^T + Wb + Rb), R [D, H, H] (packed_r: float32 panels, `r_panels`),
    seq_lens [B] i32, h0 [D, B, H] f32.
    Outputs: Y [T, D, B, H], Y_h [D, B, H]; sequence_lens semantics as for the GRU; spec.batch None: any
    batch (bound from gate_i's shape)."""
    gpu = target.kind.name == "cuda"
    D, B, H, dt = spec.num_directions, batch_extent(spec.batch), spec.hidden, spec.dtype
    sched = sched or StepSchedule.for_batch(spec.batch)
    NT = sched.gate_threads if gpu else cpu_unit_chunk(H, sched, target)
    acts, clip, has_lens = spec.activations, _clip_fn(spec.clip), spec.has_seq_lens
    is_reverse = reverse_fn(spec.direction)
    fns = [a.expr if gpu else cpu_activation(a) for a in acts]
    if len(set(acts)) == 1:
        act = lambda d, x: fns[0](x)  # noqa: E731
    else:
        act = lambda d, x: T.if_then_else(d == 0, fns[0](x), fns[1](x))  # noqa: E731
    gemm, S = step_gemm_plan(gpu, D, B, H, dt, sched, H, 0, H, target)
    load_state, store_final_state = state_macros(gpu, D, B, H, NT, has_lens, dt)
    row_length = row_length_fn(has_lens)

    @T.macro
    def step_unit(GateI, state, gh, Y, d, t, b, j):
        hn = act(d, clip(GateI[d, t, b, j] + partial_sum(gh, S, d, b, j)))
        state[d, b, j] = hn
        Y[t, d, b, j] = T.Cast(dt, hn)

    # the CPU variant: one expression per unit (see gru.unit_update)
    @T.macro
    def step_unit_cpu(GateI, state, gh, Y, d, t, b, j):
        state[d, b, j] = act(d, clip(GateI[d, t, b, j] + partial_sum(gh, S, d, b, j)))
        Y[t, d, b, j] = T.Cast(dt, state[d, b, j])

    # grid (batch, directions, unit chunks), as the GRU's gate kernel
    update_launch = unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse,
                                                             step_unit if gpu else step_unit_cpu))

    def pool_stages():   # the CPU's one-launch time loop: both stages on the pool at any size
        return (step_gemm_plan(gpu, D, B, H, dt, sched, H, 0, H, target, parallel=True)[0],
                unit_loops(gpu, D, B, H, NT, unit_update(gpu, NT, H, dt, row_length, is_reverse, step_unit_cpu),
                           parallel=True))

    def unpack(bufs):   # gemm(state, R, gh), then the units on (GateI, state, gh)
        GateI, Lens, Y, state, gh = bufs
        return state, gh, Lens, Y, (GateI, state, gh)

    steps = gemm_then_units_steps(gpu, sched, gemm, update_launch, unpack, pool_stages, D, B, H, H, target)

    run_steps = time_loop(steps, gpu, dt, D, H, H, B, sched, target, packed_r=packed_r)
    r_shape, r_dtype = r_buffer(D, H, H, dt, cpu_r_panels(gpu, sched, H, target) if packed_r else None)

    from .cells import per_step_check

    check_steps = per_step_check(f"RNN recurrence (hidden {H}, {D} direction(s))", D, B, H)

    @T.prim_func
    def rnn_recurrence(gate_i: T.handle, r_w: T.handle, lens: T.handle, h0: T.handle, y: T.handle,
                       y_h: T.handle):
        T.func_attr({"global_symbol": "rnn_recurrence", "tirx.noalias": True})
        seq = T.int32()
        GateI = T.match_buffer(gate_i, (D, seq, B, H), "float32")
        R = T.match_buffer(r_w, r_shape, r_dtype)
        Lens = T.match_buffer(lens, (B,), "int32")
        H0 = T.match_buffer(h0, (D, B, H), "float32")
        Y = T.match_buffer(y, (seq, D, B, H), dt)
        Yh = T.match_buffer(y_h, (D, B, H), dt)
        state = T.alloc_buffer((D, B, H), "float32")
        gh = T.alloc_buffer((S, D, B, H), "float32")   # split-K partial sums, added below
        check_steps(seq)
        load_state(state, H0)
        run_steps(R, (GateI, Lens, Y, state, gh), seq)
        store_final_state(Yh, state, Lens, seq)

    return rnn_recurrence.with_attr("tirx.is_scheduled", True)
