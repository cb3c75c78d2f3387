"""Probe: would computing the input projection inside the staged-state recurrence (float32) pay?

scripts/overlap_probe.py showed that running the projection kernel beside the recurrence on the same SMs hides
little of it (they contend while the recurrence computes). A fused kernel would instead do a step's gate_i slice
of each block in the one window where the block has nothing to do: between its arrival at the step barrier and
the barrier's release. `persistent_mma_func(..., proj_probe=1|2|3)` builds exactly that window with the same
work in it (1: the barrier split, empty window; 2: a second product of the block's weight slice with a staged
chunk plus the cross-warp sum of its partials, the FLOPs and shared-memory reads of a gate_i slice when the input
size is the hidden size; 3: as 2, after a copy of the chunk's size into the slot, as an input chunk would need).
This times those variants against the importer's recurrence and projection in one process.

  python3 scripts/fused_projection_probe.py build out/fproj   # here (compiler)
  python3 scripts/fused_projection_probe.py run out/fproj [DIR]   # GPU machine (runtime + torch):
                                                               # DIR/fused_projection_probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SEQ = 100
# (D, B, H, dtype) -> [(config knobs, proj_probe levels)]: the database's pick and the pick without its cluster
PROBES = {
    (1, 64, 512, "float32"): [((8, 8, 32, 0, 2, 0, 0, 0, 1, 1, 2), (0, 1, 2, 3)),
                              ((8, 8, 32, 0, 2, 0, 0, 0, 1, 1), (0, 3))],
    (1, 64, 256, "float32"): [((8, 8, 16, 0, 4), (0, 1, 3))],   # the database's pick less early_gate
}


def _cell(D, B, H, dtype):
    return {"dtype": dtype, "bidirectional": D == 2, "hidden": H, "batch": B}


def build(out):
    from tvmseq.bench import persistent_gru as pgb
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import persistent_mma as pm
    from tvmseq.targets import resolve

    tgt, out = resolve("cuda"), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for (D, B, H, dtype), variants in PROBES.items():
        c = _cell(D, B, H, dtype)
        pair, path, _, tile = pgb._bench_funcs(c, tgt)   # the importer's projection and recurrence
        funcs.update(pair)
        sfx = pgb._suffix(c)
        index.append(dict(c, D=D, B=B, H=H, name=f"rec_{sfx}", kind="importer", path=path, proj=f"proj_{sfx}",
                          proj_rows=tile))
        for knobs, levels in variants:
            for level in levels:
                name = f"probe_{sfx}_{'_'.join(map(str, knobs))}_pp{level}"
                funcs[name] = pm.persistent_mma_func(D, B, H, dtype, "forward" if D == 1 else "bidirectional",
                                                     None, None, False, tgt, pm.MmaConfig.of(knobs),
                                                     proj_probe=level).with_attr("global_symbol", name)
                index.append(dict(c, D=D, B=B, H=H, name=name, kind="probe", config=list(knobs), proj_probe=level))
    ex, report = compile_for_gpu(funcs, tgt)
    for e in index:
        e["ptxas"] = report.get(e["name"] + "_kernel", {})
        print(e["name"], e["ptxas"], flush=True)
    ex.export_library(str(out / "fproj.so"))
    (out / "index.json").write_text(json.dumps(index, indent=1))


def run(root):
    import torch
    import tvm

    from tvmseq import artifacts
    from tvmseq.bench import gru as grub
    from tvmseq.bench.common import environment, time_cuda

    sys.path.insert(0, str(Path(__file__).parent))
    from pmma_sweep import _reference

    artifacts.ensure_cuda_runtime()
    root = Path(root)
    mod = tvm.runtime.load_module(str(root / "fproj.so"))
    rows, proj_us = [], {}
    for e in json.loads((root / "index.json").read_text()):
        D, B, H = e["D"], e["B"], e["H"]
        g = torch.Generator(device="cuda").manual_seed(0)
        X = torch.randn(SEQ, B, H, device="cuda", generator=g)
        W = (torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5
        bias_i = torch.randn(D, 3 * H, device="cuda", generator=g) * 0.1
        gate_i = torch.empty(D, SEQ, B, 3 * H, device="cuda")
        R = (torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5
        rb_h = torch.randn(D, H, device="cuda", generator=g) * 0.1
        lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
        h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
        Y, Yh = torch.empty(SEQ, D, B, H, device="cuda"), torch.empty(D, B, H, device="cuda")
        tv = [tvm.runtime.from_dlpack(t) for t in (X, W, bias_i, gate_i, R, rb_h, lens, h0, Y, Yh)]
        key = (D, B, H)
        if e["kind"] == "importer":   # the projection as the importer runs it, once a shape
            project = grub._projection(mod[e["proj"]], e.get("proj_rows"), tv, X, gate_i, bias_i, SEQ, B, D, H)
            proj_us[key] = time_cuda(project, warmup=3, iters=20) * 1e3 / SEQ
            project()
        else:
            gate_i.copy_(torch.randn(D, SEQ, B, 3 * H, device="cuda", generator=g))
        f = mod[e["name"]]
        args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, rb_h, lens, h0, Y, Yh)]
        try:
            f(*args)
            torch.cuda.synchronize()
            err = float((Y.double() - _reference(gate_i, R, rb_h, h0, D)).abs().max())
            us = time_cuda(lambda: f(*args), warmup=3, iters=20) * 1e3 / SEQ
            row = dict(e, us_step=us, proj_us_step=proj_us.get(key), max_err=err, ok=err < 1e-4)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the probe
            row = dict(e, error=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
        print(e["name"], {k: row.get(k) for k in ("us_step", "proj_us_step", "max_err", "ok", "error")}, flush=True)
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else root
    (out / "fused_projection_probe.json").write_text(json.dumps({"environment": environment(), "rows": rows},
                                                                indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](sys.argv[2])
