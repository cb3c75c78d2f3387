"""Measured schedule sweep of the persistent LSTM on the H100: the SIMT engine's configs (`pgru_sweep.variants` on the
4-gate cell) and the staged-state kernel's (its rule pick, the GRU-derived picks, and cluster configs whose state is
handed over in distributed shared memory where one batch group's unit blocks fit a cluster of <= 16 blocks), one
library per cell. The LSTM's engine configs had never been timed: `engine.default_lstm_config` used the GRU/RNN
fit on the LSTM's geometry, and no hidden-128 shape had a dsmem config.

  python3 schedules/plstm_sweep.py build out/plstm [CELLS]   # here: one library per cell, index.json
  python3 schedules/plstm_sweep.py build-auto out/odd CELLS   # here: only the importer's pick per cell
  python3 schedules/plstm_sweep.py build-tiles out/ltile      # here: the per-step path's step GEMM tiles
  python3 schedules/plstm_sweep.py build-wgmma out/lwg CELLS  # here: the warpgroup kernel's configs (float16)
  python3 schedules/plstm_sweep.py run out/plstm              # GPU machine: each cell's variants in one process
  python3 schedules/plstm_sweep.py merge out/plstm/results.json   # here: winners -> both measured databases
                                                  # (committed: artifacts/bench/plstm_sweep.json.gz, after the GRU's)

CELLS: comma-separated D:B:H:dtype (default CELLS). `run` checks each variant against a float64 LSTM recurrence and
times it with CUDA events (median of TIMED launches), recurrence only; a cell's process has a deadline.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# the cells slower than cuDNN or short of a target on the LSTM grid (README, 2026-11-26) where a persistent kernel
# runs, the VAD benchmark's LSTM at batch 32, and their neighbours
CELLS = [(1, 64, 128, "float16"), (1, 64, 128, "float32"), (1, 32, 128, "float32"), (1, 256, 128, "float16"),
         (1, 8, 128, "float16"), (2, 256, 128, "float16"), (2, 64, 128, "float32"), (1, 8, 128, "float32"),
         (1, 8, 512, "float16"), (1, 8, 1024, "float16"), (1, 8, 256, "float16"), (2, 8, 512, "float16"),
         (1, 8, 512, "float32"), (1, 8, 1024, "float32"), (2, 8, 1024, "float32"), (1, 64, 512, "float32")]
SEQ, WARM, TIMED = 100, 3, 20


def mma_variants(D: int, B: int, H: int, dtype: str) -> list:
    """Staged-state configs: the rules' pick, the GRU-derived LSTM picks, then every cluster config with the state in
    distributed shared memory (cluster = the G unit blocks of a batch group, one chunk a block; float16 also with
    the warps splitting the gate rows) that fits."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    facts = rg.gpu_facts(tgt)
    fits = lambda c: c is not None and pm.MmaGeometry(D, B, H, 4, c, dtype).check(facts) is None  # noqa: E731
    picks = [pm.default_config(D, B, H, tgt, "lstm", measured=False, dtype=dtype)]
    picks += pm.lstm_variants(pm.default_config(D, B, H, tgt, "gru", measured=False, dtype=dtype))
    for units in (8, 16, 32):
        groups = math.ceil(H / units)
        if not 2 <= groups <= pm.CLUSTER_SYNC_MAX:
            continue
        # float32 at batch <= 8 also 1 and 2 warps: a step's partial sums and barrier over fewer warps
        for warps in ((1, 2, 4, 8, 16) if dtype == "float32" and B <= 8 else (4, 8, 16)):
            # float16 at batch <= 8: also 8-row chunks with the gate rows as the mma's M (gate_m)
            # float32 at batch <= 8: also chunks of 1-8 rows (the gate rows spread over the lanes:
            # `mma.SIMT_SMALL_CHUNKS`) up to the smallest that holds the batch; a smaller one splits the batch over
            # clusters (batch_split), each cluster a step as short as batch 1's
            fitting = [r for r in pm.SIMT_SMALL_CHUNKS if r >= B][:1]
            small = [r for r in pm.SIMT_SMALL_CHUNKS if r <= fitting[0]] if dtype == "float32" and fitting else []
            for rows in ((8, 16, 32) if dtype == "float16" and B <= 8 else (*small, 16, 32)):
                # float16: the warps may also split the gate rows (n_split; the check refuses what does not divide)
                for n_split in ((1, 2, 4, 8) if dtype == "float16" else (1,)):
                    split = math.ceil(B / rows)
                    picks.append(pm.MmaConfig(units, warps, rows, batch_split=split, cluster=groups,
                                              cluster_sync=True, dsmem=True, n_split=n_split,
                                              gate_m=rows == 8 and dtype == "float16"))
    if dtype == "float16" and B <= 8:   # the grid-barrier picks with 8-row gate_m chunks
        picks += [dataclasses.replace(c, chunk_rows=8, gate_m=True) for c in picks[:1] if c and not c.dsmem]
    return [c for c in dict.fromkeys(picks) if fits(c) and D * math.ceil(H / c.units_per_block) * c.batch_split
            <= facts.num_sms * 2]


