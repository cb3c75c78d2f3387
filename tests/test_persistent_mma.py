"""Tensor-core persistent GRU/RNN (kernels/recurrent/mma.py): the CPU variant (same staging, partial sums,
gates and publishing, serial loops) against a float64 numpy GRU/RNN on odd sizes, every direction,
sequence_lens, clip, activations, several chunks and configs; the path choice; CUDA code generation
(mma.sync, ldmatrix, cp.async, no spills); (marked gpu) the prebuilt kernels on the GPU, where the
fragment layouts are exercised.

GPU kernels: `python tests/test_persistent_mma.py out/pmma` builds them here (sm_90a); run
`pytest -m gpu tests/test_persistent_mma.py` there with out/pmma carried (or TVMSEQ_PMMA_PREBUILT)."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_persistent_gru import batched_reference, default_acts, make_problem, reference  # noqa: E402

from tvmseq.errors import TvmseqError  # noqa: E402

try:
    import tvm

    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.recurrent import paths
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.targets import resolve
except ImportError:
    pm = None
needs_compiler = pytest.mark.skipif(pm is None, reason="TVM compiler not available")

# fp16 state in the product (as cuDNN's fp16 GRU): ~1e-3 absolute on states of size ~1
TOL = dict(rtol=1e-2, atol=4e-3)


def _compile_cpu(func):
    name = func.attrs["global_symbol"]
    return tvm.compile(tvm.IRModule({name: func}), target="llvm")[name]


def run_cpu(inputs, D, B, H, seq, direction, acts, clip, has_lens, config, cell="gru"):
    f = _compile_cpu(pm.persistent_mma_func(D, B, H, "float16", direction, list(acts), clip, has_lens, "llvm",
                                            config, cell))
    Y = tvm.runtime.tensor(np.full((seq, D, B, H), np.nan, np.float16))  # poisoned: every element written
    Yh = tvm.runtime.tensor(np.full((D, B, H), np.nan, np.float16))
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], Y, Yh)
    return Y.numpy().astype(np.float64), Yh.numpy().astype(np.float64)


@needs_compiler
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("H,B,config", [
    (37, 5, pm and pm.MmaConfig(8, 2, 16)),     # padded units, k and rows
    (20, 19, pm and pm.MmaConfig(16, 1, 16)),   # two chunks, one warp
    (50, 33, pm and pm.MmaConfig(8, 3, 32)),    # ragged chunks (33 rows in 2 x 32), 3 warps
    (16, 16, pm and pm.MmaConfig(8, 1, 64)),    # exact tiles
    (24, 70, pm and pm.MmaConfig(8, 2, 16, False, 2)),   # batch split: 5 chunks -> 6 (3 per block)
    (40, 45, pm and pm.MmaConfig(16, 1, 16, True, 3)),   # batch split 3, pipelined flag (GPU only)
    # the state in the staging image layout (chunk, warp, k half, row, padded column), batch split 3
    (72, 45, pm and pm.MmaConfig(8, 2, 16, True, 3, bulk=True, image=True)),
    (48, 37, pm and pm.MmaConfig(8, 3, 16, False, 2, bulk=True, image=True, cluster=2)),   # 3 warps: one k16 each
])
def test_gru_matches_numpy(H, B, config, direction):
    D = 2 if direction == "bidirectional" else 1
    seq = 4
    inputs, ref_args = make_problem(D, B, H, seq, "float16", 1, seed=H * 7 + B)
    acts = default_acts(D)
    Y, Yh = run_cpu(inputs, D, B, H, seq, direction, acts, None, True, config)
    rY, rYh = reference(ref_args, direction, 1, None, acts)
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


@needs_compiler
@pytest.mark.parametrize("direction,config", [("bidirectional", pm and pm.MmaConfig(8, 2, 16, False, 2)),
                                              ("reverse", pm and pm.MmaConfig(16, 3, 32)),
                                              ("forward", pm and pm.MmaConfig(8, 1, 32, bulk=True, image=True))])
def test_float32_matches_numpy(direction, config):
    """float32 (the FMA product on the GPU): the same kernel keeps a float32 state buffer, float32 tolerances."""
    D = 2 if direction == "bidirectional" else 1
    inputs, ref_args = make_problem(D, 37, 29, 4, "float32", 1, seed=17)
    acts = default_acts(D)
    f = _compile_cpu(pm.persistent_mma_func(D, 37, 29, "float32", direction, list(acts), None, True, "llvm", config))
    Y = tvm.runtime.tensor(np.full((4, D, 37, 29), np.nan, np.float32))
    Yh = tvm.runtime.tensor(np.full((D, 37, 29), np.nan, np.float32))
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], Y, Yh)
    rY, rYh = reference(ref_args, direction, 1, None, acts)
    np.testing.assert_allclose(Y.numpy(), rY, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Yh.numpy(), rYh, rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("direction,B,H,cell,knobs", [
    ("forward", 1, 45, "gru", (32, 8, 1, 0, 1, 0, 0, 0, 0, 0, 2, 1, 1)),
    ("bidirectional", 3, 29, "gru", (16, 4, 4, 0, 1, 0, 0, 0, 0, 0, 2, 1, 1)),
    ("reverse", 7, 29, "rnn", (8, 2, 8, 0, 1, 0, 0, 0, 0, 0, 4, 1, 1)),
    ("forward", 2, 29, "gru", (16, 2, 2, 0, 1, 0, 0, 0, 0, 0, 2, 1, 1))])
def test_float32_small_chunks_match_numpy(direction, B, H, cell, knobs):
    """float32 chunks of 1-8 rows (the dsmem hand-off, a batch of at most 8): the CPU variant's chunk geometry (items,
    padded rows, the bytes a slot expects) at odd sizes; the GPU product's lane layout runs in GPU_CASES."""
    D, seq = (2 if direction == "bidirectional" else 1), 5
    cfg = pm.MmaConfig.of(knobs)
    if cell == "rnn":
        inputs = rnn_problem(D, B, H, seq, seed=B, dtype="float32")
        acts = [Activation.make("Tanh")] * D
        rev = [direction == "reverse" or d == 1 for d in range(D)]
        want = rnn_reference(inputs[0], inputs[1], inputs[3], inputs[4], rev, acts[0].numpy)
    else:
        inputs, ref_args = make_problem(D, B, H, seq, "float32", 1, seed=B)
        acts = default_acts(D)
        want = reference(ref_args, direction, 1, None, acts)
    f = _compile_cpu(pm.persistent_mma_func(D, B, H, "float32", direction, list(acts), None, True, "llvm", cfg, cell))
    Y = tvm.runtime.tensor(np.full((seq, D, B, H), np.nan, np.float32))
    Yh = tvm.runtime.tensor(np.full((D, B, H), np.nan, np.float32))
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in inputs], Y, Yh)
    np.testing.assert_allclose(Y.numpy(), want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Yh.numpy(), want[1], rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("clip", [None, 0.5])
def test_clip_activations_and_no_lengths(clip):
    D, B, H, seq = 2, 6, 24, 5
    acts = tuple(Activation.make(n) for n in ("HardSigmoid", "Softsign", "Sigmoid", "Relu"))
    inputs, ref_args = make_problem(D, B, H, seq, "float16", 1, seed=3, lens_kind="full")
    Y, Yh = run_cpu(inputs, D, B, H, seq, "bidirectional", acts, clip, False, pm.MmaConfig(8, 2, 16))
    rY, rYh = reference(ref_args, "bidirectional", 1, clip, acts)
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


def rnn_reference(gate_i, R, lens, h0, reverse_dirs, act, clip=None):
    """float64 ONNX RNN recurrence from the kernel's inputs (gate_i = X W^T + Wb + Rb)."""
    D, T_, B, H = gate_i.shape
    L = np.clip(lens.astype(np.int64), 0, T_)
    Y, Yh, rows = np.zeros((T_, D, B, H)), np.zeros((D, B, H)), np.arange(B)
    c = (lambda x: x) if clip is None else (lambda x: np.clip(x, -clip, clip))
    for d in range(D):
        h = h0[d].astype(np.float64)
        for s in range(T_):
            live = s < L
            t = np.where(live, (L - 1 - s) if reverse_dirs[d] else s, 0)
            h = np.where(live[:, None], act(c(gate_i[d, t, rows] + h @ R[d].astype(np.float64).T)), h)
            Y[t[live], d, rows[live]] = h[live]
        Yh[d] = np.where((L > 0)[:, None], h, 0)
    return Y, Yh


def rnn_problem(D, B, H, seq, seed, dtype="float16"):
    rng = np.random.default_rng(seed)
    gate_i = rng.uniform(-1, 1, (D, seq, B, H)).astype(np.float32)
    R = rng.uniform(-H ** -0.5, H ** -0.5, (D, H, H)).astype(dtype)
    lens = rng.integers(0, seq + 1, B).astype(np.int32)
    lens[0] = seq
    h0 = rng.standard_normal((D, B, H)).astype(np.float32)
    return gate_i, R, np.zeros((D, H), np.float32), lens, h0


@needs_compiler
@pytest.mark.parametrize("direction,act", [("reverse", "Tanh"), ("bidirectional", "Relu")])
def test_rnn_matches_numpy(direction, act):
    D, B, H, seq = (2 if direction == "bidirectional" else 1), 17, 40, 5
    inputs = rnn_problem(D, B, H, seq, seed=9)
    acts = [Activation.make(act)] * D
    Y, Yh = run_cpu(inputs, D, B, H, seq, direction, acts, 2.5, True, pm.MmaConfig(8, 2, 16), cell="rnn")
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    rY, rYh = rnn_reference(inputs[0], inputs[1], inputs[3], inputs[4], rev, acts[0].numpy, clip=2.5)
    np.testing.assert_allclose(Y, rY, **TOL)
    np.testing.assert_allclose(Yh, rYh, **TOL)


@needs_compiler
def test_path_choice():
    h100 = resolve("cuda")
    assert paths.choose_path(1, 64, 1024, "float16", h100)[0] == "persistent_mma"
    assert paths.choose_path(2, 32, 1024, "float16", h100)[0] == "persistent_mma"
    assert paths.choose_path(2, 256, 1024, "float16", h100)[0] == "persistent_wgmma"   # batch >= 128 on sm_90a
    assert paths.choose_path(2, 64, 1024, "float16", h100)[0] == "persistent_wgmma"    # bidirectional, H >= 1024
    assert paths.choose_path(1, 256, 1024, "float16", h100, cell="rnn")[0] == "persistent_mma"   # RNN: not timed
    sm80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert paths.choose_path(1, 256, 1024, "float16", sm80)[0] != "persistent_wgmma"   # no wgmma before sm_90a
    assert paths.choose_path(1, 64, 1024, "float32", h100)[0] == "per_step"   # float32: FMA product, measured slower
    assert paths.choose_path(1, 64, 512, "float32", h100)[0] == "persistent_mma"    # ... and faster here
    assert paths.choose_path(1, 256, 512, "float32", h100)[0] == "per_step"
    assert paths.choose_path(1, 8, 1024, "float16", h100)[0] == "persistent"         # below MMA_MIN_BATCH
    assert paths.choose_path(1, 64, 1024, "float16", h100, lbr=0)[0] != "persistent_mma"
    assert paths.choose_path(1, 64, 1024, "float16", h100, cell="rnn")[0] == "persistent_mma"
    assert paths.choose_path(1, 64, 1024, "float16", "llvm")[0] == "per_step"
    ok, why = pm.supported(1, 64, 1024, "float16", 1, tvm.target.Target({"kind": "cuda", "arch": "sm_75"}))
    assert not ok and "sm_80" in why
    ok, why = pm.supported(2, 64, 8192, "float16", 1, h100)   # 2 x 1024 blocks of 8 units
    assert not ok and "no staged-state configuration" in why


@needs_compiler
def test_rejects_bad_arguments():
    with pytest.raises(TvmseqError, match="float16 or float32"):
        pm.persistent_mma_func(1, 16, 64, "bfloat16", "forward", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="direction"):
        pm.persistent_mma_func(2, 16, 64, "float16", "forward", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="multiple of 8"):
        pm.persistent_mma_func(1, 16, 64, "float16", "forward", None, None, False, "llvm", pm.MmaConfig(12, 8, 64))
    with pytest.raises(TvmseqError, match="not all resident"):
        pm.persistent_mma_func(1, 16, 4096, "float16", "forward", None, None, False, "cuda", pm.MmaConfig(8, 8, 16))
    from tvmseq.kernels.recurrent import gru

    spec = gru.GruSpec(1, 32, 64, 64, "float16", 0, "forward")
    with pytest.raises(TvmseqError, match="linear_before_reset=1"):
        paths.recurrence_func_auto(spec, "llvm", path="persistent_mma")


@needs_compiler
@pytest.mark.parametrize("D,B,H,cell", [(1, 64, 1024, "gru"), (2, 256, 1024, "gru"), (1, 64, 512, "rnn")])
def test_cuda_codegen(D, B, H, cell):
    """Builds for the H100 without a GPU (the database's config where it has one): tensor-core and async-copy
    instructions (cluster multicast where the config asks for it), the grid barrier, registers within the estimate's budget and (with nvcc) no spills."""
    tgt = resolve("cuda")
    func = pm.persistent_mma_func(D, B, H, "float16", "bidirectional" if D == 2 else "forward", None, None, True,
                                  tgt, cell=cell)
    src = tvm.compile(tvm.IRModule({"k": func}), target=tgt).mod.imports[0].inspect_source()
    cfg = pm.default_config(D, B, H, tgt, cell)
    staging = ["cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               if cfg.cluster > 1 else "cp.async.bulk"] if cfg.bulk else ["cp.async.cg.shared.global"]
    for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4",
                   "cg::this_grid().sync()", *staging):
        assert needle in src, needle
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


@needs_compiler
@pytest.mark.parametrize("dtype,cell,knobs", [("float32", "rnn", (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1)),
                                              ("float16", "gru", (32, 8, 16, 0, 4, 0, 0, 0, 1, 1, 8, 1)),
                                              ("float32", "gru", (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1)),
                                              ("float16", "rnn", (32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 8, 1, 1))])
def test_cluster_sync_codegen(dtype, cell, knobs):
    """cluster_sync: the step ends with a cluster barrier, no grid barrier, and the launch is not cooperative (the
    clusters are independent and need not all be resident); with the image layout the copies multicast; with
    dsmem the state goes to the peers by st.async (completing on their mbarriers) and nothing is copied from global
    memory."""
    tgt = resolve("cuda")
    cfg = pm.MmaConfig.of(knobs)
    func = pm.persistent_mma_func(1, 64, 16 * cfg.units_per_block if cfg.cluster == 16 else 8 * cfg.units_per_block,
                                  dtype, "forward", None, None, True, tgt, cfg, cell)
    assert "tirx.kernel_launch_params" not in func.attrs
    src = tvm.compile(tvm.IRModule({"k": func}), target=tgt).mod.imports[0].inspect_source()
    assert "barrier.cluster.arrive.release" in src and "barrier.cluster.wait.acquire" in src
    assert "grid().sync()" not in src
    assert ("multicast::cluster" in src) == cfg.image
    assert ("st.async.shared::cluster.mbarrier::complete_tx::bytes" in src and "mapa.shared::cluster" in src) == cfg.dsmem
    assert ("cp.async" not in src) == cfg.dsmem
    # float32 sends 4 units a lane as one 16-byte st.async, float16 2 units as a word (mma.DSMEM_SEND_BYTES)
    sent = f"tvmseq_st_async_{dtype}_{pm.DSMEM_SEND_BYTES[dtype]}("
    assert (sent in src) == cfg.dsmem


def _dyn_shared_bytes(func, tgt) -> int:
    """Bytes of the merged dynamic shared memory allocation TVM gives the built kernel (its launch size)."""
    import re

    seen = []

    @tvm.instrument.pass_instrument
    class Capture:
        def run_after_pass(self, mod, info):
            if info.name.endswith("MergeSharedMemoryAllocations"):
                seen.extend(int(n) for n in re.findall(r'buf_dyn_shmem = T.alloc_buffer\(\((\d+),\)', str(mod)))

    with tvm.transform.PassContext(instruments=[Capture()]):
        tvm.compile(tvm.IRModule({"k": func}), target=tgt)
    return seen[-1]


@needs_compiler
@pytest.mark.parametrize("dtype,H,knobs", [("float32", 512, (8, 8, 32, 0, 2, 0, 0, 0, 1, 1, 2)),
                                           ("float16", 1024, (16, 8, 32, 0, 2, 0, 0, 0, 1, 1, 2))])
def test_bulk_image_copies_get_their_whole_staging_buffer(dtype, H, knobs):
    """The image copies write whole padded k halves into the staging buffer; shared-memory merging sizes a
    buffer by the accesses it sees, so the kernel must get all of smem_bytes() (an address_of destination once
    left the float32 buffer 16 bytes short: compute-sanitizer memcheck, invalid __shared__ write of 4608 bytes)."""
    tgt = resolve("cuda")
    cfg = pm.MmaConfig.of(knobs)
    func = pm.persistent_mma_func(1, 64, H, dtype, "forward", None, None, True, tgt, cfg)
    assert _dyn_shared_bytes(func, tgt) == pm.MmaGeometry(1, 64, H, 3, cfg, dtype).smem_bytes()


@needs_compiler
@pytest.mark.parametrize("op,direction,acts", [("GRU", "bidirectional", None), ("RNN", "reverse", ["Relu"])])
def test_importer_mma_path_matches_onnxruntime(op, direction, acts):
    """The importer on the tensor-core path (its serial CPU variant, so CI checks the wiring), float16, against
    onnxruntime's float32 run of the same fp16-valued weights (its CPU GRU/RNN has no float16 kernel)."""
    import tvmseq

    ort = pytest.importorskip("onnxruntime")
    from test_gpu_models import _float32_twin

    from tvmseq import models

    model, feeds = models.rnn_node_model(op, seq=4, batch=17, input_size=5, hidden=11, direction=direction,
                                         with_seq_lens=True, with_initial_h=True,
                                         linear_before_reset=1 if op == "GRU" else None, activations=acts,
                                         weight_scale=0.4, seed=5, dtype="float16")
    got = tvmseq.compile_onnx(model, target="llvm", recurrence="persistent_mma")(**feeds)
    twin, twin_feeds = _float32_twin(model, feeds)
    want = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, twin_feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, **TOL)


