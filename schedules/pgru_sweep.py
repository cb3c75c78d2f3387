"""Measured schedule sweep of the SIMT engine (persistent GRU and RNN) on the grid cells it runs (what
`tvmseq tune persistent_gru` drives). Per cell (D, B, H, dtype, cell): the cost model's pick, the database's pick, and
for every (blocks a direction, warps) the two shared-memory-rows x batch-chunk settings the cost model ranks best
and the one with the fewest passes a step, so the sweep also tests the model's ranking.

  python3 schedules/pgru_sweep.py build out/psw [CELLS]   # here: one library per cell, index.json
  python3 schedules/pgru_sweep.py run out/psw             # GPU machine: each cell's variants in one process
  python3 schedules/tune_persistent_gru.py merge out/psw/results.json   # here: winners -> the database

CELLS: comma-separated D:B:H:dtype[:cell] (default: the grid cells on the engine). `run` times each variant with CUDA
events (3 warm launches, then the median of 10) and checks it against a float64 recurrence; a cell's process
has a deadline, so a hang costs that cell, not the run. Results carry `us_step_wall` as the merge reads it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the grid cells of batch {1, 8} x hidden {256, 512, 1024}, uni and bi, both dtypes: where the importer runs the
# SIMT engine, or the staged-state kernel where the database has it beat the engine (schedules/pmma_sweep.py sweeps
# those against the engine's pick from here). A sweep with one process per kernel (H100, 2026-11-23) found 16 warps
# and 64 blocks a direction at batch 1.
CELLS = [(D, B, H, dtype, "gru") for dtype in ("float32", "float16") for D in (1, 2) for B in (1, 8)
         for H in (256, 512, 1024)] + \
        [(D, B, H, "float32", "rnn") for D in (1, 2) for B in (1, 8) for H in (256, 1024)]   # the RNN benchmark's
SEQ, WARM, TIMED = 100, 3, 10


def variants(D: int, B: int, H: int, dtype: str, cell: str = "gru") -> list:
    """PersistentConfigs to time for one cell (model's pick first)."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import cells, engine
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    facts = rg.gpu_facts(tgt)
    ng = cells.CELL_GATES[cell]   # weight rows a unit: shared-memory rows come in whole units
    picks = [engine.default_gru_config(D, B, H, dtype, tgt, cell, measured=False),
             engine.default_gru_config(D, B, H, dtype, tgt, cell, measured=True)]
    for blocks in sorted({64 // D, 128 // D, 64, 128}):
        for warps in (4, 8, 16):
            ranked = []
            for chunk_cap in (1, 2, 4, 8):
                chunk = rg._pick_batch_chunk(B, chunk_cap)
                for smem_rows in range(0, ng * -(-H // blocks) + 1, ng):
                    cfg = rg.PersistentConfig(blocks, warps, chunk, smem_rows)
                    geo = engine._geometry(D, B, H, cfg, True, cell)
                    if geo.check(facts, blocks * D) is None and blocks * geo.U >= H:
                        ranked.append((geo.NC, rg.estimate_step_cycles(geo), smem_rows, cfg))
            ranked.sort(key=lambda x: x[1:3])
            # ... and the one with the fewest passes a step (schedules/engine_cost_fit.py: each pass pays a hand-off)
            picks += [cfg for *_, cfg in ranked[:2] + sorted(ranked, key=lambda x: x[:3])[:1]]
    return list(dict.fromkeys(picks))


def _cells(arg: str | None):
    if not arg:
        return CELLS
    cells = []
    for text in arg.split(","):
        d, b, h, dtype, *cell = text.split(":")
        cells.append((int(d), int(b), int(h), dtype, cell[0] if cell else "gru"))
    return cells


def build(out: Path, cells) -> None:
    from tvmseq.kernels.recurrent import engine
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() else []
    for D, B, H, dtype, cell in cells:
        lib = f"{cell}_d{D}_b{B}_h{H}_{dtype}.so"
        if (out / lib).exists():
            continue
        funcs, rows = {}, []
        for cfg in variants(D, B, H, dtype, cell):
            name = (f"e_{cell}_d{D}_b{B}_h{H}_{dtype}_g{cfg.num_blocks}w{cfg.num_warps}c{cfg.batch_chunk}"
                    f"s{cfg.smem_rows}")
            f = engine.persistent_gru_func(D, B, H, dtype, 1, "bidirectional" if D == 2 else "forward", None, None,
                                           False, tgt, cfg, cell=cell)
            funcs[name] = f.with_attr("global_symbol", name)
            rows.append(dict(D=D, B=B, H=H, dtype=dtype, cell=cell, func=name, file=lib, config=str(cfg)))
        t0 = time.time()
        ex, report = compile_for_gpu(funcs, tgt)
        ex.export_library(str(out / lib))
        for r in rows:
            r["ptxas"] = report.get(r["func"] + "_kernel", {})
            spill = r["ptxas"].get("spill_stores", 0)
            print(r["func"], r["ptxas"].get("registers"), "regs", f"SPILL {spill}" if spill else "", flush=True)
        index += rows
        (out / "index.json").write_text(json.dumps(index, indent=1))
        print(f"{lib}: {len(funcs)} kernels in {time.time() - t0:.0f}s", flush=True)


def run_cell(out: Path, lib: str) -> list[dict]:
    """Every variant in `lib`, in this process: errors against float64 (pmma_sweep's GRU/RNN reference) and CUDA-event
    time a step (the median of TIMED launches, as pmma_sweep times the staged-state kernel it is compared with)."""
    import torch
    import tvm

    from pmma_sweep import _reference
    from tvmseq.measure import time_cuda
    from tvmseq.kernels.recurrent.cells import GATES

    rows = [e for e in json.loads((out / "index.json").read_text()) if e["file"] == lib]
    D, B, H, dtype, cell = (rows[0][k] for k in ("D", "B", "H", "dtype", "cell"))
    mod = tvm.runtime.load_module(str(out / lib))
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_i = torch.randn(D, SEQ, B, GATES[cell] * H, device="cuda", generator=g)
    R = ((torch.rand(D, GATES[cell] * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(getattr(torch, dtype))
    rb_h = torch.zeros(D, H, device="cuda")
    h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
    ref = _reference(gate_i, R, rb_h, h0, D)
    Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=R.dtype)
    Yh = torch.empty(D, B, H, device="cuda", dtype=R.dtype)
    lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
    args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, rb_h, lens, h0, Y, Yh)]
    tol = 2e-3 if dtype == "float16" else 1e-4
    results = []
    for e in rows:
        fn = mod[e["func"]]
        Y.fill_(float("nan"))
        fn(*args)
        torch.cuda.synchronize()
        err = float((Y.double() - ref).abs().max())
        us = time_cuda(lambda: fn(*args), warmup=WARM, iters=TIMED) * 1e3 / SEQ
        res = dict(e, errs=[err], us_step_wall=[us], ok=err <= tol, timing=f"cuda events, median of {TIMED} launches")
        print(json.dumps({k: res[k] for k in ("func", "ok", "errs", "us_step_wall")}), flush=True)
        results.append(res)
    return results


def run_libraries(out: Path, script: str, kinds=(None,)) -> list[dict]:
    """Every library of out/index.json timed by `script cell OUT LIB` in a process of its own (a hang or a failed
    launch costs that library only), each kind's winner printed (kinds: values of the rows' "kernel", None: all
    rows), out/results.json written after each library."""
    index = json.loads((out / "index.json").read_text())
    results = []
    for lib in dict.fromkeys(e["file"] for e in index):
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, script, "cell", str(out), lib], capture_output=True, text=True,
                               timeout=90)
            got = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("[")]
            if got:
                results += got[-1]
            else:
                print(lib, "failed:", p.stderr[-600:], flush=True)
        except subprocess.TimeoutExpired:
            print(lib, "timed out", flush=True)
        for kind in kinds:
            cell = [r for r in results if r["file"] == lib and r["ok"] and kind in (None, r.get("kernel"))]
            if cell:
                best = min(cell, key=lambda r: r["us_step_wall"][0])
                print(f"{lib}{' ' + kind if kind else ''}: best {best['config']} {best['us_step_wall'][0]:.3f} us "
                      f"(first {cell[0]['us_step_wall'][0]:.3f}; {time.time() - t0:.0f}s)", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))   # after each cell: a timeout keeps the rest
    return results


def run(out: Path) -> list[dict]:
    return run_libraries(out, __file__)


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "build":
        build(where, _cells(sys.argv[3] if len(sys.argv) > 3 else None))
    elif mode == "run":
        run(where)
    elif mode == "cell":
        found = run_cell(where, sys.argv[3])
        print(json.dumps(found))
    elif mode == "list":
        for c in _cells(sys.argv[3] if len(sys.argv) > 3 else None):
            print(c, [str(v) for v in variants(*c)])