def engine_variants(D: int, B: int, H: int, dtype: str) -> list:
    import pgru_sweep

    return pgru_sweep.variants(D, B, H, dtype, "lstm")


def _cells(arg: str | None):
    if not arg:
        return CELLS
    return [(int(d), int(b), int(h), dtype) for d, b, h, dtype in (t.split(":") for t in arg.split(","))]


def _funcs(D, B, H, dtype, tgt):
    """{name: prim_func}, [index rows] of one cell's variants."""
    from tvmseq.kernels.recurrent import engine
    from tvmseq.kernels.recurrent import mma as pm

    direction = "bidirectional" if D == 2 else "forward"
    funcs, rows = {}, []
    for cfg in engine_variants(D, B, H, dtype):
        name = (f"e_lstm_d{D}_b{B}_h{H}_{dtype}_g{cfg.num_blocks}w{cfg.num_warps}c{cfg.batch_chunk}"
                f"s{cfg.smem_rows}")
        funcs[name] = engine.persistent_lstm_func(D, B, H, dtype, direction, target=tgt, config=cfg)
        rows.append(dict(kernel="persistent_gru", config=str(cfg), func=name))
    for cfg in mma_variants(D, B, H, dtype):
        name = f"m_lstm_d{D}_b{B}_h{H}_{dtype}_" + "_".join(map(str, cfg.knobs()))
        funcs[name] = pm.persistent_mma_func(D, B, H, dtype, direction, None, None, False, tgt, cfg, "lstm")
        rows.append(dict(kernel="persistent_mma", config=list(cfg.knobs()), func=name))
    for r in rows:
        r.update(D=D, B=B, H=H, dtype=dtype, cell="lstm")
    return {n: f.with_attr("global_symbol", n) for n, f in funcs.items()}, rows


def auto_funcs(D, B, H, dtype, tgt):
    """{name: prim_func}, [index row] of the recurrence the importer picks for a cell (`paths.choose_lstm_path`):
    what `build-auto` checks at odd sizes on the GPU."""
    from tvmseq.kernels.recurrent import lstm, paths

    spec = lstm.LstmSpec(D, B, H, H, dtype, direction="bidirectional" if D == 2 else "forward")
    func, path, why = paths.lstm_recurrence_auto(spec, tgt)
    if func is None:
        return {}, []
    name = f"auto_lstm_d{D}_b{B}_h{H}_{dtype}"
    return ({name: func.with_attr("global_symbol", name)},
            [dict(kernel=path, config=why, func=name, D=D, B=B, H=H, dtype=dtype, cell="lstm")])


