"""`tvmseq bench gru`: tvmseq's GRU kernels against torch.nn.GRU (cuDNN) in the same process.

Grid: hidden {256, 512, 1024} x batch {1, 8, 64, 256} x seq 100, unidirectional and bidirectional,
fp32 and fp16, linear_before_reset=1 (PyTorch's GRU). Both run on the same inputs; outputs are compared
with each other and with a float64 GRU, and the TF32 setting of the peer is recorded. Batch >= 16 runs
the tiled step GEMM (kernels/recurrent/step_gemm.py), smaller batches the warp-per-row one.

Kernels are built where TVM's compiler is (no GPU needed), with sm_90a SASS embedded, into one .so per
(dtype, direction) group, plus a tile sweep (the step-GEMM tiles the cost model ranks next for a few
large-batch configs: the recurrence alone is timed for each) and the GPU test kernels
(tests/test_gpu_gru.py), and run where only TVM's runtime is:

  python3 -m tvmseq.bench.gru --build out/gru [--ptxas]     # here
  python3 -m tvmseq.bench.gru --prebuilt out/gru [--quick] [--dtype float32] [--bidirectional uni]  # GPU
"""
from __future__ import annotations

import itertools
import json
import time
from pathlib import Path


from ..measure import PrebuiltModules, compile_for_gpu, time_cuda
from .common import print_table, ratio_bar_plot, save, time_against_peer

NAME = "gru"
# alternating timing rounds of tvmseq and the peer a config (medians reported)
ROUNDS = 3
HIDDEN, BATCH, SEQ = (256, 512, 1024), (1, 8, 64, 256), 100
QUICK_HIDDEN, QUICK_BATCH = (256, 1024), (1, 64)
# tile sweep: these fp32 configs (hidden, batch, bidirectional), each with the SWEEP_TILES best tiles of the cost
# model (batch 8 runs the warp kernel in the grid: its sweep rows say whether TILED_MIN_BATCH should come down;
# the bidirectional ones are the grid cells where the per-step path runs both directions in one step GEMM)
SWEEP_CONFIGS = ((512, 8, False), (1024, 8, False), (512, 64, False), (512, 256, False), (1024, 64, False),
                 (1024, 256, False), (256, 256, False), (256, 256, True), (512, 256, True), (1024, 64, True),
                 (1024, 256, True))
SWEEP_TILES = 5
# more tiles (each shape with each K split) where a #5 target is close: fp32 bi H1024 B64 (1.39-1.41x cuDNN; 1.5x
# needs ~5% off the step)
SWEEP_TILES_AT = {(1024, 64, True): 16}
# GPU test kernels (tests/test_gpu_gru.py, marked gpu): (D, B, H, dtype, lbr, direction), all with
# sequence_lens; batch >= 16 runs the tiled step GEMM (odd sizes: edge tiles, K % 4 != 0, split-K)
GPU_TEST_CASES = [
    (1, 17, 37, "float32", 0, "forward"),
    (2, 17, 37, "float16", 1, "bidirectional"),
    (1, 33, 100, "float32", 1, "reverse"),
    (2, 33, 100, "float16", 0, "bidirectional"),
    (2, 65, 333, "float32", 1, "bidirectional"),
    (1, 65, 333, "float16", 0, "reverse"),
    (2, 256, 512, "float32", 0, "bidirectional"),
    (1, 18, 102, "float32", 0, "forward"),      # 2H % 4 == 0 but 3H % 4 != 0: scalar stores of gh
    (1, 5, 64, "float32", 1, "forward"),        # the warp-per-row GEMM
]
# RNN (same step GEMM, one gate): (D, B, H, dtype, direction), with sequence_lens
GPU_RNN_TEST_CASES = [(2, 33, 100, "float32", "bidirectional"), (1, 20, 37, "float16", "forward")]


def configs(quick: bool = False):
    hs, bs = (QUICK_HIDDEN, QUICK_BATCH) if quick else (HIDDEN, BATCH)
    for dtype, bidir, hidden, batch in itertools.product(("float32", "float16"), (False, True), hs, bs):
        yield {"dtype": dtype, "bidirectional": bidir, "hidden": hidden, "batch": batch}


