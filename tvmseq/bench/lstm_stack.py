"""`tvmseq bench lstm_stack`: a stack of forward LSTM layers pipelined in one persistent kernel
(`kernels.recurrent.stack.stacked_lstm_func`, row-split schedule) against the same layers run one after the
other (per layer: tvmseq's input projection, the importer's, + the single-layer LSTM recurrence that
`paths.lstm_recurrence_auto` picks) and against cuDNN's multi-layer torch.nn.LSTM (TF32 off), all
in one process, all checked against a float64 torch LSTM.

  python3 -m tvmseq.bench.lstm_stack --build out/lstm_stack       # here (TVM compiler, sm_90a SASS via nvcc)
  python3 -m tvmseq.bench.lstm_stack --prebuilt out/lstm_stack    # GPU machine (TVM runtime + torch)

The odd-size configs are correctness checks of the stack kernel alone (`check_kernels`, run by the gpu test
of tests/test_persistent_lstm_stack.py) against `tvmseq.reference.lstm` applied layer by layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..measure import PrebuiltModules, compile_for_gpu, time_cuda
from . import gru as gru_bench
from .common import add_build_run_arguments, build_or_run, run_and_report

NAME = "lstm_stack"
ROUNDS, ITERS = 3, 10   # alternating timing rounds (pipelined, layer by layer, cuDNN), CUDA-event runs per round
# (layers, hidden, batch, seq, dtype); the first is the target (>= 2x over layer by layer)
BENCH_CONFIGS = [(2, 512, 8, 200, "float32"), (2, 512, 8, 200, "float16"), (2, 512, 1, 200, "float32"),
                 (2, 512, 64, 200, "float32"), (2, 256, 8, 200, "float32"), (3, 512, 8, 200, "float32"),
                 (4, 256, 8, 200, "float32")]
# odd sizes, short sequences, the cell's options: the stack kernel alone against the layer-by-layer reference
# (layers, hidden, batch, seq, dtype, options of stacked_lstm_func)
ODD_CONFIGS = [(3, 37, 5, 23, "float32", {}), (2, 100, 3, 17, "float32", dict(has_peepholes=True, clip=1.5)),
               (2, 257, 19, 11, "float32", {}), (2, 64, 4, 9, "float16", dict(input_forget=True)),
               (2, 37, 67, 7, "float32", dict(has_peepholes=True))]


# ---- the stack's inputs and its float64 reference (numpy; used by the CPU test too) --------------------

def onnx_layers(L, B, H, I, T_, seed, peepholes=False):
    """Random ONNX-layout weights of L forward LSTM layers (W [1, 4H, in], R [1, 4H, H], B [1, 8H], P [1, 3H]
    or None), X [T, B, I] and initial states h0, c0 [L, B, H], all float64."""
    import numpy as np

    rng = np.random.default_rng(seed)
    k = H ** -0.5
    layers = []
    for l in range(L):
        size = I if l == 0 else H
        layers.append(dict(W=rng.uniform(-k, k, (1, 4 * H, size)), R=rng.uniform(-k, k, (1, 4 * H, H)),
                           B=rng.standard_normal((1, 8 * H)) * 0.3,
                           P=rng.standard_normal((1, 3 * H)) * 0.5 if peepholes else None))
    X = rng.standard_normal((T_, B, I))
    h0, c0 = rng.standard_normal((L, B, H)) * 0.5, rng.standard_normal((L, B, H)) * 0.5
    return layers, X, h0, c0


def reference_stack(layers, X, h0, c0, **attrs):
    """tvmseq.reference.lstm layer by layer (attrs: its keyword options, shared by every layer):
    (Y [L, T, B, H], Y_h [L, B, H], Y_c [L, B, H]) in float64."""
    import numpy as np

    from ..reference.lstm import lstm

    Ys, Yhs, Ycs, x = [], [], [], X
    for l, p in enumerate(layers):
        y, y_h, y_c = lstm(x, p["W"], p["R"], p["B"], initial_h=h0[l:l + 1], initial_c=c0[l:l + 1], P=p["P"], **attrs)
        Ys.append(y[:, 0])
        Yhs.append(y_h[0])
        Ycs.append(y_c[0])
        x = y[:, 0]
    return np.stack(Ys), np.stack(Yhs), np.stack(Ycs)


def kernel_inputs(layers, X, h0, c0, dtype):
    """The stack kernel's arguments from ONNX-layout layers: layer 0's projection X W0^T + Wb0 + Rb0 (float32),
    R, W of layers 1.. (one unused zero layer when L == 1), their folded biases Wb + Rb, P, h0, c0."""
    import numpy as np

    H, L = layers[0]["R"].shape[-1], len(layers)
    fold = lambda p: p["B"][0, :4 * H] + p["B"][0, 4 * H:]  # noqa: E731
    gi0 = (X @ layers[0]["W"][0].T + fold(layers[0])).astype("float32")
    R = np.concatenate([p["R"] for p in layers]).astype(dtype)
    rest = layers[1:] or layers[:1]
    W = np.concatenate([p["W"] if L > 1 else np.zeros((1, 4 * H, H)) for p in rest]).astype(dtype)
    BI = np.stack([fold(p) for p in rest]).astype("float32")
    P = np.stack([p["P"][0] if p["P"] is not None else np.zeros(3 * H) for p in layers]).astype("float32")
    return [gi0, R, W, BI, P, h0.astype("float32"), c0.astype("float32")]


def check_kernels(mod, index, launches: int = 2) -> list[str]:
    """Run every odd-size stack kernel of `index` alone on the GPU (no torch) `launches` times against the
    layer-by-layer float64 reference; returns one line per problem (empty: all correct)."""
    import numpy as np
    import tvm

    problems = []
    for e in index["configs"]:
        if not e.get("odd"):
            continue
        L, H, B, seq, dtype, opts = e["layers"], e["hidden"], e["batch"], e["seq"], e["dtype"], e["options"]
        layers, X, h0, c0 = onnx_layers(L, B, H, H, seq, seed=H + B, peepholes=opts.get("has_peepholes", False))
        want = reference_stack(layers, X, h0, c0, clip=opts.get("clip"), input_forget=int(opts.get("input_forget", 0)))
        inputs = kernel_inputs(layers, X, h0, c0, dtype)
        dev = tvm.cuda(0)
        tol = 2e-2 if dtype == "float16" else 1e-4
        for launch in range(launches):
            outs = [np.full((L, seq, B, H), np.nan, dtype), np.full((L, B, H), np.nan, dtype),
                    np.full((L, B, H), np.nan, dtype)]
            args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in (*inputs, *outs)]
            mod[f"stack_{e['suffix']}"](*args)
            got = [a.numpy().astype(np.float64) for a in args[-3:]]
            err = max(float(np.abs(g - w).max()) if not np.isnan(g).any() else np.inf for g, w in zip(got, want))
            print(f"check {e['suffix']} launch {launch}: max abs err {err:.3g}", flush=True)
            if not err <= tol:
                problems.append(f"{e['suffix']} launch {launch}: max abs err {err:.3g} > {tol}")
    return problems


# ---- build (here) ----------------------------------------------------------------------------------------

def _suffix(c) -> str:
    L, H, B, seq, dtype = c[:5]
    opts = c[5] if len(c) > 5 else {}
    tag = "".join(f"_{k[0]}{int(v) if isinstance(v, bool) else v}" for k, v in sorted(opts.items()))
    return f"l{L}_h{H}_b{B}_t{seq}_{dtype}{tag}".replace(".", "p")


def _layer_funcs(B, H, seq, dtype, target, sfx) -> tuple[dict, str, str, object]:
    """The single-layer kernels of the layer-by-layer side ({name: prim_func}, recurrence path, why, projection
    row tile): the importer's input projection and the recurrence `lstm_recurrence_auto` picks."""
    from ..kernels.projection import gemm as ip
    from ..kernels.recurrent import lstm, paths

    spec = lstm.LstmSpec(1, B, H, H, dtype, direction="forward")
    proj, tile = ip.projection_for(spec, target, seq)
    rec, path, why = paths.lstm_recurrence_auto(spec, target)
    if rec is None:
        rec = lstm.recurrence_func(spec, target)
    return ({**gru_bench.projection_funcs(proj, tile, spec, sfx, target),
             f"rec_{sfx}": rec.with_attr("global_symbol", f"rec_{sfx}")}, path, why, tile)


