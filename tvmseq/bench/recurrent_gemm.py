"""Benchmark: persistent recurrent GEMM X_n = f(X_{n-1} A^T + b) vs a CUDA-graph loop of torch
addmm + tanh and cuDNN's RNN-tanh (torch.nn.RNN with zero input), per step, over hidden x batch.

Kernels are BUILT on a machine with TVM's compiler (`build_for_gpu(out_dir)`, CUDA target, exported
.so files + index.json) and RUN where only TVM's runtime is (`run(args)` with `--prebuilt DIR`).
Nothing here imports the kernel factories unless it builds, so the run side needs no compiler.
Without torch/CUDA, `run` falls back to the llvm target on tiny sizes with numpy as the peer, so the
whole code path is testable on a CPU machine.

  python3 -m tvmseq.bench.recurrent_gemm --build out/rg             # here: build the payload
  python3 -m tvmseq.bench.recurrent_gemm --prebuilt out/rg [--quick] # GPU machine: measure
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from ..reference.recurrent import recurrent_gemm as reference
from ..measure import PrebuiltModules, cuda_available
from .common import print_table, ratio_bar_plot, save

NAME = "recurrent_gemm"
STEPS = 100
HIDDEN = (512, 1024, 2048)
BATCH = (1, 16, 64)
QUICK = ((1024, 1), (1024, 16), (512, 64))
# schedule variants measured next to the default (what a tuner would search first)
SWEEP = {
    (1024, 1): [dict(num_blocks=nb, num_warps=w, batch_chunk=1) for nb in (64, 128) for w in (4, 8, 16)],
    (512, 1): [dict(num_blocks=nb, num_warps=w, batch_chunk=1) for nb in (64, 128) for w in (4, 8)],
    (1024, 16): [dict(num_blocks=128, num_warps=8, batch_chunk=bc) for bc in (2, 4, 16)],
    (1024, 64): [dict(num_blocks=128, num_warps=w, batch_chunk=bc, smem_rows=s)
                 for w, bc, s in ((8, 8, 0), (8, 16, 4), (16, 8, 4))],
}
TOLERANCE = {"float32": 2e-3, "float16": 3e-2}  # max abs error after 100 tanh steps (|x| <= 1)
CPU_SIZES = ((19, 1), (24, 3))  # the llvm code path: tiny, odd sizes
CPU_STEPS = 6
WATCHDOG_S = 30.0


# ----------------------------------------------------------------------------------------------------
# Build side (needs TVM's compiler)
# ----------------------------------------------------------------------------------------------------


# GPU test kernels (tests/test_recurrent_gemm.py, marked gpu, loads them from the payload):
# (H, B, steps, dtype, activation, return_sequences, path, config) with odd sizes and every knob
GPU_TEST_CASES = [
    (37, 3, 7, "float32", "tanh", True, "persistent", None),
    (1000, 5, 9, "float32", "sigmoid", True, "persistent", None),
    (1024, 1, 20, "float32", "tanh", False, "persistent", None),
    (512, 19, 6, "float32", "relu", True, "persistent", dict(num_blocks=60, num_warps=4, batch_chunk=4, smem_rows=3)),
    (256, 2, 5, "float32", "identity", True, "persistent", dict(num_blocks=128, num_warps=16, batch_chunk=1)),
    (333, 4, 6, "float16", "tanh", True, "persistent", None),
    (1024, 16, 10, "float16", "tanh", False, "persistent", None),
    (37, 3, 7, "float32", "tanh", True, "per_step", None),
    (333, 4, 6, "float16", "sigmoid", False, "per_step", None),
]


def _entries(target_is_gpu: bool, quick: bool, sweep: bool, tests: bool, dtypes, steps: int, activation: str):
    """(group, H, B, steps, dtype, activation, return_sequences, path, config dict or None) of every
    kernel to build."""
    out = []
    if not target_is_gpu:
        for H, B in CPU_SIZES:
            for dtype in dtypes:
                for path in ("persistent", "per_step"):
                    out.append(("grid", H, B, CPU_STEPS, dtype, activation, True, path, None))
        return out
    sizes = QUICK if quick else [(h, b) for h in HIDDEN for b in BATCH]
    for dtype in dtypes:
        for H, B in sizes:
            out.append(("grid_" + dtype, H, B, steps, dtype, activation, True, "persistent", None))
            out.append(("per_step_" + dtype, H, B, steps, dtype, activation, True, "per_step", None))
    if sweep and not quick:
        for (H, B), cfgs in SWEEP.items():
            out += [("sweep", H, B, steps, "float32", activation, True, "persistent", c) for c in cfgs]
    if tests:
        out += [("tests",) + case for case in GPU_TEST_CASES]
    return out


def _func_name(group, H, B, steps, dtype, activation, return_sequences, path, cfg) -> str:
    name = f"rg_{path}_{dtype}_H{H}_B{B}"
    if group == "tests":
        name += f"_T{steps}_{activation}_{'seq' if return_sequences else 'last'}"
    if cfg:
        name += "_" + "_".join(f"{k}{v}" for k, v in sorted(cfg.items()))
    return name


def build_for_gpu(out_dir, quick: bool = False, sweep: bool = True, tests: bool = True,
                  dtypes=("float32", "float16"), steps: int = STEPS, target: str = "cuda",
                  activation: str = "tanh", ptxas: bool = False) -> Path:
    """Build every kernel variant the benchmark needs for `target` (default: the H100 tag), one
    exported .so per group (so the GPU side compiles each group's CUDA source once), plus index.json.
    ptxas=True also compiles each group's CUDA source with the local nvcc and prints registers/spills."""
    import tvm

    from ..cuda_toolchain import ptxas_report
    from ..kernels import recurrent_gemm as rg
    from ..targets import is_gpu, resolve

    tgt = resolve(target)
    gpu = is_gpu(tgt)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict] = {}
    index = []
    for entry in _entries(gpu, quick, sweep, tests, dtypes, steps, activation):
        group, H, B, n_steps, dtype, act, seq, path, cfg = entry
        config = None
        if path == "persistent":
            config = rg.PersistentConfig(**cfg) if cfg else rg.default_config(H, B, dtype, tgt)
            ok, why = rg.fits_on_chip(H, B, dtype, tgt, config)
            if not ok:
                print(f"skip {H}x{B} {dtype} {cfg}: {why}")
                continue
        func, path = rg.recurrent_gemm_func(H, B, n_steps, dtype, act, seq, tgt, config, path)
        name = _func_name(*entry)
        groups.setdefault(group, {})[name] = func.with_attr("global_symbol", name)
        index.append(dict(group=group, file=f"{NAME}_{group}.so", func=name, H=H, B=B, steps=n_steps,
                          dtype=dtype, activation=act, return_sequences=seq, path=path,
                          config=(config.__dict__ if config is not None else None), variant=bool(cfg)))
    for group, funcs in groups.items():
        t0 = time.time()
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
        ex.export_library(str(out_dir / f"{NAME}_{group}.so"))
        print(f"built {group}: {len(funcs)} kernels in {time.time() - t0:.1f}s")
        if gpu and ptxas:
            report = ptxas_report(ex.mod.imports[0].inspect_source(), str(tgt.attrs.get("arch", "sm_90a")))
            for kernel, info in sorted(report.items()):
                print(f"  ptxas {kernel}: {info}")
    meta = dict(benchmark=NAME, target=str(tgt.kind.name), arch=str(tgt.attrs.get("arch", "")),
                tvm=tvm.__version__, entries=index)
    (out_dir / "index.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {out_dir / 'index.json'} ({len(index)} kernels)")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Run side (TVM runtime only)
