"""Tune the hierarchical top-k kernel's level-0 tiling (threads per block, values per thread) by measurement,
and record the winners in schedules/measured/topk.json, which `topk.choose_config` reads on GPU targets.

  tvmseq tune topk build out/topk_tune                  # here: per shape the model's pick + neighbours
  tvmseq tune topk run out/topk_tune                    # GPU machine: each variant checked and timed
  tvmseq tune topk merge out/topk_tune/results.json     # here: winners -> the database

A winner replaces the model's pick only when >= 3% faster in the same run.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

# (rows, vocabulary, k): the benchmark's LLM-decoding shapes
SHAPES = [(1, 128256, 8), (32, 32000, 8), (32, 50257, 1), (32, 128256, 8), (256, 32000, 4), (256, 50257, 8),
          (256, 128256, 8), (256, 128256, 64)]
DTYPE = "float32"


def _variants(rows, n, k):
    from tvmseq.kernels.topk import topk as tk

    pick = tk.choose_config(rows, n, k, True, measured=False)
    out = [pick]
    for threads, vpt in ((pick.threads // 2, pick.values_per_thread), (pick.threads * 2, pick.values_per_thread),
                         (pick.threads, pick.values_per_thread // 2), (pick.threads, pick.values_per_thread * 2),
                         (pick.threads * 2, pick.values_per_thread // 2)):
        cfg = dataclasses.replace(pick, threads=threads, values_per_thread=vpt)
        try:
            cfg.validate(True)
        except Exception:  # noqa: BLE001 - a neighbour outside the valid range is not timed
            continue
        if cfg not in out and threads * vpt >= 2 * k:
            out.append(cfg)
    return out


def build(out: Path) -> None:
    from tvmseq.kernels.topk import topk as tk
    from tvmseq.measure import compile_for_gpu
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for rows, n, k in SHAPES:
        for i, cfg in enumerate(_variants(rows, n, k)):
            name = f"topk_r{rows}_n{n}_k{k}_v{i}"
            funcs[name] = tk.topk_func(rows, n, k, DTYPE, True, "cuda", cfg).with_attr("global_symbol", name)
            index.append(dict(rows=rows, n=n, k=k, dtype=DTYPE, func=name, config=dataclasses.asdict(cfg)))
    t0 = time.time()
    ex, _ = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / "topk_tune.so"))
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(funcs)} top-k variants in {time.time() - t0:.0f}s -> {out}")


def run(out: Path) -> None:
    from tvmseq.measure import PrebuiltModules
    from tvmseq.bench.topk import run_topk_gpu

    index = json.loads((out / "index.json").read_text())
    mod = PrebuiltModules(out).get("topk_tune.so")
    results, best = [], {}
    for i, e in enumerate(index):
        row = run_topk_gpu(mod[e["func"]], e["rows"], e["n"], e["k"], e["dtype"], 1.0, seed=i)
        key = (e["rows"], e["n"], e["k"])
        us = row["tvmseq_ms"] * 1e3
        if row["ok"]:
            best[key] = min(best.get(key, us), us)
        results.append(dict(e, us=us, ok=row["ok"], torch_us=row["torch_ms"] * 1e3))
        print(f"[{i + 1}/{len(index)}] rows {e['rows']} n {e['n']} k {e['k']} threads {e['config']['threads']} "
              f"x {e['config']['values_per_thread']}: {us:.2f} us {'ok' if row['ok'] else 'WRONG'} "
              f"(best {best.get(key, float('nan')):.2f}, torch {row['torch_ms'] * 1e3:.2f})", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def merge(results: Path) -> None:
    from tvmseq.kernels.topk import topk as tk
    from tvmseq.tune import measured

    trials = [dict(key=dict(rows=r["rows"], n=r["n"], k=r["k"], dtype=r["dtype"]), config=r["config"], us=r["us"])
              for r in measured.read_results(results) if r["ok"]]
    measured.merge("topk", trials,
                   lambda k: dataclasses.asdict(tk.choose_config(k["rows"], k["n"], k["k"], True, measured=False)),
                   source=f"{results}: us per call (CUDA events, median)")


def main(argv=None) -> int:
    from tvmseq.tune import measured

    return measured.script_main(__doc__, {"build": build, "run": run, "merge": merge}, argv)


if __name__ == "__main__":
    sys.exit(main())
