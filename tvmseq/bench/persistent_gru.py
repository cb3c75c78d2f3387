"""`tvmseq bench persistent_gru`: the persistent GRU kernel against torch.nn.GRU (cuDNN), same process.

Grid: hidden {256, 512, 1024} x batch {1, 8, 64} x seq 100, unidirectional and bidirectional, fp32 and
fp16, linear_before_reset=1 (PyTorch's GRU). Each config runs tvmseq's input projection (one GEMM over
all steps, `gru.input_projection_func`) + the persistent recurrence; the comparison with cuDNN, the
float64 check and the timing are `bench.gru.run_one` (shared with the per-step benchmark), and the
recurrence alone is timed as well.

Kernels are built here (TVM compiler, CUDA target, no GPU needed) into one .so per (dtype, direction)
group plus the GPU test kernels, and run where only TVM's runtime is:

  python3 -m tvmseq.bench.persistent_gru --build out/pgru           # here
  python3 -m tvmseq.bench.persistent_gru --prebuilt out/pgru [--quick]  # GPU machine
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from ..measure import PrebuiltModules, compile_for_gpu, cuda_available
from . import gru as gru_bench
from .common import config_group, config_suffix, grid_configs, print_table, ratio_bar_plot, save

NAME = "persistent_gru"
HIDDEN, BATCH, SEQ = (256, 512, 1024), (1, 8, 64, 256), 100
QUICK = ((256, 1), (1024, 1), (1024, 64))

# GPU test kernels (tests/test_persistent_gru.py, marked gpu): every feature on odd sizes.
# (D, B, H, dtype, lbr, direction, acts (names), clip, has_seq_lens, config dict or None)
GPU_TEST_CASES = [
    (1, 3, 37, "float32", 1, "forward", None, None, True, None),
    (2, 5, 100, "float32", 1, "bidirectional", None, None, True, None),
    (2, 4, 256, "float32", 0, "bidirectional", None, None, True, None),
    (1, 7, 333, "float32", 0, "reverse", ("HardSigmoid", "Softsign"), 0.8, True, None),
    (2, 19, 512, "float32", 1, "bidirectional", ("Sigmoid", "Tanh", "Sigmoid", "Relu"), None, True,
     dict(num_blocks=40, num_warps=8, batch_chunk=2, smem_rows=6)),
    (1, 64, 1024, "float32", 1, "forward", None, None, True, None),
    (2, 8, 1024, "float16", 0, "bidirectional", None, None, True, None),
    (1, 2, 129, "float16", 1, "forward", None, None, False, None),
]


def configs(quick: bool = False):
    return grid_configs(HIDDEN, BATCH, QUICK, quick)


def _test_name(case) -> str:
    D, B, H, dtype, lbr, direction, acts, clip, lens, cfg = case
    return f"pgru_test_{direction}_{dtype}_h{H}_b{B}_lbr{lbr}_{'lens' if lens else 'nolens'}"


# ----------------------------------------------------------------------------------------------------
# Build side (needs TVM's compiler)
# ----------------------------------------------------------------------------------------------------


def _bench_funcs(c, target) -> dict:
    """The two prim_funcs of a benchmark config (input projection + persistent recurrence), renamed."""
    from ..kernels.projection import gemm as ip
    from ..kernels.recurrent import gru, paths

    D = 2 if c["bidirectional"] else 1
    spec = gru.GruSpec(D, c["batch"], c["hidden"], c["hidden"], c["dtype"], linear_before_reset=1,
                       direction="bidirectional" if D == 2 else "forward")
    proj, tile = ip.projection_for(spec, target, SEQ)   # what the importer emits (static seq)
    rec, path, why = paths.recurrence_func_auto(spec, target)
    sfx = config_suffix(c)
    return {**gru_bench.projection_funcs(proj, tile, spec, sfx, target),
            f"rec_{sfx}": rec.with_attr("global_symbol", f"rec_{sfx}")}, path, why, tile


def _test_func(case, target):
    from ..kernels.activations import Activation
    from ..kernels.recurrent import engine
    from ..kernels.recurrent_gemm import PersistentConfig

    D, B, H, dtype, lbr, direction, acts, clip, lens, cfg = case
    acts_ = [Activation.make(a) for a in acts] if acts else None
    if acts_ is not None and len(acts_) == 2 and D == 2:
        acts_ = acts_ * 2
    func = engine.persistent_gru_func(D, B, H, dtype, lbr, direction, acts_, clip, lens, target,
                                      PersistentConfig(**cfg) if cfg else None)
    return func.with_attr("global_symbol", _test_name(case))


def residency(report: dict, threads: int, dyn_smem: int, blocks: int, num_sms: int = 132) -> dict:
    """Whether `blocks` blocks of a kernel with ptxas numbers `report` ({registers, smem}) and `threads`
    threads can all be resident on an H100-class GPU (64K registers, 228 KB shared memory, 2048 threads
    and 32 blocks per SM): {"blocks_per_sm", "resident", "why"}. A cooperative launch fails rather
    than hangs when they cannot, but the build checks anyway and takes the per-step path instead."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(report.get("registers", 0), 1) * 32 / 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = (228 * 1024) // (report.get("smem", 0) + dyn_smem + 1024)
    per_sm = max(0, min(by_regs, by_smem, 2048 // threads, 32))
    ok = blocks <= per_sm * num_sms
    why = (f"{blocks} blocks <= {per_sm}/SM x {num_sms} SMs ({report.get('registers')} regs x {threads} threads, "
           f"{report.get('smem', 0) + dyn_smem} B smem)")
    return {"blocks_per_sm": per_sm, "resident": ok, "why": ("" if ok else "NOT resident: ") + why}


def _rec_launch(c, target, path: str = "persistent"):
    """(threads, dynamic shared bytes, blocks) of a config's persistent recurrence (SIMT or tensor-core)."""
    from ..kernels.recurrent import engine
    from ..kernels.recurrent import mma as pm
    from ..kernels.recurrent import wgmma as pw

    D = 2 if c["bidirectional"] else 1
    if path == "persistent_wgmma":
        geo = pw.WgmmaRecGeometry(D, c["batch"], c["hidden"], 3, pw.default_config(D, c["batch"], c["hidden"], target))
        return geo.NTB, geo.smem_bytes(), geo.BLOCKS
    if path == "persistent_mma":
        cfg = pm.default_config(D, c["batch"], c["hidden"], target, dtype=c["dtype"])
        geo = pm.MmaGeometry(D, c["batch"], c["hidden"], 3, cfg, c["dtype"])
        return geo.NT, geo.smem_bytes(), geo.BLOCKS
    cfg = engine.default_gru_config(D, c["batch"], c["hidden"], c["dtype"], target)
    geo = engine._geometry(D, c["batch"], c["hidden"], cfg, True)
    return geo.NT, 4 * geo.R_smem * geo.Hp, cfg.num_blocks * D


def build_for_gpu(out_dir, quick: bool = False, tests: bool = True, target: str = "cuda",
                  ptxas: bool = False, dtypes=None) -> Path:
    """Build every kernel the benchmark (and the GPU tests) need, one .so per group, + index.json with
    each kernel's ptxas numbers and residency. A config whose persistent kernel could not be resident
    (registers/shared memory per block x blocks > the GPU) is rebuilt on the per-step path."""
    import tvm

    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict] = {}
    index = {"benchmark": NAME, "tvm": tvm.__version__, "arch": str(tgt.attrs.get("arch", "")),
             "configs": [], "tests": []}
    for c in configs(quick):
        if dtypes and c["dtype"] not in dtypes:
            continue
        funcs, path, why, tile = _bench_funcs(c, tgt)
        groups.setdefault(config_group(c), {}).update(funcs)
        entry = dict(c, file=f"{NAME}_{config_group(c)}.so", suffix=config_suffix(c), path=path, reason=why,
                     proj_rows=tile)
        if path.startswith("persistent"):
            entry["threads"], entry["dyn_smem"], entry["blocks"] = _rec_launch(c, tgt, path)
        index["configs"].append(entry)
    if tests:
        for case in GPU_TEST_CASES:
            groups.setdefault("tests", {})[_test_name(case)] = _test_func(case, tgt)
            D, B, H, dtype, lbr, direction, acts, clip, lens, cfg = case
            index["tests"].append(dict(file=f"{NAME}_tests.so", func=_test_name(case), D=D, B=B, H=H,
                                       dtype=dtype, lbr=lbr, direction=direction, acts=acts, clip=clip,
                                       has_seq_lens=lens, config=cfg))
    for group, funcs in groups.items():
        t0 = time.time()
        ex, report = compile_for_gpu(funcs, tgt)
        retry = []
        for e in index["configs"]:
            if config_group(e) != group or not e["path"].startswith("persistent"):
                continue
            info = report.get(f"rec_{e['suffix']}_kernel", {})
            e["ptxas"] = info
            e.update(residency=residency(info, e["threads"], e["dyn_smem"], e["blocks"]))
            if info and not e["residency"]["resident"]:
                retry.append(e)
        for e in retry:  # fall back to the per-step path for these configs
            from ..kernels.recurrent import gru

            c = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch")}
            D = 2 if c["bidirectional"] else 1
            spec = gru.GruSpec(D, c["batch"], c["hidden"], c["hidden"], c["dtype"], linear_before_reset=1,
                               direction="bidirectional" if D == 2 else "forward")
            funcs[f"rec_{e['suffix']}"] = gru.recurrence_func(spec, tgt).with_attr("global_symbol", f"rec_{e['suffix']}")
            e.update(path="per_step", reason=e["residency"]["why"])
            print(f"  {e['suffix']}: {e['reason']} -> per-step path", flush=True)
        if retry:
            ex, report = compile_for_gpu(funcs, tgt)
        ex.export_library(str(out_dir / f"{NAME}_{group}.so"))
        print(f"built {group}: {len(funcs)} functions in {time.time() - t0:.1f}s "
              f"({(out_dir / f'{NAME}_{group}.so').stat().st_size / 1e6:.1f} MB)", flush=True)
        if ptxas:
            for kernel, info in sorted(report.items()):
                if "proj" not in kernel:
                    print(f"  ptxas {kernel}: {info}")
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {out_dir / 'index.json'}")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Run side (TVM runtime + torch)
# ----------------------------------------------------------------------------------------------------


class _Renamed:
    """Looks like the per-step benchmark's module: ['gru_input_projection'], ['gru_recurrence']."""

    def __init__(self, mod, suffix, proj_rows=None):
        self.mod, self.suffix, self.proj_rows = mod, suffix, proj_rows

    def __getitem__(self, name):
        if name == "gru_input_projection":   # with the split pass of a tf32x3 projection
            return gru_bench.projection_of(self.mod, self.suffix, self.proj_rows)
        return self.mod[{"gru_recurrence": "rec_"}[name] + self.suffix]


def _recurrence_only_us(mod, c, seq) -> float:
    """Per-step time of the persistent recurrence alone (random gate_i), for the record."""
    import torch
    import tvm

    from ..measure import time_cuda

    H, B, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    dev, tdt = "cuda", getattr(torch, c["dtype"])
    g = torch.Generator(device=dev).manual_seed(1)
    gate_i = torch.randn(D, seq, B, 3 * H, device=dev, generator=g)
    R = ((torch.rand(D, 3 * H, H, device=dev, generator=g) * 2 - 1) * H ** -0.5).to(tdt)
    rb_h = torch.zeros(D, H, device=dev)
    lens = torch.full((B,), seq, dtype=torch.int32, device=dev)
    h0 = torch.zeros(D, B, H, device=dev)
    Y = torch.empty(seq, D, B, H, device=dev, dtype=tdt)
    Yh = torch.empty(D, B, H, device=dev, dtype=tdt)
    args = [tvm.runtime.from_dlpack(t) for t in (gate_i, R, rb_h, lens, h0, Y, Yh)]
    rec = mod["gru_recurrence"]
    for _ in range(3):  # launches one at a time first: a hang shows up here, attributed to this config
        rec(*args)
        torch.cuda.synchronize()
    return time_cuda(lambda: rec(*args), warmup=2, iters=20) * 1e3 / seq


# ----------------------------------------------------------------------------------------------------
# Supervisor / worker: the worker runs configs in order and reports progress; the supervisor kills it
# when one config runs past its time limit (a hung GPU kernel cannot be interrupted in-process), records
# that config as a timeout and starts a new worker on the rest. Results are saved after every row.
# ----------------------------------------------------------------------------------------------------

COLS = ["dtype", "bidirectional", "hidden", "batch", "path", "tvmseq_us_step", "recurrence_us_step",
        "cudnn_us_step", "speedup", "err_tvmseq", "err_peer", "agree", "status"]


def _read_rows(rows_file: Path) -> list[dict]:
    if not rows_file.exists():
        return []
    return [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]


def _save_rows(rows, out, final=False):
    meta = {"peer": "torch.nn.GRU (cuDNN)", "seq": SEQ,
            "note": "tvmseq time = TVM input projection + persistent recurrence"}
    timed = [r for r in rows if r.get("speedup")]
    plot = (ratio_bar_plot(timed, ["dtype", "bidirectional", "hidden", "batch"], "speedup",
                           "tvmseq persistent GRU vs cuDNN: speedup per config") if final and timed else None)
    save(NAME, rows, meta, plot, out)


def _worker(index, root, suffixes, rows_file: Path, progress: Path, out, deadline: float = 1e18):
    """Run the configs `suffixes` in order; one JSON line per finished config in rows_file."""
    import torch

    from . import gru as gru_bench

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    mods = PrebuiltModules(root)
    by_suffix = {e["suffix"]: e for e in index["configs"]}
    for sfx in suffixes:
        if time.time() > deadline:
            print(f"budget spent: not run: {suffixes[suffixes.index(sfx):]}", flush=True)
            os._exit(5)
        e = by_suffix[sfx]
        c = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch")}
        row = dict(c, seq=SEQ, path=e["path"])
        c["proj_rows"] = e.get("proj_rows")   # the projection on padded rows (as the importer runs it)
        progress.write_text(f"{sfx} {time.time()}\n")
        res = residency(e["ptxas"], e["threads"], e["dyn_smem"], e["blocks"], num_sms) \
            if e["path"].startswith("persistent") and e.get("ptxas") else None
        if res is not None and not res["resident"]:
            row.update(status="skipped", reason=res["why"])
        else:
            try:
                mod = _Renamed(mods.get(e["file"]), e["suffix"], c["proj_rows"])
                progress.write_text(f"{sfx} {time.time()}\n")  # the clock starts after the load
                rec_us = _recurrence_only_us(mod, c, SEQ)
                saved = gru_bench._load
                gru_bench._load = lambda _c, _p, _m=mod: _m  # run_one loads through _load: hand it our module
                try:
                    row = gru_bench.run_one(c, prebuilt=str(root), seq=SEQ)
                finally:
                    gru_bench._load = saved
                row.update(path=e["path"], recurrence_us_step=rec_us, status="ok" if row["agree"] else "WRONG")
            except Exception as err:  # noqa: BLE001 - a launch error must not stop the other configs
                row.update(status="error", reason=f"{type(err).__name__}: {err}"[:400])
                print(f"{sfx}: {row['reason']}", flush=True)
                if "CUDA" in str(err) or "cuda" in str(err):
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    os._exit(4)  # the context may be unusable: let the supervisor start a fresh worker
        with rows_file.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        print_table([row], [k for k in COLS if k in row])
        _save_rows(_read_rows(rows_file), out)


_WORKER_MODULE = "tvmseq.bench.persistent_gru"  # what the supervisor starts with --worker (a test fakes it)


def _supervise(index, root, args) -> list[dict]:
    import signal
    import subprocess
    import sys
    import tempfile

    wanted = [e["suffix"] for e in index["configs"]
              if (e["dtype"], e["bidirectional"], e["hidden"], e["batch"]) in
              {(c["dtype"], c["bidirectional"], c["hidden"], c["batch"]) for c in configs(args.quick)}
              and (not args.dtype or e["dtype"] in args.dtype.split(","))
              and (args.bidirectional is None or e["bidirectional"] == (args.bidirectional == "bi"))]
    order = {"float32": 0, "float16": 1}  # fp32 uni, fp32 bi, fp16 uni, fp16 bi
    by_suffix = {e["suffix"]: e for e in index["configs"]}
    wanted.sort(key=lambda s: (order[by_suffix[s]["dtype"]], by_suffix[s]["bidirectional"]))
    work = Path(tempfile.mkdtemp(prefix="pgru_bench_"))
    rows_file, progress = work / "rows.jsonl", work / "progress"
    t_start = time.time()
    for _ in range(len(wanted) + 3):  # each round finishes or records at least one config
        done = {config_suffix(r) for r in _read_rows(rows_file)}
        todo = [s for s in wanted if s not in done]
        if not todo:
            break
        if time.time() - t_start > args.budget:
            print(f"budget of {args.budget}s spent: not run: {todo}", flush=True)
            break
        progress.write_text(f"{todo[0]} {time.time()}\n")
        cmd = [sys.executable, "-m", _WORKER_MODULE, "--prebuilt", str(root), "--worker",
               ",".join(todo), "--rows", str(rows_file), "--progress", str(progress)]
        if args.out:
            cmd += ["--out", str(args.out)]
        cmd += ["--deadline", str(t_start + args.budget)]
        proc = subprocess.Popen(cmd, start_new_session=True)
        # an outer `timeout` must not leave the worker (own session) running on the GPU
        signal.signal(signal.SIGTERM, lambda *_: (os.killpg(proc.pid, 9), os._exit(124)))
        first = True
        while proc.poll() is None:
            time.sleep(0.5)
            try:
                sfx, since = progress.read_text().split()
            except ValueError:
                continue
            limit = args.config_timeout + (args.load_timeout if first else 0)
            if sfx != todo[0]:
                first = False
            if time.time() - float(since) > limit or time.time() - t_start > args.budget + 60:
                print(f"\nTIMEOUT: {sfx} ran over {limit:.0f}s (hung kernel?): killing the worker, "
                      "going on with the next config", flush=True)
                os.killpg(proc.pid, 9)
                proc.wait()
                e = by_suffix[sfx]
                row = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch", "path")}
                row.update(seq=SEQ, status="timeout", reason=f"no result within {limit:.0f}s",
                           ptxas=e.get("ptxas"), config=e.get("reason"))
                with rows_file.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                _save_rows(_read_rows(rows_file), args.out)
                break
        else:
            if proc.returncode == 5:  # the worker stopped at the budget
                break
            if proc.returncode not in (0, 4):
                print(f"worker exited with {proc.returncode}", flush=True)
                sfx = progress.read_text().split()[0]
                if sfx not in {config_suffix(r) for r in _read_rows(rows_file)}:
                    e = by_suffix[sfx]
                    row = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch", "path")}
                    row.update(seq=SEQ, status="crash", reason=f"worker exit code {proc.returncode}")
                    with rows_file.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
    rows = _read_rows(rows_file)
    print()
    print_table(rows, [k for k in COLS if any(k in r for r in rows)])
    _save_rows(rows, args.out, final=True)
    return rows


def _run_cpu(args) -> list[dict]:
    """No GPU: the llvm variant on tiny sizes against a numpy GRU (exercises the code path)."""
    import tvm

    from ..kernels.recurrent import engine

    rows = []
    for D, B, H, lbr in ((1, 2, 9, 1), (2, 3, 7, 0)):
        seq = 5
        rng = np.random.default_rng(H)
        gate_i = rng.standard_normal((D, seq, B, 3 * H)).astype(np.float32)
        R = rng.uniform(-0.5, 0.5, (D, 3 * H, H)).astype(np.float32)
        rb_h = rng.uniform(-0.5, 0.5, (D, H)).astype(np.float32)
        h0 = rng.standard_normal((D, B, H)).astype(np.float32)
        lens = np.full(B, seq, np.int32)
        func = engine.persistent_gru_func(D, B, H, "float32", lbr, "bidirectional" if D == 2 else "forward",
                                          None, None, False, "llvm")
        f = tvm.compile(tvm.IRModule({"gru_recurrence": func}), target="llvm")["gru_recurrence"]
        Y = tvm.runtime.tensor(np.zeros((seq, D, B, H), np.float32))
        Yh = tvm.runtime.tensor(np.zeros((D, B, H), np.float32))
        t0 = time.perf_counter()
        f(*[tvm.runtime.tensor(a) for a in (gate_i, R, rb_h, lens, h0)], Y, Yh)
        us = (time.perf_counter() - t0) * 1e6 / seq
        want = _numpy_recurrence(gate_i, R, rb_h, h0, lbr)
        err = float(np.abs(Y.numpy() - want).max())
        rows.append(dict(D=D, B=B, H=H, lbr=lbr, tvmseq_us_step=us, max_err=err, ok=err < 1e-4))
    print_table(rows, ["D", "B", "H", "lbr", "tvmseq_us_step", "max_err", "ok"])
    return rows


def _numpy_recurrence(gate_i, R, rb_h, h0, lbr):
    """float64 GRU recurrence on gate_i (forward for d=0, reverse for d=1), sigmoid/tanh."""
    D, seq, B, G3 = gate_i.shape
    H = G3 // 3
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    Y = np.zeros((seq, D, B, H))
    for d in range(D):
        h = h0[d].astype(np.float64)
        Rz, Rr, Rh = np.split(R[d].astype(np.float64), 3)
        for s in range(seq):
            t = seq - 1 - s if d == 1 else s
            gz, gr, gh = np.split(gate_i[d, t].astype(np.float64), 3, axis=1)
            z, r = sig(gz + h @ Rz.T), sig(gr + h @ Rr.T)
            hh = np.tanh(gh + r * (h @ Rh.T + rb_h[d])) if lbr else np.tanh(gh + (r * h) @ Rh.T)
            h = (1 - z) * hh + z * h
            Y[t, d] = h
    return Y


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"only (hidden, batch) in {QUICK}")
    parser.add_argument("--prebuilt", metavar="DIR", help="kernels from build_for_gpu (index.json + .so)")
    parser.add_argument("--build", metavar="DIR", help="build the kernels into DIR and exit (needs the compiler)")
    parser.add_argument("--ptxas", action="store_true", help="with --build: print ptxas registers/spills")
    parser.add_argument("--no-tests", action="store_true", help="with --build: leave out the GPU test kernels")
    parser.add_argument("--dtype", default=None, help="comma list, e.g. float32")
    parser.add_argument("--bidirectional", choices=("uni", "bi"), default=None, help="only one direction kind")
    parser.add_argument("--config-timeout", type=float, default=30.0,
                        help="seconds one config may take before its worker is killed (default 30)")
    parser.add_argument("--load-timeout", type=float, default=60.0,
                        help="extra seconds for a worker's start (imports, module load; default 60)")
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting configs after this many seconds")
    parser.add_argument("--out", default=None, help="directory for the JSON + plot (default artifacts/bench)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: config suffixes
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=1e18, help=argparse.SUPPRESS)


def run(args) -> list[dict]:
    if args.build:
        build_for_gpu(args.build, quick=args.quick, tests=not args.no_tests, ptxas=args.ptxas,
                      dtypes=args.dtype.split(",") if args.dtype else None)
        return []
    if not cuda_available():
        print("no CUDA GPU: running the llvm variant on tiny sizes")
        return _run_cpu(args)
    root = Path(args.prebuilt) if args.prebuilt else None
    if root is None:
        import tempfile

        root = build_for_gpu(tempfile.mkdtemp(prefix="pgru_"), quick=args.quick, tests=False)
    index = json.loads((root / "index.json").read_text())
    if args.worker:
        _worker(index, root, args.worker.split(","), Path(args.rows), Path(args.progress), args.out, args.deadline)
        return []
    return _supervise(index, root, args)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