def build(out_dir, target: str = "cuda", configs=None) -> Path:
    """Stack kernel per config; for the timed configs also the layer's projection and recurrence. One .so."""
    from ..kernels.recurrent import stack as ps
    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, {"benchmark": NAME, "configs": []}
    for c in configs or (BENCH_CONFIGS + ODD_CONFIGS):
        L, H, B, seq, dtype = c[:5]
        opts, odd, sfx = (c[5] if len(c) > 5 else {}), len(c) > 5, _suffix(c)
        ok, why = ps.lstm_fits_on_chip(L, B, H, dtype, tgt)
        if not ok:
            print(f"skip {sfx}: {why}")
            continue
        funcs[f"stack_{sfx}"] = ps.stacked_lstm_func(L, B, H, dtype, tgt, **opts).with_attr(
            "global_symbol", f"stack_{sfx}")
        entry = dict(layers=L, hidden=H, batch=B, seq=seq, dtype=dtype, suffix=sfx, odd=odd, options=opts,
                     stack_config=str(ps.default_lstm_config(L, B, H, tgt)))
        if not odd:
            layer, path, why, tile = _layer_funcs(B, H, seq, dtype, tgt, sfx)
            funcs.update(layer)
            entry.update(layer_path=path, layer_path_why=why, proj_rows=tile)
        index["configs"].append(entry)
    t0 = time.time()
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out_dir / f"{NAME}.so"))
    for e in index["configs"]:
        e["ptxas_stack"] = report.get(f"stack_{e['suffix']}_kernel", {})
        print(e["suffix"], e["stack_config"], e.get("layer_path"), e["ptxas_stack"])
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, default=str))
    size = (out_dir / f"{NAME}.so").stat().st_size
    print(f"built {len(funcs)} functions in {time.time() - t0:.0f}s -> {out_dir} ({size / 2**20:.1f} MiB)")
    return out_dir


