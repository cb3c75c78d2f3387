"""`tvmseq bench model --tuned DB` without a GPU: the build half compiles each architecture at static shapes twice,
with the default schedules and with the database, and records which functions the database scheduled. The
database here holds one record for the vad's heaviest CUDA function: dlight's Fallback schedule of it (a traced
s_tir.Schedule, as MetaSchedule's candidates are) committed with a made-up time, since nothing can be measured
without a GPU (MetaSchedule's own TuneContext would spend 15-90 s importing its tensor intrinsics)."""
import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("tvm.s_tir.meta_schedule")
pytest.importorskip("torch")


def fake_cuda_database(model_bytes, shapes, work_dir, *, expose_state=False, weights="inputs", tasks=1):
    """Commit dlight's Fallback schedule (run time 1 us, never measured) of each of the `tasks` heaviest stock
    functions of the model as the bench compiles it for CUDA, as MetaSchedule tuning records. Returns their names."""
    from tvm.s_tir import dlight as dl
    from tvm.s_tir import meta_schedule as ms

    from tvmseq import targets
    from tvmseq.tune import metaschedule as wrap
    from tvmseq.tune import model as tune_model

    target = targets.resolve("cuda")
    mod, _, _ = tune_model.import_for_tuning(model_bytes, target, shapes, weights=weights, expose_state=expose_state,
                                             log=lambda *_: None)
    extracted, _ = tune_model.extract_tasks(mod, target)
    database = wrap.open_database(work_dir)
    names = []
    for task in extracted[:tasks]:
        func = task.dispatched[0]["main"]
        with target:
            sch = dl.gpu.Fallback().apply(func, target, False)    # not what the default schedules pick
        workload = database.commit_workload(task.dispatched[0])
        database.commit_tuning_record(ms.database.TuningRecord(
            sch.trace, workload, run_secs=[1e-6], target=target, args_info=ms.arg_info.ArgInfo.from_prim_func(func)))
        names.append(task.task_name)
    return names


def _kernel(source: str, name: str) -> tuple[int, bool]:
    """(launch bound, uses shared memory) of kernel `name` in CUDA source."""
    m = re.search(rf"__launch_bounds__\((\d+)\) {name}_kernel\([^)]*\) \{{(.*?)\n\}}", source, re.S)
    assert m, f"{name}_kernel not in the CUDA source"
    return int(m.group(1)), "__shared__" in m.group(2)


def _cuda_source(model) -> str:
    out = []

    def walk(mod):
        for sub in mod.imports:
            if sub.kind == "cuda":
                out.append(sub.inspect_source())
            walk(sub)

    walk(model.executable.mod)
    return "\n".join(out)


def test_bench_model_build_records_static_and_tuned(tmp_path):
    from tvmseq.bench import architectures as A
    from tvmseq.bench import model as bench_model
    from tvmseq.build import compile_onnx

    batch, frames = 1, 100
    db = tmp_path / "db"
    model_bytes = A.export_onnx("vad", A.build("vad"), batch)
    shapes = bench_model._static_shapes("vad", batch, frames)
    names = fake_cuda_database(model_bytes, shapes, db)
    # the database reaches the CUDA build (source only here, in this process: no device code)
    kernels = {tuned: _kernel(_cuda_source(compile_onnx(model_bytes, target="cuda", shape_dict=shapes,
                                                        weights="inputs", tuned=tuned)), names[0])
               for tuned in (None, str(db))}
    assert kernels[str(db)] != kernels[None] and kernels[str(db)][1] is False      # Fallback: no shared memory
    # the bench's build half, in a process of its own (embedding device code loads a CUDA driver stub for good)
    out = tmp_path / "built"
    done = subprocess.run([sys.executable, "-m", "tvmseq.cli", "bench", "model", "--build", str(out), "--arch", "vad",
                           "--batch", str(batch), "--frames", str(frames), "--tuned", str(db), "--static-only"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the database schedules 1 function(s)" in done.stdout
    index = json.loads((out / "index.json").read_text())
    entry = index["models"]["vad"]
    assert entry["failed"] is None, entry["failed"]
    files = entry["builds"]["1"]
    assert set(files) >= {"static", "tuned", "tuned_functions"} and "plain" not in files     # --static-only
    assert files["tuned_functions"]["100"] == names
    for variant in ("static", "tuned"):
        assert (out / files[variant]["100"]).stat().st_size > 0
        meta = json.loads((out / (files[variant]["100"] + ".json")).read_text())
        assert meta["signature"]["inputs"][0]["shape"] == [frames, batch, 64]
    assert index["tuned"]["database"] == str(db.resolve())


def test_bench_model_tuned_options_are_checked(tmp_path):
    from tvmseq import cli

    assert cli.main(["bench", "model", "--build", str(tmp_path / "b"), "--static-only"]) == 2
    assert cli.main(["bench", "model", "--build", str(tmp_path / "b"), "--tuned", str(tmp_path)]) == 2
    assert cli.main(["bench", "model", "--prebuilt", str(tmp_path / "b"), "--tune", "8"]) == 2
    assert cli.main(["bench", "model", "--build", str(tmp_path / "b"), "--tune", "0"]) == 2


def test_tasks_come_heaviest_first_and_share_the_budget():
    from tvmseq import targets
    from tvmseq.bench import architectures as A
    from tvmseq.bench import model as bench_model
    from tvmseq.tune import model as tune_model

    target = targets.resolve("cuda")
    mod, shapes, chosen = tune_model.import_for_tuning(A.export_onnx("vad", A.build("vad"), 8), target,
                                                       bench_model._static_shapes("vad", 8, 100), weights="inputs",
                                                       log=lambda *_: None)
    assert chosen == {}                      # every dim given: nothing tuned at a representative size
    tasks, skipped = tune_model.extract_tasks(mod, target)
    flops = [tune_model.task_flops(t) for t in tasks]
    assert flops == sorted(flops, reverse=True) and flops[0] > 0
    assert any(name.startswith("lstm_") for name in skipped)          # tvmseq's kernels are not tasks
    assert tune_model.auto_trials_per_iter(64, 4) == 16
    assert tune_model.auto_trials_per_iter(8, 6) == 8                 # at least 8 a round
    assert tune_model.auto_trials_per_iter(1000, 2) == 64


def test_tune_cli_options_are_checked(tmp_path, capsys):
    from tvmseq import cli

    model = tmp_path / "m.onnx"
    from test_tune_model import _linear_model

    model.write_bytes(_linear_model().SerializeToString())
    assert cli.main(["tune", str(model), "--target", "llvm", "--trials-per-iter", "0", "-o", str(tmp_path / "db")]) == 2
    assert cli.main(["tune", str(model), "--target", "llvm", "--strategy", "greedy", "-o", str(tmp_path / "db")]) == 2
    assert cli.main(["tune", str(model), "--target", "llvm", "--max-tasks", "0", "-o", str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err
    assert "--trials-per-iter" in err and "--strategy" in err and "--max-tasks" in err
