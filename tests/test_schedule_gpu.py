"""tvmseq's GPU schedule rules for stock operators (`tvmseq.schedule_gpu`), on the CPU: which PrimFuncs a rule
takes, that its schedule lowers and compiles for CUDA, and what it computes (the CUDA schedule run on the CPU
with its thread bindings made serial: `blocks.emulate_cuda_module`). The GPU run of the same kernels is in
`tvmseq bench model` (every output checked against onnxruntime)."""
import math
import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tests import blocks
from tvmseq import schedule_gpu, targets


def fc_reference(x, w, b, activation):
    """numpy: activation(x @ w + b), float64."""
    y = x.astype(np.float64) @ w.astype(np.float64) + b
    return {"relu": lambda v: np.maximum(v, 0), "sigmoid": lambda v: 1 / (1 + np.exp(-v)), None: lambda v: v}[
        activation](y)


def _fc_module(lead: tuple, k: int, n: int, activation, seed: int = 0):
    """Relax: x [*lead, k] -> activation(x @ W + b), W [k, n] and b constants (an exported FC layer); a str in
    `lead` is a symbolic dim (frames)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    bb = relax.BlockBuilder()
    lead = [tvm.tirx.Var(d, "int64") if isinstance(d, str) else d for d in lead]
    x = relax.Var("x", relax.TensorType([*lead, k], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, relax.const(w)), relax.const(b)))
            if activation == "relu":
                y = bb.emit(relax.op.nn.relu(y))
            elif activation == "sigmoid":
                y = bb.emit(relax.op.sigmoid(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get(), w, b


def _fused_prim_funcs(mod):
    cuda = targets.resolve("cuda")
    with cuda:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FoldConstant(), relax.transform.FuseOps(),
                                        relax.transform.FuseTIR()])(mod)
    return [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("activation", ["relu", "sigmoid", None])
@pytest.mark.parametrize("lead,k,n", [((1, 8), 600, 600), ((1, 3), 37, 257), ((2,), 100, 16), ((16,), 161, 33),
                                      ((2, 2, 2), 64, 100)])
def test_small_rows_matmul_computes_the_fc(lead, k, n, activation):
    mod, w, b = _fc_module(lead, k, n, activation)
    rule = schedule_gpu.SmallRowsMatmul()
    cuda = targets.resolve("cuda")
    (func,) = _fused_prim_funcs(mod)
    with cuda:
        sch = rule.apply(func, cuda, False)
    assert sch is not None
    assert schedule_gpu.lowering_error(sch.mod["main"].with_attr("tirx.is_scheduled", True), cuda) is None
    x = np.random.default_rng(1).standard_normal((*lead, k)).astype("float32")
    got = blocks.emulate_cuda_module(mod, {"x": x})
    np.testing.assert_allclose(got, fc_reference(x, w, b, activation), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lead,k,n,why", [((1, 1), 600, 600, "one row: dlight's GEMV"),
                                          ((17,), 64, 64, "more rows than MAX_ROWS"),
                                          ((8,), 64, 8, "fewer columns than a block's")])
def test_small_rows_matmul_leaves_other_matmuls(lead, k, n, why):
    mod, _, _ = _fc_module(lead, k, n, "relu")
    (func,) = _fused_prim_funcs(mod)
    cuda = targets.resolve("cuda")
    with cuda:
        assert schedule_gpu.SmallRowsMatmul().apply(func, cuda, False) is None, why


def test_small_rows_matmul_compiles_for_cuda():
    """The rule is first in the GPU pipeline: an 8-row FC compiles to one kernel with its k shares on
    threadIdx.y and the partial sums in shared memory."""
    mod, _, _ = _fc_module((1, 8), 600, 600, "relu")
    ex = tvm.compile(mod, target=targets.resolve("cuda"), relax_pipeline=schedule_gpu.pipeline(targets.resolve("cuda")))
    source = ex.mod.imports[0].imports[0].inspect_source() if ex.mod.imports[0].imports else \
        ex.mod.imports[0].inspect_source()
    assert "threadIdx.y" in source and "__shared__" in source


@pytest.mark.parametrize("frames,k,n", [(100, 161, 400), (37, 600, 161), (19, 33, 70)])
def test_matmul_tile_of_symbolic_and_many_rows(frames, k, n):
    """An FC over a symbolic frame count (or over more rows than SmallRowsMatmul takes) gets dlight's Matmul
    with tvmseq's CUDA tile (`schedule_gpu.Matmul`: 16 rows x 64 columns x 32 k; dlight's own 32 x 64 x 16 left
    28-76 blocks at 100 frames), and its schedule lowers. What it computes is checked on the GPU (the GPU model
    tests and `tvmseq bench model` against onnxruntime): `blocks.emulate_cuda_module` cannot lower dlight's
    Matmul kernels for the CPU."""
    cuda = targets.resolve("cuda")
    for lead in (("T", 1), (frames, 1)):
        mod, _, _ = _fc_module(lead, k, n, "relu")
        (func,) = _fused_prim_funcs(mod)
        with cuda:
            assert schedule_gpu.SmallRowsMatmul().apply(func, cuda, False) is None
            scheduled = schedule_gpu.Matmul().apply(func, cuda, False).mod["main"]
        text = scheduled.script()
        rows = r"\(T\w* \+ T\.int64\(15\)\) // T\.int64\(16\)" if lead[0] == "T" else \
            re.escape(f'T.thread_binding(T.int64({-(-frames // 16)}), thread="blockIdx.x")')
        assert re.search(rows, text), text                                               # 16-row tiles
        assert f"in range(T.int64({-(-k // 32)}))" in text, text                          # 32 k a step
        assert schedule_gpu.lowering_error(scheduled.with_attr("tirx.is_scheduled", True), cuda) is None


@pytest.mark.parametrize("lead,many", [(("T", 32), True), (("T", 64), True), ((4096,), True), (("T", 8), False),
                                       ((100,), False), ((32, 1), False)])
def test_matmul_keeps_dlight_tile_for_many_rows(lead, many):
    """From a batch of 32 frames (a symbolic frame count times a static batch of 32 or more) or 2048 static rows
    the FC keeps dlight's own 32-row tile (`schedule_gpu.Matmul.MANY_ROWS_*`: the small tile measured 3-6% slower
    at 32,000 rows)."""
    mod, _, _ = _fc_module(lead, 96, 128, None)
    (func,) = _fused_prim_funcs(mod)
    cuda = targets.resolve("cuda")
    with cuda:
        text = schedule_gpu.Matmul().apply(func, cuda, False).mod["main"].script()
    assert ("in range(T.int64(6))" in text) == many, text      # dlight: 96 k in 16-k steps; the small tile: 32


# ---------------------------------------------------------------------------------------------------
# SmallReduction: one thread an output where each output sums a few products
# ---------------------------------------------------------------------------------------------------
def _conv_feeds(x_shape, w_shape, feeds_shape, seed, **attrs):
    return blocks._conv("Conv", x_shape, w_shape, feeds_shape, seed=seed, **attrs)


@pytest.mark.parametrize("x_shape,w_shape,feeds_shape,attrs", [
    (["N", 1, 64], [8, 1, 5], [37, 1, 64], dict(strides=[2], kernel_shape=[5])),        # a VAD's first conv1d
    (["N", 8, 30], [16, 8, 5], [19, 8, 30], dict(strides=[2], kernel_shape=[5])),       # its second: 40 products
    (["N", 1, 9, 23], [5, 1, 3, 3], [2, 1, 9, 23], dict(pads=[1, 1, 1, 1], kernel_shape=[3, 3])),  # a CRNN's first
    ([1, 3, 11, 13], [7, 3, 3, 3], [1, 3, 11, 13], dict(strides=[1, 2], kernel_shape=[3, 3], dilations=[2, 1])),
])
def test_small_reduction_computes_the_conv(x_shape, w_shape, feeds_shape, attrs, caplog):
    model, feeds = _conv_feeds(x_shape, w_shape, feeds_shape, 11, **attrs)
    with caplog.at_level("DEBUG", logger="tvmseq.schedule_gpu"):
        got = blocks.emulate_cuda_schedule(model, feeds)
    np.testing.assert_allclose(got, blocks.onnxruntime_outputs(model, feeds)["Y"], **blocks.TOL)
    assert re.search(r"SmallReduction scheduled \S*conv", caplog.text)


def _conv2d_module(x_shape):
    """Relax: relu(conv2d(x, W 5 x 1 x 3 x 3, padding 1) + b) with a str in `x_shape` a symbolic dim."""
    rng = np.random.default_rng(3)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var(d, "int64") if isinstance(d, str) else d for d in x_shape],
                                        "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(rng.standard_normal((5, 1, 3, 3)).astype("float32")),
                                           padding=1))
            y = bb.emit(relax.op.add(y, relax.const(rng.standard_normal((1, 5, 1, 1)).astype("float32"))))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(y)))
        bb.emit_func_output(out)
    return bb.get()


def test_small_reduction_divides_no_index_by_a_run_time_inner_extent():
    """A conv over a line of run-time width (a CRNN built for any number of frames): its width over the threads,
    the other output axes on the grid, no thread index divided by the width; a run-time batch (the outermost
    axis): one fused index, divided by constants only. Both compute the conv (run serially on the CPU)."""
    cuda = targets.resolve("cuda")
    (width,) = _fused_prim_funcs(_conv2d_module([2, 1, 9, "W"]))
    (batch,) = _fused_prim_funcs(_conv2d_module(["N", 1, 9, 23]))
    with cuda:
        by_width = schedule_gpu.SmallReduction().apply(width, cuda, False)
        by_batch = schedule_gpu.SmallReduction().apply(batch, cuda, False)
    text = by_width.mod["main"].script()
    assert re.search(r'thread_binding\(\(W \+ T\.int64\(255\)\) // T\.int64\(256\), thread="blockIdx\.x"\)', text), text
    assert not re.search(r"[/%] W\b", text.split("T.where")[0]), "an index divided by the run-time width"
    assert by_batch is not None
    rng = np.random.default_rng(3)                     # _conv2d_module's weights
    w, b = rng.standard_normal((5, 1, 3, 3)).astype("float32"), rng.standard_normal(5).astype("float32")
    for sch, shape, size in ((by_width, (2, 1, 9, 37), 37), (by_batch, (3, 1, 9, 23), 3)):
        scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        assert schedule_gpu.lowering_error(scheduled, cuda) is None
        x = np.random.default_rng(size).standard_normal(shape).astype("float32")
        xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
        want = sum(xp[:, :, i:i + shape[2], j:j + shape[3]] * w[None, :, 0, i, j, None, None]
                   for i in range(3) for j in range(3))
        want = np.maximum(want + b[None, :, None, None], 0)
        out = tvm.runtime.tensor(np.zeros(want.shape, "float32"))
        consts = [tvm.runtime.tensor(w), tvm.runtime.tensor(b.reshape(1, 5, 1, 1))]   # folded into params
        _run_serial(scheduled, [tvm.runtime.tensor(x), *consts, out])
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_small_reduction_leaves_larger_sums_and_two_reductions():
    cuda = targets.resolve("cuda")
    (matmul,) = _fused_prim_funcs(_fc_module((1000,), schedule_gpu.SmallReduction.MAX_PRODUCTS + 1, 64, "relu")[0])
    (small,) = _fused_prim_funcs(_fc_module((1000,), schedule_gpu.SmallReduction.MAX_PRODUCTS, 64, "relu")[0])
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1000, 16], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(x)))
        bb.emit_func_output(out)
    softmax = _fused_prim_funcs(bb.get())
    rule = schedule_gpu.SmallReduction()
    with cuda:
        assert rule.apply(matmul, cuda, False) is None        # 65 products an output: dlight's Matmul
        assert rule.apply(small, cuda, False) is not None     # 64
        assert all(rule.apply(f, cuda, False) is None for f in softmax)   # max, then sum: two reductions


# PLCMOS's first pool as TVM legalizes it: max 1 x 4, stride 1 x 4 over [1, 32, frames - 2, 257] (a dilated conv's
# output height: an expression of the symbolic frame count)
POOL_OVER_AN_EXPRESSION = """
@T.prim_func(private=True, s_tir=True)
def main(lv3: T.Buffer((T.int64(1), T.int64(32), "frames - T.int64(2)", T.int64(257)), "float32"), frames: T.int64,
         pool_max: T.Buffer((T.int64(1), T.int64(32), frames - T.int64(2), T.int64(64)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    for ax0, ax1, ax2, ax3, rv0, rv1 in T.grid(T.int64(1), T.int64(32), frames - T.int64(2), T.int64(64),
                                               T.int64(1), T.int64(4)):
        with T.sblock("pool_max"):
            v_ax0, v_ax1, v_ax2, v_ax3, v_rv0, v_rv1 = T.axis.remap("SSSSRR", [ax0, ax1, ax2, ax3, rv0, rv1])
            T.reads(lv3[v_ax0, v_ax1, v_ax2 + v_rv0, v_ax3 * T.int64(4) + v_rv1])
            T.writes(pool_max[v_ax0, v_ax1, v_ax2, v_ax3])
            with T.init():
                pool_max[v_ax0, v_ax1, v_ax2, v_ax3] = T.float32(-3.4e38)
            pool_max[v_ax0, v_ax1, v_ax2, v_ax3] = T.max(pool_max[v_ax0, v_ax1, v_ax2, v_ax3],
                                                         lv3[v_ax0, v_ax1, v_ax2 + v_rv0, v_ax3 * T.int64(4) + v_rv1])
"""


def test_pool_over_a_symbolic_expression_gets_a_grid():
    """dlight's Fallback raises on that pool (its fuse cannot prove a split of (64 frames - 128) x 64 divisible),
    and the last resort ran it on one GPU thread (12 ms of PLCMOS's call): UnfusedSpatial gives it 32 x (frames - 2)
    blocks, each thread reducing its own output."""
    cuda = targets.resolve("cuda")
    func = tvm.script.from_source(POOL_OVER_AN_EXPRESSION)
    with cuda:
        with pytest.raises(Exception, match="divisible"):
            tvm.s_tir.dlight.gpu.Fallback().apply(func, cuda, False)
        sch = schedule_gpu.UnfusedSpatial().apply(func, cuda, False)
    assert sch is not None
    text = sch.mod["main"].script()
    assert re.search(r'T\.thread_binding\(T\.int64\(32\), thread="blockIdx\.y"\)', text)
    assert schedule_gpu.lowering_error(sch.mod["main"].with_attr("tirx.is_scheduled", True), cuda) is None
    serial = tvm.script.from_source(re.sub(r'T\.thread_binding\((.*?), thread="[^"]+"\)', r"T.serial(\1)", text))
    run = tvm.compile(tvm.IRModule({"main": serial.with_attr("global_symbol", "main")}), target="llvm")["main"]
    for frames in (7, 12):
        x = np.random.default_rng(frames).standard_normal((1, 32, frames - 2, 257)).astype("float32")
        out = tvm.runtime.tensor(np.zeros((1, 32, frames - 2, 64), "float32"))
        run(tvm.runtime.tensor(x), frames, out)
        np.testing.assert_array_equal(out.numpy(), x[..., :256].reshape(1, 32, frames - 2, 64, 4).max(-1))


# a CRNN's first pool at batch 8 as TVM legalizes it: max 2 x 2, stride 2 x 2 over [8, 32, 32, width]
POOL_OF_A_BATCH = """
@T.prim_func(private=True, s_tir=True)
def main(x: T.Buffer((T.int64(8), T.int64(32), T.int64(32), "width"), "float32"), width: T.int64,
         pool_max: T.Buffer((T.int64(8), T.int64(32), T.int64(16), width // T.int64(2)), "float32")):
    T.func_attr({"op_pattern": 4, "tirx.noalias": True})
    for ax0, ax1, ax2, ax3, rv0, rv1 in T.grid(T.int64(8), T.int64(32), T.int64(16), width // T.int64(2),
                                               T.int64(2), T.int64(2)):
        with T.sblock("pool_max"):
            v_ax0, v_ax1, v_ax2, v_ax3, v_rv0, v_rv1 = T.axis.remap("SSSSRR", [ax0, ax1, ax2, ax3, rv0, rv1])
            T.reads(x[v_ax0, v_ax1, v_ax2 * T.int64(2) + v_rv0, v_ax3 * T.int64(2) + v_rv1])
            T.writes(pool_max[v_ax0, v_ax1, v_ax2, v_ax3])
            with T.init():
                pool_max[v_ax0, v_ax1, v_ax2, v_ax3] = T.float32(-3.4e38)
            pool_max[v_ax0, v_ax1, v_ax2, v_ax3] = T.max(pool_max[v_ax0, v_ax1, v_ax2, v_ax3],
                                                         x[v_ax0, v_ax1, v_ax2 * T.int64(2) + v_rv0,
                                                           v_ax3 * T.int64(2) + v_rv1])
"""


@pytest.mark.parametrize("rule", ["SerialReduction", "UnfusedSpatial"])
def test_pool_of_a_batch_gets_a_grid_of_every_static_axis(rule):
    """Four output loops (batch, channel, height, a run-time width): the grid took the batch alone (8 blocks, each
    looping over 32 x 16 rows: a CRNN's pool 0.29 ms at batch 8, 100 frames on the H200); now every static output
    axis is on the grid (SerialReduction: batch x channel fused on blockIdx.z, the height on y, the width's blocks
    on x)."""
    cuda = targets.resolve("cuda")
    func = tvm.script.from_source(POOL_OF_A_BATCH)
    with cuda:
        sch = getattr(schedule_gpu, rule)().apply(func, cuda, False)
    assert sch is not None
    text = sch.mod["main"].script()
    grid = dict((axis, extent) for extent, axis in re.findall(r'T\.thread_binding\((.*?), thread="(blockIdx\.[xyz])"\)',
                                                                 text))
    static = [int(e[len("T.int64("):-1]) for e in grid.values() if re.fullmatch(r"T\.int64\(\d+\)", e)]
    assert math.prod(static) == 8 * 32 * 16, grid
    assert schedule_gpu.lowering_error(sch.mod["main"].with_attr("tirx.is_scheduled", True), cuda) is None
    for width in (6, 9):
        x = np.random.default_rng(width).standard_normal((8, 32, 32, width)).astype("float32")
        out = tvm.runtime.tensor(np.zeros((8, 32, 16, width // 2), "float32"))
        _run_serial(sch.mod["main"], [tvm.runtime.tensor(x), width, out])
        w = width // 2 * 2
        np.testing.assert_array_equal(out.numpy(), x[..., :w].reshape(8, 32, 16, 2, width // 2, 2).max((3, 5)))


# ---------------------------------------------------------------------------------------------------
# SerialReduction: the reductions dlight's GEMM and reduction rules leave, one thread an output, sum in a register
# ---------------------------------------------------------------------------------------------------
def _conv1d_module(length, w_shape, stride):
    """Relax: conv1d(x [1, in, length], W constant, stride), `length` a function of the symbolic T."""
    rng = np.random.default_rng(4)
    bb = relax.BlockBuilder()
    t = tvm.tirx.Var("T", "int64")
    x = relax.Var("x", relax.TensorType([1, w_shape[1], length(t)], "float32"))
    w = rng.standard_normal(w_shape).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.conv1d(x, relax.const(w), strides=stride)))
        bb.emit_func_output(out)
    return bb.get(), w


def _run_serial(func, args):
    """A scheduled PrimFunc run on the CPU with its thread bindings serial, thread-local buffers global."""
    text = re.sub(r'T\.thread_binding\((.*?), thread="[^"]+"\)', r"T.serial(\1)", func.script())
    text = text.replace('scope="local"', 'scope="global"')
    run = tvm.compile(tvm.IRModule({"main": tvm.script.from_source(text).with_attr("global_symbol", "main")}),
                      target="llvm")["main"]
    run(*args)


@pytest.mark.parametrize("length,w_shape,stride", [
    (lambda t: t + 256, [19, 1, 256], 64),      # silero v3's STFT (258 channels there), after its reflection pad
    (lambda t: t, [5, 3, 96], 3),
])
def test_serial_reduction_sums_each_output_in_a_register(length, w_shape, stride):
    """A conv1d of many taps over a run-time length: SmallReduction leaves it (more than 64 products, a run-time
    inner axis). In silero v3 dlight's Matmul tile did not lower (a thread-local buffer of symbolic size) and its
    Fallback, next, summed into global memory: the output read and written once a product. SerialReduction's
    sum is a thread-local buffer of one value, stored once, and computes the conv (run serially on the CPU)."""
    cuda = targets.resolve("cuda")
    mod, w = _conv1d_module(length, w_shape, stride)
    (conv,) = _fused_prim_funcs(mod)
    with cuda:
        assert schedule_gpu.SmallReduction().apply(conv, cuda, False) is None
        sch = schedule_gpu.SerialReduction().apply(conv, cuda, False)
        fallback = tvm.s_tir.dlight.gpu.Fallback().apply(conv, cuda, False)
    scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    assert schedule_gpu.lowering_error(scheduled, cuda) is None
    assert re.search(r'alloc_buffer\(.*scope="local"\)', scheduled.script())
    assert 'scope="local"' not in fallback.mod["main"].script()
    for t in (300, 1000):
        x = np.random.default_rng(t).standard_normal((1, w_shape[1], int(length(t)))).astype("float32")
        frames = (x.shape[2] - w_shape[2]) // stride + 1
        out = tvm.runtime.tensor(np.zeros((1, w_shape[0], frames), "float32"))
        sizes = [t] if len(scheduled.params) == 4 else []        # T a parameter where no buffer's dim is T alone
        _run_serial(scheduled, [tvm.runtime.tensor(x), tvm.runtime.tensor(w), *sizes, out])
        windows = np.stack([x[0, :, f * stride:f * stride + w_shape[2]] for f in range(frames)])   # [F, in, taps]
        want = np.einsum("fit,oit->of", windows.astype(np.float64), w.astype(np.float64))[None]
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


def test_serial_reduction_comes_before_dlights_fallback():
    names = [type(rule).__name__ for rule in schedule_gpu.default_rules()]
    assert names.index("SerialReduction") < names.index("Fallback")
    assert names.index("GeneralReduction") < names.index("SerialReduction")


def _if_then_elementwise():
    """x -> If(constant true: x + 1, else x - 1) -> * 2 -> Relu -> Sigmoid: the If decided at import."""
    from onnx import TensorProto, helper, numpy_helper

    then = helper.make_graph([helper.make_node("Add", ["x", "one"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Sub", ["x", "one"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("If", ["yes"], ["r"], then_branch=then, else_branch=other),
             helper.make_node("Mul", ["r", "two"], ["m"]), helper.make_node("Relu", ["m"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["y"])]
    inits = [numpy_helper.from_array(np.float32(1), "one"), numpy_helper.from_array(np.float32(2), "two"),
             numpy_helper.from_array(np.array(True), "yes")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_ops_of_a_graph_with_an_if_fuse_on_cuda():
    """TVM's importer builds `main` without a dataflow block when the graph has an If, even one the importer
    decides and inlines (silero v3's, on a static dim; here the ONNX-level folding that would remove it first
    is off), and FuseOps fuses only inside one: the four elementwise ops were four kernels (silero v3: 351
    launches a call)."""
    import tvmseq

    cuda = targets.resolve("cuda")
    mod = tvmseq.from_onnx(_if_then_elementwise(), target=cuda, fold=False)
    assert "R.dataflow" not in mod["main"].script()
    with cuda:
        lowered = tvm.transform.Sequential(schedule_gpu.legalize_passes(cuda))(mod)
    assert lowered["main"].script().count("R.call_tir") == 1
    x = np.random.default_rng(0).standard_normal((3, 5)).astype("float32")
    np.testing.assert_allclose(blocks.emulate_cuda_module(mod, {"x": x}), 1 / (1 + np.exp(-np.maximum(2 * (x + 1), 0))),
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Transpose: a block that reads an input along another innermost axis than it writes, through shared tiles
# ---------------------------------------------------------------------------------------------------
def _permute_relu_module(shape, perm):
    """Relax: relu(permute_dims(x, perm)), a str in `shape` a symbolic dim."""
    bb = relax.BlockBuilder()
    dims = [tvm.tirx.Var(d, "int64") if isinstance(d, str) else d for d in shape]
    x = relax.Var("x", relax.TensorType(dims, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.relu(bb.emit(relax.op.permute_dims(x, perm)))))
        bb.emit_func_output(out)
    return bb.get()


def _shared_sizes(func, target) -> list:
    """Floats of each shared buffer `func` allocates once lowered for `target`."""
    import tvm_ffi

    with target:
        mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}))
        lowered = tvm.tirx.get_default_tir_pipeline(target)[0](mod)
    sizes = []

    def visit(node):
        if node.buffer.scope() == "shared":
            sizes.append(math.prod(int(d) for d in node.buffer.shape))
        return node

    for _, fn in lowered.functions_items():
        tvm_ffi.structural_map(fn, [(tvm.tirx.AllocBuffer, visit)])
    return sizes


@pytest.mark.parametrize("shape,perm,sizes", [
    ((8, 16, "W", 64), (0, 3, 1, 2), (45, 3)),   # a conv's rows of positions x channels back to channels first
    ((8, 256, "W"), (2, 0, 1), (45, 7)),         # a CRNN's features [batch, channels, width] to [width, batch, ..]
    ((3, "T", 37), (0, 2, 1), (70, 33)),
    ((2, 40, 33), (2, 0, 1), ()),
])
def test_transpose_goes_through_shared_tiles(shape, perm, sizes):
    """Reads along the input's innermost axis, writes along the output's, a run-time size anywhere; the tile's
    shared buffer of static size (CUDA cannot allocate another) with its rows padded to TILE + 1 floats."""
    cuda = targets.resolve("cuda")
    (func,) = _fused_prim_funcs(_permute_relu_module(shape, perm))
    with cuda:
        sch = schedule_gpu.Transpose().apply(func, cuda, False)
    assert sch is not None
    scheduled = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    assert schedule_gpu.lowering_error(scheduled, cuda) is None
    assert 'scope="shared"' in scheduled.script()
    assert _shared_sizes(scheduled, cuda) == [32 * 33], "one tile, rows padded to 33 floats"
    grid = re.findall(r'T\.thread_binding\((.*?), thread="blockIdx\.([xyz])"\)', scheduled.script())
    assert sorted(axis for _, axis in grid) == ["x", "y", "z"] and all("T.int64(" in e for e, a in grid if a != "x"), \
        f"every tile on the grid, a run-time extent on blockIdx.x: {grid}"
    text = scheduled.script().replace('scope="shared"', 'scope="global"')
    for size in sizes or (None,):
        x = np.random.default_rng(size).standard_normal([size if isinstance(d, str) else d for d in shape])
        x = x.astype("float32")
        want = np.maximum(x.transpose(perm), 0)
        out = tvm.runtime.tensor(np.zeros(want.shape, "float32"))
        args = [tvm.runtime.tensor(x), out] if len(scheduled.params) == 2 else [tvm.runtime.tensor(x), size, out]
        _run_serial(tvm.script.from_source(text), args)
        np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("shape,perm", [((8, 16, 64), (1, 0, 2)), ((8, 4, 64), (0, 2, 1))])
def test_transpose_leaves_the_same_innermost_axis_and_short_axes(shape, perm):
    """The same innermost axis on both sides reads rows already (dlight's Fallback is coalesced there); an axis of
    4 would fill 4 of a tile's 32 rows."""
    cuda = targets.resolve("cuda")
    (func,) = _fused_prim_funcs(_permute_relu_module(shape, perm))
    with cuda:
        assert schedule_gpu.Transpose().apply(func, cuda, False) is None


def test_transpose_comes_before_dlights_fallback():
    names = [type(rule).__name__ for rule in schedule_gpu.default_rules()]
    assert names.index("SerialReduction") < names.index("Transpose") < names.index("Fallback")
