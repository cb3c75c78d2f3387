"""Merge LSTM benchmark runs (`tvmseq bench persistent_lstm` JSON, any paths, any cells) into the measured path
database `schedules/measured/lstm_path.json`: for each (D, B, H, dtype) the path whose whole step (input
projection + recurrence) measured fastest, with every path's time. `paths.choose_lstm_path` reads it.

    python schedules/lstm_paths.py artifacts/bench/persistent_lstm_grid.json artifacts/bench/persistent_lstm_mma.json
    python schedules/lstm_paths.py --table FILES...   # the README's grid: the fastest path per cell, with cuDNN's
                                                      # time from the same run (a markdown table)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "measured" / "lstm_path.json"


def _rows(paths: list[str]):
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("status") == "ok" and row.get("agree"):
                yield row


def table(paths: list[str]) -> str:
    """Markdown: per dtype and direction a row per hidden size, a column per batch, each cell
    'tvmseq / cuDNN (ratio) path' for the fastest tvmseq path measured."""
    best: dict[tuple, dict] = {}
    for row in _rows(paths):
        key = (row["dtype"], row["bidirectional"], row["hidden"], row["batch"])
        if key not in best or row["tvmseq_us_step"] < best[key]["tvmseq_us_step"]:
            best[key] = row
    batches = sorted({k[3] for k in best})
    short = {"persistent": "P", "persistent_mma": "M", "persistent_wgmma": "W", "per_step": "S"}
    lines = ["| dtype | dirs | hidden | " + " | ".join(f"batch={b}" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    for dtype, bi, hidden in sorted({k[:3] for k in best}, key=lambda k: (k[0] != "float32", k[1], k[2])):
        cells = []
        for b in batches:
            r = best.get((dtype, bi, hidden, b))
            cells.append("-" if r is None else f"{r['tvmseq_us_step']:.1f} / {r['cudnn_us_step']:.1f} "
                         f"({r['cudnn_us_step'] / r['tvmseq_us_step']:.2f}x) {short.get(r['path'], r['path'])}")
        lines.append(f"| {dtype} | {'bi' if bi else 'uni'} | {hidden} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    times: dict[tuple, dict[str, float]] = {}
    sources = [f"{Path(p).name} ({json.loads(Path(p).read_text()).get('environment', {}).get('gpu', 'GPU')})"
               for p in paths]
    for row in _rows(paths):
        key = (2 if row["bidirectional"] else 1, row["batch"], row["hidden"], row["dtype"])
        times.setdefault(key, {})[row["path"]] = round(row["tvmseq_us_step"], 3)
    entries = [{"key": {"D": D, "B": B, "H": H, "dtype": dt}, "path": min(us, key=us.get), "us": us}
               for (D, B, H, dt), us in sorted(times.items())]
    return {"op": "lstm_path", "source": sources, "entries": entries}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
    else:
        OUT.write_text(json.dumps(merge(sys.argv[1:]), indent=1) + "\n")
        print(f"wrote {OUT}")
