"""Persistent LSTM (the LSTM cell of the SIMT engine, kernels/recurrent/engine.py): the CPU variant of the kernel
(same per-thread code, serial loops) against the float64 ONNX LSTM of tvmseq.reference.lstm on odd sizes with
every feature (directions, peepholes, input_forget, clip, activations, sequence_lens, fp16, schedule knobs); the
path choice; CUDA code generation (nvcc/ptxas: no spills); (marked gpu) the kernels prebuilt for the H100.

GPU run, modules built here with the compiler and loaded there with TVM's runtime only:
  python -m tests.test_persistent_lstm build out/plstm          # here (or the benchmark's --build, which adds them)
  TVMSEQ_PLSTM_DIR=out/plstm pytest -m gpu tests/test_persistent_lstm.py   # GPU machine
"""
import functools
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tvmseq.errors import TvmseqError
from tvmseq.reference.lstm import lstm as reference_lstm

try:  # the kernel factories need TVM's compiler; the gpu test only its runtime
    import tvm

    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.recurrent import engine, paths
    from tvmseq.kernels.recurrent_gemm import PersistentConfig
except ImportError:
    engine = None
needs_compiler = pytest.mark.skipif(engine is None, reason="TVM compiler not available")

TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=1e-2, atol=1e-2)}
INPUT_SIZE = 5


