"""Persistent LSTM: all time steps of an ONNX LSTM node (one or both directions) in ONE CUDA kernel, on the
SIMT engine of `persistent_gru` (weights on chip, LL {value, step} word hand-off, no per-step barrier).

The LSTM is a cell of that engine (`persistent_gru.engine_func`), not a kernel of its own: block g of a direction
keeps rows i, o, f, c of its U units (4U rows of R) in registers / shared memory, a step is one pass of those
rows over h_{n-1}, and the thread that finishes (unit, batch column) holds that item's h AND its cell state c in
float32 registers for all steps (c never leaves the chip; only h is handed off). This module holds the LSTM's
update math (`LstmCell`) and the choice between this kernel, the staged-state kernel of `persistent_mma` (its
'lstm' cell: the same update math, 4 gate rows a unit on tensor cores / FMA units) and the per-step one
(`lstm_recurrence_auto`).

Interface (the same on every LSTM path, so the converter can take either):
  gate_i f32 [D, T, B, 4H] (X W^T + Wb + Rb, gates i, o, f, c), R [D, 4H, H] (dtype), P f32 [D, 3H] (peepholes
  i, o, f; zeros when none), seq_lens i32 [B], h0 f32 [D, B, H], c0 f32 [D, B, H]
  -> Y [T, D, B, H], Y_h [D, B, H], Y_c [D, B, H] (dtype), T symbolic.

ONNX LSTM step (clip applied to every pre-activation, peephole terms included):
  i = f(Xi + Hi + Pi*c), f = f(Xf + Hf + Pf*c) (input_forget: f = 1 - i), c~ = g(Xc + Hc), c' = f*c + i*c~,
  o = f(Xo + Ho + Po*c'), h' = o*h(c'). sequence_lens: past a row's end Y = 0 and (h, c) are kept; Y_h / Y_c the
  state after the row's last valid step, 0 for a zero-length row.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TvmseqError
from ..targets import is_gpu, resolve
from . import persistent_gru as pg
from .activations import Activation

CELL = "lstm"
GATES = pg.CELL_GATES[CELL]   # rows i, o, f, c per hidden unit
PATHS = ("auto", "persistent", "persistent_mma", "persistent_wgmma", "per_step")


@dataclass(frozen=True)
class LstmCell:
    """The LSTM's update math for the engine. `pre(q)` is gate q's input plus its recurrent sum (q: 0 i, 1 o,
    2 f, 3 c), `peep(q)` the peephole weight of i (0), o (1), f (2) or None, `fns` = [f, g, h] activations of
    direction d (`persistent_gru.direction_activations`), `clip` the ONNX clip."""

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


def _activations(acts, D: int):
    """Activation objects (names or Activation in, ONNX defaults when empty)."""
    if not acts:
        return None
    try:
        return [a if isinstance(a, Activation) else Activation.make(a) for a in acts]
    except TvmseqError as err:
        raise TvmseqError(f"persistent LSTM: activations: {err}") from None


def persistent_lstm_func(D: int, B: int, H: int, dtype: str, directions: str, acts=None, clip=None,
                         has_seq_lens: bool = False, input_forget: bool = False, has_peepholes: bool = False,
                         target=None, config=None, slots: int = 2, poll=None):
    """prim_func(gate_i, R, P, seq_lens, h0, c0, Y, Y_h, Y_c) for all steps of an LSTM node (see module doc):
    the CUDA kernel on a GPU target, its serial variant (same per-thread code) on a CPU one."""
    return pg.engine_func(D, B, H, dtype, 1, directions, _activations(acts, D), clip, has_seq_lens, target, config,
                          slots, poll, cell=CELL, lstm=LstmCell(bool(input_forget), bool(has_peepholes)))


def spec_func(spec, target, config=None):
    """`persistent_lstm_func` for an `lstm.LstmSpec`."""
    return persistent_lstm_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                list(spec.activations), spec.clip, spec.has_seq_lens, spec.input_forget,
                                spec.has_peepholes, target, config)


def default_config(D: int, B: int, H: int, dtype: str, target):
    """The engine's schedule for 4H x H weights per direction. No LSTM timings are measured yet, so this is
    the GRU/RNN step-time fit (`persistent_gru.STEP_FIT_US`, per pass: a 4-row pass is a pass like a 3-row one)
    on the LSTM's geometry, or a measured winner once `persistent_gru.json` holds cell 'lstm' entries."""
    return pg.default_gru_config(D, B, H, dtype, resolve(target), CELL)


def fits_on_chip(D: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[bool, str]:
    """Whether the 4H x H recurrent weights of all D directions stay on chip (registers + shared memory of
    resident blocks), and why not."""
    return pg.fits_on_chip(D, B, H, dtype, target, config, CELL)


def estimated_step_us(D: int, B: int, H: int, dtype: str, target=None, config=None) -> float:
    """The cost model's time of one step (us) on the engine (the GRU/RNN fit, see `default_config`)."""
    target = resolve(target)
    config = config or default_config(D, B, H, dtype, target)
    return pg.fitted_step_us(pg._geometry(D, B, H, config, True, CELL))


def mma_func(spec, target, config=None):
    """`persistent_mma.persistent_mma_func` (cell 'lstm') for an `lstm.LstmSpec`: the same interface as
    `spec_func`'s kernel."""
    from . import persistent_mma as pm

    return pm.persistent_mma_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                  _activations(list(spec.activations), spec.num_directions), spec.clip,
                                  spec.has_seq_lens, target, config, CELL,
                                  LstmCell(bool(spec.input_forget), bool(spec.has_peepholes)))


