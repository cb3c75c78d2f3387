"""A/B of the SIMT engine's warp reduction padding (`recurrent_gemm.padded_sums`): the same configs built from two
checkouts (this one, prefix n_, and another given by --old, prefix o_), checked against a float64 GRU and timed in
one process alternately (seq 100, recurrence alone).

  python3 scripts/reduce_ab.py build out/redab [OLD_CHECKOUT]  # here; OLD_CHECKOUT on PYTHONPATH for the o_ kernels
  python3 scripts/reduce_ab.py run out/redab                    # GPU machine: results.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SEQ = 100
# (D, B, H, dtype) -> [(blocks, warps, batch chunk, smem rows) or None (the default config)]
VARIANTS = {
    (1, 8, 1024, "float32"): [None, (128, 8, 4, 9), (128, 8, 4, 0), (128, 16, 4, 0), (128, 16, 8, 12)],
    (2, 8, 1024, "float32"): [None, (64, 8, 4, 42), (64, 16, 4, 30)],
    (1, 8, 1024, "float16"): [None],
    (2, 8, 1024, "float16"): [None],
    (1, 8, 512, "float32"): [None],
    (1, 5, 1024, "float32"): [None],
}
# run 2: the default configs of every engine shape whose cost-model pick the padding changed (scripts/reduce_ab.py)
VARIANTS2 = {key: [None] for key in [
    (1, 7, 1024, "float32"), (1, 13, 1024, "float32"), (1, 16, 1024, "float32"), (2, 4, 1024, "float32"),
    (2, 5, 1024, "float32"), (2, 7, 1024, "float32"), (2, 13, 1024, "float32"), (2, 16, 1024, "float32"),
    (2, 13, 512, "float32"), (2, 16, 512, "float32"), (1, 19, 257, "float32"), (2, 19, 257, "float32"),
    (1, 5, 1024, "float16"), (2, 16, 1024, "float16")]}
# run 3: the bidirectional H512 picks once the engine's check refused 43 KB of dynamic beside 12 KB of static shared
# memory (run 2: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)
VARIANTS3 = {key: [None] for key in [(2, 13, 512, "float32"), (2, 16, 512, "float32")]}
# run 4: the select-free reduction (XOR layout, `recurrent_gemm.xor_layout`) against run 3's code, where it applies
VARIANTS4 = {key: [None] for key in [
    (1, 8, 1024, "float32"), (2, 8, 1024, "float32"), (1, 8, 1024, "float16"), (2, 8, 1024, "float16"),
    (1, 7, 1024, "float32"), (1, 16, 1024, "float32"), (2, 7, 1024, "float32"), (2, 16, 1024, "float32")]}
VARIANTS = {"2": VARIANTS2, "3": VARIANTS3, "4": VARIANTS4}.get(os.environ.get("REDUCE_AB", ""), VARIANTS)


def build_one(out: Path, prefix: str) -> None:
    """This process's tvmseq (from PYTHONPATH) builds every variant into out/<prefix>.so."""
    from tvmseq.bench.common import compile_for_gpu
    from tvmseq.kernels import persistent_gru as pg
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.targets import resolve

    tgt = resolve("cuda")
    funcs, index = {}, []
    for (D, B, H, dtype), cfgs in VARIANTS.items():
        for knobs in cfgs:
            cfg = rg.PersistentConfig(*knobs) if knobs else pg.default_gru_config(D, B, H, dtype, tgt)
            why = pg._geometry(D, B, H, cfg, True).check(rg.gpu_facts(tgt), cfg.num_blocks * D)
            if why:
                print("skip", D, B, H, dtype, cfg, why)
                continue
            name = f"{prefix}_d{D}_b{B}_h{H}_{dtype[5:]}_g{cfg.num_blocks}w{cfg.num_warps}c{cfg.batch_chunk}s{cfg.smem_rows}"
            f = pg.persistent_gru_func(D, B, H, dtype, 1, "bidirectional" if D == 2 else "forward", None, None, False,
                                       tgt, cfg)
            funcs[name] = f.with_attr("global_symbol", name)
            index.append(dict(D=D, B=B, H=H, dtype=dtype, config=str(cfg), name=name, file=f"{prefix}.so",
                              default=knobs is None))
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out / f"{prefix}.so"))
    for e in index:
        e["ptxas"] = report.get(e["name"] + "_kernel", {})
        print(e["name"], e["config"], e["ptxas"])
    (out / f"{prefix}.json").write_text(json.dumps(index, indent=1))


