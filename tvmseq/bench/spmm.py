"""`tvmseq bench spmm`: spmm_t (S^T D without a transpose) and spmm (S D) against cuSPARSE/cuBLAS.

Grid: S 4096x4096 and 16384x4096 (CSR, int32 indices), densities 0.5%, 1%, 5%, 20%, D with 64, 128,
256 columns, fp32 and fp16. Peers, all in this process on the same data (torch):
  spmm_t: torch `A.t() @ D` (cuSPARSE with a transposed operand), cuSPARSE on a CSR of S^T built
          beforehand (`At @ D`, the transpose not timed), dense cuBLAS `Ad.t() @ D`;
  spmm:   cuSPARSE `A @ D`, dense cuBLAS `Ad @ D`.
Every tvmseq kernel is timed with its default schedule and a few schedule variants (the best is
reported too); outputs are checked against cuBLAS in fp32 and for bitwise determinism. For fp32
spmm_t the atomic scatter alternative (S read in row order, `out[c] += v * D[r]` with atomics, zeroing
of `out` included; not deterministic) is timed as `scatter_ms`. Also reported: the transpose index
map's bytes against those of a stored transpose.

Kernels are built where TVM's compiler is (`--build-only DIR`, no GPU needed) and loaded with
`--prebuilt DIR` where only TVM's runtime is; DIR also holds the kernels `tests/test_sparse.py`'s GPU
tests need (TVMSEQ_SPMM_PREBUILT=DIR).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path

import numpy as np

from ..measure import time_cuda
from .common import print_table, save

SHAPES = ((4096, 4096), (16384, 4096))
DENSITIES = (0.005, 0.01, 0.05, 0.2)
NCOLS = (64, 128, 256)
DTYPES = ("float32", "float16")
QUICK = dict(shapes=((4096, 4096),), densities=(0.01, 0.05), ncols=(64, 256), dtypes=DTYPES)
SMOKE = dict(shapes=((67, 45),), densities=(0.05, 0.3), ncols=(8, 12), dtypes=DTYPES)  # CPU check of this file
# kernels tests/test_sparse.py's GPU tests use: (rows, cols, n)
TEST_SHAPES = ((37, 29, 5), (129, 7, 33), (300, 200, 64), (1000, 513, 256))
LIBRARY = "spmm_kernels.so"
NAME_SMOKE = "spmm_smoke_cpu"
TARGET_VS_TORCH_T = 4.0  # spmm_t at least 4x faster than torch A.t() @ D
TARGET_VS_PRE = 1 / 1.3  # and within 1.3x of cuSPARSE on a stored transpose


def grid(quick: bool = False, smoke: bool = False) -> dict:
    if smoke:
        return SMOKE
    return QUICK if quick else dict(shapes=SHAPES, densities=DENSITIES, ncols=NCOLS, dtypes=DTYPES)


def variants(shape, target, quick: bool = False) -> dict:
    """Schedule variants timed for one kernel: the default and a few neighbours (tag -> schedule)."""
    from ..kernels.sparse.spmm import default_schedule

    d = default_schedule(shape, target)
    replace = dataclasses.replace
    candidates = {"default": d, "u8": replace(d, unroll=8)}
    model = default_schedule(shape, target, measured=False)
    if model != d:  # d is a measured winner: time the cost model's pick beside it (schedules/tune_spmm.py)
        candidates["model"] = model
    if not quick:
        candidates["u2"] = replace(d, unroll=2)
        if d.split > 1:  # fewer groups, more rows a block (same threads)
            candidates["split/2"] = replace(d, split=d.split // 2, rows_per_block=d.rows_per_block * 2)
        if d.rows_per_block > 1 and d.split < 8:  # more groups, fewer rows a block
            candidates["split*2"] = replace(d, split=d.split * 2, rows_per_block=d.rows_per_block // 2)
        if d.lanes % 2 == 0 and d.lanes >= 8:  # two chunks a lane: more loads in flight per thread
            candidates["lanes/2"] = replace(d, lanes=d.lanes // 2, rows_per_block=d.rows_per_block * 2)
    out, seen = {}, set()
    for tag, sched in candidates.items():
        try:
            sched.check(shape.n_cols, target)
        except Exception:  # noqa: BLE001 - an infeasible neighbour is simply not timed
            continue
        if sched not in seen:
            seen.add(sched)
            out[tag] = sched
    return out


def kernel_name(shape, tag: str) -> str:
    return shape.name if tag == "default" else f"{shape.name}__{tag.replace('/', 'div').replace('*', 'x')}"


def _bench_shapes(g: dict):
    from ..kernels.sparse.spmm import SpmmShape

    for (rows, cols), n, dtype, transposed in itertools.product(g["shapes"], g["ncols"], g["dtypes"], (True, False)):
        yield SpmmShape(transposed, rows, cols, n, dtype)


def _test_shapes():
    from ..kernels.sparse.spmm import SpmmShape

    for (rows, cols, n), dtype, transposed in itertools.product(TEST_SHAPES, DTYPES, (True, False)):
        yield SpmmShape(transposed, rows, cols, n, dtype)


def kernel_module(quick: bool = False, with_tests: bool = True, target_name: str = "cuda", g: dict | None = None):
    """(IRModule of every kernel the benchmark and the GPU tests need, index dict, target)."""
    import tvm

    from .. import targets
    from ..kernels.sparse.spmm import spmm_func, spmm_t_scatter_func
    from ..targets import is_gpu

    target = targets.resolve(target_name)
    funcs = {}
    index = {"library": LIBRARY, "target_kind": target.kind.name, "kernels": [], "schedules": {}}
    for shape in _bench_shapes(g or grid(quick)):
        for tag, sched in variants(shape, target, quick).items():
            name = kernel_name(shape, tag)
            funcs[name] = spmm_func(shape, target, sched).with_attr("global_symbol", name)
            index["schedules"][name] = {"shape": dataclasses.asdict(shape), "variant": tag,
                                        "schedule": dataclasses.asdict(sched)}
        if shape.transposed and shape.dtype == "float32" and is_gpu(target):  # the atomic scatter alternative
            funcs[shape.name + "__scatter"] = spmm_t_scatter_func(shape, target)
    if with_tests:
        for shape in _test_shapes():
            funcs.setdefault(shape.name, spmm_func(shape, target))
    index["kernels"] = sorted(funcs)
    return tvm.IRModule(funcs), index, target


def build_for_gpu(out_dir, quick: bool = False) -> Path:
    """Build every kernel for CUDA here (no GPU needed) into out_dir/spmm_kernels.so + index.json."""
    import tvm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from ..measure import compile_for_gpu

    mod, index, target = kernel_module(quick)
    start = time.time()
    compile_for_gpu({gv.name_hint: f for gv, f in mod.functions_items()}, target)[0].export_library(str(out_dir / LIBRARY))
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    print(f"built {len(index['kernels'])} kernels in {time.time() - start:.0f} s -> {out_dir}")
    return out_dir


def _kernels(prebuilt, quick, target_name="cuda", g=None):
    """name -> callable: loaded from `prebuilt`, else compiled here (needs TVM's compiler)."""
    import tvm

    from .. import sparse

    if prebuilt:
        index = json.loads((Path(prebuilt) / "index.json").read_text())
        return sparse.load_kernels(prebuilt), index
    mod, index, target = kernel_module(quick, with_tests=False, target_name=target_name, g=g)
    ex = tvm.compile(mod, target=target)
    return {n: ex[n] for n in index["kernels"]}, index


def _pattern(rows, cols, density, seed, device="cuda"):
    """A random CSR pattern made on `device`: int32 crow/col (torch) and the values in fp32."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    mask = torch.rand(rows, cols, device=device, generator=g) < density
    values = torch.rand(rows, cols, device=device, generator=g) * 0.9 + 0.1
    values = torch.where(torch.rand(rows, cols, device=device, generator=g) < 0.5, -values, values)
    A = torch.where(mask, values, torch.zeros((), device=device)).to_sparse_csr()
    del mask, values
    return A.crow_indices().int(), A.col_indices().int(), A.values()


def time_host(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds on the host clock (the CPU smoke run of this benchmark)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _time_or_none(timer, fn, errors: dict, key: str):
    try:
        return timer(fn)
    except Exception as err:  # noqa: BLE001 - a peer lacking a dtype is recorded, not fatal
        errors[key] = f"{type(err).__name__}: {err}"[:200]
        return None


def run_pattern(rows, cols, density, kernels, index, g, seed=0, device="cuda") -> list[dict]:
    """All (n, dtype, op) rows of one sparsity pattern (device "cpu": the smoke run, llvm kernels)."""
    import torch
    import tvm

    from .. import sparse
    from ..kernels.sparse.spmm import SpmmShape

    timer = time_cuda if device == "cuda" else time_host
    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    crow, col, vals32 = _pattern(rows, cols, density, seed, device)
    out_rows_all = []
    for dtype in g["dtypes"]:
        tdt = getattr(torch, dtype)
        vals = vals32.to(tdt)
        S = sparse.CSR(crow.cpu().numpy(), col.cpu().numpy(), vals.cpu().numpy(), (rows, cols))
        t0 = time.time()
        tm = S.transpose_map
        map_build_s = time.time() - t0
        A = torch.sparse_csr_tensor(crow, col, vals, (rows, cols))
        A_dense = A.to_dense()
        try:  # the peer's stored transpose, built before timing
            At = A.t().to_sparse_csr()
        except Exception as err:  # noqa: BLE001 - recorded per row as the peer's error
            At, at_error = None, f"{type(err).__name__}: {err}"[:200]
        for n, transposed in itertools.product(g["ncols"], (True, False)):
            shape = SpmmShape(transposed, rows, cols, n, dtype)
            d_rows, o_rows = (rows, cols) if transposed else (cols, rows)
            D = (torch.rand(d_rows, n, device=device, dtype=torch.float32) * 2 - 1).to(tdt)
            out = torch.empty(o_rows, n, device=device, dtype=tdt)
            args = S.kernel_args(transposed, dev) + [tvm.runtime.from_dlpack(D), tvm.runtime.from_dlpack(out)]
            ref = ((A_dense.float().t() if transposed else A_dense.float()) @ D.float())
            errors: dict = {}
            times, variant_errs = {}, {}
            for name, info in index["schedules"].items():
                if info["shape"] != dataclasses.asdict(shape):
                    continue
                fn = kernels[name]
                times[info["variant"]] = timer(lambda fn=fn: fn(*args))
                variant_errs[info["variant"]] = _rel_err(out, ref)  # every variant is checked, not only timed
            kernels[shape.name](*args)
            first = out.clone()
            kernels[shape.name](*args)
            deterministic = bool(torch.equal(first, out))
            err = _rel_err(first, ref)
            scatter = kernels.get(shape.name + "__scatter")
            if scatter is not None:  # row order + atomics: a comparison, not deterministic
                out_s = torch.zeros_like(out)
                s_args = S.kernel_args(False, dev) + [args[-2], tvm.runtime.from_dlpack(out_s)]
                scatter_ms = timer(lambda: (out_s.zero_(), scatter(*s_args)))
                out_s.zero_()
                scatter(*s_args)
                first_s = out_s.clone()
                out_s.zero_()
                scatter(*s_args)
                scatter_info = {"scatter_ms": scatter_ms, "scatter_rel_err": _rel_err(first_s, ref),
                                "scatter_deterministic": bool(torch.equal(first_s, out_s))}
            else:
                scatter_info = {}
            row = {"op": "spmm_t" if transposed else "spmm", "shape": f"{rows}x{cols}", "density": density,
                   "n": n, "dtype": dtype, "nnz": S.nnz, "tvmseq_ms": times["default"]}
            best = min(times, key=times.get)
            row.update(tvmseq_best_ms=times[best], best_variant=best,
                       variants_ms={k: round(v, 5) for k, v in times.items()},
                       variants_rel_err={k: float(f"{v:.3g}") for k, v in variant_errs.items()}, **scatter_info)
            if transposed:
                row["torch_t_ms"] = _time_or_none(timer, lambda: A.t() @ D, errors, "torch_t")
                if At is None:
                    row["cusparse_pre_ms"], errors["cusparse_pre"] = None, at_error
                else:
                    row["cusparse_pre_ms"] = _time_or_none(timer, lambda: At @ D, errors, "cusparse_pre")
                row["cublas_ms"] = _time_or_none(timer, lambda: A_dense.t() @ D, errors, "cublas")
                row["vs_torch_t"] = _ratio(row["torch_t_ms"], row["tvmseq_best_ms"])
                row["vs_cusparse_pre"] = _ratio(row["cusparse_pre_ms"], row["tvmseq_best_ms"])
                row["map_bytes"], row["transpose_bytes"] = tm.nbytes, S.transpose_nbytes()
                row["map_share"] = tm.nbytes / S.transpose_nbytes()
                row["map_build_s"] = round(map_build_s, 3)
                row["targets_met"] = bool((row["vs_torch_t"] or 0) >= TARGET_VS_TORCH_T and
                                          (row["vs_cusparse_pre"] or 0) >= TARGET_VS_PRE)
            else:
                row["cusparse_ms"] = _time_or_none(timer, lambda: A @ D, errors, "cusparse")
                row["cublas_ms"] = _time_or_none(timer, lambda: A_dense @ D, errors, "cublas")
                row["vs_cusparse"] = _ratio(row["cusparse_ms"], row["tvmseq_best_ms"])
            row["vs_cublas"] = _ratio(row["cublas_ms"], row["tvmseq_best_ms"])
            try:  # the sparse peer's own answer, for the record
                peer_out = (A.t() @ D) if transposed else (A @ D)
                row["peer_rel_err"] = _rel_err(peer_out.to_dense() if peer_out.is_sparse_csr else peer_out, ref)
            except Exception:  # noqa: BLE001 - already recorded by its timing
                pass
            row["rel_err"] = err
            tol = 1e-4 if dtype == "float32" else 1e-2
            row["agree"] = err < tol and all(e < tol for e in variant_errs.values())
            row["deterministic"] = deterministic
            if errors:
                row["peer_errors"] = errors
            out_rows_all.append(row)
            print_table([row], COLUMNS_T if transposed else COLUMNS)
        del A, A_dense, At
        if device == "cuda":
            torch.cuda.empty_cache()
    return out_rows_all


def _rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| (ref in float32)."""
    return float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _ratio(peer, ours):
    return None if peer is None or not ours else peer / ours


COLUMNS_T = ["op", "shape", "density", "n", "dtype", "tvmseq_ms", "tvmseq_best_ms", "best_variant", "scatter_ms",
             "torch_t_ms",
             "cusparse_pre_ms", "cublas_ms", "vs_torch_t", "vs_cusparse_pre", "vs_cublas", "map_share", "agree",
             "deterministic"]
COLUMNS = ["op", "shape", "density", "n", "dtype", "tvmseq_ms", "tvmseq_best_ms", "best_variant", "cusparse_ms",
           "cublas_ms", "vs_cusparse", "vs_cublas", "agree", "deterministic"]


def plot_speedups(rows):
    """Two panels (spmm_t, spmm): speedup of tvmseq (best schedule) over each peer, log scale."""

    def plot(path):
        import matplotlib.pyplot as plt

        panels = [("spmm_t", [("vs_torch_t", "torch A.t() @ D"), ("vs_cusparse_pre", "cuSPARSE, stored S^T"),
                              ("vs_cublas", "dense cuBLAS")], [TARGET_VS_TORCH_T, TARGET_VS_PRE]),
                  ("spmm", [("vs_cusparse", "cuSPARSE A @ D"), ("vs_cublas", "dense cuBLAS")], [1.0])]
        fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.3 * len(rows)), 9))
        for ax, (op, series, lines) in zip(axes, panels):
            sel = [r for r in rows if r["op"] == op]
            width = 0.8 / len(series)
            for i, (key, label) in enumerate(series):
                ax.bar([j + i * width for j in range(len(sel))], [r.get(key) or 0 for r in sel], width, label=label)
            for y in lines:
                ax.axhline(y, color="black", lw=0.8, ls="--")
            ax.set_yscale("log")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sel))],
                          [f"{r['shape']} {r['density']:g} n{r['n']} {r['dtype'][5:]}" for r in sel],
                          rotation=90, fontsize=6)
            ax.set_ylabel("speedup of tvmseq (x)")
            ax.set_title(f"tvmseq {op} vs peers (>1 = tvmseq faster)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=80)   # small enough to commit
        plt.close(fig)

    return plot


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a small subset: 4096x4096, 1%%/5%%, n 64/256")
    parser.add_argument("--prebuilt", default=None, help="directory written by --build-only")
    parser.add_argument("--build-only", metavar="DIR", default=None,
                        help="only build the CUDA kernels (+ the GPU tests') into DIR (no GPU needed)")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="run this benchmark's code on the CPU (llvm kernels, torch CPU peers, tiny grid)")


