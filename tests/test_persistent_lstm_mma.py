"""The LSTM cell of the staged-state persistent kernel (kernels/recurrent/mma.py, cell 'lstm'): its CPU variant
(same seeding, partial sums, gate math and publishing, serial loops) against the float64 ONNX LSTM of
tvmseq.reference.lstm on odd sizes with every feature (directions, peepholes, input_forget, clip, activations,
sequence_lens, fp16 and fp32, batch split, pipelining, bulk / image staging); the path choice of
`paths.lstm_recurrence_auto`; CUDA code generation (nvcc/ptxas: no spills); (marked gpu) kernels
prebuilt for the H100, where the fragment layouts, copies and barriers run.

GPU run, modules built here with the compiler and loaded there with TVM's runtime only:
  python tests/test_persistent_lstm_mma.py out/plstm      # here (the benchmark's --build adds them too)
  TVMSEQ_PLSTM_DIR=out/plstm pytest -m gpu tests/test_persistent_lstm_mma.py   # GPU machine
"""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_persistent_lstm import check, make_problem, reference  # noqa: E402

from tvmseq.errors import TvmseqError  # noqa: E402

try:  # the kernel factories need TVM's compiler; the gpu test only its runtime
    import tvm

    from tvmseq.kernels.activations import Activation
    from tvmseq.kernels.recurrent import paths
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.kernels.recurrent.cells import FAST_MATH_DTYPES, LstmCell
    from tvmseq.targets import resolve
except ImportError:
    pm = None
needs_compiler = pytest.mark.skipif(pm is None, reason="TVM compiler not available")

PREBUILT = Path(os.environ.get("TVMSEQ_PLSTM_DIR", "out/plstm"))


def kernel(D, B, H, dtype, direction, acts, clip, lens, input_forget, peepholes, target, config, fast_math=None):
    names = [Activation.make(a) for a in acts] * (D if len(acts) == 3 else 1) if acts else None
    return pm.persistent_mma_func(D, B, H, dtype, direction, names, clip, lens, target, config, "lstm",
                                  LstmCell(bool(input_forget), bool(peepholes)), fast_math)


def run_cpu(inputs, seq, D, B, H, dtype, direction, acts, clip, lens, input_forget, peepholes, config):
    func = kernel(D, B, H, dtype, direction, acts, clip, lens, input_forget, peepholes, "llvm", config)
    name = func.attrs["global_symbol"]
    f = tvm.compile(tvm.IRModule({name: func}), target="llvm")[name]
    outs = [tvm.runtime.tensor(np.full(shape, np.nan, dtype))   # poisoned: every element must be written
            for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
    kernel_in = list(inputs)
    if not peepholes:
        kernel_in[2] = np.zeros_like(inputs[2])
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in kernel_in], *outs)
    return [o.numpy() for o in outs]


