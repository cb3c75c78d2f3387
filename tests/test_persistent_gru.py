"""Persistent GRU: the CPU variant of the kernel (same TIR body, serial loops) against a float64 numpy
GRU (tests/numpy_gru.py) on odd sizes, lbr 0/1, every direction, sequence_lens, clip,
per-direction activations, batch chunks and weight rows in shared memory; the on-chip decision and
the automatic fallback; CUDA code generation (ptxas: no spills); (marked gpu) the prebuilt kernels."""
import functools
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from numpy_gru import numpy_gru  # noqa: E402

from tvmseq.errors import TvmseqError  # noqa: E402

try:  # the kernel factories need TVM's compiler; the gpu tests only its runtime
    import tvm

    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.recurrent import engine, paths
    from tvmseq.kernels.recurrent_gemm import PersistentConfig
except ImportError:
    engine = None
needs_compiler = pytest.mark.skipif(engine is None, reason="TVM compiler not available")

TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=1e-2, atol=1e-2)}


def make_problem(D, B, H, seq, dtype, lbr, seed, lens_kind="random"):
    """Random GRU weights/inputs (never zeros), the kernel's inputs and the numpy reference pieces."""
    rng = np.random.default_rng(seed)
    I = 3  # noqa: E741 - the input projection is folded into gate_i here
    X = rng.standard_normal((seq, B, I)).astype(np.float32)
    W = rng.uniform(-0.6, 0.6, (D, 3 * H, I)).astype(np.float32)
    # |R| <= min(0.6, 1/sqrt(H)) (PyTorch's init scale): with larger weights a GRU of H >= 256 is chaotic and
    # even a float32 numpy GRU leaves float64 by O(1) within 20 steps, so no kernel could pass
    k = min(0.6, H ** -0.5)
    R = rng.uniform(-k, k, (D, 3 * H, H)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    if lens_kind == "full":
        lens = np.full(B, seq)
    else:
        lens = rng.integers(0, seq + 1, B)
        lens[0] = seq
        if B > 2:
            lens[1] = 0  # a zero-length row: Y_h = 0 (onnxruntime)
    bias_i = Bias[:, :3 * H] + np.concatenate([Bias[:, 3 * H:5 * H], (1 - lbr) * Bias[:, 5 * H:]], 1)
    gate_i = (np.einsum("tbi,dgi->dtbg", X, W) + bias_i[:, None, None, :]).astype(np.float32)
    inputs = (gate_i, R, np.ascontiguousarray(Bias[:, 5 * H:]), lens.astype(np.int32), h0)
    return inputs, (X, W, R.astype(np.float32), Bias, lens, h0)


def reference(ref_args, direction, lbr, clip, acts):
    D = 2 if direction == "bidirectional" else 1
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    np_acts = [(acts[2 * d].numpy, acts[2 * d + 1].numpy) for d in range(D)]
    return numpy_gru(*ref_args, rev, lbr, clip, np_acts)


@functools.lru_cache(maxsize=None)
def _compiled(D, B, H, dtype, lbr, direction, acts, clip, has_lens, config):
    func = engine.persistent_gru_func(D, B, H, dtype, lbr, direction, list(acts), clip, has_lens, "llvm", config)
    return tvm.compile(tvm.IRModule({"gru_recurrence": func}), target="llvm")["gru_recurrence"]


def run_cpu(inputs, D, B, H, seq, dtype, lbr, direction, acts, clip, has_lens, config=None):
    f = _compiled(D, B, H, dtype, lbr, direction, tuple(acts), clip, has_lens, config)
    Y = tvm.runtime.tensor(np.full((seq, D, B, H), np.nan, dtype))  # poisoned: every element written
    Yh = tvm.runtime.tensor(np.full((D, B, H), np.nan, dtype))
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], Y, Yh)
    return Y.numpy(), Yh.numpy()


def default_acts(D):
    return (Activation.make("Sigmoid"), Activation.make("Tanh")) * D


@needs_compiler
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("H,B", [(1, 1), (7, 3), (33, 5)])
def test_matches_numpy(H, B, lbr, direction, dtype):
    D = 2 if direction == "bidirectional" else 1
    seq = 5
    inputs, ref_args = make_problem(D, B, H, seq, dtype, lbr, seed=H * 31 + B)
    acts = default_acts(D)
    Y, Yh = run_cpu(inputs, D, B, H, seq, dtype, lbr, direction, acts, None, True)
    rY, rYh = reference(ref_args, direction, lbr, None, acts)
    np.testing.assert_allclose(Y.astype(np.float64), rY, **TOL[dtype])
    np.testing.assert_allclose(Yh.astype(np.float64), rYh, **TOL[dtype])


