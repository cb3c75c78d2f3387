"""Measured schedule databases (tvmseq/tune/measured.py, schedules/tune_*.py): merge rules, the result-file
parsers of the three tuning scripts, and the kernels' defaults reading the committed databases."""
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("tvm.script")
from tvmseq.tune import measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "schedules" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_keeps_a_winner_only_against_the_timed_model_pick(tmp_path):
    pick = {"w": 8}
    key1, key2, key3 = {"H": 1}, {"H": 2}, {"H": 3}
    trials = [dict(key=key1, config=pick, us=10.0), dict(key=key1, config={"w": 16}, us=8.0),   # 20% faster
              dict(key=key2, config=pick, us=10.0), dict(key=key2, config={"w": 16}, us=9.8),   # noise: 2%
              dict(key=key3, config={"w": 16}, us=1.0)]                                         # pick not timed
    written = measured.merge("toy", trials, lambda k: pick, "test", root=tmp_path)
    assert [e["key"] for e in written] == [key1]
    entries = json.loads((tmp_path / "toy.json").read_text())["entries"]
    assert entries == [dict(key=key1, config={"w": 16}, us=8.0, model_config=pick, model_us=10.0, trials=2,
                            source="test")]
    # a later run where the pick wins drops the old entry
    measured.merge("toy", [dict(key=key1, config=pick, us=7.0), dict(key=key1, config={"w": 16}, us=8.0)],
                   lambda k: pick, "test 2", root=tmp_path)
    assert json.loads((tmp_path / "toy.json").read_text())["entries"] == []


def test_lookup_reads_the_database_dir(tmp_path, monkeypatch):
    measured.merge("toy", [dict(key={"H": 1}, config={"w": 1}, us=10.0), dict(key={"H": 1}, config={"w": 2}, us=5.0)],
                   lambda k: {"w": 1}, "test", root=tmp_path)
    monkeypatch.setattr(measured, "DIR", tmp_path)
    assert measured.lookup("toy", H=1) == {"w": 2}
    assert measured.lookup("toy", H=2) is None and measured.lookup("missing_op", H=1) is None


def test_script_parsers():
    assert _script("tune_persistent_gru")._config(
        "PersistentConfig(num_blocks=64, num_warps=16, batch_chunk=1, smem_rows=39)") == dict(
        num_blocks=64, num_warps=16, batch_chunk=1, smem_rows=39)
    assert _script("tune_step_gemm")._tile("64x128x16 8x8 s4") == dict(bm=64, bn=128, bk=16, tm=8, tn=8, split_k=4,
                                                                        vec=4)
    assert _script("tune_recurrent_gemm")._config("blk128w16bc8s4") == dict(num_blocks=128, num_warps=16,
                                                                            batch_chunk=8, smem_rows=4)


def test_kernel_defaults_come_from_the_committed_databases():
    """The committed databases (merged from artifacts/bench/*sweep*.json, recurrent_gemm.json) are what the
    defaults return on a GPU target, the cost model's pick with measured=False or on the CPU."""
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import engine, step_gemm
    from tvmseq.targets import resolve

    from tvmseq.kernels.recurrent import mma as pm
    from tvmseq.kernels.sparse import spmm
    from tvmseq.kernels.topk import topk

    cuda = resolve("cuda")
    checks = [
        ("persistent_gru", lambda k: engine.default_gru_config(k["D"], k["B"], k["H"], k["dtype"], cuda, k["cell"])),
        ("recurrent_gemm", lambda k: rg.default_config(k["H"], k["B"], k["dtype"], cuda)),
        ("step_gemm", lambda k: step_gemm.choose_tile(k["M"], k["N"], k["K"], k["D"], k["dtype"], cuda)),
        ("spmm", lambda k: spmm.default_schedule(spmm.SpmmShape(**k), cuda)),
        # the database's layer (`default_config` then swaps float16 batch <= 8 picks to gate_m: test_gate_m_rule)
        ("persistent_mma", lambda k: pm._default_config(k["D"], k["B"], k["H"], cuda, k["cell"], True, k["dtype"]))]
    if (ROOT / "schedules" / "measured" / "topk.json").exists():
        checks.append(("topk", lambda k: topk.choose_config(k["rows"], k["n"], k["k"], True, dtype=k["dtype"])))
    for op, check in checks:
        entries = json.loads((ROOT / "schedules" / "measured" / f"{op}.json").read_text())["entries"]
        assert entries, op
        for e in entries:
            assert dataclasses.asdict(check(e["key"])) == e["config"], (op, e["key"])
            assert e["us"] < e["model_us"], (op, e["key"])
    assert engine.default_gru_config(1, 8, 256, "float32", cuda, measured=False) != \
        engine.default_gru_config(1, 8, 256, "float32", cuda)
    assert step_gemm.choose_tile(64, 3072, 1024, 1, "float32", None) == \
        step_gemm.choose_tile(64, 3072, 1024, 1, "float32", cuda, measured=False)


