"""`tvmseq bench persistent_rnn`: ONNX RNN on the persistent engine (`persistent_gru_func(cell="rnn")`), or on
the staged-state kernel where the importer picks it (`persistent_mma`: fp32 batch 32-64, hidden <= 512),
against torch.nn.RNN(nonlinearity="tanh") (cuDNN), same process.

Grid: fp32, seq 100, Tanh, hidden {256, 1024} x batch {1, 8, 64}, forward and bidirectional. tvmseq time
= the RNN input projection (`gru.input_projection_func` with an RnnSpec, one gate) + the persistent
recurrence; the recurrence alone is timed too. Both sides are checked against a float64 torch RNN
(TF32 off on the peer: true fp32). Before the grid, the test kernels (odd sizes, Relu, clip, lengths,
reverse, fp16, per-direction activations) run twice each against `numpy_rnn`, the float64 reference
below; `tests/test_persistent_rnn_gpu.py` runs the same checks under pytest.

Kernels are built here (TVM compiler, CUDA target, sm_90a SASS via nvcc, no GPU needed) into one .so,
and run where only TVM's runtime (+ torch) is:

  python3 -m tvmseq.bench.persistent_rnn --build out/prnn                  # here
  python3 -m tvmseq.bench.persistent_rnn --prebuilt out/prnn --out DIR     # GPU machine
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..measure import PrebuiltModules, compile_for_gpu, cuda_available, time_cuda
from .common import config_suffix, print_table, ratio_bar_plot, save
from .gru import _kernels_of
from .persistent_gru import residency

NAME = "persistent_rnn"
HIDDEN, BATCH, SEQ = (256, 1024), (1, 8, 64), 100
TEST_SEQ, TEST_INPUT_SIZE = 23, 19
FILE = f"{NAME}.so"
# GPU test kernels, odd sizes (input size TEST_INPUT_SIZE, or I = H like the grid for the bench-sized one):
# (D, B, H, dtype, direction, activation per direction, clip, has_seq_lens)
TEST_CASES = [
    (1, 3, 37, "float32", "forward", ("Relu",), None, True),
    (2, 5, 100, "float32", "bidirectional", ("Tanh", "Tanh"), 0.9, True),
    (1, 19, 257, "float32", "reverse", ("Tanh",), None, False),
    (2, 6, 129, "float16", "bidirectional", ("Tanh", "Relu"), None, True),
    (1, 64, 1024, "float32", "forward", ("Tanh",), None, True),
]
BENCH_SIZED = {(64, 1024)}  # (B, H) of test cases whose input size is H
# the same features on tiny sizes: the llvm build of tests/test_persistent_rnn_gpu.py (CI, no GPU)
CPU_TEST_CASES = [
    (1, 3, 7, "float32", "forward", ("Relu",), None, True),
    (2, 4, 9, "float32", "bidirectional", ("Tanh", "Relu"), 0.9, True),
    (1, 2, 5, "float16", "reverse", ("Tanh",), None, False),
]
TOL = {"float32": dict(rtol=1e-3, atol=1e-4), "float16": dict(rtol=1e-2, atol=1e-2)}
AGREE = {"float32": 1e-3, "float16": 2e-2}  # relative error (norm) vs float64 for a bench row to agree


def configs():
    for bidir, hidden, batch in itertools.product((False, True), HIDDEN, BATCH):
        yield {"dtype": "float32", "bidirectional": bidir, "hidden": hidden, "batch": batch}


def _test_name(case) -> str:
    D, B, H, dtype, direction, acts, clip, lens = case
    return (f"prnn_test_{direction}_{dtype}_h{H}_b{B}_{'_'.join(a.lower() for a in acts)}"
            f"{'_clip' if clip is not None else ''}_{'lens' if lens else 'nolens'}")


# ----------------------------------------------------------------------------------------------------
# float64 reference (numpy, vectorised over the batch) and the shared check of a test kernel
# ----------------------------------------------------------------------------------------------------


def numpy_rnn(X, W, R, Bias, lens, h0, direction="forward", clip=None, acts=None):
    """ONNX RNN in float64: X [T, B, I], W [D, H, I], R [D, H, H], Bias [D, 2H] (Wb, Rb), lens [B] or None,
    h0 [D, B, H]; acts: one activation name (or Activation) per direction (default Tanh).
    Past a row's length Y = 0 and the state is kept; the reverse direction handles t = len-1-s at step s;
    Y_h is the state after the row's last valid step, 0 for a zero-length row (onnxruntime).
    Returns (Y [T, D, B, H], Y_h [D, B, H])."""
    from ..kernels.activations import Activation

    X = np.asarray(X, np.float64)
    T_, B = X.shape[:2]
    D, H = R.shape[0], R.shape[-1]
    acts = [a if isinstance(a, Activation) else Activation.make(a) for a in (acts or ["Tanh"] * D)]
    L = np.full(B, T_) if lens is None else np.clip(np.asarray(lens, np.int64), 0, T_)
    Y, Yh, rows = np.zeros((T_, D, B, H)), np.zeros((D, B, H)), np.arange(B)
    for d in range(D):
        rev = direction == "reverse" or d == 1
        Rd = np.asarray(R[d], np.float64)
        xw = X @ np.asarray(W[d], np.float64).T + np.asarray(Bias[d, :H], np.float64) + Bias[d, H:]
        h = np.asarray(h0[d], np.float64)
        for s in range(T_):
            live = s < L
            t = np.where(live, (L - 1 - s) if rev else s, 0)
            pre = xw[t, rows] + h @ Rd.T
            if clip is not None:
                pre = np.clip(pre, -clip, clip)
            h = np.where(live[:, None], acts[d].numpy(pre), h)
            Y[t[live], d, rows[live]] = h[live]
        Yh[d] = np.where((L > 0)[:, None], h, 0)
    return Y, Yh


def make_problem(D, B, H, I, seq, dtype, seed, lens_kind="random"):  # noqa: E741
    """Random ONNX RNN inputs (numpy): X, W, R in `dtype`; |W| <= 1/sqrt(I), |R| <= 1/sqrt(H) (PyTorch's
    init scale), Bias [D, 2H] f32, lens i32 (random in [0, seq], row 0 full, row 1 empty when B > 2),
    h0 f32."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((seq, B, I)).astype(dtype)
    W = rng.uniform(-1, 1, (D, H, I)).astype(np.float32) * np.float32(I ** -0.5)
    R = rng.uniform(-1, 1, (D, H, H)).astype(np.float32) * np.float32(H ** -0.5)
    Bias = (rng.uniform(-1, 1, (D, 2 * H)) * H ** -0.5).astype(np.float32)
    h0 = (rng.standard_normal((D, B, H)) * 0.5).astype(np.float32)
    if lens_kind == "full":
        lens = np.full(B, seq, np.int32)
    else:
        lens = rng.integers(0, seq + 1, B).astype(np.int32)
        lens[0] = seq
        if B > 2:
            lens[1] = 0
    return dict(X=X, W=W.astype(dtype), R=R.astype(dtype), Bias=Bias, lens=lens, h0=h0)


