"""Dense float32 Conv on sm_90a as im2col x W^T on the tf32x3 projection (`tvmseq.onnx.conv._as_gemm`).

The kernel that makes and splits the im2col rows is checked on the CPU bit for bit against the split of a numpy
im2col, itself checked against a plain numpy convolution (odd sizes, strides, dilations, pads, 1-D and 2-D, static
and symbolic dims); the importer's choice (which convs take the rule, which stay TVM's) is read from the imported
module; the whole product against onnxruntime runs on the GPU (`-m gpu`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper



def _h100():   # built when a test asks: TVM's runtime alone (the GPU machine) has no target registry
    return tvm.target.Target("nvidia/nvidia-h100", host="llvm")


def numpy_conv(x, w, b, strides, dilations, pads):
    """ONNX Conv (group 1) in float64: x [N, C, *S], w [M, C, *K], pads [begin..., end...]."""
    nd = x.ndim - 2
    widths = [(0, 0), (0, 0)] + [(pads[i], pads[nd + i]) for i in range(nd)]
    xp = np.pad(x.astype(np.float64), widths)
    kernel = w.shape[2:]
    outs = [(xp.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    y = np.zeros((x.shape[0], w.shape[0], *outs))
    for tap in np.ndindex(*kernel):
        window = xp[(slice(None), slice(None), *(slice(t * d, t * d + s * (o - 1) + 1, s) for t, d, s, o in
                                                  zip(tap, dilations, strides, outs)))]
        y += np.einsum("nc...,mc->nm...", window, w[(slice(None), slice(None), *tap)].astype(np.float64))
    return y + b.reshape(1, -1, *([1] * nd))


def numpy_im2col(x, kernel, strides, dilations, pads):
    """[N x output positions, C x taps]: row (n, o..), column (c, t..) holds x_padded[n, c, o s + t d ..]."""
    nd = x.ndim - 2
    widths = [(0, 0), (0, 0)] + [(pads[i], pads[nd + i]) for i in range(nd)]
    xp = np.pad(x, widths)
    outs = [(xp.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    taps = [xp[(slice(None), slice(None), *(slice(t * d, t * d + s * (o - 1) + 1, s) for t, d, s, o in
                                             zip(tap, dilations, strides, outs)))] for tap in np.ndindex(*kernel)]
    col = np.stack(taps, axis=2)                                  # [N, C, taps, *out]
    col = np.moveaxis(col.reshape(x.shape[0], -1, *outs), 1, -1)  # [N, *out, C x taps]
    return col.reshape(-1, col.shape[-1])


def _conv_split(x, kernel, strides, dilations, pads, Kp, symbolic):
    from tvm import tirx

    from tvmseq.kernels.projection import tf32x3

    dims = [tirx.Var(f"d{i}", "int32") if symbolic and i != 1 else d for i, d in enumerate(x.shape)]
    func = tf32x3.conv_split_func(dims, kernel, strides, dilations, pads, Kp)
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    rows = len(numpy_im2col(x, kernel, strides, dilations, pads))
    out = tvm.runtime.tensor(np.zeros((2, rows, Kp), np.float32))
    lib(tvm.runtime.tensor(x), out)
    return out.numpy()


@pytest.mark.parametrize("shape,kernel,strides,dilations,pads", [
    ((2, 3, 7, 11), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((1, 5, 9, 6), (3, 2), (2, 1), (1, 2), (0, 2, 1, 0)),
    ((3, 4, 13), (5,), (2,), (1,), (2, 1)),
    ((1, 2, 8, 5), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_conv_split_is_the_split_of_the_im2col_rows(shape, kernel, strides, dilations, pads, symbolic):
    from tvmseq.kernels.projection import tf32x3

    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((7, shape[1], *kernel)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    col = numpy_im2col(x, kernel, strides, dilations, pads)
    conv = numpy_conv(x, w, b, strides, dilations, pads)          # the rows are the convolution's products
    got = col.astype(np.float64) @ w.reshape(7, -1).T.astype(np.float64) + b
    np.testing.assert_allclose(np.moveaxis(got.reshape(shape[0], *conv.shape[2:], 7), -1, 1), conv, rtol=1e-12,
                               atol=1e-12)
    Kp = -(-col.shape[1] // 32) * 32
    want = tf32x3.split_array(np.pad(col, [(0, 0), (0, Kp - col.shape[1])]))
    np.testing.assert_array_equal(_conv_split(x, kernel, strides, dilations, pads, Kp, symbolic), want)


def test_conv_split_refuses_more_rows_than_32_bit_offsets_reach():
    """The split of a conv's im2col rows checks its output positions x (the widest row after it) against 2^31 on
    the host before its kernel runs, naming the node, as the split of X's rows does (`tf32x3.split_func`)."""
    from tvm import tirx

    from tvmseq import runtime  # noqa: F401  (maps the error kind to TvmseqError)
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import tf32x3

    dims = [2, 3, tirx.Var("w", "int32")]     # rows: 2 x the width (a 1 x 1 kernel)
    func = tf32x3.conv_split_func(dims, (1,), (1,), (1,), (0, 0), 32, row_values=1 << 28,
                                  what="ONNX node 'conv_0' (Conv)")
    split = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    split(tvm.runtime.tensor(np.ones((2, 3, 3), np.float32)), tvm.runtime.tensor(np.zeros((2, 6, 32), np.float32)))
    with pytest.raises(TvmseqError, match=r"ONNX node 'conv_0' \(Conv\): 268435456 values a row .* at most 7 rows"):
        split(tvm.runtime.tensor(np.ones((2, 3, 4), np.float32)),
              tvm.runtime.tensor(np.zeros((2, 8, 32), np.float32)))   # 8 output positions


