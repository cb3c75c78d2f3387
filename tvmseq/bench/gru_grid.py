"""Reports over runs of `tvmseq bench persistent_gru` (their JSON files; no GPU needed):

  python -m tvmseq.bench.gru_grid [FILES...]            # the README's GRU-vs-cuDNN grid
  python -m tvmseq.bench.gru_grid --floors [FILES...] [--json OUT]   # each GRU target against the FLOP floor

FILES default to artifacts/bench/persistent_gru_runs/*.json (the runs the README's table is made of). The grid
gives per cell tvmseq's us a step (highest of the runs) / cuDNN's lowest-highest (speedup lowest-highest, each
from one run) and the path letter. The floors set each cell's target (cuDNN's fastest run / the speedup asked
there; bidirectional: 1.2 x the unidirectional step) against the FLOPs of a step (input projection + recurrence,
input size = hidden) at the chip's peak and at the best GEMM rate measured on the same GPU
(`artifacts/bench/input_projection.json`). A target below the measured-GEMM floor asks the whole step (a chain of
dependent recurrence steps with a grid-wide hand-off each) to run more efficiently than one large independent
GEMM does on this GPU.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import BENCH_DIR

LETTER = {"persistent": "P", "persistent_mma": "M", "persistent_wgmma": "W", "per_step": "S"}
BATCHES = (1, 8, 64, 256)
RUNS_DIR = BENCH_DIR / "persistent_gru_runs"
# H100 SXM5 at its 1.98 GHz boost: 132 SMs x 128 FP32 FMA lanes x 2; dense fp16 tensor-core peak
PEAK_TFLOPS = {"float32": 132 * 128 * 2 * 1.98e9 / 1e12, "float16": 989.0}


def cells(paths) -> dict:
    """(dtype, bidirectional, hidden, batch) -> the rows of every run that timed that cell."""
    grid = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            if r.get("status") != "ok":
                continue
            grid.setdefault((r["dtype"], r["bidirectional"], r["hidden"], r["batch"]), []).append(r)
    return grid


def cell_text(rows) -> str:
    tv = max(r["tvmseq_us_step"] for r in rows)
    cu = [r["cudnn_us_step"] for r in rows]
    sp = [r["speedup"] for r in rows]
    paths = {LETTER.get(r["path"], r["path"]) for r in rows}
    cu_s = f"{min(cu):.1f}" if len(rows) == 1 or abs(max(cu) - min(cu)) < 0.05 else f"{min(cu):.1f}-{max(cu):.1f}"
    sp_s = f"{min(sp):.2f}x" if len(rows) == 1 else f"{min(sp):.2f}-{max(sp):.2f}x"
    return f"{tv:.1f} / {cu_s} ({sp_s}) {'/'.join(sorted(paths))}"


def grid_table(paths) -> str:
    grid = cells(paths)
    lines = ["| dtype | dirs | hidden | " + " | ".join(f"batch={b}" for b in BATCHES) + " |",
             "|---|---|---|" + "---|" * len(BATCHES)]
    for dtype in ("float32", "float16"):
        for bi in (False, True):
            for hidden in (256, 512, 1024):
                row = [grid.get((dtype, bi, hidden, b)) for b in BATCHES]
                if any(row):
                    lines.append(f"| {dtype} | {'bi' if bi else 'uni'} | {hidden} | "
                                 + " | ".join(cell_text(r) if r else "" for r in row) + " |")
    return "\n".join(lines)


def required_speedup(dtype: str, hidden: int, batch: int) -> float:
    """The GRU targets' speedup over cuDNN for a cell: 3x in fp16 at batch <= 64, hidden <= 1024; in fp32 3x at
    batch <= 64, hidden <= 512 and at batch <= 8, hidden 1024, 1.5x at hidden 1024 batch 64; never slower elsewhere."""
    if dtype == "float16":
        return 3.0 if batch <= 64 and hidden <= 1024 else 1.0
    if batch <= 64 and hidden <= 512 or batch <= 8 and hidden == 1024:
        return 3.0
    return 1.5 if hidden == 1024 and batch == 64 else 1.0


def best_gemm_tflops(path=BENCH_DIR / "input_projection.json") -> dict:
    """Highest GEMM throughput measured on the GPU per dtype (tvmseq's projection or cuBLAS via torch)."""
    best = {}
    for r in json.loads(Path(path).read_text())["rows"]:
        flops = 2 * r["directions"] * r["batch"] * r["seq"] * r["input"] * r["n"]
        for key in ("tiled_ms", "torch_ms", "tc_ms"):
            if r.get(key):
                best[r["dtype"]] = max(best.get(r["dtype"], 0.0), flops / (r[key] * 1e-3) / 1e12)
    return best


def floors(paths, gemm: dict) -> list[dict]:
    """Per grid cell of the runs in `paths`: its FLOPs, floors at the peak and at `gemm` (TFLOP/s per dtype),
    tvmseq's and cuDNN's times and the target times."""
    grid = cells(paths)
    out = []
    for (dtype, bi, hidden, batch), rows in sorted(grid.items()):
        D = 2 if bi else 1
        flops = 2 * D * batch * 3 * hidden * (hidden + hidden)   # projection (I = H) + recurrence, one step
        uni = grid.get((dtype, False, hidden, batch))
        asked = required_speedup(dtype, hidden, batch)
        cudnn_min = min(r["cudnn_us_step"] for r in rows)
        out.append(dict(dtype=dtype, D=D, hidden=hidden, batch=batch, mflop_step=flops / 1e6,
                        floor_peak_us=flops / PEAK_TFLOPS[dtype] / 1e6, floor_gemm_us=flops / gemm[dtype] / 1e6,
                        tvmseq_us=max(r["tvmseq_us_step"] for r in rows),
                        recurrence_us=max(r.get("recurrence_us_step") or 0 for r in rows),
                        cudnn_us_min=cudnn_min, speedup_asked=asked, target_us=cudnn_min / asked,
                        target_bi_us=1.2 * max(r["tvmseq_us_step"] for r in uni) if bi and uni else None))
    return out


def floors_table(found) -> str:
    lines = ["| cell | MFLOP a step | floor at peak / at best GEMM (us) | tvmseq (rec) us | speedup target us | "
             "bi <= 1.2 uni target us |", "|---|---|---|---|---|---|"]
    for c in found:
        name = f"{c['dtype']} {'bi' if c['D'] == 2 else 'uni'} H{c['hidden']} B{c['batch']}"

        def mark(t, c=c):
            return "" if t is None else f"{t:.1f}" + (" (below GEMM floor)" if t < c["floor_gemm_us"] else "")

        lines.append(f"| {name} | {c['mflop_step']:.1f} | {c['floor_peak_us']:.2f} / {c['floor_gemm_us']:.2f} | "
                     f"{c['tvmseq_us']:.1f} ({c['recurrence_us']:.1f}) | {c['speedup_asked']:g}x: "
                     f"{mark(c['target_us'])} | {mark(c['target_bi_us'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmseq.bench.gru_grid", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="persistent_gru JSON runs (default: artifacts/bench/persistent_gru_runs)")
    parser.add_argument("--floors", action="store_true", help="each target against the FLOP floor instead of the grid")
    parser.add_argument("--json", type=Path, default=None, help="with --floors: also write the cells here")
    args = parser.parse_args(argv)
    files = args.files or sorted(RUNS_DIR.glob("*.json"))
    if not files:
        parser.error(f"no runs given and none in {RUNS_DIR}")
    if not args.floors:
        print(grid_table(files))
        return 0
    gemm = best_gemm_tflops()
    found = floors(files, gemm)
    print(f"best GEMM measured: {gemm} TFLOP/s; peaks {PEAK_TFLOPS}")
    print(floors_table(found))
    if args.json:
        args.json.write_text(json.dumps(dict(peak_tflops=PEAK_TFLOPS, best_gemm_tflops=gemm, cells=found), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