def wgmma_variants(D: int, B: int, H: int) -> list:
    """Warpgroup configs of a float16 cell that fit: 8 or 16 units a block, every batch split, the state chunk
    whole or through a ring of 2, 3, 4, 6, 8 .. k-tiles (one that need not divide them); one or two blocks an SM, one or two warpgroups a block."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import wgmma as pw
    from tvmseq.targets import resolve

    facts = rg.gpu_facts(resolve("cuda"))
    nkb = math.ceil(H / pw.KB)
    configs = [pw.WgmmaRecConfig(ub, bs, st, wgs) for ub in (16, 8) for bs in (1, 2, 4)
               for st in (0, 2, 3) + tuple(range(4, nkb, 2)) for wgs in (1, 2)]
    return [c for c in configs if pw.WgmmaRecGeometry(D, B, H, 4, c).check(facts) is None]


def wgmma_funcs(D, B, H, dtype, tgt):
    """{name: prim_func}, [index rows] of a float16 cell's warpgroup variants (`wgmma_variants`)."""
    from tvmseq.kernels.recurrent import wgmma as pw

    direction = "bidirectional" if D == 2 else "forward"
    funcs, rows = {}, []
    for cfg in wgmma_variants(D, B, H):
        name = f"w_lstm_d{D}_b{B}_h{H}_{dtype}_" + "_".join(map(str, cfg.knobs()))
        funcs[name] = pw.persistent_wgmma_func(D, B, H, dtype, direction, None, None, False, tgt, cfg, "lstm")
        rows.append(dict(kernel="persistent_wgmma", config=list(cfg.knobs()), func=name, D=D, B=B, H=H,
                         dtype=dtype, cell="lstm"))
    return {n: f.with_attr("global_symbol", n) for n, f in funcs.items()}, rows


# the per-step path's cells (fp32, batch >= 64 at hidden >= 512): its step GEMM [B, H] x [H, 4H] had only the
# cost model's tile (the tuned database holds the GRU's 3H shapes)
TILE_CELLS = [(1, 256, 1024, "float32"), (2, 256, 1024, "float32"), (1, 64, 1024, "float32"), (2, 64, 1024, "float32"),
              (1, 256, 512, "float32"), (2, 256, 512, "float32")]
TILES_PER_CELL = 10


def tile_funcs(D, B, H, dtype, tgt):
    """{name: prim_func}, [index rows] of the per-step LSTM with the step GEMM tiles the cost model ranks best
    (the best bk of each tile shape and split; its own pick first)."""
    from tvmseq.kernels.recurrent import gru, lstm
    from tvmseq.kernels.recurrent import step_gemm as sg

    from tvmseq.bench.gru import sweep_tiles

    c = dict(dtype=dtype, bidirectional=D == 2, hidden=H, batch=B)
    pick = sg.normalized(sg.choose_tile(B, 4 * H, H, D, dtype, tgt, measured=False), H)
    ranked = [t for t, _ in sweep_tiles(c, tgt, 4 * TILES_PER_CELL, by_split=True, gates=4)]
    tiles = [pick] + [t for t in ranked if t != pick][:TILES_PER_CELL - 1]
    spec = lstm.LstmSpec(D, B, H, H, dtype, direction="bidirectional" if D == 2 else "forward")
    funcs, rows = {}, []
    for tile in tiles:
        name = (f"s_lstm_d{D}_b{B}_h{H}_{dtype}_{tile.bm}x{tile.bn}x{tile.bk}_{tile.tm}x{tile.tn}_s{tile.split_k}")
        sched = gru.StepSchedule(tiled=True, tile=tile)
        funcs[name] = lstm.recurrence_func(spec, tgt, sched).with_attr("global_symbol", name)
        rows.append(dict(kernel="step_gemm", config=dict(bm=tile.bm, bn=tile.bn, bk=tile.bk, tm=tile.tm, tn=tile.tn,
                                                          split_k=tile.split_k, vec=tile.vec),
                         func=name, D=D, B=B, H=H, dtype=dtype, cell="lstm"))
    return funcs, rows


def build(out: Path, cells, funcs_of=None) -> None:
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() else []
    for D, B, H, dtype in cells:
        lib = f"lstm_d{D}_b{B}_h{H}_{dtype}.so"
        if (out / lib).exists():
            continue
        t0 = time.time()
        funcs, rows = (funcs_of or _funcs)(D, B, H, dtype, tgt)
        if not funcs:
            print(lib, "no persistent kernel: skipped", flush=True)
            continue
        ex, report = compile_for_gpu(funcs, tgt)
        ex.export_library(str(out / lib))
        for r in rows:
            r["file"], r["ptxas"] = lib, report.get(r["func"] + "_kernel", {})
            spill = r["ptxas"].get("spill_stores", 0)
            print(r["func"], r["ptxas"].get("registers"), "regs", f"SPILL {spill}" if spill else "", flush=True)
        index += rows
        (out / "index.json").write_text(json.dumps(index, indent=1))
        print(f"{lib}: {len(funcs)} kernels in {time.time() - t0:.0f}s", flush=True)


