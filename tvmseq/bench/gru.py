"""`tvmseq bench gru`: tvmseq's GRU kernels against torch.nn.GRU (cuDNN) in the same process.

Grid: hidden {256, 512, 1024} x batch {1, 8, 64, 256} x seq 100, unidirectional and bidirectional,
fp32 and fp16, linear_before_reset=1 (PyTorch's GRU). Both run on the same inputs; outputs are compared
with each other and, for fp32, with a float64 GRU, and the TF32 setting of the peer is recorded.
Kernels are built on the machine with TVM's compiler (`build_for_gpu`, `--prebuilt DIR` loads them where
only TVM's runtime is installed).
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from .common import print_table, ratio_bar_plot, save, time_cuda

HIDDEN, BATCH, SEQ = (256, 512, 1024), (1, 8, 64, 256), 100
QUICK_HIDDEN, QUICK_BATCH = (256, 1024), (1, 64)


def configs(quick: bool = False):
    hs, bs = (QUICK_HIDDEN, QUICK_BATCH) if quick else (HIDDEN, BATCH)
    for dtype, bidir, hidden, batch in itertools.product(("float32", "float16"), (False, True), hs, bs):
        yield {"dtype": dtype, "bidirectional": bidir, "hidden": hidden, "batch": batch}


def _name(c) -> str:
    return f"gru_{c['dtype']}_{'bi' if c['bidirectional'] else 'uni'}_h{c['hidden']}_b{c['batch']}"


def _spec(c):
    from ..kernels import gru

    D = 2 if c["bidirectional"] else 1
    return gru.GruSpec(D, c["batch"], c["hidden"], c["hidden"], c["dtype"], linear_before_reset=1,
                       direction="bidirectional" if D == 2 else "forward")


def build_module(c, target):
    """One module holding both kernels of the config (input projection + recurrence)."""
    import tvm

    from ..kernels import gru

    spec = _spec(c)
    proj = gru.schedule_input_projection(gru.input_projection_func(spec), target)["main"]
    mod = tvm.IRModule({"gru_input_projection": proj, "gru_recurrence": gru.recurrence_func(spec, target)})
    return tvm.compile(mod, target=target)


def build_for_gpu(out_dir, quick: bool = False) -> Path:
    """Build every config's module for CUDA here and export it to out_dir (+ index.json)."""
    from .. import targets

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = targets.resolve("cuda")
    index = []
    for c in configs(quick):
        build_module(c, target).export_library(str(out_dir / f"{_name(c)}.so"))
        index.append(c)
    (out_dir / "gru_index.json").write_text(json.dumps(index))
    return out_dir


def _load(c, prebuilt):
    import tvm

    if prebuilt:
        return tvm.runtime.load_module(str(Path(prebuilt) / f"{_name(c)}.so"))
    from .. import targets

    return build_module(c, targets.resolve("cuda"))


def _torch_weights_from_onnx(W, R, B, H):
    """ONNX gate order z, r, h -> PyTorch's r, z, n (per direction)."""
    import torch

    perm = torch.cat([torch.arange(H, 2 * H), torch.arange(0, H), torch.arange(2 * H, 3 * H)])
    return W[:, perm], R[:, perm], B[:, :3 * H][:, perm], B[:, 3 * H:][:, perm]


