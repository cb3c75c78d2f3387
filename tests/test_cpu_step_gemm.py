"""The CPU panel step GEMM (step_gemm.cpu_panel_gemm_macro): R packed once into panels of 64 rows x K
(`cpu_pack_macro`), outputs in SIMD lanes. The packing and the GEMM against numpy at odd sizes (K not a
multiple of the lanes, rows not a multiple of the panel, an offset row range, batch tails, a symbolic batch),
and the GRU / LSTM / RNN recurrences that pack before a long time loop against float64 references and
against their unpacked path."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # CPU kernels built here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

import host_cpu  # noqa: E402
from numpy_gru import numpy_gru  # noqa: E402
from tvmseq.kernels.recurrent import gru, lstm, rnn, step_gemm  # noqa: E402
from tvmseq.targets import resolve  # noqa: E402

LLVM = resolve("llvm")


def pack_ref(R, panel=step_gemm.CPU_PANEL):
    """Rp[d, p, k, c] = R[d, p * panel + c, k], rows past R's as zeros (float32)."""
    D, G, K = R.shape
    nP = -(-G // panel)
    Rp = np.zeros((D, nP, K, panel), np.float32)
    for p in range(nP):
        rows = R[:, p * panel:(p + 1) * panel].astype(np.float32)
        Rp[:, p, :, :rows.shape[1]] = rows.transpose(0, 2, 1)
    return Rp


def gemm_ref(h, R, row_offset, rows):
    """gh[d, m, row_offset + r] = sum_k h[d, m, k] R[d, row_offset + r, k] (float64)."""
    return np.einsum("dmk,dnk->dmn", h.astype(np.float64), R[:, row_offset:row_offset + rows].astype(np.float64))


def _tensor(a):
    return tvm.runtime.tensor(np.ascontiguousarray(a))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("G,K", [(70, 37), (129, 100), (64, 257), (520, 259)])
def test_pack_matches_numpy(dtype, G, K):
    """The last size packs its panels on the thread pool (2 x 520 x 259 >= CPU_PACK_PARALLEL_MIN floats)."""
    R = np.random.default_rng(G + K).standard_normal((2, G, K)).astype(dtype)
    func = step_gemm.cpu_pack_func(2, G, K, dtype)
    assert ("T.parallel" in func.script()) == (2 * G * K >= step_gemm.CPU_PACK_PARALLEL_MIN)
    mod = tvm.compile(func, target=LLVM)
    out = _tensor(np.full(pack_ref(R).shape, np.nan, np.float32))
    mod["cpu_pack"](_tensor(R), out)
    np.testing.assert_array_equal(out.numpy(), pack_ref(R))
    np.testing.assert_array_equal(step_gemm.pack_numpy(R), pack_ref(R))


@pytest.mark.parametrize("K", [37, 100, 257])
@pytest.mark.parametrize("N,row_offset,rows", [(70, 0, 70), (135, 90, 45), (192, 0, 128)],
                         ids=["rows70", "offset90-rows45", "rows128-of-192"])
@pytest.mark.parametrize("batch", [1, 3, 19, None])
def test_panel_gemm_matches_numpy(K, N, row_offset, rows, batch):
    """Every panel tail: K with a remainder of 2-vector steps, rows not a multiple of 64, an offset range that
    starts and ends inside panels (the GRU's lbr=0 h rows), batch tiles of 4 with 1-row tails; gh outside
    the row range stays untouched."""
    D = 2
    rng = np.random.default_rng(K + N + (batch or 0))
    R = rng.standard_normal((D, N, K)).astype(np.float32)
    mod = tvm.compile(step_gemm.cpu_panel_gemm_func(D, batch, N, K, row_offset=row_offset, rows=rows), target=LLVM)
    for M in ((batch,) if batch else (1, 3, 19, 70)):
        h = rng.standard_normal((D, M, K)).astype(np.float32)
        out = _tensor(np.full((1, D, M, N), np.nan, np.float32))
        mod["cpu_panel_gemm"](_tensor(h), _tensor(pack_ref(R)), out)
        got = out.numpy()[0]
        np.testing.assert_allclose(got[..., row_offset:row_offset + rows], gemm_ref(h, R, row_offset, rows),
                                   rtol=1e-5, atol=1e-4, err_msg=f"batch {M}")
        outside = np.ones(N, bool)
        outside[row_offset:row_offset + rows] = False
        assert np.isnan(got[..., outside]).all()


def test_panel_gemm_splits_over_threads():
    """The forced parallel loop over (m block, direction, panel) gives the serial sums."""
    D, N, K, M = 2, 200, 45, 70
    rng = np.random.default_rng(5)
    R, h = rng.standard_normal((D, N, K)).astype(np.float32), rng.standard_normal((D, M, K)).astype(np.float32)
    func = step_gemm.cpu_panel_gemm_func(D, M, N, K, parallel=True)
    assert "T.parallel" in func.script()
    out = _tensor(np.zeros((1, D, M, N), np.float32))
    tvm.compile(func, target=LLVM)["cpu_panel_gemm"](_tensor(h), _tensor(pack_ref(R)), out)
    np.testing.assert_allclose(out.numpy()[0], gemm_ref(h, R, 0, N), rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# the k-in-lanes GEMM at batch 1 split over threads (2026-11-27: accumulators on the stack, lower threshold)
# ---------------------------------------------------------------------------------------------------
def _asm(mod):
    mod = getattr(mod, "mod", mod)
    return mod.inspect_source("asm") if hasattr(mod, "inspect_source") else mod.get_source("asm")


@pytest.mark.parametrize("N,K", [(37, 43), (130, 257), (384, 128)])
def test_batch1_gemm_split_equals_serial_and_numpy(N, K):
    """Batch 1 (the GEMV of a batch-1 step), odd rows (a clamped last row tile) and K (a scalar tail), 2
    directions: the row blocks split over threads give the serial sums bit for bit (each row's sum is the same
    operations), both against numpy."""
    D = 2
    rng = np.random.default_rng(N + K)
    R, h = rng.standard_normal((D, N, K)).astype(np.float32), rng.standard_normal((D, 1, K)).astype(np.float32)
    outs = []
    for parallel in (False, True):
        func = step_gemm.cpu_gemm_func(D, 1, N, K, parallel=parallel)
        assert ("T.parallel" in func.script()) == parallel
        out = _tensor(np.full((1, D, 1, N), np.nan, np.float32))
        tvm.compile(func, target=LLVM)["cpu_step_gemm"](_tensor(h), _tensor(R), out)
        outs.append(out.numpy())
        np.testing.assert_allclose(out.numpy()[0], gemm_ref(h, R, 0, N), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("M", [1, 6, None])
@pytest.mark.parametrize("gemm", ["k_in_lanes", "panel", "projection"])
def test_split_gemm_tiles_allocate_nothing(M, gemm):
    """The GEMMs' accumulator tiles are stack arrays (CPU_TILE_SCOPE, each under step_gemm.CPU_STACK_BYTES): a split
    step calls no TVMBackendAllocWorkspace. As "local" buffers each 4-row block of the parallel loop allocated and
    freed 4 of them (a split batch-1 step took as long as a serial one); the panel GEMM's 4-row tile (1 KB, TVM's
    stack limit) came from the pool until it was held in two halves, and in a module with a shape function LLVM then
    kept its sums in memory (`step_gemm.CPU_STACK_BYTES`)."""
    from types import SimpleNamespace

    from tvmseq.kernels.projection import gemm as ip

    if gemm == "k_in_lanes":
        func = step_gemm.cpu_gemm_func(1, M, 384, 128, parallel=True)
    elif gemm == "panel":
        func = step_gemm.cpu_panel_gemm_func(1, M, 384, 128, parallel=True)
    else:   # rows symbolic whatever M is
        if not host_cpu.panel_rows():
            pytest.skip("the host CPU has no packed-panel projection")
        spec = SimpleNamespace(num_directions=1, input_size=128, gates=3, hidden=128, dtype="float32")
        func = ip.cpu_projection_func(spec, LLVM, packed_w=True).with_attr("global_symbol", "main")
    assert "T.parallel" in func.script()
    assert "TVMBackendAllocWorkspace" not in _asm(tvm.compile(func, target=LLVM))


def test_batch1_split_threshold_on_two_cores(monkeypatch):
    """On 2 cores a batch-1 step splits from CPU_PARALLEL_MIN_MACS (160K multiply-adds): GRU / LSTM hidden 256
    and up, RNN hidden 512 and up; RNN hidden 256 (66K) and hidden-128 cells stay on one thread."""
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    macs = step_gemm.cpu_parallel_min_macs(LLVM)
    assert macs == step_gemm.CPU_PARALLEL_MIN_MACS
    for gates, H, split in [(3, 256, True), (4, 256, True), (1, 512, True), (4, 1024, True), (1, 256, False),
                            (3, 128, False), (4, 128, False)]:
        assert step_gemm.cpu_parallel(1, 1, gates * H, H, macs) == split, (gates, H)
    text = lstm.recurrence_func(lstm.LstmSpec(1, 1, 256, 256, "float32", direction="forward"), LLVM).script()
    assert "T.parallel" in text
    text = rnn.recurrence_func(rnn.RnnSpec(1, 1, 256, 256), LLVM).script()
    assert "T.parallel" not in text


# ---------------------------------------------------------------------------------------------------
# the recurrences: R packed before a long enough time loop
# ---------------------------------------------------------------------------------------------------
def _gru_gate_i(X, W, Bias, H, lbr):
    bias_i = Bias[:, :3 * H] + np.concatenate([Bias[:, 3 * H:5 * H], (1 - lbr) * Bias[:, 5 * H:]], 1)
    return (np.einsum("tbi,dgi->dtbg", X.astype(np.float32), W.astype(np.float32)) + bias_i[:, None, None]
            ).astype(np.float32)


@pytest.mark.parametrize("lbr,direction,dtype,batch", [
    (1, "forward", "float32", 3), (0, "bidirectional", "float32", None), (0, "reverse", "float16", 2),
    (1, "bidirectional", "float16", None)])
@host_cpu.needs_panels
def test_gru_recurrence_packs_and_matches_numpy(monkeypatch, lbr, direction, dtype, batch):
    """hidden 45: 135 gate rows (3 panels, the last partial; lbr=0's h rows start inside a panel). The module
    packs only when time steps x batch >= CPU_PACK_MIN_ROW_STEPS (here 12): seq 5 at batch 2 steps on R as
    stored, seq 9 packs; both against the float64 GRU with ragged sequence lengths."""
    monkeypatch.setattr(step_gemm, "CPU_PACK_MIN_ROW_STEPS", 12)
    H, I, D = 45, 13, 2 if direction == "bidirectional" else 1
    spec = gru.GruSpec(D, batch, H, I, dtype, lbr, direction, has_seq_lens=True)
    func = gru.recurrence_func(spec, LLVM)
    text = func.script()
    P = host_cpu.panel_rows()   # 3 x 45 gate rows: 3 panels of 64 (AVX-512) or 5 of 32 (AVX2), packed at run time
    assert f"Rp = T.alloc_buffer(({D}, {-(-3 * H // P)}, {H}, {P}))" in text and ">= 12:" in text
    rec = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)["gru_recurrence"]
    rng = np.random.default_rng(lbr * 10 + D)
    R = rng.uniform(-0.3, 0.3, (D, 3 * H, H)).astype(dtype)
    W = rng.uniform(-0.5, 0.5, (D, 3 * H, I)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * H)).astype(np.float32)
    B = batch or 2
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    for seq in (5, 9):
        X = rng.standard_normal((seq, B, I)).astype(dtype)
        h0 = rng.standard_normal((D, B, H)).astype(np.float32)
        lens = np.array([seq] + [max(1, seq - 3 - b) for b in range(1, B)])
        Y = _tensor(np.full((seq, D, B, H), np.nan, dtype))
        Yh = _tensor(np.full((D, B, H), np.nan, dtype))
        rec(_tensor(_gru_gate_i(X, W, Bias, H, lbr)), _tensor(R), _tensor(Bias[:, 5 * H:]),
            _tensor(lens.astype(np.int32)), _tensor(h0), Y, Yh)
        rev = [direction == "reverse" or d == 1 for d in range(D)]
        rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, rev, lbr, None, [(sig, np.tanh)] * D)
        tol = dict(rtol=1e-4, atol=2e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(Y.numpy().astype(np.float64), rY, **tol, err_msg=f"seq {seq}")
        np.testing.assert_allclose(Yh.numpy().astype(np.float64), rYh, **tol, err_msg=f"seq {seq}")


def _run_packed_and_not(monkeypatch, build, args, out_shapes, target=LLVM):
    """Outputs of the recurrence `build()` with packing forced on and off (the threshold at 1 and never)."""
    outs = []
    for threshold in (1, 1 << 30):
        monkeypatch.setattr(step_gemm, "CPU_PACK_MIN_ROW_STEPS", threshold)
        mod = tvm.compile(tvm.IRModule({"main": build()}), target=target)
        res = [_tensor(np.full(s, np.nan, np.float32)) for s in out_shapes]
        mod["main"](*[_tensor(a) for a in args], *res)
        outs.append([r.numpy() for r in res])
    return outs


# (seq, cores): an even and an odd number of steps, this machine's threads and 16
_LSTM_PACKED_CASES = [
    (37, 3, "bidirectional", dict(has_peepholes=True), 6, None),
    # hidden 48: whole vectors of units, so the packed loop fuses the gate math into the panel GEMM
    # (`cpu_fused_time_loop_macro`): batch 7 (a 4-row tile and 3 single rows), ragged lengths, every option
    (48, 7, "bidirectional", dict(has_peepholes=True, has_seq_lens=True, clip=2.5), 6, None),
    (48, 7, "bidirectional", dict(has_peepholes=True, has_seq_lens=True, clip=2.5), 7, 16),
    (48, 5, "reverse", dict(input_forget=1, has_seq_lens=True), 7, 16),
    (32, 6, "forward", dict(activations=("HardSigmoid", "Relu", "Tanh")), 6, None),
]


@pytest.mark.parametrize("H,B,direction,kw,seq,cores", _LSTM_PACKED_CASES)
@host_cpu.needs_fused_lstm
def test_lstm_recurrence_packed_equals_unpacked(monkeypatch, H, B, direction, kw, seq, cores):
    """LSTM recurrences with R packed (panels; the gate math fused into them where hidden is a multiple of 16)
    against the k-in-lanes GEMM and gate loop (tested against the reference elsewhere), any batch: equal to
    rounding, an odd and an even number of steps (the fused loop alternates two state buffers). Built for 16
    cores, the fused step splits the batch into m blocks of a batch tile or two (`step_gemm._fused_m_blocks`)."""
    from tvmseq.kernels.activations import Activation

    target = LLVM if cores is None else tvm.target.Target(dict(LLVM.export(), **{"num-cores": cores}))
    D = 2 if direction == "bidirectional" else 1
    if "activations" in kw:
        kw = dict(kw, activations=tuple(Activation.make(a) for a in kw["activations"]) * D)
    spec = lstm.LstmSpec(D, None, H, 11, direction=direction, **kw)
    assert lstm.cpu_fuses_gates(False, gru.StepSchedule.for_batch(None), H, target) == (H % 16 == 0)
    rng = np.random.default_rng(H + B)
    lens = np.array([seq] + [(seq - 2 - b) % (seq + 1) for b in range(1, B)], np.int32)
    args = (rng.standard_normal((D, seq, B, 4 * H)).astype(np.float32),
            rng.uniform(-0.3, 0.3, (D, 4 * H, H)).astype(np.float32),
            rng.uniform(-0.5, 0.5, (D, 3 * H)).astype(np.float32), lens,
            rng.standard_normal((D, B, H)).astype(np.float32), rng.standard_normal((D, B, H)).astype(np.float32))
    packed, plain = _run_packed_and_not(monkeypatch, lambda: lstm.recurrence_func(spec, target), args,
                                        [(seq, D, B, H), (D, B, H), (D, B, H)], target)
    for a, b in zip(packed, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    if kw.get("has_seq_lens"):
        assert np.all(packed[0][seq - 1][:, lens < seq] == 0) and np.all(packed[1][:, lens == 0] == 0)


def test_rnn_recurrence_packed_matches_reference(monkeypatch):
    """RNN hidden 130 (3 panels, 2 rows in the last), batch 19 (four 4-row tiles and 3 single rows)."""
    from tvmseq import reference

    D, H, B, seq, I = 1, 130, 19, 4, 7
    spec = rnn.RnnSpec(D, B, H, I)
    rng = np.random.default_rng(13)
    X = rng.standard_normal((seq, B, I)).astype(np.float32)
    W = rng.uniform(-0.3, 0.3, (D, H, I)).astype(np.float32)
    R = rng.uniform(-0.15, 0.15, (D, H, H)).astype(np.float32)
    Bias = rng.uniform(-0.5, 0.5, (D, 2 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    gate_i = np.einsum("tbi,dhi->dtbh", X, W) + (Bias[:, :H] + Bias[:, H:])[:, None, None]
    args = (gate_i.astype(np.float32), R, np.full(B, seq, np.int32), h0)
    packed, plain = _run_packed_and_not(monkeypatch, lambda: rnn.recurrence_func(spec, LLVM), args,
                                        [(seq, D, B, H), (D, B, H)])
    rY, rYh = reference.rnn(X, W, R, Bias, None, h0)
    np.testing.assert_allclose(packed[0], np.asarray(rY).reshape(seq, D, B, H), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(packed[1], np.asarray(rYh).reshape(D, B, H), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(packed[0], plain[0], rtol=1e-5, atol=1e-5)


def test_small_gpu_or_sse_recurrences_do_not_pack():
    """Fewer than two panels of gate rows (64 x 2 with AVX-512, 32 x 2 with AVX2), the tiled schedule, CUDA or a CPU
    without AVX2: no panels."""
    sched, G = gru.StepSchedule(), step_gemm.CPU_PACK_MIN_PANELS * step_gemm.CPU_PANEL
    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"})
    assert gru.cpu_packs_r(False, sched, G, avx512)
    assert not gru.cpu_packs_r(False, sched, G - 1, avx512)
    assert gru.cpu_packs_r(False, sched, step_gemm.CPU_PACK_MIN_PANELS * step_gemm.CPU_PANEL_AVX2, avx2)
    assert not gru.cpu_packs_r(False, sched, step_gemm.CPU_PACK_MIN_PANELS * step_gemm.CPU_PANEL_AVX2 - 1, avx2)
    assert not gru.cpu_packs_r(True, sched, 4096, avx512)
    assert not gru.cpu_packs_r(False, gru.StepSchedule(tiled=True), 4096, avx512)
    assert not gru.cpu_packs_r(False, sched, 4096, tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v2"}))
    spec = gru.GruSpec(1, 2, 64, 8)
    assert "Rp = T.alloc_buffer((1, 3, 64, 64))" in gru.recurrence_func(spec, avx512).script()
    assert "Rp = T.alloc_buffer((1, 6, 64, 32))" in gru.recurrence_func(spec, resolve(
        {"kind": "llvm", "mcpu": "x86-64-v3"})).script()
    assert "Rp = T.alloc_buffer" not in gru.recurrence_func(spec, resolve({"kind": "llvm", "mcpu": "x86-64-v2"})).script()


# ---------------------------------------------------------------------------------------------------
# The CPU input projection on packed W (projection.gemm.cpu_projection_func's panel path)
# ---------------------------------------------------------------------------------------------------
def _projection_spec(D, I, G, dtype="float32", gates=1):
    from types import SimpleNamespace

    return SimpleNamespace(num_directions=D, input_size=I, gates=gates, hidden=G // gates, dtype=dtype)


def _run_projection(func, X, W, Bias):
    mod = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=LLVM)
    out = _tensor(np.full((W.shape[0], X.shape[0], Bias.shape[1]), np.nan, np.float32))
    mod["main"](_tensor(X), _tensor(W), _tensor(Bias), out)
    return out.numpy()


def _projection_ref(X, W, Bias):
    return np.einsum("mk,djk->dmj", X.astype(np.float64), W.astype(np.float64)) + Bias[:, None, :]


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("I,G", [(37, 70), (100, 129), (37, 129), (100, 70)])
def test_packed_projection_matches_numpy(D, I, G):
    """One build (rows symbolic) run at rows 1 (under min_rows: the k-in-lanes GEMM), 3 and 19 (W packed, the
    panel GEMM: batch tiles of 4 and 1-row tails, last panels of 1-5 vectors, K tails), X shared by the
    directions, bias added; both paths against numpy."""
    from tvmseq.kernels.projection import gemm as ip

    rng = np.random.default_rng(D * 1000 + I + G)
    W = rng.standard_normal((D, G, I)).astype(np.float32)
    Bias = rng.standard_normal((D, G)).astype(np.float32)
    func = ip.cpu_projection_func(_projection_spec(D, I, G), LLVM, panel=True, min_rows=2)
    for rows in (1, 3, 19):
        X = rng.standard_normal((rows, I)).astype(np.float32)
        np.testing.assert_allclose(_run_projection(func, X, W, Bias), _projection_ref(X, W, Bias), rtol=1e-4,
                                   atol=1e-4)


def test_packed_projection_default_threshold():
    """Built as the importer builds it (H128 GRU, this host's target): under cpu_panel_projection_min_rows the old
    GEMM, from it the packed one (AVX-512 or AVX2); both match numpy and each other's numbers."""
    from tvmseq.kernels.projection import gemm as ip

    spec = _projection_spec(2, 128, 384, gates=3)
    assert ip.cpu_panel_projection(spec, LLVM) == bool(host_cpu.panel_rows())
    rng = np.random.default_rng(7)
    W = rng.standard_normal((2, 384, 128)).astype(np.float32)
    Bias = rng.standard_normal((2, 384)).astype(np.float32)
    func = ip.cpu_projection_func(spec, LLVM)
    limit = ip.cpu_panel_projection_min_rows(128)
    for rows in (limit - 1, limit, 100):
        X = rng.standard_normal((rows, 128)).astype(np.float32)
        np.testing.assert_allclose(_run_projection(func, X, W, Bias), _projection_ref(X, W, Bias), rtol=1e-4,
                                   atol=1e-4)


def test_projection_keeps_old_gemm_off_panels_and_fp16():
    """float16 weights, W with fewer than two panels of rows, or a target without AVX2 (SSE only): no packed path;
    AVX2 packs W in panels of 32 rows, AVX-512 of 64."""
    from tvmseq.kernels.projection import gemm as ip

    avx2, sse = resolve({"kind": "llvm", "mcpu": "x86-64-v3"}), resolve({"kind": "llvm", "mcpu": "x86-64-v2"})
    avx512 = resolve({"kind": "llvm", "mcpu": "znver4"})
    assert not ip.cpu_panel_projection(_projection_spec(1, 128, 384, "float16", 3), avx512)
    assert not ip.cpu_panel_projection(_projection_spec(1, 128, 96, gates=3), avx512)
    assert ip.cpu_panel_projection(_projection_spec(1, 128, 96, gates=3), avx2)       # 3 panels of 32
    assert not ip.cpu_panel_projection(_projection_spec(1, 128, 384, gates=3), sse)
    assert "Wp" not in ip.cpu_projection_func(_projection_spec(1, 128, 384, gates=3), sse).script()
    assert "Wp = T.alloc_buffer((1, 12, 128, 32))" in ip.cpu_projection_func(
        _projection_spec(1, 128, 384, gates=3), avx2).script()
    assert ip.cpu_panel_projection_min_rows(37) == ip.CPU_PANEL_PROJECTION_MIN_ROWS
    assert ip.cpu_panel_projection_min_rows(1024) == 384


def test_panel_paths_reject_what_they_cannot_compute():
    """A panel that is not whole vectors of lanes, and the packed projection forced on float16 inputs, are
    refused with a message naming the cause (the default choice never asks for either)."""
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import gemm as proj

    with pytest.raises(TvmseqError, match="panel 40 is not a multiple of 4 vectors"):
        step_gemm.cpu_panel_gemm_macro(1, 8, 64, 128, 0, panel=40)
    spec = lstm.LstmSpec(1, 8, 64, 64, "float16", direction="forward")
    with pytest.raises(ValueError, match="packed CPU projection takes float32"):
        proj.cpu_projection_func(spec, resolve("llvm"), panel=True)


def _recurrence_case(cell, kw, D, B, H, seq, rng):
    """(spec, args, output shapes, module) of a per-step recurrence with ragged lengths (any batch)."""
    module = {"GRU": gru, "RNN": rnn, "LSTM": lstm}[cell]
    G = {"GRU": 3, "RNN": 1, "LSTM": 4}[cell] * H
    direction = "bidirectional" if D == 2 else "forward"
    spec = {"GRU": gru.GruSpec, "RNN": rnn.RnnSpec, "LSTM": lstm.LstmSpec}[cell](
        D, None, H, 9, direction=direction, has_seq_lens=True, **kw)
    lens = np.array([seq] + [(seq - 2 - b) % (seq + 1) for b in range(1, B)], np.int32)
    extra = {"GRU": [rng.uniform(-0.5, 0.5, (D, H)).astype(np.float32)], "RNN": [],
             "LSTM": [rng.uniform(-0.5, 0.5, (D, 3 * H)).astype(np.float32)]}[cell]
    args = [rng.standard_normal((D, seq, B, G)).astype(np.float32),
            rng.uniform(-0.3, 0.3, (D, G, H)).astype(np.float32), *extra, lens,
            rng.standard_normal((D, B, H)).astype(np.float32)]
    if cell == "LSTM":
        args.append(rng.standard_normal((D, B, H)).astype(np.float32))
    shapes = [(seq, D, B, H)] + [(D, B, H)] * (2 if cell == "LSTM" else 1)
    return spec, args, shapes, module


@pytest.mark.parametrize("cell,kw", [
    ("GRU", dict(linear_before_reset=0)), ("GRU", dict(linear_before_reset=1)), ("RNN", {}),
    ("LSTM", dict(has_peepholes=True, input_forget=1)),
], ids=["gru-lbr0", "gru-lbr1", "rnn", "lstm"])
def test_one_launch_time_loop_equals_a_launch_a_loop(monkeypatch, cell, kw):
    """Where the step GEMM splits over threads (here forced at any size), the per-step recurrences run their time
    loop as one launch of the thread pool with barriers between stages (`gru.cpu_one_launch_steps`): the same
    outputs, bit for bit, as a launch a loop. Bidirectional, ragged lengths, any batch at batch 6, hidden 42 (R
    not packed: seq 5 x batch 6 < CPU_PACK_MIN_ROW_STEPS; no whole vectors of units, so no fused LSTM step)."""
    monkeypatch.setattr(step_gemm, "CPU_PARALLEL_MIN_MACS", 1)
    spec, args, shapes, module = _recurrence_case(cell, kw, 2, 6, 42, 5, np.random.default_rng(17))
    outs = {}
    for one_launch in (True, False):
        if not one_launch:
            monkeypatch.setattr(gru, "cpu_one_launch_steps", lambda step_on_pool, steps, *a, **k: steps)
        func = module.recurrence_func(spec, LLVM)
        assert ("pragma_parallel_launch_point" in func.script()) == one_launch
        mod = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
        res = [_tensor(np.full(s, np.nan, np.float32)) for s in shapes]
        mod["main"](*[_tensor(a) for a in args], *res)
        outs[one_launch] = [r.numpy() for r in res]
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_array_equal(a, b)
    assert not np.isnan(outs[True][0]).any()
