"""The TMA + warp-specialized float16 input projection (kernels/projection_tma.py): the tiles it refuses, its CUDA
code generation for the H100 (tensor maps as __grid_constant__ kernel parameters, TMA tile loads completing on
mbarriers, wgmma, no spills), and (marked gpu) the prebuilt kernels against a float64 einsum on the GPU, with a
partial last row tile (the TMA's out-of-bounds zero fill) and two directions.

GPU kernels: `python tests/test_projection_tma.py out/ptma` builds them here (sm_90a); run
`pytest -m gpu tests/test_projection_tma.py` there with out/ptma carried (or TVMSEQ_PTMA_PREBUILT)."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import tvm

    from tvmseq.kernels import projection_tma as ptm
    from tvmseq.targets import resolve
except ImportError:
    ptm = None
needs_compiler = pytest.mark.skipif(ptm is None, reason="TVM compiler not available")


@needs_compiler
def test_refuses_tiles_and_shapes_it_cannot_run():
    from tvmseq.errors import TvmseqError

    assert "multiple of 64" in ptm.supports(3072, 1024, ptm.TmaTile(bm=96))
    assert "up to 256" in ptm.supports(3072, 1024, ptm.TmaTile(bn=512))
    assert "accumulators" in ptm.supports(3072, 1024, ptm.TmaTile(bm=192, bn=256, stages=3))   # 512 threads
    assert "2+ stages" in ptm.supports(3072, 1024, ptm.TmaTile(stages=1))
    assert "> 227 KB" in ptm.supports(3072, 1024, ptm.TmaTile(stages=5))
    with pytest.raises(TvmseqError, match=r"K=1000 \(input size\) of 64"):
        ptm.projection_tma_func(1, 3072, 1000)
    assert ptm.projection_tma_func(1, 256, 64, gpu=False) is not None   # the CPU variant: mma's loop nest


@needs_compiler
@pytest.mark.parametrize("D,tile", [(1, ptm and ptm.TmaTile()), (2, ptm and ptm.TmaTile(256, 128, 4))])
def test_cuda_codegen(D, tile):
    tgt = resolve("cuda")
    src = tvm.compile(tvm.IRModule({"k": ptm.projection_tma_func(D, 3072, 1024, True, tile)}),
                      target=tgt).mod.imports[0].inspect_source()
    for needle in ("const __grid_constant__ CUtensorMap x_map", "const __grid_constant__ CUtensorMap w_map",
                   "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes",
                   f"wgmma.mma_async.sync.aligned.m64n{tile.bn}k16.f32.f16.f16", "mbarrier.arrive.expect_tx"):
        assert needle in src, needle
    assert "__syncthreads" in src and src.count("__syncthreads") <= 2   # only after the barrier set-up
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.bench.recurrent_gemm import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


PREBUILT = Path(os.environ.get("TVMSEQ_PTMA_PREBUILT", Path(__file__).resolve().parents[1] / "out" / "ptma"))
# (D, rows, N, K, tile): rows not a multiple of the row tile, K over several rounds of the stages
GPU_CASES = [(1, 1000, 768, 640, (128, 256, 4)), (2, 333, 384, 1024, (256, 128, 4)), (1, 64, 256, 64, (128, 256, 3)),
             (2, 3700, 3072, 1024, (128, 256, 4))]


def _case_name(case):
    D, rows, N, K, tile = case
    return f"ptma_d{D}_m{rows}_n{N}_k{K}_" + "_".join(map(str, tile))


def build_gpu_cases(out_dir):
    from tvmseq.bench.common import compile_for_gpu

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    funcs = {_case_name(c): ptm.projection_tma_func(c[0], c[2], c[3], True, ptm.TmaTile(*c[4])).with_attr(
        "global_symbol", _case_name(c)) for c in GPU_CASES}
    ex, report = compile_for_gpu(funcs, resolve("cuda"))
    ex.export_library(str(out / "ptma.so"))
    (out / "index.json").write_text(json.dumps({"cases": GPU_CASES, "ptxas": report}, indent=1))
    print(f"built {len(funcs)} kernels into {out}; ptxas: {report}")


if __name__ == "__main__":
    build_gpu_cases(sys.argv[1] if len(sys.argv) > 1 else "out/ptma")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_name)
def test_prebuilt_on_gpu(case):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if not (PREBUILT / "ptma.so").exists():
        pytest.skip(f"no prebuilt kernels in {PREBUILT} (python tests/test_projection_tma.py {PREBUILT})")
    import tvm as tvm_rt

    D, rows, N, K, _ = case
    rng = np.random.default_rng(rows + N)
    X = rng.standard_normal((rows, K)).astype(np.float16)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float16)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    out = torch.full((D, rows, N), float("nan"), device="cuda")   # poisoned: every element written
    f = tvm_rt.runtime.load_module(str(PREBUILT / "ptma.so"))[_case_name(case)]
    f(*[tvm_rt.runtime.from_dlpack(torch.from_numpy(a).cuda()) for a in (X, W, bias)], tvm_rt.runtime.from_dlpack(out))
    torch.cuda.synchronize()
    want = np.einsum("mk,dnk->dmn", X.astype(np.float64), W.astype(np.float64)) + bias[:, None, :]
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-3, atol=1e-3)