# ----------------------------------------------------------------------------------------------------
# GPU: kernels built here by `python tests/test_persistent_mma.py out/pmma`, run with TVM's runtime only
# ----------------------------------------------------------------------------------------------------
PREBUILT = Path(os.environ.get("TVMSEQ_PMMA_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "pmma"))

# (D, B, H, direction, cell, activations, clip, has_seq_lens, config (units, warps, rows) or None)
GPU_CASES = [
    (1, 16, 1024, "forward", "gru", None, None, True, None),
    (2, 64, 1024, "bidirectional", "gru", None, None, False, None),
    (1, 256, 512, "forward", "gru", None, None, True, None),                     # 4 chunks a step
    (2, 37, 200, "bidirectional", "gru", None, 0.9, True, (16, 4, 32)),           # odd, clip, 2 chunks
    (1, 100, 333, "reverse", "gru", ("HardSigmoid", "Softsign"), None, True, (8, 8, 48)),
    (1, 19, 129, "forward", "rnn", ("Relu",), None, True, None),
    (2, 64, 1024, "bidirectional", "rnn", None, None, True, None),
    (1, 77, 300, "reverse", "gru", None, None, True, (8, 4, 16, 1)),             # pipelined, 5 chunks (odd)
    (2, 50, 96, "bidirectional", "gru", None, 1.5, True, (8, 2, 32, 1)),         # pipelined, 2 chunks
    (1, 70, 160, "forward", "gru", None, None, True, (8, 4, 16, 0, 2)),          # batch split, padded chunk
    (2, 99, 64, "bidirectional", "gru", None, None, True, (8, 2, 16, 1, 3)),     # split 3 + pipelined
    (1, 256, 1024, "forward", "gru", None, None, True, (8, 8, 32, 0, 2)),        # 2 blocks an SM
    (1, 64, 1024, "reverse", "gru", None, None, True, (8, 8, 32, 0, 2, 1)),      # ready flags, split
    (2, 45, 136, "bidirectional", "gru", None, None, True, (8, 4, 16, 1, 2, 1)),  # flags, padded k, pipelined
    (2, 33, 512, "bidirectional", "rnn", None, None, True, (8, 8, 16, 0, 1, 1)),  # flags, RNN
    (1, 77, 520, "forward", "gru", None, None, True, (16, 8, 16, 1, 2)),        # wide blocks, odd H, pipelined
    (1, 130, 1000, "reverse", "gru", None, 1.2, True, (16, 8, 32, 1, 2)),        # wide, 3 chunks a block, clip
    (1, 70, 300, "reverse", "gru", None, None, True, (16, 8, 16, 0, 2, 0, 0, 0, 1)),   # bulk copies, odd k
    (1, 21, 129, "forward", "rnn", ("Relu",), None, True, (8, 8, 16, 0, 1, 0, 0, 0, 1)),  # bulk, 2 k halves
    (1, 64, 1024, "forward", "gru", None, None, True, (16, 8, 32, 0, 2, 0, 0, 1)),      # early gate loads
    # the state in the staging image layout, one bulk copy a k half; clusters multicast the copies
    (1, 64, 1024, "reverse", "gru", None, 0.8, False, (16, 8, 32, 0, 2, 0, 0, 0, 1, 1)),   # image
    (1, 60, 1024, "forward", "gru", None, None, True, (16, 8, 32, 0, 2, 0, 0, 0, 1, 1, 2)),  # cluster 2
    (1, 250, 1016, "forward", "gru", None, 1.2, True, (16, 8, 32, 1, 2, 0, 0, 1, 1, 1, 2)),  # 4 chunks, pipelined
    (2, 90, 500, "bidirectional", "gru", None, None, True, (16, 8, 16, 1, 1, 0, 0, 0, 1, 1, 4)),  # cluster 4
    (1, 23, 250, "forward", "rnn", ("Relu",), None, True, (8, 8, 16, 0, 1, 0, 0, 0, 1, 1, 2)),  # RNN, cluster
    # float32: the product on FMA units, R slice in shared memory
    (1, 64, 1024, "forward", "gru", None, None, True, None, "float32"),
    (2, 45, 136, "bidirectional", "gru", None, 0.9, True, (8, 4, 16, 1, 2), "float32"),
    (1, 70, 333, "reverse", "gru", ("HardSigmoid", "Softsign"), None, True, (8, 8, 32, 0, 2), "float32"),
    (1, 50, 256, "forward", "rnn", ("Relu",), None, True, None, "float32"),
    (1, 64, 1024, "reverse", "gru", None, None, True, (8, 8, 32, 0, 1, 0, 1), "float32"),      # half_stage
    (2, 40, 200, "bidirectional", "gru", None, None, True, (8, 4, 32, 0, 2, 0, 1), "float32"),  # half, split
    (2, 47, 136, "bidirectional", "gru", None, 0.9, True, (8, 4, 16, 0, 2, 0, 0, 0, 1), "float32"),  # bulk
    (1, 51, 256, "forward", "rnn", ("Relu",), None, True, (8, 8, 16, 0, 4, 0, 0, 1, 1), "float32"),  # bulk, early
    (1, 64, 512, "forward", "gru", None, None, True, (8, 8, 32, 0, 2, 0, 0, 0, 1, 1), "float32"),  # image
    (2, 47, 128, "bidirectional", "gru", None, 0.9, True, (8, 4, 16, 1, 2, 0, 0, 0, 1, 1, 2), "float32"),  # cluster
    # cluster_sync: a cluster is a batch group's unit groups and a step ends with a cluster barrier (no grid barrier)
    (1, 61, 250, "forward", "rnn", None, None, True, (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1), "float32"),  # 16 blocks
    (2, 37, 256, "bidirectional", "rnn", ("Relu",), None, True, (32, 8, 16, 0, 2, 0, 0, 1, 0, 0, 8, 1), "float32"),
    (2, 70, 200, "bidirectional", "gru", None, 0.9, True, (16, 8, 16, 1, 2, 0, 0, 0, 0, 0, 13, 1), "float32"),  # 13
    (1, 7, 256, "reverse", "gru", None, None, True, (32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1)),   # batch 7
    (1, 66, 500, "forward", "gru", None, None, True, (32, 8, 16, 0, 4, 0, 0, 0, 1, 1, 16, 1)),  # multicast to 16
    (2, 90, 250, "bidirectional", "gru", None, None, False, (16, 8, 32, 1, 1, 0, 0, 0, 1, 1, 16, 1)),  # 3 chunks
    # dsmem: the new state pushed into every cluster peer's staging slot (no global round trip)
    (1, 61, 250, "reverse", "rnn", None, None, True, (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1), "float32"),
    (2, 39, 256, "bidirectional", "rnn", ("Relu",), 0.7, True, (32, 4, 16, 0, 3, 0, 0, 0, 0, 0, 8, 1, 1), "float32"),
    (2, 29, 200, "bidirectional", "gru", None, 0.9, True, (16, 8, 16, 0, 2, 0, 0, 1, 0, 0, 13, 1, 1), "float32"),
    (1, 1, 256, "forward", "rnn", None, None, False, (16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1), "float32"),  # batch 1
    (1, 64, 256, "forward", "gru", None, None, True, (16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1)),
    (1, 7, 250, "reverse", "gru", ("HardSigmoid", "Softsign"), None, True, (32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1)),
    # batch 1 in a cluster with the gate rows as the mma's M (the measured database's float16 picks at batch 1)
    (2, 1, 250, "bidirectional", "gru", None, 0.9, True, (16, 4, 8, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 1, 1)),
    (1, 1, 500, "reverse", "gru", None, None, False, (32, 8, 8, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 2, 1)),
    (2, 50, 500, "bidirectional", "gru", None, 1.1, True, (32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1)),  # padded k
    (1, 23, 136, "forward", "rnn", ("Relu",), None, False, (16, 4, 32, 0, 1, 0, 0, 0, 0, 0, 9, 1, 1)),   # 32-row chunk
    # dsmem with the n split: k-groups of warps splitting the gate rows
    (1, 11, 250, "forward", "gru", None, None, True, (16, 4, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 2)),  # 2 k-groups
    (2, 19, 250, "bidirectional", "gru", None, 0.9, True, (16, 8, 16, 0, 2, 0, 0, 0, 0, 0, 16, 1, 1, 2)),
    # float32 chunks of fewer than 16 rows (dsmem): the gate rows spread over the lanes (1 row: 32 lane groups)
    (1, 1, 400, "forward", "gru", None, None, False, (32, 8, 1, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1), "float32"),
    (2, 1, 250, "bidirectional", "gru", None, 0.9, True, (32, 4, 1, 0, 1, 0, 0, 0, 0, 0, 8, 1, 1), "float32"),
    (1, 3, 129, "reverse", "rnn", ("Relu",), None, True, (16, 4, 4, 0, 1, 0, 0, 0, 0, 0, 9, 1, 1), "float32"),
    (1, 7, 300, "forward", "gru", None, None, True, (32, 8, 8, 0, 1, 0, 0, 0, 0, 0, 10, 1, 1), "float32"),
    (2, 2, 200, "bidirectional", "gru", ("HardSigmoid", "Softsign"), None, True,
     (16, 8, 2, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1), "float32"),
]
TOL32 = dict(rtol=1e-4, atol=2e-5)


def _case_name(case):
    D, B, H, direction, cell, acts, clip, lens, cfg, *dtype = case
    return f"pmma_{cell}_{direction}_h{H}_b{B}_{'lens' if lens else 'nolens'}" + ("_f32" if dtype else "")


def build_gpu_cases(out_dir):
    from tvmseq.measure import compile_for_gpu

    tgt = resolve("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {}
    for case in GPU_CASES:
        D, B, H, direction, cell, acts, clip, lens, cfg, *dtype = case
        acts_ = [Activation.make(a) for a in acts] * D if acts else None
        func = pm.persistent_mma_func(D, B, H, (dtype or ["float16"])[0], direction, acts_, clip, lens, tgt,
                                      pm.MmaConfig.of(cfg) if cfg else None, cell)
        funcs[_case_name(case)] = func.with_attr("global_symbol", _case_name(case))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "pmma.so"))
    (out / "index.json").write_text(json.dumps({"cases": GPU_CASES, "ptxas": report}, indent=1))
    print(f"built {len(funcs)} kernels into {out}; ptxas: {report}")


def test_gpu_case_names_are_unique():
    """Each GPU case is one kernel of the prebuilt library, found by its name."""
    names = [_case_name(case) for case in GPU_CASES]
    assert len(set(names)) == len(names), [n for n in names if names.count(n) > 1]


def _gpu_index():
    index = PREBUILT / "index.json"
    return json.loads(index.read_text())["cases"] if index.exists() else []


def gpu_case_problem(D, B, H, direction, cell, acts, clip, lens, dtype, seq=23):
    """(kernel inputs, float64 (Y, Y_h)) of a GPU case (this file's and tests/test_persistent_wgmma.py's)."""
    from tvmseq.kernels.activations import Activation as Act

    rev = [direction == "reverse" or d == 1 for d in range(D)]
    if cell == "gru":
        inputs, _ = make_problem(D, B, H, seq, dtype, 1, seed=B + H, lens_kind="random" if lens else "full")
        names = (acts or ("Sigmoid", "Tanh"))
        np_acts = [(Act.make(names[0]).numpy, Act.make(names[1]).numpy)] * D
        return inputs, batched_reference(*inputs, rev, 1, clip, np_acts)
    inputs = list(rnn_problem(D, B, H, seq, seed=B + H, dtype=dtype))
    if not lens:
        inputs[3] = np.full(B, seq, np.int32)
    return inputs, rnn_reference(inputs[0], inputs[1], inputs[3], inputs[4], rev,
                                 Act.make((acts or ("Tanh",))[0]).numpy, clip)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_index(), ids=lambda c: _case_name(c))