def _name(c) -> str:
    return f"gru_{c['dtype']}_{'bi' if c['bidirectional'] else 'uni'}_h{c['hidden']}_b{c['batch']}"


def _suffix(c) -> str:
    return _name(c).removeprefix("gru_")


def _group(c) -> str:
    return f"{c['dtype']}_{'bi' if c['bidirectional'] else 'uni'}"


def _spec(c):
    from ..kernels.recurrent import gru

    D = 2 if c["bidirectional"] else 1
    return gru.GruSpec(D, c["batch"], c["hidden"], c["hidden"], c["dtype"], linear_before_reset=1,
                       direction="bidirectional" if D == 2 else "forward")


def _test_name(case) -> str:
    D, B, H, dtype, lbr, direction = case
    return f"test_{direction}_{dtype}_h{H}_b{B}_lbr{lbr}"


TEST_INPUT_SIZE = 19


def _test_spec(case):
    from ..kernels.recurrent import gru

    D, B, H, dtype, lbr, direction = case
    return gru.GruSpec(D, B, H, TEST_INPUT_SIZE, dtype, lbr, direction, has_seq_lens=True)


def _tile_key(tile) -> str:
    return f"t{tile.bm}x{tile.bn}x{tile.bk}_{tile.tm}x{tile.tn}_s{tile.split_k}"


def step_gemm_info(spec, target) -> dict:
    """Which step GEMM a spec's recurrence runs, its tile and the cost model's estimate (lbr=1: one GEMM)."""
    from ..kernels.recurrent import gru, step_gemm

    sched = gru.StepSchedule.for_batch(spec.batch)
    if not sched.use_tiled(True, spec.batch):
        return {"step_gemm": "warp", "gemm_batch_tile": sched.gemm_batch_tile}
    H, D = spec.hidden, spec.num_directions
    rows = 3 * H if spec.linear_before_reset else 2 * H
    tile = step_gemm.normalized(step_gemm.choose_tile(spec.batch, rows, H, D, spec.dtype, target), H)
    est = step_gemm.estimate_cycles(tile, spec.batch, rows, H, D, 2 if spec.dtype == "float16" else 4)
    return {"step_gemm": "tiled", "tile": _tile_json(tile), "model_us": round(est / 1750, 2)}


def _tile_json(tile) -> dict:
    from dataclasses import asdict

    return dict(asdict(tile), threads=tile.threads)


def sweep_tiles(c, target, count: int = SWEEP_TILES, by_split: bool = False, gates: int = 3):
    """The cost model's `count` best tile shapes for a config's step GEMM [B, H] x [H, gates x H] (the best bk and
    split of each; with by_split, of each shape and split), cheapest first: what the sweep measures to check the
    model's ranking (gates 3: the GRU; schedules/plstm_sweep.py asks for the LSTM's 4)."""
    from ..kernels.recurrent import step_gemm as sg

    H, B, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    r_bytes = 2 if c["dtype"] == "float16" else 4
    best = {}
    for bm, bn, tm, tn in sg.TILE_SHAPES:
        for bk in sg.BK_CHOICES:
            for split in sg.SPLITS:
                tile = sg.normalized(sg.GemmTile(bm, bn, bk, tm, tn, split), H)
                cost = sg.estimate_cycles(tile, B, gates * H, H, D, r_bytes)
                key = (bm, bn, tm, tn, tile.split_k if by_split else 0)
                if cost < best.get(key, (float("inf"), None))[0]:
                    best[key] = (cost, tile)
    return [(tile, cost) for cost, tile in sorted(best.values(), key=lambda v: v[0])[:count]]


def _bench_funcs(c, target) -> dict:
    from ..kernels.recurrent import gru

    spec, sfx = _spec(c), _suffix(c)
    proj = gru.schedule_input_projection(gru.input_projection_func(spec), target)["main"]
    return {f"proj_{sfx}": proj.with_attr("global_symbol", f"proj_{sfx}"),
            f"rec_{sfx}": gru.recurrence_func(spec, target).with_attr("global_symbol", f"rec_{sfx}")}


