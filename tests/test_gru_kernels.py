"""GRU TensorIR kernels (input projection + recurrence) on llvm against a plain numpy GRU; the tiled step
GEMM (step_gemm.py) through its serialised CPU variant, and its CUDA code (ptxas: no spills)."""
import functools
import re
import shutil

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from numpy_gru import numpy_gru
from tvmseq import targets
from tvmseq.kernels.recurrent import gru, rnn, step_gemm
from tvmseq.kernels.activations import Activation


@functools.lru_cache(maxsize=None)
def _built(spec, sched=None):
    tgt = targets.resolve("llvm")
    proj = tvm.compile(gru.schedule_input_projection(gru.input_projection_func(spec), tgt), target=tgt)
    rec = tvm.compile(tvm.IRModule({"main": gru.recurrence_func(spec, tgt, sched)}), target=tgt)
    return proj["gru_input_projection"], rec["gru_recurrence"]


def _run(spec, X, W, R, Bias, lens, h0, sched=None):
    H, D = spec.hidden, spec.num_directions
    lbr = spec.linear_before_reset
    bias_i = Bias[:, :3 * H] + np.concatenate([Bias[:, 3 * H:5 * H], (1 - lbr) * Bias[:, 5 * H:]], 1)
    proj, rec = _built(spec, sched)
    tensor = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    gate_i = tensor(np.full((D, X.shape[0], spec.batch, 3 * H), np.nan, np.float32))
    proj(tensor(X), tensor(W), tensor(bias_i.astype(np.float32)), gate_i)
    Y = tensor(np.full((X.shape[0], D, spec.batch, H), np.nan, spec.dtype))  # poisoned: every element must be written
    Yh = tensor(np.full((D, spec.batch, H), np.nan, spec.dtype))
    rec(gate_i, tensor(R), tensor(Bias[:, 5 * H:].astype(np.float32)), tensor(lens.astype(np.int32)),
        tensor(h0.astype(np.float32)), Y, Yh)
    return Y.numpy(), Yh.numpy()


TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("hidden,batch,input_size", [(1, 1, 3), (7, 3, 5), (33, 2, 17)])
def test_recurrence_matches_numpy(dtype, direction, lbr, hidden, batch, input_size):
    rng = np.random.default_rng(hidden * 100 + batch)
    D = 2 if direction == "bidirectional" else 1
    seq = 6
    spec = gru.GruSpec(D, batch, hidden, input_size, dtype, lbr, direction, has_seq_lens=True)
    X = rng.standard_normal((seq, batch, input_size)).astype(dtype)
    W = rng.uniform(-0.6, 0.6, (D, 3 * hidden, input_size)).astype(dtype)
    R = rng.uniform(-0.6, 0.6, (D, 3 * hidden, hidden)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * hidden)).astype(np.float32)
    h0 = rng.standard_normal((D, batch, hidden)).astype(np.float32)
    lens = rng.integers(0, seq + 1, batch)
    lens[0] = seq
    Y, Yh = _run(spec, X, W, R, Bias, lens, h0)
    sig, tanh = (lambda x: 1 / (1 + np.exp(-x))), np.tanh
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, rev, lbr, None, [(sig, tanh)] * D)
    np.testing.assert_allclose(Y.astype(np.float64), rY, **TOL[dtype])
    np.testing.assert_allclose(Yh.astype(np.float64), rYh, **TOL[dtype])


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("acts", [("Sigmoid", "Tanh", "HardSigmoid", "Softsign"),
                                  ("LeakyRelu", "Relu", "ScaledTanh", "Elu")])
