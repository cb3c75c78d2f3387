"""Tune the persistent LSTM's schedules by measurement: the SIMT engine's configs and the staged-state kernel's
(cluster hand-off configs included), per cell in one process, and record the winners in
schedules/measured/persistent_gru.json (engine, cell 'lstm') and schedules/measured/persistent_mma.json, which
`engine.default_lstm_config` and `mma.default_config` read.

  tvmseq tune persistent_lstm build out/lsw                  # here: schedules/plstm_sweep.py's cells and variants
  tvmseq tune persistent_lstm run out/lsw                    # GPU machine: checked against float64, timed
  tvmseq tune persistent_lstm merge out/lsw/results.json     # here: winners -> the databases

A staged-state winner below the batch floors must beat the engine's best config in the same run; a winner
replaces the pick only when >= 3% faster. After a merge, re-time the cells' whole steps (`tvmseq bench
persistent_lstm --path ...`) and fold them into the path database (`schedules/lstm_paths.py`).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(out: Path) -> None:
    import plstm_sweep

    plstm_sweep.build(out, plstm_sweep.CELLS)


def run(out: Path) -> None:
    import plstm_sweep

    plstm_sweep.run(out)


def merge(results: Path) -> None:
    import plstm_sweep

    plstm_sweep.merge(results)


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