@needs_compiler
@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("clip", [None, 0.4])
@pytest.mark.parametrize("names", [("HardSigmoid", "Softsign", "Sigmoid", "Relu"),
                                   ("LeakyRelu", "ScaledTanh", "Elu", "Tanh")])
def test_clip_and_per_direction_activations(names, clip, lbr):
    D, B, H, seq = 2, 3, 6, 4
    acts = tuple(Activation.make(n) for n in names)
    inputs, ref_args = make_problem(D, B, H, seq, "float32", lbr, seed=5)
    Y, Yh = run_cpu(inputs, D, B, H, seq, "float32", lbr, "bidirectional", acts, clip, True)
    rY, rYh = reference(ref_args, "bidirectional", lbr, clip, acts)
    np.testing.assert_allclose(Y, rY, **TOL["float32"])
    np.testing.assert_allclose(Yh, rYh, **TOL["float32"])


@needs_compiler
@pytest.mark.parametrize("lbr", [1, 0])
@pytest.mark.parametrize("config", [
    dict(num_blocks=2, num_warps=3, batch_chunk=3, smem_rows=4),   # chunks, ragged last chunk, smem rows
    dict(num_blocks=5, num_warps=2, batch_chunk=7, smem_rows=0),   # one chunk, ragged unit split
    dict(num_blocks=1, num_warps=5, batch_chunk=1, smem_rows=27),  # everything in "shared memory"
])
def test_schedule_knobs(config, lbr):
    """Knobs change only the schedule: the same numbers for any (blocks, warps, chunk, smem rows)."""
    D, B, H, seq = 2, 7, 9, 4
    inputs, ref_args = make_problem(D, B, H, seq, "float32", lbr, seed=11)
    acts = default_acts(D)
    Y, Yh = run_cpu(inputs, D, B, H, seq, "float32", lbr, "bidirectional", acts, None, True,
                    PersistentConfig(**config))
    rY, rYh = reference(ref_args, "bidirectional", lbr, None, acts)
    np.testing.assert_allclose(Y, rY, **TOL["float32"])
    np.testing.assert_allclose(Yh, rYh, **TOL["float32"])


@needs_compiler
@pytest.mark.parametrize("lbr", [1, 0])
def test_without_seq_lens_and_out_of_range_lengths(lbr):
    """has_seq_lens=False ignores the lengths; lengths outside [0, T] are clamped inside the kernel."""
    D, B, H, seq = 2, 4, 5, 3
    inputs, ref_args = make_problem(D, B, H, seq, "float32", lbr, seed=3, lens_kind="full")
    acts = default_acts(D)
    rY, rYh = reference(ref_args, "bidirectional", lbr, None, acts)
    garbage = (inputs[0], inputs[1], inputs[2], np.array([-5, 99, 0, 1], np.int32), inputs[4])
    Y, Yh = run_cpu(garbage, D, B, H, seq, "float32", lbr, "bidirectional", acts, None, False)
    np.testing.assert_allclose(Y, rY, **TOL["float32"])
    np.testing.assert_allclose(Yh, rYh, **TOL["float32"])
    clamped = np.array([0, seq, 0, 1])
    rY2, rYh2 = reference(ref_args[:4] + (clamped, ref_args[5]), "bidirectional", lbr, None, acts)
    Y2, Yh2 = run_cpu(garbage, D, B, H, seq, "float32", lbr, "bidirectional", acts, None, True)
    np.testing.assert_allclose(Y2, rY2, **TOL["float32"])
    np.testing.assert_allclose(Yh2, rYh2, **TOL["float32"])


@needs_compiler
def test_fits_on_chip_and_fallback():
    from tvmseq.kernels.recurrent import gru
    from tvmseq.targets import resolve

    cuda = resolve("cuda")
    ok, why = engine.fits_on_chip(2, 64, 1024, "float32", cuda)
    assert ok, why
    ok, why = engine.fits_on_chip(1, 1, 4096, "float32", cuda)  # 200 MB of fp32 weights: never on chip
    assert not ok and why
    spec = gru.GruSpec(1, 1, 4096, 16, "float32", 1, "forward")
    func, path, reason = paths.recurrence_func_auto(spec, cuda)
    assert path == "per_step" and reason
    spec = gru.GruSpec(1, 8, 512, 16, "float32", 1, "forward")
    func, path, _ = paths.recurrence_func_auto(spec, cuda)
    assert path == "persistent"
    assert "tirx.use_cooperative_launch" in list(func.attrs["tirx.kernel_launch_params"])