# ----------------------------------------------------------------------------------------------------


def _inputs(H, B, dtype, seed=0):
    """A with spectral radius ~0.9 (a contractive chain keeps 100 steps well conditioned), small bias."""
    rng = np.random.default_rng(seed + 7919 * H + B)
    A = (rng.standard_normal((H, H)) * (0.9 / np.sqrt(H))).astype(dtype)
    bias = (0.1 * rng.standard_normal(H)).astype(dtype)
    x0 = rng.uniform(-1, 1, (B, H)).astype(dtype)
    return A, bias, x0


def _select(index, args):
    out = []
    for e in index:
        if e["group"] == "tests":
            continue
        if args.dtype and e["dtype"] not in args.dtype.split(","):
            continue
        if e["variant"] and not args.sweep:
            continue
        if e["path"] == "per_step" and args.no_per_step:
            continue
        if args.quick and (e["H"], e["B"]) not in QUICK:
            continue
        out.append(e)
    return out


def _watchdog(fn, seconds=WATCHDOG_S):
    """First call of a persistent kernel: if it does not finish in `seconds`, say so and exit instead
    of hanging the machine until the job's time limit (a deadlocked kernel cannot be cancelled)."""
    import torch

    fn()
    done = torch.cuda.Event()
    done.record()
    deadline = time.time() + seconds
    while not done.query():
        if time.time() > deadline:
            print(f"WATCHDOG: kernel still running after {seconds}s: deadlock, aborting", flush=True)
            os._exit(3)
        time.sleep(0.005)


