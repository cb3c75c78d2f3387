"""`tvmseq bench input_projection`: the GRU/RNN input projection (one GEMM over all steps, float32 out)
scheduled by the tiled SGEMM template (`kernels/projection/gemm.py`) against dlight's Matmul rule (the
schedule it replaced) and torch (cuBLAS, TF32 off) in the same process, checked against float64. Rows also time
the tensor-core kernel the importer picks for the target (`projection.gemm.projection_for` on the flat rows),
column `tc`: float16 on wgmma (sm_90a), float32 from 512 rows as tf32x3 (X split by its kernel in every call, W
once, as the importer does).

  python3 -m tvmseq.bench.input_projection --build out/proj      # here (TVM compiler, sm_90a SASS)
  python3 -m tvmseq.bench.input_projection --prebuilt out/proj   # GPU machine (TVM runtime + torch)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..measure import PrebuiltModules, compile_for_gpu, time_cuda
from .common import add_build_run_arguments, build_or_run, print_table, ratio_bar_plot, save
from .gru import split_projection

NAME = "input_projection"
# (directions, batch, input size, gates * hidden, seq, dtype): the GRU of the persistent_gru grid at H1024
CONFIGS = [(1, 64, 1024, 3072, 100, "float32"), (1, 256, 1024, 3072, 100, "float32"),
           (2, 64, 1024, 3072, 100, "float32"), (2, 256, 1024, 3072, 100, "float32"),
           (1, 64, 512, 1536, 100, "float32"), (1, 256, 512, 1536, 100, "float32"),
           (1, 64, 1024, 3072, 100, "float16"), (1, 256, 1024, 3072, 100, "float16"),
           (1, 96, 300, 600, 37, "float32"),
           (1, 8, 1024, 3072, 100, "float32"), (2, 8, 1024, 3072, 100, "float32"), (1, 8, 512, 1536, 100, "float32"),
           (1, 8, 1024, 3072, 100, "float16")]


def _suffix(c) -> str:
    D, B, I, N, seq, dtype = c
    return f"d{D}_b{B}_i{I}_n{N}_{dtype}"


def build(out_dir, target: str = "cuda") -> Path:
    import tvm

    from ..kernels.projection import gemm as ip
    from ..kernels.recurrent import gru
    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, {"benchmark": NAME, "configs": []}
    for c in CONFIGS:
        D, B, I, N, seq, dtype = c
        spec = gru.GruSpec(D, B, N // 3, I, dtype, linear_before_reset=1,
                           direction="bidirectional" if D == 2 else "forward")
        func = ip.input_projection_func(spec)
        tiled = ip.TiledInputProjection().apply(func, tgt)
        if tiled is None:
            print(f"skip {_suffix(c)}: no tile of the template divides batch {B}")
            continue
        from tvm.s_tir import dlight as dl

        with tgt:
            dlight = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Fallback())(
                tvm.IRModule({"main": func}))["main"]
        sfx = _suffix(c)
        funcs[f"tiled_{sfx}"] = tiled.mod["main"].with_attrs({"global_symbol": f"tiled_{sfx}", "tirx.is_scheduled": True})
        funcs[f"dlight_{sfx}"] = dlight.with_attr("global_symbol", f"dlight_{sfx}")
        tc, tile = ip.projection_for(spec, tgt, seq)
        if tile in (ip.FLAT, ip.TF32X3):   # the importer's tensor-core kernel (flat rows: same memory, other shapes)
            funcs[f"tc_{sfx}"] = tc.with_attr("global_symbol", f"tc_{sfx}")
        if tile == ip.TF32X3:
            from ..kernels.projection import tf32x3

            split = tf32x3.scheduled_split_func(I, ip.tf32x3_k(I), tgt)
            funcs[f"split_{sfx}"] = split.with_attr("global_symbol", f"split_{sfx}")
        index["configs"].append(dict(directions=D, batch=B, input=I, n=N, seq=seq, dtype=dtype, suffix=sfx,
                                     tc={ip.FLAT: "flat", ip.TF32X3: "tf32x3"}.get(tile, False)))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out_dir / f"{NAME}.so"))
    for e in index["configs"]:
        e["ptxas_tiled"] = report.get(f"tiled_{e['suffix']}_kernel", {})
        print(e["suffix"], e["ptxas_tiled"])
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    return out_dir


def run_one(mod, e) -> dict:
    import torch
    import tvm

    D, B, I, N, seq, dtype = e["directions"], e["batch"], e["input"], e["n"], e["seq"], e["dtype"]
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    X = torch.randn(seq, B, I, device="cuda", generator=g).to(tdt)
    W = (torch.randn(D, N, I, device="cuda", generator=g) * I ** -0.5).to(tdt)
    bias = torch.randn(D, N, device="cuda", generator=g)
    kinds = ("tiled", "dlight", "tc") if e.get("tc") else ("tiled", "dlight")
    outs = {k: torch.empty(D, seq, B, N, device="cuda") for k in kinds}
    tv = tvm.runtime.from_dlpack
    X2 = X.reshape(seq * B, I)
    calls = {k: (mod[f"{k}_{e['suffix']}"], [tv(X), tv(W), tv(bias), tv(outs[k])]) for k in kinds if k != "tc"}
    if e.get("tc") == "tf32x3":   # X split in every call (timed), W once (the importer's constant)
        calls["tc"] = (split_projection((mod[f"split_{e['suffix']}"], mod[f"tc_{e['suffix']}"]), X2, W, bias,
                                        outs["tc"].view(D, seq * B, N)), [])
    elif e.get("tc"):   # flat interface: X [seq * B, I] -> gate_i [D, seq * B, N], views of the same tensors
        calls["tc"] = (mod[f"tc_{e['suffix']}"], [tv(X2), tv(W), tv(bias), tv(outs["tc"].view(D, seq * B, N))])

    def peer():  # cuBLAS: the same GEMM per direction, float32 out (fp16 inputs: fp16 GEMM, then widened)
        return [(X2 @ W[d].T).float() + bias[d] for d in range(D)]

    for f, args in calls.values():
        f(*args)
    torch.cuda.synchronize()
    ref = torch.stack([(X2.double() @ W[d].double().T + bias[d].double()).reshape(seq, B, N) for d in range(D)])
    err = lambda a: float(((a.double() - ref).norm() / ref.norm()).item())  # noqa: E731
    row = dict(directions=D, batch=B, input=I, n=N, seq=seq, dtype=dtype, err_tiled=err(outs["tiled"]),
               err_dlight=err(outs["dlight"]), err_torch=err(torch.stack(peer()).reshape(D, seq, B, N)))
    flops = 2.0 * D * seq * B * I * N
    for k, (f, args) in calls.items():
        row[f"{k}_ms"] = time_cuda(lambda f=f, args=args: f(*args))
    row["torch_ms"] = time_cuda(peer)
    row["tiled_tflops"] = flops / row["tiled_ms"] / 1e9
    row["vs_dlight"] = row["dlight_ms"] / row["tiled_ms"]
    row["vs_torch"] = row["torch_ms"] / row["tiled_ms"]
    row["agree"] = row["err_tiled"] < (1e-3 if dtype == "float16" else 1e-5)
    if "tc" in calls:
        row.update(err_tc=err(outs["tc"]), tc_tflops=flops / row["tc_ms"] / 1e9, tc_vs_torch=row["torch_ms"] / row["tc_ms"])
        row["agree"] = row["agree"] and row["err_tc"] < (1e-3 if dtype == "float16" else 1e-5)
    return row


COLUMNS = ["directions", "batch", "input", "n", "dtype", "tiled_ms", "dlight_ms", "torch_ms", "tiled_tflops",
           "vs_dlight", "vs_torch", "tc_ms", "tc_tflops", "tc_vs_torch", "err_tiled", "err_torch", "agree"]


def run_prebuilt(prebuilt, out=None) -> list[dict]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False   # true fp32 on both sides
    root = Path(prebuilt)
    index = json.loads((root / "index.json").read_text())
    mod = PrebuiltModules(root).get(f"{NAME}.so")
    rows = []
    for e in index["configs"]:
        rows.append(run_one(mod, e))
        save(NAME, rows, out_dir=out, meta={"torch_tf32": False})
    print_table(rows, COLUMNS)
    save(NAME, rows, out_dir=out, meta={"torch_tf32": False},
         plot=ratio_bar_plot(rows, ("directions", "batch", "input", "dtype"), "vs_dlight",
                             "input projection: tiled template vs dlight"))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_run_arguments(parser)


def run(args) -> list[dict]:
    """`tvmseq bench input_projection`: --build DIR here, --prebuilt DIR on the GPU (`common.build_or_run`)."""
    return build_or_run(args, build, run_prebuilt, "tvmseq_proj_")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
