"""`tvmseq bench gru_stack`: a stack of GRU layers pipelined in one persistent kernel
(`kernels.recurrent.stack`) against the same layers run one after the other (per layer: tvmseq's input
projection GEMM + the persistent single-layer recurrence) and against cuDNN's multi-layer torch.nn.GRU,
all in one process, all checked against a float64 GRU.

  python3 -m tvmseq.bench.gru_stack --build out/stack       # here (TVM compiler, sm_90a SASS via nvcc)
  python3 -m tvmseq.bench.gru_stack --prebuilt out/stack    # GPU machine (TVM runtime + torch)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..measure import PrebuiltModules, compile_for_gpu, time_cuda
from .common import add_build_run_arguments, build_or_run, run_and_report

NAME = "gru_stack"
# (layers, hidden, batch, seq, dtype[, schedule knobs]); the first is the target (>= 2x over layer
# by layer). KSPLIT: the k-split engine (`stack`'s own schedule), its default and (not built by
# default: all slower on the H100, 2026-11-22) 64 blocks per layer (two per SM) and other chunkings
KSPLIT = [(4, 512, 8, 200, "float32"), (4, 512, 8, 200, "float16"), (4, 512, 1, 200, "float32"),
          (4, 512, 64, 200, "float32"), (2, 256, 8, 200, "float32"), (4, 256, 8, 200, "float32")]
KSPLIT_VARIANTS = [
           (4, 512, 8, 200, "float32", dict(num_blocks=64, num_warps=8, batch_chunk=2, smem_rows=42)),
           (4, 512, 8, 200, "float32", dict(num_blocks=64, num_warps=8, batch_chunk=1, smem_rows=27)),
           (4, 512, 8, 200, "float32", dict(num_blocks=32, num_warps=16, batch_chunk=1, smem_rows=84)),
           (4, 512, 1, 200, "float32", dict(num_blocks=64, num_warps=8, batch_chunk=1, smem_rows=27))]
# the row-split schedule (kernels/recurrent/rows.py): warps own units, lanes split k; {} = its default
_ROWS = dict(rows=True)
ROWS_CONFIGS = [(4, 512, 8, 200, "float32", _ROWS), (4, 512, 8, 200, "float16", _ROWS),
                (4, 512, 8, 200, "float32", dict(rows=True, blocks_per_layer=32, num_warps=8, batch_chunk=8, reg_rows=4)),
                (4, 512, 8, 200, "float32", dict(rows=True, blocks_per_layer=32, num_warps=16, batch_chunk=4, reg_rows=2)),
                (4, 512, 8, 200, "float32", dict(rows=True, blocks_per_layer=32, num_warps=8, batch_chunk=4, reg_rows=8)),
                (4, 512, 1, 200, "float32", _ROWS), (4, 512, 64, 200, "float32", _ROWS),
                (2, 256, 8, 200, "float32", _ROWS), (4, 256, 8, 200, "float32", _ROWS),
                (4, 256, 8, 200, "float32", dict(rows=True, blocks_per_layer=32, num_warps=4, batch_chunk=8, reg_rows=12)),
                # one layer: the row-split kernel against the k-split persistent GRU ("sequential") and cuDNN
                (1, 1024, 8, 200, "float32", _ROWS), (1, 1024, 1, 200, "float32", _ROWS),
                (1, 1024, 64, 200, "float32", _ROWS), (1, 512, 64, 200, "float32", _ROWS),
                (1, 256, 64, 200, "float32", _ROWS), (1, 512, 8, 200, "float32", _ROWS),
                (1, 1024, 8, 200, "float16", _ROWS), (1, 1024, 64, 200, "float16", _ROWS)]
# odd sizes, short sequences: correctness on the GPU (bench rows and `check_kernels`, which the gpu test
# and compute-sanitizer use: the stack kernel alone against the float64 numpy stack, launched twice)
ODD_CONFIGS = [(3, 37, 5, 23, "float32", _ROWS), (2, 100, 3, 17, "float32", _ROWS),
               (1, 257, 19, 11, "float32", _ROWS), (2, 64, 4, 9, "float16", _ROWS),
               (2, 100, 3, 17, "float32")]
CONFIGS = KSPLIT + ROWS_CONFIGS + ODD_CONFIGS


def numpy_stack(gi0, R, W, BI, rb_h, h0):
    """float64 stack of GRU layers (linear_before_reset=1, sigmoid/tanh) from the stack kernel's own inputs:
    every layer's sequence [L, T, B, H]."""
    import numpy as np

    L, T_, (_, B, H) = R.shape[0], gi0.shape[0], h0.shape
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    Y = np.zeros((L, T_, B, H))
    for l in range(L):
        gi = gi0.astype(np.float64) if l == 0 else Y[l - 1] @ W[l - 1].astype(np.float64).T + BI[l - 1]
        Rz, Rr, Rh = np.split(R[l].astype(np.float64), 3)
        h = h0[l].astype(np.float64)
        for s in range(T_):
            gz, gr, gh = np.split(gi[s], 3, axis=1)
            z, r = sig(gz + h @ Rz.T), sig(gr + h @ Rr.T)
            h = (1 - z) * np.tanh(gh + r * (h @ Rh.T + rb_h[l])) + z * h
            Y[l, s] = h
    return Y