def tvm_args(p, dev, poison: bool = True):
    """The kernels' arguments on `dev`: (proj args X, W, bias, gate_i), (rec args gate_i, R, rb_h, lens, h0,
    Y, Y_h); outputs filled with NaN (every element must be written)."""
    import tvm

    seq, B, _ = p["X"].shape
    D, H = p["R"].shape[:2]
    dt = p["R"].dtype
    fill = np.nan if poison else 0
    t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    gate_i = t(np.full((D, seq, B, H), fill, np.float32))
    bias = p["Bias"][:, :H] + p["Bias"][:, H:]   # Wb + Rb folded into the projection, as the importer does
    proj = (t(p["X"]), t(p["W"]), t(bias), gate_i)
    rec = (gate_i, t(p["R"]), t(np.zeros((D, H), np.float32)), t(p["lens"]), t(p["h0"]),
           t(np.full((seq, D, B, H), fill, dt)), t(np.full((D, B, H), fill, dt)))
    return proj, rec


def mismatch(name, got, want, rtol, atol) -> str | None:
    """None when got matches want, else one line: how many elements are off, the worst, where, NaNs."""
    got = got.astype(np.float64)
    bad = ~(np.abs(got - want) <= atol + rtol * np.abs(want))
    if not bad.any():
        return None
    err = np.where(np.isnan(got), np.inf, np.where(bad, np.abs(got - want), 0))
    at = np.unravel_index(np.argmax(err), err.shape)
    return (f"{name}: {int(bad.sum())}/{bad.size} off (rtol {rtol}, atol {atol}), {int(np.isnan(got).sum())} NaN; "
            f"worst at {tuple(int(i) for i in at)}: got {got[at]:.6g} want {want[at]:.6g}")