def test_prebuilt_on_gpu(case):
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    D, B, H, direction, cell, acts, clip, lens, cfg, *dtype = case
    dtype = (dtype or ["float16"])[0]
    seq = 23
    inputs, want = gpu_case_problem(D, B, H, direction, cell, acts, clip, lens, dtype, seq)
    dev = tvm_rt.cuda(0)
    f = tvm_rt.runtime.load_module(str(PREBUILT / "pmma.so"))[_case_name(case)]
    Y = tvm_rt.runtime.tensor(np.full((seq, D, B, H), np.nan, dtype), dev)
    Yh = tvm_rt.runtime.tensor(np.full((D, B, H), np.nan, dtype), dev)
    f(*[tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs], Y, Yh)
    for _ in range(2):  # relaunch: the double buffer is re-seeded, nothing carries over
        f(*[tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs], Y, Yh)
    tol = TOL32 if dtype == "float32" else TOL
    np.testing.assert_allclose(Y.numpy().astype(np.float64), want[0], **tol)
    np.testing.assert_allclose(Yh.numpy().astype(np.float64), want[1], **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["pmma_gru_forward_h256_b64_lens", "pmma_gru_forward_h1024_b64_lens"])
@pytest.mark.parametrize("seq", [0, 1, 2])
def test_prebuilt_short_sequences(seq, name):
    """0, 1 and 2 steps. dsmem (the first case) has no barrier a step, so a block may leave only when every send
    into its shared memory has landed: with 0 steps only h0 was sent, with 1 nothing after it. early_gate (the
    second) loads step 0's gate_i before the step loop: not with 0 steps (memcheck). Y / Y_h right, Y_h zero
    for a zero-length sequence."""
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    (case,) = [c for c in _gpu_index() if _case_name(c) == name] or [None]
    if case is None:
        pytest.skip(f"no prebuilt case {name} in {PREBUILT}")
    D, B, H, direction, cell, acts, clip, lens, cfg, *dtype = case
    assert pm.MmaConfig.of(cfg).dsmem or pm.MmaConfig.of(cfg).early_gate
    if seq:
        inputs, (want_y, want_yh) = gpu_case_problem(D, B, H, direction, cell, acts, clip, lens, "float16", seq)
    else:
        inputs, _ = make_problem(D, B, H, 1, "float16", 1, seed=3)
        inputs = (inputs[0][:, :0], inputs[1], inputs[2], np.zeros(B, np.int32), inputs[4])
        want_y, want_yh = np.zeros((0, D, B, H)), np.zeros((D, B, H))
    dev = tvm_rt.cuda(0)
    f = tvm_rt.runtime.load_module(str(PREBUILT / "pmma.so"))[_case_name(case)]
    Y = tvm_rt.runtime.tensor(np.full((seq, D, B, H), np.nan, np.float16), dev)
    Yh = tvm_rt.runtime.tensor(np.full((D, B, H), np.nan, np.float16), dev)
    for _ in range(3):
        f(*[tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs], Y, Yh)
    np.testing.assert_allclose(Y.numpy().astype(np.float64), want_y, **TOL)
    np.testing.assert_allclose(Yh.numpy().astype(np.float64), want_yh, **TOL)


