"""Tile sweep of the float16 tensor-core input projection on the H100: the wmma rule
(kernels/input_projection.TensorCoreProjection) and the hand-scheduled mma.sync kernel (kernels/projection_mma.py),
against cuBLAS (torch.matmul, fp16) in the same process.

  python3 scripts/tc_projection_sweep.py build out/tcproj    # here (compiler)
  python3 scripts/tc_projection_sweep.py run out/tcproj      # GPU machine (runtime + torch)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# (directions, batch, hidden = input size); seq 100: M = 100 x batch rows, N = 3 x hidden per direction
# session 5: the mma kernel's best tile (bk 64) against 64 x 64 warp tiles (4 warps), fewer ldmatrix an mma; then
# (tcproj6) the best three again after the epilogue's float2 stores
# (session 4's list: git log; its results: artifacts/bench/tc_projection_sweep.json)
# session 7: the TMA + warp-specialized kernel (kernels/projection_tma.py) against the warpgroup kernel's picks
SHAPES = [(1, 64, 1024), (1, 256, 1024), (2, 256, 1024), (2, 37, 1024), (1, 256, 512)]   # batch 37: a partial tile
TILES = []   # wmma rule (warps_m, frags_m, warps_n, frags_n, k_frags)
# hand-scheduled mma.sync kernel (bm, bn, bk, warps_m, warps_n, stages)
MMA_TILES = []
# warpgroup kernel (kernels/projection_wgmma.py): (bm, bn, stages)
WGMMA_TILES = [(128, 128, 3), (128, 256, 4, 1)]
# TMA + warp-specialized kernel (kernels/projection_tma.py): (bm, bn, stages)
# (bm, bn, stages); tcproj10: best (256, 128, 4) at 0.70-0.77x cuBLAS, 4-5% ahead of the warpgroup kernel at H1024
# B64-256 (uni and bi), behind it at bi B37 and H512 B256. A persistent tile loop (132 blocks; the producer loading
# the next tile's stages during the stores) measured slower still in tcproj11 (0.40-0.52 ms at B256) and was dropped
TMA_TILES = [(128, 256, 4), (128, 256, 3), (128, 128, 4), (128, 128, 6), (192, 256, 3), (256, 128, 4), (64, 256, 6)]
SEQ = 100


def _name(D, B, H, tile, kind="wmma"):
    return f"p_{kind}_d{D}_b{B}_h{H}_" + "_".join(map(str, tile))


def build(out: Path):
    import tvm

    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import gru
    from tvmseq.kernels import input_projection as ip
    from tvmseq.kernels import projection_mma as pmm
    from tvmseq.kernels import projection_tma as ptm
    from tvmseq.kernels import projection_wgmma as pwg
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for D, B, H in SHAPES:
        spec = gru.GruSpec(D, B, H, H, "float16", 1, "bidirectional" if D == 2 else "forward")
        for tile in TILES:
            try:
                f = ip.tensor_core_projection(spec, tgt, ip.TensorCoreTile(*tile))
            except Exception as err:  # noqa: BLE001 - a tile the rule cannot schedule is skipped
                print("skip", D, B, H, tile, type(err).__name__, str(err)[:200])
                continue
            if f is None:
                print("declined", D, B, H, tile)
                continue
            f = f.with_attr("global_symbol", _name(D, B, H, tile))
            try:   # some tiles schedule but fail to lower (TVM 0.27): keep them out of the shared library
                tvm.compile(tvm.IRModule({_name(D, B, H, tile): f}), target=tgt)
            except Exception as err:  # noqa: BLE001
                print("does not lower", D, B, H, tile, str(err).strip().splitlines()[-1][:160])
                continue
            funcs[_name(D, B, H, tile)] = f
            index.append(dict(D=D, B=B, H=H, tile=list(tile), kind="wmma", name=_name(D, B, H, tile)))
        # the hand-scheduled kernels: (kind, tiles, tile class, supports, prim_func builder)
        for kind, tiles, Tile, supports, make in (
                ("mma", MMA_TILES, pmm.MmaGemmTile, pmm.supports, pmm.projection_mma_func),
                ("wgmma", WGMMA_TILES, pwg.WgmmaTile, pwg.supports, pwg.projection_wgmma_func),
                ("tma", TMA_TILES, ptm.TmaTile, ptm.supports, ptm.projection_tma_func)):
            for tile in tiles:
                t = Tile(*tile)
                if supports(3 * H, H, t) or t.smem_bytes() > 227 * 1024:
                    continue
                name = _name(D, B, H, tile, kind)
                funcs[name] = make(D, 3 * H, H, True, t).with_attr("global_symbol", name)
                index.append(dict(D=D, B=B, H=H, tile=list(tile), kind=kind, name=name))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "tcproj.so"))
    for e in index:
        e["ptxas"] = {k: v for k, v in report.items() if k.startswith(e["name"] + "_kernel")}
        print(e["name"], e["ptxas"])
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(funcs)} variants")


def run(out: Path):
    import torch
    import tvm

    from tvmseq.bench.common import time_cuda

    index = json.loads((out / "index.json").read_text())
    mod = tvm.runtime.load_module(str(out / "tcproj.so"))
    results, peers = [], {}
    for e in index:
        D, B, H = e["D"], e["B"], e["H"]
        M, N = SEQ * B, 3 * H
        g = torch.Generator(device="cuda").manual_seed(0)
        X = torch.randn(M, H, device="cuda", generator=g).half()
        W = (torch.randn(D, N, H, device="cuda", generator=g) * H ** -0.5).half()
        bias = torch.randn(D, N, device="cuda", generator=g)
        out_t = torch.empty(D, M, N, device="cuda")
        args = [tvm.runtime.from_dlpack(t) for t in (X, W, bias, out_t)]
        f = mod[e["name"]]
        try:
            f(*args)
            torch.cuda.synchronize()
            want = torch.einsum("mk,dnk->dmn", X.float(), W.float()) + bias[:, None, :]
            err = float(((out_t - want).norm() / want.norm()).item())
            ms = time_cuda(lambda: f(*args), warmup=3, iters=20)
            if (D, B, H) not in peers:
                Wt = W.transpose(1, 2).contiguous()
                peers[(D, B, H)] = time_cuda(lambda: [torch.matmul(X, Wt[d]) for d in range(D)], warmup=3, iters=20)
            tflops = 2 * D * M * N * H / ms / 1e9
            row = dict(e, ms=ms, tflops=tflops, cublas_ms=peers[(D, B, H)], vs_cublas=peers[(D, B, H)] / ms,
                       rel_err=err, ok=err < 1e-3)
        except Exception as err:  # noqa: BLE001 - one failing variant must not stop the sweep
            row = dict(e, error=f"{type(err).__name__}: {err}"[:300])
        results.append(row)
        print(e["name"], {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if k in ("ms", "tflops", "cublas_ms", "vs_cublas", "rel_err", "ok", "error")}, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](Path(sys.argv[2]))