@contextlib.contextmanager
def watchdog(seconds: float, what: str, on_fire=None):
    """A hung kernel cannot be interrupted in-process: after `seconds`, call on_fire() (save what was
    measured), say which kernel hung and exit the process (code 3)."""
    def fire():
        print(f"\nWATCHDOG: {what} took over {seconds:.0f}s (hung kernel?): exiting", flush=True)
        if on_fire is not None:
            on_fire()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_test(entry: dict, mods: PrebuiltModules, dev, seq: int = TEST_SEQ, launches: int = 2) -> dict:
    """Run a test entry of index.json `launches` times (fresh NaN outputs, same inputs) against numpy_rnn;
    also checks the projection's gate_i, so a failure says which kernel is wrong.
    Returns {"name", "ok", "problems", "max_err"}."""
    D, B, H, I, dtype = entry["D"], entry["B"], entry["H"], entry["input_size"], entry["dtype"]
    p = make_problem(D, B, H, I, seq, dtype, seed=H + B, lens_kind="random" if entry["has_seq_lens"] else "full")
    lens = p["lens"] if entry["has_seq_lens"] else None
    rY, rYh = numpy_rnn(p["X"], p["W"], p["R"], p["Bias"], lens, p["h0"], entry["direction"], entry["clip"],
                        entry["acts"])
    rG = (np.einsum("tbi,dhi->dtbh", p["X"].astype(np.float64), p["W"].astype(np.float64))
          + (p["Bias"][:, :H].astype(np.float64) + p["Bias"][:, H:])[:, None, None, :])
    mod = mods.get(entry["file"])
    proj, rec = mod[entry["proj"]], mod[entry["rec"]]
    tol, problems, max_err = TOL[dtype], [], 0.0
    for launch in range(launches):  # twice: the second launch must not see the first one's LL flags
        pa, ra = tvm_args(p, dev)
        with watchdog(60, entry["name"]):
            proj(*pa)
            rec(*ra)
            dev.sync()
        for name, got, want, tl in (("gate_i", pa[3].numpy(), rG, TOL["float32"] if dtype == "float32" else
                                     dict(rtol=1e-4, atol=1e-4)),
                                    ("Y", ra[5].numpy(), rY, tol), ("Y_h", ra[6].numpy(), rYh, tol)):
            max_err = max(max_err, float(np.nanmax(np.abs(got.astype(np.float64) - want), initial=0)))
            why = mismatch(name, got, want, **tl)
            if why:
                problems.append(f"launch {launch}: {why}")
    return {"name": entry["name"], "ok": not problems, "problems": problems, "max_err": max_err}


# ----------------------------------------------------------------------------------------------------
# Build side (needs TVM's compiler)
# ----------------------------------------------------------------------------------------------------