# ---- run (GPU) -------------------------------------------------------------------------------------------

def run_one(mod, e) -> dict:
    import torch
    import tvm

    from . import gru as gru_bench
    from .persistent_lstm import _torch_weights_from_onnx

    L, H, B, seq, dtype = e["layers"], e["hidden"], e["batch"], e["seq"], e["dtype"]
    sfx, dev, tdt = e["suffix"], "cuda", getattr(torch, e["dtype"])
    g = torch.Generator(device=dev).manual_seed(0)
    u = lambda *s: (torch.rand(*s, device=dev, generator=g) * 2 - 1) * H ** -0.5  # noqa: E731
    W, R, Bias = u(L, 4 * H, H), u(L, 4 * H, H), u(L, 8 * H)     # ONNX layout per layer (gates i, o, f, c)
    X = torch.randn(seq, B, H, device=dev, generator=g)
    h0 = torch.randn(L, B, H, device=dev, generator=g) * 0.5
    c0 = torch.randn(L, B, H, device=dev, generator=g) * 0.5
    bias_i = (Bias[:, :4 * H] + Bias[:, 4 * H:]).contiguous()     # every LSTM bias folds into the projection
    Wt, Rt, Xt = W.to(tdt).contiguous(), R.to(tdt).contiguous(), X.to(tdt).contiguous()
    tv = lambda t: tvm.runtime.from_dlpack(t)  # noqa: E731
    proj, rec, stack = gru_bench.projection_of(mod, sfx, e.get("proj_rows")), mod[f"rec_{sfx}"], mod[f"stack_{sfx}"]
    P = torch.zeros(L, 3 * H, device=dev)                         # torch.nn.LSTM has no peepholes

    def projection(x, l):
        """(run, gate_i as the recurrence reads it, a [1, seq, B, 4H] tvm tensor): the importer's projection."""
        gate_i = torch.empty(1, seq, B, 4 * H, device=dev)
        args = [tv(t) for t in (x, Wt[l:l + 1].clone(), bias_i[l:l + 1].clone(), gate_i)]
        run = gru_bench._projection(proj, e.get("proj_rows"), args, x, gate_i, bias_i[l:l + 1], seq, B, 1, H)
        return run, args[3]

    # pipelined: layer 0's projection, then every layer in one kernel
    project0, gi0 = projection(Xt, 0)
    gi0_flat = tv(torch.from_dlpack(gi0).view(seq, B, 4 * H))
    Ys = torch.empty(L, seq, B, H, device=dev, dtype=tdt)
    Yhs, Ycs = (torch.empty(L, B, H, device=dev, dtype=tdt) for _ in range(2))
    # clone(), not contiguous(): a slice's data pointer (odd H) need not be 64-byte aligned, as DLPack import wants
    W_rest = Wt[1:].clone() if L > 1 else Wt[:1].clone()
    BI_rest = bias_i[1:].clone() if L > 1 else bias_i[:1].clone()
    s_args = [gi0_flat] + [tv(t) for t in (Rt, W_rest, BI_rest, P, h0.contiguous(), c0.contiguous(), Ys, Yhs, Ycs)]

    def stacked():
        project0()
        stack(*s_args)

    # layer by layer: projection + single-layer recurrence per layer, each reading the layer below's Y
    lens = torch.full((B,), seq, dtype=torch.int32, device=dev)
    Yl = [torch.empty(seq, 1, B, H, device=dev, dtype=tdt) for _ in range(L)]
    Yhl = [torch.empty(1, B, H, device=dev, dtype=tdt) for _ in range(L)]
    Ycl = [torch.empty(1, B, H, device=dev, dtype=tdt) for _ in range(L)]
    layers = []
    for l in range(L):
        run, gi = projection(Xt if l == 0 else Yl[l - 1].view(seq, B, H), l)
        layers.append((run, [gi] + [tv(t) for t in (Rt[l:l + 1].clone(), P[:1].clone(), lens, h0[l:l + 1].clone(),
                                                    c0[l:l + 1].clone(), Yl[l], Yhl[l], Ycl[l])]))

    def sequential():
        for run, ra in layers:
            run()
            rec(*ra)

    # peer: cuDNN multi-layer LSTM with the same weights
    lstm = torch.nn.LSTM(H, H, num_layers=L).to(dev).to(tdt)
    w_ih, w_hh, b_ih, b_hh = _torch_weights_from_onnx(W, R, Bias, H)
    with torch.no_grad():
        for l in range(L):
            for name, val in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih), ("bias_hh", b_hh)):
                getattr(lstm, f"{name}_l{l}").copy_(val[l])
    h0t, c0t = h0.to(tdt), c0.to(tdt)

    def peer():
        with torch.no_grad():
            return lstm(Xt, (h0t, c0t))

    for fn in (stacked, sequential):   # one at a time first: a hang shows up here, attributed to this config
        fn()
        torch.cuda.synchronize()
    peer_y, _ = peer()
    lstm64 = torch.nn.LSTM(H, H, num_layers=L).to(dev).double()
    lstm64.load_state_dict({k: v.double() for k, v in lstm.state_dict().items()})
    with torch.no_grad():
        ref_y, (ref_h, ref_c) = lstm64(Xt.double(), (h0t.double(), c0t.double()))
    err = lambda a, b: float(((a.double() - b).norm() / b.norm()).item())  # noqa: E731
    row = dict(layers=L, hidden=H, batch=B, seq=seq, dtype=dtype, stack_config=e["stack_config"],
               layer_path=e["layer_path"], err_stacked=err(Ys[-1], ref_y), err_stacked_h=err(Yhs, ref_h),
               err_stacked_c=err(Ycs, ref_c), err_sequential=err(Yl[-1][:, 0], ref_y), err_cudnn=err(peer_y, ref_y),
               cudnn_tf32=bool(torch.backends.cudnn.allow_tf32) and dtype == "float32")
    times = {"stacked": [], "sequential": [], "cudnn": []}
    for _ in range(ROUNDS):
        for key, fn in (("stacked", stacked), ("sequential", sequential), ("cudnn", peer)):
            times[key].append(time_cuda(fn, warmup=3, iters=ITERS) * 1e3 / seq)
    for key, ts in times.items():
        row[f"{key}_us_step"] = statistics.median(ts)
        row[f"{key}_us_range"] = [min(ts), max(ts)]
    row["vs_sequential"] = row["sequential_us_step"] / row["stacked_us_step"]
    row["vs_cudnn"] = row["cudnn_us_step"] / row["stacked_us_step"]
    tol = 2e-2 if dtype == "float16" else 1e-3
    row["agree"] = max(row["err_stacked"], row["err_stacked_h"], row["err_stacked_c"]) < tol
    return row


