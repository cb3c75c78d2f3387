"""Pipelined GRU stack (one persistent kernel for all layers): the serial CPU variant against a float64
numpy stack of GRU layers, the schedule choice, and CUDA code generation (ptxas: no spills)."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
from tvmseq.bench.gru_stack import numpy_stack, stack_inputs as make_inputs  # noqa: E402
from tvmseq.errors import TvmseqError  # noqa: E402
from tvmseq.kernels.recurrent import rows as pr  # noqa: E402
from tvmseq.kernels.recurrent import stack as ps  # noqa: E402


@pytest.mark.parametrize("L,B,H,T_", [(1, 3, 5, 4), (2, 1, 13, 7), (3, 5, 7, 6), (4, 2, 9, 5)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_stack_matches_numpy(L, B, H, T_, dtype):
    """The k-split engine (for two or more layers the default is the row-split schedule, tested below)."""
    _check_stack(L, B, H, T_, dtype, ps.default_stack_config(L, B, H, dtype, "llvm"), seed=0)


def _check_stack(L, B, H, T_, dtype, config, seed):
    """The serial CPU variant of the stack kernel with `config` against the float64 numpy stack."""
    f = ps.stacked_gru_func(L, B, H, dtype, "llvm", config=config)
    mod = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    inputs = make_inputs(L, B, H, T_, dtype, seed=seed)
    outs = [np.zeros((L, T_, B, H), dtype), np.zeros((L, B, H), dtype)]
    args = [tvm.runtime.tensor(a) for a in (*inputs, *outs)]
    mod["gru_stack"](*args)
    want = numpy_stack(*inputs)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(args[6].numpy(), want, **tol)
    np.testing.assert_allclose(args[7].numpy(), want[:, -1], **tol)


def test_stack_config_and_errors():
    from tvmseq.targets import resolve

    assert isinstance(ps.default_config(4, 8, 512, "float32", resolve("cuda")), pr.RowSplitConfig)
    assert not isinstance(ps.default_config(1, 8, 512, "float32", resolve("cuda")), pr.RowSplitConfig)
    cfg = ps.default_stack_config(4, 8, 512, "float32", resolve("cuda"))
    assert cfg.num_blocks * 4 <= 132 and cfg.num_blocks * (ps._geometry(8, 512, cfg, True).U) >= 512
    assert ps.fits_on_chip(4, 8, 512, "float32", "cuda")[0]
    ok, why = ps.fits_on_chip(4, 8, 2048, "float32", "cuda")
    assert not ok and "no pipelined configuration" in why
    with pytest.raises(TvmseqError, match="slots"):
        ps.stacked_gru_func(2, 2, 8, "float32", "llvm", slots=1)
    with pytest.raises(TvmseqError, match="dtype"):
        ps.stacked_gru_func(2, 2, 8, "int8", "llvm")


def test_stack_cuda_builds_without_spills():
    """CUDA codegen for the H100 without a GPU: cooperative launch, the LL and progress primitives, and
    (when nvcc is installed) ptxas reports no spills for sm_90a. The source is compiled by nvcc here,
    not through TVM's compile callback (registering that in the test process breaks later CUDA builds)."""
    from tvmseq.cuda_toolchain import ptxas_report
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    f = ps.stacked_gru_func(4, 8, 512, "float32", tgt)
    assert "tirx.use_cooperative_launch" in list(f.attrs["tirx.kernel_launch_params"])
    src = tvm.compile(tvm.IRModule({"gru_stack": f}), target=tgt).mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "st.release.gpu.global.b32", "ld.acquire.gpu.global.b32",
                   "__all_sync", "st.relaxed.gpu.global.b64"):
        assert needle in src, needle
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["registers"] <= 255, info


# ----------------------------------------------------------------------------------------------------
# Row-split schedule (kernels/recurrent/rows.py): same interface, warps own units, lanes split k
# ----------------------------------------------------------------------------------------------------
_RS = pr.RowSplitConfig


@pytest.mark.parametrize("L,B,H,T_,cfg", [
    (1, 3, 5, 4, None), (4, 2, 9, 5, None),
    (2, 5, 11, 5, _RS(2, 3, 2, 0)),        # all weights in "shared memory", ragged batch chunks
    (3, 4, 10, 4, _RS(4, 1, 3, 5)),        # one warp per block, units past H in the last block
    (2, 3, 16, 3, _RS(1, 4, 1, 100)),      # one block per layer, every row in registers
    (1, 7, 9, 6, _RS(5, 2, 7, 1)),         # one layer (the single-layer GRU), one chunk of 7
])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_stack_matches_numpy(L, B, H, T_, cfg, dtype):
    _check_stack(L, B, H, T_, dtype, cfg or pr.default_rows_config(L, B, H, "llvm"), seed=L + B)