def _kernels(D, B, H, I, dtype, direction, acts, clip, lens, target, name, path="persistent"):
    """{proj_<name>, rec_<name>}: the RNN input projection and the recurrence (cell="rnn"): the SIMT engine
    (path "persistent", the test kernels) or what the importer picks (path "auto": the engine or, at batch
    32-64 and hidden <= 512 in fp32, the staged-state kernel)."""
    from ..kernels.activations import Activation
    from ..kernels.recurrent import engine, gru, paths, rnn

    acts_ = tuple(Activation.make(a) for a in acts)
    spec = rnn.RnnSpec(D, B, H, I, dtype, direction, acts_, clip, lens)
    proj = gru.schedule_input_projection(gru.input_projection_func(spec), target)["main"]
    if path == "auto":
        rec, _, _ = paths.recurrence_func_auto(spec, target)
    else:
        rec = engine.persistent_gru_func(D, B, H, dtype, 1, direction, list(acts_), clip, lens, target, cell="rnn")
    return {f"proj_{name}": proj.with_attr("global_symbol", f"proj_{name}"),
            f"rec_{name}": rec.with_attr("global_symbol", f"rec_{name}")}


def _add(funcs, *args) -> tuple[bool, str]:
    """funcs += _kernels(*args); (False, why) when a kernel cannot be made (the others are still built)."""
    try:
        funcs.update(_kernels(*args))
    except Exception as err:  # noqa: BLE001 - e.g. a schedule error: recorded in index.json, printed
        return False, f"{type(err).__name__}: {str(err).strip().splitlines()[-1]}"[:400]
    return True, ""


def _launch(D, B, H, dtype, target, path="persistent") -> dict:
    """threads, dynamic shared bytes and blocks of a persistent RNN launch (for `residency`)."""
    from ..kernels.recurrent import engine
    from ..kernels.recurrent import mma as pm

    if path == "persistent_mma":
        cfg = pm.default_config(D, B, H, target, "rnn", dtype=dtype)
        geo = pm.MmaGeometry(D, B, H, 1, cfg, dtype)
        return {"threads": geo.NT, "dyn_smem": geo.smem_bytes(), "blocks": geo.BLOCKS, "config": str(cfg),
                "path": path}

    cfg = engine.default_gru_config(D, B, H, dtype, target, "rnn")
    geo = engine._geometry(D, B, H, cfg, True, "rnn")
    return {"threads": geo.NT, "dyn_smem": 4 * geo.R_smem * geo.Hp, "blocks": cfg.num_blocks * D,
            "config": str(cfg)}