@needs_compiler
def test_rejects_bad_arguments():
    with pytest.raises(TvmseqError, match="direction"):
        engine.persistent_gru_func(1, 1, 4, "float32", 1, "sideways", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="needs D=2"):
        engine.persistent_gru_func(1, 1, 4, "float32", 1, "bidirectional", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="dtype"):
        engine.persistent_gru_func(1, 1, 4, "int8", 1, "forward", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="Activation"):
        engine.persistent_gru_func(1, 1, 4, "float32", 1, "forward", [Activation.make("Tanh")], None, False, "llvm")
    with pytest.raises(TvmseqError, match="registers"):
        engine.persistent_gru_func(1, 1, 1024, "float32", 1, "forward", None, None, False, "cuda",
                                   PersistentConfig(num_blocks=8, num_warps=1, batch_chunk=1))


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,lbr", [(1, 1, 1024, "float32", 1), (2, 64, 512, "float16", 0)])
def test_cuda_codegen(D, B, H, dtype, lbr):
    """Builds for the H100 without a GPU: cooperative launch, LL primitives, one barrier per pass in
    the step loop, and (with nvcc) no register spills for sm_90a."""
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    func = engine.persistent_gru_func(D, B, H, dtype, lbr, "bidirectional" if D == 2 else "forward", None, None,
                                      True, tgt)
    src = tvm.compile(tvm.IRModule({"gru_recurrence": func}), target=tgt).mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "st.relaxed.gpu.global.b64", "ld.relaxed.gpu.global"):
        assert needle in src
    loop = src[src.index("tvm_builtin_cuda_grid_sync();") + len("tvm_builtin_cuda_grid_sync();"):].lstrip()
    loop = loop.removeprefix("__syncthreads();")   # weights in shared memory: one barrier before the loop
    assert loop.count("__syncthreads()") == 2  # lbr=1: two unrolled iterations; lbr=0: two passes
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


# ----------------------------------------------------------------------------------------------------
# GPU: the prebuilt payload (python3 -m tvmseq.bench.persistent_gru --build out/pgru), runtime only
# ----------------------------------------------------------------------------------------------------