# (D, B, H, dtype, direction, acts, clip, has_seq_lens, input_forget, peepholes, config knobs)
CPU_CASES = [
    (2, 19, 37, "float16", "bidirectional", None, 0.9, True, 0, True, (8, 2, 16)),        # padded units, k, rows
    (1, 33, 50, "float16", "reverse", None, None, True, 1, True, (8, 3, 32)),            # ragged chunks, 3 warps
    (1, 45, 40, "float16", "forward", None, None, True, 0, False, (16, 1, 16, 1, 3)),    # split 3, pipelined
    (2, 37, 48, "float16", "bidirectional", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 0, True,
     (8, 3, 16, 0, 2, 0, 0, 0, 1, 1, 2)),                                                # image, cluster 2
    (1, 3, 29, "float16", "forward", None, None, False, 0, True, (16, 2, 16, 0, 1, 0, 0, 1, 0, 0, 2, 1, 1)),  # dsmem
    (2, 37, 29, "float32", "bidirectional", None, None, True, 0, True, (8, 2, 16, 0, 2)),  # FMA product, split
    (1, 19, 67, "float32", "reverse", None, 0.7, True, 1, False, (8, 4, 32, 0, 1, 0, 1)),  # half_stage
    (2, 19, 100, "float32", "bidirectional", None, None, True, 0, True,
     (8, 4, 16, 0, 2, 0, 0, 0, 0, 0, 13, 1, 1)),                                     # lstm_cluster_config's pick
    (1, 11, 70, "float16", "forward", None, None, True, 0, True,
     (32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1, 4)),                         # n split: 2 k-groups x 4 warps
    (2, 9, 45, "float16", "bidirectional", None, 0.8, True, 1, False,
     (16, 4, 16, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1, 2)),                         # n split 2, padded units and k
    (1, 21, 45, "float16", "reverse", None, None, True, 0, True,
     (8, 4, 16, 0, 2, 0, 0, 0, 0, 0, 6, 1, 1, 4)),                          # n split 4: one k-group of 4 warps
    # gate_m (gate rows as the mma's M): 8-row chunks, ragged batch, n split, no split, the grid-barrier hand-off
    (1, 7, 70, "float16", "forward", None, None, True, 0, True,
     (32, 8, 8, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1, 4, 1)),
    (2, 13, 45, "float16", "bidirectional", None, 0.8, True, 1, False,
     (16, 4, 8, 0, 2, 0, 0, 0, 0, 0, 3, 1, 1, 2, 1)),
    (1, 17, 40, "float16", "reverse", None, None, True, 0, True, (8, 2, 16, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1)),
    # batch 1 in clusters (the measured database's picks at hidden 128-512, batch 1): 15 of 16 / 7 of 8 rows padding
    (1, 1, 45, "float16", "forward", None, None, True, 0, True, (16, 4, 16, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1, 4)),
    (2, 1, 45, "float16", "bidirectional", None, 0.9, True, 1, True, (16, 4, 8, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1, 2, 1)),
    # float32 chunks of fewer than 16 rows (dsmem): batch 1, and 3 rows in a 4-row chunk
    (1, 1, 45, "float32", "forward", None, None, True, 0, True, (16, 4, 1, 0, 1, 0, 0, 0, 0, 0, 3, 1, 1)),
    (2, 3, 29, "float32", "bidirectional", None, 0.8, True, 1, False, (8, 2, 4, 0, 1, 0, 0, 0, 0, 0, 4, 1, 1)),
]


def _case_id(case):
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, knobs = case
    return (f"{direction}_{dtype}_h{H}_b{B}{'_lens' if lens else ''}{'_if' if input_forget else ''}"
            f"{'_peep' if peep else ''}{'_clip' if clip else ''}_{'-'.join(map(str, knobs))}")


@needs_compiler
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_matches_reference(case):
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, knobs = case
    seq = 5
    inputs, onnx = make_problem(D, B, H, seq, dtype, seed=H * 7 + B, lens_kind="random" if lens else "full")
    got = run_cpu(inputs, seq, D, B, H, dtype, direction, acts, clip, lens, input_forget, peep,
                  pm.MmaConfig.of(knobs))
    names = [Activation.make(a) for a in acts] * D if acts else None
    check(got, reference(onnx, direction, inputs[3], names, clip, input_forget, peep, has_seq_lens=lens), dtype)


# ---- the path choice --------------------------------------------------------------------------------


