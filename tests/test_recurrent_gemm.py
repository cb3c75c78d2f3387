"""Recurrent GEMM X_n = f(X_{n-1} A^T + b): the persistent kernel's CPU variant and the per-step path
against numpy on odd sizes, the warp reduction plan, the on-chip decision, CUDA code generation
(ptxas: no spills), and (marked gpu) the prebuilt CUDA kernels on the GPU."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tvmseq.errors import TvmseqError


def ref_chain(A, bias, x0, steps, f, dtype):
    """Plain numpy: float64 math, state rounded to dtype after every step (as the kernels store it)."""
    x = x0.astype(np.float64)
    out = []
    for _ in range(steps):
        x = f(x @ A.astype(np.float64).T + bias.astype(np.float64)).astype(dtype).astype(np.float64)
        out.append(x)
    return np.stack(out)


ACTS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0), "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "identity": lambda x: x}
TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=1e-2, atol=2e-3)}


def make_inputs(H, B, dtype, seed):
    rng = np.random.default_rng(seed)
    A = (rng.standard_normal((H, H)) * (0.9 / np.sqrt(H))).astype(dtype)
    bias = (0.1 * rng.standard_normal(H) + 0.05).astype(dtype)
    x0 = rng.uniform(-1, 1, (B, H)).astype(dtype)
    return A, bias, x0


try:  # the kernel factories need TVM's compiler; the gpu tests below only its runtime
    from tvmseq.kernels import recurrent_gemm as rg
except ImportError:  # runtime-only TVM (the GPU payload)
    rg = None
needs_compiler = pytest.mark.skipif(rg is None, reason="TVM compiler not available")


def check(H, B, steps, dtype, act, seq, path, config=None, seed=0):
    A, bias, x0 = make_inputs(H, B, dtype, seed)
    got = rg.recurrent_gemm(A, bias, x0, steps, act, seq, target="llvm", config=config, path=path)
    want = ref_chain(A, bias, x0, steps, ACTS[act], dtype)
    want = want if seq else want[-1]
    assert got.shape == want.shape and got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want, **TOL[dtype])


@needs_compiler
@pytest.mark.parametrize("path", ["persistent", "per_step"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("H,B,steps", [(37, 3, 5), (64, 1, 4), (19, 7, 3)])
def test_matches_numpy(H, B, steps, dtype, path):
    check(H, B, steps, dtype, "tanh", True, path, seed=H * B)


@needs_compiler
@pytest.mark.parametrize("path", ["persistent", "per_step"])
@pytest.mark.parametrize("act,seq", [("relu", True), ("sigmoid", False), ("identity", True), ("tanh", False)])
def test_activations_and_last_only(act, seq, path):
    check(23, 2, 4, "float32", act, seq, path, seed=5)


# Knobs that leave padding: blocks not dividing H (padded rows), threads not dividing H (padded k),
# batch chunk not dividing B (or larger than B), rows in shared memory, one row per block.
@needs_compiler
@pytest.mark.parametrize("config", [
    dict(num_blocks=5, num_warps=3, batch_chunk=2, smem_rows=2),
    dict(num_blocks=37, num_warps=1, batch_chunk=3),
    dict(num_blocks=2, num_warps=8, batch_chunk=4, smem_rows=19),
    dict(num_blocks=4, num_warps=40, batch_chunk=1),
], ids=str)
def test_persistent_configs(config):
    check(37, 3, 4, "float32", "tanh", True, "persistent", rg.PersistentConfig(**config), seed=11)


def test_reference_module_agrees():
    from tvmseq.reference.recurrent import recurrent_gemm as ref

    A, bias, x0 = make_inputs(13, 2, "float32", 3)
    np.testing.assert_allclose(ref(A, bias, x0, 4, "sigmoid"), ref_chain(A, bias, x0, 4, ACTS["sigmoid"], "float32"),
                               rtol=1e-6)
    np.testing.assert_allclose(ref(A, bias, x0, 4, "relu", return_sequences=False),
                               ref_chain(A, bias, x0, 4, ACTS["relu"], "float32")[-1], rtol=1e-6)


@needs_compiler
@pytest.mark.parametrize("vp", [1, 2, 4, 8, 16, 32, 64, 128, 96, 160, 224, 288])   # powers of two, 32 x odd
def test_transposing_warp_reduction_plan(vp):
    """Simulate the shuffle stages lane by lane exactly as `make_warp_reduce` emits them: every one of
    the vp sums must be written once, by one lane, at its original index."""
    rng = np.random.default_rng(vp)
    acc = rng.standard_normal((32, vp))
    want = acc.sum(axis=0)
    vals = acc.copy()
    for off, half in rg.reduce_plan(vp, 32):
        new = vals.copy()
        for lane in range(32):
            partner, upper = lane ^ off, bool(lane & off)
            if half > 0:
                for i in range(half):
                    p_send = vals[partner, i] if (partner & off) else vals[partner, i + half]
                    keep = vals[lane, i + half] if upper else vals[lane, i]
                    new[lane, i] = keep + p_send
            else:
                new[lane, 0] = vals[lane, 0] + vals[partner, 0]
        vals = new
    held, bits, dup_mask = rg.reduced_layout(vp, 32)
    out = np.full(vp, np.nan)
    for lane in range(32):
        if lane & dup_mask:
            continue
        base = sum(stride for off, stride in bits if lane & off)
        for i in range(held):
            assert np.isnan(out[base + i]), "two lanes write the same sum"
            out[base + i] = vals[lane, i]
    np.testing.assert_allclose(out, want, rtol=1e-12)


@needs_compiler
@pytest.mark.parametrize("rows,batch", [(24, 4), (48, 4), (12, 8), (32, 1), (4, 8), (96, 2)])
def test_select_free_reduction_in_xor_layout(rows, batch):
    """Lanes hold sum v = b * rows + r at position ((v // h) ^ lane) * h + v % h (`xor_layout`): each stage
    acc[i] += shfl_xor(acc[i + half]) (the select-free `make_warp_reduce`) leaves lane L with the sums L h + i,
    where `reduced_layout` says the standard reduction leaves them; `xor_row` and the column swap place them."""
    h, row_bits = rg.xor_layout(rows, batch, 32)
    vp = rows * batch
    rng = np.random.default_rng(rows * batch)
    sums = rng.standard_normal((32, vp))            # [lane, v]: this lane's partial sum of v
    acc = np.empty((32, vp))
    for lane in range(32):
        for slot_b in range(batch):                 # column slot b holds batch column b ^ (lane >> row_bits)
            for slot_r in range(rows):              # row slot s holds row xor_row(s)
                r = ((slot_r // h) ^ (lane & ((1 << row_bits) - 1))) * h + slot_r % h
                acc[lane, slot_b * rows + slot_r] = sums[lane, (slot_b ^ (lane >> row_bits)) * rows + r]
    for off, half in rg.reduce_plan(vp, 32):
        acc[:, :half] = acc[:, :half] + acc[[lane ^ off for lane in range(32)], half:2 * half]
    held, bits, dup_mask = rg.reduced_layout(vp, 32)
    assert held == h and dup_mask == 0
    out = np.full(vp, np.nan)
    for lane in range(32):
        base = sum(stride for off, stride in bits if lane & off)
        out[base:base + held] = acc[lane, :held]
    np.testing.assert_allclose(out, sums.sum(axis=0), rtol=1e-12)


def test_xor_layout_only_where_it_fits():
    assert rg.xor_layout(24, 4, 32) == (3, 3) and rg.xor_layout(48, 4, 32) == (6, 3)
    assert rg.xor_layout(12, 4, 32) is None      # 48 sums: padded to 64
    assert rg.xor_layout(24, 3, 32) is None      # 72 sums
    assert rg.xor_layout(24, 4, 1) is None       # the CPU variant


@needs_compiler
def test_padded_sums():
    """Up to a warp the next power of two, above it the next multiple of 32 (the reduction's stages stay whole);
    exactly the sums on the CPU (a warp of one)."""
    assert [rg.padded_sums(v, 32) for v in (1, 3, 17, 32, 33, 48, 96, 97, 130)] == [1, 4, 32, 32, 64, 64, 96, 128, 160]
    assert [rg.padded_sums(v, 1) for v in (1, 5, 96)] == [1, 5, 96]
    geo = rg.EngineGeometry(3 * 1024, 1024, 8, rg.PersistentConfig(64, 8, 4, 48), 32, rows_per_unit=3)
    assert geo.V == 192 and geo.Vp == 192     # 256 before: the H1024 B8 bidirectional GRU's pick


@needs_compiler
def test_shared_memory_over_48k_needs_48k_dynamic():
    """TVM's runtime raises a kernel's shared-memory limit only when its dynamic part is >= 48 KB: 43 KB of weight
    rows beside 12 KB of static partial sums did not launch on the H100 (bidirectional H512 B13), 48 KB do."""
    from tvmseq.targets import resolve

    facts = rg.gpu_facts(resolve("cuda"))
    geo = lambda rows: rg.EngineGeometry(3 * 512, 512, 13, rg.PersistentConfig(64, 8, 7, rows), 32,  # noqa: E731
                                         rows_per_unit=3)
    assert "48 KB" in geo(21).check(facts, 128)
    assert geo(24).check(facts, 128) is None


@needs_compiler
def test_on_chip_decision():
    ok, why = rg.fits_on_chip(1024, 1, "float32", "cuda")
    assert ok and rg.choose_path(1024, 1, "float32", "cuda")[0] == "persistent"
    ok, why = rg.fits_on_chip(4096, 1, "float32", "cuda")
    assert not ok and "4096x4096" in why
    assert rg.choose_path(4096, 8, "float32", "cuda")[0] == "per_step"
    # a config that cannot be resident is refused with the reason
    bad = rg.PersistentConfig(num_blocks=300, num_warps=8, batch_chunk=1)  # > 2 blocks on each of 132 SMs
    ok, why = rg.fits_on_chip(1024, 1, "float32", "cuda", bad)
    assert not ok and "SMs" in why
    with pytest.raises(TvmseqError, match="SMs"):
        rg.persistent_recurrent_gemm_func(1024, 1, 10, "float32", "tanh", True, "cuda", bad)


@needs_compiler
@pytest.mark.parametrize("bad", [
    dict(A=np.zeros((3, 4), "float32")),
    dict(bias=np.zeros(5, "float32")),
    dict(x0=np.zeros((2, 5), "float32")),
    dict(A=np.zeros((4, 4), "float64"), bias=np.zeros(4, "float64"), x0=np.zeros((1, 4), "float64")),
    dict(bias=np.zeros(4, "float16")),
    dict(steps=0),
], ids=lambda d: ",".join(d))
def test_bad_inputs_raise(bad):
    args = dict(A=np.ones((4, 4), "float32"), bias=np.ones(4, "float32"), x0=np.ones((1, 4), "float32"), steps=3)
    args.update(bad)
    with pytest.raises(TvmseqError):
        rg.recurrent_gemm(args["A"], args["bias"], args["x0"], args["steps"], target="llvm")
    with pytest.raises(TvmseqError, match="activation"):
        rg.recurrent_gemm(np.ones((4, 4), "float32"), np.ones(4, "float32"), np.ones((1, 4), "float32"), 2,
                          activation="gelu", target="llvm")


@needs_compiler
@pytest.mark.parametrize("H,B,config", [
    (1024, 1, None),
    (1024, 64, dict(num_blocks=128, num_warps=8, batch_chunk=16, smem_rows=4)),
])
def test_cuda_codegen(H, B, config):
    """Builds for the H100 without a GPU: cooperative launch requested, the LL primitives present,
    and (when nvcc is installed) ptxas reports no spills for sm_90a."""
    import tvm

    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    cfg = rg.PersistentConfig(**config) if config else None
    func, path = rg.recurrent_gemm_func(H, B, 50, "float32", "tanh", True, tgt, cfg)
    assert path == "persistent"
    assert "tirx.use_cooperative_launch" in list(func.attrs["tirx.kernel_launch_params"])
    ex = tvm.compile(tvm.IRModule({"recurrent_gemm": func}), target=tgt)
    src = ex.mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "st.relaxed.gpu.global.b64", "ld.relaxed.gpu.global", "__shfl_xor_sync"):
        assert needle in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    report = ptxas_report(src)
    (info,) = report.values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["stack"] == 0, info


# ----------------------------------------------------------------------------------------------------
# GPU: the prebuilt payload (python3 -m tvmseq.bench.recurrent_gemm --build out/rg), runtime only
# ----------------------------------------------------------------------------------------------------

PREBUILT = Path(os.environ.get("TVMSEQ_RG_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "rg"))


def _gpu_cases():
    index = PREBUILT / "index.json"
    if not index.exists():
        return []
    return [e for e in json.loads(index.read_text())["entries"] if e["group"] == "tests"]


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _gpu_cases() or [None], ids=lambda e: e["func"] if e else "no-payload")
def test_prebuilt_kernels_on_gpu(entry):
    if entry is None:
        pytest.skip(f"no prebuilt payload in {PREBUILT} (build it with --build out/rg and carry out/rg)")
    import tvm

    mod = _load(PREBUILT / entry["file"])
    H, B, steps, dtype = entry["H"], entry["B"], entry["steps"], entry["dtype"]
    A, bias, x0 = make_inputs(H, B, dtype, seed=H + B)
    dev = tvm.cuda(0)
    shape = (steps, B, H) if entry["return_sequences"] else (B, H)
    y = tvm.runtime.tensor(np.full(shape, np.nan, dtype), dev)
    args = [tvm.runtime.tensor(a, dev) for a in (A, bias, x0)] + [y]
    for _ in range(2):  # twice: the second launch must not see the first one's flags
        with _watchdog(60, entry["func"]):
            mod[entry["func"]](*args)
            dev.sync()
        want = ref_chain(A, bias, x0, steps, ACTS[entry["activation"]], dtype)
        want = want if entry["return_sequences"] else want[-1]
        np.testing.assert_allclose(y.numpy().astype(np.float64), want, **TOL[dtype])


_MODULES = {}


def _load(path):
    import tvm

    if path not in _MODULES:
        _MODULES[path] = tvm.runtime.load_module(str(path))
    return _MODULES[path]


class _watchdog:
    """A deadlocked persistent kernel cannot be cancelled: end the test run with a message instead of
    hanging until the job's time limit."""

    def __init__(self, seconds, what):
        import threading

        self.timer = threading.Timer(seconds, self._fire, args=(what, seconds))

    @staticmethod
    def _fire(what, seconds):
        print(f"\nWATCHDOG: {what} still running after {seconds}s: deadlock, aborting", flush=True)
        os._exit(3)

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()
