"""How far each #5 GRU target is from the H100's arithmetic floor: per grid cell, the FLOPs of a step (input
projection + recurrence, input size = hidden), the time they take at the chip's peak and at the best GEMM
efficiency measured on this H100 (cuBLAS/tvmseq projection, `artifacts/bench/input_projection.json`), the time
a target asks for (cuDNN's fastest run / the speedup #5 asks there; 1.2 x the unidirectional step), and what tvmseq measured.

  python3 scripts/gru_floors.py artifacts/bench/persistent_gru_session9_float32_*.json [...] [--json OUT]

A target below the measured-GEMM floor asks the whole step (a chain of 100 dependent recurrence steps with a
grid-wide hand-off each) to run more efficiently than one large independent GEMM does on this GPU.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gru_grid_table  # noqa: E402  (cells: the grid runs' rows by (dtype, bi, hidden, batch))

# H100 SXM5 at its 1.98 GHz boost: 132 SMs x 128 FP32 FMA lanes x 2; dense fp16 tensor-core peak
PEAK_TFLOPS = {"float32": 132 * 128 * 2 * 1.98e9 / 1e12, "float16": 989.0}


def required_speedup(dtype: str, hidden: int, batch: int) -> float:
    """#5's speedup over cuDNN for a cell: 3x in fp16 at batch <= 64, hidden <= 1024; in fp32 3x at batch <= 64,
    hidden <= 512 and at batch <= 8, hidden 1024, 1.5x at hidden 1024 batch 64; never slower elsewhere."""
    if dtype == "float16":
        return 3.0 if batch <= 64 and hidden <= 1024 else 1.0
    if batch <= 64 and hidden <= 512 or batch <= 8 and hidden == 1024:
        return 3.0
    return 1.5 if hidden == 1024 and batch == 64 else 1.0


def best_gemm_tflops(path="artifacts/bench/input_projection.json") -> dict:
    """Highest GEMM throughput measured on this H100 per dtype (tvmseq's projection or cuBLAS via torch)."""
    best = {}
    for r in json.loads(Path(path).read_text())["rows"]:
        flops = 2 * r["directions"] * r["batch"] * r["seq"] * r["input"] * r["n"]
        for key in ("tiled_ms", "torch_ms", "tc_ms"):
            if r.get(key):
                best[r["dtype"]] = max(best.get(r["dtype"], 0.0), flops / (r[key] * 1e-3) / 1e12)
    return best


def floors(paths, gemm: dict) -> list[dict]:
    """Per grid cell of the runs in `paths`: its FLOPs, floors at the peak and at `gemm` (TFLOP/s per dtype), tvmseq's
    and cuDNN's times and the target times."""
    grid = gru_grid_table.cells(paths)
    out = []
    for (dtype, bi, hidden, batch), rows in sorted(grid.items()):
        D = 2 if bi else 1
        flops = 2 * D * batch * 3 * hidden * (hidden + hidden)   # projection (I = H) + recurrence, one step
        uni = grid.get((dtype, False, hidden, batch))
        ours = max(r["tvmseq_us_step"] for r in rows)
        rec = max(r.get("recurrence_us_step") or 0 for r in rows)
        cell = dict(dtype=dtype, D=D, hidden=hidden, batch=batch, mflop_step=flops / 1e6,
                    floor_peak_us=flops / PEAK_TFLOPS[dtype] / 1e6, floor_gemm_us=flops / gemm[dtype] / 1e6,
                    tvmseq_us=ours, recurrence_us=rec, cudnn_us_min=min(r["cudnn_us_step"] for r in rows),
                    speedup_asked=required_speedup(dtype, hidden, batch),
                    target_us=min(r["cudnn_us_step"] for r in rows) / required_speedup(dtype, hidden, batch),
                    target_bi_us=1.2 * max(r["tvmseq_us_step"] for r in uni) if bi and uni else None)
        out.append(cell)
    return out


def table(cells) -> str:
    lines = ["| cell | MFLOP a step | floor at peak / at best GEMM (us) | tvmseq (rec) us | speedup target us | "
             "bi <= 1.2 uni target us |", "|---|---|---|---|---|---|"]
    for c in cells:
        name = f"{c['dtype']} {'bi' if c['D'] == 2 else 'uni'} H{c['hidden']} B{c['batch']}"
        mark = lambda t: "" if t is None else f"{t:.1f}" + (" (below GEMM floor)" if t < c["floor_gemm_us"] else "")
        lines.append(f"| {name} | {c['mflop_step']:.1f} | {c['floor_peak_us']:.2f} / {c['floor_gemm_us']:.2f} | "
                     f"{c['tvmseq_us']:.1f} ({c['recurrence_us']:.1f}) | {c['speedup_asked']:g}x: {mark(c['target_us'])} | "
                     f"{mark(c['target_bi_us'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    out = None
    if "--json" in args:
        i = args.index("--json")
        out, args = Path(args[i + 1]), args[:i] + args[i + 2:]
    gemm = best_gemm_tflops()
    found = floors(args, gemm)
    print(f"best GEMM measured: {gemm} TFLOP/s; peaks {PEAK_TFLOPS}")
    print(table(found))
    if out:
        out.write_text(json.dumps(dict(peak_tflops=PEAK_TFLOPS, best_gemm_tflops=gemm, cells=found), indent=1) + "\n")