def reference(gate_i, R, h0, c0):
    """float64 ONNX LSTM recurrence (gates i, o, f, c; no peepholes), Y [T, D, B, H]; direction 1 runs backwards."""
    import torch

    D, T_, B, H = gate_i.shape[0], gate_i.shape[1], gate_i.shape[2], R.shape[-1]
    Y = torch.empty(T_, D, B, H, dtype=torch.float64, device=gate_i.device)
    for d in range(D):
        h, c = h0[d].double(), c0[d].double()
        for s in range(T_):
            t = T_ - 1 - s if d else s
            i, o, f, g = (gate_i[d, t].double() + h @ R[d].double().T).split(H, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            Y[t, d] = h
    return Y


def run_cell(out: Path, lib: str) -> list[dict]:
    import torch
    import tvm

    from tvmseq.measure import time_cuda

    rows = [e for e in json.loads((out / "index.json").read_text()) if e["file"] == lib]
    D, B, H, dtype = (rows[0][k] for k in ("D", "B", "H", "dtype"))
    mod = tvm.runtime.load_module(str(out / lib))
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_i = torch.randn(D, SEQ, B, 4 * H, device="cuda", generator=g)
    R = ((torch.rand(D, 4 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(getattr(torch, dtype))
    P = torch.zeros(D, 3 * H, device="cuda")
    h0, c0 = (torch.randn(D, B, H, device="cuda", generator=g) * 0.5 for _ in range(2))
    ref = reference(gate_i, R, h0, c0)
    Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=R.dtype)
    Yh, Yc = (torch.empty(D, B, H, device="cuda", dtype=R.dtype) for _ in range(2))
    lens = torch.full((B,), SEQ, dtype=torch.int32, device="cuda")
    args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, P, lens, h0, c0, Y, Yh, Yc)]
    tol = 2e-3 if dtype == "float16" else 1e-4
    results = []
    for e in rows:
        fn = mod[e["func"]]
        Y.fill_(float("nan"))
        try:
            fn(*args)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a variant that cannot launch (e.g. not co-resident) costs itself only
            print(e["func"], "failed:", f"{type(err).__name__}: {err}"[:200], flush=True)
            continue
        err = float((Y.double() - ref).abs().max())
        # CHECK_ONLY=1: correctness only (under compute-sanitizer, where timing means nothing)
        us = float("nan") if os.environ.get("CHECK_ONLY") else time_cuda(lambda: fn(*args), warmup=WARM,
                                                                          iters=TIMED) * 1e3 / SEQ
        res = dict(e, errs=[err], us_step_wall=[us], ok=err <= tol, timing=f"cuda events, median of {TIMED} launches")
        print(json.dumps({k: res[k] for k in ("func", "ok", "errs", "us_step_wall")}), flush=True)
        results.append(res)
    return results


def run(out: Path) -> list[dict]:
    import pgru_sweep

    return pgru_sweep.run_libraries(out, __file__, ("persistent_gru", "persistent_mma", "step_gemm", None))


def merge(results: Path) -> None:
    """Each kernel's winners into its database: the engine's (persistent_gru.json, cell 'lstm') against its cost
    model's pick; the staged-state kernel's (persistent_mma.json) against what the importer would run otherwise
    (`tune_persistent_mma._rival`: below the batch floors the engine, timed in the same process, else the rules'
    pick); the warpgroup kernel's (persistent_wgmma.json) against its rule's pick. A winner replaces the pick only
    where >= 3% faster in the same run (`measured.merge`)."""
    import dataclasses

    import tune_persistent_gru
    import tune_persistent_mma
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.targets import resolve
    from tvmseq.tune import measured

    found = measured.read_results(results)   # a run's results.json (rows) or the committed artifact (a dict)
    rows = [r for r in (found["rows"] if isinstance(found, dict) else found) if r.get("ok") and r.get("us_step_wall")]
    key = lambda r, *extra: dict(D=r["D"], B=r["B"], H=r["H"], **{k: r[k] for k in extra})  # noqa: E731
    source = f"{results}: time per step (CUDA events), recurrence only"
    engine = [r for r in rows if r["kernel"] == "persistent_gru"]
    measured.merge("persistent_gru", [dict(key=key(r, "dtype", "cell"), config=tune_persistent_gru._config(r["config"]),
                                           us=r["us_step_wall"][-1]) for r in engine],
                   lambda k: dataclasses.asdict(tune_persistent_gru._model_pick(k["D"], k["B"], k["H"], k["dtype"],
                                                                               k["cell"])), source=source)
    engine_best = {}   # the engine's fastest config per cell: what the importer runs where it does not pick mma
    for r in engine:
        k = json.dumps(key(r, "cell", "dtype"), sort_keys=True)
        engine_best[k] = min(engine_best.get(k, float("inf")), r["us_step_wall"][-1])
    trials = [dict(key=key(r, "cell", "dtype"), config=dataclasses.asdict(pm.MmaConfig.of(r["config"])),
                   us=r["us_step_wall"][-1]) for r in rows if r["kernel"] == "persistent_mma"]
    trials += [dict(key=json.loads(k), config=pm.ENGINE_PICK, us=us) for k, us in engine_best.items()]
    measured.merge("persistent_mma", trials, tune_persistent_mma._rival, source=source)
    wgmma = [r for r in rows if r["kernel"] == "persistent_wgmma"]
    if wgmma:   # the warpgroup kernel's configs against its rule's pick (one block an SM, one warpgroup)
        from tvmseq.kernels.recurrent import wgmma as pw

        measured.merge("persistent_wgmma", [dict(key=key(r, "cell"), config=dataclasses.asdict(pw.WgmmaRecConfig.of(
            r["config"])), us=r["us_step_wall"][-1]) for r in wgmma],
            lambda k: dataclasses.asdict(pw.default_config(k["D"], k["B"], k["H"], resolve("cuda"), k["cell"],
                                                           measured=False)), source=source)
    tiles = [r for r in rows if r["kernel"] == "step_gemm"]
    if tiles:   # the per-step path's step GEMM: [B, H] x [H, 4H] a direction, against the cost model's tile
        from tvmseq.kernels.recurrent import step_gemm as sg

        def model_tile(k):
            return dataclasses.asdict(sg.normalized(sg.choose_tile(k["M"], k["N"], k["K"], k["D"], k["dtype"],
                                                                   resolve("cuda"), measured=False), k["K"]))

        measured.merge("step_gemm", [dict(key=dict(M=r["B"], N=4 * r["H"], K=r["H"], D=r["D"], dtype=r["dtype"]),
                                          config=r["config"], us=r["us_step_wall"][-1]) for r in tiles],
                       model_tile, source=f"{results}: us per step of the per-step LSTM (recurrence only)")


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    if mode == "build":
        build(where, _cells(sys.argv[3] if len(sys.argv) > 3 else None))
    elif mode == "build-auto":   # the importer's pick only, e.g. at odd sizes
        build(where, _cells(sys.argv[3]), auto_funcs)
    elif mode == "build-tiles":   # the per-step path's step GEMM tiles (TILE_CELLS)
        build(where, _cells(sys.argv[3]) if len(sys.argv) > 3 else TILE_CELLS, tile_funcs)
    elif mode == "build-wgmma":   # the warpgroup kernel's configs, float16 cells
        build(where, _cells(sys.argv[3]), wgmma_funcs)
    elif mode == "run":
        run(where)
    elif mode == "cell":
        print(json.dumps(run_cell(where, sys.argv[3])))
    elif mode == "merge":
        merge(where)
    elif mode == "list":
        for c in _cells(sys.argv[3] if len(sys.argv) > 3 else None):
            print(c, "engine", [str(v) for v in engine_variants(*c)])
            print(c, "mma", [v.knobs() for v in mma_variants(*c)])
