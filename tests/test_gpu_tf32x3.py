"""The tf32x3 warpgroup projection itself on the GPU (`kernels/projection/wgmma.py`, operands "tf32x3"): the rule's
tile (both tf32 planes in a stage, three products a k step), its 128-row form for many static rows, its narrower
forms for few rows (64, 32 and 16 columns, on W padded for the 128-column tile) and the three-pass form, odd sizes,
row counts under, at and over a block's 64 rows, against float64, within 3x a float32 GEMM's error.

Compiled HERE for the H100 (`python tests/test_gpu_tf32x3.py DIR`), run THERE with TVM's runtime only
(`TVMSEQ_TF32X3=DIR pytest -m gpu tests/test_gpu_tf32x3.py`)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

SHAPES = [(1, 600, 600), (2, 148, 80), (1, 128, 208), (2, 1536, 1024), (1, 400, 161), (1, 161, 600), (2, 37, 80)]   # (D, N, K)
ROWS = [1, 37, 64, 129, 1000]
TILES = ("rule", "three_passes", "large", "n64", "n32", "n16")
GPU_DIR = Path(os.environ.get("TVMSEQ_TF32X3", Path(__file__).resolve().parents[1] / "out" / "tf32x3_kernel"))


def build(out_dir) -> None:
    import dataclasses

    import tvm

    from tvmseq.kernels.projection import gemm as ip
    from tvmseq.kernels.projection import tf32x3, wgmma
    from tvmseq.measure import compile_for_gpu

    h100 = tvm.target.Target("nvidia/nvidia-h100", host="llvm")
    tiles = {"rule": ip.TF32X3_TILE, "three_passes": dataclasses.replace(ip.TF32X3_TILE, both_planes=False),
             "large": ip.TF32X3_LARGE_TILE, **{f"n{t.bn}": t for t in ip.TF32X3_NARROW_TILES}}
    funcs, padded = {}, {}
    for D, N, K in SHAPES:
        Kp, Np = ip.tf32x3_k(K), ip.tf32x3_n(N)
        padded[f"{D}_{N}_{K}"] = (Kp, Np)
        funcs[f"split_{K}"] = tf32x3.scheduled_split_func(K, Kp, h100).with_attr("global_symbol", f"split_{K}")
        for name, tile in tiles.items():
            funcs[f"{name}_{D}_{N}_{K}"] = wgmma.projection_wgmma_func(D, N, Kp, tile=tile, operands="tf32x3",
                                                                       w_rows=Np) \
                .with_attr("global_symbol", f"{name}_{D}_{N}_{K}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ex, _ = compile_for_gpu(funcs, h100)
    ex.export_library(str(out / "tf32x3_kernel.so"))
    (out / "tf32x3_kernel.json").write_text(json.dumps(padded))


@pytest.mark.gpu
@pytest.mark.parametrize("D,N,K", SHAPES)
@pytest.mark.parametrize("tile", TILES)
def test_tf32x3_kernel_is_as_accurate_as_float32(D, N, K, tile):
    import tvm

    from tvmseq.kernels.projection.tf32x3 import split_array

    path = GPU_DIR / "tf32x3_kernel.so"
    if not path.exists():
        pytest.skip(f"no prebuilt module in {GPU_DIR} (python tests/test_gpu_tf32x3.py {GPU_DIR})")
    lib, dev = tvm.runtime.load_module(str(path)), tvm.cuda()
    Kp, Np = json.loads((GPU_DIR / "tf32x3_kernel.json").read_text())[f"{D}_{N}_{K}"]
    rng = np.random.default_rng(D + N + K)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float32)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    ws = tvm.runtime.tensor(split_array(np.pad(W, [(0, 0), (0, Np - N), (0, Kp - K)])), dev)
    for rows in ROWS:
        X = rng.standard_normal((rows, K)).astype(np.float32)
        xs = tvm.runtime.tensor(np.full((2, rows, Kp), np.nan, np.float32), dev)
        lib[f"split_{K}"](tvm.runtime.tensor(X, dev), xs)
        out = tvm.runtime.tensor(np.full((D, rows, N), np.nan, np.float32), dev)
        lib[f"{tile}_{D}_{N}_{K}"](xs, ws, tvm.runtime.tensor(bias, dev), out)
        exact = np.einsum("mk,dnk->dmn", X.astype(np.float64), W.astype(np.float64)) + bias[:, None, :]
        f32 = np.einsum("mk,dnk->dmn", X, W) + bias[:, None, :]
        err, err32 = (np.abs(np.asarray(a, np.float64) - exact).max() for a in (out.numpy(), f32))
        assert err <= 3 * err32 + 1e-6, (rows, err, err32)


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else GPU_DIR)