def build_for_gpu(out_dir, target: str = "cuda", bench: bool = True, tests=TEST_CASES) -> Path:
    """One .so with every config's projection + recurrence and the test kernels, + index.json (each
    kernel's ptxas registers/spills, the recurrence's launch and residency on a 132-SM H100)."""
    import tvm

    from ..kernels.recurrent import engine, paths
    from ..targets import resolve

    tgt = resolve(target)
    gpu = tgt.kind.name == "cuda"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    funcs: dict = {}
    index = {"benchmark": NAME, "tvm": tvm.__version__, "target": tgt.kind.name,
             "arch": str(tgt.attrs.get("arch", "")), "configs": [], "tests": [], "skipped": []}
    for c in (configs() if bench else ()):
        D, B, H = 2 if c["bidirectional"] else 1, c["batch"], c["hidden"]
        # the staged-state kernel where the importer picks it, else the SIMT engine (where it fits)
        path, why = paths.choose_path(D, B, H, c["dtype"], tgt, cell="rnn")
        if path != "persistent_mma":
            path = "persistent"
            ok, why = engine.fits_on_chip(D, B, H, c["dtype"], tgt, cell="rnn")
        else:
            ok = True
        sfx = config_suffix(c)
        if ok:
            ok, why2 = _add(funcs, D, B, H, H, c["dtype"], "bidirectional" if D == 2 else "forward", ("Tanh",) * D,
                            None, False, tgt, sfx, "auto" if path == "persistent_mma" else "persistent")
            why = why if ok else why2
        if not ok:
            print(f"skip {sfx}: {why}", flush=True)
            index["skipped"].append(dict(c, name=sfx, reason=why))
            continue
        index["configs"].append(dict(c, name=sfx, file=FILE, proj=f"proj_{sfx}", rec=f"rec_{sfx}", reason=why,
                                     **(_launch(D, B, H, c["dtype"], tgt, path) if gpu else {})))
    for case in tests:
        D, B, H, dtype, direction, acts, clip, lens = case
        name, I = _test_name(case), H if (B, H) in BENCH_SIZED else TEST_INPUT_SIZE  # noqa: E741
        ok, why = _add(funcs, D, B, H, I, dtype, direction, acts, clip, lens, tgt, name)
        if not ok:
            print(f"skip {name}: {why}", flush=True)
            index["skipped"].append(dict(name=name, reason=why))
            continue
        index["tests"].append(dict(name=name, file=FILE, proj=f"proj_{name}", rec=f"rec_{name}", D=D, B=B, H=H,
                                   input_size=I, dtype=dtype, direction=direction, acts=list(acts),
                                   clip=clip, has_seq_lens=lens,
                                   **(_launch(D, B, H, dtype, tgt) if gpu else {})))
    t0 = time.time()
    ex, report = compile_for_gpu(funcs, tgt)
    ex.export_library(str(out_dir / FILE))
    print(f"built {FILE}: {len(funcs)} functions in {time.time() - t0:.1f}s "
          f"({(out_dir / FILE).stat().st_size / 1e6:.2f} MB)", flush=True)
    spills = sorted(k for k, v in report.items() if v.get("spill_stores") or v.get("spill_loads"))
    for e in index["configs"] + index["tests"]:
        e["ptxas"] = {k: v for f in (e["proj"], e["rec"]) for k, v in _kernels_of(report, f).items()}
        rec = report.get(f"{e['rec']}_kernel")
        if rec:
            e["residency"] = residency(rec, e["threads"], e["dyn_smem"], e["blocks"])
            if not e["residency"]["resident"]:
                print(f"WARNING {e['name']}: {e['residency']['why']}", flush=True)
    for kernel, info in sorted(report.items()):
        print(f"  ptxas {kernel}: {info}")
    (out_dir / "index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {out_dir / 'index.json'}: {len(index['configs'])} configs, {len(index['tests'])} tests, "
          f"{len(index['skipped'])} skipped")
    print(f"WARNING: ptxas spills in {spills}" if spills else "ptxas: no spills")
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Run side (TVM runtime + torch)
# ----------------------------------------------------------------------------------------------------

COLS = ["bidirectional", "hidden", "batch", "tvmseq_us_step", "recurrence_us_step", "cudnn_us_step", "speedup",
        "err_tvmseq", "err_cudnn", "agree", "status"]


