"""Tune the sparse matmul kernels' launch shape (lanes, rows per block, non-zero split, unroll) by
measurement, and record the winners in schedules/measured/spmm.json, which `spmm.default_schedule` reads.

  tvmseq tune spmm build out/spmm                  # here: every kernel + its schedule neighbours
  tvmseq tune spmm run out/spmm                    # GPU machine: each variant timed on every density
  tvmseq tune spmm merge out/spmm/spmm.json        # here: winners -> the database

(`build`/`run` are `tvmseq bench spmm --build-only DIR` / `--prebuilt DIR --out DIR`, which time the
variants of `bench.spmm.variants` beside the default.) The kernels are built per shape with nnz symbolic,
so a variant is scored by its geometric mean over the densities timed; it replaces the model's pick only
when >= 3% faster.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path


def build(out: Path) -> None:
    from tvmseq.bench import spmm

    spmm.build_for_gpu(out)


def run(out: Path) -> None:
    from tvmseq.cli import main as cli

    cli(["bench", "spmm", "--prebuilt", str(out), "--out", str(out)])


def trials_of(results: dict) -> list[dict]:
    """One trial per (shape, schedule): the geometric mean of its times over the densities."""
    from tvmseq.bench.spmm import kernel_name
    from tvmseq.kernels.sparse.spmm import SpmmShape

    schedules = results["schedules"]
    # a benchmark row names its kernel's shape by (op, "rows x cols", n, dtype)
    shape_of = {(k["shape"]["transposed"], f"{k['shape']['rows']}x{k['shape']['cols']}", k["shape"]["n_cols"],
                 k["shape"]["dtype"]): SpmmShape(**k["shape"]) for k in schedules.values() if k["variant"] == "default"}
    times: dict[str, list[float]] = {}
    for row in results["rows"]:
        shape = shape_of.get((row["op"] == "spmm_t", row["shape"], row["n"], row["dtype"]))
        if not row.get("agree") or shape is None:
            continue
        for tag, ms in (row.get("variants_ms") or {}).items():
            name = kernel_name(shape, tag)
            if ms is not None and name in schedules:
                times.setdefault(name, []).append(ms * 1e3)
    return [dict(key=schedules[name]["shape"], config=schedules[name]["schedule"],
                 us=math.exp(sum(map(math.log, values)) / len(values))) for name, values in times.items()]


def merge(results: Path) -> None:
    from tvmseq.kernels.sparse import spmm
    from tvmseq.targets import resolve
    from tvmseq.tune import measured

    cuda = resolve("cuda")
    measured.merge("spmm", trials_of(measured.read_results(results)),
                   lambda k: dataclasses.asdict(spmm.default_schedule(spmm.SpmmShape(**k), cuda, measured=False)),
                   source=f"{results}: geometric mean over densities of us per call")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
