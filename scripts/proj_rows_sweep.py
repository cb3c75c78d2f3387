"""Sweep the tiled SGEMM template's genes for the padded-rows input projection (float32, batch no M tile
divides: the GRU/RNN at batch 1-8, whose seq * batch rows are padded to whole row tiles, see
`input_projection.row_tile`), against cuBLAS (TF32 off) in the same process.

  python3 scripts/proj_rows_sweep.py build out/projrows     # here: every variant as sm_90a SASS, one .so
  python3 scripts/proj_rows_sweep.py build2 out/projrows2   # run 2: its best candidates at every padded cell
  python3 scripts/proj_rows_sweep.py run out/projrows       # GPU machine: check + time, results.json

A variant is (row tile, genes); the row tile is the genes' bm (the projection of a [tiles, tile, I] batch).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

SEQ = 100
# (directions, batch, input size, gates * hidden): fp32 GRU at H1024 B8 (uni, bi), H512 B8, H1024 B1
SHAPES = [(1, 8, 1024, 3072), (2, 8, 1024, 3072), (1, 8, 512, 1536), (1, 1, 1024, 3072)]
# run 2: the candidates of run 1 at every padded-rows cell of the GRU grid, and at batch 100 (10,000 rows)
SHAPES2 = [(1, 8, 1024, 3072), (2, 8, 1024, 3072), (1, 100, 1024, 3072), (2, 100, 1024, 3072),
           (1, 8, 512, 1536), (2, 8, 512, 1536), (1, 1, 1024, 3072), (2, 1, 1024, 3072), (1, 1, 512, 1536),
           (2, 1, 512, 1536), (1, 1, 256, 768), (1, 8, 256, 768), (2, 8, 256, 768)]
# (bm, bn, bk, tm, tn, warp_n, stages): the first is PROJECTION_GENES (the importer's choice today)
VARIANTS = [(64, 128, 16, 8, 8, 8, 3), (32, 128, 16, 8, 8, 8, 3), (32, 128, 16, 4, 8, 8, 3),
            (64, 64, 16, 8, 8, 8, 3), (64, 64, 16, 4, 8, 8, 3), (64, 64, 16, 8, 4, 8, 3),
            (64, 64, 8, 4, 4, 8, 2), (128, 64, 16, 8, 8, 8, 3), (128, 128, 8, 8, 8, 8, 2),
            (32, 64, 16, 4, 4, 8, 3), (64, 128, 16, 8, 4, 8, 3), (128, 64, 16, 8, 4, 8, 3),
            (32, 64, 16, 8, 8, 8, 3), (64, 128, 8, 8, 8, 8, 2)]
VARIANTS2 = [(64, 128, 16, 8, 8, 8, 3), (64, 64, 16, 8, 4, 8, 3), (64, 64, 16, 4, 8, 8, 3), (64, 64, 16, 8, 8, 8, 3),
             (64, 128, 16, 8, 4, 8, 3), (32, 64, 16, 4, 4, 8, 3)]


def genes_of(v) -> dict:
    from tvmseq.kernels.input_projection import PROJECTION_GENES

    bm, bn, bk, tm, tn, warp_n, stages = v
    return dict(PROJECTION_GENES, bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, warp_n=warp_n, stages=stages)


def name_of(shape, v) -> str:
    D, B, I, N = shape
    return f"p_d{D}_b{B}_i{I}_n{N}_" + "_".join(map(str, v))


def build(out: Path, shapes=SHAPES, variants=VARIANTS) -> None:
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import gru, input_projection as ip
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    funcs, index = {}, []
    for shape in shapes:
        D, B, I, N = shape
        for v in variants:
            tile = v[0]
            spec = gru.GruSpec(D, tile, N // 3, I, "float32", linear_before_reset=1,
                               direction="bidirectional" if D == 2 else "forward")
            sch = ip.TiledInputProjection(genes_of(v)).apply(ip.input_projection_func(spec), tgt)
            if sch is None:
                print("skip", name_of(shape, v))
                continue
            name = name_of(shape, v)
            funcs[name] = sch.mod["main"].with_attrs({"global_symbol": name, "tirx.is_scheduled": True})
            index.append(dict(name=name, D=D, B=B, I=I, N=N, variant=list(v), tile=tile))
    out.mkdir(parents=True, exist_ok=True)
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "proj_rows.so"))
    for e in index:
        e["ptxas"] = report.get(f"{e['name']}_kernel", {})
        print(e["name"], e["ptxas"])
    (out / "index.json").write_text(json.dumps(index, indent=1))


def run(out: Path) -> None:
    import torch
    import tvm

    from tvmseq.bench.common import PrebuiltModules, time_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    mod = PrebuiltModules(out).get("proj_rows.so")
    index = json.loads((out / "index.json").read_text())
    rows, peers = [], {}
    tv = tvm.runtime.from_dlpack
    for e in index:
        D, B, I, N, tile = e["D"], e["B"], e["I"], e["N"], e["tile"]
        g = torch.Generator(device="cuda").manual_seed(0)
        X = torch.randn(SEQ * B, I, device="cuda", generator=g)
        W = torch.randn(D, N, I, device="cuda", generator=g) * I ** -0.5
        bias = torch.randn(D, N, device="cuda", generator=g)
        rows_n = SEQ * B
        tiles = math.ceil(rows_n / tile)
        x_t = torch.zeros(tiles * tile, I, device="cuda")
        x_t[:rows_n] = X
        g_t = torch.empty(D, tiles * tile, N, device="cuda")
        f = mod[e["name"]]
        args = [tv(x_t.view(tiles, tile, I)), tv(W), tv(bias), tv(g_t.view(D, tiles, tile, N))]
        f(*args)
        torch.cuda.synchronize()
        ref = torch.stack([X.double() @ W[d].double().T + bias[d].double() for d in range(D)])
        err = float(((g_t[:, :rows_n].double() - ref).norm() / ref.norm()).item())
        key = (D, B, I, N)
        if key not in peers:
            peers[key] = time_cuda(lambda: [torch.addmm(bias[d], X, W[d].T) for d in range(D)], iters=200)
        ms = time_cuda(lambda: f(*args), iters=200)
        row = dict(e, ms=ms, us_step=ms * 1e3 / SEQ, cublas_ms=peers[key], vs_cublas=peers[key] / ms, err=err,
                   ok=err < 1e-5, tflops=2.0 * D * rows_n * I * N / ms / 1e9)
        rows.append(row)
        print(f"{e['name']:44s} {ms * 1e3:8.1f} us  ({row['us_step']:.3f} us/step)  cuBLAS {peers[key] * 1e3:8.1f} us"
              f"  x{row['vs_cublas']:.2f}  {row['tflops']:.1f} TFLOP/s  err {err:.1e}", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    {"build": build, "build2": lambda out: build(out, SHAPES2, VARIANTS2), "run": run}[sys.argv[1]](Path(sys.argv[2]))