def stack_inputs(L, B, H, T_, dtype, seed=0):
    """Random inputs of the stack kernel (numpy): gate_i0, R, W, bias_i, rb_h, h0 (|R|, |W| <= 1/sqrt(H))."""
    import numpy as np

    rng = np.random.default_rng(seed)
    k = H ** -0.5
    gi0 = rng.standard_normal((T_, B, 3 * H)).astype("float32")
    R = rng.uniform(-k, k, (L, 3 * H, H)).astype(dtype)
    W = rng.uniform(-k, k, (max(L - 1, 1), 3 * H, H)).astype(dtype)
    BI = (rng.standard_normal((max(L - 1, 1), 3 * H)) * 0.1).astype("float32")
    rb_h = (rng.standard_normal((L, H)) * 0.1).astype("float32")
    h0 = (rng.standard_normal((L, B, H)) * 0.5).astype("float32")
    return gi0, R, W, BI, rb_h, h0


def check_kernels(mod, index, launches: int = 2) -> list[str]:
    """Run every odd-size stack kernel of `index` alone on the GPU (no torch) `launches` times against the
    float64 numpy stack; returns one line per problem (empty: all correct)."""
    import numpy as np
    import tvm

    problems = []
    for e in index["configs"]:
        if not e.get("odd"):
            continue
        L, H, B, seq, dtype = e["layers"], e["hidden"], e["batch"], e["seq"], e["dtype"]
        inputs = stack_inputs(L, B, H, seq, dtype, seed=H + B)
        want = numpy_stack(*inputs)
        dev = tvm.cuda(0)
        tol = 2e-2 if dtype == "float16" else 1e-4
        for launch in range(launches):
            outs = [np.full((L, seq, B, H), np.nan, dtype), np.full((L, B, H), np.nan, dtype)]
            args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (*inputs, *outs)]
            mod[f"stack_{e['suffix']}"](*args)
            got_y, got_h = args[6].numpy().astype(np.float64), args[7].numpy().astype(np.float64)
            err = max(np.nanmax(np.abs(got_y - want)) if not np.isnan(got_y).any() else np.inf,
                      np.abs(got_h - want[:, -1]).max())
            print(f"check {e['suffix']} launch {launch}: max abs err {err:.3g}", flush=True)
            if not err <= tol:
                problems.append(f"{e['suffix']} launch {launch}: max abs err {err:.3g} > {tol}")
    return problems


def _suffix(c) -> str:
    L, H, B, seq, dtype = c[:5]
    knobs = c[5] if len(c) > 5 else {}
    if knobs.get("rows"):
        tag = "_rows" + "".join(f"_{k[0]}{v}" for k, v in knobs.items() if k != "rows")
    else:
        tag = "_g{num_blocks}w{num_warps}c{batch_chunk}s{smem_rows}".format(**knobs) if knobs else ""
    return f"l{L}_h{H}_b{B}_{dtype}{tag}"


def _config(c, target):
    """The schedule of a config: None (the k-split default), a PersistentConfig or a RowSplitConfig."""
    from ..kernels.recurrent.rows import RowSplitConfig, default_rows_config
    from ..kernels.recurrent_gemm import PersistentConfig

    knobs = dict(c[5]) if len(c) > 5 else {}
    if knobs.pop("rows", False):
        L, H, B = c[:3]
        return RowSplitConfig(**knobs) if knobs else default_rows_config(L, B, H, target)
    return PersistentConfig(**knobs) if knobs else None