def test_recurrence_clip_and_per_direction_activations(clip, acts):
    rng = np.random.default_rng(7)
    hidden, batch, input_size, seq = 5, 2, 3, 4
    activations = tuple(Activation.make(a) for a in acts)
    spec = gru.GruSpec(2, batch, hidden, input_size, "float32", 0, "bidirectional", activations, clip)
    X = rng.standard_normal((seq, batch, input_size)).astype(np.float32)
    W = rng.uniform(-0.6, 0.6, (2, 3 * hidden, input_size)).astype(np.float32)
    R = rng.uniform(-0.6, 0.6, (2, 3 * hidden, hidden)).astype(np.float32)
    Bias = rng.uniform(-0.5, 0.5, (2, 6 * hidden)).astype(np.float32)
    h0 = rng.standard_normal((2, batch, hidden)).astype(np.float32)
    lens = np.full(batch, seq)
    Y, Yh = _run(spec, X, W, R, Bias, lens, h0)
    np_acts = [(activations[0].numpy, activations[1].numpy), (activations[2].numpy, activations[3].numpy)]
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, [False, True], 0, clip, np_acts)
    np.testing.assert_allclose(Y, rY, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Yh, rYh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu",
                                  "ScaledTanh", "HardSigmoid", "Elu", "Softsign", "Softplus"])
