"""A/B of the per-step path's gate kernel block size (`gru.StepSchedule.gate_threads`; grid batch x directions x
hidden / threads): the GRU recurrence alone, seq 100, timed in one process, checked against each other.

  python3 scripts/gate_threads_ab.py build out/gateab    # here
  python3 scripts/gate_threads_ab.py run out/gateab      # GPU machine: results.json
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

SEQ = 100
SHAPES = [(1, 64, 1024), (2, 64, 1024), (1, 256, 1024), (1, 256, 512), (1, 256, 256)]
THREADS = (128, 256, 512)


def build(out: Path) -> None:
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import gru
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    funcs, index = {}, []
    for D, B, H in SHAPES:
        spec = gru.GruSpec(D, B, H, H, "float32", linear_before_reset=1,
                           direction="bidirectional" if D == 2 else "forward")
        for nt in THREADS:
            name = f"g_d{D}_b{B}_h{H}_t{nt}"
            sched = dataclasses.replace(gru.StepSchedule.for_batch(B), gate_threads=nt)
            funcs[name] = gru.recurrence_func(spec, tgt, sched).with_attr("global_symbol", name)
            index.append(dict(D=D, B=B, H=H, threads=nt, name=name))
    out.mkdir(parents=True, exist_ok=True)
    ex, _ = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "gateab.so"))
    (out / "index.json").write_text(json.dumps(index, indent=1))


def run(out: Path) -> None:
    import torch
    import tvm

    from tvmseq.bench.common import time_cuda

    mod = tvm.runtime.load_module(str(out / "gateab.so"))
    tv = tvm.runtime.from_dlpack
    rows, first = [], {}
    for rnd in range(3):
        for e in json.loads((out / "index.json").read_text()):
            D, B, H = e["D"], e["B"], e["H"]
            g = torch.Generator(device="cuda").manual_seed(0)
            gate_i = torch.randn(D, SEQ, B, 3 * H, device="cuda", generator=g)
            R = (torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5
            args = [gate_i, R, torch.zeros(D, H, device="cuda"), torch.full((B,), SEQ, dtype=torch.int32, device="cuda"),
                    torch.randn(D, B, H, device="cuda", generator=g) * 0.5, torch.empty(SEQ, D, B, H, device="cuda"),
                    torch.empty(D, B, H, device="cuda")]
            targs = [tv(t) for t in args]
            fn = mod[e["name"]]
            fn(*targs)
            torch.cuda.synchronize()
            ref = first.setdefault((D, B, H), args[5].clone())
            diff = float((args[5] - ref).abs().max())
            us = time_cuda(lambda: fn(*targs), warmup=2, iters=10) * 1e3 / SEQ
            rows.append(dict(e, round=rnd, us_step=us, max_diff=diff))
    for e in json.loads((out / "index.json").read_text()):
        ts = [r["us_step"] for r in rows if r["name"] == e["name"]]
        print(f"{e['name']:28s} {min(ts):8.3f} us/step  diff {rows[-1]['max_diff']:.1e}")
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](Path(sys.argv[2]))