def build(out_dir, target: str = "cuda", configs=None) -> Path:
    """Stack kernel + (input projection, single-layer persistent recurrence) per config, one .so."""
    from ..kernels.recurrent import gru, paths
    from ..kernels.recurrent import stack as ps
    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, {"benchmark": NAME, "configs": []}
    for c in configs or CONFIGS:
        L, H, B, seq, dtype = c[:5]
        cfg = _config(c, tgt)
        ok, why = ps.fits_on_chip(L, B, H, dtype, tgt, cfg)
        if not ok:
            print(f"skip {_suffix(c)}: {why}")
            continue
        sfx = _suffix(c)
        spec = gru.GruSpec(1, B, H, H, dtype, linear_before_reset=1, direction="forward")
        rec, path, _ = paths.recurrence_func_auto(spec, tgt)
        funcs[f"stack_{sfx}"] = ps.stacked_gru_func(L, B, H, dtype, tgt, config=cfg).with_attr(
            "global_symbol", f"stack_{sfx}")
        funcs[f"proj_{sfx}"] = gru.schedule_input_projection(gru.input_projection_func(spec), tgt)["main"].with_attr(
            "global_symbol", f"proj_{sfx}")
        funcs[f"rec_{sfx}"] = rec.with_attr("global_symbol", f"rec_{sfx}")
        index["configs"].append(dict(layers=L, hidden=H, batch=B, seq=seq, dtype=dtype, suffix=sfx, layer_path=path,
                                     odd=c in ODD_CONFIGS,
                                     stack_config=str(cfg or ps.default_stack_config(L, B, H, dtype, tgt))))
    t0 = time.time()
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out_dir / f"{NAME}.so"))
    for e in index["configs"]:
        e["ptxas_stack"] = report.get(f"stack_{e['suffix']}_kernel", {})
        print(e["suffix"], e["stack_config"], e["ptxas_stack"])
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(funcs)} functions in {time.time() - t0:.0f}s -> {out_dir}")
    return out_dir


def _schedule_tag(config: str) -> str:
    """'rows b32 n8 b8 r6' / 'ksplit b32 w8 c2 s60' from a config's repr (a short plot label)."""
    import re

    kind = "rows" if config.startswith("RowSplit") else "ksplit"
    return " ".join([kind] + [k[0] + v for k, v in re.findall(r"(\w+)=(\d+)", config)])


