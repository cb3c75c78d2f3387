"""Diagnose the persistent GRU's lost hand-off (configs that hung on the H100) by building the same
kernel with different hand-off knobs and running each, in its own process with a deadline, several
times against a float64 torch reference.

  python3 scripts/pgru_diag.py build out/diag      # here: TVM compiler, nvcc for sm_90a SASS
  python3 scripts/pgru_diag.py run out/diag        # GPU machine: TVM runtime + torch

Knobs (recurrent_gemm.PollOptions / persistent_gru_func(slots=...)): LL slots per buffer, nanosleep
back-off between polls, __syncwarp after a wait; every variant reports a giving-up poll from any lane.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [  # (D, B, H, dtype): the first four hung in session 1's benchmark, the last ran fine
    (1, 64, 512, "float32"), (1, 64, 1024, "float32"), (2, 8, 256, "float32"),
]
VARIANTS = {  # name: (slots, PollOptions kwargs, persistent_gru_func kwargs)
    "base": (2, {"warp_uniform": False}, {}),   # session 1 kernels: hung on the H100
    "uniform": (2, {}, {}),   # the fix, now the default: passed every config
    "uni_swb": (2, {}, {"syncwarp_before_barrier": True}),
    "acqrel": (2, {"warp_uniform": False, "order": "acqrel"}, {}),
    "single": (2, {"warp_uniform": False}, {"paired_buffers": False}),
    "all": (4, {"order": "acqrel"}, {"paired_buffers": False, "syncwarp_before_barrier": True}),
}
SEQ, LAUNCHES = 100, 3
# small kernels for compute-sanitizer (memcheck, racecheck): (D, B, H, dtype, lbr, direction, lens)
SANITIZE = [(1, 3, 37, "float32", 1, "forward", True), (2, 5, 100, "float32", 0, "bidirectional", True),
            (1, 4, 64, "float16", 1, "reverse", False)]
SAN_SEQ = 5


def _name(cfg, variant):
    D, B, H, dtype = cfg
    return f"g_{variant}_d{D}_b{B}_h{H}_{dtype}"


def build(out: Path):
    import tvm

    from tvmseq import artifacts
    from tvmseq.kernels import persistent_gru as pg
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for variant, (slots, poll, kw) in VARIANTS.items():
        funcs = {}
        for cfg in CONFIGS:
            D, B, H, dtype = cfg
            opts = rg.PollOptions(report="all", limit=1 << 20, **poll)
            f = pg.persistent_gru_func(D, B, H, dtype, 1, "bidirectional" if D == 2 else "forward", None, None,
                                       False, tgt, slots=slots, poll=opts, **kw)
            funcs[_name(cfg, variant)] = f.with_attr("global_symbol", _name(cfg, variant))
            index.append(dict(variant=variant, D=D, B=B, H=H, dtype=dtype, func=_name(cfg, variant),
                              file=f"diag_{variant}.so",
                              config=str(pg.default_gru_config(D, B, H, dtype, tgt))))
        t0 = time.time()
        with artifacts.device_binaries(("sm_90a",)):
            ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
            report = dict(artifacts.NVCC.last_report)
        ex.export_library(str(out / f"diag_{variant}.so"))
        for e in index:
            if e["variant"] == variant:
                e["ptxas"] = report.get(e["func"] + "_kernel", {})
        print(f"built {variant} in {time.time() - t0:.0f}s", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))
    funcs = {}
    for D, B, H, dtype, lbr, direction, lens in SANITIZE:
        name = f"san_gru_d{D}_b{B}_h{H}_{dtype}_lbr{lbr}_{direction}"
        funcs[name] = pg.persistent_gru_func(D, B, H, dtype, lbr, direction, None, None, lens, tgt).with_attr(
            "global_symbol", name)
    funcs["san_rg_h96_b3"] = rg.persistent_recurrent_gemm_func(96, 3, SAN_SEQ, "float32", "tanh", True, tgt).with_attr(
        "global_symbol", "san_rg_h96_b3")
    if (out / "sanitize.so").exists():
        return
    with artifacts.device_binaries(("sm_90a",)):
        tvm.compile(tvm.IRModule(funcs), target=tgt).export_library(str(out / "sanitize.so"))
    print("built sanitize.so", flush=True)


def sanitize_run(out: Path):
    """Every small kernel once (run under compute-sanitizer): prints max errors vs float64."""
    import numpy as np
    import torch
    import tvm

    mod = tvm.runtime.load_module(str(out / "sanitize.so"))
    g = torch.Generator(device="cuda").manual_seed(0)
    for D, B, H, dtype, lbr, direction, lens in SANITIZE:
        name = f"san_gru_d{D}_b{B}_h{H}_{dtype}_lbr{lbr}_{direction}"
        tdt = getattr(torch, dtype)
        gate_i = torch.randn(D, SAN_SEQ, B, 3 * H, device="cuda", generator=g)
        R = ((torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(tdt)
        args = [gate_i, R, torch.zeros(D, H, device="cuda"),
                torch.tensor([SAN_SEQ, 2, 0, 4, 1][:B], dtype=torch.int32, device="cuda"),
                torch.zeros(D, B, H, device="cuda"), torch.empty(SAN_SEQ, D, B, H, device="cuda", dtype=tdt),
                torch.empty(D, B, H, device="cuda", dtype=tdt)]
        mod[name](*[tvm.runtime.from_dlpack(t) for t in args])
        torch.cuda.synchronize()
        print(name, "ran; finite:", bool(torch.isfinite(args[5]).all()), flush=True)
    A = (torch.rand(96, 96, device="cuda", generator=g) - 0.5) * 0.2
    bias, x0 = torch.rand(96, device="cuda", generator=g) - 0.5, torch.rand(3, 96, device="cuda", generator=g)
    Y = torch.empty(SAN_SEQ, 3, 96, device="cuda")
    mod["san_rg_h96_b3"](*[tvm.runtime.from_dlpack(t) for t in (A, bias, x0, Y)])
    x = x0.double()
    for n in range(SAN_SEQ):
        x = torch.tanh(x @ A.double().T + bias.double())
    print("san_rg_h96_b3 max err", float((Y[-1].double() - x).abs().max()), flush=True)


def _reference(gate_i, R, h0):
    """float64 GRU recurrence (lbr=1, sigmoid/tanh, zero rb_h) on the GPU; directions: 0 fwd, 1 reverse."""
    import torch

    D, T_, B, G3 = gate_i.shape
    Y = torch.zeros(T_, D, B, G3 // 3, dtype=torch.float64, device=gate_i.device)
    for d in range(D):
        h = h0[d].double()
        Rz, Rr, Rh = R[d].double().chunk(3)
        for s in range(T_):
            t = T_ - 1 - s if d == 1 else s
            gz, gr, gh = gate_i[d, t].double().chunk(3, dim=1)
            z, r = torch.sigmoid(gz + h @ Rz.T), torch.sigmoid(gr + h @ Rr.T)
            h = (1 - z) * torch.tanh(gh + r * (h @ Rh.T)) + z * h
            Y[t, d] = h
    return Y


def run_one(out: Path, entry: dict) -> dict:
    import torch
    import tvm

    D, B, H, dtype = entry["D"], entry["B"], entry["H"], entry["dtype"]
    mod = tvm.runtime.load_module(str(out / entry["file"]))
    fn = mod[entry["func"]]
    g = torch.Generator(device="cuda").manual_seed(0)
    tdt = getattr(torch, dtype)
    gate_i = torch.randn(D, SEQ, B, 3 * H, device="cuda", generator=g)
    R = ((torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(tdt)
    rb_h = torch.zeros(D, H, device="cuda")
    lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
    h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
    ref = _reference(gate_i, R, h0)
    Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=tdt)
    Yh = torch.empty(D, B, H, device="cuda", dtype=tdt)
    args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, rb_h, lens, h0, Y, Yh)]
    errs, times = [], []
    for _ in range(LAUNCHES):
        Y.fill_(float("nan"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / SEQ)
        errs.append(float((Y.double() - ref).abs().max()))
    tol = 2e-3 if dtype == "float16" else 1e-4
    return dict(entry, errs=errs, us_step_wall=times, ok=all(e <= tol for e in errs))


def run(out: Path):
    index = json.loads((out / "index.json").read_text())
    results = []
    for i, e in enumerate(index):
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "one", str(out), str(i)], capture_output=True, text=True,
                               timeout=15)
            lines = p.stdout.strip().splitlines()
            res = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else dict(e, ok=False, error=p.stderr[-800:])
            res["reports"] = [ln for ln in (p.stdout + p.stderr).splitlines() if "LL timeout" in ln][:12]
        except subprocess.TimeoutExpired as ex:
            out_txt = (ex.stdout or b"").decode() if isinstance(ex.stdout, bytes) else (ex.stdout or "")
            res = dict(e, ok=False, error="timeout 15 s",
                       reports=[ln for ln in out_txt.splitlines() if "LL timeout" in ln][:12])
        res["wall_s"] = round(time.time() - t0, 1)
        results.append(res)
        print(json.dumps({k: res.get(k) for k in ("func", "config", "ok", "errs", "us_step_wall", "error", "wall_s")}),
              flush=True)
        for ln in res.get("reports", [])[:6]:
            print("   ", ln, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "build":
        build(out)
    elif mode == "run":
        run(out)
    elif mode == "sanitize":
        sanitize_run(out)
    else:
        print(json.dumps(run_one(out, json.loads((out / "index.json").read_text())[int(sys.argv[3])])), flush=True)
