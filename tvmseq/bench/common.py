"""Benchmark plumbing shared by every operator: environment record, a printed table with the ratio against the
peer, JSON + plot under artifacts/bench/, the --build / --prebuilt halves of a run. Building, loading and timing
kernels on the GPU is `tvmseq.measure` (shared with tuning)."""
from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Callable, Sequence

BENCH_DIR = Path(os.environ.get("TVMSEQ_BENCH_DIR", Path(__file__).resolve().parents[2] / "artifacts" / "bench"))


def environment() -> dict:
    """GPU, library versions and date, stored with every result."""
    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version()}
    try:
        import tvm

        info["tvm"] = tvm.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cudnn"] = torch.backends.cudnn.version()
            info["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return info


def print_table(rows: list[dict], columns: Sequence[str]) -> None:
    widths = [max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)), flush=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def save(name: str, rows: list[dict], meta: dict | None = None, plot: Callable | None = None,
         out_dir: Path | None = None) -> Path:
    """Write `<name>.json` (rows + environment) and, if `plot(ax_fig_path)` is given, `<name>.png`."""
    out_dir = Path(out_dir or BENCH_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(dumps_rows({"benchmark": name, "environment": environment(), **(meta or {}), "rows": rows}))
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(out_dir / f"{name}.png")
        except ImportError:
            print("matplotlib not installed: no plot written")
    print(f"wrote {path}")
    return path


def dumps_rows(obj) -> str:
    """JSON with one line per row (a list of dicts, top level or under a key) and no indentation: results stay
    diffable row by row at about 3/4 of the indented size."""
    def row_list(rows):
        return "[\n" + ",\n".join(json.dumps(r, separators=(",", ":"), default=str) for r in rows) + "\n]"

    def is_rows(v):
        return isinstance(v, list) and v and all(isinstance(r, dict) for r in v)

    if is_rows(obj):
        return row_list(obj) + "\n"
    if not isinstance(obj, dict):
        return json.dumps(obj, default=str) + "\n"
    items = [json.dumps(k) + ":" + (row_list(v) if is_rows(v) else json.dumps(v, separators=(",", ":"), default=str))
             for k, v in obj.items()]
    return "{" + ",\n".join(items) + "}\n"


PLOT_LABEL_CHARS = 36      # a bar's label at most this long (a corpus row's input shapes run past the figure)


def ratio_bar_plot(rows: list[dict], label_keys: Sequence[str], ratio_key: str, title: str,
                   guides: Sequence[tuple[float, str]] = ()):
    """A plot function for `save`: one bar per row, the speedup over the peer (>1 = tvmseq faster); `guides`:
    (ratio, label) lines drawn dashed (a target such as "within 2x" at 0.5)."""

    def label(row) -> str:
        text = " ".join(str(row[k]) for k in label_keys)
        return text if len(text) <= PLOT_LABEL_CHARS else text[:PLOT_LABEL_CHARS - 1] + "\u2026"

    def plot(path):
        import matplotlib.pyplot as plt

        labels = [label(r) for r in rows]
        ratios = [r[ratio_key] for r in rows]
        fig, ax = plt.subplots(figsize=(max(6, 0.28 * len(rows)), 5.5))
        ax.bar(range(len(rows)), ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios])
        ax.axhline(1.0, color="black", lw=0.8)
        for y, text in guides:
            ax.axhline(y, color="tab:gray", lw=0.8, ls="--")
            ax.annotate(text, (1, y), xycoords=("axes fraction", "data"), xytext=(-2, 2), textcoords="offset points",
                        fontsize=7, color="tab:gray", ha="right")
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        ax.set_ylabel("speedup over peer (x)")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=80)   # small enough to commit
        plt.close(fig)

    return plot


def grid_configs(hidden, batch, quick_cells, quick: bool = False):
    """The grid of the single-layer recurrent benchmarks (persistent_gru, persistent_lstm): float32 and float16 x
    uni- and bidirectional x hidden x batch, or only the (hidden, batch) cells of `quick_cells` with --quick."""
    for dtype, bidir in itertools.product(("float32", "float16"), (False, True)):
        for h, b in (quick_cells if quick else itertools.product(hidden, batch)):
            yield {"dtype": dtype, "bidirectional": bidir, "hidden": h, "batch": b}


def config_suffix(c) -> str:
    """A grid config's name in kernel and file names: dtype, direction, hidden, batch."""
    return f"{c['dtype']}_{'bi' if c['bidirectional'] else 'uni'}_h{c['hidden']}_b{c['batch']}"


def config_group(c) -> str:
    """The module a grid config's kernels are built into: one per dtype and direction."""
    return f"{c['dtype']}_{'bi' if c['bidirectional'] else 'uni'}"


def time_against_peer(ours: Callable, peer: Callable, seq: int, rounds: int, iters: int,
                      timer: Callable | None = None) -> dict:
    """tvmseq and its peer timed in alternating rounds, the medians kept (us per step of a seq-step run):
    {"tvmseq_us_step", "cudnn_us_step", "tvmseq_us_range", "cudnn_us_range"}. cuDNN's time for one config moved
    up to 2x between runs (H100, 2026-11-22), so a single round each could compare a fast round with a slow one.
    `timer`: milliseconds of fn(warmup=, iters=), CUDA events by default."""
    if timer is None:
        from ..measure import time_cuda as timer
    ours_us, peer_us = [], []
    for _ in range(rounds):
        ours_us.append(timer(ours, warmup=3, iters=iters) * 1e3 / seq)
        peer_us.append(timer(peer, warmup=3, iters=iters) * 1e3 / seq)
    return {"tvmseq_us_step": statistics.median(ours_us), "cudnn_us_step": statistics.median(peer_us),
            "tvmseq_us_range": [min(ours_us), max(ours_us)], "cudnn_us_range": [min(peer_us), max(peer_us)]}


def run_and_report(name: str, entries, run_one: Callable, columns: Sequence[str], plot_labels: Sequence[str],
                   plot_title: str, meta: dict | None = None, out=None) -> list[dict]:
    """`run_one(entry)` for each entry of a prebuilt benchmark, the rows printed and saved after each (a later
    hang or crash keeps what ran), then the whole table and the plot of the speedup over running the same
    layers one by one (`vs_sequential`)."""
    rows = []
    for e in entries:
        rows.append(run_one(e))
        print_table(rows[-1:], columns)
        save(name, rows, meta, out_dir=out)
    print_table(rows, columns)
    save(name, rows, meta, out_dir=out, plot=ratio_bar_plot(rows, plot_labels, "vs_sequential", plot_title))
    return rows


def add_build_run_arguments(parser, build_help: str = "build the CUDA module into DIR (no GPU needed)") -> None:
    """--build / --prebuilt / --out: the two halves of a benchmark (build here, run on the GPU)."""
    parser.add_argument("--build", metavar="DIR", help=build_help)
    parser.add_argument("--prebuilt", metavar="DIR", help="run the module built by --build")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")


def build_or_run(args, build: Callable, run_prebuilt: Callable, scratch_prefix: str) -> list[dict]:
    """--build DIR: build and stop; --prebuilt DIR: run it; neither: build into a scratch directory and run
    (a GPU machine with TVM's compiler)."""
    if args.build:
        build(args.build)
        return []
    root = args.prebuilt
    if root is None:
        import tempfile

        root = build(tempfile.mkdtemp(prefix=scratch_prefix))
    return run_prebuilt(root, args.out)