def run(args) -> list[dict]:
    if getattr(args, "build_only", None):
        build_for_gpu(args.build_only, args.quick)
        return []
    import torch

    smoke = getattr(args, "smoke_cpu", False)
    device = "cpu" if smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        from ..errors import TvmseqError

        raise TvmseqError("bench spmm needs a CUDA GPU visible to torch (or --smoke-cpu / --build-only DIR)")
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS peer in true fp32, like the kernels
    g = grid(args.quick, smoke)
    kernels, index = _kernels(args.prebuilt, args.quick, "llvm" if smoke else "cuda", g)
    meta = {"grid": {k: list(v) for k, v in g.items()}, "targets": {"vs_torch_t": TARGET_VS_TORCH_T,
            "vs_cusparse_pre": TARGET_VS_PRE}, "tf32": False, "index_dtype": "int32",
            "schedules": index["schedules"]}
    rows = []
    for seed, ((r, c), density) in enumerate(itertools.product(g["shapes"], g["densities"])):
        rows += run_pattern(r, c, density, kernels, index, g, seed, device)
        # save after every pattern: what was measured survives a run cut short
        save(NAME_SMOKE if smoke else "spmm", rows, meta, None, args.out)
    print()
    print_table([r for r in rows if r["op"] == "spmm_t"], COLUMNS_T)
    print_table([r for r in rows if r["op"] == "spmm"], COLUMNS)
    met = [r["targets_met"] for r in rows if r["op"] == "spmm_t"]
    print(f"spmm_t targets (>= {TARGET_VS_TORCH_T}x torch A.t()@D, within 1.3x of cuSPARSE on stored S^T) met "
          f"in {sum(met)}/{len(met)} configs")
    save(NAME_SMOKE if smoke else "spmm", rows, meta, plot_speedups(rows), args.out)
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