def _spec(D, B, H, dtype="float16", **kw):
    from tvmseq.kernels.recurrent import lstm

    return lstm.LstmSpec(D, B, H, 16, dtype, "bidirectional" if D == 2 else "forward", **kw)


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,path", [
    (1, 64, 512, "float16", "persistent_mma"), (2, 256, 128, "float16", "persistent_mma"),
    (1, 8, 256, "float16", "persistent_mma"),    # the GRU database: the staged kernel beat the engine there
    (1, 64, 256, "float32", "persistent_mma"),
    (1, 8, 512, "float16", "persistent_mma"),    # the n split: measured faster than the engine (database)
    (1, 8, 512, "float32", "persistent"), (1, 256, 1024, "float32", "per_step"),
    (1, 19, 100, "float32", "persistent_mma"), (2, 67, 37, "float16", "persistent_mma"),   # lstm_cluster_config
    (1, 8, 128, "float32", "persistent_mma"),    # the LSTM's own sweep: the staged kernel beat the engine there
    (1, 7, 100, "float32", "persistent_mma"),    # float32 at batch <= 8: a cluster a batch row
    (1, 3, 37, "float32", "persistent_mma"), (2, 3, 100, "float32", "persistent_mma"),
    (2, 5, 128, "float32", "persistent"),        # 2 x 16 x 5 blocks: more than the SMs, the engine
    (2, 8, 256, "float32", "persistent"),        # the rule's 16-unit blocks do not fit fp32 registers: engine
])
def test_path_choice(D, B, H, dtype, path):
    cuda = resolve("cuda")
    func, got, why = paths.lstm_recurrence_auto(_spec(D, B, H, dtype, has_peepholes=True), cuda)
    assert got == path, why
    if path == "persistent_mma":
        assert func.attrs["global_symbol"] == "lstm_recurrence_mma" and len(func.params) == 9
        assert "kernel" in why or "measured fastest" in why


@needs_compiler
def test_requested_mma_path_and_configs():
    cuda = resolve("cuda")
    func, path, _ = paths.lstm_recurrence_auto(_spec(1, 5, 37, "float32"), "llvm", path="persistent_mma")
    assert path == "persistent_mma" and len(func.params) == 9   # the CPU variant on request
    # an MmaConfig asks for the staged kernel, a config that cannot run says why
    _, path, _ = paths.lstm_recurrence_auto(_spec(1, 64, 512), cuda, config=pm.MmaConfig(8, 8, 32))
    assert path == "persistent_mma"
    _, path, why = paths.lstm_recurrence_auto(_spec(1, 64, 512), cuda, config=pm.MmaConfig(12, 8, 32))
    assert path == "per_step" and "multiple of 8" in why
    # the LSTM config derived from the GRU's pick fits with 4 gate rows a unit
    from tvmseq.kernels.recurrent_gemm import gpu_facts

    for D, B, H in ((1, 64, 1024), (1, 256, 1024), (2, 64, 256)):
        cfg = pm.default_config(D, B, H, cuda, "lstm")
        assert pm.MmaGeometry(D, B, H, 4, cfg).check(gpu_facts(cuda)) is None, (D, B, H, cfg)


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,knobs", [
    (1, 8, 128, "float16", (8, 4, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 4)),   # one cluster of 16 blocks, the n split
    (1, 8, 128, "float32", (8, 4, 1, 0, 8, 0, 0, 0, 0, 0, 16, 1, 1)),       # float32: a cluster a batch row
    (1, 3, 37, "float32", (8, 4, 1, 0, 3, 0, 0, 0, 0, 0, 5, 1, 1)),
    (2, 8, 64, "float32", (8, 4, 1, 0, 8, 0, 0, 0, 0, 0, 8, 1, 1)),         # 2 x 8 x 8 = 128 blocks
    (2, 8, 128, "float32", (8, 4, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)),      # 256 blocks: one 8-row cluster a direction
    (1, 5, 256, "float32", None),                                           # 32 groups of 8 units: past a cluster
    (1, 256, 128, "float16", (8, 4, 16, 0, 16, 0, 0, 0, 0, 0, 16, 1, 1, 4)),  # 256 blocks: two an SM
    (2, 256, 128, "float16", (16, 8, 16, 0, 16, 0, 0, 0, 0, 0, 8, 1, 1, 4)),  # 8 units a block would need 512 blocks
    (1, 9, 200, "float16", (16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1, 4)),
    (1, 19, 100, "float32", (8, 4, 16, 0, 2, 0, 0, 0, 0, 0, 13, 1, 1)),
    (2, 67, 37, "float16", (8, 4, 16, 0, 5, 0, 0, 0, 0, 0, 5, 1, 1, 4)),
    (1, 8, 512, "float16", (32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 4)),  # 32 units, warps split k 2 x gate rows 4
    (2, 13, 257, "float16", (32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 9, 1, 1, 4)),  # 17 groups of 16 units: 9 of 32
    (1, 8, 512, "float32", None),                                           # 32-unit blocks: float16 only
    (1, 7, 128, "float16", None), (1, 24, 512, "float16", None), (1, 8, 600, "float16", None),  # batch below 8 /
    (2, 1024, 256, "float16", None),                # above 16 for 32 units, 19 groups, too many blocks
])
def test_lstm_cluster_config(D, B, H, dtype, knobs):
    """The small-hidden LSTM rule (measured winners of schedules/plstm_sweep.py): its configs fit the H100."""
    from tvmseq.kernels.recurrent_gemm import gpu_facts

    facts = gpu_facts(resolve("cuda"))
    cfg = pm.lstm_cluster_config(D, B, H, facts, dtype)
    assert (cfg.knobs() if cfg else None) == knobs
    if cfg:
        assert pm.MmaGeometry(D, B, H, 4, cfg, dtype).check(facts) is None
    for dtype in ("float16", "float32"):   # where the rule's pick does not fit (fp32 registers), the next rule's does
        picked = pm.default_config(D, B, H, resolve("cuda"), "lstm", measured=False, dtype=dtype)
        assert picked is None or pm.MmaGeometry(D, B, H, 4, picked, dtype).check(facts) is None, dtype


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype,cell,swapped", [
    (1, 8, 512, "float16", "lstm", True), (2, 8, 512, "float16", "lstm", True), (1, 8, 1024, "float16", "lstm", True),
    (1, 8, 256, "float16", "lstm", False),    # hidden 256: level in the sweep, the unswapped pick stays
    (1, 16, 512, "float16", "lstm", False),   # past batch 8 a 16-row chunk is no padding
    (1, 64, 512, "float32", "lstm", False), (1, 8, 512, "float16", "gru", False)])
