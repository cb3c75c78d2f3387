"""The LSTM cell of the warpgroup persistent kernel (kernels/recurrent/wgmma.py, cell 'lstm'): its CPU variant
(same seeding, image-layout state, accumulator-layout items, LSTM gate math; the product as serial float32 sums)
against the float64 ONNX LSTM of tvmseq.reference.lstm on odd sizes with every feature (directions, peepholes,
input_forget, clip, activations, sequence_lens, chunks and batch splits); the geometry (the state-tile ring that
lets 16-unit LSTM blocks hold their R slice at hidden 1024); the path choice of `paths.lstm_recurrence_auto`; CUDA code
generation (wgmma, the ring's refills, nvcc/ptxas: no spills); (marked gpu) kernels prebuilt for the H100, where
the descriptors, bulk copies, ring and barriers run.

GPU run, modules built here with the compiler and loaded there with TVM's runtime only:
  python tests/test_persistent_lstm_wgmma.py out/plstm_wg                          # here
  TVMSEQ_PLSTM_WG_DIR=out/plstm_wg pytest -m gpu tests/test_persistent_lstm_wgmma.py   # GPU machine
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
    from tvmseq.kernels.recurrent import wgmma as pw
    from tvmseq.kernels.recurrent.cells import LstmCell
    from tvmseq.targets import resolve
except ImportError:
    pw = None
needs_compiler = pytest.mark.skipif(pw is None, reason="TVM compiler not available")

PREBUILT = Path(os.environ.get("TVMSEQ_PLSTM_WG_DIR", "out/plstm_wg"))
LIBRARY, INDEX = "plstm_wgmma_tests.so", "plstm_wgmma_index.json"


def _acts(acts, D):
    """Activation objects for every direction from 3 names (both directions) or 3 x D names; None: defaults."""
    return [Activation.make(a) for a in acts] * (D if len(acts) == 3 else 1) if acts else None


def kernel(case, target):
    D, B, H, direction, acts, clip, lens, input_forget, peep, knobs = case
    return pw.persistent_wgmma_func(D, B, H, "float16", direction, _acts(acts, D), clip, lens, target,
                                    pw.WgmmaRecConfig.of(knobs) if knobs else None, "lstm",
                                    lstm=LstmCell(bool(input_forget), bool(peep)))


def kernel_inputs(inputs, peep):
    """The kernel's arguments: zero peepholes when the node has none."""
    args = list(inputs)
    if not peep:
        args[2] = np.zeros_like(inputs[2])
    return [np.ascontiguousarray(a) for a in args]


def want(case, inputs, onnx):
    D, B, H, direction, acts, clip, lens, input_forget, peep, knobs = case
    return reference(onnx, direction, inputs[3], _acts(acts, D), clip, input_forget, peep, has_seq_lens=lens)


# (D, B, H, direction, acts, clip, has_seq_lens, input_forget, has_peepholes, WgmmaRecConfig knobs or None)
CPU_CASES = [
    (2, 19, 37, "bidirectional", None, 0.9, True, 0, True, (8, 1)),                  # padded units, k, rows
    (1, 70, 72, "reverse", None, None, True, 1, True, (16, 1)),                      # 2 k tiles, 2 chunks, 4.5 groups
    (1, 130, 40, "forward", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 0, False, (8, 2)),   # 3 -> 4 chunks, split
    (2, 5, 24, "bidirectional", ("Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Softsign", "Relu"), None, False, 0, True,
     (8, 1)),                                                                         # per-direction activations
]


def _case_id(case):
    D, B, H, direction, acts, clip, lens, input_forget, peep, knobs = case
    return (f"plstm_wg_{direction}_h{H}_b{B}{'_lens' if lens else ''}{'_if' if input_forget else ''}"
            f"{'_peep' if peep else ''}{'_clip' if clip else ''}{'_acts' if acts else ''}_"
            + "_".join(map(str, knobs or ("default",))))


