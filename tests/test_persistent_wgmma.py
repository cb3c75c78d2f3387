"""Persistent GRU/RNN on warpgroup tensor cores (kernels/recurrent/wgmma.py): the CPU variant (same seeding,
image-layout state, accumulator-layout items, gate math; the product as serial float32 sums) against a float64
numpy GRU/RNN on odd sizes, every direction, sequence_lens, clip, several chunks and batch splits; the
geometry checks; CUDA code generation (wgmma, bulk copies, no spills); (marked gpu) the prebuilt kernels on the
GPU, where the descriptors, the swizzle and the accumulator layout are exercised. gate_dtype="float16" (half gate_i,
as kernels/projection/wgmma.py can write it) on the CPU variant and, with the fp16 projection itself, on the GPU.

GPU kernels: `python tests/test_persistent_wgmma.py out/pwg` builds them here (sm_90a); run
`pytest -m gpu tests/test_persistent_wgmma.py` there with out/pwg carried (or TVMSEQ_PWG_PREBUILT)."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_persistent_gru import batched_reference, default_acts, make_problem, reference  # noqa: E402
from test_persistent_mma import gpu_case_problem, rnn_problem, rnn_reference  # noqa: E402

from tvmseq.errors import TvmseqError  # noqa: E402

try:
    import tvm

    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.projection import wgmma as pwg
    from tvmseq.kernels.recurrent import wgmma as pw
    from tvmseq.targets import resolve
except ImportError:
    pw = None
needs_compiler = pytest.mark.skipif(pw is None, reason="TVM compiler not available")

TOL = dict(rtol=1e-2, atol=4e-3)   # the fp16 state in the product


def run_cpu(inputs, D, B, H, seq, direction, acts, clip, has_lens, config, cell="gru", gate_dtype="float32"):
    func = pw.persistent_wgmma_func(D, B, H, "float16", direction, list(acts), clip, has_lens, "llvm", config, cell,
                                    gate_dtype)
    name = func.attrs["global_symbol"]
    f = tvm.compile(tvm.IRModule({name: func}), target="llvm")[name]
    Y = tvm.runtime.tensor(np.full((seq, D, B, H), np.nan, np.float16))   # poisoned: every element written
    Yh = tvm.runtime.tensor(np.full((D, B, H), np.nan, np.float16))
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], Y, Yh)
    return Y.numpy().astype(np.float64), Yh.numpy().astype(np.float64)


@needs_compiler
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("H,B,config", [
    (37, 5, pw and pw.WgmmaRecConfig(8, 1)),      # padded units, k (one tile) and rows
    (72, 70, pw and pw.WgmmaRecConfig(16, 1)),    # two k tiles, two chunks a block, 4.5 unit groups
    (40, 130, pw and pw.WgmmaRecConfig(8, 2)),    # three chunks -> four, split over two blocks
])
def test_gru_matches_numpy(H, B, config, direction):
    D = 2 if direction == "bidirectional" else 1
    seq = 3
    inputs, ref_args = make_problem(D, B, H, seq, "float16", 1, seed=H * 7 + B)
    acts = default_acts(D)
    Y, Yh = run_cpu(inputs, D, B, H, seq, direction, acts, 0.9 if B == 70 else None, True, config)
    rY, rYh = reference(ref_args, direction, 1, 0.9 if B == 70 else None, acts)
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


def half_gate_problem(D, B, H, seq, direction, acts, clip, lens, seed):
    """A GRU problem with gate_i rounded to float16 (the kernel's input) and the float64 reference computed from
    those rounded values, so the comparison sees the kernel's error only. acts: names (f, g) or None."""
    from tvmseq.kernels.activations import Activation as Act

    inputs, _ = make_problem(D, B, H, seq, "float16", 1, seed=seed, lens_kind="random" if lens else "full")
    inputs = (inputs[0].astype(np.float16),) + tuple(inputs[1:])
    names = acts or ("Sigmoid", "Tanh")
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    np_acts = [(Act.make(names[0]).numpy, Act.make(names[1]).numpy)] * D
    return inputs, batched_reference(*inputs, rev, 1, clip, np_acts)


@needs_compiler
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("H,B,config", [
    (40, 3, pw and pw.WgmmaRecConfig(8, 1)),     # padded units and rows, one chunk
    (72, 19, pw and pw.WgmmaRecConfig(16, 1)),   # two k tiles, 4.5 unit groups
])
def test_gru_half_gate_i_matches_numpy(H, B, config, direction):
    """gate_dtype float16: the kernel reads half gate_i and widens it on load; same tolerance as fp32 gate_i."""
    D = 2 if direction == "bidirectional" else 1
    seq = 3
    inputs, (rY, rYh) = half_gate_problem(D, B, H, seq, direction, None, None, True, seed=H * 5 + B)
    Y, Yh = run_cpu(inputs, D, B, H, seq, direction, default_acts(D), None, True, config, gate_dtype="float16")
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


@needs_compiler
def test_rnn_matches_numpy():
    D, B, H, seq = 2, 9, 70, 3
    inputs = rnn_problem(D, B, H, seq, seed=5)
    acts = [Activation.make("Relu")] * D
    Y, Yh = run_cpu(inputs, D, B, H, seq, "bidirectional", acts, None, True, pw.WgmmaRecConfig(8, 1), "rnn")
    rY, rYh = rnn_reference(inputs[0], inputs[1], inputs[3], inputs[4], [False, True], acts[0].numpy)
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


@needs_compiler
def test_geometry_and_argument_errors():
    from tvmseq.kernels import recurrent_gemm as rg

    h100 = rg.gpu_facts(resolve("cuda"))
    geo = lambda cfg, D=1, B=64, H=1024, NG=3: pw.WgmmaRecGeometry(D, B, H, NG, cfg).check(h100)  # noqa: E731
    assert geo(pw.WgmmaRecConfig(16, 2), B=256) is None            # 128 blocks, 96 KB R + 128 KB state
    assert "shared memory" in geo(pw.WgmmaRecConfig(32, 1), H=1024)  # 192 KB R slice + 128 KB state
    assert "not all resident" in geo(pw.WgmmaRecConfig(8, 4), H=1024)           # 512 blocks > 2 an SM
    # 256 blocks: two an SM, each with half of the SM's shared memory (the whole 128 KB state chunk does not fit;
    # a ring of 4 k-tiles does) and half of its registers
    assert "> 115712 (2 block(s) an SM)" in geo(pw.WgmmaRecConfig(8, 2), H=1024)
    assert geo(pw.WgmmaRecConfig(8, 2, 4), H=1024) is None
    # two warpgroups: each its own slots (2 x 8 x 8 KB beside an LSTM's 128 KB R slice is too much, 2 x 4 fits)
    assert "shared memory" in geo(pw.WgmmaRecConfig(16, 1, 8, 2), D=2, B=256, NG=4)
    assert geo(pw.WgmmaRecConfig(16, 1, 4, 2), D=2, B=256, NG=4) is None
    assert "dividing the 3 chunks a block" in geo(pw.WgmmaRecConfig(16, 1, 4, 2), B=150)
    assert "warpgroups 1 or 2" in geo(pw.WgmmaRecConfig(16, 1, 4, 4), B=256)
    assert pw.WgmmaRecConfig.of((16, 1, 0, 2)).knobs() == (16, 1, 0, 2)
    assert "divide 64" in geo(pw.WgmmaRecConfig(24, 1), H=256)
    assert "gates x units <= 256" in geo(pw.WgmmaRecConfig(96, 1), H=256)
    assert pw.WgmmaRecConfig.of((8, 2)).knobs() == (8, 2)
    assert "registers a thread > 240" in geo(pw.WgmmaRecConfig(64, 1), B=128, H=64, NG=1)   # RNN, 2 chunks
    assert pw.default_config(2, 256, 8192, "cuda") is None                          # 2 x 512+ unit groups
    assert "no warpgroup configuration fits" in pw.supported(2, 256, 8192, "float16", 1, resolve("cuda"))[1]
    with pytest.raises(TvmseqError, match="no configuration fits"):
        pw.persistent_wgmma_func(2, 256, 8192, "float16", "bidirectional", None, None, False, "cuda")
    assert pw.default_config(1, 256, 1024, "cuda") == pw.WgmmaRecConfig(16, 2)
    assert pw.default_config(2, 256, 1024, "cuda") == pw.WgmmaRecConfig(16, 1)
    with pytest.raises(TvmseqError, match="dtype must be float16"):
        pw.persistent_wgmma_func(1, 16, 64, "float32", "forward", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="does not match D=1"):
        pw.persistent_wgmma_func(1, 16, 64, "float16", "bidirectional", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="gate_dtype 'bfloat16'"):
        pw.persistent_wgmma_func(1, 16, 64, "float16", "forward", None, None, False, "llvm", gate_dtype="bfloat16")


@needs_compiler
@pytest.mark.parametrize("D,B,H,cell,gate_dtype", [(1, 256, 1024, "gru", "float32"), (2, 64, 520, "rnn", "float32"),
                                                    (2, 256, 1024, "gru", "float16")])
def test_cuda_codegen(D, B, H, cell, gate_dtype):
    """Builds for the H100 without a GPU: wgmma with the block's N, bulk copies on mbarriers, the grid
    barrier, the whole shared-memory estimate allocated, gate_i of gate_dtype, and (with nvcc) no spills."""
    import re

    tgt = resolve("cuda")
    cfg = pw.default_config(D, B, H, tgt, cell)
    geo = pw.WgmmaRecGeometry(D, B, H, pw.GATES[cell], cfg)
    func = pw.persistent_wgmma_func(D, B, H, "float16", "bidirectional" if D == 2 else "forward", None, None,
                                    True, tgt, cfg, cell, gate_dtype)
    seen = []

    @tvm.instrument.pass_instrument
    class Capture:
        def run_after_pass(self, mod, info):
            if info.name.endswith("MergeSharedMemoryAllocations"):   # one dynamic buffer: nothing to merge
                seen.extend(int(n) * {"uint8": 1, "float16": 2}[dt] for n, dt in re.findall(
                    r'T.alloc_buffer\(\((\d+),\), "(\w+)", scope="shared.dyn"', str(mod)))

    with tvm.transform.PassContext(instruments=[Capture()]):
        src = tvm.compile(tvm.IRModule({"k": func}), target=tgt).mod.imports[0].inspect_source()
    assert seen[-1] == geo.smem_bytes()
    gi_type = "half" if gate_dtype == "float16" else "float"
    for needle in (f"wgmma.mma_async.sync.aligned.m64n{geo.N}k16.f32.f16.f16", "cp.async.bulk.shared::cta.global",
                   "cg::this_grid().sync()", f"{gi_type}* __restrict__ GI_ptr"):
        assert needle in src, needle
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


@needs_compiler
def test_importer_wgmma_path_matches_onnxruntime():
    """The importer on the warpgroup path (its serial CPU variant: CI checks the wiring), float16 GRU, against
    onnxruntime's float32 run of the same fp16-valued weights."""
    import tvmseq

    ort = pytest.importorskip("onnxruntime")
    from test_gpu_models import _float32_twin

    from tvmseq import models

    model, feeds = models.rnn_node_model("GRU", seq=3, batch=66, input_size=5, hidden=13, direction="bidirectional",
                                         with_seq_lens=True, with_initial_h=True, linear_before_reset=1,
                                         weight_scale=0.4, seed=6, dtype="float16")
    got = tvmseq.compile_onnx(model, target="llvm", recurrence="persistent_wgmma")(**feeds)
    twin, twin_feeds = _float32_twin(model, feeds)
    want = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, twin_feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, **TOL)