def test_rows_config_and_errors():
    from tvmseq.targets import resolve

    cuda = resolve("cuda")
    cfg = pr.default_rows_config(4, 8, 512, cuda)
    geo = pr.RowGeometry(4, 8, 512, cfg, 32)
    assert cfg.blocks_per_layer * 4 <= 132 and geo.G * geo.U >= 512 and geo.check(pr_facts(cuda)) is None
    assert ps.fits_on_chip(4, 8, 512, "float32", cuda, cfg)[0]
    ok, why = pr.rows_fit(4, 8, 512, cuda, _RS(32, 16, 8, 6))     # 512 threads: 128 registers each
    assert not ok and "registers" in why
    ok, why = pr.rows_fit(4, 8, 512, cuda, _RS(40, 8, 8, 0))      # 160 blocks > 132 SMs
    assert not ok and "resident" in why
    ok, why = pr.rows_fit(2, 8, 1024, cuda, _RS(64, 8, 8, 0))     # every weight row in shared memory
    assert not ok and "shared memory" in why
    ok, why = pr.rows_fit(4, 8, 2048, cuda)                        # 4 x 2 x 48 MB of fp32 weights
    assert not ok and "no row-split configuration" in why
    with pytest.raises(TvmseqError, match="non-positive"):
        ps.stacked_gru_func(2, 2, 64, "float32", "llvm", config=_RS(2, 0, 2, 0))


def pr_facts(target):
    from tvmseq.kernels import recurrent_gemm as rg

    return rg.gpu_facts(target)


@pytest.mark.parametrize("L,B,H", [(4, 8, 512), (1, 8, 1024)])
def test_rows_cuda_builds_without_spills(L, B, H):
    from tvmseq.cuda_toolchain import ptxas_report
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    f = ps.stacked_gru_func(L, B, H, "float32", tgt, config=pr.default_rows_config(L, B, H, tgt))
    src = tvm.compile(tvm.IRModule({"gru_stack": f}), target=tgt).mod.imports[0].inspect_source()
    for needle in ("cg::this_grid().sync()", "__syncwarp", "__all_sync", "st.relaxed.gpu.global.b64",
                   "__shfl_xor_sync"):
        assert needle in src, needle
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["registers"] <= 255, info


# ----------------------------------------------------------------------------------------------------
# GPU: the odd-size kernels of the benchmark payload (python3 -m tvmseq.bench.gru_stack --build out/stack2)
# ----------------------------------------------------------------------------------------------------
STACK_PREBUILT = Path(os.environ.get("TVMSEQ_STACK_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "stack2"))


@pytest.mark.gpu
def test_prebuilt_odd_stacks_on_gpu():
    import json

    from tvmseq.bench.gru_stack import NAME, check_kernels
    from tvmseq.measure import PrebuiltModules

    if not (STACK_PREBUILT / "index.json").exists():
        pytest.skip(f"no prebuilt payload in {STACK_PREBUILT}")
    index = json.loads((STACK_PREBUILT / "index.json").read_text())
    assert any(e.get("odd") for e in index["configs"]), "payload has no odd-size kernels"
    mod = PrebuiltModules(STACK_PREBUILT).get(f"{NAME}.so")
    assert check_kernels(mod, index) == []


def test_stack_refuses_more_steps_than_32_bit_indices(monkeypatch):
    """The stack kernel's gate_i0 [seq, B, 3H] and Y [L, seq, B, H] are indexed in 32 bits: past 2^31 values it is
    refused on the host with one line (here the limit lowered to 150 steps of B x max(3H, L x H) = 48 values)."""
    import tvm

    from tvmseq.kernels.recurrent import stack
    from tvmseq.onnx import checks

    monkeypatch.setattr(checks, "INDEX_LIMIT", 48 * 150 + 1)
    func = stack.stacked_gru_func(2, 2, 8, "float32", "llvm")
    run = tvm.compile(tvm.IRModule({"k": func.with_attr("global_symbol", "k")}), target="llvm")["k"]

    def call(seq):
        f32 = lambda *s: tvm.runtime.tensor(np.random.rand(*s).astype("float32"))  # noqa: E731
        run(f32(seq, 2, 24), f32(2, 24, 8), f32(1, 24, 8), f32(1, 24), f32(2, 8), f32(2, 2, 8), f32(2, seq, 2, 8),
            f32(2, 2, 8))

    call(150)
    with pytest.raises(Exception, match="2-layer GRU stack .* at most 150 steps"):
        call(151)