def _conv_model(x_dims, channels_out, kernel, *, w_input=False, dtype=TensorProto.FLOAT, **attrs):
    rng = np.random.default_rng(channels_out)
    w = rng.standard_normal((channels_out, x_dims[1], *kernel)).astype(np.float32)
    b = rng.standard_normal(channels_out).astype(np.float32)
    inputs = [helper.make_tensor_value_info("X", dtype, x_dims)]
    inits = [numpy_helper.from_array(b, "B")]
    if w_input:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, list(w.shape)))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    conv = helper.make_node("Conv", ["X", "W", "B"], ["C"], kernel_shape=list(kernel), **attrs)
    relu = helper.make_node("Relu", ["C"], ["Y"])
    graph = helper.make_graph([conv, relu], "conv", inputs, [helper.make_tensor_value_info("Y", dtype, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), w, b


def _names(model, target=None):
    from tvmseq.onnx import from_onnx

    mod = from_onnx(model, target=target or _h100())
    return {gv.name_hint for gv in mod.get_global_vars()}, mod


@pytest.mark.parametrize("channels_out", [96, 37])   # 37: an odd count (stored a value at a time)
@pytest.mark.parametrize("x_dims", [[8, 64, 8, "W"], [2, 32, 16, 40], ["N", 48, 100], [1, 48, "T"]])
def test_dense_float32_convs_with_many_products_take_the_projection(x_dims, channels_out):
    """Static output positions: the product from TF32X3_MIN_ROWS of them; a count known at run time: a run-time
    choice where the sizes known at import give GEMM_MIN_STATIC_ROWS of them (["N", 48, 100]: 100 a batch row),
    else TVM's conv."""
    kernel = (3, 3) if len(x_dims) == 4 else (5,)
    model, w, _ = _conv_model(x_dims, channels_out, kernel, pads=[1] * (2 * len(kernel)))
    names, mod = _names(model)
    if x_dims == [1, 48, "T"]:   # one static output position a frame: a streaming call's few frames stay TVM's
        assert not any(n.startswith("conv_") for n in names), sorted(names)
        return
    assert {"conv_tf32x3_split", "conv_input_projection_tf32x3"} <= names, sorted(names)
    static = isinstance(x_dims[-1], int) and isinstance(x_dims[0], int)
    # a count of output positions known at run time only: few of them go to TVM's conv, in a branch of its own
    assert ({"conv_by_rows", "conv_stock", "conv_gemm"} <= names) != static, sorted(names)
    assert "R.nn.conv" not in mod["main"].script(show_meta=False)
    if static:   # W split at import
        from tvmseq.kernels.projection import gemm as ip
        from tvmseq.kernels.projection import tf32x3

        want = tf32x3.split_weight(w.reshape(1, channels_out, -1), ip.tf32x3_n(channels_out), w[0].size)
        consts = [c.value.numpy() for c in _constants(mod["main"])]
        assert any(c.shape == want.shape and np.array_equal(c, want) for c in consts)


def _constants(func):
    found = []
    tvm.relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, tvm.ir.expr.GenericConst)
                                        else None)
    return found


