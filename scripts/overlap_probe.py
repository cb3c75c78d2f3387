"""Probe: how much of the input projection can hide behind a latency-bound persistent recurrence?

The importer runs a GRU layer as two kernels, one after the other: the input projection for all steps, then the
persistent recurrence. The recurrence waits on hand-offs most of a step (issue active ~40% at batch 64), so the
projection could run in its idle issue slots, if the two can share the SMs. This probe measures exactly that with
the kernels the importer builds today (nothing new): each alone, one after the other (what runs now), and both at
once on two CUDA streams (the recurrence reading a gate_i computed beforehand, so the two are independent: a pure
resource-sharing measurement). If "both at once" is close to the recurrence alone, fusing the projection into the
recurrence (extra warps a block computing the next steps' gate_i) is worth building; if it is close to the sum,
it is not.

  python3 scripts/overlap_probe.py build out/overlap     # here (compiler): kernels + index.json (ptxas, residency)
  python3 scripts/overlap_probe.py run out/overlap [DIR] # GPU machine (runtime + torch): DIR/overlap_probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CELLS = [  # (dtype, bidirectional, hidden, batch): the #5 cells the projection weighs on
    ("float32", False, 512, 64),
    ("float32", True, 512, 64),
    ("float16", False, 1024, 64),
    ("float32", True, 1024, 8),
    ("float32", False, 1024, 8),
]
SEQ = 100


def _cell(t):
    return {"dtype": t[0], "bidirectional": t[1], "hidden": t[2], "batch": t[3]}


def build(out):
    from tvmseq.bench import persistent_gru as pgb
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.targets import resolve

    tgt, out = resolve("cuda"), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for t in CELLS:
        c = _cell(t)
        f, path, why, tile = pgb._bench_funcs(c, tgt)
        funcs.update(f)
        e = dict(c, suffix=pgb._suffix(c), path=path, proj_rows=tile)
        if path.startswith("persistent"):
            e["threads"], e["dyn_smem"], e["blocks"] = pgb._rec_launch(c, tgt, path)
        index.append(e)
    ex, report = compile_for_gpu(funcs, tgt)
    for e in index:
        e["ptxas_rec"] = report.get(f"rec_{e['suffix']}_kernel", {})
        e["ptxas_proj"] = {k: v for k, v in report.items() if k.startswith(f"proj_{e['suffix']}")}
        print(e["suffix"], e["path"], e.get("threads"), e.get("dyn_smem"), e.get("blocks"), e["ptxas_rec"],
              e["ptxas_proj"], flush=True)
    ex.export_library(str(out / "overlap.so"))
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _setup(c, mod):
    """Tensors and the two launches of one cell, as tvmseq.bench.gru.run_one sets them up."""
    import torch
    import tvm

    from tvmseq.bench import gru as grub

    H, B, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    tdt, dev = getattr(torch, c["dtype"]), "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    u = lambda *s: ((torch.rand(*s, device=dev, generator=g) * 2 - 1) * H ** -0.5)  # noqa: E731
    X = torch.randn(SEQ, B, H, device=dev, generator=g).to(tdt)
    W, R = u(D, 3 * H, H).to(tdt), u(D, 3 * H, H).to(tdt)
    bias_i, rb_h = u(D, 3 * H), u(D, H)
    lens = torch.full((B,), SEQ, dtype=torch.int32, device=dev)
    h0 = torch.zeros(D, B, H, device=dev)
    gate_i = torch.empty(D, SEQ, B, 3 * H, device=dev)
    Y = torch.empty(SEQ, D, B, H, device=dev, dtype=tdt)
    Yh = torch.empty(D, B, H, device=dev, dtype=tdt)
    tv = [tvm.runtime.from_dlpack(t) for t in (X, W, bias_i, gate_i, R, rb_h, lens, h0, Y, Yh)]
    sfx = c["suffix"]
    proj, rec = mod[f"proj_{sfx}"], mod[f"rec_{sfx}"]
    project = grub._projection(proj, c.get("proj_rows"), tv, X, gate_i, bias_i, SEQ, B, D, H)
    project()
    torch.cuda.synchronize()
    # the recurrence of the concurrent runs reads its own copy of gate_i (the projection rewrites the other)
    gate_own = torch.randn(D, SEQ, B, 3 * H, device=dev, generator=g)
    rec_args = [tvm.runtime.from_dlpack(gate_own)] + tv[4:]
    return project, (lambda: rec(*rec_args)), (lambda: rec(*tv[3:]))


def run(root):
    import torch
    import tvm
    import tvm_ffi

    from tvmseq import artifacts
    from tvmseq.bench.common import environment, time_cuda

    artifacts.ensure_cuda_runtime()
    root = Path(root)
    mod = tvm.runtime.load_module(str(root / "overlap.so"))
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []

    def both(first, second):
        start = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(start)
        for s, fn in zip(streams, (first, second)):
            with tvm_ffi.use_torch_stream(torch.cuda.stream(s)):
                fn()
        for s in streams:
            start.wait_stream(s)

    for c in json.loads((root / "index.json").read_text()):
        project, rec_own, rec_seq = _setup(c, mod)
        t = lambda fn: time_cuda(fn, warmup=3, iters=20) * 1e3 / SEQ  # noqa: E731
        row = {k: c[k] for k in ("dtype", "bidirectional", "hidden", "batch", "path")}
        row["proj_us"], row["rec_us"] = t(project), t(rec_own)
        row["sequential_us"] = t(lambda: (project(), rec_seq()))
        row["both_rec_first_us"] = t(lambda: both(rec_own, project))
        row["both_proj_first_us"] = t(lambda: both(project, rec_own))
        best = min(row["both_rec_first_us"], row["both_proj_first_us"])
        row["hidden_share"] = (row["sequential_us"] - best) / row["proj_us"]   # of the projection's time
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else root
    (out / "overlap_probe.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](sys.argv[2])
