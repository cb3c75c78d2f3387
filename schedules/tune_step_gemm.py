"""Tune the per-step path's tiled step GEMM (tile, K split) by measurement, and record the winners in
schedules/measured/step_gemm.json, which `step_gemm.choose_tile` reads on GPU targets.

  tvmseq tune step_gemm build out/gru                  # here: per config the cost model's 5 best tiles
  tvmseq tune step_gemm run out/gru                    # GPU machine: each tile's whole GRU step timed
  tvmseq tune step_gemm merge out/gru/gru_sweep.json.gz   # here: winners -> the database

(`build` and `run` are `tvmseq bench gru --build DIR` and `--prebuilt DIR --sweep-only --out DIR`; rank 0 of
each config is the model's pick; a winner replaces it only when >= 3% faster in the same run.)
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path


def build(out: Path) -> None:
    from tvmseq.cli import main as cli

    cli(["bench", "gru", "--build", str(out), "--no-tests"])


def run(out: Path) -> None:
    from tvmseq.cli import main as cli

    cli(["bench", "gru", "--prebuilt", str(out), "--sweep-only", "--out", str(out)])


def _tile(text: str) -> dict:
    bm, bn, bk, tm, tn, split = map(int, re.fullmatch(r"(\d+)x(\d+)x(\d+) (\d+)x(\d+) s(\d+)", text).groups())
    return dict(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, split_k=split, vec=4)


def merge(results: Path) -> None:
    from tvmseq.kernels.recurrent import step_gemm
    from tvmseq.targets import resolve
    from tvmseq.tune import measured

    cuda = resolve("cuda")

    def model_pick(k):
        tile = step_gemm.choose_tile(k["M"], k["N"], k["K"], k["D"], k["dtype"], cuda, measured=False)
        return dataclasses.asdict(step_gemm.normalized(tile, k["K"]))

    trials = []
    for r in measured.read_results(results)["rows"]:
        if r.get("agree"):
            H = r["hidden"]
            key = dict(M=r["batch"], N=3 * H, K=H, D=2 if r.get("bidirectional") else 1, dtype=r["dtype"])
            trials.append(dict(key=key, config=_tile(r["tile"]), us=r["tvmseq_us_step"]))
    measured.merge("step_gemm", trials, model_pick, source=f"{results}: us per step of the per-step GRU")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
