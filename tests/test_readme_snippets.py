"""The README's Python snippets run as written on a CPU: every ```python block, statement by statement, in one
namespace holding `tvmseq` and the inputs the snippets name (a bidirectional GRU `model.onnx` in the working directory, its
feeds, weights, logits, a float64 scipy CSR matrix ...), and the inline `tvmseq.artifacts.find_kernel(...)`
example against a CPU artifact built for it. Statements that need a GPU (`target="cuda"`) are skipped by name.
The results are then checked against numpy / tvmseq.reference."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_ONLY = ('target="cuda"',)   # statements with these run only where a GPU is


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def statements(block: str) -> list[str]:
    """The block's top-level statements as source (a snippet line may hold several, joined by ';')."""
    return [ast.get_source_segment(block, node) for node in ast.parse(block).body]


def run_statement(source: str, namespace: dict) -> None:
    """exec, keeping an expression statement's value in namespace['_'] (as the REPL does) so it can be checked."""
    node = ast.parse(source).body[0]
    if isinstance(node, ast.Expr):
        namespace["_"] = eval(compile(ast.Expression(node.value), "README.md", "eval"), namespace)
    else:
        exec(compile(source, "README.md", "exec"), namespace)


@pytest.fixture
def snippet_inputs(tmp_path, monkeypatch):
    """What the snippets name, in a fresh working directory."""
    import scipy.sparse

    from tvmseq import models

    monkeypatch.chdir(tmp_path)
    model, feeds = models.rnn_node_model("GRU", seq=7, batch=3, input_size=5, hidden=6, direction="bidirectional",
                                         linear_before_reset=1, with_seq_lens=True)
    feeds["sequence_lens"] = np.array([7, 4, 1], np.int32)
    onnx.save(model, tmp_path / "model.onnx")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    rng = np.random.default_rng(1)
    return dict(x=feeds["X"], lens=feeds["sequence_lens"], X=feeds["X"], W=weights["W"], R=weights["R"],
                B=weights["B"], sequence_lens=feeds["sequence_lens"], initial_h=None,
                logits=rng.standard_normal((2, 4, 37)).astype(np.float32),
                beam_scores=rng.standard_normal((2, 4)).astype(np.float32),
                scipy_csr=scipy.sparse.random(23, 19, density=0.2, format="csr", random_state=3),   # float64
                D=rng.standard_normal((23, 5)).astype(np.float32))


def test_readme_python_blocks_run_on_cpu(snippet_inputs):
    import tvmseq

    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    namespace = dict(snippet_inputs, tvmseq=tvmseq)   # a one-line snippet assumes `import tvmseq` done
    results = {}
    skipped = []
    for block in blocks:
        for source in statements(block):
            if any(mark in source for mark in GPU_ONLY):
                skipped.append(source)
                continue
            run_statement(source, namespace)
            for name in ("tvmseq.reference.gru", "sparse.spmm_t"):
                if name in source:
                    results[name] = namespace["_"]
    assert skipped, "no GPU-only statement found: update GPU_ONLY if the README changed"

    want_y, want_h = tvmseq.reference.gru(namespace["X"], namespace["W"], namespace["R"], namespace["B"],
                                          namespace["sequence_lens"], None, direction="bidirectional",
                                          linear_before_reset=1)
    if "y" in namespace:   # the model snippet's outputs against the ONNX reference
        np.testing.assert_allclose(namespace["y"], want_y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(namespace["y_h"], want_h, rtol=1e-4, atol=1e-5)
    if "tvmseq.reference.gru" in results:
        assert results["tvmseq.reference.gru"][1].shape == want_h.shape
    if "sparse.spmm_t" in results:   # S^T D from the float64 scipy matrix, converted to float32 by as_csr
        want = namespace["scipy_csr"].T @ namespace["D"].astype(np.float64)
        np.testing.assert_allclose(np.asarray(results["sparse.spmm_t"]), want, rtol=1e-4, atol=1e-5)
    if "token_ids" in namespace:   # the fused beam step against numpy
        logp = namespace["logits"] - np.log(np.exp(namespace["logits"]).sum(-1, keepdims=True))
        total = (logp + namespace["beam_scores"][..., None]).reshape(2, -1)
        best = np.argsort(-total, axis=1, kind="stable")[:, :4]
        np.testing.assert_array_equal(namespace["beam_ids"] * 37 + namespace["token_ids"], best)
        np.testing.assert_allclose(namespace["scores"], np.take_along_axis(total, best, 1), rtol=1e-5, atol=1e-5)


def test_readme_find_kernel_example_runs_on_cpu(tmp_path, monkeypatch):
    """The prose's `tvmseq.artifacts.find_kernel(...)` call, as written, finds a CPU artifact built for exactly
    that request (via $TVMSEQ_ARTIFACTS's root) and the kernel it returns computes the top-k."""
    import tvmseq
    from tvmseq import prebuild
    from onnx import TensorProto, helper, numpy_helper

    calls = re.findall(r"`(tvmseq\.artifacts\.find_kernel\(.*?\))`", README.read_text())
    assert calls, "README.md no longer shows a find_kernel example"
    call = calls[0]
    shapes = ast.literal_eval(call[call.index("{"):call.index("}") + 1])
    rows, n, k = shapes["rows"], shapes["n"], shapes["k"]
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=-1)], "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, n])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("indices", TensorProto.INT64, None)],
        initializer=[numpy_helper.from_array(np.array([k], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    onnx.save(model, tmp_path / "topk.onnx")
    report = prebuild.build([str(tmp_path / "topk.onnx")], arch="cpu", out=str(tmp_path / "artifacts"))
    assert not report.failed, report.failed
    monkeypatch.setattr(tvmseq.artifacts, "ARTIFACTS_ROOT", tmp_path / "artifacts")
    kernel = eval(call, {"tvmseq": tvmseq})
    assert kernel is not None, f"{call} found nothing in the CPU artifacts built for it"
    x = np.random.default_rng(0).standard_normal((rows, n)).astype(np.float32)
    got = kernel(x)
    values = np.asarray(got[0] if isinstance(got, (tuple, list)) else got)
    np.testing.assert_allclose(values, -np.sort(-x, axis=1)[:, :k], rtol=1e-6)