def test_a_weight_input_is_split_once_in_the_transform_function():
    """weights="inputs" with a run-time count of output positions: the weight's reshape and tf32 split depend on
    the weights alone: `main_transform_params` does them once, `main` (through the row dispatch) only the input's."""
    from tvmseq import build
    from tvmseq.onnx import from_onnx

    model = _conv_model([8, 64, 8, "W"], 96, (3, 3), pads=[1, 1, 1, 1])[0]
    proto, pairs, values = build.prepare_proto(model, _h100(), False, "inputs", 16, {})
    mod = from_onnx(proto, target=_h100())
    signature = build.signature_of(mod, proto, values, pairs)
    lifted = build.lift_weight_transforms(mod, signature)
    main, transform = (lifted[n].script(show_meta=False) for n in ("main", "main_transform_params"))
    assert "conv_tf32x3_split" in transform and "conv_tf32x3_split" not in main, main


@pytest.mark.parametrize("case", ["few_products", "few_rows", "grouped", "llvm", "sm80", "few_channels"])
def test_other_convs_stay_tvms(case):
    target = {"llvm": tvm.target.Target("llvm"), "sm80": tvm.target.Target("nvidia/nvidia-a100", host="llvm")}.get(
        case, None)
    if case == "few_products":                      # one input channel, 3 x 3: 9 products an output
        model = _conv_model([8, 1, 32, "W"], 32, (3, 3), pads=[1, 1, 1, 1])[0]
    elif case == "few_rows":                        # 2 x 4 x 4 = 32 output positions, static
        model = _conv_model([2, 64, 4, 4], 64, (3, 3), pads=[1, 1, 1, 1])[0]
    elif case == "few_channels":                    # 8 output channels: under TF32X3_MIN_N
        model = _conv_model([8, 64, 8, "W"], 8, (3, 3), pads=[1, 1, 1, 1])[0]
    elif case == "grouped":
        model = _conv_model([2, 64, 16, "W"], 64, (3, 3), pads=[1, 1, 1, 1])[0]
        model.graph.node[0].attribute.append(helper.make_attribute("group", 2))
        w = numpy_helper.to_array(model.graph.initializer[1])[:, :32]
        model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w), "W"))
    else:
        model = _conv_model([8, 64, 8, "W"], 96, (3, 3), pads=[1, 1, 1, 1])[0]
    names, _ = _names(model, target)
    assert not any(n.startswith(("conv_tf32x3", "conv_input")) for n in names), sorted(names)


# the GPU cases: compiled HERE for the H100 (`python tests/test_conv_gemm.py DIR`), run THERE with TVM's runtime only
# (`TVMSEQ_CONV_GEMM=DIR pytest -m gpu tests/test_conv_gemm.py`) against onnxruntime's outputs computed here; the last
# dim symbolic, two widths: many rows (the tf32x3 projection) and few (the stock matmul on the im2col rows)
GPU_CASES = {
    "crnn_3x3": ([8, 64, 8, 37], (3, 3), dict(pads=[1, 1, 1, 1])),
    "strided_dilated": ([8, 33, 17, 29], (3, 2), dict(pads=[0, 1, 2, 0], strides=[2, 1], dilations=[1, 2])),
    "conv1d": ([64, 40, 17], (5,), dict(pads=[2, 2])),
    "odd_channels": ([8, 64, 8, 37], (3, 3), dict(pads=[1, 1, 1, 1])),   # 37 output channels: an odd N
}
CHANNELS_OUT = {"odd_channels": 37}
PRODUCT_MIN_ROWS = 512   # gemm.TF32X3_MIN_ROWS (the GPU machine's TVM runtime cannot import the rule)
GPU_ROOT = Path(os.environ.get("TVMSEQ_CONV_GEMM", Path(__file__).resolve().parents[1] / "out" / "conv_gemm"))