def build(out: Path, old: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build_one(out, "n")
    if old:
        env = dict(os.environ, PYTHONPATH=old)
        subprocess.run([sys.executable, __file__, "build-one", str(out.resolve()), "o"], env=env, check=True, cwd=old)


def run(out: Path) -> None:
    import torch
    import tvm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pgru_diag import _reference

    from tvmseq.bench.common import time_cuda

    entries = [e for p in ("n", "o") if (out / f"{p}.json").exists()
               for e in json.loads((out / f"{p}.json").read_text())]
    mods = {f: tvm.runtime.load_module(str(out / f)) for f in {e["file"] for e in entries}}
    tv = tvm.runtime.from_dlpack
    shapes = {(e["D"], e["B"], e["H"], e["dtype"]) for e in entries}
    data = {}
    for D, B, H, dtype in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        gate_i = torch.randn(D, SEQ, B, 3 * H, device="cuda", generator=g)
        R = ((torch.rand(D, 3 * H, H, device="cuda", generator=g) * 2 - 1) * H ** -0.5).to(getattr(torch, dtype))
        h0 = torch.randn(D, B, H, device="cuda", generator=g) * 0.5
        data[(D, B, H, dtype)] = (gate_i, R, h0, _reference(gate_i, R, h0))
    rows = []
    for rnd in range(3):   # alternating rounds: every variant once a round
        for e in entries:
            gate_i, R, h0, ref = data[(e["D"], e["B"], e["H"], e["dtype"])]
            D, B, H = e["D"], e["B"], e["H"]
            Y = torch.empty(SEQ, D, B, H, device="cuda", dtype=R.dtype)
            Yh = torch.empty(D, B, H, device="cuda", dtype=R.dtype)
            args = [tv(t) for t in (gate_i, R, torch.zeros(D, H, device="cuda"),
                                    torch.full((B,), SEQ, dtype=torch.int32, device="cuda"), h0, Y, Yh)]
            fn = mods[e["file"]][e["name"]]
            try:
                fn(*args)
                torch.cuda.synchronize()
            except Exception as err:   # noqa: BLE001 - a launch the GPU refuses: recorded, the rest still run
                if rnd == 0:
                    print(f"{e['name']}: {str(err).splitlines()[0]}", flush=True)
                rows.append(dict(e, round=rnd, error=str(err)[:300], ok=False))
                continue
            err = float((Y.double() - ref).abs().max())
            us = time_cuda(lambda: fn(*args), warmup=3, iters=20) * 1e3 / SEQ
            rows.append(dict(e, round=rnd, us_step=us, max_err=err,
                             ok=err <= (2e-3 if e["dtype"] == "float16" else 1e-4)))
            if rnd == 2:
                ts = [r["us_step"] for r in rows if r["name"] == e["name"] and "us_step" in r]
                print(f"{e['name']:42s} {e['config'][17:]:60s} {min(ts):7.3f} us/step  err {err:.1e}  "
                      f"{'ok' if rows[-1]['ok'] else 'WRONG'}  regs {e['ptxas'].get('registers')} "
                      f"spill {e['ptxas'].get('spill_stores')}", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "build":
        build(out, sys.argv[3] if len(sys.argv) > 3 else None)
    elif mode == "build-one":
        out.mkdir(parents=True, exist_ok=True)
        build_one(out, sys.argv[3])
    else:
        run(out)