def make_problem(D, B, H, seq, dtype, seed, lens_kind="random"):
    """Random ONNX LSTM inputs (never zeros) and the kernel's inputs (gate_i = X W^T + Wb + Rb in float32)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((seq, B, INPUT_SIZE)).astype(np.float32)
    W = rng.uniform(-0.6, 0.6, (D, 4 * H, INPUT_SIZE)).astype(np.float32)
    k = min(0.6, H ** -0.5)   # PyTorch's init scale: larger weights make a long LSTM chaotic in float32
    R = rng.uniform(-k, k, (D, 4 * H, H)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 8 * H)).astype(np.float32)
    P = rng.uniform(-0.5, 0.5, (D, 3 * H)).astype(np.float32)
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    c0 = rng.standard_normal((D, B, H)).astype(np.float32)
    if lens_kind == "full":
        lens = np.full(B, seq, np.int32)
    else:
        lens = rng.integers(0, seq + 1, B).astype(np.int32)
        lens[0] = seq
        if B > 2:
            lens[1] = 0  # a zero-length row: Y_h = Y_c = 0 (onnxruntime)
    gate_i = (np.einsum("tbi,dgi->dtbg", X, W) + (Bias[:, :4 * H] + Bias[:, 4 * H:])[:, None, None, :])
    onnx = dict(X=X, W=W, R=R.astype(np.float32), B=Bias, initial_h=h0, initial_c=c0, P=P)
    return (gate_i.astype(np.float32), R, P, lens, h0, c0), onnx


def reference(onnx, direction, lens, acts, clip, input_forget, peepholes, has_seq_lens=True):
    """(Y, Y_h, Y_c) float64 of the ONNX LSTM; the kernel gets zero peepholes when the node has none."""
    args = dict(onnx, P=onnx["P"] if peepholes else None, sequence_lens=lens if has_seq_lens else None)
    return reference_lstm(**args, direction=direction, activations=list(acts) if acts else None, clip=clip,
                          input_forget=input_forget)


@functools.lru_cache(maxsize=None)
def _compiled(D, B, H, dtype, direction, acts, clip, lens, input_forget, peepholes, config):
    func = engine.persistent_lstm_func(D, B, H, dtype, direction, list(acts) if acts else None, clip, lens,
                                       input_forget, peepholes, "llvm", config)
    return tvm.compile(tvm.IRModule({"lstm_recurrence": func}), target="llvm")["lstm_recurrence"]


def run_cpu(inputs, D, B, H, seq, dtype, direction, acts=None, clip=None, lens=True, input_forget=0,
            peepholes=True, config=None):
    f = _compiled(D, B, H, dtype, direction, tuple(acts) if acts else None, clip, lens, input_forget, peepholes,
                  config)
    outs = [tvm.runtime.tensor(np.full(shape, np.nan, dtype))   # poisoned: every element must be written
            for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
    kernel_in = list(inputs)
    if not peepholes:
        kernel_in[2] = np.zeros_like(inputs[2])
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in kernel_in], *outs)
    return [o.numpy() for o in outs]


def check(got, want, dtype):
    for name, g, w in zip(("Y", "Y_h", "Y_c"), got, want):
        np.testing.assert_allclose(g.astype(np.float64), w, **TOL[dtype], err_msg=name)


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,direction,clip,input_forget,peepholes", [
    (2, 3, 37, "float32", "bidirectional", 0.9, 0, True),
    (1, 3, 100, "float32", "forward", None, 1, True),
    (1, 3, 37, "float16", "reverse", 1.5, 0, False),
    (2, 3, 100, "float16", "bidirectional", None, 1, False),
])
def test_matches_reference(D, B, H, dtype, direction, clip, input_forget, peepholes):
    seq = 5
    inputs, onnx = make_problem(D, B, H, seq, dtype, seed=H * 7 + D)
    got = run_cpu(inputs, D, B, H, seq, dtype, direction, None, clip, True, input_forget, peepholes)
    check(got, reference(onnx, direction, inputs[3], None, clip, input_forget, peepholes), dtype)


@needs_compiler
def test_per_direction_activations_with_alpha_beta():
    D, B, H, seq = 2, 3, 6, 4
    acts = (Activation.make("HardSigmoid", 0.3, 0.4), Activation.make("ScaledTanh", 0.8, 1.2), Activation.make("Elu"),
            Activation.make("Sigmoid"), Activation.make("Softsign"), Activation.make("LeakyRelu", 0.2))
    inputs, onnx = make_problem(D, B, H, seq, "float32", seed=5)
    got = run_cpu(inputs, D, B, H, seq, "float32", "bidirectional", acts, 0.7, True, 1, True)
    check(got, reference(onnx, "bidirectional", inputs[3], acts, 0.7, 1, True), "float32")


@needs_compiler
@pytest.mark.parametrize("config", [
    dict(num_blocks=2, num_warps=3, batch_chunk=3, smem_rows=8),   # chunks, ragged last chunk, smem rows
    dict(num_blocks=4, num_warps=2, batch_chunk=7, smem_rows=0),   # one chunk, ragged unit split
    dict(num_blocks=1, num_warps=5, batch_chunk=1, smem_rows=36),  # every row in "shared memory"
])
def test_schedule_knobs(config):
    """Knobs change only the schedule: the same numbers for any (blocks, warps, chunk, smem rows)."""
    D, B, H, seq = 2, 7, 9, 4
    inputs, onnx = make_problem(D, B, H, seq, "float32", seed=11)
    got = run_cpu(inputs, D, B, H, seq, "float32", "bidirectional", config=PersistentConfig(**config))
    check(got, reference(onnx, "bidirectional", inputs[3], None, None, 0, True), "float32")


@needs_compiler
def test_without_seq_lens_and_out_of_range_lengths():
    """has_seq_lens=False ignores the lengths; lengths outside [0, T] are clamped inside the kernel."""
    D, B, H, seq = 2, 4, 5, 3
    inputs, onnx = make_problem(D, B, H, seq, "float32", seed=3, lens_kind="full")
    garbage = list(inputs)
    garbage[3] = np.array([-5, 99, 0, 1], np.int32)
    got = run_cpu(garbage, D, B, H, seq, "float32", "bidirectional", lens=False)
    check(got, reference(onnx, "bidirectional", None, None, None, 0, True, has_seq_lens=False), "float32")
    got = run_cpu(garbage, D, B, H, seq, "float32", "bidirectional", lens=True)
    check(got, reference(onnx, "bidirectional", np.array([0, seq, 0, 1]), None, None, 0, True), "float32")


@needs_compiler
def test_benchmark_run_one_on_cpu():
    """The benchmark's run (ONNX -> torch gate order, projection plumbing, layouts, errors) on llvm modules
    against torch's CPU LSTM: what the GPU run does, on a tiny config."""
    pytest.importorskip("torch")
    from tvmseq.bench import persistent_lstm as bench
    from tvmseq.kernels.projection import gemm as ip
    from tvmseq.targets import resolve

    c = {"dtype": "float32", "bidirectional": True, "hidden": 6, "batch": 3}
    spec, llvm = bench._spec(c), resolve("llvm")
    proj, tile = ip.projection_for(spec, llvm, 7)
    funcs = {"proj": proj.with_attr("global_symbol", "proj"),
             "rec": engine.lstm_spec_func(spec, llvm).with_attr("global_symbol", "rec")}
    mod = tvm.compile(tvm.IRModule(funcs), target=llvm)
    row = bench.run_one(dict(c, proj_rows=tile), mod["proj"], mod["rec"], seq=7, device="cpu")
    assert row["agree"] and max(row["err_tvmseq"], row["err_tvmseq_h"], row["err_tvmseq_c"]) < 1e-5, row
    assert row["err_peer"] < 1e-5 and row["speedup"] > 0, row


