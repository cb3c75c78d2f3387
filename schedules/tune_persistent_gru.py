"""Tune the persistent GRU's (and RNN's) schedule (blocks per direction, warps, batch chunk, shared-memory rows) by
measurement, and record the winners in schedules/measured/persistent_gru.json, which
`engine.default_gru_config` reads.

  tvmseq tune persistent_gru build out/sweep                 # here: per grid cell the model's pick + variants
  tvmseq tune persistent_gru run out/sweep                   # GPU machine: checked against float64, timed
  tvmseq tune persistent_gru merge out/sweep/results.json    # here: winners -> the database

The cells and variants are schedules/pgru_sweep.py's; `run` prints each cell's winner as it goes and runs each cell
in its own process (a hang costs that cell). A winner replaces the model's pick only when >= 3% faster in the same
run.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "schedules"))

def _model_pick(D, B, H, dtype="float32", cell="gru"):
    from tvmseq.kernels.recurrent import engine
    from tvmseq.targets import resolve

    return engine.default_gru_config(D, B, H, dtype, resolve("cuda"), cell, measured=False)


def build(out: Path) -> None:
    import pgru_sweep  # schedules/pgru_sweep.py: the cells, their variants (the model's pick first) and the builder

    pgru_sweep.build(out, pgru_sweep.CELLS)


def run(out: Path) -> None:
    import pgru_sweep

    pgru_sweep.run(out)


def _config(text: str) -> dict:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", text)}


def merge(results: Path) -> None:
    from tvmseq.tune import measured

    trials = []
    for r in measured.read_results(results):
        if r.get("ok") and r.get("us_step_wall"):
            key = dict(D=r["D"], B=r["B"], H=r["H"], dtype=r["dtype"], cell=r.get("cell", "gru"))
            trials.append(dict(key=key, config=_config(r["config"]), us=r["us_step_wall"][-1]))
    measured.merge("persistent_gru", trials,
                   lambda k: dataclasses.asdict(_model_pick(k["D"], k["B"], k["H"], k["dtype"], k["cell"])),
                   source=f"{results}: time per step (CUDA events), recurrence only")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
