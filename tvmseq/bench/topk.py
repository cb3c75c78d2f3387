"""`tvmseq bench topk`: hierarchical top-k and the fused beam-search step against PyTorch.

Grid: rows {1, 32, 256} x vocab {32000, 50257, 128256} x k {1, 4, 8, 64}, fp32 (`--fp16` adds fp16
rows at k 8) against `torch.topk(x, k, dim=-1)`; beam step: batch {1, 8, 64} x beam 4 x the same
vocabs x k {4, 8} against torch `log_softmax` + add + `topk` over beam*vocab (+ the // and % that give
beam and token ids). Every row reports the median CUDA-event time of both, the speedup, and the GB/s
our kernel reaches reading the logits once against the GPU's copy bandwidth measured in the same run
(device-to-device copy of 1 GiB: 2 x bytes / time). Outputs are checked against torch first.
Targets: >= 5x torch.topk at 32 x 32000 for k <= 8, >= 3x at 256 x 128256 for k <= 8, never slower.

Kernels are built where TVM's compiler is (`--build-only DIR`, no GPU needed) into one library plus
index.json, and loaded with `--prebuilt DIR` where only TVM's runtime is. DIR also holds the kernels
of tests/test_topk.py's GPU tests (TVMSEQ_TOPK_PREBUILT=DIR). `--smoke-cpu` runs this file's code on
the CPU (llvm kernels through the same build/export/load path, numpy peers, tiny grid).
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np

from ..measure import time_cuda
from .common import print_table, save

GRID = dict(rows=(1, 32, 256), vocab=(32000, 50257, 128256), k=(1, 4, 8, 64))
QUICK = dict(rows=(1, 32, 256), vocab=(32000, 128256), k=(1, 8, 64))
SMOKE = dict(rows=(1, 3), vocab=(1000, 2049), k=(1, 8, 64))
BEAM_GRID = dict(batch=(1, 8, 64), beam=(4,), vocab=(32000, 50257, 128256), k=(4, 8))
BEAM_QUICK = dict(batch=(8, 64), beam=(4,), vocab=(32000, 128256), k=(8,))
BEAM_SMOKE = dict(batch=(1, 2), beam=(3,), vocab=(1000,), k=(3,))
FP16_K = 8
# kernels tests/test_topk.py's GPU tests use: (rows, n, k, dtype, largest) and (batch, beam, vocab, k, dtype)
TEST_TOPK = ((3, 1, 1, "float32", True), (5, 777, 5, "float32", True), (4, 1000, 8, "float16", True),
             (7, 2049, 16, "float32", False), (2, 50000, 64, "float32", True), (3, 300, 300, "float32", True),
             (3, 4000, 500, "float16", False), (33, 32000, 8, "float32", True), (2, 513, 9, "int64", True))
TEST_BEAM = ((2, 3, 1000, 3, "float32"), (4, 4, 32000, 8, "float16"))
LIBRARY = "topk_kernels.so"
TARGET_32x32000 = 5.0  # >= 5x torch.topk at 32 x 32000, k <= 8
TARGET_256x128256 = 3.0  # >= 3x at 256 x 128256, k <= 8
COLUMNS = ["op", "rows", "vocab", "k", "dtype", "tvmseq_ms", "torch_ms", "speedup", "gbs", "copy_frac",
           "target", "ok"]


def topk_name(rows, n, k, dtype, largest=True) -> str:
    return f"topk_r{rows}_n{n}_k{k}_{dtype}_{'max' if largest else 'min'}"


def beam_name(batch, beam, vocab, k, dtype) -> str:
    return f"beam_b{batch}_w{beam}_v{vocab}_k{k}_{dtype}"


def _topk_cases(quick=False, smoke=False, fp16=False):
    g = SMOKE if smoke else QUICK if quick else GRID
    for rows, n, k in itertools.product(g["rows"], g["vocab"], g["k"]):
        if k <= n:
            yield rows, n, k, "float32"
    if fp16:
        for rows, n in itertools.product(g["rows"], g["vocab"]):
            yield rows, n, FP16_K, "float16"


def _beam_cases(quick=False, smoke=False):
    g = BEAM_SMOKE if smoke else BEAM_QUICK if quick else BEAM_GRID
    for batch, beam, vocab, k in itertools.product(g["batch"], g["beam"], g["vocab"], g["k"]):
        yield batch, beam, vocab, k, "float32"


def kernel_module(quick=False, smoke=False, fp16=False, with_tests=True, target_name="cuda"):
    """(IRModule of every kernel the benchmark (and the GPU tests) need, index dict, target)."""
    import tvm

    from .. import targets
    from ..kernels.topk import topk as tk

    target = targets.resolve(target_name)
    kind = target.kind.name
    gpu = kind == "cuda"
    funcs, index = {}, {"library": LIBRARY, "target_kind": kind, "tvm": tvm.__version__, "kernels": {}}

    def add_topk(rows, n, k, dtype, largest):
        name = topk_name(rows, n, k, dtype, largest)
        if name not in funcs:
            cfg = tk.choose_config(rows, n, k, gpu, dtype=dtype)
            funcs[name] = tk.topk_func(rows, n, k, dtype, largest, kind, cfg).with_attr("global_symbol", name)
            index["kernels"][name] = {"op": "topk", "rows": rows, "n": n, "k": k, "dtype": dtype,
                                      "largest": largest, "config": cfg.__dict__ if tk.uses_hierarchy(n, k, cfg)
                                      else "bitonic sort"}

    def add_beam(batch, beam, vocab, k, dtype):
        name = beam_name(batch, beam, vocab, k, dtype)
        if name not in funcs:
            cfg = tk.choose_config(batch * beam, vocab, k, gpu, measured=False)
            funcs[name] = tk.beam_step_func(batch, beam, vocab, k, dtype, gpu, cfg).with_attr("global_symbol", name)
            index["kernels"][name] = {"op": "beam", "batch": batch, "beam": beam, "vocab": vocab, "k": k,
                                      "dtype": dtype, "config": cfg.__dict__}

    for rows, n, k, dtype in _topk_cases(quick, smoke, fp16):
        add_topk(rows, n, k, dtype, True)
    for case in _beam_cases(quick, smoke):
        add_beam(*case)
    if with_tests:
        for case in TEST_TOPK:
            add_topk(*case)
        for case in TEST_BEAM:
            add_beam(*case)
    return tvm.IRModule(funcs), index, target


def build_for_gpu(out_dir, quick: bool = False, fp16: bool = True, target_name: str = "cuda",
                  smoke: bool = False) -> Path:
    """Build every kernel of the benchmark and of the GPU tests for CUDA here (no GPU needed) into
    out_dir/topk_kernels.so + index.json."""
    import tvm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    mod, index, target = kernel_module(quick, smoke, fp16, not smoke, target_name)
    tvm.compile(mod, target=target).export_library(str(out_dir / LIBRARY))
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(index['kernels'])} top-k kernels in {time.time() - start:.0f} s -> {out_dir}")
    return out_dir


def load_kernels(prebuilt) -> tuple[dict, dict]:
    """name -> PackedFunc from a directory written by `build_for_gpu` (TVM's runtime only)."""
    import tvm

    from ..errors import TvmseqError

    prebuilt = Path(prebuilt)
    if not (prebuilt / "index.json").exists():
        raise TvmseqError(f"{prebuilt} holds no index.json: build it with `python3 -m tvmseq.bench.topk "
                          f"--build-only {prebuilt}`")
    index = json.loads((prebuilt / "index.json").read_text())
    lib = tvm.runtime.load_module(str(prebuilt / index["library"]))
    return {name: lib[name] for name in index["kernels"]}, index


def time_host(fn, warmup: int = 1, iters: int = 5) -> float:
    """Median milliseconds on the host clock (the CPU smoke run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) in GB/s."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=3, iters=20)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _target_of(rows, n, k):
    if k <= 8 and (rows, n) == (32, 32000):
        return TARGET_32x32000
    if k <= 8 and (rows, n) == (256, 128256):
        return TARGET_256x128256
    return 1.0  # never slower than the peer


# ---------------------------------------------------------------------------------------- GPU (torch)
def run_topk_gpu(f, rows, n, k, dtype, copy_gbs, seed) -> dict:
    import torch
    import tvm

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, n, device="cuda", generator=g).to(getattr(torch, dtype))
    vals = torch.empty(rows, k, device="cuda", dtype=x.dtype)
    inds = torch.empty(rows, k, device="cuda", dtype=torch.int64)
    args = [tvm.runtime.from_dlpack(t) for t in (x, vals, inds)]
    f(*args)
    ref_v, _ = torch.topk(x, k, dim=-1, largest=True, sorted=True)
    ok = bool(torch.equal(vals, ref_v) and torch.equal(x.gather(1, inds), vals)
              and bool((inds.sort(dim=1).values.diff(dim=1) > 0).all()))
    ours = time_cuda(lambda: f(*args))
    peer = time_cuda(lambda: torch.topk(x, k, dim=-1, largest=True, sorted=True))
    gbs = rows * n * x.element_size() / (ours * 1e-3) / 1e9
    target = _target_of(rows, n, k)
    return {"op": "topk", "rows": rows, "vocab": n, "k": k, "dtype": dtype, "tvmseq_ms": ours,
            "torch_ms": peer, "speedup": peer / ours, "gbs": gbs, "copy_frac": gbs / copy_gbs,
            "target": target, "target_met": peer / ours >= target, "ok": ok}


def run_beam_gpu(f, batch, beam, vocab, k, dtype, copy_gbs, seed) -> dict:
    import torch
    import tvm

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(batch * beam, vocab, device="cuda", generator=g) * 3).to(getattr(torch, dtype))
    bs = torch.randn(batch, beam, device="cuda", generator=g)
    scores = torch.empty(batch, k, device="cuda")
    beam_ids = torch.empty(batch, k, device="cuda", dtype=torch.int64)
    tokens = torch.empty(batch, k, device="cuda", dtype=torch.int64)
    args = [tvm.runtime.from_dlpack(t) for t in (logits, bs, scores, beam_ids, tokens)]

    def peer():
        s = (bs[:, :, None] + logits.view(batch, beam, vocab).float().log_softmax(-1)).view(batch, -1)
        v, i = torch.topk(s, k, dim=-1)
        return v, i // vocab, i % vocab, s

    f(*args)
    ref_v, _, _, flat = peer()
    picked = flat.gather(1, beam_ids * vocab + tokens)
    ok = bool(torch.allclose(scores, ref_v, atol=1e-4, rtol=1e-5) and torch.allclose(picked, scores, atol=1e-4))
    ours = time_cuda(lambda: f(*args))
    theirs = time_cuda(peer)
    gbs = batch * beam * vocab * logits.element_size() / (ours * 1e-3) / 1e9
    return {"op": "beam", "rows": batch * beam, "batch": batch, "beam": beam, "vocab": vocab, "k": k,
            "dtype": dtype, "tvmseq_ms": ours, "torch_ms": theirs, "speedup": theirs / ours, "gbs": gbs,
            "copy_frac": gbs / copy_gbs, "target": 1.0, "target_met": theirs / ours >= 1.0, "ok": ok}


# ---------------------------------------------------------------------------------- CPU smoke (numpy)
def run_topk_cpu(f, rows, n, k, dtype, seed) -> dict:
    import tvm

    from ..reference.topk import topk as ref_topk

    x = np.random.default_rng(seed).standard_normal((rows, n)).astype(dtype)
    vals, inds = tvm.runtime.tensor(np.zeros((rows, k), dtype)), tvm.runtime.tensor(np.zeros((rows, k), np.int64))
    xt = tvm.runtime.tensor(x)
    f(xt, vals, inds)
    rv, ri = ref_topk(x, k)
    ok = bool(np.array_equal(vals.numpy(), rv) and np.array_equal(inds.numpy(), ri))
    ours = time_host(lambda: f(xt, vals, inds))

    def peer():
        part = np.argpartition(-x, k - 1, axis=1)[:, :k]
        return np.take_along_axis(part, np.argsort(-np.take_along_axis(x, part, 1), 1, kind="stable"), 1)

    theirs = time_host(peer)
    return {"op": "topk", "rows": rows, "vocab": n, "k": k, "dtype": dtype, "tvmseq_ms": ours,
            "torch_ms": theirs, "speedup": theirs / ours, "gbs": x.nbytes / (ours * 1e-3) / 1e9,
            "copy_frac": None, "target": None, "target_met": None, "ok": ok}


def run_beam_cpu(f, batch, beam, vocab, k, dtype, seed) -> dict:
    import tvm

    from ..reference.topk import beam_search_step as ref_beam

    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch * beam, vocab)) * 3).astype(dtype)
    bs = rng.standard_normal((batch, beam)).astype("float32")
    outs = [tvm.runtime.tensor(np.zeros((batch, k), dt)) for dt in ("float32", "int64", "int64")]
    args = [tvm.runtime.tensor(logits), tvm.runtime.tensor(bs)] + outs
    f(*args)
    rs, rb, rt = ref_beam(logits.reshape(batch, beam, vocab), bs, k)
    ok = bool(np.allclose(outs[0].numpy(), rs, atol=1e-4) and np.array_equal(outs[1].numpy(), rb)
              and np.array_equal(outs[2].numpy(), rt))
    ours = time_host(lambda: f(*args))
    theirs = time_host(lambda: ref_beam(logits.reshape(batch, beam, vocab), bs, k))
    return {"op": "beam", "rows": batch * beam, "batch": batch, "beam": beam, "vocab": vocab, "k": k,
            "dtype": dtype, "tvmseq_ms": ours, "torch_ms": theirs, "speedup": theirs / ours,
            "gbs": logits.nbytes / (ours * 1e-3) / 1e9, "copy_frac": None, "target": None,
            "target_met": None, "ok": ok}


def plot_speedups(rows):
    """Speedup over torch per row (log scale), the targets as dashed lines."""

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(8, 0.3 * len(rows)), 5))
        colors = ["tab:green" if r["speedup"] >= (r.get("target") or 1.0) else "tab:red" for r in rows]
        ax.bar(range(len(rows)), [r["speedup"] for r in rows], color=colors)
        for y in (1.0, TARGET_256x128256, TARGET_32x32000):
            ax.axhline(y, color="black", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), [f"{r['op']} {r['rows']}x{r['vocab']} k{r['k']} {r['dtype'][5:]}"
                                         for r in rows], rotation=90, fontsize=6)
        ax.set_ylabel("speedup over torch (x)")
        ax.set_title("tvmseq top-k / beam step vs torch (green: target met; dashed: 1x, 3x, 5x)")
        fig.tight_layout()
        fig.savefig(path, dpi=80)   # small enough to commit
        plt.close(fig)

    return plot


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a subset: rows 1/32/256, vocab 32000/128256, k 1/8/64")
    parser.add_argument("--fp16", action="store_true", help="add fp16 rows (k 8)")
    parser.add_argument("--no-beam", action="store_true", help="skip the beam-search step rows")
    parser.add_argument("--prebuilt", default=None, help="directory written by --build-only")
    parser.add_argument("--build-only", metavar="DIR", default=None,
                        help="only build the CUDA kernels (+ the GPU tests') into DIR (no GPU needed)")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="run this benchmark's code on the CPU (llvm kernels, numpy peers, tiny grid)")


def run(args) -> list[dict]:
    if getattr(args, "build_only", None):
        build_for_gpu(args.build_only, args.quick, fp16=True)
        return []
    smoke = getattr(args, "smoke_cpu", False)
    fp16 = getattr(args, "fp16", False)
    if smoke:
        kernels, index = _smoke_kernels(args.prebuilt)
        copy_gbs = None
    else:
        import torch

        from ..errors import TvmseqError

        if not torch.cuda.is_available():
            raise TvmseqError("bench topk needs a CUDA GPU visible to torch (or --smoke-cpu / --build-only DIR)")
        if args.prebuilt:
            kernels, index = load_kernels(args.prebuilt)
        else:  # build here: needs TVM's compiler
            import tvm

            mod, index, target = kernel_module(args.quick, False, fp16, False, "cuda")
            ex = tvm.compile(mod, target=target)
            kernels = {n: ex[n] for n in index["kernels"]}
        copy_gbs = copy_bandwidth_gbs()
        print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s")
    name = "topk_smoke_cpu" if smoke else "topk"
    meta = {"grid": GRID if not args.quick else QUICK, "beam_grid": BEAM_GRID if not args.quick else BEAM_QUICK,
            "copy_gbs": copy_gbs, "targets": {"32x32000_k<=8": TARGET_32x32000,
                                              "256x128256_k<=8": TARGET_256x128256, "else": 1.0},
            "configs": {k: v["config"] for k, v in index["kernels"].items()}}
    rows = []
    cases = [("topk", c) for c in _topk_cases(args.quick, smoke, fp16)]
    if not getattr(args, "no_beam", False):
        cases += [("beam", c) for c in _beam_cases(args.quick, smoke)]
    for seed, (op, case) in enumerate(cases):
        kname = topk_name(*case) if op == "topk" else beam_name(*case)
        if kname not in kernels:
            print(f"skipping {kname}: not in the prebuilt library (rebuild with --build-only)")
            continue
        f = kernels[kname]
        if smoke:
            row = run_topk_cpu(f, *case, seed) if op == "topk" else run_beam_cpu(f, *case, seed)
        else:
            row = run_topk_gpu(f, *case, copy_gbs, seed) if op == "topk" else run_beam_gpu(f, *case, copy_gbs, seed)
        rows.append(row)
        print_table([row], COLUMNS)
        save(name, rows, meta, None, args.out)  # keep what was measured if the run is cut short
    print()
    print_table(rows, COLUMNS)
    if not smoke:
        met = [r["target_met"] for r in rows]
        print(f"targets met in {sum(met)}/{len(met)} rows; outputs agree with torch in "
              f"{sum(r['ok'] for r in rows)}/{len(rows)}")
    save(name, rows, meta, plot_speedups(rows), args.out)
    return rows


def _smoke_kernels(prebuilt):
    """CPU smoke run: the llvm kernels go through the same export + load path as the GPU ones."""
    import tempfile

    directory = prebuilt or tempfile.mkdtemp(prefix="tvmseq_topk_smoke_")
    if not (Path(directory) / "index.json").exists():
        build_for_gpu(directory, fp16=False, target_name="llvm", smoke=True)
    return load_kernels(directory)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    run(p.parse_args())
