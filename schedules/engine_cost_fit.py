"""How well the SIMT engine's step cost model ranks the configs the sweep timed (artifacts/bench/pgru_sweep.json.gz),
against a linear model fitted to those timings:

  t_step = c0 + c1 NC + c2 NC issue / 1000 + c3 NC KT + c4 NC G / 64       (us)

NC passes a step, `issue` the issue-cycle count of one pass (`recurrent_gemm.pass_issue_cycles`), KT k-values a
thread, G blocks a direction. Per cell (D, B, H, dtype, GRU/RNN) it prints the cost model's pick (what
`default_gru_config(measured=False)` returns) and the fitted model's pick, fitted without that cell (leave one cell
out), each as its time over the cell's best measured time ("unmeasured" when the sweep did not time that config).

  python3 schedules/engine_cost_fit.py [artifacts/bench/pgru_sweep.json.gz]

H100, 2026-11-23: the fit put ~0.8 us on every pass, i.e. the hand-off is paid per pass where the cycle model
(`recurrent_gemm.estimate_step_cycles`) overlaps passes with one hand-off a step. Re-run with 387 configs (32 cells,
the fewest-pass configs timed): the cycle model's picks were 0-110% slower than the best (mean 43%), the fit's
0-79% (mean 7%); the fit's weights on all cells are now the engine's cost model (`engine.STEP_FIT_US`),
so the two columns print the same picks until the sweep is re-run and re-fitted.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np


def load(path: Path) -> list[dict]:
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import engine
    from tvmseq.tune import measured

    rows = []
    for r in measured.read_results(path):
        if r.get("ok"):
            cfg = rg.PersistentConfig(**{k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", r["config"])})
            cell = r.get("cell", "gru")
            rows.append(dict(cell=(r["D"], r["B"], r["H"], r["dtype"], cell), cfg=cfg, us=r["us_step_wall"][0],
                             geo=engine._geometry(r["D"], r["B"], r["H"], cfg, True, cell)))
    return rows


def fitted_pick(D: int, B: int, H: int, dtype: str, cell: str, weights, tgt):
    """The engine's own search (`recurrent_gemm.default_config`, no database) with `weights` as its step cost."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import cells, engine

    ng = cells.GATES[cell]
    return rg.default_config(H, B, dtype, tgt, rows_per_unit=ng, directions=D, rows_total=ng * H, measured=False,
                             step_cost=lambda geo: float(np.dot(weights, engine.step_features(geo))))


def main(path: Path) -> None:
    from tvmseq.kernels.recurrent import engine
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    rows = load(path)
    X, y = np.array([engine.step_features(r["geo"]) for r in rows]), np.array([r["us"] for r in rows])
    weights = np.linalg.lstsq(X, y, rcond=None)[0]
    print("fit on all cells (us):", np.round(weights, 3), "rms residual", round(float(np.sqrt(np.mean((X @ weights - y) ** 2))), 3))
    regrets = {"cost model": [], "fit": []}
    for cell in sorted({r["cell"] for r in rows}):
        timed = {r["cfg"]: r["us"] for r in rows if r["cell"] == cell}
        rest = [i for i, r in enumerate(rows) if r["cell"] != cell]
        w = np.linalg.lstsq(X[rest], y[rest], rcond=None)[0]
        best = min(timed.values())
        line = []
        for name, cfg in (("cost model", engine.default_gru_config(*cell[:4], tgt, cell[4], measured=False)),
                          ("fit", fitted_pick(*cell, w, tgt))):
            knobs = f"{cfg.num_blocks},{cfg.num_warps},{cfg.batch_chunk},{cfg.smem_rows}"
            if cfg in timed:
                regrets[name].append(timed[cfg] / best - 1)
                line.append(f"{name} {knobs} {timed[cfg] / best - 1:+.0%}")
            else:
                line.append(f"{name} {knobs} unmeasured")
        print(cell, f"best {best:.2f} us;", "; ".join(line))
    for name, r in regrets.items():
        print(f"{name}: {len(r)} picks timed, slower than the best by mean {np.mean(r):.0%}, max {np.max(r):.0%}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "artifacts/bench/pgru_sweep.json.gz"))
