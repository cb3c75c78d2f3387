"""The float32 input projection on tf32 tensor cores at float32 accuracy (`kernels/projection/tf32x3.py`) against
the SIMT projection it replaces, at the input GEMMs of float32 recurrent cells: X [rows, K] x W [D, N, K] -> gate_i
[D, rows, N], rows = seq x batch. Decides `gemm.TF32X3_TILE` (and `gemm.TF32X3_MIN_ROWS`).

  python3 schedules/tf32x3_sweep.py build out/t3sweep [few-rows]   # here: one library, index.json
  python3 schedules/tf32x3_sweep.py run out/t3sweep OUT   # GPU machine: check each against float64, time it
  compute-sanitizer python3 schedules/tf32x3_sweep.py check out/t3sweep SHAPE...   # each variant run once

`run` times (CUDA events, median of TIMED launches) the SIMT projection as the importer ran it before (row tiles
padded by a copy, as `bench.gru._projection` does), the split pass + tf32x3 kernel at each tile, and cuBLAS's
float32 GEMM (TF32 off) in the same process, with each one's largest error against a float64 GEMM of the same
operands; writes OUT/tf32x3_sweep.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SEQ = 100
# (directions, batch, hidden, input size, gates): the float32 LSTM grid's cells with many rows, a GRU, an input
# size that is no multiple of 32 (zero-padded by the split), the VAD's 32,000-row projection (K 128, N 512)
# (directions, batch, hidden, input size, gates; gates 1: an FC layer): the float32 products of the benchmark
# architectures (`tvmseq bench model`) at 100 frames a call (batch 10: 1000 frames of batch 1): the ASR encoder's
# input GEMMs at batch 8 and 80, its first layer (K 80), the VAD's fc_in and LSTM projection, the denoiser's FCs and
# GRU projection, the CRNN's second BiLSTM layer; and float32 LSTM cells of 800-25,600 rows
SHAPES = [(2, 8, 512, 1024, 3), (2, 80, 512, 1024, 3), (2, 8, 512, 80, 3), (1, 10, 128, 208, 1), (1, 10, 128, 128, 4),
          (1, 10, 600, 600, 1), (1, 10, 400, 161, 3), (1, 1, 600, 600, 1), (1, 1, 400, 400, 3), (2, 8, 256, 512, 4),
          (1, 3, 600, 400, 1), (1, 64, 128, 128, 4), (1, 256, 1024, 1024, 4), (1, 64, 256, 100, 4)]
# (bm, bn, stages, in flight, promoted chunk in k steps of 32 (0: one tensor-core sum over all of 3K), both tf32
# planes in a stage: three products a k step)
TILES = [(128, 128, 4, True, 8, False), (64, 128, 4, True, 8, False), (128, 128, 3, True, 3, True),
         (128, 64, 4, True, 3, True), (64, 128, 4, True, 3, True), (64, 64, 4, True, 3, True),
         (64, 128, 4, True, 8, True), (128, 128, 3, True, 8, True)]
# `build DIR few-rows`: the products of calls of few rows (the denoiser's FCs and GRU projection at batch 1 and 8, 100
# frames: 100 and 800 rows), where a 64 x 128 tile leaves most SMs idle and a block's k steps wait on their loads:
# narrower tiles (more blocks) with more stages in flight
FEW_ROW_SHAPES = [(1, b, h, i, g) for b in (1, 8) for h, i, g in
                  ((400, 161, 1), (400, 400, 3), (600, 400, 1), (600, 600, 1), (161, 600, 1))]
FEW_ROW_TILES = [(64, 128, 4, True, 3, True), (64, 64, 4, True, 3, True), (64, 64, 6, True, 3, True),
                 (64, 32, 4, True, 3, True), (64, 32, 6, True, 3, True), (64, 32, 8, True, 3, True),
                 (64, 16, 8, True, 3, True)]
SETS = {"all": (SHAPES, TILES), "few-rows": (FEW_ROW_SHAPES, FEW_ROW_TILES)}
WARM, TIMED = 5, 30


def _spec(D, B, H, I, gates):
    from tvmseq.kernels.recurrent import gru, lstm

    direction = "bidirectional" if D == 2 else "forward"
    if gates == 1:
        from tvmseq.kernels.recurrent.rnn import RnnSpec
        return RnnSpec(D, B, H, I, "float32", direction=direction)
    if gates == 4:
        return lstm.LstmSpec(D, B, H, I, "float32", direction=direction)
    return gru.GruSpec(D, B, H, I, "float32", linear_before_reset=1, direction=direction)


def build(out: Path, which: str = "all") -> None:
    from tvmseq.kernels.projection import gemm as ip
    from tvmseq.kernels.projection import tf32x3, wgmma
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    shapes, tiles = SETS[which]
    for D, B, H, I, gates in shapes:
        spec, shape = _spec(D, B, H, I, gates), f"d{D}_b{B}_h{H}_i{I}_g{gates}"
        N, Kp = gates * H, ip.tf32x3_k(I)
        old = ip.TF32X3_MIN_ROWS
        ip.TF32X3_MIN_ROWS = 1 << 30   # the projection the importer picked before tf32x3
        try:
            simt, tile = ip.projection_for(spec, tgt, SEQ)
        finally:
            ip.TF32X3_MIN_ROWS = old
        funcs[f"simt_{shape}"] = simt.with_attr("global_symbol", f"simt_{shape}")
        funcs[f"split_{shape}"] = tf32x3.scheduled_split_func(I, Kp, tgt).with_attr("global_symbol", f"split_{shape}")
        variants = []
        for bm, bn, stages, inflight, promote, planes in tiles:
            wt = wgmma.WgmmaTile(bm=bm, bn=bn, stages=stages, inflight=inflight, promote=promote, both_planes=planes)
            Np = -(-N // bn) * bn
            if wgmma.supports(Np, Kp, wt, 4) is not None:
                print("skip", shape, wt, wgmma.supports(Np, Kp, wt, 4))
                continue
            name = f"t3_{shape}_{bm}x{bn}s{stages}{'i' if inflight else ''}p{promote}{'P' if planes else ''}"
            funcs[name] = wgmma.projection_wgmma_func(D, N, Kp, True, wt, operands="tf32x3").with_attr(
                "global_symbol", name)
            variants.append(dict(func=name, bm=bm, bn=bn, stages=stages, inflight=inflight, promote=promote))
        pick = ip.tf32x3_projection(spec, tgt, SEQ)
        index.append(dict(shape=shape, D=D, B=B, H=H, I=I, gates=gates, simt_tile=tile, variants=variants,
                          rule_tile=pick is not None and next(
                              (v["func"] for v in variants if funcs[v["func"]].script() == pick.with_attr(
                                  "global_symbol", v["func"]).script()), None)))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "tf32x3_sweep.so"))
    for e in index:
        for v in e["variants"]:
            v["ptxas"] = report.get(v["func"] + "_kernel", {})
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(funcs)} kernels", flush=True)


def run(out: Path, dest: Path) -> None:
    import torch
    import tvm

    from tvmseq.bench.gru import _projection
    from tvmseq.kernels.projection.gemm import tf32x3_k
    from tvmseq.measure import time_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    index = json.loads((out / "index.json").read_text())
    mod = tvm.runtime.load_module(str(out / "tf32x3_sweep.so"))
    dl = tvm.runtime.from_dlpack
    results = []
    for e in index:
        D, B, H, I, gates = e["D"], e["B"], e["H"], e["I"], e["gates"]
        rows, N, Kp = SEQ * B, gates * H, tf32x3_k(I)
        g = torch.Generator(device="cuda").manual_seed(0)
        X = torch.randn(SEQ, B, I, device="cuda", generator=g)
        W = (torch.randn(D, N, I, device="cuda", generator=g) * I ** -0.5).contiguous()
        bias = torch.randn(D, N, device="cuda", generator=g)
        ref = torch.stack([X.view(rows, I).double() @ W[d].double().T for d in range(D)]) + bias[:, None, :].double()
        scale = float(ref.abs().max())

        def err(gate):
            return float((gate.view(D, rows, N).double() - ref).abs().max()) / scale

        gate = torch.empty(D, SEQ, B, N, device="cuda")
        tv = [dl(t) for t in (X, W, bias, gate)]
        simt = _projection(mod[f"simt_{e['shape']}"], e["simt_tile"], tv, X, gate, bias, SEQ, B, D, H)
        gate.fill_(float("nan"))
        simt()
        torch.cuda.synchronize()
        row = dict(e, rows=rows, N=N, K=I, simt_err=err(gate),
                   simt_us=time_cuda(simt, warmup=WARM, iters=TIMED) * 1e3)
        cub = time_cuda(lambda: [X.view(rows, I) @ W[d].T for d in range(D)], warmup=WARM, iters=TIMED)
        cub_out = torch.stack([X.view(rows, I) @ W[d].T for d in range(D)]) + bias[:, None, :]
        row.update(cublas_us=cub * 1e3, cublas_err=err(cub_out))
        split = mod[f"split_{e['shape']}"]
        xs, ws = torch.empty(2, rows, Kp, device="cuda"), torch.empty(2, D * N, Kp, device="cuda")
        split(dl(W.view(D * N, I)), dl(ws))
        args = [dl(t) for t in (X.view(rows, I), xs, ws.view(2, D, N, Kp), bias, gate.view(D, rows, N))]
        row["split_us"] = time_cuda(lambda: split(args[0], args[1]), warmup=WARM, iters=TIMED) * 1e3
        for v in e["variants"]:
            fn = mod[v["func"]]
            Np = -(-N // v["bn"]) * v["bn"]
            wsp = torch.zeros(2, D, Np, Kp, device="cuda")
            wsp[:, :, :N] = ws.view(2, D, N, Kp)
            args = [dl(t) for t in (X.view(rows, I), xs, wsp, bias, gate.view(D, rows, N))]

            def both():
                split(args[0], args[1])
                fn(*args[1:])
            gate.fill_(float("nan"))
            both()
            torch.cuda.synchronize()
            v.update(err=err(gate), us=time_cuda(both, warmup=WARM, iters=TIMED) * 1e3,
                     gemm_us=time_cuda(lambda: fn(*args[1:]), warmup=WARM, iters=TIMED) * 1e3)
            v["tflops"] = 2.0 * D * rows * N * Kp / v["gemm_us"] / 1e6
        best = min(e["variants"], key=lambda v: v["us"]) if e["variants"] else None
        results.append(row)
        print(f"{e['shape']:28s} rows {rows:6d}: SIMT {row['simt_us']:8.1f} us err {row['simt_err']:.1e} | "
              f"cuBLAS fp32 {row['cublas_us']:8.1f} err {row['cublas_err']:.1e} | split {row['split_us']:6.1f} | " +
              " ".join(f"{v['func'].split('_')[-1]} {v['us']:.1f} ({v['gemm_us']:.1f}, {v['tflops']:.0f} TF/s) "
                       f"err {v['err']:.1e}" for v in e["variants"]) +
              (f" | best {best['us']:.1f}: {row['simt_us'] / best['us']:.2f}x SIMT" if best else ""), flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tf32x3_sweep.json").write_text(json.dumps(
        dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, seq=SEQ,
             timing=f"cuda events, median of {TIMED} launches; split + projection (us) and the projection alone "
                    "(gemm_us)", results=results), indent=1))


def check(out: Path, shapes) -> None:
    """Run the split and every tf32x3 variant of the given shapes once (under compute-sanitizer), print the error."""
    import torch
    import tvm

    from tvmseq.kernels.projection.gemm import tf32x3_k

    index = {e["shape"]: e for e in json.loads((out / "index.json").read_text())}
    mod = tvm.runtime.load_module(str(out / "tf32x3_sweep.so"))
    dl = tvm.runtime.from_dlpack
    for shape in shapes:
        e = index[shape]
        D, B, I, N = e["D"], e["B"], e["I"], e["gates"] * e["H"]
        rows, Kp = SEQ * B, tf32x3_k(I)
        X, W = torch.randn(rows, I, device="cuda"), torch.randn(D * N, I, device="cuda") * I ** -0.5
        bias, gate = torch.zeros(D, N, device="cuda"), torch.empty(D, rows, N, device="cuda")
        xs, ws = torch.empty(2, rows, Kp, device="cuda"), torch.empty(2, D * N, Kp, device="cuda")
        split = mod[f"split_{shape}"]
        split(dl(X), dl(xs))
        split(dl(W), dl(ws))
        ref = torch.stack([X.double() @ W.view(D, N, I)[d].double().T for d in range(D)])
        for v in e["variants"]:
            Np = -(-N // v["bn"]) * v["bn"]
            wsp = torch.zeros(2, D, Np, Kp, device="cuda")
            wsp[:, :, :N] = ws.view(2, D, N, Kp)
            mod[v["func"]](dl(xs), dl(wsp), dl(bias), dl(gate))
            torch.cuda.synchronize()
            print(v["func"], float((gate.double() - ref).abs().max()), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "all")
    elif sys.argv[1] == "check":
        check(Path(sys.argv[2]), sys.argv[3:])
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