def test_cli_runs_the_tuning_scripts(tmp_path, monkeypatch, capsys):
    """`tvmseq tune <op> merge FILE` runs schedules/tune_<op>.py; a bad call prints its usage (exit 2)."""
    from tvmseq import cli

    monkeypatch.setattr(measured, "DIR", tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rows": [
        {"H": 512, "B": 1, "dtype": "float32", "path": "persistent", "ok": True, "tvmseq_us": 1.0,
         "config": "blk{num_blocks}w{num_warps}bc{batch_chunk}s{smem_rows}".format(**_pick_rg())},
        {"H": 512, "B": 1, "dtype": "float32", "path": "persistent", "ok": True, "tvmseq_us": 0.5,
         "config": "blk32w4bc1s0"}]}))
    original = measured.merge
    monkeypatch.setattr(measured, "merge", lambda *a, **k: original(*a, **dict(k, root=tmp_path)))
    assert cli.main(["tune", "recurrent_gemm", "merge", str(results)]) in (0, None)
    entries = json.loads((tmp_path / "recurrent_gemm.json").read_text())["entries"]
    assert entries[0]["config"]["num_blocks"] == 32
    with pytest.raises(SystemExit) as err:
        cli.main(["tune", "persistent_gru", "bogus"])
    assert err.value.code == 2


def _pick_rg():
    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.targets import resolve

    return dataclasses.asdict(rg.default_config(512, 1, "float32", resolve("cuda"), measured=False))


# (op, tuning script, committed measurements it was merged from[, then more (script, measurements) merged in order])
SOURCES = [("persistent_gru", "tune_persistent_gru", "artifacts/bench/pgru_sweep.json.gz",
            ("plstm_sweep", "artifacts/bench/plstm_sweep.json.gz"),
            ("plstm_sweep", "artifacts/bench/plstm_b1_cluster_2026-11-28.json.gz"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_warps_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_chains_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_batch_split_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_row_clusters_2026-11-29.json")),
           ("recurrent_gemm", "tune_recurrent_gemm", "artifacts/bench/recurrent_gemm.json"),
           ("step_gemm", "tune_step_gemm", "artifacts/bench/gru_sweep.json.gz",
            ("plstm_sweep", "artifacts/bench/plstm_tiles.json.gz")),
           ("spmm", "tune_spmm", "artifacts/bench/spmm_tune.json.gz"),
           ("topk", "tune_topk", "artifacts/bench/topk_tune.json.gz"),
           ("persistent_mma", "tune_persistent_mma", "artifacts/bench/pmma_sweep.json.gz",
            ("plstm_sweep", "artifacts/bench/plstm_sweep.json.gz"),
            ("plstm_sweep", "artifacts/bench/plstm_gate_m_2026-11-28.json.gz"),
            ("plstm_sweep", "artifacts/bench/plstm_b1_cluster_2026-11-28.json.gz"),
            ("tune_persistent_mma", "artifacts/bench/pmma_b1_cluster_2026-11-28.json.gz"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_2026-11-29.json"),
            ("tune_persistent_mma", "artifacts/bench/pmma_sweep_small_chunks_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_warps_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_small_chunks_chains_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_batch_split_2026-11-29.json"),
            ("plstm_sweep", "artifacts/bench/plstm_sweep_row_clusters_2026-11-29.json")),
           ("persistent_wgmma", "plstm_sweep", "artifacts/bench/plstm_wgmma_sweep_2026-11-28.json.gz")]


@pytest.mark.parametrize("op,script,source,more",
                         [(op, script, source, tuple(more)) for op, script, source, *more in SOURCES],
                         ids=[s[0] for s in SOURCES])
def test_committed_database_is_reproducible_from_the_committed_measurements(tmp_path, monkeypatch, op, script,
                                                                           source, more):
    merges = [(script, source), *more]
    for _, path in merges:
        if not (ROOT / path).exists():
            pytest.skip(f"{path} not committed")
    original = measured.merge
    monkeypatch.setattr(measured, "merge", lambda *a, **k: original(*a, **dict(k, root=tmp_path)))
    for name, path in merges:   # the LSTM sweep after the GRU's: the same order as the committed database
        _script(name).merge(ROOT / path)
    got = json.loads((tmp_path / f"{op}.json").read_text())["entries"]
    want = json.loads((ROOT / "schedules" / "measured" / f"{op}.json").read_text())["entries"]
    strip = lambda es: [{k: v for k, v in e.items() if k != "source"} for e in es]  # noqa: E731
    assert strip(got) == strip(want)


@pytest.mark.parametrize("script,step,want", [
    ("tune_step_gemm", "build", ["bench", "gru", "--build", "D", "--no-tests"]),
    ("tune_step_gemm", "run", ["bench", "gru", "--prebuilt", "D", "--sweep-only", "--out", "D"]),
    ("tune_spmm", "run", ["bench", "spmm", "--prebuilt", "D", "--out", "D"])])
def test_scripts_drive_the_benchmarks_through_the_cli(monkeypatch, script, step, want):
    """build/run go through `tvmseq bench ...`, and the CLI accepts those arguments."""
    from tvmseq import cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv))
    getattr(_script(script), step)(Path("D"))
    assert seen == [want]
    parsed = cli._parser().parse_args(want)   # exits (SystemExit) on an argument the benchmark does not take
    assert parsed.op == want[1]


def test_persistent_gru_build_always_times_the_model_pick(monkeypatch):
    """tune_persistent_gru build: schedules/pgru_sweep.py's cells; each cell's variants start with the cost model's
    pick (a winner is only a winner against it), hold the database's pick, and all fit on the H100."""
    import sys

    from tvmseq.kernels import recurrent_gemm as rg
    from tvmseq.kernels.recurrent import engine
    from tvmseq.targets import resolve

    tune = _script("tune_persistent_gru")
    sys.path.insert(0, str(ROOT / "scripts"))
    import pgru_sweep

    seen = []
    monkeypatch.setattr(pgru_sweep, "build", lambda out, cells: seen.extend(cells))
    tune.build(Path("unused"))
    assert seen == pgru_sweep.CELLS
    facts = rg.gpu_facts(resolve("cuda"))
    assert {c[4] for c in seen} == {"gru", "rnn"}
    for D, B, H, dtype, cell in seen:
        variants = pgru_sweep.variants(D, B, H, dtype, cell)
        assert variants[0] == tune._model_pick(D, B, H, dtype, cell)
        assert engine.default_gru_config(D, B, H, dtype, resolve("cuda"), cell) in variants
        assert len(set(variants)) == len(variants) > 3
        for cfg in variants:
            assert engine._geometry(D, B, H, cfg, True, cell).check(facts, cfg.num_blocks * D) is None, cfg


def test_persistent_mma_merge_counts_a_configs_newest_timing(tmp_path, monkeypatch):
    """A config timed in several sweeps counts with its newest time (the kernel changed in between): an old,
    faster timing of a variant must not make it the winner once a later sweep timed it slower."""
    tune = _script("tune_persistent_mma")
    pick = tune._model_pick(1, 64, 512)
    other = (16, 8, 32, 0, 2, 0, 0, 0, 1, 1, 2)
    row = lambda config, us, run: dict(D=1, B=64, H=512, dtype="float16", cell="gru", config=list(config),  # noqa: E731
                                       us_step=us, ok=True, run=run)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([row(pick.knobs(), 3.0, "a"), row(other, 2.0, "a"),      # 33% faster in run a
                                   row(pick.knobs(), 3.0, "b"), row(other, 3.5, "b")]))    # slower in run b
    original = measured.merge
    monkeypatch.setattr(measured, "merge", lambda *a, **k: original(*a, **dict(k, root=tmp_path)))
    tune.merge(results)
    assert json.loads((tmp_path / "persistent_mma.json").read_text())["entries"] == []