@needs_compiler
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_matches_reference(case):
    D, B, H = case[:3]
    seq = 4
    inputs, onnx = make_problem(D, B, H, seq, "float16", seed=H * 7 + B, lens_kind="random" if case[6] else "full")
    func = kernel(case, "llvm")
    f = tvm.compile(tvm.IRModule({"k": func}), target="llvm")[func.attrs["global_symbol"]]
    outs = [tvm.runtime.tensor(np.full(shape, np.nan, np.float16))   # poisoned: every element must be written
            for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
    f(*[tvm.runtime.tensor(a) for a in kernel_inputs(inputs, case[8])], *outs)
    check([o.numpy() for o in outs], want(case, inputs, onnx), "float16")


# ---- geometry, configs and the path choice ------------------------------------------------------------------


@needs_compiler
def test_geometry_and_configs():
    from tvmseq.kernels import recurrent_gemm as rg

    cuda = resolve("cuda")
    h100 = rg.gpu_facts(cuda)
    geo = lambda cfg, D=2, B=64, H=1024: pw.WgmmaRecGeometry(D, B, H, 4, cfg).check(h100)  # noqa: E731
    # 16 LSTM units: a 128 KB R slice; with the whole 128 KB state chunk it does not fit, with a ring of 8 tiles it does
    assert "shared memory" in geo(pw.WgmmaRecConfig(16, 1))
    assert geo(pw.WgmmaRecConfig(16, 1, 8)) is None
    assert geo(pw.WgmmaRecConfig(16, 1, 12)) is None                 # a ring need not divide the 16 k-tiles
    assert "shared memory" in geo(pw.WgmmaRecConfig(16, 1, 13))
    assert "state_tiles must be 0 or 2 .. the 16 k-tiles" in geo(pw.WgmmaRecConfig(16, 1, 1))
    assert "state_tiles must be 0 or 2 .. the 16 k-tiles" in geo(pw.WgmmaRecConfig(16, 1, 17))
    # 2 x 128 unit groups: two blocks an SM, which the whole state chunk does not leave room for; a ring of 4 does
    assert "(2 block(s) an SM)" in geo(pw.WgmmaRecConfig(8, 1))
    assert geo(pw.WgmmaRecConfig(8, 1, 4)) is None
    assert "not all resident" in geo(pw.WgmmaRecConfig(8, 2, 4))         # 512 blocks
    # the rule keeps one block an SM; the measured database picks two where they were measured faster
    assert pw.default_config(2, 64, 1024, cuda, "lstm").units_per_block == 16
    rule = pw.default_config(2, 256, 512, cuda, "lstm", measured=False)
    assert rule == pw.WgmmaRecConfig(16, 2) and geo(rule, B=256, H=512) is None
    picked = pw.default_config(2, 256, 512, cuda, "lstm")
    assert picked == pw.WgmmaRecConfig(16, 4, 3)   # schedules/measured/persistent_wgmma.json: 7.2 against 8.0 us
    assert pw.WgmmaRecGeometry(2, 256, 512, 4, picked).per_sm(h100) == 2
    assert pw.default_config(2, 256, 512, "llvm", "lstm", measured=True) == rule   # no database on the CPU
    assert pw.WgmmaRecConfig.of((16, 1, 8)).knobs() == (16, 1, 8) and pw.WgmmaRecConfig(16, 1).knobs() == (16, 1)
    assert pw.default_config(2, 64, 1024, cuda, "lstm") == pw.WgmmaRecConfig(16, 1, 8)
    assert pw.default_config(2, 256, 512, cuda, "lstm", measured=False) == pw.WgmmaRecConfig(16, 2)
    # the GRU's configs are unchanged (no ring)
    assert pw.default_config(2, 256, 1024, cuda) == pw.WgmmaRecConfig(16, 1)
    # the LSTM's registers: its cell state, peepholes and temporaries counted on top of the GRU's
    lstm = pw.WgmmaRecGeometry(2, 256, 1024, 4, pw.WgmmaRecConfig(16, 1, 8))
    gru4 = pw.WgmmaRecGeometry(2, 256, 1024, 3, pw.WgmmaRecConfig(16, 1))
    assert lstm.regs_estimate() - gru4.regs_estimate() == 8 + lstm.NCB * 8 + 3 * 8 + 8
    assert pw.supported(2, 64, 1024, "float16", 1, cuda, "lstm")[0]
    assert "measured faster" in pw.supported(1, 64, 1024, "float16", 1, cuda, "lstm")[1]
    assert "float16" in pw.supported(1, 256, 1024, "float32", 1, cuda, "lstm")[1]


def _spec(D, B, H, dtype="float16", **kw):
    from tvmseq.kernels.recurrent import lstm

    return lstm.LstmSpec(D, B, H, 16, dtype, "bidirectional" if D == 2 else "forward", **kw)


@needs_compiler
@pytest.mark.parametrize("D,B,H,path", [
    (2, 64, 1024, "persistent_wgmma"),    # measured on the H100: 9.5 us a step against the per-step path's 39.0
    (1, 128, 512, "persistent_wgmma"), (2, 128, 256, "persistent_wgmma"),   # not measured: the GRU's rule
    (2, 256, 512, "persistent_wgmma"),    # measured: 12.8 against the staged kernel's 14.0
    (2, 256, 128, "persistent_mma"),      # measured: the staged kernel 4.26 against 4.32
    (1, 64, 512, "persistent_mma"),
])
def test_path_choice(D, B, H, path):
    cuda = resolve("cuda")
    func, got, why = paths.lstm_recurrence_auto(_spec(D, B, H, has_peepholes=True), cuda)
    assert got == path, why
    if path == "persistent_wgmma":
        assert func.attrs["global_symbol"] == "lstm_recurrence_wgmma" and len(func.params) == 9
        assert "warpgroup" in why or "measured fastest" in why


@needs_compiler
def test_requested_path_and_bad_arguments():
    cuda = resolve("cuda")
    func, path, _ = paths.lstm_recurrence_auto(_spec(1, 5, 37), "llvm", path="persistent_wgmma")
    assert path == "persistent_wgmma" and len(func.params) == 9   # the CPU variant on request
    _, path, _ = paths.lstm_recurrence_auto(_spec(1, 256, 512), cuda, config=pw.WgmmaRecConfig(8, 2))
    assert path == "persistent_wgmma"
    _, path, why = paths.lstm_recurrence_auto(_spec(2, 64, 1024), cuda, config=pw.WgmmaRecConfig(16, 1))
    assert path == "per_step" and "shared memory" in why
    with pytest.raises(TvmseqError, match="dtype must be float16"):
        paths.lstm_recurrence_auto(_spec(1, 256, 512, "float32"), cuda, path="persistent_wgmma")
    with pytest.raises(TvmseqError, match="LSTM update math given for cell 'gru'"):
        pw.persistent_wgmma_func(1, 256, 256, "float16", "forward", None, None, False, "llvm", cell="gru",
                                 lstm=LstmCell())
    with pytest.raises(TvmseqError, match="needs 3 Activation"):
        pw.persistent_wgmma_func(1, 256, 256, "float16", "forward", [Activation.make("Tanh")], None, False, "llvm",
                                 cell="lstm")


# ---- CUDA code generation ---------------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("D,B,H", [(2, 256, 1024), (1, 256, 512)])
def test_cuda_codegen(D, B, H):
    """The default config builds for the H100: wgmma with N = 4 x units, bulk copies (the ring's refills where it
    has one), the grid barrier, the cell state written to global memory only as Y_c, and (with nvcc) no spills.
    bi H1024 B256 is the register worst case (16-unit blocks, 4 chunks a block, each item's h and c)."""
    tgt = resolve("cuda")
    cfg = pw.default_config(D, B, H, tgt, "lstm")
    geo = pw.WgmmaRecGeometry(D, B, H, 4, cfg)
    case = (D, B, H, "bidirectional" if D == 2 else "forward", None, 0.9, True, 0, True, cfg.knobs())
    src = tvm.compile(tvm.IRModule({"k": kernel(case, tgt)}), target=tgt).mod.imports[0].inspect_source()
    for needle in (f"wgmma.mma_async.sync.aligned.m64n{geo.N}k16.f32.f16.f16", "cp.async.bulk.shared::cta.global",
                   "cg::this_grid().sync()", "Yc_ptr", "Pw_ptr"):
        assert needle in src, needle
    assert ("wgmma.wait_group.sync.aligned 1" in src) == geo.RING
    # descriptors: two base encodes (plus the helper's definition), each wgmma's a base plus its tile's offset
    assert src.count("ptx_wgmma_encode_matrix_descriptor(") == 3
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


# ---- GPU (prebuilt kernels) -------------------------------------------------------------------------

GPU_CASES = [
    (1, 131, 257, "forward", None, None, True, 0, True, None),                        # padded units, k, rows
    (2, 67, 1000, "bidirectional", None, 0.9, True, 1, True, None),                   # ring of 8, one chunk
    (2, 256, 1024, "bidirectional", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 0, True, None),  # ring, 4 chunks
    (1, 256, 1024, "forward", None, None, True, 0, False, None),                      # ring, split 2
    (2, 150, 256, "bidirectional", None, None, True, 1, True, (8, 1)),                # 3 chunks a block
    (1, 200, 512, "reverse", None, None, True, 0, True, (16, 2, 2)),                  # ring of 2: 4 tiles a slot
    (2, 256, 1024, "bidirectional", None, None, True, 0, True, (16, 1, 12)),          # ring of 12: 2 or 1 a slot
    (1, 200, 640, "forward", None, 0.9, True, 1, True, (16, 2, 4)),                   # ring of 4 over 10 tiles
    (2, 256, 1024, "bidirectional", None, None, True, 0, True, (16, 1, 4, 2)),        # 2 warpgroups, 2 chunks each
    (2, 250, 257, "bidirectional", None, 0.9, True, 1, True, (16, 1, 2, 2)),          # 2 warpgroups, ragged chunk
    (2, 128, 512, "bidirectional", ("Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Softsign", "Relu"), None, False, 0,
     True, None),
]


def test_gpu_case_names_are_unique():
    names = [_case_id(case) for case in GPU_CASES]
    assert len(set(names)) == len(names)


def build_gpu_cases(out_dir):
    """GPU_CASES into out_dir/LIBRARY + INDEX (the cases and ptxas numbers)."""
    from tvmseq.measure import compile_for_gpu

    tgt = resolve("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {_case_id(c): kernel(c, tgt).with_attr("global_symbol", _case_id(c)) for c in GPU_CASES}
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / LIBRARY))
    (out / INDEX).write_text(json.dumps({"cases": GPU_CASES, "ptxas": report}, indent=1))
    print(f"built {len(funcs)} warpgroup LSTM test kernels into {out / LIBRARY}; ptxas: {report}")


