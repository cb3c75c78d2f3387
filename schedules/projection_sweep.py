"""Measured tile sweep of the float16 warpgroup input projection (`kernels/projection/wgmma.py`) on the H100, at the
input GEMMs of the LSTM grid's float16 cells: X [rows, K] x W [D, N, K] -> gate_i [D, rows, N], rows = seq x batch.
The kernel's tiles were chosen on GRU input GEMMs with K = 1024 (notes/persistent.md); at hidden 128 K is 128,
two k steps, so a 4-stage pipeline only holds shared memory that keeps a second block off the SM.

  python3 schedules/projection_sweep.py build out/psweep     # here: one library, index.json
  python3 schedules/projection_sweep.py run out/psweep OUT   # GPU machine: check each against torch, time it

`run` checks every variant against a float32 GEMM of the same float16 operands (TF32 off), times it with CUDA events
(median of TIMED launches) next to cuBLAS (torch.matmul of the float16 operands, float16 out, the same process) and
writes OUT/projection_sweep.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SEQ = 100
# (D, batch, hidden, gate dtype): the float16 LSTM grid's staged-state cells (float32 gate_i) and warpgroup cells
# (float16 gate_i); input size = hidden, N = 4 x hidden
SHAPES = [(1, 8, 128, "float32"), (1, 64, 128, "float32"), (1, 256, 128, "float32"), (2, 256, 128, "float32"),
          (1, 8, 256, "float32"), (1, 64, 256, "float32"), (1, 8, 512, "float32"),
          (1, 256, 256, "float16"), (1, 64, 1024, "float16"), (1, 256, 1024, "float16"), (2, 256, 1024, "float16")]
TILES = [(128, 256, 4, True), (128, 128, 3, False), (128, 256, 3, True), (128, 256, 2, False), (128, 128, 2, False),
         (64, 256, 2, False), (64, 128, 2, False), (64, 128, 3, False), (64, 64, 2, False), (128, 64, 2, False)]
WARM, TIMED = 5, 50


def build(out: Path) -> None:
    from tvmseq.kernels.projection import wgmma
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for D, B, H, gate in SHAPES:
        N, K = 4 * H, H
        for bm, bn, stages, inflight in TILES:
            tile = wgmma.WgmmaTile(bm=bm, bn=bn, stages=stages, inflight=inflight)
            if wgmma.supports(N, K, tile) is not None:
                continue
            name = f"proj_d{D}_b{B}_h{H}_{gate}_{bm}x{bn}s{stages}{'i' if inflight else ''}"
            funcs[name] = wgmma.projection_wgmma_func(D, N, K, True, tile, gate).with_attr("global_symbol", name)
            index.append(dict(func=name, D=D, B=B, H=H, gate=gate, bm=bm, bn=bn, stages=stages, inflight=inflight))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "projection_sweep.so"))
    for e in index:
        e["ptxas"] = report.get(e["func"] + "_kernel", {})
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(funcs)} kernels", flush=True)


def run(out: Path, dest: Path) -> None:
    import torch
    import tvm

    from tvmseq.measure import time_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    index = json.loads((out / "index.json").read_text())
    mod = tvm.runtime.load_module(str(out / "projection_sweep.so"))
    results, shapes = [], {}
    for e in index:
        key = (e["D"], e["B"], e["H"], e["gate"])
        if key not in shapes:
            D, B, H, gate = key
            rows, N, K = SEQ * B, 4 * H, H
            g = torch.Generator(device="cuda").manual_seed(0)
            X = torch.randn(rows, K, device="cuda", generator=g).half()
            W = (torch.randn(D, N, K, device="cuda", generator=g) * K ** -0.5).half()
            bias = torch.randn(D, N, device="cuda", generator=g)
            ref = torch.stack([X.float() @ W[d].float().T for d in range(D)]) + bias[:, None, :]
            out_t = torch.empty(D, rows, N, device="cuda", dtype=getattr(torch, gate))
            cublas = time_cuda(lambda: [X @ W[d].T for d in range(D)], warmup=WARM, iters=TIMED)
            shapes[key] = (X, W, bias, ref, out_t, cublas, 2.0 * D * rows * N * K)
        X, W, bias, ref, out_t, cublas, flop = shapes[key]
        args = [tvm.runtime.from_dlpack(t) for t in (X, W, bias, out_t)]
        fn = mod[e["func"]]
        out_t.fill_(float("nan"))
        fn(*args)
        torch.cuda.synchronize()
        err = float((out_t.float() - ref).abs().max())
        ms = time_cuda(lambda: fn(*args), warmup=WARM, iters=TIMED)
        res = dict(e, err=err, ok=err <= (2e-2 if e["gate"] == "float16" else 1e-3), us=ms * 1e3,
                   us_step=ms * 1e3 / SEQ, tflops=flop / ms / 1e9, cublas_us=cublas * 1e3)
        results.append(res)
        print(f"{e['func']:44s} ok={res['ok']} err={err:.1e} {res['us']:8.1f} us {res['tflops']:6.1f} TFLOP/s "
              f"(cuBLAS fp16 out {res['cublas_us']:.1f} us)", flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "projection_sweep.json").write_text(json.dumps(
        dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, seq=SEQ, timing=f"cuda events, median of "
             f"{TIMED} launches", results=results), indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