def _gpu_case(name, w_input):
    x_dims, kernel, attrs = GPU_CASES[name]
    model, w, b = _conv_model([*x_dims[:-1], "W"], CHANNELS_OUT.get(name, 96), kernel, w_input=w_input, **attrs)
    rng = np.random.default_rng(len(name))
    feeds = [{"X": rng.standard_normal([*x_dims[:-1], width]).astype(np.float32), **({"W": w} if w_input else {})}
             for width in (x_dims[-1], 3)]
    return model, feeds, w, b


def build(out_dir) -> None:
    import onnxruntime as ort

    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in GPU_CASES:
        for w_input in (False, True):
            model, feeds, weight, bias = _gpu_case(name, w_input)
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            with cuda_toolchain.device_binaries(("sm_90a",)):
                export(compile_onnx(model, target="cuda"), out / f"{name}_{w_input}.so")
            _, kernel, attrs = GPU_CASES[name]
            nd = len(kernel)
            geometry = (attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd), attrs["pads"])
            np.savez(out / f"{name}_{w_input}.npz", **{f"{k}_{i}": v for i, f in enumerate(feeds) for k, v in f.items()},
                     **{f"ort_{i}": session.run(None, f)[0] for i, f in enumerate(feeds)},
                     **{f"exact_{i}": np.maximum(numpy_conv(f["X"], weight, bias, *geometry), 0)
                        for i, f in enumerate(feeds)})
            print(name, w_input, flush=True)


def test_the_gpu_cases_split_at_the_rules_row_count():
    from tvmseq.kernels.projection.gemm import TF32X3_MIN_ROWS

    assert PRODUCT_MIN_ROWS == TF32X3_MIN_ROWS


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("w_input", [False, True])
def test_conv_on_the_projection_matches_onnxruntime_on_the_gpu(name, w_input):
    from tvmseq.runtime import load_model

    path = GPU_ROOT / f"{name}_{w_input}.so"
    if not path.exists():
        pytest.skip(f"no prebuilt module in {GPU_ROOT} (python tests/test_conv_gemm.py {GPU_ROOT})")
    data, compiled = np.load(path.with_suffix(".npz")), load_model(path)
    _, kernel, attrs = GPU_CASES[name]
    nd = len(kernel)
    geometry = (attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd), attrs["pads"])
    _, _, weight, bias = _gpu_case(name, w_input)
    for i in range(2):
        feeds = {k: data[f"{k}_{i}"] for k in (("X", "W") if w_input else ("X",))}
        exact, got = data[f"exact_{i}"], np.asarray(compiled(**feeds), np.float64)
        assert got.shape == exact.shape
        rows = exact.shape[0] * int(np.prod(exact.shape[2:]))
        if rows >= PRODUCT_MIN_ROWS:
            # the product: against float64, within 3x onnxruntime's float32 error (as tests/test_tf32x3.py holds the
            # projection to 3x a float32 sum's): tf32x3 drops the lo x lo products; 576 products an output: 2.1x
            err, err_ort = (np.abs(np.asarray(a, np.float64) - exact).max() for a in (got, data[f"ort_{i}"]))
            assert err <= 3 * err_ort + 1e-6, (name, feeds["X"].shape, err, err_ort)
        else:
            # TVM's conv (a float32 sum in its schedule's order; 37 channels: 3.2x onnxruntime's error, H200):
            # within float32's bound for any order of the sum, gamma_K x the sum of |products| (a lost or
            # misplaced tap is off by one whole product, ~300x the bound here)
            products = weight[0].size + 1
            gamma = products * 2.0 ** -24 / (1 - products * 2.0 ** -24)
            scale = numpy_conv(np.abs(feeds["X"]), np.abs(weight), np.abs(bias), *geometry)
            assert (np.abs(got - exact) <= gamma * scale).all(), (name, feeds["X"].shape)


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else GPU_ROOT)