# ---- the path choice --------------------------------------------------------------------------------


def _spec(D, B, H, dtype="float32", **kw):
    from tvmseq.kernels.recurrent import lstm

    return lstm.LstmSpec(D, B, H, 16, dtype, "bidirectional" if D == 2 else "forward", **kw)


@needs_compiler
def test_fits_on_chip_and_path_choice():
    from tvmseq.targets import resolve

    cuda = resolve("cuda")
    ok, why = engine.lstm_fits_on_chip(2, 8, 1024, "float32", cuda)   # 2 x 4096 x 1024 fp32 = 32 MB over 128 blocks
    assert ok, why
    ok, why = engine.lstm_fits_on_chip(1, 1, 4096, "float32", cuda)   # 256 MB: never on chip
    assert not ok and why
    func, path, why = paths.lstm_recurrence_auto(_spec(1, 8, 384), cuda)   # no measured entry: the cost model
    assert path == "persistent" and func is not None and "us a step" in why
    assert "tirx.use_cooperative_launch" in list(func.attrs["tirx.kernel_launch_params"])
    for spec in (_spec(1, 1, 4096), _spec(2, 256, 1024, "float32"), _spec(1, "N", 128)):
        func, path, why = paths.lstm_recurrence_auto(spec, cuda)
        assert func is None and path == "per_step" and why, spec
    assert paths.lstm_recurrence_auto(_spec(1, 8, 64), "llvm")[:2] == (None, "per_step")     # CPU: per-step
    func, path, _ = paths.lstm_recurrence_auto(_spec(1, 8, 64), "llvm", path="persistent")  # its serial check
    assert path == "persistent" and func is not None
    with pytest.raises(TvmseqError, match="path must be one of"):
        paths.lstm_recurrence_auto(_spec(1, 8, 64), cuda, path="fast")
    with pytest.raises(TvmseqError, match="static batch"):
        paths.lstm_recurrence_auto(_spec(1, None, 64), cuda, path="persistent")


@needs_compiler
def test_rejects_bad_arguments():
    with pytest.raises(TvmseqError, match="needs D=2"):
        engine.persistent_lstm_func(1, 1, 4, "float32", "bidirectional", target="llvm")
    with pytest.raises(TvmseqError, match="dtype"):
        engine.persistent_lstm_func(1, 1, 4, "int8", "forward", target="llvm")
    with pytest.raises(TvmseqError, match="needs 3 Activation"):
        engine.persistent_lstm_func(1, 1, 4, "float32", "forward", ["Sigmoid", "Tanh"], target="llvm")
    with pytest.raises(TvmseqError, match="activations.*unsupported"):
        engine.persistent_lstm_func(1, 1, 4, "float32", "forward", ["Sigmoid", "Tanh", "Swish"], target="llvm")
    with pytest.raises(TvmseqError, match="registers"):
        engine.persistent_lstm_func(1, 1, 1024, "float32", "forward", target="cuda",
                                    config=PersistentConfig(num_blocks=8, num_warps=1, batch_chunk=1))