def wgmma_func(spec, target, config=None):
    """`persistent_wgmma.persistent_wgmma_func` (cell 'lstm', float16, sm_90a) for an `lstm.LstmSpec`: the same
    interface as `spec_func`'s kernel."""
    from . import persistent_wgmma as pw

    return pw.persistent_wgmma_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                    _activations(list(spec.activations), spec.num_directions), spec.clip,
                                    spec.has_seq_lens, target, config, CELL,
                                    lstm=LstmCell(bool(spec.input_forget), bool(spec.has_peepholes)))


def measured_path(D: int, B: int, H: int, dtype: str) -> tuple[str, str] | None:
    """(path, why) where `schedules/measured/lstm_path.json` (`schedules/lstm_paths.py`) has timed more than one
    path for this shape on the GPU and the winner still runs it; None elsewhere."""
    from ..tune import measured as db

    entry = db.entry("lstm_path", D=D, B=B, H=H, dtype=dtype)
    if entry is None or len(entry["us"]) < 2:
        return None
    times = ", ".join(f"{p} {us} us" for p, us in sorted(entry["us"].items(), key=lambda kv: kv[1]))
    return entry["path"], f"measured fastest a step ({times})"


def choose_path(D: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[str, str]:
    """The measured path database's winner where it has timed several paths for the shape (`measured_path`); else
    'persistent_wgmma' where the warpgroup kernel runs the shape (`persistent_wgmma.supported` for cell 'lstm':
    the GRU's measured rule, float16 on sm_90a at batch >= 128 or bidirectional hidden >= 1024 batch >= 64, where
    the GRU's wgmma kernel beat the mma.sync one); else 'persistent_mma' where the staged-state kernel runs the shape and is expected faster
    (`persistent_mma.supported` for cell 'lstm': the GRU's measured rules, which an LSTM inherits because both
    kernels do 4/3 of the GRU's work a step: float16 at batch >= 16, float32 at batch 32-64 and hidden <= 512,
    and the small-batch shapes where the GRU database has it beating the engine; its config is the GRU's pick
    where the LSTM's registers fit, `persistent_mma.lstm_variants`); else 'persistent' where the weights stay on
    chip and the batch is one where the engine is expected faster than the per-step kernel, else 'per_step'.
    An engine config (`recurrent_gemm.PersistentConfig`) skips the staged kernels, an `MmaConfig` asks for the
    mma.sync one, a `WgmmaRecConfig` for the warpgroup one.
    Engine or per-step: no LSTM timings yet, the GRU's measured rule (`persistent_gru`: persistent at batch <=
    PERSISTENT_MAX_BATCH or batch x hidden <= PERSISTENT_MAX_BATCH_X_HIDDEN; above, the per-step path's tiled
    step GEMM won), which the LSTM's extra gate does not move (both paths do 4/3 of the GRU's work)."""
    from . import persistent_mma as pm
    from . import persistent_wgmma as pw

    target = resolve(target)
    if not is_gpu(target):
        return "per_step", "CPU target: the per-step kernel (the persistent variant is a serial check only)"
    measured = measured_path(D, B, H, dtype) if config is None else None
    if measured is not None:
        return measured
    if config is None or isinstance(config, pw.WgmmaRecConfig):
        ok, why_wgmma = pw.supported(D, B, H, dtype, 1, target, CELL, config)
        if ok or config is not None:
            return ("persistent_wgmma" if ok else "per_step"), why_wgmma
    if config is None or isinstance(config, pm.MmaConfig):
        ok, why_mma = pm.supported(D, B, H, dtype, 1, target, CELL, config)
        if ok or config is not None:
            return ("persistent_mma" if ok else "per_step"), why_mma
    ok, why = fits_on_chip(D, B, H, dtype, target, config)
    if not ok:
        return "per_step", why
    if config is None and B > pg.PERSISTENT_MAX_BATCH and B * H > pg.PERSISTENT_MAX_BATCH_X_HIDDEN:
        return "per_step", (f"batch {B} x hidden {H}: the per-step path's tiled step GEMM was measured faster there "
                            "than the persistent engine (GRU)")
    return "persistent", f"{why}; ~{estimated_step_us(D, B, H, dtype, target, config):.1f} us a step (cost model)"


def lstm_recurrence_auto(spec, target, path: str = "auto", config=None):
    """(prim_func, path, why) for an `lstm.LstmSpec`: a persistent kernel where it fits and is expected to be
    faster (path 'auto', `choose_path`: 'persistent_wgmma', 'persistent_mma' or 'persistent') or where asked (path
    'persistent', 'persistent_mma' or 'persistent_wgmma'; raises TvmseqError when it cannot run), else (None, 'per_step', why): the caller uses the
    per-step kernel. Both persistent kernels take the same arguments."""
    target = resolve(target)
    if not isinstance(spec.batch, int):
        if path in ("persistent", "persistent_mma", "persistent_wgmma"):
            raise TvmseqError(f"persistent LSTM: needs a static batch, got {spec.batch!r}")
        return None, "per_step", f"batch {spec.batch!r} is not static: the per-step kernel"
    if path == "auto":
        path, why = choose_path(spec.num_directions, spec.batch, spec.hidden, spec.dtype, target, config)
    elif path in PATHS:
        why = f"{path} requested"
    else:
        raise TvmseqError(f"persistent LSTM: path must be one of {PATHS}, got {path!r}")
    if path == "per_step":
        return None, path, why
    if path == "persistent_mma":
        return mma_func(spec, target, config), path, why
    if path == "persistent_wgmma":
        return wgmma_func(spec, target, config), path, why
    return spec_func(spec, target, config), path, why