def _run_gpu(entries, mods, args) -> list[dict]:
    import torch
    import tvm

    from ..measure import time_cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    rows, peers = [], {}
    for e in entries:
        H, B, dtype, steps = e["H"], e["B"], e["dtype"], e["steps"]
        tdt = getattr(torch, dtype)
        A, bias, x0 = (torch.from_numpy(a).to(dev) for a in _inputs(H, B, dtype))
        y = torch.empty((steps, B, H), dtype=tdt, device=dev)
        f = mods.func(e)
        targs = [tvm.runtime.from_dlpack(t) for t in (A, bias, x0, y)]
        call = lambda: f(*targs)  # noqa: E731
        _watchdog(call)
        want = _torch_reference(A, bias, x0, steps)
        err = float((y.double() - want).abs().max())
        ms = time_cuda(call, warmup=5, iters=args.iters)
        key = (H, B, dtype)
        if key not in peers and not args.no_peer:
            peers[key] = _torch_peers(A, bias, x0, steps, want, args.iters)
        peer = peers.get(key, {})
        us = ms * 1e3 / steps
        row = dict(H=H, B=B, dtype=dtype, path=e["path"], config=_cfg_str(e), tvmseq_us=us,
                   torch_graph_us=peer.get("graph_us"), cudnn_us=peer.get("cudnn_us"),
                   speedup_vs_graph=(peer["graph_us"] / us) if "graph_us" in peer else None,
                   speedup_vs_cudnn=(peer["cudnn_us"] / us) if "cudnn_us" in peer else None,
                   max_err=err, ok=err <= TOLERANCE[dtype], peer_err=peer.get("cudnn_err"))
        rows.append(row)
        print_table([row], _COLUMNS)
    return rows


def _torch_reference(A, bias, x0, steps):
    """float64 chain on the GPU, rounded to the storage dtype after each step (as the kernels store)."""
    import torch

    a, b, x = A.double(), bias.double(), x0.double()
    out = []
    for _ in range(steps):
        x = torch.tanh(x @ a.T + b).to(A.dtype).double()
        out.append(x)
    return torch.stack(out)


def _torch_peers(A, bias, x0, steps, want, iters) -> dict:
    """Per-step times of (1) a CUDA graph of `steps` x (addmm + tanh) and (2) cuDNN RNN-tanh."""
    import torch

    from ..measure import time_cuda

    B, H = x0.shape
    out = {}
    y = torch.empty((steps, B, H), dtype=A.dtype, device=A.device)
    at = A.t()

    def chain():
        prev = x0
        for n in range(steps):
            torch.addmm(bias, prev, at, out=y[n])
            torch.tanh(y[n], out=y[n])
            prev = y[n]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    out["graph_us"] = time_cuda(graph.replay, warmup=5, iters=iters) * 1e3 / steps
    out["graph_err"] = float((y.double() - want).abs().max())
    try:
        rnn = torch.nn.RNN(H, H, nonlinearity="tanh").to(device=A.device, dtype=A.dtype)
        with torch.no_grad():
            rnn.weight_hh_l0.copy_(A)
            rnn.bias_hh_l0.copy_(bias)
            rnn.weight_ih_l0.zero_()
            rnn.bias_ih_l0.zero_()
            zeros = torch.zeros((steps, B, H), dtype=A.dtype, device=A.device)
            h0 = x0[None].contiguous()
            res, _ = rnn(zeros, h0)
            out["cudnn_err"] = float((res.double() - want).abs().max())
            out["cudnn_us"] = time_cuda(lambda: rnn(zeros, h0), warmup=5, iters=iters) * 1e3 / steps
    except Exception as err:  # noqa: BLE001 - a peer failing must not stop the table
        print(f"cuDNN RNN peer failed for H={H} B={B}: {err}")
    return out


