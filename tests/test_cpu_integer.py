"""Integer convs / matmuls as dot products of int16 pairs on the CPU (`kernels.integer.pairs`, `cpu_ops`)."""
import numpy as np
import pytest


def conv_reference(x, w, stride, dilation, pads):
    """int64 NCHW conv of x [N, C, H, W] and w [O, C, KH, KW]; pads: top, bottom, left, right."""
    top, bottom, left, right = pads
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    O, _, KH, KW = w.shape
    OH = (xp.shape[2] - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    OW = (xp.shape[3] - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    y = np.zeros((x.shape[0], O, OH, OW), np.int64)
    for kh in range(KH):
        for kw in range(KW):
            y0, x0 = kh * dilation[0], kw * dilation[1]
            patch = xp[:, :, y0: y0 + stride[0] * (OH - 1) + 1: stride[0], x0: x0 + stride[1] * (OW - 1) + 1: stride[1]]
            y += np.einsum("nchw,oc->nohw", patch, w[:, :, kh, kw].astype(np.int64))
    return y


def _host_has(feature: str) -> bool:
    from tvm.target import codegen

    from tvmseq import targets

    return bool(codegen.target_has_features(feature, targets.host_cpu_target()))


def _instruction(name: str) -> str:
    if not _host_has({"avx512bw": "avx512bw", "avx2": "avx2"}.get(name, "avx512vnni")):
        pytest.skip(f"this CPU has no {name}")
    return name


def _run(func, name, *arrays, out_shape, out_dtype):
    import tvm

    from tvmseq import targets

    lib = tvm.compile(func, target=targets.host_cpu_target())
    out = tvm.runtime.empty(out_shape, out_dtype)
    lib[name](*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


def _pairs_of(x, pads):
    """x [N, C, H, W] -> int16 [N, ceil(C/2), H', W', 2] (the kernel's data layout, numpy)."""
    top, bottom, left, right = pads
    N, C, H, W = x.shape
    padded = np.zeros((N, C + C % 2, H + top + bottom, W + left + right), np.int16)
    padded[:, :C, top: top + H, left: left + W] = x
    return padded.reshape(N, -1, 2, *padded.shape[2:]).transpose(0, 1, 3, 4, 2).copy()


@pytest.mark.parametrize("instruction", ["vnni", "avx512bw", "avx2"])
@pytest.mark.parametrize("N,C,O,K,stride,dilation,H", [
    (1, 1, 24, 3, (2, 2), (1, 1), 9),       # one input channel (an odd pair), 24 channels: a partial vector
    (2, 5, 37, 3, (1, 2), (1, 1), 4),       # odd channels in and out, batch 2, strides unequal
    (1, 48, 192, 3, (1, 1), (1, 1), 3),     # ddddocr's 48 -> 192 (4 vectors a block, 6 columns a tile)
    (1, 7, 50, 1, (1, 1), (1, 1), 2),       # 1 x 1, 4 vectors (50 channels) in blocks of 2
    (1, 9, 33, 3, (1, 1), (2, 2), 6),       # dilation 2, 3 vectors
])
def test_pair_conv_equals_exact_sums(instruction, N, C, O, K, stride, dilation, H):
    from tvmseq.kernels.integer.pairs import PairTile, pack_weight, pair_conv2d_func

    isa = _instruction(instruction)
    rng = np.random.default_rng(C * 1000 + O)
    w = rng.integers(-255, 256, (O, C, K, K)).astype(np.int16)
    tile = PairTile.for_channels(O, isa)
    func = pair_conv2d_func(C, O, K, K, stride, dilation, tile, isa)
    pads = [dilation[0] * (K // 2)] * 2 + [dilation[1] * (K // 2)] * 2
    # widths whose output columns leave every tail (ow % columns = 0 .. columns - 1) at this stride
    for width in range(1, 2 * stride[1] * tile.columns + 2, stride[1]):
        x = rng.integers(-255, 256, (N, C, H, width)).astype(np.int16)
        want = conv_reference(x, w, stride, dilation, pads)
        got = _run(func, "pair_conv", _pairs_of(x, pads), pack_weight(w, tile), out_shape=want.shape,
                   out_dtype="int32")
        np.testing.assert_array_equal(got, want, err_msg=f"width {width}")


@pytest.mark.parametrize("instruction", ["vnni", "avx2"])
def test_pair_conv_sums_wrap_as_int32(instruction):
    """The pairs' products are exact and their sums wrap in int32 as the int32 sums they replace do: 256 input
    channels of -32768 x -32768 overflow int32."""
    from tvmseq.kernels.integer.pairs import PairTile, pack_weight, pair_conv2d_func

    isa = _instruction(instruction)
    C, O = 256, 16
    x = np.full((1, C, 1, 3), -32768, np.int16)
    w = np.full((O, C, 1, 1), -32768, np.int16)
    tile = PairTile.for_channels(O, isa)
    got = _run(pair_conv2d_func(C, O, 1, 1, tile=tile, isa=isa), "pair_conv", _pairs_of(x, [0] * 4),
               pack_weight(w, tile), out_shape=(1, O, 1, 3), out_dtype="int32")
    np.testing.assert_array_equal(got, conv_reference(x, w, (1, 1), (1, 1), [0] * 4).astype(np.int32))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16])
@pytest.mark.parametrize("C,pads", [(1, (1, 1, 1, 1)), (6, (0, 0, 0, 0)), (5, (2, 0, 1, 3))])
def test_image_pairs_is_the_kernels_layout(dtype, C, pads):
    from tvmseq.kernels.integer.pairs import image_pairs_func, pair_count

    info = np.iinfo(dtype)
    x = np.random.default_rng(C).integers(info.min, info.max + 1, (2, C, 3, 7)).astype(dtype)
    want = _pairs_of(x.astype(np.int16), pads)
    got = _run(image_pairs_func(C, pads, np.dtype(dtype).name), "image_pairs", x, out_shape=want.shape,
               out_dtype="int16")
    assert got.shape == (2, pair_count(C), 3 + pads[0] + pads[1], 7 + pads[2] + pads[3], 2)
    np.testing.assert_array_equal(got, want)


def _conv_and_matmul_module():
    """conv2d(int16 data of a symbolic width, constant int16 weight) -> int32 and a matmul of int16 rows by a
    constant int8 [K, N], as tvmseq.onnx.quantized imports ConvInteger / MatMulInteger."""
    import tvm
    from tvm import relax, tirx

    rng = np.random.default_rng(3)
    w = rng.integers(-255, 256, (19, 5, 3, 3)).astype(np.int16)
    b = rng.integers(-128, 128, (9, 21)).astype(np.int8)
    width, rows = tirx.Var("width", "int64"), tirx.Var("rows", "int64")
    x = relax.Var("x", relax.TensorType([1, 5, 6, width], "int16"))
    a = relax.Var("a", relax.TensorType([rows, 1, 9], "int16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, a]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), strides=[2, 1], padding=[1, 1, 1, 1],
                                           out_dtype="int32"))
            z = bb.emit(relax.op.matmul(a, relax.const(b), out_dtype="int32"))
            out = bb.emit_output(relax.Tuple([y, z]))
        bb.emit_func_output(out)
    return bb.get(), w, b


@pytest.mark.parametrize("int_pairs", ["vnni", "avx512bw", "avx2", None])
def test_cpu_ops_runs_integer_contractions_as_pair_kernels(int_pairs):
    """cpu_ops puts the pair kernels in place of the int32 conv2d and matmul (None: a target without AVX512BW
    or AVX2 keeps TVM's ops), and the module still computes the exact sums at any width and row count."""
    import tvm
    from tvm import relax

    from tvmseq import targets
    from tvmseq.cpu_ops import cpu_ops

    if int_pairs:
        _instruction(int_pairs)
    mod, w, b = _conv_and_matmul_module()
    rewritten = cpu_ops(mod, int_pairs=int_pairs)
    kernels = sorted(str(gv.name_hint) for gv in rewritten.get_global_vars() if "pair" in str(gv.name_hint))
    assert kernels == ([] if int_pairs is None else
                       ["image_pairs_5", "pair_conv_5_19_3x3", "pair_conv_9_21_1x1", "rows_as_pairs"])
    ex = tvm.compile(rewritten, target=targets.host_cpu_target())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(4)
    for width, rows in ((1, 1), (13, 3), (20, 17)):
        x = rng.integers(-255, 256, (1, 5, 6, width)).astype(np.int16)
        a = rng.integers(-255, 256, (rows, 1, 9)).astype(np.int16)
        y, z = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(a))
        np.testing.assert_array_equal(y.numpy(), conv_reference(x, w, (2, 1), (1, 1), [1, 1, 1, 1]))
        np.testing.assert_array_equal(z.numpy(), a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("name", ["sigmoid", "tanh", "exp"])
def test_cpu_ops_runs_float_activations_on_the_polynomial_exp(name):
    """sigmoid / tanh / exp of float32 become TE ops on the recurrences' polynomial exp (TVM's call libm's expf an
    element, scalar: ddddocr's SiLU epilogues 0.2 -> 0.04 ms): within 2e-7 of numpy's (relative for exp in the normal
    float32 range, absolute for sigmoid / tanh everywhere), and no relax op of that name is left."""
    import tvm
    from tvm import relax

    from tvmseq import targets
    from tvmseq.cpu_ops import cpu_ops

    from tvm import tirx

    x = relax.Var("x", relax.TensorType([tirx.Var("n", "int64")], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(getattr(relax.op, name)(x))
        bb.emit_func_output(out)
    rewritten = cpu_ops(bb.get())
    assert f"relax.{name}" not in rewritten["main"].script()
    vm = relax.VirtualMachine(tvm.compile(rewritten, target=targets.host_cpu_target()), tvm.cpu())
    values = np.concatenate([np.linspace(-30, 30, 6001), [-1e30, -88.5, -0.0, 1e-30, 88.5, 1e30]]).astype(np.float32)
    got = vm["main"](tvm.runtime.tensor(values)).numpy().astype(np.float64)
    exact = {"sigmoid": lambda v: 1 / (1 + np.exp(-v)), "tanh": np.tanh, "exp": np.exp}[name]
    with np.errstate(over="ignore"):
        want = exact(values.astype(np.float64))
    if name == "exp":   # clamped where the result leaves the normal float32 range (fast_exp's doc)
        normal = (values > -87) & (values < 88)
        np.testing.assert_allclose(got[normal], want[normal], rtol=2e-7, atol=0)
        assert np.all(got[values >= 88] > 1e38) and np.all(got[values <= -87] < 1.2e-38)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-7)


@pytest.mark.parametrize("K,N", [(4, 1), (12, 37), (64, 50), (1024, 8210)])
def test_u8s8_matmul_equals_exact_sums(K, N):
    """uint8 x int8 quads (vpdpbusd) at every row tail (M = 1 .. 2 x rows + 1), full byte ranges."""
    from tvmseq.kernels.integer.pairs import PairTile
    from tvmseq.kernels.integer.quads import pack_quads, u8s8_matmul_func

    _instruction("vnni")
    rng = np.random.default_rng(K + N)
    w = rng.integers(-128, 128, (K, N)).astype(np.int8)
    w[0] = -128                                        # the int8 extremes in every column
    tile = PairTile.for_channels(N)
    func = u8s8_matmul_func(K, N, tile.vectors, tile.columns)
    packed = pack_quads(w, tile.vectors)
    for M in (range(1, 2 * tile.columns + 2) if K < 1024 else (15,)):
        a = rng.integers(0, 256, (M, K)).astype(np.uint8)
        a[0] = 255
        got = _run(func, "u8s8_matmul", a, packed, out_shape=(M, N), out_dtype="int32")
        np.testing.assert_array_equal(got, a.astype(np.int64) @ w.astype(np.int64), err_msg=f"rows {M}")


def test_shifted_int8_keeps_columns_of_at_most_256_values():
    from tvmseq.kernels.integer.quads import shifted_int8

    centered = np.array([[-255, 0, 7], [0, 255, 7], [-10, 100, 7]], np.int16)
    w8, shift = shifted_int8(centered)
    assert w8.dtype == np.int8
    np.testing.assert_array_equal(w8.astype(np.int64) + shift, centered)
    assert shifted_int8(np.array([[-200], [100]], np.int16)) is None     # 301 values apart


def test_matmul_integer_of_uint8_runs_on_quads():
    """ONNX MatMulInteger of uint8 A (scalar zero point) and a constant uint8 B (a zero point per column, so the
    centered B needs int16): on a VNNI target cpu_ops runs it as quads with the zero points' terms added, and the
    result equals the exact int32 sums."""
    import tvm
    from onnx import TensorProto, helper, numpy_helper
    from tvm import relax

    import tvmseq
    from tvmseq.cpu_ops import cpu_ops

    _instruction("vnni")
    rng = np.random.default_rng(7)
    K, N = 64, 19
    b = rng.integers(0, 256, (K, N)).astype(np.uint8)
    b_zp = rng.integers(0, 256, N).astype(np.uint8)
    node = helper.make_node("MatMulInteger", ["A", "B", "a_zp", "b_zp"], ["Y"])
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("A", TensorProto.UINT8, ["M", 1, K])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(v, k) for k, v in
                               {"B": b, "a_zp": np.array(201, np.uint8), "b_zp": b_zp}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    mod = cpu_ops(relax.transform.ConvertToDataflow()(tvmseq.from_onnx(model, target="llvm")), int_pairs="vnni")
    assert any(str(gv.name_hint).startswith("u8s8_matmul") for gv in mod.get_global_vars())
    compiled = tvmseq.compile_onnx(model, target="llvm")
    for M in (1, 11):
        a = rng.integers(0, 256, (M, 1, K)).astype(np.uint8)
        want = (a.astype(np.int64) - 201) @ (b.astype(np.int64) - b_zp.astype(np.int64))
        np.testing.assert_array_equal(np.asarray(compiled(A=a)), want)
