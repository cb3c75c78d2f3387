"""Schedule sweep of the tensor-core persistent GRU (units per block / warps / batch chunk) on the H100.

  python3 schedules/pmma_sweep.py build out/pmma_sweep [float32]  # here (compiler); or `tvmseq tune persistent_mma`
  python3 schedules/pmma_sweep.py build-wg out/pwg_sweep  # here: the warpgroup kernel's variants (WG_SWEEP)
  python3 schedules/pmma_sweep.py build-engine out/peng   # here: the SIMT engine at ENGINE_SWEEP's shapes
  python3 schedules/pmma_sweep.py run out/pmma_sweep      # GPU machine (runtime + torch)

Each variant is checked against a float64 GRU (torch on the GPU) and its recurrence timed alone (seq 100,
random gate_i), us a step; results in out/.../results.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# (D, B, H) -> [(units per block, warps, chunk rows, pipeline)]; the first is the default's pick
SWEEP = {
    # sweep 15 (H100, 2026-11-23): dsmem (the new state pushed straight into every cluster peer's staging slot, no global
    # round trip) against sweep 14's best cluster_sync configs (first of each list where there is one; sweep 14's
    # lists are in artifacts/bench/pmma_sweep.json.gz; run sweep15b added the rules' picks of the two bidirectional
    # batch-64 shapes, which no sweep had timed)
    (1, 64, 256, "float32", "rnn"): [(16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1), (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1),
                                     (16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1), (32, 8, 16, 0, 4, 0, 0, 1, 0, 0, 8, 1, 1),
                                     (32, 4, 16, 0, 4, 0, 0, 1, 0, 0, 8, 1, 1)],
    (1, 8, 256, "float32", "rnn"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1), (16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1),
                                    (32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1), (32, 4, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1)],
    (1, 1, 256, "float32", "rnn"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1), (32, 4, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1)],
    (2, 64, 256, "float32", "rnn"): [(8, 8, 32, 0, 2), (32, 8, 16, 0, 4, 0, 0, 1, 0, 0, 8, 1), (32, 8, 16, 0, 4, 0, 0, 1, 0, 0, 8, 1, 1),
                                     (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1)],
    (2, 8, 256, "float32", "rnn"): [(32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1), (16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1)],
    (1, 64, 256, "float32"): [(8, 8, 16, 0, 4, 0, 0, 1), (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1),
                              (16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1), (16, 4, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1)],
    (1, 8, 256, "float32"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1)],
    (2, 64, 256, "float32"): [(16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1)],
    (1, 64, 256): [(16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1), (16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1),
                   (32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 8, 1, 1), (16, 8, 16, 0, 4, 0, 0, 1, 0, 0, 16, 1, 1),
                   (16, 8, 32, 0, 2, 0, 0, 0, 0, 0, 16, 1, 1)],   # sweep 17: 32-row chunks
    (1, 8, 256): [(32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1), (32, 8, 16, 0, 1, 0, 0, 1, 0, 0, 8, 1, 1),
                  (16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (1, 1, 256): [(16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 64, 256): [(8, 8, 32, 0, 2), (16, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1), (32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 8, 1, 1)],
    (1, 64, 512): [(16, 8, 16, 0, 4), (32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1)],
    (1, 8, 512): [(32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 64, 512): [(32, 8, 16, 0, 4, 0, 0, 0, 0, 0, 16, 1, 1)],
    # sweep 16 re-timed the dsmem variants above after dsmem moved to st.async (no cluster barrier a step); sweep 17:
    # the small batches of the GRU / RNN benchmark grids that the SIMT engine runs (and 32-row chunks above)
    (1, 1, 512): [(32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 1, 256): [(16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 8, 256): [(16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 8, 512): [(32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (2, 1, 512): [(32, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)],
    (1, 1, 256, "float32"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1)],
    (2, 8, 256, "float32"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1)],
    (2, 1, 256, "float32", "rnn"): [(16, 8, 16, 0, 1, 0, 0, 1, 0, 0, 16, 1, 1)],
}
SEQ = 100


def small_chunk_variants(D: int, B: int, H: int, cell: str = "gru") -> list:
    """float32 dsmem configs whose chunk is the smallest of 1-8 rows that holds the batch (`mma.SIMT_SMALL_CHUNKS`:
    the gate rows spread over the lanes), every units / warps pair whose unit groups make one cluster."""
    import math

    rows = next(r for r in (1, 2, 4, 8) if r >= B)
    out = []
    for units in (8, 16, 32):
        groups = math.ceil(H / units)
        if 2 <= groups <= 16:
            out += [(units, warps, rows, 0, 1, 0, 0, 0, 0, 0, groups, 1, 1) for warps in (1, 2, 4, 8, 16)]
    return out


# sweep 18 (H200, 2026-11-29): float32 chunks of fewer than 16 rows, at the float32 cells of the benchmark models at
# batch 1 and 8 (the ASR's bidirectional GRU 512, the denoiser's GRU 400) and the grid's float32 GRU / RNN at 256
SMALL_CHUNK_KEYS = [(1, 1, 400, "float32"), (1, 8, 400, "float32"), (2, 1, 512, "float32"), (2, 8, 512, "float32"),
                    (1, 1, 256, "float32"), (2, 8, 256, "float32"), (1, 1, 512, "float32"), (1, 8, 512, "float32"),
                    (2, 1, 256, "float32", "rnn")]


def sweep_key(key) -> tuple:
    """(D, B, H[, dtype[, cell]]) -> (D, B, H, dtype, cell), float16 GRU by default."""
    D, B, H, dtype, cell = (*key, "float16", "gru")[:5] if len(key) < 4 else (*key, "gru")[:5]
    return D, B, H, dtype, cell


for _key in SMALL_CHUNK_KEYS:
    _D, _B, _H, _dtype, _cell = sweep_key(_key)
    SWEEP[_key] = SWEEP.get(_key, []) + small_chunk_variants(_D, _B, _H, _cell)


def _name(D, B, H, cfg, dtype="float16", cell="gru"):
    return f"m_{cell}_{dtype[5:]}_d{D}_b{B}_h{H}_u{cfg[0]}w{cfg[1]}c{cfg[2]}p{cfg[3]}" + "".join(
        f"{k}{v}" for k, v in zip("sfhebixld", cfg[4:]))


# the warpgroup kernel (kernels/recurrent/wgmma.py): (D, B, H[, dtype, cell]) -> [(units per block, batch split)]
WG_SWEEP = {
    # (sweeps w1-w6 are in artifacts/bench/pwg_sweep.json: w2 clusters, w4 wait-all, w5 k-tile ring, w6 early gate
    # loads, all dropped)
    (1, 64, 1024): [(8, 1), (16, 1)],
    (1, 256, 1024): [(16, 2), (16, 1)],
    (2, 64, 1024): [(16, 1)],
    (2, 256, 1024): [(16, 1)],
    (1, 256, 512): [(16, 4), (8, 1)],
    (2, 256, 512): [(16, 2)],
    (1, 256, 256): [(8, 4), (16, 4)],
}

# the SIMT engine (kernels/recurrent/engine.py, its default config) at the small batches where sweep 15 times the
# staged-state kernel with dsmem: the importer may route those to it only where both were timed in one process
ENGINE_SWEEP = {key: [()] for key in [(1, 8, 256, "float32", "rnn"), (1, 1, 256, "float32", "rnn"),
                                      (2, 8, 256, "float32", "rnn"), (1, 8, 256, "float32"), (1, 8, 256),
                                      (1, 1, 256), (1, 8, 512),
                                      # sweep 17
                                      (1, 1, 512), (2, 1, 256), (2, 8, 256), (2, 8, 512), (2, 1, 512),
                                      (1, 1, 256, "float32"), (2, 8, 256, "float32"), (2, 1, 256, "float32", "rnn"),
                                      # sweep 18
                                      (1, 1, 400, "float32"), (1, 8, 400, "float32"), (2, 1, 512, "float32"),
                                      (2, 8, 512, "float32"), (1, 1, 512, "float32"), (1, 8, 512, "float32")]}


class _EngineFits:
    @staticmethod
    def check(facts):
        return None


def _families():
    """kernel -> (geometry check, prim_func factory, config of a knob tuple, variant name)."""
    from tvmseq.kernels.recurrent import engine
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.kernels.recurrent import wgmma as pw

    return {
        "persistent_mma": (lambda D, B, H, dtype, cell, cfg: pm.MmaGeometry(D, B, H, pm.GATES[cell], cfg, dtype),
                           pm.persistent_mma_func, pm.MmaConfig.of,
                           lambda D, B, H, cfg, dtype, cell: _name(D, B, H, cfg, dtype, cell)),
        "persistent_wgmma": (lambda D, B, H, dtype, cell, cfg: pw.WgmmaRecGeometry(D, B, H, pw.GATES[cell], cfg),
                             pw.persistent_wgmma_func, pw.WgmmaRecConfig.of,
                             lambda D, B, H, cfg, dtype, cell: f"w_{cell}_d{D}_b{B}_h{H}_u{cfg[0]}s{cfg[1]}"
                             + "".join(f"k{v}" for v in cfg[2:])),
        "persistent_gru": (lambda D, B, H, dtype, cell, cfg: _EngineFits(),
                           lambda D, B, H, dtype, direction, acts, clip, lens, tgt, cfg, cell:
                               engine.persistent_gru_func(D, B, H, dtype, 1, direction, acts, clip, lens, tgt, None,
                                                          cell=cell),
                           lambda knobs: None, lambda D, B, H, cfg, dtype, cell: f"p_{cell}_{dtype[5:]}_d{D}_b{B}_h{H}"),
    }


def build(out: Path, sweep: dict | None = None, kernel: str = "persistent_mma"):
    """The variants of `sweep` (default SWEEP, or WG_SWEEP for the warpgroup kernel) into out/sweep.so and
    out/index.json (one entry a variant: shape, kernel, config knobs, name, ptxas report)."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    geometry, factory, config_of, name_of = _families()[kernel]
    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    default = {"persistent_mma": SWEEP, "persistent_wgmma": WG_SWEEP, "persistent_gru": ENGINE_SWEEP}[kernel]
    for key, cfgs in (sweep or default).items():
        D, B, H, dtype, cell = sweep_key(key)
        for cfg in cfgs:
            why = geometry(D, B, H, dtype, cell, config_of(cfg)).check(rg.gpu_facts(tgt))
            if why:
                print("skip", D, B, H, cfg, why)
                continue
            name = name_of(D, B, H, cfg, dtype, cell)
            funcs[name] = factory(D, B, H, dtype, "bidirectional" if D == 2 else "forward", None, None, False, tgt,
                                  config_of(cfg), cell).with_attr("global_symbol", name)
            index.append(dict(D=D, B=B, H=H, dtype=dtype, cell=cell, kernel=kernel, config=list(cfg), name=name))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "sweep.so"))
    for e in index:
        e["ptxas"] = report.get(e["name"] + "_kernel", {})
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(funcs)} variants")


