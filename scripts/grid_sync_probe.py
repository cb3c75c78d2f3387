"""What a grid barrier costs on the H100: `steps` cooperative grid barriers (T.cuda.grid_sync, what every
persistent tvmseq kernel ends a step with) in one kernel of 1 block an SM, nothing else, timed per barrier.

  python3 scripts/grid_sync_probe.py build out/gsync      # here (compiler)
  python3 scripts/grid_sync_probe.py run out/gsync        # GPU machine (runtime + torch)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = [(64, 128), (128, 128), (128, 256), (132, 128)]   # (blocks, threads)


def probe_func(blocks: int, threads: int):
    from tvm.script import tirx as T

    from tvmseq.kernels import recurrent_gemm as rg

    @T.prim_func
    def main(out: T.handle):
        steps = T.int32()
        O = T.match_buffer(out, (steps,), "int32")
        for b in T.thread_binding(blocks, thread="blockIdx.x"):
            for t in T.thread_binding(threads, thread="threadIdx.x"):
                for s in T.serial(steps):
                    if b == 0 and t == 0:
                        O[s] = s
                    T.cuda.grid_sync()

    return rg.scheduled(main, f"gsync_b{blocks}_t{threads}", cooperative=True)


def build(out: Path):
    import tvm

    from tvmseq.targets import resolve

    out.mkdir(parents=True, exist_ok=True)
    funcs = {f"gsync_b{b}_t{t}": probe_func(b, t) for b, t in SHAPES}
    tvm.compile(tvm.IRModule(funcs), target=resolve("cuda")).export_library(str(out / "gsync.so"))
    print(f"built {len(funcs)} probes")


def run(out: Path):
    import torch
    import tvm

    from tvmseq.bench.common import time_cuda

    mod = tvm.runtime.load_module(str(out / "gsync.so"))
    results = []
    for b, t in SHAPES:
        for steps in (100, 1000):
            buf = torch.zeros(steps, dtype=torch.int32, device="cuda")
            arg = tvm.runtime.from_dlpack(buf)
            f = mod[f"gsync_b{b}_t{t}"]
            ms = time_cuda(lambda: f(arg), warmup=3, iters=20)
            results.append(dict(blocks=b, threads=t, steps=steps, us_per_barrier=ms * 1e3 / steps,
                                ok=bool((buf == torch.arange(steps, device="cuda", dtype=torch.int32)).all())))
            print(results[-1], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]](Path(sys.argv[2]))