if __name__ == "__main__":
    build_gpu_cases(sys.argv[1] if len(sys.argv) > 1 else "out/pmma")


@needs_compiler
@pytest.mark.parametrize("dtype,batch,path", [("float32", 64, "persistent_mma"), ("float32", 96, "per_step"),
                                              ("float16", 32, "persistent_mma"), ("float16", 130, "persistent_wgmma")])
def test_importer_picks_the_path_for_a_gpu_target(dtype, batch, path):
    """from_onnx for the H100 (no GPU needed to build the IRModule): the relax dtype of the node reaches the
    schedule databases as its name (a PrimType there once raised 'not JSON serializable' on every GPU import)."""
    import tvmseq
    from tvmseq import models

    model, _ = models.rnn_node_model("GRU", seq=3, batch=batch, input_size=16, hidden=256, linear_before_reset=1,
                                     dtype=dtype)
    mod = tvmseq.from_onnx(model, target="cuda")
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert any("recurrence" in n for n in names)
    spec_dtype = paths.choose_path(1, batch, 256, dtype, "cuda")[0]
    assert spec_dtype == path


@needs_compiler
def test_config_tuple_round_trip():
    """The compact config tuples of the sweeps, the tuning script and the GPU cases read back the same."""
    for knobs in [(8, 8, 64, 0), (8, 8, 32, 0, 2), (8, 4, 16, 1, 2, 1), (8, 8, 32, 0, 1, 0, 1), (16, 8, 32, 1),
                  (16, 8, 32, 0, 2, 0, 0, 1), (8, 8, 16, 0, 4, 0, 0, 0, 1), (16, 8, 32, 1, 2, 0, 0, 1, 1, 1, 2),
                  (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1), (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1)]:
        assert pm.MmaConfig.of(knobs).knobs() == knobs
    assert pm.MmaConfig.of((8, 8, 64)) == pm.MmaConfig(8, 8, 64)
    assert pm.MmaConfig.of((8, 4, 16, 1, 2, 1)) == pm.MmaConfig(8, 4, 16, pipeline=True, batch_split=2, flags=True)