def build_module(c, target):
    """One module holding both kernels of the config (input projection + recurrence)."""
    import tvm

    from ..kernels.recurrent import gru

    spec = _spec(c)
    proj = gru.schedule_input_projection(gru.input_projection_func(spec), target)["main"]
    mod = tvm.IRModule({"gru_input_projection": proj, "gru_recurrence": gru.recurrence_func(spec, target)})
    return tvm.compile(mod, target=target)



def _kernels_of(report: dict, func: str) -> dict:
    return {k: v for k, v in report.items() if k == f"{func}_kernel" or k.startswith(f"{func}_kernel_")}


def build_for_gpu(out_dir, quick: bool = False, sweep: bool = True, tests: bool = True, target: str = "cuda",
                  ptxas: bool = False) -> Path:
    """Build the benchmark's kernels (+ the tile sweep and the GPU test kernels) for CUDA here: one .so per
    group, index.json with each config's file, step GEMM, tile and ptxas numbers of its recurrence."""
    import tvm

    from ..kernels.recurrent import gru
    from ..targets import resolve

    tgt = resolve(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = sorted(out_dir.glob(f"{NAME}_*.so")) + sorted(out_dir.glob("*index.json"))
    for f in stale:   # an earlier build's modules (the old layout had one .so per config)
        f.unlink()
    if stale:
        print(f"removed {len(stale)} files of an earlier build from {out_dir}")
    groups: dict[str, dict] = {}
    index = {"benchmark": NAME, "tvm": tvm.__version__, "arch": str(tgt.attrs.get("arch", "")),
             "configs": [], "sweep": [], "tests": []}
    for c in configs(quick):
        groups.setdefault(_group(c), {}).update(_bench_funcs(c, tgt))
        index["configs"].append(dict(c, file=f"{NAME}_{_group(c)}.so", suffix=_suffix(c),
                                     **step_gemm_info(_spec(c), tgt)))
    if sweep:
        for hidden, batch, bidirectional in SWEEP_CONFIGS:
            c = {"dtype": "float32", "bidirectional": bidirectional, "hidden": hidden, "batch": batch}
            more = SWEEP_TILES_AT.get((hidden, batch, bidirectional))
            for rank, (tile, cost) in enumerate(sweep_tiles(c, tgt, more or SWEEP_TILES, by_split=bool(more))):
                func = f"rec_{_suffix(c)}_{_tile_key(tile)}"
                sched = gru.StepSchedule(tiled=True, tile=tile)
                groups.setdefault("sweep", {})[func] = gru.recurrence_func(_spec(c), tgt, sched).with_attr(
                    "global_symbol", func)
                index["sweep"].append(dict(c, file=f"{NAME}_sweep.so", func=func, suffix=_suffix(c), rank=rank,
                                           tile=_tile_json(tile), model_us=round(cost / 1750, 2)))
    if tests:
        for case in GPU_TEST_CASES:
            spec, name = _test_spec(case), _test_name(case)
            proj = gru.schedule_input_projection(gru.input_projection_func(spec), tgt)["main"]
            groups.setdefault("tests", {}).update({
                f"proj_{name}": proj.with_attr("global_symbol", f"proj_{name}"),
                f"rec_{name}": gru.recurrence_func(spec, tgt).with_attr("global_symbol", f"rec_{name}")})
            D, B, H, dtype, lbr, direction = case
            index["tests"].append(dict(file=f"{NAME}_tests.so", name=name, op="GRU", D=D, B=B, H=H, dtype=dtype,
                                       lbr=lbr, direction=direction, input_size=TEST_INPUT_SIZE,
                                       proj=f"proj_{name}", rec=f"rec_{name}", **step_gemm_info(spec, tgt)))
        from ..kernels.recurrent import rnn

        for D, B, H, dtype, direction in GPU_RNN_TEST_CASES:
            spec = rnn.RnnSpec(D, B, H, TEST_INPUT_SIZE, dtype, direction, has_seq_lens=True)
            name = f"test_rnn_{direction}_{dtype}_h{H}_b{B}"
            proj = gru.schedule_input_projection(gru.input_projection_func(spec), tgt)["main"]
            groups["tests"].update({
                f"proj_{name}": proj.with_attr("global_symbol", f"proj_{name}"),
                f"rec_{name}": rnn.recurrence_func(spec, tgt).with_attr("global_symbol", f"rec_{name}")})
            index["tests"].append(dict(file=f"{NAME}_tests.so", name=name, op="RNN", D=D, B=B, H=H, dtype=dtype,
                                       direction=direction, input_size=TEST_INPUT_SIZE,
                                       proj=f"proj_{name}", rec=f"rec_{name}"))
    spills = []
    for group, funcs in groups.items():
        t0 = time.time()
        ex, report = compile_for_gpu(funcs, tgt)
        path = out_dir / f"{NAME}_{group}.so"
        ex.export_library(str(path))
        entries = [e for e in index["configs"] + index["sweep"] + index["tests"] if e["file"] == path.name]
        for e in entries:
            func = e.get("func") or (f"rec_{e['name']}" if "name" in e else f"rec_{e['suffix']}")
            e["ptxas"] = _kernels_of(report, func)
        spills += [k for k, v in report.items() if v.get("spill_stores") or v.get("spill_loads")]
        print(f"built {group}: {len(funcs)} functions in {time.time() - t0:.1f}s "
              f"({path.stat().st_size / 1e6:.2f} MB)", flush=True)
        if ptxas:
            for kernel, info in sorted(report.items()):
                if not kernel.startswith("proj"):
                    print(f"  ptxas {kernel}: {info}")
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    total = sum(f.stat().st_size for f in out_dir.glob("*.so"))
    print(f"wrote {out_dir / 'index.json'}; {total / 1e6:.1f} MB of modules")
    if spills:
        print(f"WARNING: ptxas spills in {spills}")
    return out_dir


class _Renamed:
    """A config's two functions in a group module, under the names run_one calls."""

    def __init__(self, proj_mod, proj, rec_mod, rec):
        self.funcs = {"gru_input_projection": (proj_mod, proj), "gru_recurrence": (rec_mod, rec)}

    def __getitem__(self, name):
        mod, func = self.funcs[name]
        return mod[func]


def _load(c, prebuilt):
    import tvm

    if prebuilt:
        root = Path(prebuilt)
        if (root / "index.json").exists():
            mods = _MODULES.setdefault(str(root), PrebuiltModules(root))
            mod = mods.get(f"{NAME}_{_group(c)}.so")
            return _Renamed(mod, f"proj_{_suffix(c)}", mod, f"rec_{_suffix(c)}")
        return tvm.runtime.load_module(str(root / f"{_name(c)}.so"))  # an old per-config build
    from .. import targets

    return build_module(c, targets.resolve("cuda"))


_MODULES: dict[str, PrebuiltModules] = {}


def _torch_weights_from_onnx(W, R, B, H):
    """ONNX gate order z, r, h -> PyTorch's r, z, n (per direction)."""
    import torch

    perm = torch.cat([torch.arange(H, 2 * H), torch.arange(0, H), torch.arange(2 * H, 3 * H)])
    return W[:, perm], R[:, perm], B[:, :3 * H][:, perm], B[:, 3 * H:][:, perm]


def projection_funcs(proj, tile, spec, sfx: str, target) -> dict:
    """A benchmark module's projection functions: proj_<sfx>, and for the tf32x3 projection (tile TF32X3) the
    split pass the importer runs before it, split_<sfx>."""
    from ..kernels.projection import gemm as ip
    from ..kernels.projection import tf32x3

    funcs = {f"proj_{sfx}": proj.with_attr("global_symbol", f"proj_{sfx}")}
    if tile == ip.TF32X3:
        split = tf32x3.scheduled_split_func(spec.input_size, ip.tf32x3_k(spec.input_size), target)
        funcs[f"split_{sfx}"] = split.with_attr("global_symbol", f"split_{sfx}")
    return funcs


def projection_of(mod, sfx: str, tile):
    """What `_projection` takes as proj: the module's proj_<sfx>, or (split_<sfx>, proj_<sfx>) for tf32x3."""
    from ..kernels.projection.gemm import TF32X3

    return (mod[f"split_{sfx}"], mod[f"proj_{sfx}"]) if tile == TF32X3 else mod[f"proj_{sfx}"]


def split_projection(split_proj, X_rows, W, bias, out):
    """The tf32x3 projection as the importer runs it, as a call: X_rows [rows, I] split by the kernel every call,
    W [D, G, I] (torch) zero-padded to whole tiles and split once here; bias [D, G] and out [D, rows, G] torch or
    tvm tensors. split_proj: (split, projection), `projection_of`."""
    import torch
    import tvm

    from ..kernels.projection.gemm import tf32x3_k, tf32x3_n

    split, proj = split_proj
    (D, G, I), rows = W.shape, X_rows.shape[0]
    Kp, Np = tf32x3_k(I), tf32x3_n(G)
    padded = torch.zeros(D, Np, I, device=X_rows.device)
    padded[:, :G] = W
    xs, ws = (torch.empty(2, n, Kp, device=X_rows.device) for n in (rows, D * Np))
    split(tvm.runtime.from_dlpack(padded.view(D * Np, I)), tvm.runtime.from_dlpack(ws))
    args = [t if isinstance(t, tvm.runtime.Tensor) else tvm.runtime.from_dlpack(t)
            for t in (X_rows, xs, ws.view(2, D, Np, Kp), bias, out)]

    def run():
        split(args[0], args[1])
        proj(*args[1:])
    return run


def _projection(proj, tile, tv, X, gate_i, bias_i, seq, B, D, H):
    """The input projection as the importer runs it: on the batch layout, on the flat seq * B rows (tile
    FLAT), or (`tile` rows per tile) X's seq * B rows copied into whole tiles, projected as a [tiles, tile]
    batch and the valid rows copied back (the importer's pad_rows kernel and strided_slice; one direction:
    tv[3], the recurrence's gate_i, becomes a view of them, the importer's memory.view)."""
    import torch
    import tvm

    from ..kernels.projection.gemm import FLAT, TF32X3

    if tile == TF32X3:   # proj: (split, projection), `projection_of`
        rows, G = seq * B, gate_i.shape[-1]
        return split_projection(proj, X.reshape(rows, -1), torch.from_dlpack(tv[1]).float(), tv[2],
                                gate_i.view(D, rows, G))
    if not tile:
        return lambda: proj(tv[0], tv[1], tv[2], tv[3])
    rows, G = seq * B, gate_i.shape[-1]
    if tile == FLAT:   # the tensor-core projection on X viewed as [seq * B, I] (the importer's reshape)
        flat = [tvm.runtime.from_dlpack(t) for t in (X.view(rows, -1), gate_i.view(D, rows, G))]
        return lambda: proj(flat[0], tv[1], tv[2], flat[1])
    tiles = -(-rows // tile)
    x_tiles = torch.zeros(tiles * tile, X.shape[-1], device=X.device, dtype=X.dtype)
    g_tiles = gate_i.new_empty(D, tiles * tile, G)
    if D == 1:   # the recurrence reads a view of the tiles' first rows, as in the importer (no copy back)
        tv[3] = tvm.runtime.from_dlpack(g_tiles[:, :rows].view(gate_i.shape))
    args = [tvm.runtime.from_dlpack(t) for t in (x_tiles.view(tiles, tile, -1), g_tiles.view(D, tiles, tile, G))]

    def run():
        x_tiles[:rows].copy_(X.view(rows, -1))
        proj(args[0], tv[1], tv[2], args[1])
        if D > 1:
            gate_i.view(D, rows, G).copy_(g_tiles[:, :rows])
    return run


def run_one(c, prebuilt=None, seq: int = SEQ, module=None) -> dict:
    """One config: tvmseq (input projection + recurrence; `module` or `_load`) vs torch.nn.GRU, both timed,
    both checked against a float64 GRU; the recurrence alone is timed too."""
    import torch
    import tvm

    H, Bt, D = c["hidden"], c["batch"], 2 if c["bidirectional"] else 1
    tdt = getattr(torch, c["dtype"])
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    k = H ** -0.5
    u = lambda *s: (torch.rand(*s, device=dev, generator=g) * 2 - 1) * k  # noqa: E731
    W, R, Bias = u(D, 3 * H, H), u(D, 3 * H, H), u(D, 6 * H)
    X = torch.randn(seq, Bt, H, device=dev, generator=g)
    h0 = torch.randn(D, Bt, H, device=dev, generator=g) * 0.5

    # tvmseq: biases folded as the importer does (linear_before_reset=1: Rb_h stays in the recurrence)
    bias_i = (Bias[:, :3 * H] + torch.cat([Bias[:, 3 * H:5 * H], torch.zeros(D, H, device=dev)], 1)).contiguous()
    rb_h = Bias[:, 5 * H:].contiguous()
    lens = torch.full((Bt,), seq, dtype=torch.int32, device=dev)
    gate_i = torch.empty(D, seq, Bt, 3 * H, device=dev)
    Y = torch.empty(seq, D, Bt, H, device=dev, dtype=tdt)
    Y_h = torch.empty(D, Bt, H, device=dev, dtype=tdt)
    Xc, Wc, Rc = X.to(tdt).contiguous(), W.to(tdt).contiguous(), R.to(tdt).contiguous()
    tv = [tvm.runtime.from_dlpack(t) for t in (Xc, Wc, bias_i, gate_i, Rc, rb_h, lens, h0.contiguous(), Y, Y_h)]
    mod = module if module is not None else _load(c, prebuilt)
    proj, rec = mod["gru_input_projection"], mod["gru_recurrence"]

    project = _projection(proj, c.get("proj_rows"), tv, Xc, gate_i, bias_i, seq, Bt, D, H)

    def tvmseq_run():
        project()
        rec(tv[3], tv[4], tv[5], tv[6], tv[7], tv[8], tv[9])

    # peer: torch.nn.GRU (cuDNN), same weights
    gru = torch.nn.GRU(H, H, bidirectional=D == 2).to(dev).to(tdt)
    w_ih, w_hh, b_ih, b_hh = _torch_weights_from_onnx(W, R, Bias, H)
    with torch.no_grad():
        for d in range(D):
            sfx = "_reverse" if d else ""
            getattr(gru, f"weight_ih_l0{sfx}").copy_(w_ih[d])
            getattr(gru, f"weight_hh_l0{sfx}").copy_(w_hh[d])
            getattr(gru, f"bias_ih_l0{sfx}").copy_(b_ih[d])
            getattr(gru, f"bias_hh_l0{sfx}").copy_(b_hh[d])
    Xt, h0t = X.to(tdt), h0.to(tdt)

    def peer_run():
        with torch.no_grad():
            return gru(Xt, h0t)

    tvmseq_run()
    torch.cuda.synchronize()
    peer_y, peer_h = peer_run()
    # float64 truth (torch's GRU in double on the GPU)
    gru64 = torch.nn.GRU(H, H, bidirectional=D == 2).to(dev).double()
    gru64.load_state_dict({k_: v.double() for k_, v in gru.state_dict().items()})
    with torch.no_grad():
        ref_y, ref_h = gru64(X.to(tdt).double(), h0.to(tdt).double())
    ours_y = Y.permute(0, 2, 1, 3).reshape(seq, Bt, D * H).double()
    err = lambda a, b: float(((a - b).norm() / b.norm()).item())  # noqa: E731
    row = dict(c)
    row.update(seq=seq, err_tvmseq=err(ours_y, ref_y), err_peer=err(peer_y.double(), ref_y),
               max_diff_vs_peer=float((ours_y - peer_y.double()).abs().max().item()),
               peer_tf32=bool(torch.backends.cudnn.allow_tf32) and c["dtype"] == "float32")
    row.update(time_against_peer(tvmseq_run, peer_run, seq, ROUNDS, iters=20))
    row["recurrence_us_step"] = time_cuda(lambda: rec(*tv[3:]), warmup=2, iters=10) * 1e3 / seq
    row["speedup"] = row["cudnn_us_step"] / row["tvmseq_us_step"]
    tol = 2e-2 if c["dtype"] == "float16" else 1e-3
    row["agree"] = row["err_tvmseq"] < tol
    return row


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a 16-row subset of the grid")
    parser.add_argument("--prebuilt", default=None, help="directory of modules from --build (index.json + .so)")
    parser.add_argument("--build", "--build-only", dest="build", metavar="DIR", default=None,
                        help="only build the CUDA modules into DIR (no GPU needed)")
    parser.add_argument("--ptxas", action="store_true", help="with --build: print ptxas registers/spills")
    parser.add_argument("--no-sweep", action="store_true", help="with --build: no tile sweep; when running: skip it")
    parser.add_argument("--no-tests", action="store_true", help="with --build: leave out the GPU test kernels")
    parser.add_argument("--sweep-only", action="store_true", help="with --prebuilt: only the tile sweep")
    parser.add_argument("--dtype", default=None, help="comma list, e.g. float32")
    parser.add_argument("--bidirectional", choices=("uni", "bi"), default=None, help="only one direction kind")
    parser.add_argument("--batch", default=None, help="comma list, e.g. 64,256")
    parser.add_argument("--out", default=None, help="directory for the JSON and plot (default artifacts/bench)")


def _wanted(c, args) -> bool:
    return ((not args.dtype or c["dtype"] in args.dtype.split(","))
            and (args.bidirectional is None or c["bidirectional"] == (args.bidirectional == "bi"))
            and (not args.batch or c["batch"] in {int(b) for b in args.batch.split(",")}))


def _run_sweep(root: Path, index: dict, args) -> list[dict]:
    """Every sweep tile's recurrence (with the config's own input projection), timed and checked."""
    mods = _MODULES.setdefault(str(root), PrebuiltModules(root))
    rows = []
    cols = ["bidirectional", "hidden", "batch", "rank", "tile", "model_us", "tvmseq_us_step", "recurrence_us_step",
            "cudnn_us_step", "err_tvmseq", "agree"]
    for e in index["sweep"]:
        c = {k: e[k] for k in ("dtype", "bidirectional", "hidden", "batch")}
        if not _wanted(c, args):
            continue
        main = mods.get(f"{NAME}_{_group(c)}.so")
        module = _Renamed(main, f"proj_{e['suffix']}", mods.get(e["file"]), e["func"])
        row = run_one(c, seq=SEQ, module=module)
        t = e["tile"]
        row.update(rank=e["rank"], model_us=e["model_us"], ptxas=e.get("ptxas"),
                   tile=f"{t['bm']}x{t['bn']}x{t['bk']} {t['tm']}x{t['tn']} s{t['split_k']}")
        rows.append(row)
        print_table(rows[-1:], cols)
        save("gru_sweep", rows, {"note": "step-GEMM tile sweep (fp32, lbr=1)"}, None, args.out)
    print()
    print_table(rows, cols)
    return rows


def run(args) -> list[dict]:
    if getattr(args, "build", None):
        build_for_gpu(args.build, args.quick, sweep=not args.no_sweep, tests=not args.no_tests, ptxas=args.ptxas)
        return []
    root = Path(args.prebuilt) if args.prebuilt else None
    index = json.loads((root / "index.json").read_text()) if root and (root / "index.json").exists() else None
    if getattr(args, "sweep_only", False):
        return _run_sweep(root, index, args)
    by_suffix = {e["suffix"]: e for e in index["configs"]} if index else {}
    rows = []
    cols = ["dtype", "bidirectional", "hidden", "batch", "step_gemm", "tvmseq_us_step", "recurrence_us_step",
            "cudnn_us_step", "speedup", "err_tvmseq", "err_peer", "agree"]
    meta = {"peer": "torch.nn.GRU (cuDNN)", "seq": SEQ,
            "note": "per-step path (input GEMM + per-step GEMM and gate kernels)"}
    for c in configs(args.quick):
        if not _wanted(c, args):
            continue
        row = run_one(c, args.prebuilt)
        e = by_suffix.get(_suffix(c), {})
        row.update({k: e[k] for k in ("step_gemm", "tile", "model_us", "ptxas") if k in e})
        rows.append(row)
        print_table(rows[-1:], cols)
        save("gru", rows, meta, None, args.out)  # keep what was measured if the run is cut short
    print()
    print_table(rows, cols)
    save("gru", rows, meta, ratio_bar_plot(rows, ["dtype", "bidirectional", "hidden", "batch"], "speedup",
                                           "tvmseq GRU (per-step path) vs cuDNN: speedup per config"), args.out)
    if index and index.get("sweep") and not args.no_sweep and not args.quick:
        _run_sweep(root, index, args)
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