# ---- CUDA code generation ---------------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,input_forget,peepholes", [(1, 1, 1024, "float32", 0, True),
                                                                  (2, 8, 256, "float16", 1, False)])
def test_cuda_codegen(D, B, H, dtype, input_forget, peepholes):
    """Builds for the H100 without a GPU: cooperative launch, LL primitives, one barrier per iteration (two
    unrolled) in the step loop and (with nvcc) no register spills for sm_90a."""
    from tvmseq.targets import resolve

    tgt = resolve("nvidia/nvidia-h100")
    func = engine.persistent_lstm_func(D, B, H, dtype, "bidirectional" if D == 2 else "forward", None, 1.0, True,
                                       input_forget, peepholes, tgt)
    src = tvm.compile(tvm.IRModule({"lstm_recurrence": func}), target=tgt).mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "st.relaxed.gpu.global.b64", "ld.relaxed.gpu.global"):
        assert needle in src
    loop = src[src.index("tvm_builtin_cuda_grid_sync();") + len("tvm_builtin_cuda_grid_sync();"):].lstrip()
    loop = loop.removeprefix("__syncthreads();")   # weights in shared memory: one barrier before the loop
    assert loop.count("__syncthreads()") == 2
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


# ---- GPU: the prebuilt kernels (runtime only) ----------------------------------------------------------

PREBUILT = Path(os.environ.get("TVMSEQ_PLSTM_DIR", Path(__file__).resolve().parents[1] / "out" / "plstm"))


def _gpu_cases():
    import json

    index = PREBUILT / "index.json"
    return json.loads(index.read_text())["tests"] if index.exists() else []