def run_one(c, prebuilt=None, seq: int = SEQ) -> dict:
    import torch
    import tvm

    H, Bt, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    tdt = getattr(torch, c["dtype"])
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = H ** -0.5
    u = lambda *s: (torch.rand(*s, device=dev, generator=g) * 2 - 1) * k  # noqa: E731
    W, R, Bias = u(D, 3 * H, H), u(D, 3 * H, H), u(D, 6 * H)
    X = torch.randn(seq, Bt, H, device=dev, generator=g)
    h0 = torch.randn(D, Bt, H, device=dev, generator=g) * 0.5

    # tvmseq: biases folded as the importer does (linear_before_reset=1: Rb_h stays in the recurrence)
    bias_i = (Bias[:, :3 * H] + torch.cat([Bias[:, 3 * H:5 * H], torch.zeros(D, H, device=dev)], 1)).contiguous()
    rb_h = Bias[:, 5 * H:].contiguous()
    lens = torch.full((Bt,), seq, dtype=torch.int32, device=dev)
    gate_i = torch.empty(D, seq, Bt, 3 * H, device=dev)
    Y = torch.empty(seq, D, Bt, H, device=dev, dtype=tdt)
    Y_h = torch.empty(D, Bt, H, device=dev, dtype=tdt)
    Xc, Wc, Rc = X.to(tdt).contiguous(), W.to(tdt).contiguous(), R.to(tdt).contiguous()
    tv = [tvm.runtime.from_dlpack(t) for t in (Xc, Wc, bias_i, gate_i, Rc, rb_h, lens, h0.contiguous(), Y, Y_h)]
    mod = _load(c, prebuilt)
    proj, rec = mod["gru_input_projection"], mod["gru_recurrence"]

    def tvmseq_run():
        proj(tv[0], tv[1], tv[2], tv[3])
        rec(tv[3], tv[4], tv[5], tv[6], tv[7], tv[8], tv[9])

    # peer: torch.nn.GRU (cuDNN), same weights
    gru = torch.nn.GRU(H, H, bidirectional=D == 2).to(dev).to(tdt)
    w_ih, w_hh, b_ih, b_hh = _torch_weights_from_onnx(W, R, Bias, H)
    with torch.no_grad():
        for d in range(D):
            sfx = "_reverse" if d else ""
            getattr(gru, f"weight_ih_l0{sfx}").copy_(w_ih[d])
            getattr(gru, f"weight_hh_l0{sfx}").copy_(w_hh[d])
            getattr(gru, f"bias_ih_l0{sfx}").copy_(b_ih[d])
            getattr(gru, f"bias_hh_l0{sfx}").copy_(b_hh[d])
    Xt, h0t = X.to(tdt), h0.to(tdt)

    def peer_run():
        with torch.no_grad():
            return gru(Xt, h0t)

    tvmseq_run()
    torch.cuda.synchronize()
    peer_y, peer_h = peer_run()
    # float64 truth (torch's GRU in double on the GPU)
    gru64 = torch.nn.GRU(H, H, bidirectional=D == 2).to(dev).double()
    gru64.load_state_dict({k_: v.double() for k_, v in gru.state_dict().items()})
    with torch.no_grad():
        ref_y, ref_h = gru64(X.to(tdt).double(), h0.to(tdt).double())
    ours_y = Y.permute(0, 2, 1, 3).reshape(seq, Bt, D * H).double()
    err = lambda a, b: float(((a - b).norm() / b.norm()).item())  # noqa: E731
    row = dict(c)
    row.update(seq=seq, err_tvmseq=err(ours_y, ref_y), err_peer=err(peer_y.double(), ref_y),
               max_diff_vs_peer=float((ours_y - peer_y.double()).abs().max().item()),
               peer_tf32=bool(torch.backends.cudnn.allow_tf32) and c["dtype"] == "float32")
    row["tvmseq_us_step"] = time_cuda(tvmseq_run, warmup=3, iters=10) * 1e3 / seq
    row["cudnn_us_step"] = time_cuda(peer_run, warmup=3, iters=10) * 1e3 / seq
    row["speedup"] = row["cudnn_us_step"] / row["tvmseq_us_step"]
    tol = 2e-2 if c["dtype"] == "float16" else 1e-3
    row["agree"] = row["err_tvmseq"] < tol
    return row


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a 16-row subset of the grid")
    parser.add_argument("--prebuilt", default=None, help="directory of modules from build_for_gpu")
    parser.add_argument("--build-only", metavar="DIR", default=None,
                        help="only build the CUDA modules into DIR (no GPU needed)")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")


def run(args) -> list[dict]:
    if getattr(args, "build_only", None):
        print(f"built modules in {build_for_gpu(args.build_only, args.quick)}")
        return []
    rows = []
    cols = ["dtype", "bidirectional", "hidden", "batch", "tvmseq_us_step", "cudnn_us_step", "speedup",
            "err_tvmseq", "err_peer", "agree"]
    meta = {"peer": "torch.nn.GRU (cuDNN)", "seq": SEQ,
            "note": "per-step path (input GEMM + per-step GEMM and gate kernels)"}
    for c in configs(args.quick):
        rows.append(run_one(c, args.prebuilt))
        print_table(rows[-1:], cols)
        save("gru", rows, meta, None, args.out)  # keep what was measured if the run is cut short
    print()
    print_table(rows, cols)
    save("gru", rows, meta, ratio_bar_plot(rows, ["dtype", "bidirectional", "hidden", "batch"], "speedup",
                                           "tvmseq GRU (per-step path) vs cuDNN: speedup per config"), args.out)
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