def bench_row(e: dict, mods: PrebuiltModules, seq: int = SEQ) -> dict:
    """One config: tvmseq (projection + persistent recurrence) vs torch.nn.RNN (cuDNN, tanh), same weights,
    both against a float64 torch RNN, all timed per step."""
    import torch
    import tvm

    D, B, H, dtype = 2 if e["bidirectional"] else 1, e["batch"], e["hidden"], e["dtype"]
    p = make_problem(D, B, H, H, seq, dtype, seed=B * 7919 + H, lens_kind="full")
    dev = tvm.cuda(0)
    pa, ra = tvm_args(p, dev)
    mod = mods.get(e["file"])
    proj, rec = mod[e["proj"]], mod[e["rec"]]

    def tvmseq_run():
        proj(*pa)
        rec(*ra)

    for _ in range(2):  # one at a time first: a hang shows up here, attributed to this config
        tvmseq_run()
        dev.sync()
    Y, Yh = ra[5].numpy().astype(np.float64), ra[6].numpy().astype(np.float64)

    tdt = getattr(torch, dtype)
    cu = lambda a, dt=tdt: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", dt)  # noqa: E731

    def torch_rnn(dt):
        m = torch.nn.RNN(H, H, nonlinearity="tanh", bidirectional=D == 2).to("cuda", dt)
        with torch.no_grad():
            for d in range(D):
                sfx = "_reverse" if d else ""
                getattr(m, f"weight_ih_l0{sfx}").copy_(cu(p["W"][d], dt))
                getattr(m, f"weight_hh_l0{sfx}").copy_(cu(p["R"][d], dt))
                getattr(m, f"bias_ih_l0{sfx}").copy_(cu(p["Bias"][d, :H], dt))
                getattr(m, f"bias_hh_l0{sfx}").copy_(cu(p["Bias"][d, H:], dt))
        return m

    rnn, rnn64 = torch_rnn(tdt), torch_rnn(torch.float64)
    X, h0 = cu(p["X"]), cu(p["h0"])

    def peer_run():
        with torch.no_grad():
            return rnn(X, h0)

    peer_y, peer_h = peer_run()
    with torch.no_grad():
        ref_y, ref_h = rnn64(cu(p["X"], torch.float64), cu(p["h0"], torch.float64))
    ref_y, ref_h = ref_y.cpu().numpy(), ref_h.cpu().numpy()         # [seq, B, D*H], [D, B, H]
    ours_y = Y.transpose(0, 2, 1, 3).reshape(seq, B, D * H)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    row = {k: e[k] for k in ("name", "dtype", "bidirectional", "hidden", "batch")}
    row.update(label=f"{'bi' if D == 2 else 'uni'} H{H} B{B}", seq=seq, peer="torch.nn.RNN tanh (cuDNN)",
               peer_tf32=bool(torch.backends.cudnn.allow_tf32),
               matmul_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
               err_tvmseq=max(rel(ours_y, ref_y), rel(Yh, ref_h)),
               err_cudnn=max(rel(peer_y.double().cpu().numpy(), ref_y), rel(peer_h.double().cpu().numpy(), ref_h)),
               max_diff_vs_cudnn=float(np.abs(ours_y - peer_y.double().cpu().numpy()).max()))
    row["agree"] = bool(np.isfinite(row["err_tvmseq"]) and row["err_tvmseq"] < AGREE[dtype])
    row["tvmseq_us_step"] = time_cuda(tvmseq_run, warmup=3, iters=20) * 1e3 / seq
    row["recurrence_us_step"] = time_cuda(lambda: rec(*ra), warmup=2, iters=20) * 1e3 / seq
    row["cudnn_us_step"] = time_cuda(peer_run, warmup=3, iters=20) * 1e3 / seq
    row["speedup"] = row["cudnn_us_step"] / row["tvmseq_us_step"]
    row["status"] = "ok" if row["agree"] else "WRONG"
    return row


def _not_resident(e, num_sms) -> str | None:
    rec = e.get("ptxas", {}).get(f"{e['rec']}_kernel")
    if not rec or "threads" not in e:
        return None
    res = residency(rec, e["threads"], e["dyn_smem"], e["blocks"], num_sms)
    return None if res["resident"] else res["why"]


