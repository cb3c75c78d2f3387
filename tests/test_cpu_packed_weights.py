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

from test_cpu_step_gemm import (LLVM, _projection_ref, _projection_spec, _recurrence_case,  # noqa: E402
                                _run_packed_and_not, _run_projection, _tensor)
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
def test_recurrence_on_importer_packed_r(monkeypatch, cell, kw, H, D, B, seq):
    """A recurrence built with packed_r takes R as `r_panels(spec)` packs it and steps on the panels in every call
    (batch 1 x 5 steps, where the kernel that packs for itself keeps R as stored): equal to that kernel with
    packing forced on (bit for bit: the same panel GEMM), and to rounding with packing off."""
    rng = np.random.default_rng(H + B)
    spec, args, shapes, module = _recurrence_case(cell, kw, D, B, H, seq, rng)
    panels = module.r_panels(spec, LLVM)
    assert panels is not None and panels.interleave == (16 if cell == "LSTM" and H % 16 == 0 else None)
    func = module.recurrence_func(spec, LLVM, packed_r=True)
    assert "Rp = T.alloc_buffer" not in func.script()
    mod = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    res = [_tensor(np.full(s, np.nan, np.float32)) for s in shapes]
    mod["main"](*[_tensor(a) for a in [args[0], panels.pack(args[1]), *args[2:]]], *res)
    on_packed = [r.numpy() for r in res]
    packed, plain = _run_packed_and_not(monkeypatch, lambda: module.recurrence_func(spec, LLVM), args, shapes)
    for a, b, c in zip(on_packed, packed, plain):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
    assert not np.isnan(on_packed[0]).any()


def test_packed_r_only_where_the_kernel_would_pack():
    """No panels (None) on a target without AVX-512 or for R of fewer than CPU_PACK_MIN_ROWS rows; a kernel asked
    for packed R there is refused."""
    from tvmseq.errors import TvmseqError

    avx2 = resolve({"kind": "llvm", "mcpu": "x86-64-v3"})
    spec = lstm.LstmSpec(1, None, 64, 8)
    assert lstm.r_panels(spec, avx2) is None and rnn.r_panels(rnn.RnnSpec(1, None, 64, 8), LLVM) is None
    with pytest.raises(TvmseqError, match="packed R only where"):
        lstm.recurrence_func(spec, avx2, packed_r=True)


@pytest.mark.parametrize("D,I,G", [(1, 37, 129), (2, 100, 130), (1, 64, 256)])
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
    """A projection asked for packed W where it has no panel path (no AVX-512), and a register tile that two stack
    buffers cannot hold, are errors naming the cause."""
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import gemm as ip

    with pytest.raises(ValueError, match="packed W needs the CPU projection's panel path"):
        ip.cpu_projection_func(_projection_spec(1, 64, 256), resolve({"kind": "llvm", "mcpu": "x86-64-v3"}),
                               packed_w=True)
    assert step_gemm._tile_halves(4, 4, 16, 1) == (2, 2) and step_gemm._tile_halves(4, 3, 16, 1) == (4, 0)
    with pytest.raises(TvmseqError, match="does not fit two stack buffers"):
        step_gemm._tile_halves(4, 8, 16, 1)
