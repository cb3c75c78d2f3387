"""`tvmseq tune MODEL.onnx` on llvm: a tiny model tuned with a few MetaSchedule trials; the database is applied
by `compile_onnx(..., tuned=DB)` and `tvmseq compile --tuned DB`, and the tuned build gives the untuned one's
numbers."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvmseq
from tvmseq import cli
from tvmseq.errors import TvmseqError

pytest.importorskip("tvm.s_tir.meta_schedule")


def _linear_model(rows="T", features=24, out=40, seed=3):
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((features, out)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(out).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["X", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["Y"])]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, features])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [rows, out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    from tvmseq.tune import model as tune_model

    path = tmp_path_factory.mktemp("tune") / "linear.onnx"
    path.write_bytes(_linear_model().SerializeToString())
    db = path.parent / "db"
    report = tune_model.tune_model(str(path), target="llvm", trials=3, shapes={"X": [9, 24]}, work_dir=db,
                                   cost_model="random", progress=False, log=lambda *_: None)
    return path, db, report


def test_tune_writes_a_database_for_the_stock_ops(tuned_db):
    _, db, report = tuned_db
    assert report.tasks and all(np.isfinite(report.best_ms[t]) for t in report.tasks)
    assert (db / "database_workload.json").stat().st_size > 0
    assert (db / "database_tuning_record.json").read_text().count("\n") >= 1


def test_tuned_build_uses_the_database_and_matches_untuned(tuned_db):
    from tvmseq.tune import model as tune_model

    path, db, report = tuned_db
    mod = tvmseq.from_onnx(str(path), {"X": [9, 24]}, target="llvm")
    import tvm

    assert tune_model.scheduled_by_database(mod, tvm.target.Target("llvm"), db) == sorted(report.tasks)
    x = np.random.default_rng(0).standard_normal((9, 24)).astype(np.float32)
    plain = tvmseq.compile_onnx(str(path), target="llvm", shape_dict={"X": [9, 24]})
    tuned = tvmseq.compile_onnx(str(path), target="llvm", shape_dict={"X": [9, 24]}, tuned=str(db))
    np.testing.assert_allclose(tuned(X=x), plain(X=x), rtol=1e-5, atol=1e-5)


def test_other_sizes_find_no_record(tuned_db):
    """Tuned at 9 rows: a dynamic build (or another size) matches no record and keeps the default schedules."""
    import tvm

    from tvmseq.tune import model as tune_model

    path, db, _ = tuned_db
    for shapes in (None, {"X": [5, 24]}):
        mod = tvmseq.from_onnx(str(path), shapes, target="llvm")
        assert tune_model.scheduled_by_database(mod, tvm.target.Target("llvm"), db) == []
    x = np.random.default_rng(1).standard_normal((5, 24)).astype(np.float32)
    tuned = tvmseq.compile_onnx(str(path), target="llvm", tuned=str(db))
    np.testing.assert_allclose(tuned(X=x), np.maximum(x @ _weights(path)[0] + _weights(path)[1], 0), rtol=1e-5,
                               atol=1e-5)


def _weights(path):
    import onnx

    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    return inits["w"], inits["b"]


def test_cli_compile_tuned(tuned_db, tmp_path, capsys):
    path, db, _ = tuned_db
    out = tmp_path / "m.so"
    assert cli.main(["compile", str(path), "--target", "llvm", "--shape", "X=9,24", "--tuned", str(db),
                     "-o", str(out)]) == 0
    assert out.exists()


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    from tvmseq.tune import model as tune_model

    assert cli.main(["compile", "x.onnx", "--tuned", str(tmp_path), "-o", str(tmp_path / "m.so")]) == 2
    with pytest.raises(TvmseqError, match="not a tuning database"):
        tune_model.relax_pipeline(__import__("tvm").target.Target("llvm"), tmp_path)
    with pytest.raises(TvmseqError, match="--trials"):
        tune_model.tune_model(_linear_model(), target="llvm", trials=0)
    with pytest.raises(TvmseqError, match="cost-model"):
        tune_model.resolve_cost_model("best")
    assert cli.main(["tune", str(tmp_path / "missing.onnx")]) == 2
    assert cli.main(["tune", "nothing_such"]) == 2
    assert "expected a model" in capsys.readouterr().err
