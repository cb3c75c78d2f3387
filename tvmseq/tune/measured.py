"""Measured schedule databases of tvmseq's hand-scheduled kernels (persistent GRU, recurrent GEMM, step GEMM).

Those kernels are TIRx with explicit thread bindings (a persistent kernel, a GEMM inside a host time loop),
which MetaSchedule cannot search; their schedules are small dataclasses of knobs (blocks, warps, batch
chunk, tile sizes) chosen by a cost model. Tuning them = building the model's pick and its neighbours,
timing them on the GPU, and keeping a winner where it beats the model's pick: `schedules/tune_<op>.py
build | run | merge` does that and writes `schedules/measured/<op>.json`, which the kernels' default-config
functions read (`lookup`). Without the file (a wheel install, or TVMSEQ_MEASURED_DIR elsewhere) they fall
back to the cost model.

An entry: {"key": {...}, "config": {...}, "us": winner, "model_config": {...}, "model_us": the model's pick in
the same run, "trials": variants timed for the key, "source": where the times come from}.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Callable

DIR = Path(os.environ.get("TVMSEQ_MEASURED_DIR", Path(__file__).resolve().parents[2] / "schedules" / "measured"))
# a winner replaces the model's pick only when it is this much faster (run-to-run noise is ~1-2%)
MIN_GAIN = 0.03


def _key(key: dict) -> str:
    return json.dumps(key, sort_keys=True)


@functools.lru_cache(maxsize=None)
def _table(op: str, root: str) -> dict[str, dict]:
    path = Path(root) / f"{op}.json"
    if not path.exists():
        return {}
    return {_key(e["key"]): e for e in json.loads(path.read_text())["entries"]}


def lookup(op: str, **key) -> dict | None:
    """The measured winner's config for `key` (None: not measured, or the model's pick won)."""
    entry = _table(op, str(DIR)).get(_key(key))
    return dict(entry["config"]) if entry else None


def entry(op: str, **key) -> dict | None:
    """The whole database entry for `key` (config, times, the pick it beat), or None."""
    return _table(op, str(DIR)).get(_key(key))


def read_results(path) -> object:
    """A committed measurement file: JSON, gzip-compressed when it ends in .gz (the sweeps are kept compressed:
    they are large and read only when a database is merged again)."""
    import gzip

    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def merge(op: str, trials: list[dict], default_of: Callable[[dict], dict], source: str,
          root: Path | None = None) -> list[dict]:
    """Fold timed trials into `<root>/<op>.json`. trials: [{"key": {...}, "config": {...}, "us": float}] (only
    correct runs). Per key, the model's pick (`default_of(key)`) must be among the trials (a winner is only
    a winner against it); the fastest trial is written when it beats the pick by MIN_GAIN, and an older entry
    for the key is dropped when the pick now wins. Returns the entries written."""
    root = Path(root or DIR)
    path = root / f"{op}.json"
    table = {_key(e["key"]): e for e in json.loads(path.read_text())["entries"]} if path.exists() else {}
    groups: dict[str, list[dict]] = {}
    for t in trials:
        groups.setdefault(_key(t["key"]), []).append(t)
    written = []
    for k, group in groups.items():
        key = group[0]["key"]
        model = default_of(key)
        picks = [t for t in group if t["config"] == model]
        if not picks:
            print(f"{op} {key}: the model's pick {model} was not timed; skipped", flush=True)
            continue
        model_us = min(t["us"] for t in picks)
        best = min(group, key=lambda t: t["us"])
        if best["us"] < model_us * (1 - MIN_GAIN):
            table[k] = dict(key=key, config=best["config"], us=round(best["us"], 4), model_config=model,
                            model_us=round(model_us, 4), trials=len(group), source=source)
            written.append(table[k])
            print(f"{op} {key}: {best['config']} {best['us']:.3f} us (model's pick {model_us:.3f})", flush=True)
        else:
            table.pop(k, None)
            print(f"{op} {key}: the model's pick wins ({model_us:.3f} us, best other {best['us']:.3f})", flush=True)
    root.mkdir(parents=True, exist_ok=True)
    entries = sorted(table.values(), key=lambda e: _key(e["key"]))
    path.write_text(json.dumps({"op": op, "entries": entries}, indent=1) + "\n")
    _table.cache_clear()
    return written


def script_main(doc: str, steps: dict, argv=None) -> int:
    """The command line of a `schedules/tune_<op>.py`: `build|run|merge PATH` -> steps[name](Path(PATH));
    anything else prints the script's doc and returns 2."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] not in steps:
        print(doc)
        return 2
    steps[argv[0]](Path(argv[1]))
    return 0