@needs_compiler
def test_wide_block_rule():
    """float16 GRU at H >= 512: 16-unit blocks, one an SM, split over the batch to fill >= 75% of the SMs."""
    from tvmseq.kernels import recurrent_gemm as rg

    h100 = rg.gpu_facts(resolve("cuda"))
    assert pm.wide_block_config(1, 64, 1024, h100) == pm.MmaConfig(16, 8, 32, False, 2)    # 128 blocks
    assert pm.wide_block_config(1, 64, 512, h100) == pm.MmaConfig(16, 8, 16, False, 4)     # 16 rows split further
    assert pm.wide_block_config(1, 256, 1024, h100) == pm.MmaConfig(16, 8, 32, True, 2)    # 4 chunks: pipelined
    assert pm.wide_block_config(1, 64, 256, h100) is None       # not measured below H 512
    assert pm.wide_block_config(2, 64, 1024, h100) is None      # 128 blocks already: no split
    assert pm.wide_block_config(1, 100, 768, h100) is None      # 96 blocks < 75% of 132 SMs
    # the rule's pick is what default_config returns without a database entry, and it fits the H100
    assert pm.default_config(1, 64, 1024, "cuda", measured=False) == pm.MmaConfig(16, 8, 32, False, 2)
    assert pm.default_config(1, 64, 1024, "cuda", cell="rnn", measured=False).units_per_block == 8   # GRU only


