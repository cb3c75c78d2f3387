"""Which kernels run a recurrent node: the path chooser, apart from the kernels it chooses between.

Paths (`PATHS`, also the importer's `recurrence=` option): 'persistent' (the SIMT engine of `engine`: weights in
registers, one cooperative launch for all steps), 'persistent_mma' (the staged-state kernel of `mma`: tensor cores
in float16, FMA units in float32), 'persistent_wgmma' (`wgmma`: Hopper warpgroup tensor cores) and 'per_step' (per
step a GEMM and a gate kernel: `gru`, `rnn`, `lstm`, any batch). GRU and RNN: `choose_path`, `recurrence_func_auto`;
LSTM: `choose_lstm_path` (the measured path database `measured_path` first), `lstm_recurrence_auto`.
"""
from __future__ import annotations

from ...errors import TvmseqError
from ...targets import is_gpu, resolve
from .cells import LstmCell, lstm_activations
from .engine import estimated_lstm_step_us, fits_on_chip, lstm_fits_on_chip, lstm_spec_func, persistent_gru_func

# ----------------------------------------------------------------------------------------------------
# GRU and RNN
# ----------------------------------------------------------------------------------------------------


# Where the weights fit, the persistent kernel wins at small batch (H100, 2026-11-22, recurrence alone,
# us a step: B8 H1024 3.5 vs 12.9 per-step) but not at large batch, where its per-thread accumulators
# force many batch chunks (hand-offs) per step and the per-step path's tiled GEMM wins (B64 H1024 27.9
# vs 20.9, B64 H512 10.9 vs 10.2, B64 H256 5.2 vs 8.2). Persistent when B <= PERSISTENT_MAX_BATCH or
# B x H <= PERSISTENT_MAX_BATCH_X_HIDDEN.
PERSISTENT_MAX_BATCH = 16
PERSISTENT_MAX_BATCH_X_HIDDEN = 64 * 256


def choose_path(D: int, B: int, H: int, dtype: str, target=None, config=None, cell: str = "gru",
                lbr=1) -> tuple[str, str]:
    """'persistent_wgmma' for a float16 GRU on sm_90a at large batch (`wgmma.supported`); else
    'persistent_mma' for a float16 recurrence at batch >= 16 that the tensor-core kernel runs
    (`mma.supported`: lbr=1 or RNN, sm_80+, fits); else 'persistent' when the recurrent weights of
    all directions stay on chip and the batch is one where the SIMT engine was measured faster; else
    'per_step' (per step a GEMM launch + a gate launch, R re-read from L2)."""
    from . import mma, wgmma

    target = resolve(target)
    if not is_gpu(target):
        return "per_step", "CPU target: the per-step kernels (the persistent variant is a serial check only)"
    if config is None:
        ok, why_wg = wgmma.supported(D, B, H, dtype, lbr, target, cell)
        if ok:
            return "persistent_wgmma", why_wg
        ok, why_mma = mma.supported(D, B, H, dtype, lbr, target, cell)
        if ok:
            return "persistent_mma", why_mma
    ok, why = fits_on_chip(D, B, H, dtype, target, config, cell)
    if ok and B > PERSISTENT_MAX_BATCH and B * H > PERSISTENT_MAX_BATCH_X_HIDDEN and config is None:
        return "per_step", (f"batch {B} x hidden {H}: the per-step path's tiled step GEMM was measured faster "
                            "there than the persistent kernel")
    return ("persistent" if ok else "per_step"), why


PATHS = ("auto", "persistent", "persistent_mma", "persistent_wgmma", "per_step")


