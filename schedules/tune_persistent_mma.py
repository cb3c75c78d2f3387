"""Tune the tensor-core persistent GRU's schedule (units per block, warps, batch chunk rows, pipelined
staging) by measurement, and record the winners in schedules/measured/persistent_mma.json, which
`mma.default_config` reads.

  tvmseq tune persistent_mma build out/pmma_sweep               # here: per (D, B, H) the rule's pick + variants
  tvmseq tune persistent_mma run out/pmma_sweep                 # GPU machine: checked against float64, timed
  tvmseq tune persistent_mma merge out/pmma_sweep/results.json  # here: winners -> the database

The variants per (D, B, H) are schedules/pmma_sweep.py's SWEEP (the rule's pick is added where missing). A winner
replaces the rule's pick only when >= 3% faster. Below the kernel's batch floors (16 in float16, 32 in float32) the
rival is the SIMT engine instead (`build` also builds it at ENGINE_SWEEP's shapes into out/engine, `run` times it in
the same process): an entry there, with the engine as its model_config, makes the importer route that exact shape
to this kernel. The results file may hold several runs, oldest first: a config timed again counts with its newest time, since
the kernel changed between sweeps (sweep 12, 2026-11-23: every config re-timed after the partial-sum stores
changed). artifacts/bench/pmma_sweep.json.gz keeps each config's newest timing (and the failed rows); a new run's
rows are appended to it; the timings they replaced are in git history.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "schedules"))


def _model_pick(D, B, H, cell="gru", dtype="float16"):
    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.targets import resolve

    return pm.default_config(D, B, H, resolve("cuda"), cell, measured=False, dtype=dtype)


def build(out: Path) -> None:
    import pmma_sweep
    from tvmseq.kernels.recurrent import mma as pm

    sweep = {}
    for key, variants in pmma_sweep.SWEEP.items():
        D, B, H, dtype, cell = pmma_sweep.sweep_key(key)
        if _rival(dict(D=D, B=B, H=H, cell=cell, dtype=dtype)) == pm.ENGINE_PICK:
            sweep[key] = variants   # below the batch floor: the engine is the rival (out/engine)
            continue
        knobs = _model_pick(D, B, H, cell, dtype).knobs()
        sweep[key] = variants if knobs in variants else [knobs, *variants]   # the pick is always timed
    pmma_sweep.build(out, sweep)
    # below the batch floors the rival is the SIMT engine: built beside the variants, timed in the same process
    pmma_sweep.build(out / "engine", pmma_sweep.ENGINE_SWEEP, kernel="persistent_gru")


def run(out: Path) -> None:
    """Both libraries of `build` timed; out/results.json holds the variants' rows and then the engine's."""
    import pmma_sweep

    pmma_sweep.run(out)
    if (out / "engine" / "index.json").exists():
        pmma_sweep.run(out / "engine")
        rows = json.loads((out / "results.json").read_text()) + json.loads((out / "engine" / "results.json").read_text())
        (out / "results.json").write_text(json.dumps(rows, indent=1))


def _rival(key: dict) -> dict:
    """What a winner must beat: below the batch floors the SIMT engine (the importer's path there), else the
    rules' pick."""
    from tvmseq.kernels.recurrent import mma as pm

    floor = pm.SIMT_MIN_BATCH if key["dtype"] == "float32" else pm.MMA_MIN_BATCH
    if key["B"] < floor:
        return pm.ENGINE_PICK
    return dataclasses.asdict(_model_pick(key["D"], key["B"], key["H"], key["cell"], key["dtype"]))


def merge(results: Path) -> None:
    from tvmseq.kernels.recurrent.mma import ENGINE_PICK, MmaConfig
    from tvmseq.tune import measured

    newest = {}   # the kernel changes between sweeps: a config's newest timing (rows are in run order) counts
    for r in measured.read_results(results):
        if r.get("ok") and r.get("us_step"):
            key = dict(D=r["D"], B=r["B"], H=r["H"], cell=r.get("cell", "gru"), dtype=r.get("dtype", "float16"))
            engine = r.get("kernel") == "persistent_gru"   # the SIMT engine's rows (schedules/pmma_sweep.py build-engine)
            config = ENGINE_PICK if engine else dataclasses.asdict(MmaConfig.of(r["config"]))
            newest[json.dumps([key, config], sort_keys=True)] = dict(key=key, config=config, us=r["us_step"])
    trials = list(newest.values())
    measured.merge("persistent_mma", trials, _rival,
                   source=f"{results}: CUDA-event time per step, recurrence only (seq 100)")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