def _gpu_index():
    index = PREBUILT / INDEX
    return [tuple(c) for c in json.loads(index.read_text())["cases"]] if index.exists() else []


@pytest.mark.gpu
@pytest.mark.parametrize("case", _gpu_index(), ids=_case_id)
def test_prebuilt_on_gpu(case):
    import tvm as tvm_rt

    from tvmseq.measure import cuda_available

    if not cuda_available():
        pytest.skip("no CUDA GPU")
    D, B, H = case[:3]
    seq = 23
    inputs, onnx = make_problem(D, B, H, seq, "float16", seed=B + H, lens_kind="random" if case[6] else "full")
    dev = tvm_rt.cuda(0)
    f = tvm_rt.runtime.load_module(str(PREBUILT / LIBRARY))[_case_id(case)]
    outs = [tvm_rt.runtime.tensor(np.full(shape, np.nan, np.float16), dev)
            for shape in ((seq, D, B, H), (D, B, H), (D, B, H))]
    args = [tvm_rt.runtime.tensor(a, dev) for a in kernel_inputs(inputs, case[8])]
    for _ in range(3):   # relaunches: the state buffers are re-seeded, nothing carries over
        f(*args, *outs)
    check([o.numpy() for o in outs], want(case, inputs, onnx), "float16")


if __name__ == "__main__":
    build_gpu_cases(sys.argv[1] if len(sys.argv) > 1 else "out/plstm_wg")
