"""Schedule sweep of the persistent GRU (warps / blocks / batch chunk) on the H100, the way
`bench recurrent_gemm --sweep` found 16 warps 1.6x faster for the recurrent GEMM at batch 1.

  python3 scripts/pgru_sweep.py build out/sweep     # here
  python3 scripts/pgru_sweep.py run out/sweep       # GPU machine (each kernel in its own process)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pgru_diag  # noqa: E402  (run_one / run: load, launch 3x, check against float64, time)

# (D, B, H) x [(blocks, warps, batch chunk)]; shared-memory rows: the fewest that fit
SWEEP = {
    (1, 1, 512): [(128, 8, 1), (128, 16, 1), (64, 16, 1)],
    (1, 8, 512): [(128, 8, 2), (128, 16, 2), (128, 16, 4)],
    (1, 1, 1024): [(128, 8, 1), (128, 16, 1), (64, 16, 1)],
    (1, 8, 1024): [(128, 8, 4), (128, 16, 4), (128, 16, 2), (128, 16, 8)],
    (2, 1, 1024): [(128, 8, 1), (64, 8, 1), (64, 16, 1)],
    (2, 8, 1024): [(64, 8, 2), (64, 16, 2), (64, 16, 4)],
}


def _config(D, B, H, blocks, warps, chunk):
    from tvmseq.kernels import persistent_gru as pg
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.targets import resolve

    facts = rg.gpu_facts(resolve("cuda"))
    for smem_rows in range(0, 3 * H // blocks + 4, 3):
        cfg = rg.PersistentConfig(blocks, warps, chunk, smem_rows)
        if pg._geometry(D, B, H, cfg, True).check(facts, blocks * D) is None:
            return cfg
    return None


def build(out: Path, sweep: dict | None = None):
    """Every variant of `sweep` (default SWEEP) into out/sweep.so + index.json."""
    import tvm

    from tvmseq import artifacts
    from tvmseq.kernels import persistent_gru as pg
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    out.mkdir(parents=True, exist_ok=True)
    funcs, index = {}, []
    for (D, B, H), knobs in (sweep or SWEEP).items():
        for blocks, warps, chunk in knobs:
            cfg = _config(D, B, H, blocks, warps, chunk)
            if cfg is None:
                print("no fit", D, B, H, blocks, warps, chunk)
                continue
            name = f"s_d{D}_b{B}_h{H}_g{blocks}w{warps}c{chunk}s{cfg.smem_rows}"
            f = pg.persistent_gru_func(D, B, H, "float32", 1, "bidirectional" if D == 2 else "forward", None,
                                       None, False, tgt, cfg)
            funcs[name] = f.with_attr("global_symbol", name)
            index.append(dict(variant="sweep", D=D, B=B, H=H, dtype="float32", func=name, file="sweep.so",
                              config=str(cfg)))
    t0 = time.time()
    with artifacts.device_binaries(("sm_90a",)):
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
        report = dict(artifacts.NVCC.last_report)
    ex.export_library(str(out / "sweep.so"))
    for e in index:
        e["ptxas"] = report.get(e["func"] + "_kernel", {})
        print(e["func"], e["ptxas"])
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(funcs)} kernels in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "build":
        build(out)
    else:
        pgru_diag.LAUNCHES = 5
        pgru_diag.run(out)