@needs_compiler
def test_geometry_and_argument_errors():
    from tvmseq.kernels import recurrent_gemm as rg

    h100 = rg.gpu_facts(resolve("cuda"))
    geo = lambda cfg, dtype="float32", H=256: pm.MmaGeometry(1, 64, H, 3, cfg, dtype).check(h100)  # noqa: E731
    assert "16 or 32 chunk rows" in geo(pm.MmaConfig(8, 8, 64))
    # float32 chunks of 1-8 rows: with dsmem only (no staging copies), and 32 / rows lane groups over the gate rows
    small = lambda ub, mc, **kw: pm.MmaGeometry(1, 1, 256, 3, pm.MmaConfig(  # noqa: E731
        ub, 8, mc, cluster=256 // ub, cluster_sync=True, **kw), "float32").check(h100)
    assert "only with dsmem" in small(16, 1)
    assert "only with dsmem" in small(16, 1, dsmem=True)                 # 48 gate rows over 32 lanes
    assert small(32, 1, dsmem=True) is None and small(16, 2, dsmem=True) is None
    assert "chunk_rows of 16" in small(16, 3, dsmem=True)
    assert "half_stage is for float32" in geo(pm.MmaConfig(8, 8, 32, half_stage=True), "float16")
    assert "half_stage is for float32" in geo(pm.MmaConfig(8, 8, 32, pipeline=True, half_stage=True))
    assert "batch_split >= 1" in geo(pm.MmaConfig(8, 8, 32, batch_split=0))
    assert "bulk staging copies whole k halves" in geo(pm.MmaConfig(8, 8, 32, half_stage=True, bulk=True))
    assert "staged by bulk copies" in geo(pm.MmaConfig(8, 8, 32, image=True))
    assert "only with the image layout" in geo(pm.MmaConfig(8, 8, 32, bulk=True, cluster=2))
    assert "cluster must be one of (1, 2, 4)" in geo(pm.MmaConfig(8, 8, 32, bulk=True, image=True, cluster=8))
    assert "co-resident" in geo(pm.MmaConfig(16, 8, 32, False, 2, bulk=True, image=True, cluster=4), "float16", 1024)
    assert "do not split into clusters of 4" in geo(pm.MmaConfig(8, 8, 32, bulk=True, image=True, cluster=4), H=200)
    # cluster_sync: the cluster must be exactly a batch group's unit groups (H / units of them), up to 16
    assert "cluster_sync needs the cluster to be the 16 unit groups" in geo(pm.MmaConfig(16, 8, 32, cluster=8,
                                                                                          cluster_sync=True))
    assert "cluster_sync needs the cluster to be the 32 unit groups" in geo(pm.MmaConfig(8, 8, 32, cluster=32,
                                                                                          cluster_sync=True))
    assert "and no flags" in geo(pm.MmaConfig(16, 8, 32, flags=True, cluster=16, cluster_sync=True))
    assert geo(pm.MmaConfig(16, 8, 32, cluster=16, cluster_sync=True)) is None      # no image needed
    assert geo(pm.MmaConfig(32, 8, 16, cluster=8, cluster_sync=True), "float16") is None
    # dsmem: inside a cluster_sync cluster, one chunk a block (all of a block's rows in its two slots), no copies
    assert "dsmem hands the state over inside a cluster" in geo(pm.MmaConfig(16, 8, 32, dsmem=True))
    assert "dsmem keeps one chunk a block" in geo(pm.MmaConfig(16, 8, 16, cluster=16, cluster_sync=True, dsmem=True))
    assert "dsmem keeps one chunk a block" in geo(pm.MmaConfig(16, 8, 32, True, 2, cluster=16, cluster_sync=True,
                                                               dsmem=True))
    assert geo(pm.MmaConfig(16, 8, 32, False, 2, cluster=16, cluster_sync=True, dsmem=True)) is None
    assert "shared memory per block" in geo(pm.MmaConfig(16, 8, 32), H=2048)   # a 48 x 2048 float32 R slice
    assert "192 W operands" in geo(pm.MmaConfig(32, 8, 32))                     # 48 gate rows a lane: spills
    assert "threads x" in geo(pm.MmaConfig(8, 64, 32), "float16", H=1024)      # 64 warps
    with pytest.raises(TvmseqError, match="batch and hidden must be >= 1"):
        pm.persistent_mma_func(1, 0, 64, "float16", "forward", None, None, False, "llvm")
    with pytest.raises(TvmseqError, match="cell must be one of"):
        pm.persistent_mma_func(1, 16, 64, "float16", "forward", None, None, False, "llvm", cell="lstm2")
