"""The README's GRU-vs-cuDNN grid from runs of `tvmseq bench persistent_gru` (its JSON files): per cell
tvmseq's us a step (highest of the runs) / cuDNN's lowest-highest (speedup lowest-highest, each from one
run), and the path letter.

  python3 scripts/gru_grid_table.py artifacts/bench/persistent_gru.json artifacts/bench/persistent_gru_run2.json
"""
from __future__ import annotations

import json
import sys

LETTER = {"persistent": "P", "persistent_mma": "M", "persistent_wgmma": "W", "per_step": "S"}
BATCHES = (1, 8, 64, 256)


def cells(paths):
    grid = {}
    for path in paths:
        for r in json.loads(open(path).read())["rows"]:
            if r.get("status") != "ok":
                continue
            key = (r["dtype"], r["bidirectional"], r["hidden"], r["batch"])
            grid.setdefault(key, []).append(r)
    return grid


def cell_text(rows) -> str:
    tv = max(r["tvmseq_us_step"] for r in rows)
    cu = [r["cudnn_us_step"] for r in rows]
    sp = [r["speedup"] for r in rows]
    paths = {LETTER.get(r["path"], r["path"]) for r in rows}
    cu_s = f"{min(cu):.1f}" if len(rows) == 1 or abs(max(cu) - min(cu)) < 0.05 else f"{min(cu):.1f}-{max(cu):.1f}"
    sp_s = f"{min(sp):.2f}x" if len(rows) == 1 else f"{min(sp):.2f}-{max(sp):.2f}x"
    return f"{tv:.1f} / {cu_s} ({sp_s}) {'/'.join(sorted(paths))}"


def table(paths) -> str:
    grid = cells(paths)
    lines = ["| dtype | dirs | hidden | " + " | ".join(f"batch={b}" for b in BATCHES) + " |",
             "|---|---|---|" + "---|" * len(BATCHES)]
    for dtype in ("float32", "float16"):
        for bi in (False, True):
            for hidden in (256, 512, 1024):
                row = [grid.get((dtype, bi, hidden, b)) for b in BATCHES]
                if not any(row):
                    continue
                lines.append(f"| {dtype} | {'bi' if bi else 'uni'} | {hidden} | "
                             + " | ".join(cell_text(r) if r else "" for r in row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