def test_persistent_mma_small_batch_entries_beat_the_simt_engine(tmp_path, monkeypatch):
    """Below the staged-state kernel's batch floor its rival is the SIMT engine (rows of kernel persistent_gru): an
    entry is written only where the kernel beat the engine by 3%, with the engine as its model_config, and that
    entry alone routes the shape to the kernel (mma.supported); without it, batch 8 stays refused."""
    from tvmseq.kernels.recurrent import mma as pm

    tune = _script("tune_persistent_mma")
    knobs = (16, 8, 16, 0, 1, 0, 0, 0, 0, 0, 16, 1, 1)
    row = lambda B, us, kernel="persistent_mma", config=knobs: dict(  # noqa: E731
        D=1, B=B, H=256, dtype="float16", cell="gru", kernel=kernel, config=list(config), us_step=us, ok=True)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([row(8, 3.0, "persistent_gru", ()), row(8, 1.9),        # beats the engine
                                   row(1, 1.28, "persistent_gru", ()), row(1, 1.41)]))    # the engine wins
    original = measured.merge
    monkeypatch.setattr(measured, "merge", lambda *a, **k: original(*a, **dict(k, root=tmp_path)))
    tune.merge(results)
    (entry,) = json.loads((tmp_path / "persistent_mma.json").read_text())["entries"]
    assert entry["key"]["B"] == 8 and entry["model_config"] == pm.ENGINE_PICK and entry["model_us"] == 3.0
    assert pm.MmaConfig(**entry["config"]).knobs() == knobs
    monkeypatch.setattr(measured, "DIR", tmp_path)
    measured._table.cache_clear()
    try:
        ok, why = pm.supported(1, 8, 256, "float16", 1, "cuda")
        assert ok and "dsmem=True" in why
        assert pm.supported(1, 1, 256, "float16", 1, "cuda") == (False, "batch 1 < 16: the SIMT engine is faster there")
        assert not pm.beats_engine(1, 8, 256, "gru", "float16", "llvm")     # CPU targets never route here
    finally:
        measured._table.cache_clear()