def _mismatch(name, got, want, rtol, atol) -> str | None:
    """None when got matches want, else one line: how many elements are off, the worst, where, NaNs."""
    got = got.astype(np.float64)
    bad = ~(np.abs(got - want) <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    err = np.where(np.isnan(got), np.inf, np.where(bad, np.abs(got - want), 0))
    at = np.unravel_index(np.argmax(err), err.shape)
    return (f"{name}: {int(bad.sum())}/{bad.size} off (rtol {rtol}, atol {atol}), {int(np.isnan(got).sum())} NaN; "
            f"worst at {tuple(int(i) for i in at)}: got {got[at]:.6g} want {want[at]:.6g}")


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _gpu_cases() or [None], ids=lambda e: e["func"] if e else "no-payload")
def test_prebuilt_kernels_on_gpu(entry):
    if entry is None:
        pytest.skip(f"no prebuilt kernels in {PREBUILT} (python -m tests.test_persistent_lstm build {PREBUILT})")
    import threading

    import tvm as tvm_rt

    from tvmseq.measure import PrebuiltModules

    D, B, H, dtype, direction = entry["D"], entry["B"], entry["H"], entry["dtype"], entry["direction"]
    acts = entry["acts"]
    acts = list(acts) * D if acts and len(acts) == 3 else acts
    seq = 23
    inputs, onnx = make_problem(D, B, H, seq, dtype, seed=H + B, lens_kind="random" if entry["has_seq_lens"] else "full")
    want = reference(onnx, direction, inputs[3], acts, entry["clip"], entry["input_forget"], entry["has_peepholes"],
                     entry["has_seq_lens"])
    kernel_in = list(inputs)
    if not entry["has_peepholes"]:
        kernel_in[2] = np.zeros_like(inputs[2])
    func = PrebuiltModules(PREBUILT).func(entry)
    dev = tvm_rt.cuda(0)
    args = [tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in kernel_in]
    tol = dict(rtol=1e-3, atol=1e-4) if dtype == "float32" else TOL[dtype]
    problems = []
    for launch in range(2):  # twice: the second launch must not see the first one's flags
        outs = [tvm_rt.runtime.tensor(np.full(shape, np.nan, dtype), dev)
                for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
        # the kernel's polls give up after ~seconds (LL timeout printf), so a hang here is something else
        timer = threading.Timer(60, lambda: (print(f"\nWATCHDOG: {entry['func']} hangs", flush=True), os._exit(3)))
        timer.start()
        func(*args, *outs)
        dev.sync()
        timer.cancel()
        for name, got, w in zip(("Y", "Y_h", "Y_c"), outs, want):
            why = _mismatch(name, got.numpy(), w, **tol)
            if why:
                problems.append(f"launch {launch}: {why}")
    assert not problems, f"{entry['func']} (config {entry['config'] or 'default'}):\n  " + "\n  ".join(problems)


def build(out_dir) -> None:
    """The GPU test kernels (CUDA, sm_90a SASS embedded) into out_dir, beside any benchmark modules there."""
    from tvmseq.bench import persistent_lstm as bench

    bench.build_for_gpu(out_dir, tests=True, bench=False, ptxas=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit("usage: python -m tests.test_persistent_lstm build OUTDIR")
    build(sys.argv[2])


def test_choose_path_follows_the_measured_path_database():
    """Where the H100 runs timed several paths for a shape (schedules/measured/lstm_path.json), the fastest is
    chosen: fp32 H512 B8 stays on the SIMT engine (2.8 us a step against the staged kernel's 6.1), fp32 H128 B64
    goes to the staged kernel (2.3 us against the engine's 3.2)."""
    import tvm

    from tvmseq.kernels.recurrent import paths

    h100 = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    path, why = paths.choose_lstm_path(1, 8, 512, "float32", h100)
    assert path == "persistent" and "measured" in why
    path, why = paths.choose_lstm_path(1, 64, 128, "float32", h100)
    assert path == "persistent_mma" and "measured" in why
    assert paths.choose_lstm_path(1, 64, 128, "float16", h100)[0] == "persistent_mma"
    assert paths.measured_path(1, 3, 37, "float32") is None


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recurrence_refuses_more_steps_than_32_bit_indices(cell, monkeypatch):
    """gate_i [D, seq, B, G] and Y are indexed in 32 bits: past 2^31 values the kernel is refused on the host, one
    line saying how many steps fit (here the limit lowered to 150 steps of 2 x 4H values)."""
    import tvm

    from tvmseq.kernels.recurrent import engine
    from tvmseq.onnx import checks

    G = 4 if cell == "lstm" else 3
    monkeypatch.setattr(checks, "INDEX_LIMIT", 2 * G * 8 * 150 + 1)
    func = (engine.persistent_lstm_func(1, 2, 8, "float32", "forward", target="llvm") if cell == "lstm" else
            engine.persistent_gru_func(1, 2, 8, "float32", 1, "forward", None, None, False, "llvm"))
    run = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target="llvm")["k"]

    def call(seq):
        f32 = lambda *s: tvm.runtime.tensor(np.random.rand(*s).astype("float32"))  # noqa: E731
        lens = tvm.runtime.tensor(np.full(2, seq, "int32"))
        if cell == "lstm":
            run(f32(1, seq, 2, 32), f32(1, 32, 8), f32(1, 24), lens, f32(1, 2, 8), f32(1, 2, 8), f32(seq, 1, 2, 8),
                f32(1, 2, 8), f32(1, 2, 8))
        else:
            run(f32(1, seq, 2, 24), f32(1, 24, 8), f32(1, 8), lens, f32(1, 2, 8), f32(seq, 1, 2, 8), f32(1, 2, 8))

    call(150)
    with pytest.raises(Exception, match=f"{cell.upper()} recurrence .* at most 150 steps"):
        call(151)