PREBUILT = Path(os.environ.get("TVMSEQ_PGRU_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "pgru"))


def _gpu_cases():
    index = PREBUILT / "index.json"
    return json.loads(index.read_text())["tests"] if index.exists() else []


def batched_reference(gate_i, R, rb_h, lens, h0, reverse_dirs, lbr, clip, acts):
    """float64 GRU recurrence straight from the kernel's inputs, vectorised over the batch (the GPU cases
    are too large for the per-row loop of numpy_gru on the GPU machine's CPU). acts: (f, g) per direction."""
    D, T_, B, G3 = gate_i.shape
    H = G3 // 3
    c = (lambda x: x) if clip is None else (lambda x: np.clip(x, -clip, clip))
    L = np.clip(lens.astype(np.int64), 0, T_)
    Y, Yh = np.zeros((T_, D, B, H)), np.zeros((D, B, H))
    rows = np.arange(B)
    for d in range(D):
        f, g = acts[d]
        Rz, Rr, Rh = np.split(R[d].astype(np.float64), 3)
        h = h0[d].astype(np.float64)
        for s in range(T_):
            live = s < L
            t = np.where(live, (L - 1 - s) if reverse_dirs[d] else s, 0)
            gz, gr, gh = np.split(gate_i[d, t, rows].astype(np.float64), 3, axis=1)
            z, r = f(c(gz + h @ Rz.T)), f(c(gr + h @ Rr.T))
            hh = g(c(gh + r * (h @ Rh.T + rb_h[d]))) if lbr else g(c(gh + (r * h) @ Rh.T))
            h = np.where(live[:, None], (1 - z) * hh + z * h, h)
            Y[t[live], d, rows[live]] = h[live]
        Yh[d] = np.where((L > 0)[:, None], h, 0)
    return Y, Yh


@needs_compiler
@pytest.mark.parametrize("direction,lbr", [("bidirectional", 1), ("reverse", 0)])
def test_batched_reference_matches_numpy_gru(direction, lbr):
    """The GPU tests' vectorised reference is the same GRU as numpy_gru (lengths, reverse, clip)."""
    D = 2 if direction == "bidirectional" else 1
    inputs, ref_args = make_problem(D, 6, 5, 7, "float32", lbr, seed=2)
    acts = default_acts(D)
    rY, rYh = reference(ref_args, direction, lbr, 0.7, acts)
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    bY, bYh = batched_reference(*inputs, rev, lbr, 0.7, [(acts[2 * d].numpy, acts[2 * d + 1].numpy) for d in range(D)])
    np.testing.assert_allclose(bY, rY, rtol=1e-5, atol=1e-6)  # gate_i is float32
    np.testing.assert_allclose(bYh, rYh, rtol=1e-5, atol=1e-6)


def _mismatch(name, got, want, rtol, atol) -> str | None:
    """None when got matches want, else one line: how many elements are off, the worst, where, NaNs."""
    got = got.astype(np.float64)
    bad = ~(np.abs(got - want) <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    err = np.where(bad, np.abs(got - want), 0)
    err = np.where(np.isnan(got), np.inf, err)
    at = np.unravel_index(np.argmax(err), err.shape)
    return (f"{name}: {int(bad.sum())}/{bad.size} off (rtol {rtol}, atol {atol}), {int(np.isnan(got).sum())} NaN; "
            f"worst at {tuple(int(i) for i in at)}: got {got[at]:.6g} want {want[at]:.6g}")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _gpu_cases() or [None], ids=lambda e: e["func"] if e else "no-payload")
def test_prebuilt_kernels_on_gpu(entry):
    if entry is None:
        pytest.skip(f"no prebuilt payload in {PREBUILT} (python3 -m tvmseq.bench.persistent_gru --build out/pgru)")
    import threading

    import tvm as tvm_rt

    from tvmseq.kernels.activations import Activation as Act  # numpy side only

    D, B, H, dtype, lbr = entry["D"], entry["B"], entry["H"], entry["dtype"], entry["lbr"]
    names = entry["acts"] or ("Sigmoid", "Tanh")
    acts = [Act.make(n) for n in names]
    acts = acts * 2 if len(acts) == 2 and D == 2 else acts
    seq = 23
    inputs, _ = make_problem(D, B, H, seq, dtype, lbr, seed=H + B,
                             lens_kind="random" if entry["has_seq_lens"] else "full")
    rev = [entry["direction"] == "reverse" or d == 1 for d in range(D)]
    lens = inputs[3] if entry["has_seq_lens"] else np.full(B, seq)
    rY, rYh = batched_reference(inputs[0], inputs[1].astype(np.float32), inputs[2], lens, inputs[4], rev, lbr,
                                entry["clip"], [(acts[2 * d].numpy, acts[2 * d + 1].numpy) for d in range(D)])
    mod = tvm_rt.runtime.load_module(str(PREBUILT / entry["file"]))
    dev = tvm_rt.cuda(0)
    args = [tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs]
    tol = dict(rtol=1e-3, atol=1e-4) if dtype == "float32" else TOL[dtype]
    problems = []
    for launch in range(2):  # twice: the second launch must not see the first one's flags
        Y = tvm_rt.runtime.tensor(np.full((seq, D, B, H), np.nan, dtype), dev)
        Yh = tvm_rt.runtime.tensor(np.full((D, B, H), np.nan, dtype), dev)
        # the kernel's polls give up after ~seconds (LL timeout printf), so a hang here is something else
        timer = threading.Timer(60, lambda: (print(f"\nWATCHDOG: {entry['func']} hangs", flush=True), os._exit(3)))
        timer.start()
        mod[entry["func"]](*args, Y, Yh)
        dev.sync()
        timer.cancel()
        for name, got, want in (("Y", Y.numpy(), rY), ("Y_h", Yh.numpy(), rYh)):
            why = _mismatch(name, got, want, **tol)
            if why:
                problems.append(f"launch {launch}: {why}")
    assert not problems, f"{entry['func']} (config {entry['config'] or 'default'}):\n  " + "\n  ".join(problems)


# ---- the importer on the persistent path (its serial CPU variant, so CI checks the wiring) ----------
@needs_compiler
@pytest.mark.parametrize("op,direction,lens,lbr,acts", [
    ("GRU", "forward", False, 1, None), ("GRU", "bidirectional", True, 0, None),
    ("GRU", "reverse", True, 1, ["HardSigmoid", "Softsign"]),
    ("RNN", "forward", False, None, None), ("RNN", "bidirectional", True, None, ["Relu", "Tanh"]),
    ("RNN", "reverse", True, None, ["LeakyRelu"])])
def test_importer_persistent_path_matches_onnxruntime(op, direction, lens, lbr, acts):
    import tvmseq

    ort = pytest.importorskip("onnxruntime")
    from tvmseq import models

    model, feeds = models.rnn_node_model(op, seq=5, batch=3, input_size=4, hidden=7, direction=direction,
                                         with_seq_lens=lens, with_initial_h=True, linear_before_reset=lbr,
                                         activations=acts, weight_scale=0.5, seed=3)
    mod = tvmseq.from_onnx(model, target="llvm", recurrence="persistent")
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any("recurrence" in n for n in names)
    got = tvmseq.compile_onnx(model, target="llvm", recurrence="persistent")(**feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@needs_compiler
def test_path_choice_and_option_errors():
    import tvmseq
    from tvmseq import TvmseqError, models
    from tvmseq.kernels.recurrent import gru

    assert paths.choose_path(1, 8, 256, "float32", "llvm")[0] == "per_step"      # CPU: per-step kernels
    assert paths.choose_path(1, 8, 512, "float32", "cuda")[0] == "persistent"
    # batch 8, hidden 256: in fp16 the staged kernel (dsmem) was measured faster than the SIMT engine (database
    # entry); in fp32 the engine in one pass (1.5 us a step, H100, 2026-11-23) beats it (2.9)
    assert paths.choose_path(1, 8, 256, "float16", "cuda")[0] == "persistent_mma"
    assert paths.choose_path(1, 8, 256, "float32", "cuda")[0] == "persistent"
    # batch 1: the staged kernel with 1-row float32 chunks in one cluster beat the engine (0.888 / 1.030 us a step,
    # H200, 2026-11-29: database entry)
    assert paths.choose_path(1, 1, 256, "float32", "cuda")[0] == "persistent_mma"
    assert paths.choose_path(1, 1, 512, "float32", "cuda")[0] == "persistent"     # there the engine won
    assert paths.choose_path(1, 64, 1024, "float32", "cuda")[0] == "per_step"    # measured: tiled per-step wins
    assert paths.choose_path(1, 64, 256, "float32", "cuda")[0] == "persistent_mma"   # staged FMA kernel (measured)
    assert paths.choose_path(2, 8, 1024, "float16", "cuda")[0] == "persistent"
    spec = gru.GruSpec(1, 2, 4096, 4096, "float32", 1, "forward")
    assert paths.recurrence_func_auto(spec, "cuda")[1] == "per_step"                # 4096^2 x 3 does not fit
    model, _ = models.rnn_node_model("GRU")
    with pytest.raises(TvmseqError, match="gru0.*recurrence='fast'"):
        tvmseq.from_onnx(model, target="llvm", recurrence="fast")


@needs_compiler
def test_persistent_knob_errors():
    from tvmseq.kernels.activations import Activation

    with pytest.raises(TvmseqError, match="at least 2 LL slots"):
        engine.persistent_gru_func(1, 2, 8, "float32", 1, "forward", None, None, False, "llvm", slots=1)
    with pytest.raises(TvmseqError, match="cell must be one of"):
        engine.persistent_gru_func(1, 2, 8, "float32", 1, "forward", None, None, False, "llvm", cell="lstm")
    with pytest.raises(TvmseqError, match="needs 1 Activation"):
        engine.persistent_gru_func(1, 2, 8, "float32", 1, "forward", [Activation.make("Tanh")] * 2, None, False,
                                   "llvm", cell="rnn")


@needs_compiler
@pytest.mark.parametrize("kernel", ["engine", "staged", "stack", "rows_stack"])
def test_gates_on_fast_intrinsics_on_the_gpu(kernel):
    """The GRU kernels' CUDA computes sigmoid / tanh on __expf / __fdividef (cells.fast_math_for), and the
    accurate expf / tanhf with fast_math=False; their CPU variants (the numerics tests here) stay accurate."""
    from tvmseq.kernels.recurrent import mma as pm, rows, stack
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    build = {"engine": lambda fm: engine.persistent_gru_func(1, 5, 100, "float32", 1, "forward", None, None, False,
                                                             tgt, fast_math=fm),
             "staged": lambda fm: pm.persistent_mma_func(1, 9, 200, "float16", "forward", None, None, False, tgt,
                                                         fast_math=fm),
             "stack": lambda fm: stack.stacked_gru_func(2, 1, 100, "float32", tgt, fast_math=fm),
             "rows_stack": lambda fm: rows.stacked_gru_rows_func(2, 3, 64, "float32", tgt, fast_math=fm)}[kernel]
    for fast_math in (None, False):
        func = build(fast_math).with_attr("global_symbol", "k")
        src = tvm.compile(tvm.IRModule({"k": func}), target=tgt).mod.imports[0].inspect_source()
        accurate = "tanhf(" in src.replace("htanh, tanhf", "")
        assert ("__expf(" in src and "__fdividef(" in src) == (fast_math is None) and accurate == (fast_math is False)