def test_gate_m_rule(D, B, H, dtype, cell, swapped):
    """float16 LSTMs at batch <= 8 from hidden 512 run with the gate rows as the mma's M in 8-row chunks."""
    cfg = pm.default_config(D, B, H, resolve("cuda"), cell, dtype=dtype)
    assert cfg is not None and cfg.gate_m == swapped and (cfg.chunk_rows == 8) == swapped, cfg


@needs_compiler
def test_rejects_bad_arguments():
    with pytest.raises(TvmseqError, match="LSTM update math given for cell 'gru'"):
        pm.persistent_mma_func(1, 16, 64, "float16", "forward", None, None, False, "llvm", None, "gru", LstmCell())
    with pytest.raises(TvmseqError, match="needs 3 Activation"):
        pm.persistent_mma_func(1, 16, 64, "float16", "forward", [Activation.make("Tanh")], None, False, "llvm",
                               None, "lstm")
    from tvmseq.kernels.recurrent import wgmma as pw

    with pytest.raises(TvmseqError, match="cell must be one of"):
        pw.persistent_wgmma_func(1, 256, 256, "float16", "forward", None, None, False, "cuda", cell="lstm2")
    # the n split: a divisor of the warps and of the block's n8 tiles, float16 with the dsmem hand-off only
    split = lambda **kw: pm.MmaConfig(32, 8, 16, cluster=4, cluster_sync=True, dsmem=True, **kw)  # noqa: E731
    for cfg, dtype, why in [(split(n_split=3), "float16", "n_split must divide the warps"),
                            (pm.MmaConfig(32, 8, 16, n_split=2), "float16", "n_split is for the float16 product"),
                            (split(n_split=2), "float32", "n_split is for the float16 product"),
                            (pm.MmaConfig(8, 4, 8, gate_m=True), "float32", "gate_m is for the float16 product"),
                            (pm.MmaConfig(8, 4, 8, cluster=13, cluster_sync=True, dsmem=True, n_split=4, gate_m=True),
                             "float16", "even number of n8 tiles"),
                            (pm.MmaConfig(8, 4, 12), "float16", "chunk_rows of 16"),
                            (pm.MmaConfig(8, 4, 16, k_chains=2), "float16", "k_chains is 1 or 2, and 2 only with gate_m"),
                            (pm.MmaConfig(8, 4, 8, gate_m=True, k_chains=3), "float16", "k_chains is 1 or 2")]:
        with pytest.raises(TvmseqError, match=why):
            pm.persistent_mma_func(1, 8, 100, dtype, "forward", None, None, False, "llvm", cfg, "lstm")