def _reference(gate_i, R, rb_h, h0, D):
    import torch

    T_, H = gate_i.shape[1], R.shape[-1]
    Y = torch.empty(T_, D, gate_i.shape[2], H, dtype=torch.float64, device="cuda")
    if R.shape[1] == H:   # RNN (tanh): one gate, no rb_h
        for d in range(D):
            h = h0[d].double()
            for s in range(T_):
                t = T_ - 1 - s if d else s
                h = torch.tanh(gate_i[d, t].double() + h @ R[d].double().T)
                Y[t, d] = h
        return Y
    for d in range(D):
        h = h0[d].double()
        Rz, Rr, Rh = R[d].double().split(H)
        for s in range(T_):
            t = T_ - 1 - s if d else s
            gz, gr, gh = gate_i[d, t].double().split(H, dim=1)
            z, r = torch.sigmoid(gz + h @ Rz.T), torch.sigmoid(gr + h @ Rr.T)
            h = (1 - z) * torch.tanh(gh + r * (h @ Rh.T + rb_h[d].double())) + z * h
            Y[t, d] = h
    return Y


def run(out: Path):
    import torch
    import tvm

    from tvmseq.measure import time_cuda

    index = json.loads((out / "index.json").read_text())
    mod = tvm.runtime.load_module(str(out / "sweep.so"))
    results = []
    for e in index:
        D, B, H = e["D"], e["B"], e["H"]
        g = torch.Generator(device="cuda").manual_seed(0)
        NG = 1 if e.get("cell") == "rnn" else 3
        gate_i = torch.randn(D, SEQ, B, NG * H, device="cuda", generator=g)
        R = ((torch.rand(D, NG * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(
            getattr(torch, e.get("dtype", "float16")))
        rb_h = torch.randn(D, H, device="cuda", generator=g) * 0.1 * (NG == 3)
        lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
        h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
        Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=R.dtype)
        Yh = torch.empty(D, B, H, device="cuda", dtype=R.dtype)
        args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, rb_h, lens, h0, Y, Yh)]
        f = mod[e["name"]]
        try:
            f(*args)
            torch.cuda.synchronize()
            err = float((Y.double() - _reference(gate_i, R, rb_h, h0, D)).abs().max())
            us = time_cuda(lambda: f(*args), warmup=3, iters=20) * 1e3 / SEQ
            row = dict(e, us_step=us, max_err=err, ok=err < (1e-4 if R.dtype == torch.float32 else 1e-2))
        except Exception as err:  # noqa: BLE001 - one failing variant must not stop the sweep
            row = dict(e, error=f"{type(err).__name__}: {err}"[:300])
        results.append(row)
        print(e["name"], {k: row.get(k) for k in ("us_step", "max_err", "ok", "error")}, e["ptxas"].get("registers"),
              flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))   # after each variant: a timeout keeps the rest


if __name__ == "__main__":
    if sys.argv[1] == "build" and len(sys.argv) > 3:   # build DIR DTYPE|rnn: only that dtype's (cell's) shapes
        build(Path(sys.argv[2]), {k: v for k, v in SWEEP.items() if sys.argv[3] in (*k, "float16")[3:]})
    else:
        {"build": build, "build-wg": lambda out: build(out, kernel="persistent_wgmma"),
         "build-engine": lambda out: build(out, kernel="persistent_gru"), "run": run}[sys.argv[1]](
            Path(sys.argv[2]))