@needs_compiler
def test_supported_rule():
    h100 = resolve("cuda")
    assert pw.supported(1, 256, 1024, "float16", 1, h100)[0]
    assert pw.supported(2, 64, 1024, "float16", 1, h100)[0]
    assert "measured faster" in pw.supported(1, 64, 1024, "float16", 1, h100)[1]
    assert "sm_90a" in pw.supported(1, 256, 1024, "float16", 1, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))[1]
    assert "float16 GRU" in pw.supported(1, 256, 1024, "float32", 1, h100)[1]
    assert "float16 GRU" in pw.supported(1, 256, 1024, "float16", 1, h100, cell="rnn")[1]
    assert "float16 GRU" in pw.supported(1, 256, 1024, "float16", 0, h100)[1]


# ----------------------------------------------------------------------------------------------------
PREBUILT = Path(os.environ.get("TVMSEQ_PWG_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "pwg"))

# (D, B, H, direction, cell, activations, clip, has_seq_lens, config (units, batch split) or None[, gate dtype])
GPU_CASES = [
    (1, 64, 1024, "forward", "gru", None, None, True, None),
    (1, 256, 1024, "reverse", "gru", None, None, True, None),                    # 2 chunks a block, split 2
    (2, 200, 1000, "bidirectional", "gru", None, 1.1, True, None),               # padded units, k, rows
    (1, 77, 300, "forward", "gru", ("HardSigmoid", "Softsign"), None, True, (8, 1)),
    (2, 90, 136, "bidirectional", "rnn", ("Relu",), None, True, None),
    (1, 130, 520, "reverse", "rnn", None, 0.8, False, (16, 2)),
    (2, 150, 256, "bidirectional", "gru", None, 1.3, True, (8, 1)),              # 3 chunks a block
    (2, 256, 1024, "bidirectional", "gru", None, None, True, None, "float16"),   # half gate_i at the target shape
    (1, 77, 300, "reverse", "gru", None, 1.1, True, (8, 1), "float16"),
    (2, 256, 1000, "bidirectional", "gru", None, None, True, (16, 1, 4, 2)),    # ring of 4, 2 warpgroups
    (1, 250, 200, "reverse", "rnn", None, None, True, (8, 1, 0, 2)),             # 2 warpgroups, whole chunks
]
# float16 gate_i written by the wgmma projection: (D, rows, N, K, tile (bm, bn, stages, inflight)); rows not a
# multiple of the row tile
PROJ16_CASES = [(2, 1000, 768, 640, (128, 128, 3, False)), (1, 333, 3072, 1024, (128, 256, 4, True))]


def _gate_dtype(case):
    return case[9] if len(case) > 9 else "float32"


def _case_name(case):
    D, B, H, direction, cell, acts, clip, lens, cfg = case[:9]
    half = "_gi16" if _gate_dtype(case) == "float16" else ""
    return f"pwg_{cell}_{direction}_h{H}_b{B}_{'lens' if lens else 'nolens'}{half}"


def _proj_name(case):
    D, rows, N, K, tile = case
    return f"pwg_proj16_d{D}_m{rows}_n{N}_k{K}_" + "_".join(map(str, map(int, tile)))


def build_gpu_cases(out_dir):
    from tvmseq.measure import compile_for_gpu

    tgt = resolve("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {}
    for case in GPU_CASES:
        D, B, H, direction, cell, acts, clip, lens, cfg = case[:9]
        acts_ = [Activation.make(a) for a in acts] * D if acts else None
        func = pw.persistent_wgmma_func(D, B, H, "float16", direction, acts_, clip, lens, tgt,
                                        pw.WgmmaRecConfig.of(cfg) if cfg else None, cell, _gate_dtype(case))
        funcs[_case_name(case)] = func.with_attr("global_symbol", _case_name(case))
    for case in PROJ16_CASES:
        D, rows, N, K, tile = case
        func = pwg.projection_wgmma_func(D, N, K, True, pwg.WgmmaTile(*tile), gate_dtype="float16")
        funcs[_proj_name(case)] = func.with_attr("global_symbol", _proj_name(case))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "pwg.so"))
    (out / "index.json").write_text(json.dumps({"cases": GPU_CASES, "proj16": PROJ16_CASES, "ptxas": report},
                                               indent=1))
    print(f"built {len(funcs)} kernels into {out}; ptxas: {report}")


def test_gpu_case_names_are_unique():
    names = [_case_name(case) for case in GPU_CASES] + [_proj_name(case) for case in PROJ16_CASES]
    assert len(set(names)) == len(names), [n for n in names if names.count(n) > 1]


def _gpu_index(key="cases"):
    index = PREBUILT / "index.json"
    return json.loads(index.read_text()).get(key, []) if index.exists() else []


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_index(), ids=lambda c: _case_name(c))
def test_prebuilt_on_gpu(case):
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    D, B, H, direction, cell, acts, clip, lens, cfg = case[:9]
    seq = 23
    if _gate_dtype(case) == "float16":
        inputs, want = half_gate_problem(D, B, H, seq, direction, acts, clip, lens, seed=B + H)
    else:
        inputs, want = gpu_case_problem(D, B, H, direction, cell, acts, clip, lens, "float16", seq)
    dev = tvm_rt.cuda(0)
    f = tvm_rt.runtime.load_module(str(PREBUILT / "pwg.so"))[_case_name(case)]
    Y = tvm_rt.runtime.tensor(np.full((seq, D, B, H), np.nan, np.float16), dev)
    Yh = tvm_rt.runtime.tensor(np.full((D, B, H), np.nan, np.float16), dev)
    for _ in range(2):   # relaunch: the double buffer is re-seeded, nothing carries over
        f(*[tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs], Y, Yh)
    np.testing.assert_allclose(Y.numpy().astype(np.float64), want[0], **TOL)
    np.testing.assert_allclose(Yh.numpy().astype(np.float64), want[1], **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_index("proj16"), ids=lambda c: _proj_name(c))
def test_prebuilt_half_projection_on_gpu(case):
    """The wgmma projection (kernels/projection/wgmma.py) with gate_dtype float16 (poisoned output, partial last row
    tile) against a float64 einsum: the float32 sum rounded once (2^-11 of a value at most, plus the fp32 sum order):
    1e-3 of the largest value."""
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    D, rows, N, K, _ = case
    rng = np.random.default_rng(rows + N)
    X = rng.standard_normal((rows, K)).astype(np.float16)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float16)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    dev = tvm_rt.cuda(0)
    out = tvm_rt.runtime.tensor(np.full((D, rows, N), np.nan, np.float16), dev)
    f = tvm_rt.runtime.load_module(str(PREBUILT / "pwg.so"))[_proj_name(case)]
    f(*[tvm_rt.runtime.tensor(a, dev) for a in (X, W, bias)], out)
    got = out.numpy()
    want = np.einsum("mk,dnk->dmn", X.astype(np.float64), W.astype(np.float64)) + bias[:, None, :]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=1e-3 * np.abs(want).max())


if __name__ == "__main__":
    build_gpu_cases(sys.argv[1] if len(sys.argv) > 1 else "out/pwg")