def _run_cpu(entries, mods, args) -> list[dict]:
    """llvm code path on tiny sizes: numpy is the peer and the reference."""
    import tvm

    rows = []
    for e in entries:
        H, B, dtype, steps = e["H"], e["B"], e["dtype"], e["steps"]
        A, bias, x0 = _inputs(H, B, dtype)
        y = tvm.runtime.tensor(np.zeros((steps, B, H), dtype))
        f = mods.func(e)
        args_t = [tvm.runtime.tensor(a) for a in (A, bias, x0)] + [y]
        t0 = time.perf_counter()
        f(*args_t)
        us = (time.perf_counter() - t0) * 1e6 / steps
        want = reference(A, bias, x0, steps)
        err = float(np.abs(y.numpy().astype(np.float64) - want.astype(np.float64)).max())
        t0 = time.perf_counter()
        reference(A, bias, x0, steps)
        peer_us = (time.perf_counter() - t0) * 1e6 / steps
        rows.append(dict(H=H, B=B, dtype=dtype, path=e["path"], config=_cfg_str(e), tvmseq_us=us,
                         numpy_us=peer_us, speedup_vs_numpy=peer_us / us, max_err=err,
                         ok=err <= TOLERANCE[dtype]))
    print_table(rows, ["H", "B", "dtype", "path", "config", "tvmseq_us", "numpy_us", "speedup_vs_numpy",
                       "max_err", "ok"])
    return rows


_COLUMNS = ["H", "B", "dtype", "path", "config", "tvmseq_us", "torch_graph_us", "cudnn_us",
            "speedup_vs_graph", "speedup_vs_cudnn", "max_err", "ok"]


def _cfg_str(e) -> str:
    c = e.get("config")
    if not c:
        return ""
    return f"blk{c['num_blocks']}w{c['num_warps']}bc{c['batch_chunk']}s{c['smem_rows']}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"only (H, B) in {QUICK}")
    parser.add_argument("--prebuilt", metavar="DIR", help="kernels from build_for_gpu (index.json + .so)")
    parser.add_argument("--build", metavar="DIR", help="build the kernels into DIR and exit (needs the compiler)")
    parser.add_argument("--target", default=None, help="build target (default cuda: the H100 tag)")
    parser.add_argument("--ptxas", action="store_true", help="with --build: print ptxas registers/spills")
    parser.add_argument("--no-tests", action="store_true", help="with --build: leave out the GPU test kernels")
    parser.add_argument("--dtype", default=None, help="comma list, e.g. float32 (default: all built)")
    parser.add_argument("--sweep", action="store_true", help="also run the schedule variants")
    parser.add_argument("--no-per-step", action="store_true", help="skip the per-step fallback path")
    parser.add_argument("--no-peer", action="store_true", help="skip torch/cuDNN peers")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None, help="directory for the JSON + plot (default artifacts/bench)")


def run(args) -> list[dict]:
    if args.build:
        build_for_gpu(args.build, quick=args.quick, tests=not args.no_tests, target=args.target or "cuda",
                      ptxas=args.ptxas)
        return []
    gpu = cuda_available()
    root = args.prebuilt
    if root is None:  # build now (needs the compiler) into a scratch directory
        import tempfile

        root = tempfile.mkdtemp(prefix="tvmseq_rg_")
        build_for_gpu(root, quick=args.quick, sweep=args.sweep, tests=False,
                      target=args.target or ("cuda" if gpu else "llvm"))
    root = Path(root)
    index = json.loads((root / "index.json").read_text())
    if (index["target"] == "cuda") != gpu:
        raise SystemExit(f"{root} holds {index['target']} kernels but this machine "
                         f"{'has' if gpu else 'has no'} CUDA GPU usable from torch")
    entries = _select(index["entries"], args)
    mods = PrebuiltModules(root, cuda=gpu)
    rows = _run_gpu(entries, mods, args) if gpu else _run_cpu(entries, mods, args)
    meta = dict(steps=index["entries"][0]["steps"] if index["entries"] else None, arch=index.get("arch"),
                peers="torch CUDA-graph addmm+tanh loop; cuDNN RNN-tanh (nn.RNN, zero input)")
    if gpu:
        print_table(rows, _COLUMNS)
        plot = ratio_bar_plot([r for r in rows if r.get("speedup_vs_graph")], ["H", "B", "dtype", "path", "config"],
                              "speedup_vs_graph", "recurrent GEMM: speedup over torch CUDA-graph loop (per step)")
        save(NAME, rows, meta, plot, out_dir=args.out)
    else:
        save(NAME + "_cpu", rows, meta, None, out_dir=args.out or Path(root) / "results")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"MISMATCH in {len(bad)} rows: {[(r['H'], r['B'], r['dtype'], r['path']) for r in bad]}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m tvmseq.bench.recurrent_gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    rows = run(parser.parse_args(argv))
    return 1 if any(not r["ok"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