def test_activation_expr_matches_numpy(name):
    act = Activation.make(name, 0.7, 0.4) if name in ("Affine", "ScaledTanh", "HardSigmoid") else \
        Activation.make(name, 0.7 if name in ("LeakyRelu", "ThresholdedRelu", "Elu") else None)

    @T.prim_func
    def f(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            b[i] = act.expr(a[i])

    ex = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    x = np.linspace(-6, 6, 64).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(64, np.float32))
    ex["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), act.numpy(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_spec_rejects_bad_values():
    from tvmseq import TvmseqError

    with pytest.raises(TvmseqError, match="direction"):
        gru.GruSpec(1, 1, 4, 4, direction="sideways")
    with pytest.raises(TvmseqError, match="num_directions"):
        gru.GruSpec(1, 1, 4, 4, direction="bidirectional")
    with pytest.raises(TvmseqError, match="float32 and float16"):
        gru.GruSpec(1, 1, 4, 4, dtype="int8")
    with pytest.raises(TvmseqError, match="unsupported activation"):
        Activation.make("Gelu")


# ----------------------------------------------------------------------------------------------------
# The tiled step GEMM (batch >= step_gemm.TILED_MIN_BATCH on CUDA). On llvm it runs serialised phase by
# phase (tiled=True forces it there), so the tiling, bounds, split-K sums and pipelining are checked here.
# ----------------------------------------------------------------------------------------------------

TILED = gru.StepSchedule(tiled=True)


def _gru_problem(spec, seq, seed):
    """Random GRU inputs with R scaled by hidden**-0.5 (the gates stay out of saturation at H=333)."""
    rng = np.random.default_rng(seed)
    D, B, H, I, dtype = spec.num_directions, spec.batch, spec.hidden, spec.input_size, spec.dtype
    X = rng.standard_normal((seq, B, I)).astype(dtype)
    W = rng.uniform(-0.6, 0.6, (D, 3 * H, I)).astype(dtype)
    R = (rng.uniform(-2, 2, (D, 3 * H, H)) / np.sqrt(H)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    lens = rng.integers(0, seq + 1, B)
    lens[0] = seq
    return X, W, R, Bias, lens, h0


def _check_gru(spec, sched, seq=5, seed=0):
    X, W, R, Bias, lens, h0 = _gru_problem(spec, seq, seed)
    Y, Yh = _run(spec, X, W, R, Bias, lens, h0, sched)
    sig, tanh = (lambda x: 1 / (1 + np.exp(-x))), np.tanh
    rev = [spec.direction == "reverse" or d == 1 for d in range(spec.num_directions)]
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, rev, spec.linear_before_reset, None,
                        [(sig, tanh)] * spec.num_directions)
    np.testing.assert_allclose(Y.astype(np.float64), rY, **TOL[spec.dtype])
    np.testing.assert_allclose(Yh.astype(np.float64), rYh, **TOL[spec.dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])   # d=1 of bidirectional runs in reverse
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("hidden,batch", [(37, 17), (100, 33), (333, 65)])
def test_tiled_recurrence_matches_numpy(dtype, direction, lbr, hidden, batch):
    """The tiles choose_tile picks for these shapes (split-K among them), odd sizes, K % 4 != 0 too."""
    D = 2 if direction == "bidirectional" else 1
    spec = gru.GruSpec(D, batch, hidden, 13, dtype, lbr, direction, has_seq_lens=True)
    _check_gru(spec, TILED, seed=hidden + batch)


@pytest.mark.parametrize("tile,lbr,direction", [
    (step_gemm.GemmTile(64, 128, 8, 8, 8, 3), 0, "reverse"),   # 8x8 per thread (two float4 chunks), 3 uneven K splits
    (step_gemm.GemmTile(16, 64, 16, 2, 4, 5), 1, "bidirectional"),  # 2-row thread tiles, more splits than slices
    (step_gemm.GemmTile(32, 32, 8, 4, 4, 1, vec=1), 0, "bidirectional"),  # scalar global loads
    (step_gemm.GemmTile(128, 96, 16, 8, 4, 2), 1, "reverse"),  # a tile larger than the batch
], ids=lambda v: f"{v.bm}x{v.bn}x{v.bk}_{v.tm}x{v.tn}_s{v.split_k}_v{v.vec}" if hasattr(v, "bm") else str(v))
def test_tiled_recurrence_tiles(tile, lbr, direction):
    D = 2 if direction == "bidirectional" else 1
    spec = gru.GruSpec(D, 33, 100, 7, "float32", lbr, direction, has_seq_lens=True)
    _check_gru(spec, gru.StepSchedule(tiled=True, tile=tile), seq=4, seed=lbr)


def test_tiled_step_gemm_func_matches_numpy():
    """The standalone GEMM: the partial sums of every split add up to h R^T; every slice is written."""
    tgt = targets.resolve("llvm")
    rng = np.random.default_rng(3)
    for D, M, N, K, dtype, tile in [(2, 17, 111, 37, "float32", step_gemm.GemmTile(32, 32, 8, 4, 4, 2)),
                                    (1, 65, 200, 100, "float16", None)]:
        func = step_gemm.gemm_func(D, M, N, K, dtype, tile, tgt)
        S = step_gemm.normalized(tile or step_gemm.choose_tile(M, N, K, D, dtype), K).split_k
        h = rng.standard_normal((D, M, K)).astype(np.float32)
        R = rng.standard_normal((D, N, K)).astype(dtype)
        gh = tvm.runtime.tensor(np.full((S, D, M, N), np.nan, np.float32))
        tvm.compile(tvm.IRModule({"main": func}), target=tgt)["step_gemm"](
            tvm.runtime.tensor(h), tvm.runtime.tensor(R), gh)
        want = np.einsum("dmk,dnk->dmn", h.astype(np.float64), R.astype(np.float64))
        np.testing.assert_allclose(gh.numpy().sum(0), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_tiled_rnn_matches_reference(direction):
    from tvmseq import reference

    rng = np.random.default_rng(5)
    D, B, H, I, seq = (2 if direction == "bidirectional" else 1), 19, 45, 6, 5
    spec = rnn.RnnSpec(D, B, H, I, "float32", direction, has_seq_lens=True)
    X = rng.standard_normal((seq, B, I)).astype(np.float32)
    W = rng.uniform(-0.5, 0.5, (D, H, I)).astype(np.float32)
    R = (rng.uniform(-1, 1, (D, H, H)) / np.sqrt(H)).astype(np.float32)
    Bias = rng.uniform(-0.5, 0.5, (D, 2 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    lens = rng.integers(0, seq + 1, B).astype(np.int32)
    tgt = targets.resolve("llvm")
    proj = tvm.compile(gru.schedule_input_projection(gru.input_projection_func(spec), tgt), target=tgt)
    rec = tvm.compile(tvm.IRModule({"main": rnn.recurrence_func(spec, tgt, TILED)}), target=tgt)
    tensor = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    gate_i = tensor(np.full((D, seq, B, H), np.nan, np.float32))
    proj["gru_input_projection"](tensor(X), tensor(W), tensor(Bias[:, :H] + Bias[:, H:]), gate_i)
    Y, Yh = tensor(np.full((seq, D, B, H), np.nan, np.float32)), tensor(np.full((D, B, H), np.nan, np.float32))
    rec["rnn_recurrence"](gate_i, tensor(R), tensor(lens), tensor(h0), Y, Yh)
    rY, rYh = reference.rnn(X, W, R, Bias, lens, h0, direction=direction)
    np.testing.assert_allclose(Y.numpy(), rY, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Yh.numpy(), rYh, rtol=1e-4, atol=1e-5)


def test_tile_choice():
    """Below TILED_MIN_BATCH the warp kernel, from there on (CUDA) a feasible tile; infeasible tiles say why."""
    cuda = targets.resolve("cuda")
    assert not gru.StepSchedule().use_tiled(True, step_gemm.TILED_MIN_BATCH - 1)
    assert gru.StepSchedule().use_tiled(True, step_gemm.TILED_MIN_BATCH)
    assert not gru.StepSchedule().use_tiled(False, 256)  # the CPU keeps its loop nest unless forced
    for D in (1, 2):
        for H in (37, 256, 1024):
            for B in (16, 65, 256):
                tile = step_gemm.choose_tile(B, 3 * H, H, D, "float32", cuda)
                assert tile.check() is None
                assert np.isfinite(step_gemm.estimate_cycles(tile, B, 3 * H, H, D))
                per, splits = step_gemm.normalized(tile, H).k_tiles(H)
                assert (splits - 1) * per < -(-H // tile.bk) <= splits * per
    assert "does not divide" in step_gemm.GemmTile(64, 64, 16, 3, 4).check()
    assert "threads" in step_gemm.GemmTile(128, 128, 16, 2, 2).check()
    with pytest.raises(Exception, match="tile"):
        step_gemm.tiled_gemm_macro(False, 1, 16, 16, "float32", step_gemm.GemmTile(64, 64, 16, 3, 4), 16, 0)


def _cuda_source(funcs):
    tgt = targets.resolve("cuda")
    return tvm.compile(tvm.IRModule(funcs), target=tgt).mod.imports[0].inspect_source()


def test_tiled_cuda_codegen():
    """Built for the H100 without a GPU: the large-batch recurrence uses the tiled GEMM (shared memory,
    float4 fragments, one barrier per K slice) and the small-batch one the warp kernel; ptxas (when nvcc
    is installed) reports no spills for the recurrences and for every tile choose_tile can pick."""
    tgt = targets.resolve("cuda")
    recs = {}
    for name, (D, B, H, dtype, lbr) in {"big": (1, 256, 1024, "float32", 1), "bi16": (2, 64, 512, "float16", 0),
                                        "odd": (1, 17, 37, "float32", 0), "small": (2, 8, 256, "float32", 1)}.items():
        spec = gru.GruSpec(D, B, H, H, dtype, lbr, "bidirectional" if D == 2 else "forward", has_seq_lens=True)
        recs[f"rec_{name}"] = gru.recurrence_func(spec, tgt).with_attr("global_symbol", f"rec_{name}")
    src = _cuda_source(recs)
    kernels = {}
    for chunk in src.split('extern "C" __global__')[1:]:
        head, brace, _ = chunk.partition("{")
        if brace and ";" not in head:   # a definition, not a prototype
            kernels[re.search(r"(\w+)\(", head.split(")", 1)[1]).group(1)] = chunk
    big = [k for n, k in kernels.items() if n.startswith("rec_big") and "__shared__" in k]
    assert len(big) == 1, "one tiled GEMM kernel per step (lbr=1)"
    assert "*(float4*)(fa_ptr" in big[0] and "*(float4*)(fb_ptr" in big[0]   # vector fragment loads
    assert big[0].count("__syncthreads()") == 3    # prologue + one per K slice (loop unrolled by two)
    assert len([n for n, k in kernels.items() if n.startswith("rec_bi16") and "__shared__" in k]) == 2  # lbr=0
    assert len([n for n, k in kernels.items() if n.startswith("rec_odd") and "__shared__" in k]) == 2
    assert not any("__shared__" in k for n, k in kernels.items() if n.startswith("rec_small"))
    assert any("__shfl_down_sync" in k for n, k in kernels.items() if n.startswith("rec_small"))
    # the tiles choose_tile picks for the benchmark's large-batch grid (fp32; fp16 loads are in rec_bi16),
    # one nvcc run (`python3 -m tvmseq.bench.gru --build DIR --ptxas` checks every kernel it builds)
    tiles = {step_gemm.choose_tile(B, 3 * H, H, D, "float32", tgt)
             for B in (64, 256) for H in (256, 512, 1024) for D in (1, 2)}
    gemms = {}
    for tile in {(t.bm, t.bn, t.bk, t.tm, t.tn) for t in tiles}:
        name = "gemm_{}x{}x{}_{}x{}".format(*tile)
        gemms[name] = step_gemm.gemm_func(1, 256, 3072, 1024, "float32", step_gemm.GemmTile(*tile, 2), tgt, name=name)
    gemm_src = _cuda_source(gemms)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    report = {**ptxas_report(src), **ptxas_report(gemm_src)}
    assert len(report) >= len(gemms) + 4
    for kernel, info in report.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, (kernel, info)


@pytest.mark.parametrize("cell,gates", [("gru", 3), ("rnn", 1), ("lstm", 4)])
@pytest.mark.parametrize("batch", [2, None])
def test_per_step_recurrence_refuses_more_than_32_bit_indices(monkeypatch, cell, gates, batch):
    """The per-step path indexes gate_i [D, seq, B, G] in 32 bits too: past the limit (lowered here to 150 steps of
    2 batch rows) the call is refused on the host with one line, counted in steps for a static batch and in step x
    batch rows (64-bit products) for a batch bound at run time."""
    from tvmseq.kernels.recurrent import lstm
    from tvmseq.onnx import checks

    H, D = 8, 1
    monkeypatch.setattr(checks, "INDEX_LIMIT", gates * H * 2 * 150 + 1)
    if cell == "lstm":
        spec = lstm.LstmSpec(D, batch, H, H, "float32", "forward")
        func, name = lstm.recurrence_func(spec, targets.resolve("llvm")), "lstm_recurrence"
    elif cell == "gru":
        func, name = gru.recurrence_func(gru.GruSpec(D, batch, H, H), targets.resolve("llvm")), "gru_recurrence"
    else:
        func, name = rnn.recurrence_func(rnn.RnnSpec(D, batch, H, H), targets.resolve("llvm")), "rnn_recurrence"
    run = tvm.compile(tvm.IRModule({"main": func}), target=targets.resolve("llvm"))[name]

    def call(seq, B):
        f32 = lambda *s: tvm.runtime.tensor(np.random.rand(*s).astype("float32"))  # noqa: E731
        lens = tvm.runtime.tensor(np.full(B, seq, "int32"))
        head = [f32(D, seq, B, gates * H), f32(D, gates * H, H)]
        if cell == "lstm":
            run(*head, f32(D, 3 * H), lens, f32(D, B, H), f32(D, B, H), f32(seq, D, B, H), f32(D, B, H), f32(D, B, H))
        elif cell == "gru":
            run(*head, f32(D, H), lens, f32(D, B, H), f32(seq, D, B, H), f32(D, B, H))
        else:
            run(*head, lens, f32(D, B, H), f32(seq, D, B, H), f32(D, B, H))

    call(150, 2)
    unit = "150 steps" if batch else "300 step x batch rows"
    with pytest.raises(Exception, match=f"{cell.upper()} recurrence .* at most {unit}; run the sequence in shorter"):
        call(151, 2)
    if batch is None:   # the same rows at another batch pass; one more row does not
        call(75, 4)
        with pytest.raises(Exception, match="at most 300 step x batch rows"):
            call(76, 4)