def recurrence_func_auto(spec, target=None, config=None, path: str = "auto"):
    """The recurrence kernel for a `gru.GruSpec` or an `rnn.RnnSpec` (same interface either way, except that
    the persistent RNN takes a zero rb_h [D, H] after R): (prim_func, path, reason).
    path: 'auto' (`choose_path`), 'persistent' or 'per_step'."""
    from . import gru, rnn

    target = resolve(target)
    cell = "rnn" if isinstance(spec, rnn.RnnSpec) else "gru"
    D, B, H = spec.num_directions, spec.batch, spec.hidden
    lbr = getattr(spec, "linear_before_reset", 1)
    if path == "auto":
        path, why = choose_path(D, B, H, spec.dtype, target, config, cell, lbr)
    elif path in PATHS:
        why = f"{path} requested"
    else:
        raise TvmseqError(f"persistent {cell.upper()}: path must be one of {PATHS}, got {path!r}")
    if path in ("persistent_mma", "persistent_wgmma"):
        from . import mma, wgmma

        if cell == "gru" and not lbr:  # dtype, sizes and the fit are checked by the factory
            raise TvmseqError(f"{path} GRU: needs linear_before_reset=1")
        factory = mma.persistent_mma_func if path == "persistent_mma" else wgmma.persistent_wgmma_func
        func = factory(D, B, H, spec.dtype, spec.direction, list(spec.activations), spec.clip, spec.has_seq_lens,
                       target, config, cell)
        return func, path, why
    if path == "persistent":
        func = persistent_gru_func(D, B, H, spec.dtype, getattr(spec, "linear_before_reset", 1), spec.direction,
                                   list(spec.activations), spec.clip, spec.has_seq_lens, target, config, cell=cell)
        return func, path, why
    per_step = rnn.recurrence_func if cell == "rnn" else gru.recurrence_func
    return per_step(spec, target), path, why


# ----------------------------------------------------------------------------------------------------
# LSTM
# ----------------------------------------------------------------------------------------------------


def lstm_mma_func(spec, target, config=None):
    """`mma.persistent_mma_func` (cell 'lstm') for an `lstm.LstmSpec`: the same interface as
    `engine.lstm_spec_func`'s kernel."""
    from . import mma as pm

    return pm.persistent_mma_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                  lstm_activations(list(spec.activations), spec.num_directions), spec.clip,
                                  spec.has_seq_lens, target, config, "lstm",
                                  LstmCell(bool(spec.input_forget), bool(spec.has_peepholes)))


def lstm_wgmma_func(spec, target, config=None):
    """`wgmma.persistent_wgmma_func` (cell 'lstm', float16, sm_90a) for an `lstm.LstmSpec`: the same
    interface as `engine.lstm_spec_func`'s kernel."""
    from . import wgmma as pw

    return pw.persistent_wgmma_func(spec.num_directions, spec.batch, spec.hidden, spec.dtype, spec.direction,
                                    lstm_activations(list(spec.activations), spec.num_directions), spec.clip,
                                    spec.has_seq_lens, target, config, "lstm",
                                    lstm=LstmCell(bool(spec.input_forget), bool(spec.has_peepholes)))


def measured_path(D: int, B: int, H: int, dtype: str) -> tuple[str, str] | None:
    """(path, why) where `schedules/measured/lstm_path.json` (`schedules/lstm_paths.py`) has timed more than one
    path for this shape on the GPU and the winner still runs it; None elsewhere."""
    from ...tune import measured as db

    entry = db.entry("lstm_path", D=D, B=B, H=H, dtype=dtype)
    if entry is None or len(entry["us"]) < 2:
        return None
    times = ", ".join(f"{p} {us} us" for p, us in sorted(entry["us"].items(), key=lambda kv: kv[1]))
    return entry["path"], f"measured fastest a step ({times})"


