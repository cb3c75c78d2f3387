"""Tune the persistent recurrent GEMM's schedule (blocks, warps, batch chunk, shared-memory rows) by
measurement, and record the winners in schedules/measured/recurrent_gemm.json, which
`recurrent_gemm.default_config` reads.

  tvmseq tune recurrent_gemm build out/rg                          # here: grid + schedule variants
  tvmseq tune recurrent_gemm run out/rg                            # GPU machine: every variant timed
  tvmseq tune recurrent_gemm merge out/rg/recurrent_gemm.json      # here: winners -> the database

(`build`/`run` are `tvmseq bench recurrent_gemm --build DIR` (with the sweep) and `--prebuilt DIR --sweep
--out DIR`; a winner replaces the model's pick only when >= 3% faster in the same run.)
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path


def build(out: Path) -> None:
    from tvmseq.bench import recurrent_gemm

    recurrent_gemm.build_for_gpu(out, sweep=True, tests=False)


def run(out: Path) -> None:
    from tvmseq.bench import recurrent_gemm

    recurrent_gemm.main(["--prebuilt", str(out), "--sweep", "--no-per-step", "--out", str(out)])


def _config(text: str) -> dict:
    blocks, warps, chunk, smem = map(int, re.fullmatch(r"blk(\d+)w(\d+)bc(\d+)s(\d+)", text).groups())
    return dict(num_blocks=blocks, num_warps=warps, batch_chunk=chunk, smem_rows=smem)


def merge(results: Path) -> None:
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.targets import resolve
    from tvmseq.tune import measured

    cuda = resolve("cuda")
    trials = [dict(key=dict(H=r["H"], B=r["B"], dtype=r["dtype"]), config=_config(r["config"]), us=r["tvmseq_us"])
              for r in json.loads(Path(results).read_text())["rows"]
              if r.get("ok") and r.get("path") == "persistent" and r.get("tvmseq_us")]
    measured.merge("recurrent_gemm", trials,
                   lambda k: dataclasses.asdict(rg.default_config(k["H"], k["B"], k["dtype"], cuda, measured=False)),
                   source=f"{results}: us per step, 100 steps")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