# ---- CUDA code generation ---------------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("D,B,H,dtype", [(1, 64, 1024, "float16"), (2, 64, 256, "float16"), (1, 64, 512, "float32"),
                                         (1, 8, 1024, "float16")])   # gate_m
def test_cuda_codegen(D, B, H, dtype):
    """The default config of a benchmark cell builds for the H100: tensor-core (fp16) instructions, the cell
    state never written to global memory except Y_c, and (with nvcc) no spills."""
    tgt = resolve("cuda")
    func = kernel(D, B, H, dtype, "bidirectional" if D == 2 else "forward", None, 0.9, True, 0, True, tgt, None)
    src = tvm.compile(tvm.IRModule({"k": func}), target=tgt).mod.imports[0].inspect_source()
    if dtype == "float16":
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    # the gates on CUDA's fast intrinsics (cells.FAST_MATH_DTYPES); a CPU variant keeps the accurate functions
    fast = dtype in FAST_MATH_DTYPES
    assert ("__expf(" in src and "__fdividef(" in src) == fast
    assert ("tanhf(" in src.replace("htanh, tanhf", "")) == (not fast)
    accurate = kernel(D, B, H, dtype, "bidirectional" if D == 2 else "forward", None, 0.9, True, 0, True, tgt, None,
                      fast_math=False)
    src = tvm.compile(tvm.IRModule({"k": accurate}), target=tgt).mod.imports[0].inspect_source()
    assert "__expf(" not in src and "tanhf(" in src.replace("htanh, tanhf", "")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


# ---- GPU (prebuilt kernels) -------------------------------------------------------------------------

# the cases live with the benchmark's build (`--build DIR` builds them beside its own test kernels)
from tvmseq.bench.persistent_lstm import MMA_TEST_CASES, MMA_TEST_INDEX, MMA_TEST_LIBRARY  # noqa: E402
from tvmseq.bench.persistent_lstm import mma_test_name as gpu_case_name  # noqa: E402


def test_gpu_case_names_are_unique():
    names = [gpu_case_name(case) for case in MMA_TEST_CASES]
    assert len(set(names)) == len(names)


def _gpu_index():
    index = PREBUILT / MMA_TEST_INDEX
    return [tuple(c) for c in json.loads(index.read_text())["cases"]] if index.exists() else []


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_index(), ids=gpu_case_name)
def test_prebuilt_on_gpu(case):
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, knobs = case
    seq = 23
    inputs, onnx = make_problem(D, B, H, seq, dtype, seed=B + H, lens_kind="random" if lens else "full")
    kernel_in = list(inputs)
    if not peep:
        kernel_in[2] = np.zeros_like(inputs[2])
    dev = tvm_rt.cuda(0)
    f = tvm_rt.runtime.load_module(str(PREBUILT / MMA_TEST_LIBRARY))[gpu_case_name(case)]
    outs = [tvm_rt.runtime.tensor(np.full(shape, np.nan, dtype), dev)
            for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
    args = [tvm_rt.runtime.tensor(np.ascontiguousarray(a), dev) for a in kernel_in]
    for _ in range(3):   # relaunches: the state buffers are re-seeded, nothing carries over
        f(*args, *outs)
    from tvmseq.kernels.activations import Activation as Act

    names = [Act.make(a) for a in acts] * D if acts else None
    check([o.numpy() for o in outs], reference(onnx, direction, inputs[3], names, clip, input_forget, peep,
                                               has_seq_lens=lens), dtype)


if __name__ == "__main__":
    from tvmseq.bench.persistent_lstm import build_mma_tests

    build_mma_tests(sys.argv[1] if len(sys.argv) > 1 else "out/plstm")
