"""Weights packed once by the importer (`step_gemm.Panels`): the packing against the kernels' own, and the
projection and GRU / RNN / LSTM recurrences built to take the panels (packed_w / packed_r) against the kernels
that pack in a call and against numpy, at odd sizes."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # CPU kernels built here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

import host_cpu  # noqa: E402
from test_cpu_step_gemm import (LLVM, _projection_ref, _projection_spec, _recurrence_case,  # noqa: E402
                                _run_projection, _tensor)
from tvmseq.kernels.recurrent import lstm, rnn, step_gemm  # noqa: E402
from tvmseq.targets import resolve  # noqa: E402


@pytest.mark.parametrize("G,K,interleave", [(4 * 37, 19, 16), (4 * 48, 33, 16), (3 * 45, 17, None)])
def test_importer_packing_equals_the_kernels_packing(G, K, interleave):
    """`Panels.pack` (numpy, at import) gives the panels `cpu_pack_macro` gives in a call, bit for bit: units of
    every gate interleaved (the fused LSTM step; hidden 37 leaves a partial last panel) and plain 64-row panels."""
    R = np.random.default_rng(G + K).standard_normal((2, G, K)).astype(np.float32)
    panels = step_gemm.Panels(interleave)
    mod = tvm.compile(step_gemm.cpu_pack_func(2, G, K, interleave=interleave), target=LLVM)
    Rp = _tensor(np.full(panels.shape(2, G, K), np.nan, np.float32))
    mod["cpu_pack"](_tensor(R), Rp)
    np.testing.assert_array_equal(panels.pack(R), Rp.numpy())


@pytest.mark.parametrize("cell,kw,H,D,B,seq", [
    ("GRU", dict(linear_before_reset=0), 45, 2, 6, 7), ("GRU", dict(linear_before_reset=1), 45, 1, 1, 5),
    ("RNN", {}, 130, 1, 1, 5), ("LSTM", dict(has_peepholes=True, input_forget=1), 37, 2, 6, 7),
    ("LSTM", dict(has_peepholes=True, clip=2.5), 48, 1, 1, 5), ("LSTM", dict(has_peepholes=True), 48, 2, 6, 7),
], ids=["gru-lbr0-bi-b6", "gru-lbr1-b1", "rnn-b1", "lstm-37-bi-b6", "lstm-48-fused-b1", "lstm-48-fused-bi-b6"])
@host_cpu.needs_panels
def test_recurrence_on_importer_packed_r(monkeypatch, cell, kw, H, D, B, seq):
    """A recurrence built with packed_r takes R as `r_panels(spec)` packs it and steps on the panels in every call
    (batch 1 x 5 steps, where the kernel that packs for itself keeps R as stored): equal to that kernel with
    packing forced on, bit for bit (the same panel GEMM)."""
    rng = np.random.default_rng(H + B)
    spec, args, shapes, module = _recurrence_case(cell, kw, D, B, H, seq, rng)
    panels = module.r_panels(spec, LLVM)
    # the fused LSTM step (AVX-512: 16 units of each gate a panel) interleaves its gates; AVX2 keeps them apart
    fused = cell == "LSTM" and H % 16 == 0 and host_cpu.panel_rows() == 64
    assert panels is not None and panels.interleave == (16 if fused else None)
    func = module.recurrence_func(spec, LLVM, packed_r=True)
    assert "Rp = T.alloc_buffer" not in func.script()
    mod = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    res = [_tensor(np.full(s, np.nan, np.float32)) for s in shapes]
    mod["main"](*[_tensor(a) for a in [args[0], panels.pack(args[1]), *args[2:]]], *res)
    on_packed = [r.numpy() for r in res]
    # against the kernel that packs for itself (packing forced on); that one against R as stored, to rounding, is
    # test_cpu_step_gemm's
    monkeypatch.setattr(step_gemm, "CPU_PACK_MIN_ROW_STEPS", 1)
    packs = tvm.compile(tvm.IRModule({"main": module.recurrence_func(spec, LLVM)}), target=LLVM)
    res = [_tensor(np.full(s, np.nan, np.float32)) for s in shapes]
    packs["main"](*[_tensor(a) for a in args], *res)
    for a, b in zip(on_packed, res):
        np.testing.assert_array_equal(a, b.numpy())
    assert not np.isnan(on_packed[0]).any()


def test_packed_r_only_where_the_kernel_would_pack():
    """No panels (None) on a target without AVX2 or for R of fewer than two panels of rows; a kernel asked for
    packed R there is refused."""
    from tvmseq.errors import TvmseqError

    sse = resolve({"kind": "llvm", "mcpu": "x86-64-v2"})
    avx512 = resolve({"kind": "llvm", "mcpu": "znver4"})
    spec = lstm.LstmSpec(1, None, 64, 8)
    assert lstm.r_panels(spec, sse) is None and rnn.r_panels(rnn.RnnSpec(1, None, 64, 8), avx512) is None
    with pytest.raises(TvmseqError, match="packed R only where"):
        lstm.recurrence_func(spec, sse, packed_r=True)


@pytest.mark.parametrize("D,I,G", [(1, 37, 129), (2, 100, 130), (1, 64, 256)])
@host_cpu.needs_panels
def test_projection_on_importer_packed_w(D, I, G):
    """The projection built with packed_w runs the panel GEMM on W packed by `w_panels` at every row count (1, 3,
    19: 1-row tails, 4-row tiles, partial last panels, K tails), X shared by the directions, bias added."""
    from tvmseq.kernels.projection import gemm as ip

    spec = _projection_spec(D, I, G)
    rng = np.random.default_rng(D + I + G)
    W = rng.standard_normal((D, G, I)).astype(np.float32)
    Bias = rng.standard_normal((D, G)).astype(np.float32)
    func = ip.cpu_projection_func(spec, LLVM, packed_w=True)
    for rows in (1, 3, 19):
        X = rng.standard_normal((rows, I)).astype(np.float32)
        np.testing.assert_allclose(_run_projection(func, X, ip.w_panels(spec, LLVM).pack(W), Bias),
                                   _projection_ref(X, W, Bias), rtol=1e-4, atol=1e-4)


def test_packed_w_and_wide_tiles_are_refused():
    """A projection asked for packed W where it has no panel path (no AVX2), and a register tile that two stack
    buffers cannot hold, are errors naming the cause."""
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import gemm as ip

    with pytest.raises(ValueError, match="packed W needs the CPU projection's panel path"):
        ip.cpu_projection_func(_projection_spec(1, 64, 256), resolve({"kind": "llvm", "mcpu": "x86-64-v2"}),
                               packed_w=True)
    assert step_gemm._tile_halves(4, 4, 16, 1) == (2, 2) and step_gemm._tile_halves(4, 3, 16, 1) == (4, 0)
    with pytest.raises(TvmseqError, match="does not fit two stack buffers"):
        step_gemm._tile_halves(4, 8, 16, 1)


@pytest.mark.parametrize("D,B,H,seq,kw", [
    (1, 70, 48, 5, dict(has_seq_lens=True)),
    (2, 67, 32, 6, dict(has_peepholes=True, input_forget=1, has_seq_lens=True)),
], ids=["b70", "bi-b67"])
@host_cpu.needs_fused_lstm
def test_fused_lstm_on_many_cores_by_rows_and_by_panels(monkeypatch, D, B, H, seq, kw):
    """Built for 16 cores, a fused LSTM step whose batch gives every thread a tile (B x D >= 64) splits its rows over
    the threads (`step_gemm._fused_rows_loop`, no barrier a step): bit-identical to the split by panels, and both
    equal to the kernel on R as stored to rounding. At batch 70 (67) the panel split's m blocks of 8 rows end past
    the batch; the last ones once computed rows of the block before them again, updating their cell state twice.
    The prefetches of the next step's gate_i rows (a hint, wasted past a row's length) leave the sums as they are."""
    from tvmseq.kernels.recurrent import gru

    target = tvm.target.Target(dict(LLVM.export(), **{"num-cores": 16}))
    direction = "bidirectional" if D == 2 else "forward"
    spec = lstm.LstmSpec(D, B, H, 11, direction=direction, **kw)
    assert lstm.cpu_fuses_gates(False, gru.StepSchedule.for_batch(B), H, target)
    rng = np.random.default_rng(B)
    G = 4 * H
    lens = np.array([seq] + [(seq - 2 - b) % (seq + 1) for b in range(1, B)], np.int32) if spec.has_seq_lens \
        else np.full(B, seq, np.int32)
    args = [rng.standard_normal((D, seq, B, G)).astype(np.float32), rng.uniform(-0.3, 0.3, (D, G, H)).astype(np.float32),
            rng.uniform(-0.5, 0.5, (D, 3 * H)).astype(np.float32), lens,
            rng.standard_normal((D, B, H)).astype(np.float32), rng.standard_normal((D, B, H)).astype(np.float32)]
    shapes = [(seq, D, B, H), (D, B, H), (D, B, H)]

    def run(pack_from: int, row_split_bytes: int):
        monkeypatch.setattr(step_gemm, "CPU_PACK_MIN_ROW_STEPS", pack_from)
        monkeypatch.setattr(step_gemm, "CPU_ROW_SPLIT_MAX_R_BYTES", row_split_bytes)
        func = lstm.recurrence_func(spec, target)
        res = [_tensor(np.full(s, np.nan, np.float32)) for s in shapes]
        tvm.compile(tvm.IRModule({"main": func}), target=target)["main"](*[_tensor(a) for a in args], *res)
        return func.script(), [r.numpy() for r in res]

    (by_rows, rows), (by_panels, panels), (_, plain) = run(1, 1 << 30), run(1, 0), run(1 << 30, 0)
    assert by_rows != by_panels
    # the split by rows prefetches each thread's gate_i rows of the next step; the split by panels does not
    assert "T.prefetch(" in by_rows and "T.prefetch(" not in by_panels
    for a, b, c in zip(rows, panels, plain):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
