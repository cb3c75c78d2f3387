"""`tvmseq bench persistent_lstm`: tvmseq's LSTM (input projection + the persistent recurrence where
`paths.lstm_recurrence_auto` takes it, else the per-step kernel of `kernels/recurrent/lstm.py`) against
torch.nn.LSTM (cuDNN, TF32 off) in the same process.

Grid: hidden {128, 256, 512, 1024} x batch {1, 8, 64, 256} x seq 100, unidirectional and bidirectional, fp32
and fp16. Per config: both sides on the same weights and inputs, medians of CUDA-event timings after warm-up
in alternating rounds, both sides' relative error against a float64 LSTM (torch's, in double), the ratio; the
recurrence alone is timed too. tvmseq's input projection is the importer's (`projection.gemm.projection_for`
with 4 gates, run through the GRU benchmark's plumbing).

Kernels are built here (TVM compiler, CUDA target, no GPU needed) into one .so per (dtype, direction) group plus
the GPU test kernels (tests/test_persistent_lstm.py), and run where only TVM's runtime is:

  python3 -m tvmseq.bench.persistent_lstm --build out/plstm [--ptxas]        # here
  python3 -m tvmseq.bench.persistent_lstm --prebuilt out/plstm [--quick]     # GPU machine

--cells PATTERNS (comma list of fnmatch patterns on a config's suffix, e.g. 'float16_*_b64,float32_uni_h128_b64')
limits a build or a run to those configs. A build with --cells adds to an existing build directory: each such
config gets its own module (persistent_lstm_cell_<suffix>.so) and index entry, the other configs keep theirs, so
only what changed is rebuilt; --path (persistent_mma, persistent_wgmma, persistent or per_step) forces their recurrence path (A/B
against the automatic choice).

A worker process runs the configs; the supervisor kills it when one config runs past --config-timeout (a hung
kernel cannot be stopped in-process), records a timeout and goes on with a fresh worker.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import time
from pathlib import Path

from ..measure import PrebuiltModules, compile_for_gpu, cuda_available, time_cuda
from . import gru as gru_bench
from .common import (config_group, config_suffix, grid_configs, print_table, ratio_bar_plot, save,
                     time_against_peer)

NAME = "persistent_lstm"
HIDDEN, BATCH, SEQ = (128, 256, 512, 1024), (1, 8, 64, 256), 100
QUICK = ((256, 1), (1024, 8), (512, 64))
ROUNDS, ITERS = 3, 10   # alternating timing rounds of tvmseq and cuDNN, CUDA-event runs per round
INPUT_SIZE = 37          # of the GPU test kernels' projection-free problems (gate_i is made directly)

# GPU test kernels (tests/test_persistent_lstm.py, marked gpu): every feature on odd sizes.
# (D, B, H, dtype, direction, acts (names, 3 per direction or 3 for both), clip, has_seq_lens, input_forget,
#  has_peepholes, config dict or None)
GPU_TEST_CASES = [
    (1, 3, 37, "float32", "forward", None, None, True, 0, True, None),
    (2, 19, 100, "float32", "bidirectional", None, 0.9, True, 0, True, None),
    (1, 19, 257, "float32", "reverse", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 1, True, None),
    (2, 3, 257, "float16", "bidirectional", None, None, True, 1, False, None),
    (2, 19, 37, "float16", "bidirectional", ("Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Softsign", "Relu"), None,
     False, 0, True, None),
    (1, 67, 100, "float32", "forward", None, None, True, 0, True, None),
    (2, 19, 257, "float32", "bidirectional", None, None, True, 0, True,
     dict(num_blocks=40, num_warps=4, batch_chunk=4, smem_rows=8)),
    (1, 8, 1024, "float32", "forward", None, None, True, 0, False, None),
    (2, 1, 1024, "float16", "bidirectional", None, None, True, 0, True, None),
]


def configs(quick: bool = False):
    return grid_configs(HIDDEN, BATCH, QUICK, quick)


def _selected(c, cells) -> bool:
    """Whether config c is one of --cells (fnmatch patterns on its suffix; None: every config)."""
    return cells is None or any(fnmatch.fnmatchcase(config_suffix(c), pattern) for pattern in cells)


PERSISTENT_PATHS = ("persistent", "persistent_mma", "persistent_wgmma")   # one kernel for all steps: launch facts and residency

# GPU test kernels of the staged-state LSTM (tests/test_persistent_lstm_mma.py, marked gpu), in their own module.
# (D, B, H, dtype, direction, acts (3 names, every direction), clip, has_seq_lens, input_forget, has_peepholes,
#  MmaConfig knobs or None: the default config)
MMA_TEST_LIBRARY, MMA_TEST_INDEX = "plstm_mma_tests.so", "plstm_mma_index.json"
MMA_TEST_CASES = [
    (1, 67, 257, "float16", "forward", None, None, True, 0, True, None),
    (2, 67, 100, "float16", "bidirectional", None, 0.9, True, 1, True, None),
    (1, 19, 256, "float16", "reverse", None, None, True, 0, True, (16, 8, 16, 0, 2, 0, 0, 0, 0, 0, 16, 1, 1)),  # dsmem
    (1, 256, 1024, "float16", "forward", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 0, True, None),
    (1, 64, 1024, "float16", "reverse", None, None, True, 0, False, None),    # image, cluster 2
    (2, 64, 512, "float16", "bidirectional", None, None, True, 0, True, None),
    (1, 67, 257, "float32", "forward", None, None, True, 0, True, (8, 8, 32, 0, 2)),
    (2, 64, 256, "float32", "bidirectional", None, 0.8, True, 1, True, None),
    (1, 64, 512, "float32", "forward", None, None, True, 0, True, None),      # image, cluster 2
    (1, 19, 100, "float32", "reverse", None, 0.7, True, 1, True, None),       # lstm_cluster_config: 13-block dsmem
    (1, 11, 300, "float16", "forward", None, None, True, 0, True, None),      # the n split: 10 blocks of 32 units
    (2, 9, 500, "float16", "bidirectional", None, 0.9, True, 1, False, None),  # n split, 2 clusters of 16
    (1, 67, 37, "float16", "forward", None, None, True, 0, True, None),       # 8 units: 4 warps split 4 (n)
    (1, 9, 200, "float16", "reverse", None, 0.8, True, 1, True, None),        # 16 units: 2 k-groups x 4 warps
    (2, 19, 100, "float16", "bidirectional", None, None, True, 0, True, None),  # 13-block clusters, n split
    # gate_m (gate rows as the mma's M, 8-row chunks): dsmem with the n split, a batch split, the grid barrier
    (1, 7, 300, "float16", "forward", None, None, True, 0, True, (32, 8, 8, 0, 1, 0, 0, 0, 0, 0, 10, 1, 1, 4, 1)),
    (2, 5, 200, "float16", "bidirectional", None, 0.9, True, 1, False,
     (16, 8, 8, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1, 4, 1)),
    (1, 13, 37, "float16", "reverse", None, None, True, 0, True, (8, 4, 8, 0, 2, 0, 0, 0, 0, 0, 5, 1, 1, 1, 1)),
    (1, 6, 260, "float16", "forward", None, None, True, 0, True, (8, 4, 8, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1)),
    (1, 11, 1000, "float16", "forward", None, None, True, 1, True, (8, 8, 8, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1)),
    (1, 5, 1008, "float16", "reverse", None, 0.9, True, 0, True,              # image + multicast, two mma chains
     (8, 4, 8, 0, 1, 0, 0, 1, 1, 1, 2, 0, 0, 1, 1, 2)),
    # batch 1 on the measured database's cluster configs (hidden 128 / 256 at batch 1), at hidden sizes they pad
    (1, 1, 120, "float16", "forward", None, None, True, 0, True, (16, 4, 16, 0, 1, 0, 0, 0, 0, 0, 8, 1, 1, 4)),
    (2, 1, 250, "float16", "bidirectional", None, 0.9, True, 1, True, (16, 4, 8, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1, 2, 1)),
    # float32 chunks of fewer than 16 rows (dsmem): batch 1 (the VAD's LSTM), a ragged 8-row chunk, 4 rows
    (1, 1, 128, "float32", "forward", None, None, True, 0, False, (16, 4, 1, 0, 1, 0, 0, 0, 0, 0, 8, 1, 1)),
    (2, 1, 100, "float32", "bidirectional", None, 0.9, True, 1, True, (8, 4, 1, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1)),
    (1, 5, 128, "float32", "reverse", None, None, True, 0, True, (16, 4, 8, 0, 1, 0, 0, 0, 0, 0, 8, 1, 1)),
    (1, 3, 200, "float32", "forward", ("HardSigmoid", "Softsign", "Elu"), 1.5, True, 0, False,
     (16, 8, 4, 0, 1, 0, 0, 0, 0, 0, 13, 1, 1)),
]


def mma_test_name(case) -> str:
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, knobs = case
    return (f"plstm_mma_{direction}_{dtype}_h{H}_b{B}{'_lens' if lens else ''}{'_if' if input_forget else ''}"
            f"{'_peep' if peep else ''}{'_clip' if clip else ''}_{'_'.join(map(str, knobs or ('default',)))}")


def mma_test_func(case, target):
    """The staged-state LSTM kernel of an MMA_TEST_CASES case, named `mma_test_name(case)`."""
    from ..kernels.activations import Activation
    from ..kernels.recurrent import mma as pm
    from ..kernels.recurrent.cells import LstmCell

    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, knobs = case
    names = [Activation.make(a) for a in acts] * D if acts else None
    func = pm.persistent_mma_func(D, B, H, dtype, direction, names, clip, lens, target,
                                  pm.MmaConfig.of(knobs) if knobs else None, "lstm",
                                  LstmCell(bool(input_forget), bool(peep)))
    return func.with_attr("global_symbol", mma_test_name(case))


def build_mma_tests(out_dir, target="cuda") -> dict:
    """MMA_TEST_CASES into out_dir/MMA_TEST_LIBRARY + MMA_TEST_INDEX (cases and ptxas numbers); the report."""
    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ex, report = compile_for_gpu({mma_test_name(c): mma_test_func(c, tgt) for c in MMA_TEST_CASES}, tgt)
    ex.export_library(str(out_dir / MMA_TEST_LIBRARY))
    (out_dir / MMA_TEST_INDEX).write_text(json.dumps({"cases": MMA_TEST_CASES, "ptxas": report}, indent=1))
    print(f"built {len(MMA_TEST_CASES)} staged-state LSTM test kernels into {out_dir / MMA_TEST_LIBRARY}", flush=True)
    return report


def gpu_test_name(case) -> str:
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, cfg = case
    return (f"plstm_test_{direction}_{dtype}_h{H}_b{B}{'_lens' if lens else ''}{'_if' if input_forget else ''}"
            f"{'_peep' if peep else ''}{'_cfg' if cfg else ''}")


# ----------------------------------------------------------------------------------------------------
# Build side (needs TVM's compiler)
# ----------------------------------------------------------------------------------------------------


def _spec(c):
    from ..kernels.recurrent import lstm

    D = 2 if c["bidirectional"] else 1
    return lstm.LstmSpec(D, c["batch"], c["hidden"], c["hidden"], c["dtype"],
                         direction="bidirectional" if D == 2 else "forward")


def _per_step(spec, target):
    """The per-step kernel of kernels/recurrent/lstm.py, or None where it is not there."""
    try:
        from ..kernels.recurrent import lstm
    except ImportError:
        return None
    factory = getattr(lstm, "recurrence_func", None)
    return factory(spec, target) if factory else None


def _bench_funcs(c, target, path: str = "auto"):
    """({name: prim_func}, path, why, projection row tile) of a config: the projection and the recurrence
    (path: `paths.lstm_recurrence_auto`'s option; a forced path that cannot run falls back to auto)."""
    from ..errors import TvmseqError
    from ..kernels.projection import gemm as ip
    from ..kernels.recurrent import paths

    spec, sfx = _spec(c), config_suffix(c)
    proj, tile = ip.projection_for(spec, target, SEQ)   # what the importer emits (static seq)
    try:
        rec, path, why = paths.lstm_recurrence_auto(spec, target, path)
    except TvmseqError as err:
        rec, path, why = paths.lstm_recurrence_auto(spec, target)
        why = f"{err}; auto: {why}"
    if rec is None:
        rec = _per_step(spec, target)
        if rec is None:
            return {}, "not_run", f"{why}; no per-step LSTM kernel here", tile
    return {**gru_bench.projection_funcs(proj, tile, spec, sfx, target),
            f"rec_{sfx}": rec.with_attr("global_symbol", f"rec_{sfx}")}, path, why, tile


def _rec_launch(c, target, path: str = "persistent") -> tuple[int, int, int]:
    """(threads, dynamic shared bytes, blocks) of a config's persistent recurrence (engine or staged-state)."""
    from ..kernels.recurrent import cells, engine
    from ..kernels.recurrent import mma as pm

    D = 2 if c["bidirectional"] else 1
    if path == "persistent_wgmma":
        from ..kernels.recurrent import wgmma as pw

        cfg = pw.default_config(D, c["batch"], c["hidden"], target, "lstm")
        geo = pw.WgmmaRecGeometry(D, c["batch"], c["hidden"], cells.CELL_GATES["lstm"], cfg)
        return geo.NTB, geo.smem_bytes(), geo.BLOCKS
    if path == "persistent_mma":
        cfg = pm.default_config(D, c["batch"], c["hidden"], target, "lstm", dtype=c["dtype"])
        geo = pm.MmaGeometry(D, c["batch"], c["hidden"], cells.CELL_GATES["lstm"], cfg, c["dtype"])
        return geo.NT, geo.smem_bytes(), geo.BLOCKS
    cfg = engine.default_lstm_config(D, c["batch"], c["hidden"], c["dtype"], target)
    geo = engine._geometry(D, c["batch"], c["hidden"], cfg, True, "lstm")
    return geo.NT, 4 * geo.R_smem * geo.Hp, cfg.num_blocks * D


def gpu_test_func(case, target):
    """The persistent kernel of a GPU test case, named `gpu_test_name(case)`."""
    from ..kernels.recurrent import engine
    from ..kernels.recurrent_gemm import PersistentConfig

    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, cfg = case
    names = list(acts) * (D if acts and len(acts) == 3 else 1) if acts else None
    func = engine.persistent_lstm_func(D, B, H, dtype, direction, names, clip, lens, input_forget, peep, target,
                                       PersistentConfig(**cfg) if cfg else None)
    return func.with_attr("global_symbol", gpu_test_name(case))


def gpu_test_entry(case) -> dict:
    D, B, H, dtype, direction, acts, clip, lens, input_forget, peep, cfg = case
    return dict(file=f"{NAME}_tests.so", func=gpu_test_name(case), D=D, B=B, H=H, dtype=dtype, direction=direction,
                acts=acts, clip=clip, has_seq_lens=lens, input_forget=input_forget, has_peepholes=peep, config=cfg)


def build_for_gpu(out_dir, quick: bool = False, tests: bool = True, bench: bool = True, target: str = "cuda",
                  ptxas: bool = False, dtypes=None, cells=None, path: str = "auto") -> Path:
    """Build the benchmark's kernels (one .so per group) and the GPU test kernels + index.json with each kernel's
    path, reason, ptxas numbers and residency. A config whose persistent kernel could not be resident is rebuilt
    on the per-step path. cells (fnmatch patterns on config suffixes): only those configs, each into its own
    module, added to the directory's existing index (the others' entries and modules kept); path: their
    recurrence path option (`paths.lstm_recurrence_auto`)."""
    import tvm

    from ..targets import resolve
    from .persistent_gru import residency

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    selected = [c for c in (configs(quick) if bench else ()) if (not dtypes or c["dtype"] in dtypes)
                and _selected(c, cells)]
    rebuilt = {config_suffix(c) for c in selected}
    index_path = out_dir / "index.json"
    old = json.loads(index_path.read_text()) if index_path.exists() else {}
    if cells is None:   # a full build: every module of an earlier one goes
        stale = [f for f in out_dir.glob(f"{NAME}_*.so") if bench or f.name == f"{NAME}_tests.so"]
    else:               # only the rebuilt configs' own modules
        stale = [out_dir / f"{NAME}_cell_{sfx}.so" for sfx in rebuilt]
    for f in stale:
        f.unlink(missing_ok=True)
    kept = old.get("configs", []) if cells is not None or not bench else []
    index = {"benchmark": NAME, "tvm": tvm.__version__, "arch": str(tgt.attrs.get("arch", "")),
             "configs": [e for e in kept if e["suffix"] not in rebuilt],
             "tests": [] if tests else old.get("tests", [])}
    groups: dict[str, dict] = {}
    for c in selected:
        funcs, rec_path, why, tile = _bench_funcs(c, tgt, path)
        group = config_group(c) if cells is None else f"cell_{config_suffix(c)}"
        entry = dict(c, file=f"{NAME}_{group}.so", suffix=config_suffix(c), path=rec_path, reason=why, proj_rows=tile)
        if funcs:
            groups.setdefault(group, {}).update(funcs)
        if rec_path in PERSISTENT_PATHS:
            entry["threads"], entry["dyn_smem"], entry["blocks"] = _rec_launch(c, tgt, rec_path)
        print(f"  {entry['suffix']}: {rec_path} ({why})", flush=True)
        index["configs"].append(entry)
    if tests:
        for case in GPU_TEST_CASES:
            groups.setdefault("tests", {})[gpu_test_name(case)] = gpu_test_func(case, tgt)
            index["tests"].append(gpu_test_entry(case))
    for group, funcs in groups.items():
        t0 = time.time()
        ex, report = compile_for_gpu(funcs, tgt)
        retry = []
        for e in index["configs"] + index["tests"]:
            if e["file"] != f"{NAME}_{group}.so":
                continue
            func = e.get("func") or f"rec_{e['suffix']}"
            e["ptxas"] = {k: v for k, v in report.items() if k == f"{func}_kernel" or k.startswith(f"{func}_kernel_")}
            if e.get("path") in PERSISTENT_PATHS:
                info = report.get(f"{func}_kernel", {})
                e["residency"] = residency(info, e["threads"], e["dyn_smem"], e["blocks"])
                if info and not e["residency"]["resident"]:
                    retry.append(e)
        for e in retry:  # fall back to the per-step path for these configs
            c = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch")}
            rec = _per_step(_spec(c), tgt)
            if rec is None:
                del funcs[f"rec_{e['suffix']}"], funcs[f"proj_{e['suffix']}"]
                funcs.pop(f"split_{e['suffix']}", None)
                e.update(path="not_run", reason=e["residency"]["why"] + "; no per-step LSTM kernel here")
            else:
                funcs[f"rec_{e['suffix']}"] = rec.with_attr("global_symbol", f"rec_{e['suffix']}")
                e.update(path="per_step", reason=e["residency"]["why"])
            print(f"  {e['suffix']}: {e['reason']} -> {e['path']}", flush=True)
        if retry:
            ex, report = compile_for_gpu(funcs, tgt)
        path = out_dir / f"{NAME}_{group}.so"
        ex.export_library(str(path))
        print(f"built {group}: {len(funcs)} functions in {time.time() - t0:.1f}s ({path.stat().st_size / 1e6:.2f} MB)",
              flush=True)
        if ptxas:
            for kernel, info in sorted(report.items()):
                if not kernel.startswith("proj"):
                    print(f"  ptxas {kernel}: {info}")
    if tests:
        report = build_mma_tests(out_dir, target)
        if ptxas:
            for kernel, info in sorted(report.items()):
                print(f"  ptxas {kernel}: {info}")
    index_path.write_text(json.dumps(index, indent=1))
    total = sum(f.stat().st_size for f in out_dir.glob("*.so"))
    print(f"wrote {index_path}; {total / 1e6:.1f} MB of modules")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Run side (TVM runtime + torch)
# ----------------------------------------------------------------------------------------------------


def _torch_weights_from_onnx(W, R, Bias, H):
    """ONNX gate order i, o, f, c -> PyTorch's i, f, g, o (per direction): (w_ih, w_hh, b_ih, b_hh)."""
    import torch

    perm = torch.cat([torch.arange(0, H), torch.arange(2 * H, 3 * H), torch.arange(3 * H, 4 * H),
                      torch.arange(H, 2 * H)])
    return W[:, perm], R[:, perm], Bias[:, :4 * H][:, perm], Bias[:, 4 * H:][:, perm]


def _time_host(fn, warmup: int = 1, iters: int = 3) -> float:
    """Median milliseconds of fn() by the host clock (the CPU smoke run of `run_one`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_one(c, proj, rec, seq: int = SEQ, device: str = "cuda") -> dict:
    """One config: tvmseq (projection + recurrence) vs torch.nn.LSTM, both timed, both checked against a float64
    LSTM; the recurrence alone is timed too. device 'cpu': the same on llvm modules and torch's CPU LSTM, timed
    by the host clock (a smoke run of this function: weight order, layouts, error and timing plumbing)."""
    import torch
    import tvm

    from . import gru as gru_bench

    H, Bt, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    tdt, dev = getattr(torch, c["dtype"]), device
    timer, sync = (time_cuda, torch.cuda.synchronize) if dev == "cuda" else (_time_host, lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    k = H ** -0.5
    u = lambda *s: (torch.rand(*s, device=dev, generator=g) * 2 - 1) * k  # noqa: E731
    W, R, Bias = u(D, 4 * H, H), u(D, 4 * H, H), u(D, 8 * H)
    X = torch.randn(seq, Bt, H, device=dev, generator=g)
    h0 = torch.randn(D, Bt, H, device=dev, generator=g) * 0.5
    c0 = torch.randn(D, Bt, H, device=dev, generator=g) * 0.5

    bias_i = (Bias[:, :4 * H] + Bias[:, 4 * H:]).contiguous()   # every LSTM bias folds into the projection
    P = torch.zeros(D, 3 * H, device=dev)                       # torch.nn.LSTM has no peepholes
    lens = torch.full((Bt,), seq, dtype=torch.int32, device=dev)
    gate_i = torch.empty(D, seq, Bt, 4 * H, device=dev)
    Y = torch.empty(seq, D, Bt, H, device=dev, dtype=tdt)
    Y_h, Y_c = (torch.empty(D, Bt, H, device=dev, dtype=tdt) for _ in range(2))
    Xc, Wc, Rc = X.to(tdt).contiguous(), W.to(tdt).contiguous(), R.to(tdt).contiguous()
    tv = [tvm.runtime.from_dlpack(t) for t in (Xc, Wc, bias_i, gate_i, Rc, P, lens, h0.contiguous(),
                                               c0.contiguous(), Y, Y_h, Y_c)]
    project = gru_bench._projection(proj, c.get("proj_rows"), tv, Xc, gate_i, bias_i, seq, Bt, D, H)

    def recurrence():
        rec(*tv[3:])

    def tvmseq_run():
        project()
        recurrence()

    lstm = torch.nn.LSTM(H, H, bidirectional=D == 2).to(dev).to(tdt)
    w_ih, w_hh, b_ih, b_hh = _torch_weights_from_onnx(W, R, Bias, H)
    with torch.no_grad():
        for d in range(D):
            sfx = "_reverse" if d else ""
            for name, value in (("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih), ("bias_hh", b_hh)):
                getattr(lstm, f"{name}_l0{sfx}").copy_(value[d])
    Xt, h0t, c0t = X.to(tdt), h0.to(tdt), c0.to(tdt)

    def peer_run():
        with torch.no_grad():
            return lstm(Xt, (h0t, c0t))

    for _ in range(2):   # one at a time first: a hang shows up here, attributed to this config
        tvmseq_run()
        sync()
    peer_y, _ = peer_run()
    lstm64 = torch.nn.LSTM(H, H, bidirectional=D == 2).to(dev).double()
    lstm64.load_state_dict({k_: v.double() for k_, v in lstm.state_dict().items()})
    with torch.no_grad():
        ref_y, (ref_h, ref_c) = lstm64(Xt.double(), (h0t.double(), c0t.double()))
    ours_y = Y.permute(0, 2, 1, 3).reshape(seq, Bt, D * H).double()
    err = lambda a, b: float(((a - b).norm() / b.norm()).item())  # noqa: E731
    row = dict(c, seq=seq, err_tvmseq=err(ours_y, ref_y), err_peer=err(peer_y.double(), ref_y),
               err_tvmseq_h=err(Y_h.double(), ref_h), err_tvmseq_c=err(Y_c.double(), ref_c),
               peer_tf32=bool(torch.backends.cudnn.allow_tf32) and c["dtype"] == "float32")
    row.update(time_against_peer(tvmseq_run, peer_run, seq, ROUNDS, ITERS, timer))
    row["recurrence_us_step"] = timer(recurrence, warmup=2, iters=ITERS) * 1e3 / seq
    row["speedup"] = row["cudnn_us_step"] / row["tvmseq_us_step"]
    tol = 2e-2 if c["dtype"] == "float16" else 1e-3
    row["agree"] = max(row["err_tvmseq"], row["err_tvmseq_h"], row["err_tvmseq_c"]) < tol
    return row


COLS = ["dtype", "bidirectional", "hidden", "batch", "path", "tvmseq_us_step", "recurrence_us_step",
        "cudnn_us_step", "speedup", "err_tvmseq", "err_peer", "agree", "status"]


def _read_rows(rows_file: Path) -> list[dict]:
    if not rows_file.exists():
        return []
    return [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]


def _append(rows_file: Path, row: dict) -> None:
    with rows_file.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _save_rows(rows, out, final=False):
    meta = {"peer": "torch.nn.LSTM (cuDNN, TF32 off)", "seq": SEQ,
            "note": "tvmseq time = TVM input projection + recurrence (persistent engine or per-step kernel)"}
    timed = [r for r in rows if r.get("speedup")]
    plot = (ratio_bar_plot(timed, ["dtype", "bidirectional", "hidden", "batch"], "speedup",
                           "tvmseq LSTM vs cuDNN: speedup per config (seq 100)") if final and timed else None)
    save(NAME, rows, meta, plot, out)


def _worker(index, root, suffixes, rows_file: Path, progress: Path, out):
    """Run the configs `suffixes` in order; one JSON line per finished config in rows_file."""
    import torch

    from .persistent_gru import residency

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    mods = PrebuiltModules(root)
    by_suffix = {e["suffix"]: e for e in index["configs"]}
    for sfx in suffixes:
        e = by_suffix[sfx]
        c = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch")}
        row = dict(c, seq=SEQ, path=e["path"], reason=e.get("reason"))
        progress.write_text(f"{sfx} {time.time()}\n")
        rec_info = e.get("ptxas", {}).get(f"rec_{sfx}_kernel")
        res = residency(rec_info, e["threads"], e["dyn_smem"], e["blocks"], num_sms) \
            if e["path"] in PERSISTENT_PATHS and rec_info else None
        if e["path"] == "not_run":
            row.update(status="not run")
        elif res is not None and not res["resident"]:
            row.update(status="skipped", reason=res["why"])
        else:
            try:
                mod = mods.get(e["file"])
                progress.write_text(f"{sfx} {time.time()}\n")  # the clock starts after the load
                c["proj_rows"] = e.get("proj_rows")
                row = run_one(c, gru_bench.projection_of(mod, sfx, c["proj_rows"]), mod[f"rec_{sfx}"])
                row.pop("proj_rows", None)
                row.update(path=e["path"], reason=e.get("reason"), status="ok" if row["agree"] else "WRONG")
            except Exception as err:  # noqa: BLE001 - a launch error must not stop the other configs
                row.update(status="error", reason=f"{type(err).__name__}: {err}"[:400])
                print(f"{sfx}: {row['reason']}", flush=True)
                if "CUDA" in str(err) or "cuda" in str(err):
                    _append(rows_file, row)
                    os._exit(4)  # the context may be unusable: the supervisor starts a fresh worker
        _append(rows_file, row)
        print_table([row], [k for k in COLS if k in row])
        _save_rows(_read_rows(rows_file), out)


def _supervise(index, root, args) -> list[dict]:
    import signal
    import subprocess
    import sys
    import tempfile

    cells = args.cells.split(",") if args.cells else None
    wanted_keys = {config_suffix(c) for c in configs(args.quick) if _selected(c, cells)}
    wanted = [e["suffix"] for e in index["configs"] if e["suffix"] in wanted_keys
              and (not args.dtype or e["dtype"] in args.dtype.split(","))
              and (args.bidirectional is None or e["bidirectional"] == (args.bidirectional == "bi"))]
    work = Path(tempfile.mkdtemp(prefix="plstm_bench_"))
    rows_file, progress = work / "rows.jsonl", work / "progress"
    t_start = time.time()
    by_suffix = {e["suffix"]: e for e in index["configs"]}
    for _ in range(len(wanted) + 3):  # each round finishes or records at least one config
        todo = [s for s in wanted if s not in {config_suffix(r) for r in _read_rows(rows_file)}]
        if not todo or time.time() - t_start > args.budget:
            if todo:
                print(f"budget of {args.budget}s spent: not run: {todo}", flush=True)
            break
        progress.write_text(f"{todo[0]} {time.time()}\n")
        cmd = [sys.executable, "-m", "tvmseq.bench.persistent_lstm", "--prebuilt", str(root), "--worker",
               ",".join(todo), "--rows", str(rows_file), "--progress", str(progress)]
        if args.out:
            cmd += ["--out", str(args.out)]
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
            first = first and sfx == todo[0]
            limit = args.config_timeout + (args.load_timeout if first else 0)
            if time.time() - float(since) > limit or time.time() - t_start > args.budget + 60:
                print(f"\nTIMEOUT: {sfx} ran over {limit:.0f}s: killing the worker, going on", flush=True)
                os.killpg(proc.pid, 9)
                proc.wait()
                e = by_suffix[sfx]
                _append(rows_file, dict({k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch", "path")},
                                        seq=SEQ, status="timeout", reason=f"no result within {limit:.0f}s"))
                break
        else:
            if proc.returncode not in (0, 4):
                sfx = progress.read_text().split()[0]
                if sfx not in {config_suffix(r) for r in _read_rows(rows_file)}:
                    e = by_suffix[sfx]
                    _append(rows_file, dict({k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch", "path")},
                                            seq=SEQ, status="crash", reason=f"worker exit code {proc.returncode}"))
    rows = _read_rows(rows_file)
    print()
    print_table(rows, [k for k in COLS if any(k in r for r in rows)])
    _save_rows(rows, args.out, final=True)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"only (hidden, batch) in {QUICK}")
    parser.add_argument("--prebuilt", metavar="DIR", help="kernels from --build (index.json + .so)")
    parser.add_argument("--build", metavar="DIR", help="build the kernels into DIR and exit (needs the compiler)")
    parser.add_argument("--ptxas", action="store_true", help="with --build: print ptxas registers/spills")
    parser.add_argument("--no-tests", action="store_true", help="with --build: leave out the GPU test kernels")
    parser.add_argument("--dtype", default=None, help="comma list, e.g. float32")
    parser.add_argument("--cells", default=None,
                        help="comma list of fnmatch patterns on config suffixes (e.g. 'float16_*_b64'): build (each "
                             "into its own module, added to DIR's index) or run only those")
    parser.add_argument("--path", default="auto", choices=("auto", "persistent_mma", "persistent_wgmma", "persistent", "per_step"),
                        help="with --build: the recurrence path of the configs built (default: the automatic choice)")
    parser.add_argument("--bidirectional", choices=("uni", "bi"), default=None, help="only one direction kind")
    parser.add_argument("--config-timeout", type=float, default=30.0,
                        help="seconds one config may take before its worker is killed (default 30)")
    parser.add_argument("--load-timeout", type=float, default=60.0,
                        help="extra seconds for a worker's start (imports, module loads; default 60)")
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting configs after this many seconds")
    parser.add_argument("--out", default=None, help="directory for the JSON + plot (default artifacts/bench)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: config suffixes
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)


def run(args) -> list[dict]:
    if args.build:
        build_for_gpu(args.build, quick=args.quick, tests=not args.no_tests, ptxas=args.ptxas,
                      dtypes=args.dtype.split(",") if args.dtype else None,
                      cells=args.cells.split(",") if args.cells else None, path=args.path)
        return []
    if not cuda_available():
        print("no CUDA GPU: build with --build DIR here, run with --prebuilt DIR on a GPU machine")
        return []
    root = Path(args.prebuilt) if args.prebuilt else None
    if root is None:
        import tempfile

        root = build_for_gpu(tempfile.mkdtemp(prefix="plstm_"), quick=args.quick, tests=False)
    index = json.loads((root / "index.json").read_text())
    if args.worker:
        _worker(index, root, args.worker.split(","), Path(args.rows), Path(args.progress), args.out)
        return []
    return _supervise(index, root, args)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