def run_one(mod, e) -> dict:
    import torch
    import tvm

    from .gru import _torch_weights_from_onnx

    L, H, B, seq, dtype = e["layers"], e["hidden"], e["batch"], e["seq"], e["dtype"]
    sfx, dev, tdt = e["suffix"], "cuda", getattr(torch, e["dtype"])
    g = torch.Generator(device=dev).manual_seed(0)
    u = lambda *s: (torch.rand(*s, device=dev, generator=g) * 2 - 1) * H ** -0.5  # noqa: E731
    W, R, Bias = u(L, 3 * H, H), u(L, 3 * H, H), u(L, 6 * H)     # ONNX layout per layer (gates z, r, h)
    X = torch.randn(seq, B, H, device=dev, generator=g)
    h0 = torch.randn(L, B, H, device=dev, generator=g) * 0.5
    bias_i = (Bias[:, :3 * H] + torch.cat([Bias[:, 3 * H:5 * H], torch.zeros(L, H, device=dev)], 1)).contiguous()
    rb_h = Bias[:, 5 * H:].clone()
    Wt, Rt, Xt = W.to(tdt).contiguous(), R.to(tdt).contiguous(), X.to(tdt).contiguous()
    tv = lambda t: tvm.runtime.from_dlpack(t)  # noqa: E731
    proj, rec, stack = mod[f"proj_{sfx}"], mod[f"rec_{sfx}"], mod[f"stack_{sfx}"]

    # pipelined: layer 0's projection, then every layer in one kernel
    gate_i0 = torch.empty(1, seq, B, 3 * H, device=dev)
    Ys, Yhs = torch.empty(L, seq, B, H, device=dev, dtype=tdt), torch.empty(L, B, H, device=dev, dtype=tdt)
    # clone(), not contiguous(): a slice is already contiguous, and its data pointer (odd H) is not
    # 64-byte aligned, which TVM's DLPack import rejects
    W_rest = Wt[1:].clone() if L > 1 else Wt[:1].clone()
    BI_rest = bias_i[1:].clone() if L > 1 else bias_i[:1].clone()
    s_args = [tv(t) for t in (gate_i0[0], Rt, W_rest, BI_rest, rb_h, h0.contiguous(), Ys, Yhs)]
    p0 = [tv(t) for t in (Xt, Wt[:1], bias_i[:1], gate_i0)]

    def stacked():
        proj(*p0)
        stack(*s_args)

    # layer by layer: projection + persistent recurrence per layer
    lens = torch.full((B,), seq, dtype=torch.int32, device=dev)
    gate_i = torch.empty(1, seq, B, 3 * H, device=dev)
    Yl = [torch.empty(seq, 1, B, H, device=dev, dtype=tdt) for _ in range(L)]
    Yhl = [torch.empty(1, B, H, device=dev, dtype=tdt) for _ in range(L)]
    layer_args = []
    for l in range(L):
        x = Xt if l == 0 else Yl[l - 1].view(seq, B, H)
        layer_args.append(([tv(t) for t in (x, Wt[l:l + 1].clone(), bias_i[l:l + 1].clone(), gate_i)],
                           [tv(t) for t in (gate_i, Rt[l:l + 1].clone(), rb_h[l:l + 1].clone(), lens, h0[l:l + 1].clone(),
                                            Yl[l], Yhl[l])]))

    def sequential():
        for pa, ra in layer_args:
            proj(*pa)
            rec(*ra)

    # peer: cuDNN multi-layer GRU with the same weights
    gru = torch.nn.GRU(H, H, num_layers=L).to(dev).to(tdt)
    w_ih, w_hh, b_ih, b_hh = _torch_weights_from_onnx(W, R, Bias, H)
    with torch.no_grad():
        for l in range(L):
            for name, val in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih), ("bias_hh", b_hh)):
                getattr(gru, f"{name}_l{l}").copy_(val[l])
    h0t = h0.to(tdt)

    def peer():
        with torch.no_grad():
            return gru(Xt, h0t)

    stacked()
    sequential()
    torch.cuda.synchronize()
    peer_y, _ = peer()
    gru64 = torch.nn.GRU(H, H, num_layers=L).to(dev).double()
    gru64.load_state_dict({k: v.double() for k, v in gru.state_dict().items()})
    with torch.no_grad():
        ref_y, ref_h = gru64(Xt.double(), h0t.double())
    err = lambda a, b: float(((a.double() - b).norm() / b.norm()).item())  # noqa: E731
    row = dict(layers=L, hidden=H, batch=B, seq=seq, dtype=dtype, schedule=_schedule_tag(e["stack_config"]),
               stack_config=e["stack_config"],
               err_stacked=err(Ys[-1], ref_y), err_stacked_h=err(Yhs, ref_h), err_sequential=err(Yl[-1][:, 0], ref_y),
               err_cudnn=err(peer_y, ref_y), cudnn_tf32=bool(torch.backends.cudnn.allow_tf32) and dtype == "float32")
    row["stacked_us_step"] = time_cuda(stacked, warmup=3, iters=10) * 1e3 / seq
    row["sequential_us_step"] = time_cuda(sequential, warmup=3, iters=10) * 1e3 / seq
    row["cudnn_us_step"] = time_cuda(peer, warmup=3, iters=10) * 1e3 / seq
    row["vs_sequential"] = row["sequential_us_step"] / row["stacked_us_step"]
    row["vs_cudnn"] = row["cudnn_us_step"] / row["stacked_us_step"]
    tol = 2e-2 if dtype == "float16" else 1e-3
    row["agree"] = row["err_stacked"] < tol and row["err_stacked_h"] < tol
    return row


COLUMNS = ["layers", "hidden", "batch", "seq", "dtype", "schedule", "stacked_us_step", "sequential_us_step", "cudnn_us_step",
           "vs_sequential", "vs_cudnn", "err_stacked", "err_sequential", "err_cudnn", "agree"]


def run_prebuilt(prebuilt, out=None) -> list[dict]:
    root = Path(prebuilt)
    index = json.loads((root / "index.json").read_text())
    mod = PrebuiltModules(root).get(f"{NAME}.so")
    return run_and_report(NAME, index["configs"], lambda e: run_one(mod, e), COLUMNS,
                          ("layers", "hidden", "batch", "dtype", "schedule"),
                          "GRU stack: pipelined kernel vs the same layers one by one", out=out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_run_arguments(parser)


def run(args) -> list[dict]:
    """`tvmseq bench gru_stack`: --build DIR here, --prebuilt DIR on the GPU (`common.build_or_run`)."""
    return build_or_run(args, build, run_prebuilt, "tvmseq_stack_")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
