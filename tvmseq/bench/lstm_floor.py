"""`tvmseq bench lstm_floor [--grid FILES]`: how far each cell of the LSTM grid is from its arithmetic floor.

A step of an LSTM layer (seq 100, input size = hidden, as `tvmseq bench persistent_lstm` runs it) does
2 * B * 4H * (I + H) floating-point operations per direction: the input projection's share and the recurrence's.
No kernel can do them faster than the GPU's best measured GEMM rate for that dtype (measured here: torch.matmul
on large square matrices, TF32 off for float32, the best of a few sizes), so FLOPs / rate is a floor on the time a
step takes. Where 3x cuDNN (the issue's target for cells where cuDNN takes 10 us a step or more at batch <= 64)
is below that floor, the target cannot be met by any schedule; the table shows the floor and how far tvmseq's
measured time is from it. The grid's times come from the JSON of earlier runs on the same GPU kind (default:
artifacts/bench/persistent_lstm_*.json, the fastest path of each cell, cuDNN from the same run).

The floor ignores the per-step hand-off (the state every block needs before the next step: a grid barrier or a
cluster exchange, about 1 us measured), so it is a lower bound, not a prediction.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .common import BENCH_DIR, print_table, ratio_bar_plot, save

NAME = "lstm_floor"
SQUARE_SIZES = (4096, 8192)
TARGET_SPEEDUP = 3.0
TARGET_MIN_PEER_US = 10.0     # the 3x target holds where cuDNN takes this long a step or more ...
TARGET_MAX_BATCH = 64         # ... at batch <= 64


def add_arguments(parser) -> None:
    parser.add_argument("--grid", nargs="*", default=None,
                        help="persistent_lstm JSON files (default: artifacts/bench/persistent_lstm_*.json)")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default: artifacts/bench)")


def best_gemm_tflops() -> dict[str, float]:
    """{dtype: TFLOP/s}: the best of torch.matmul on square matrices (CUDA events, median of 20), TF32 off."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    rates = {}
    for dtype in ("float32", "float16"):
        best = 0.0
        for n in SQUARE_SIZES:
            a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
            for _ in range(3):
                a @ b
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                a @ b
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            best = max(best, 2 * n ** 3 / statistics.median(times) / 1e12)
        rates[dtype] = best
    return rates


def fastest_cells(paths: list[Path]) -> list[dict]:
    """The fastest agreeing tvmseq path of each (dtype, direction, hidden, batch) cell across the files."""
    best: dict[tuple, dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            if row.get("status") != "ok" or not row.get("agree"):
                continue
            key = (row["dtype"], row["bidirectional"], row["hidden"], row["batch"])
            if key not in best or row["tvmseq_us_step"] < best[key]["tvmseq_us_step"]:
                best[key] = row
    return [best[k] for k in sorted(best, key=lambda k: (k[0] != "float32", k[1], k[2], k[3]))]


def floor_row(cell: dict, tflops: float) -> dict:
    H, B, D = cell["hidden"], cell["batch"], 2 if cell["bidirectional"] else 1
    flops = D * 2 * B * 4 * H * (H + H)
    floor_us = flops / (tflops * 1e12) * 1e6
    peer = cell["cudnn_us_step"]
    target_3x = peer >= TARGET_MIN_PEER_US and B <= TARGET_MAX_BATCH
    return {"dtype": cell["dtype"], "dirs": "bi" if D == 2 else "uni", "hidden": H, "batch": B,
            "tvmseq_us": cell["tvmseq_us_step"], "cudnn_us": peer, "speedup": peer / cell["tvmseq_us_step"],
            "floor_us": floor_us, "tvmseq_over_floor": cell["tvmseq_us_step"] / floor_us,
            "target_us": peer / TARGET_SPEEDUP if target_3x else None,
            "target_below_floor": bool(target_3x and peer / TARGET_SPEEDUP < floor_us)}


def run(args) -> list[dict]:
    grid = [Path(p) for p in args.grid] if args.grid else sorted(BENCH_DIR.glob("persistent_lstm_*.json"))
    rates = best_gemm_tflops()
    print("best measured GEMM rate (TFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    rows = [floor_row(cell, rates[cell["dtype"]]) for cell in fastest_cells(grid)]
    print_table(rows, ["dtype", "dirs", "hidden", "batch", "tvmseq_us", "cudnn_us", "speedup", "floor_us",
                       "tvmseq_over_floor", "target_us", "target_below_floor"])
    missed = [r for r in rows if r["target_us"] is not None and r["tvmseq_us"] > r["target_us"]]
    for r in missed:
        why = "below the floor" if r["target_below_floor"] else "above the floor: a schedule could reach it"
        print(f"3x missed: {r['dtype']} {r['dirs']} H{r['hidden']} B{r['batch']}: target {r['target_us']:.1f} us, "
              f"floor {r['floor_us']:.1f}, tvmseq {r['tvmseq_us']:.1f} ({r['tvmseq_over_floor']:.2f}x the floor), "
              f"target {why}")
    save(NAME, rows, {"gemm_tflops": rates, "grid": [p.name for p in grid], "note": __doc__.split("\n\n")[1]},
         ratio_bar_plot(rows, ("dtype", "dirs", "hidden", "batch"), "tvmseq_over_floor",
                        "LSTM step: tvmseq's time over the FLOP floor (1 = at the floor)"),
         out_dir=Path(args.out) if args.out else None)
    return rows