def run_prebuilt(root, args) -> list[dict]:
    import torch
    import tvm

    torch.backends.cudnn.allow_tf32 = False        # true fp32 on the peer
    torch.backends.cuda.matmul.allow_tf32 = False
    root = Path(root)
    index = json.loads((root / "index.json").read_text())
    mods, dev = PrebuiltModules(root), tvm.cuda(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tests, rows = [], []
    meta = lambda: {"peer": "torch.nn.RNN(nonlinearity='tanh') (cuDNN), TF32 off", "seq": SEQ,  # noqa: E731
                    "note": "tvmseq time = TVM input projection + persistent RNN recurrence (cell='rnn')",
                    "skipped_at_build": index.get("skipped", []), "tests": tests}
    for e in (index["tests"] if not args.no_tests else []):
        why = _not_resident(e, num_sms)
        if why:
            tests.append({"name": e["name"], "ok": None, "problems": [f"skipped: {why}"]})
            continue
        try:
            res = check_test(e, mods, dev)
        except Exception as err:  # noqa: BLE001 - one broken kernel must not stop the others
            res = {"name": e["name"], "ok": False, "problems": [f"{type(err).__name__}: {err}"[:400]]}
        tests.append(res)
        print(f"test {e['name']}: {'ok' if res['ok'] else 'FAILED'} (max err {res.get('max_err', float('nan')):.3g})"
              + "".join(f"\n    {p}" for p in res["problems"]), flush=True)
    if tests:
        print(f"tests: {sum(t['ok'] is True for t in tests)}/{len(tests)} ok", flush=True)
    for e in (index["configs"] if not args.tests_only else []):
        if args.bidirectional is not None and e["bidirectional"] != (args.bidirectional == "bi"):
            continue
        why = _not_resident(e, num_sms)
        if why:
            row = {k: e[k] for k in ("name", "dtype", "bidirectional", "hidden", "batch")}
            row.update(status="skipped", agree=None, reason=why)
        else:
            def on_fire(e=e):
                save(NAME, rows + [dict(name=e["name"], status="timeout", agree=False)], meta(), None, args.out)

            try:
                with watchdog(args.config_timeout, e["name"], on_fire):
                    row = bench_row(e, mods)
            except Exception as err:  # noqa: BLE001 - a launch error must not stop the other configs
                row = {k: e[k] for k in ("name", "dtype", "bidirectional", "hidden", "batch")}
                row.update(status="error", agree=False, reason=f"{type(err).__name__}: {err}"[:400])
                print(f"{e['name']}: {row['reason']}", flush=True)
        row.update(config=e.get("config"), path=e.get("path", "persistent"),
                   ptxas=e.get("ptxas", {}).get(f"{e['rec']}_kernel"))
        rows.append(row)
        print_table([row], COLS)
        save(NAME, rows, meta(), None, args.out)  # keep what was measured if the run is cut short
    print()
    if rows:
        print_table(rows, COLS)
    timed = [r for r in rows if r.get("speedup")]
    save(NAME, rows, meta(), ratio_bar_plot(timed, ["label"], "speedup",
                                            "tvmseq persistent RNN vs cuDNN (fp32, tanh): speedup") if timed else None,
         args.out)
    bad = [t["name"] for t in tests if t["ok"] is False] + [r["name"] for r in rows if r.get("agree") is False]
    if bad:
        print(f"NOT OK: {bad}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--build", metavar="DIR", help="build the kernels into DIR and exit (needs the compiler)")
    parser.add_argument("--prebuilt", metavar="DIR", help="run the kernels of --build (index.json + .so)")
    parser.add_argument("--no-tests", action="store_true", help="with --prebuilt: skip the test kernels")
    parser.add_argument("--tests-only", action="store_true", help="with --prebuilt: only the test kernels")
    parser.add_argument("--bidirectional", choices=("uni", "bi"), default=None, help="only one direction kind")
    parser.add_argument("--config-timeout", type=float, default=120.0,
                        help="seconds a config may take before the run is stopped as hung (default 120)")
    parser.add_argument("--out", default=None, help="directory for the JSON + plot (default artifacts/bench)")


def run(args) -> list[dict]:
    if args.build:
        build_for_gpu(args.build)
        return []
    if not cuda_available():
        print("no CUDA GPU (or no torch): build here with --build DIR, run with --prebuilt DIR on a GPU machine")
        return []
    root = args.prebuilt
    if root is None:
        import tempfile

        root = build_for_gpu(tempfile.mkdtemp(prefix="prnn_"))
    return run_prebuilt(root, args)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    run(p.parse_args())