COLUMNS = ["layers", "hidden", "batch", "seq", "dtype", "layer_path", "stacked_us_step", "sequential_us_step",
           "cudnn_us_step", "vs_sequential", "vs_cudnn", "err_stacked", "err_sequential", "err_cudnn", "agree"]


def run_prebuilt(prebuilt, out=None) -> list[dict]:
    root = Path(prebuilt)
    index = json.loads((root / "index.json").read_text())
    mod = PrebuiltModules(root).get(f"{NAME}.so")
    problems = check_kernels(mod, index)
    print("odd-size stack kernels:", "all correct" if not problems else problems, flush=True)
    meta = {"peer": "torch.nn.LSTM(num_layers=L) (cuDNN, TF32 off)", "odd_size_checks": problems or "all correct",
            "note": "stacked = layer 0's input projection + the pipelined stack kernel; sequential = per layer the "
                    "importer's input projection + the single-layer recurrence lstm_recurrence_auto picks"}
    import torch

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return run_and_report(NAME, [e for e in index["configs"] if not e.get("odd")], lambda e: run_one(mod, e), COLUMNS,
                          ("layers", "hidden", "batch", "dtype"),
                          "LSTM stack: pipelined kernel vs the same layers one by one", meta, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_build_run_arguments(parser)


def run(args) -> list[dict]:
    """`tvmseq bench lstm_stack`: --build DIR here, --prebuilt DIR on the GPU (`common.build_or_run`)."""
    return build_or_run(args, build, run_prebuilt, "tvmseq_lstm_stack_")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
