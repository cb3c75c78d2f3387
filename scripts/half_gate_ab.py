"""A/B of gate_i storage on the fp16 warpgroup path (the GRU grid's W cells): the input projection
(`projection_wgmma`) writing float32 or float16 gate_i, and the persistent warpgroup recurrence
(`persistent_wgmma`) reading it, timed in the same process (seq 100), outputs compared with each other and with
a float64 GRU.

  python3 scripts/half_gate_ab.py build out/halfgate     # here: both variants of every shape, sm_90a SASS
  python3 scripts/half_gate_ab.py run out/halfgate       # GPU machine: results.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SEQ = 100
SHAPES = [(1, 256, 256), (1, 256, 512), (1, 256, 1024), (2, 256, 256), (2, 256, 512), (2, 256, 1024),
          (2, 64, 1024), (1, 128, 1024)]
GATES = ("float32", "float16")


def name(kind, D, B, H, gate):
    return f"{kind}_d{D}_b{B}_h{H}_{gate[5:]}"


def build(out: Path) -> None:
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import input_projection as ip, persistent_wgmma as pw, projection_wgmma as pj
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    funcs, index = {}, []
    for D, B, H in SHAPES:
        direction = "bidirectional" if D == 2 else "forward"
        tile = next(t for t in ip.WGMMA_TILES if pj.supports(3 * H, H, t) is None)
        for gate in GATES:
            p, r = name("proj", D, B, H, gate), name("rec", D, B, H, gate)
            funcs[p] = pj.projection_wgmma_func(D, 3 * H, H, True, tile, gate).with_attr("global_symbol", p)
            funcs[r] = pw.persistent_wgmma_func(D, B, H, "float16", direction, None, None, False, tgt,
                                                gate_dtype=gate).with_attr("global_symbol", r)
        index.append(dict(D=D, B=B, H=H))
    out.mkdir(parents=True, exist_ok=True)
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "halfgate.so"))
    for k, v in report.items():
        print(k, v)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _reference(X, W, R, bias, rb_h, h0, D):
    """float64 GRU (lbr=1, gate order z, r, h; bias = Wb + Rb for z, r and Wb for h), Y [seq, D, B, H]."""
    import torch

    seq, B, _ = X.shape
    H = R.shape[-1]
    Y = torch.empty(seq, D, B, H, dtype=torch.float64, device=X.device)
    for d in range(D):
        h = h0[d].double()
        for s in range(seq):
            t = s if d == 0 else seq - 1 - s
            gi = X[t].double() @ W[d].double().T + bias[d].double()
            gh = h @ R[d].double().T
            z = torch.sigmoid(gi[:, :H] + gh[:, :H])
            r = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
            n = torch.tanh(gi[:, 2 * H:] + r * (gh[:, 2 * H:] + rb_h[d].double()))
            h = (1 - z) * n + z * h
            Y[t, d] = h
    return Y


def run(out: Path) -> None:
    import torch
    import tvm

    from tvmseq.bench.common import PrebuiltModules, time_cuda

    mod = PrebuiltModules(out).get("halfgate.so")
    tv = tvm.runtime.from_dlpack
    rows = []
    for e in json.loads((out / "index.json").read_text()):
        D, B, H = e["D"], e["B"], e["H"]
        g = torch.Generator(device="cuda").manual_seed(0)
        k = H ** -0.5
        u = lambda *s: ((torch.rand(*s, device="cuda", generator=g) * 2 - 1) * k)  # noqa: E731
        X = torch.randn(SEQ, B, H, device="cuda", generator=g).half()
        W, R = u(D, 3 * H, H).half(), u(D, 3 * H, H).half()
        bias, rb_h = u(D, 3 * H), u(D, H)
        h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
        lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
        ref = _reference(X, W, R, bias, rb_h, h0, D)
        row = dict(e)
        for gate in GATES:
            gdt = getattr(torch, gate)
            gate_i = torch.empty(D, SEQ * B, 3 * H, device="cuda", dtype=gdt)
            Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=torch.float16)
            Yh = torch.empty(D, B, H, device="cuda", dtype=torch.float16)
            pa = [tv(X.view(SEQ * B, H)), tv(W), tv(bias), tv(gate_i)]
            ra = [tv(gate_i.view(D, SEQ, B, 3 * H)), tv(R), tv(rb_h), tv(lens), tv(h0), tv(Y), tv(Yh)]
            proj, rec = mod[name("proj", D, B, H, gate)], mod[name("rec", D, B, H, gate)]
            proj(*pa)
            rec(*ra)
            torch.cuda.synchronize()
            sfx = gate[5:]
            row[f"err_{sfx}"] = float(((Y.double() - ref).norm() / ref.norm()).item())
            row[f"proj_us_{sfx}"] = time_cuda(lambda: proj(*pa), iters=50) * 1e3 / SEQ
            row[f"rec_us_{sfx}"] = time_cuda(lambda: rec(*ra), iters=20) * 1e3 / SEQ
            row[f"total_us_{sfx}"] = time_cuda(lambda: (proj(*pa), rec(*ra)), iters=20) * 1e3 / SEQ
            row[f"Y_{sfx}"] = Y.float()
        row["max_diff"] = float((row.pop("Y_32") - row.pop("Y_16")).abs().max().item())
        row["gain"] = row["total_us_32"] / row["total_us_16"]
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](Path(sys.argv[2]))
