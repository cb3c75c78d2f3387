"""What describes a recurrent cell, shared by every path that runs one (the SIMT engine of `engine`, the
staged-state kernels of `mma` and `wgmma`, the stacks of `rows` and `stack`): weight rows per hidden unit,
default activations, the pieces of a cell's math as TIR expressions (activations per direction, clip, the time
step a direction handles, a row's sequence length), the LSTM's update (`LstmCell`) and the interface of the
persistent kernels, each cell's signature around one kernel body (`recurrence_prim_func`).

ONNX LSTM step (clip applied to every pre-activation, peephole terms included):
  i = f(Xi + Hi + Pi*c), f = f(Xf + Hf + Pf*c) (input_forget: f = 1 - i), c~ = g(Xc + Hc), c' = f*c + i*c~,
  o = f(Xo + Ho + Po*c'), h' = o*h(c'). sequence_lens: past a row's end Y = 0 and (h, c) are kept; Y_h / Y_c the
  state after the row's last valid step, 0 for a zero-length row.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import TvmseqError
from ..activations import Activation

GATES = {"gru": 3, "rnn": 1}
# Weight rows per hidden unit of every cell: GATES (`engine.persistent_gru_func`) and the LSTM's rows i, o, f, c
# (`engine.persistent_lstm_func`, which brings the LSTM's update math, `LstmCell`, to `engine.engine_func`)
CELL_GATES = {**GATES, "lstm": 4}
# default activations of one direction, as ONNX defines them
DEFAULT_ACTS = {"gru": ("Sigmoid", "Tanh"), "rnn": ("Tanh",), "lstm": ("Sigmoid", "Tanh", "Tanh")}


def check_acts(acts, D, cell="gru"):
    """The Activation objects of every direction (len(DEFAULT_ACTS[cell]) per direction), checked; the ONNX
    defaults when `acts` is empty."""
    per_dir = [Activation.make(name) for name in DEFAULT_ACTS[cell]]
    acts = list(acts) if acts else per_dir * D
    if len(acts) != len(per_dir) * D or not all(isinstance(a, Activation) for a in acts):
        raise TvmseqError(f"persistent {cell.upper()}: needs {len(per_dir) * D} Activation objects "
                          f"({len(per_dir)} per direction), got {acts!r}")
    return acts


# Recurrences on the GPU: sigmoid and tanh on CUDA's fast intrinsics (`activations.fast_sigmoid`, absolute error < 6e-7).
# The gate math is on the critical path of every step: the accurate expf / tanhf / IEEE division were ~100
# instructions a thread a step. Measured on an H200 (2026-11-28, each cell's pick built both ways, recurrence us a
# step, accurate -> fast; max error of Y against a float64 LSTM): float16 batch 8 H128 0.812 -> 0.589, H512 1.670 ->
# 1.385, H1024 2.528 -> 2.310, H128 B256 1.372 -> 1.132, H1024 B256 12.91 -> 10.74 (errors 2.5e-4..2.9e-4 both
# ways); float32 H256 B8 2.092 -> 1.643, H128 B64 1.844 -> 1.659, H512 B64 6.90 -> 6.86 (errors 1.5e-7..1.9e-7 ->
# 2.4e-7..3.1e-7, cuDNN's 2.8e-7..5.5e-6 normwise).
FAST_MATH_DTYPES = ("float16", "float32")


def fast_math_for(dtype: str, gpu: bool, fast_math: bool | None = None) -> bool:
    """Whether a recurrent kernel (engine, staged-state, warpgroup, stacks, one step) computes its gates on
    the fast intrinsics: `fast_math` when given (a benchmark's A/B), else on a GPU (a CPU variant keeps the
    accurate functions)."""
    return gpu and (dtype in FAST_MATH_DTYPES if fast_math is None else fast_math)


def direction_activations(acts, D: int, fast: bool = False) -> list:
    """[fn(d, x)] for each activation slot of a direction (GRU f, g; RNN f; LSTM f, g, h): the activation of
    direction d applied to x (an if_then_else when the two directions differ); `fast`: Sigmoid and Tanh on
    CUDA's fast intrinsics (`activations.fast_sigmoid`)."""
    from tvm.script import tirx as T

    def per_dir(which):
        fns = [acts[(len(acts) // D) * d + which] for d in range(D)]
        if len(set(fns)) == 1:
            return lambda d, x: fns[0].expr(x, fast)
        return lambda d, x: T.if_then_else(d == 0, fns[0].expr(x, fast), fns[1].expr(x, fast))

    return [per_dir(which) for which in range(len(acts) // D)]


def clip_fn(clip):
    """clip(x): the ONNX clip of a pre-activation (identity without one)."""
    from tvm.script import tirx as T

    if clip is None:
        return lambda x: x
    c_ = float(clip)
    return lambda x: T.min(T.max(x, T.float32(-c_)), T.float32(c_))


def cell_math(acts, D: int, NG: int, clip, fast: bool = False):
    """(f, g, clip) of a GRU (NG = 3) / RNN (NG = 1) kernel body: f(d, x) and g(d, x) the activations of
    direction d (an if_then_else when the two directions differ; g None for an RNN), clip(x) the ONNX clip;
    `fast`: `fast_math_for`."""
    fns = direction_activations(acts, D, fast)
    return fns[0], (fns[1] if NG == 3 else None), clip_fn(clip)


def time_index_fn(directions: str):
    """time_index(d, L, s): the time step direction d handles at step s of a row of length L."""
    from tvm.script import tirx as T

    def time_index(d, L, s):
        if directions == "forward":
            return s
        if directions == "reverse":
            return L - 1 - s
        return T.if_then_else(d == 1, L - 1 - s, s)

    return time_index


def row_length(has_seq_lens: bool, B: int):
    """length(Lens, b, seq): row b's sequence length clamped to [0, seq] (seq without sequence_lens)."""
    from tvm.script import tirx as T

    def length(Lens, b, seq):
        if not has_seq_lens:
            return seq
        return T.max(T.min(Lens[T.min(b, B - 1)], seq), 0)

    return length


@dataclass(frozen=True)
class LstmCell:
    """The LSTM's update math for the engine. `pre(q)` is gate q's input plus its recurrent sum (q: 0 i, 1 o,
    2 f, 3 c), `peep(q)` the peephole weight of i (0), o (1), f (2) or None, `fns` = [f, g, h] activations of
    direction d (`direction_activations`), `clip` the ONNX clip."""

    input_forget: bool = False
    has_peepholes: bool = False

    @staticmethod
    def _gate(fn, clip, d, pre, peep, q, c):
        x = pre(q) if peep is None else pre(q) + peep(q) * c
        return fn(d, clip(x))

    def cell(self, fns, clip, d, pre, peep, c):
        """c' = f*c + i*g(Xc + Hc)."""
        from tvm.script import tirx as T

        i = self._gate(fns[0], clip, d, pre, peep, 0, c)
        f = T.float32(1) - i if self.input_forget else self._gate(fns[0], clip, d, pre, peep, 2, c)
        return f * c + i * fns[1](d, clip(pre(3)))

    def hidden(self, fns, clip, d, pre, peep, c_new):
        """h' = o*h(c'), the o gate's peephole on c'."""
        return self._gate(fns[0], clip, d, pre, peep, 1, c_new) * fns[2](d, c_new)


def lstm_activations(acts, D: int):
    """Activation objects (names or Activation in, ONNX defaults when empty)."""
    if not acts:
        return None
    try:
        return [a if isinstance(a, Activation) else Activation.make(a) for a in acts]
    except TvmseqError as err:
        raise TvmseqError(f"persistent LSTM: activations: {err}") from None


def per_step_check(what: str, D: int, B, G: int):
    """T.macro(seq) for the per-step path's recurrences, whose gate_i [D, seq, B, G] is indexed in 32 bits as well:
    with a static batch steps of D x B x G values; with a batch bound at run time (a tirx.Var) the
    rows seq x B (counted in 64 bits) of D x G values each."""
    from tvm.script import tirx as T

    from ...onnx.checks import index_limit_check

    if isinstance(B, int):
        return index_limit_check(what, D * B * G, "step")
    check_rows = index_limit_check(what, D * G, "step x batch row")

    @T.macro
    def check(seq):
        check_rows(T.Cast("int64", seq) * T.Cast("int64", B))

    return check


def recurrence_prim_func(kernel, cell: str, D: int, B: int, H: int, dtype: str, gi_dtype: str = "float32"):
    """The prim_func of a persistent kernel (`engine`, `mma`, `wgmma`) with the interface of `cell`: GRU / RNN
    (gate_i, R, rb_h, seq_lens, h0, Y, Y_h), LSTM (gate_i, R, P, seq_lens, h0, c0, Y, Y_h, Y_c); gate_i of
    gi_dtype, R, Y, Y_h (Y_c) of dtype, the rest float32 (seq_lens int32). Its body is the T.macro
    kernel(GI, Rw, RbH, Pw, Lens, H0, C0, Y, Yh, Yc, seq), None for the buffers the cell lacks."""
    from tvm.script import tirx as T

    from ...onnx.checks import index_limit_check

    G3 = CELL_GATES[cell] * H
    # gate_i [D, seq, B, G3] and Y [seq, D, B, H] are indexed in 32 bits: checked on the host before the kernel
    check_steps = index_limit_check(f"{cell.upper()} recurrence (hidden {H}, batch {B}, {D} direction(s))",
                                    D * B * G3, "step")
    if cell == "lstm":
        @T.prim_func
        def main(gate_i: T.handle, r_w: T.handle, p_w: T.handle, lens: T.handle, h0: T.handle, c0: T.handle,
                 y: T.handle, y_h: T.handle, y_c: T.handle):
            seq = T.int32()
            GI = T.match_buffer(gate_i, (D, seq, B, G3), gi_dtype)
            Rw = T.match_buffer(r_w, (D, G3, H), dtype)
            Pw = T.match_buffer(p_w, (D, 3 * H), "float32")
            Lens = T.match_buffer(lens, (B,), "int32")
            H0 = T.match_buffer(h0, (D, B, H), "float32")
            C0 = T.match_buffer(c0, (D, B, H), "float32")
            Y = T.match_buffer(y, (seq, D, B, H), dtype)
            Yh = T.match_buffer(y_h, (D, B, H), dtype)
            Yc = T.match_buffer(y_c, (D, B, H), dtype)
            check_steps(seq)
            kernel(GI, Rw, None, Pw, Lens, H0, C0, Y, Yh, Yc, seq)

        return main

    @T.prim_func
    def main(gate_i: T.handle, r_w: T.handle, rb_h: T.handle, lens: T.handle, h0: T.handle,
             y: T.handle, y_h: T.handle):
        seq = T.int32()
        GI = T.match_buffer(gate_i, (D, seq, B, G3), gi_dtype)
        Rw = T.match_buffer(r_w, (D, G3, H), dtype)
        RbH = T.match_buffer(rb_h, (D, H), "float32")
        Lens = T.match_buffer(lens, (B,), "int32")
        H0 = T.match_buffer(h0, (D, B, H), "float32")
        Y = T.match_buffer(y, (seq, D, B, H), dtype)
        Yh = T.match_buffer(y_h, (D, B, H), dtype)
        check_steps(seq)
        kernel(GI, Rw, RbH, None, Lens, H0, None, Y, Yh, None, seq)

    return main