def choose_lstm_path(D: int, B: int, H: int, dtype: str, target=None, config=None) -> tuple[str, str]:
    """The measured path database's winner where it has timed several paths for the shape (`measured_path`); else
    'persistent_wgmma' where the warpgroup kernel runs the shape (`wgmma.supported` for cell 'lstm': the GRU's
    measured rule, float16 on sm_90a at batch >= 128 or bidirectional hidden >= 1024 batch >= 64, where the GRU's
    wgmma kernel beat the mma.sync one); else 'persistent_mma' where the staged-state kernel runs the shape and is
    expected faster (`mma.supported` for cell 'lstm': the GRU's measured rules, which an LSTM inherits because both
    kernels do 4/3 of the GRU's work a step: float16 at batch >= 16, float32 at batch 32-64 and hidden <= 512,
    and the small-batch shapes where the GRU database has it beating the engine; its config is the GRU's pick
    where the LSTM's registers fit, `mma.lstm_variants`); else 'persistent' where the weights stay on
    chip and the batch is one where the engine is expected faster than the per-step kernel, else 'per_step'.
    An engine config (`recurrent_gemm.PersistentConfig`) skips the staged kernels, an `MmaConfig` asks for the
    mma.sync one, a `WgmmaRecConfig` for the warpgroup one.
    Engine or per-step: no LSTM timings yet, the GRU's measured rule (`choose_path`: persistent at batch <=
    PERSISTENT_MAX_BATCH or batch x hidden <= PERSISTENT_MAX_BATCH_X_HIDDEN; above, the per-step path's tiled
    step GEMM won), which the LSTM's extra gate does not move (both paths do 4/3 of the GRU's work)."""
    from . import mma as pm
    from . import wgmma as pw

    target = resolve(target)
    if not is_gpu(target):
        return "per_step", "CPU target: the per-step kernel (the persistent variant is a serial check only)"
    measured = measured_path(D, B, H, dtype) if config is None else None
    if measured is not None:
        return measured
    if config is None or isinstance(config, pw.WgmmaRecConfig):
        ok, why_wgmma = pw.supported(D, B, H, dtype, 1, target, "lstm", config)
        if ok or config is not None:
            return ("persistent_wgmma" if ok else "per_step"), why_wgmma
    if config is None or isinstance(config, pm.MmaConfig):
        ok, why_mma = pm.supported(D, B, H, dtype, 1, target, "lstm", config)
        if ok or config is not None:
            return ("persistent_mma" if ok else "per_step"), why_mma
    ok, why = lstm_fits_on_chip(D, B, H, dtype, target, config)
    if not ok:
        return "per_step", why
    if config is None and B > PERSISTENT_MAX_BATCH and B * H > PERSISTENT_MAX_BATCH_X_HIDDEN:
        return "per_step", (f"batch {B} x hidden {H}: the per-step path's tiled step GEMM was measured faster there "
                            "than the persistent engine (GRU)")
    return "persistent", f"{why}; ~{estimated_lstm_step_us(D, B, H, dtype, target, config):.1f} us a step (cost model)"


def lstm_recurrence_auto(spec, target, path: str = "auto", config=None):
    """(prim_func, path, why) for an `lstm.LstmSpec`: a persistent kernel where it fits and is expected to be
    faster (path 'auto', `choose_lstm_path`: 'persistent_wgmma', 'persistent_mma' or 'persistent') or where asked
    (path 'persistent', 'persistent_mma' or 'persistent_wgmma'; raises TvmseqError when it cannot run), else
    (None, 'per_step', why): the caller uses the per-step kernel. Both persistent kernels take the same arguments."""
    target = resolve(target)
    if not isinstance(spec.batch, int):
        if path in ("persistent", "persistent_mma", "persistent_wgmma"):
            raise TvmseqError(f"persistent LSTM: needs a static batch, got {spec.batch!r}")
        return None, "per_step", f"batch {spec.batch!r} is not static: the per-step kernel"
    if path == "auto":
        path, why = choose_lstm_path(spec.num_directions, spec.batch, spec.hidden, spec.dtype, target, config)
    elif path in PATHS:
        why = f"{path} requested"
    else:
        raise TvmseqError(f"persistent LSTM: path must be one of {PATHS}, got {path!r}")
    if path == "per_step":
        return None, path, why
    if path == "persistent_mma":
        return lstm_mma_func(spec, target, config), path, why
    if path == "persistent_wgmma":
        return lstm_wgmma_func(spec, target, config), path, why
    return lstm_spec_func(spec, target, config), path, why
