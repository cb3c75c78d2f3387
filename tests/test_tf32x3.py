"""The float32 projection on tf32 tensor cores at float32 accuracy (`kernels/projection/tf32x3.py`): the split of an
operand into two tf32 parts, the projection's numerics (its CPU variant: the three passes in the kernel's order),
the rule that picks it and the importer's wiring. The GPU kernel's fragment layouts are checked on the GPU by the
float32 cases of tests/test_gpu_lstm.py and tests/test_gpu_models.py that take it."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import tvm

from tvmseq.kernels.projection import gemm as ip
from tvmseq.kernels.projection import tf32x3, wgmma
from tvmseq.kernels.recurrent import gru, lstm

LLVM = tvm.target.Target("llvm")
H100 = tvm.target.Target("nvidia/nvidia-h100", host="llvm")


def numpy_tf32(a):
    """a rounded to tf32's 10 mantissa bits, half away from zero (what the split writes), in float64."""
    a = np.asarray(a, np.float64)
    m, e = np.frexp(a)                       # a = m 2^e, 0.5 <= |m| < 1: 11 significant bits kept
    return np.ldexp(np.sign(m) * np.floor(np.abs(m) * 2.0 ** 11 + 0.5) / 2.0 ** 11, e)


def _values(shape, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    x.flat[:6] = [0.0, -0.0, 1.0, -3.0e38, 1.0e-40, np.float32(1 + 2 ** -11)]   # a subnormal, a tie
    return x


@pytest.mark.parametrize("rows,K,Kp", [(1, 32, 32), (37, 23, 32), (5, 100, 128)])
def test_split_func_matches_split_array_and_rounds_to_tf32(rows, K, Kp):
    x = _values((rows, K), rows + K)
    split = tvm.compile(tf32x3.split_func(K, Kp), target=LLVM)
    got = tvm.runtime.tensor(np.full((2, rows, Kp), np.nan, np.float32))
    split(tvm.runtime.tensor(x), got)
    got = got.numpy()
    want = tf32x3.split_array(np.pad(x, [(0, 0), (0, Kp - K)]))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not (got.view(np.uint32) & 0x1FFF).any(), "a part with bits below tf32's mantissa"
    normal = np.abs(x) > 1e-30
    np.testing.assert_array_equal(got[0, :, :K][normal], numpy_tf32(x)[normal])
    rest = np.abs(x.astype(np.float64) - got[0, :, :K] - got[1, :, :K])
    assert (rest <= 2.0 ** -22 * np.abs(x))[normal].all()
    assert not got[:, :, K:].any()


def _cpu_projection(D, rows, N, K):
    rng = np.random.default_rng(D * rows + N + K)
    X = rng.standard_normal((rows, K)).astype(np.float32)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float32)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    proj = tvm.compile(wgmma.projection_wgmma_func(D, N, K, gpu=False, tile=ip.TF32X3_TILE, operands="tf32x3"),
                       target=LLVM)
    out = tvm.runtime.tensor(np.zeros((D, rows, N), np.float32))
    ws = tf32x3.split_weight(W, ip.tf32x3_n(N), K)   # W's rows zero-padded to whole tiles
    proj(*[tvm.runtime.tensor(a) for a in (tf32x3.split_array(X), ws, bias)], out)
    exact = np.einsum("mk,dnk->dmn", X.astype(np.float64), W.astype(np.float64)) + bias[:, None, :]
    return out.numpy(), exact, X, W, bias


@pytest.mark.parametrize("D,rows,N,K", [(1, 37, 128, 32), (2, 19, 256, 96), (1, 3, 512, 256), (2, 5, 148, 64),
                                        (1, 11, 400, 32), (2, 7, 111, 64)])
def test_tf32x3_projection_is_as_accurate_as_float32(D, rows, N, K):
    got, exact, X, W, bias = _cpu_projection(D, rows, N, K)
    f32 = np.zeros_like(got)          # a float32 GEMM summed in the same order (one pass)
    for k in range(K):
        f32 += X[None, :, k, None] * W[:, None, :, k]
    f32 += bias[:, None, :]
    hi_only = np.einsum("mk,dnk->dmn", numpy_tf32(X), numpy_tf32(W)) + bias[:, None, :]
    err, err32, err_tf32 = (np.abs(a - exact).max() for a in (got, f32, hi_only))
    assert err <= 3 * err32 + 1e-6, (err, err32)
    assert err * 100 < err_tf32, "the low parts did not count"


def _spec(D, B, H, I, dtype="float32", cell="lstm"):  # noqa: E741
    direction = "bidirectional" if D == 2 else "forward"
    if cell == "lstm":
        return lstm.LstmSpec(D, B, H, I, dtype, direction=direction)
    return gru.GruSpec(D, B, H, I, dtype, linear_before_reset=1, direction=direction)


def test_rule_takes_tf32x3_for_many_float32_rows_on_sm90a():
    sm80 = tvm.target.Target("nvidia/nvidia-a100", host="llvm")
    assert ip.projection_for(_spec(1, 64, 1024, 1024), H100, 100)[1] == ip.TF32X3
    assert ip.projection_for(_spec(2, 8, 128, 23), H100, 100)[1] == ip.TF32X3       # K 23 padded to 32
    assert ip.projection_for(_spec(1, 64, 128, 128, cell="gru"), H100, None)[1] == ip.TF32X3   # length at run time
    assert ip.projection_for(_spec(1, 1, 1024, 1024), H100, 100)[1] != ip.TF32X3    # 100 rows: SIMT
    assert ip.projection_for(_spec(1, 64, 100, 100), H100, 100)[1] == ip.TF32X3     # N 400: W padded to 512 rows
    assert ip.projection_for(_spec(1, 64, 37, 37, cell="gru"), H100, 100)[1] == ip.TF32X3   # N 111: odd
    assert ip.projection_for(_spec(1, 64, 1024, 1024, "float16"), H100, 100)[1] == ip.FLAT
    assert ip.projection_for(_spec(1, None, 1024, 1024), H100, 100)[1] != ip.TF32X3  # any batch: dlight
    assert ip.projection_for(_spec(1, 64, 1024, 1024), sm80, 100)[1] != ip.TF32X3
    assert ip.projection_for(_spec(1, 64, 1024, 1024), LLVM, 100)[1] != ip.TF32X3
    func, _ = ip.projection_for(_spec(1, 64, 1024, 1024), H100, 100)
    src = tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32" in src


def test_importer_splits_x_per_call_and_constant_w_once():
    from tvmseq import models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq=100, batch=8, input_size=23, hidden=128, direction="bidirectional",
                                     linear_before_reset=1)
    mod = from_onnx(model, target=H100)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert {"gru_tf32x3_split", "gru_input_projection_tf32x3"} <= names
    text = mod["main"].script(show_meta=False)
    assert text.count("gru_tf32x3_split") == 1, "W is a constant: split at import, not per call"
    w = next(i for i in model.graph.initializer if i.name == model.graph.node[0].input[1])
    from onnx import numpy_helper

    w = numpy_helper.to_array(w)
    consts = [c.value.numpy() for c in _constants(mod["main"])]
    want = tf32x3.split_weight(w, 384, 32)   # K 23 -> 32
    assert any(c.shape == want.shape and np.array_equal(c, want) for c in consts)


def _constants(func):
    found = []

    def visit(expr):
        if isinstance(expr, tvm.ir.expr.GenericConst):
            found.append(expr)
    tvm.relax.analysis.post_order_visit(func, visit)
    return found


def test_importer_dispatches_few_rows_of_a_run_time_length_to_the_stock_matmul():
    from tvmseq import models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq="frames", batch=4, input_size=64, hidden=128, direction="forward",
                                     linear_before_reset=1)
    mod = from_onnx(model, target=H100)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert {"gru_projection_by_rows", "gru_projection_stock", "gru_tf32x3_split"} <= names
    tiled = mod["gru_projection_tiled"].script(show_meta=False)
    assert len(re.findall(r"gru_tf32x3_split\d*, \(", tiled)) == 2, "X and the constant W (a parameter here) split"
    assert "R.reshape" not in tiled.split("R.output")[-1], "the branch returns the kernel's rows, no copy"


def test_promoted_chunks_only_where_the_registers_hold_two_sums():
    assert "bn <= 128" in wgmma.supports(512, 256, wgmma.WgmmaTile(128, 256, 4, True, promote=8), 4)
    assert wgmma.supports(512, 256, ip.TF32X3_TILE, 4) is None
    assert ip.TF32X3_TILE.promote > 0   # the accuracy the rule was chosen for (tensor cores truncate as they sum)


@pytest.mark.parametrize("hidden", [128, 100])
def test_importer_splits_a_weight_passed_as_an_input_every_call(hidden):
    from tvmseq import models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq=100, batch=8, input_size=64, hidden=hidden, direction="forward",
                                     linear_before_reset=1, weights_as_inputs=True)
    text = from_onnx(model, target=H100)["main"].script(show_meta=False)
    assert text.count("gru_tf32x3_split") == 2, "X and W each split before the projection"
    assert ("R.nn.pad" in text) == (hidden == 100), "W's 300 rows padded to 384, 384 left as they are"


def test_source_carrying_modules_compile_for_the_architecture_variant_wgmma_needs(monkeypatch):
    """A module built without device binaries carries CUDA source, compiled where it is loaded: for the GPU present
    (sm_90a on an H100: TVM's own callback took sm_90 there, where ptxas refuses wgmma) or, in a build, for the
    current target's architecture."""
    from tvmseq import cuda_toolchain

    built = []
    monkeypatch.setattr(cuda_toolchain, "nvcc_fatbin", lambda code, arches: (built.append(arches) or b"", {}))
    monkeypatch.setattr(cuda_toolchain, "present_arch", lambda device=None: "sm_90a")
    cuda_toolchain._present_gpu_compile("__global__ void k() {}")
    with tvm.target.Target("nvidia/nvidia-a100"):
        cuda_toolchain._present_gpu_compile("__global__ void k() {}")
    assert built == [("sm_90a",), ("sm_80",)]


def test_one_stage_holds_both_planes_and_a_k_step_runs_the_three_products():
    # the rule's tile loads X's and W's high and low tiles of a k step together (not one pass over K per product)
    assert ip.TF32X3_TILE.both_planes
    def k_loop(tile):
        func = wgmma.projection_wgmma_func(1, 256, 96, tile=tile, operands="tf32x3")
        src = tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()
        body = src[src.index("for (int kt"):]
        return re.search(r"kt < (\d+);", body).group(1), len(re.findall(r"_m64n128k8_f32_tf32_tf32\w*\(", body))

    # K 96: 3 k steps of 32 columns, each 3 products x 4 k8 wgmmas in one unrolled body; three passes: 9 steps of 4
    assert k_loop(ip.TF32X3_TILE) == ("3", 12)
    assert k_loop(dataclasses.replace(ip.TF32X3_TILE, both_planes=False)) == ("9", 4)


def test_many_static_rows_take_128_row_blocks():
    def threads(seq, batch):
        func, tile = ip.projection_for(_spec(1, batch, 1024, 1024), H100, seq)
        assert tile == ip.TF32X3
        return int(re.search(r'T.thread_binding\((\d+), thread="threadIdx.x"\)', func.script()).group(1))

    assert threads(100, 256) == 256                   # 25,600 rows known at import: bm 128, two warpgroups
    assert threads(100, 64) == threads(None, 256) == 128   # 6,400 rows, or a length known at run time: bm 64


@pytest.mark.parametrize("N", [1, 161, 600, 1200, 1536, 4096])
def test_row_ranges_give_each_run_time_row_count_the_tile_of_the_rule(N):
    ranges = ip.tf32x3_row_ranges(N, 132)
    assert ranges[0][0] == 1 and [r for r, _ in ranges] == sorted({r for r, _ in ranges})
    for rows in range(1, ip.TF32X3_LARGE_ROWS, 7):
        picked = next(t for start, t in reversed(ranges) if start <= rows)
        assert picked == ip.tf32x3_tile(N, rows, 132), rows


def test_few_rows_take_narrower_tiles_that_fill_the_gpu():
    tile = lambda n, rows: ip.tf32x3_tile(n, rows, 132)   # noqa: E731
    assert tile(600, 100).bn == 16 and tile(600, 800).bn == 64 and tile(1200, 800) == ip.TF32X3_TILE
    assert tile(1200, 100).bn == 32 and tile(161, 800).bn == 32 and tile(4096, 20000) == ip.TF32X3_LARGE_TILE
    for t in ip.TF32X3_NARROW_TILES:   # each fits and keeps the rule tile's chunks and planes
        assert wgmma.supports(ip.tf32x3_n(600), 608, t, 4) is None and (t.promote, t.both_planes) == (3, True)


def test_a_narrow_tile_reads_w_padded_for_the_wide_one():
    func = ip.tf32x3_tile_projection(_spec(1, 4, 200, 96, cell="gru"), ip.TF32X3_NARROW_TILES[-1])   # N 600, bn 16
    text = func.script()
    assert "(2, 1, 640, 96)" in text, "W's rows as the 128-column tile pads them"
    assert 'T.thread_binding(38, thread="blockIdx.x")' in text, "ceil(600 / 16) column blocks, not 640 / 16"
    src = tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32" in src
    with pytest.raises(Exception, match="do not cover N"):
        wgmma.projection_wgmma_func(1, 600, 96, tile=ip.TF32X3_TILE, operands="tf32x3", w_rows=600)


def test_importer_dispatches_run_time_rows_over_the_tiles():
    from tvmseq import models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq="frames", batch=1, input_size=64, hidden=200, direction="forward",
                                     linear_before_reset=1)
    mod = from_onnx(model, target=H100)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    starts = [start for start, _ in ip.tf32x3_row_ranges(600, 132)]    # 1 (16 columns), 193, 385, 833
    assert {"gru_input_projection_tf32x3_n16", "gru_input_projection_tf32x3_n32", "gru_input_projection_tf32x3_n64",
            "gru_input_projection_tf32x3", "gru_projection_tiled0", "gru_projection_tiled"} <= names
    conditions = " ".join(mod[n].script(show_meta=False) for n in names if n.startswith("gru_projection_by_rows"))
    for bound in (9, *starts[1:]):   # the stock matmul up to 8 rows, then each range from its start
        assert re.search(rf"< {bound}\b", conditions), bound


def test_both_planes_tiles_fit_shared_memory_and_are_tf32x3_only():
    fp16 = wgmma.WgmmaTile(64, 128, 4, True, both_planes=True)
    assert "tf32x3's" in wgmma.supports(512, 256, fp16, 2)
    big = wgmma.WgmmaTile(128, 128, 4, True, promote=3, both_planes=True)   # 4 x 64 KB stages
    assert "shared memory" in wgmma.supports(512, 256, big, 4)
    assert wgmma.supports(512, 256, dataclasses.replace(big, stages=3), 4) is None


def test_tf32x3_kernel_refuses_what_it_cannot_run():
    from tvmseq.errors import TvmseqError

    with pytest.raises(TvmseqError, match="operands 'tf32' not one of"):
        wgmma.projection_wgmma_func(1, 512, 64, tile=ip.TF32X3_TILE, operands="tf32")



# ---- MatMul / Gemm on the projection (tvmseq.onnx.matmul) -------------------------------------------------------


def _fc_model(x_dims, k, n, *, op="MatMul", w_input=False, dtype=np.float32, **attrs):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k) if op == "Gemm" else (k, n)).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info("X", elem, x_dims)]
    inits = [numpy_helper.from_array(rng.standard_normal(n).astype(dtype), "B")]
    if w_input:
        inputs.append(helper.make_tensor_value_info("W", elem, list(w.shape)))
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    node = helper.make_node(op, ["X", "W", "B"] if op == "Gemm" else ["X", "W"], ["Y"], **attrs)
    graph = helper.make_graph([node], "fc", inputs, [helper.make_tensor_value_info("Y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _fc_names(model, target=H100):
    from tvmseq.onnx import from_onnx

    mod = from_onnx(model, target=target)
    return {gv.name_hint for gv in mod.get_global_vars()}, mod["main"].script(show_meta=False), mod


@pytest.mark.parametrize("n", [200, 161])   # 161: an odd N (the denoiser's mask layer), stored a value at a time
def test_matmul_with_a_constant_weight_runs_on_the_projection(n):
    model, w = _fc_model(["T", 4, 96], 96, n)
    names, text, mod = _fc_names(model)
    assert {"fc_projection_by_rows", "fc_projection_stock", "fc_tf32x3_split", "fc_input_projection_tf32x3"} <= names
    assert "R.matmul" not in text
    consts = [c.value.numpy() for f in mod.functions.values() if isinstance(f, tvm.relax.Function)
              for c in _constants(f)]
    assert any(c.shape == (1, n, 96) and np.array_equal(c[0], w.T) for c in consts), "W^T, transposed once"
    static, _, mod = _fc_names(_fc_model([1000, 4, 96], 96, n)[0])   # a static length: W split at import
    want = tf32x3.split_weight(w.T.reshape(1, n, 96), 256, 96)   # N -> 256 rows, K 96
    consts = [c.value.numpy() for c in _constants(mod["main"])]
    assert any(c.shape == want.shape and np.array_equal(c, want) for c in consts)


def test_gemm_takes_its_bias_and_a_weight_input_is_transposed_in_the_graph():
    names, _, mod = _fc_names(_fc_model([1000, 64], 64, 48, op="Gemm", transB=1)[0])
    assert "fc_input_projection_tf32x3" in names and "fc_projection_by_rows" not in names   # 1000 rows, static
    names, text, _ = _fc_names(_fc_model(["T", 8, 64], 64, 48, w_input=True)[0])
    assert "fc_input_projection_tf32x3" in names and "R.permute_dims" in text


# (a float16 product is computed in float32 since 2026-11-29, on this projection where it applies:
# tests/test_float16_products.py)
@pytest.mark.parametrize("case", ["sm80", "llvm", "trans_a", "alpha", "few_static_rows", "batched_weight", "few_columns"])
def test_other_products_stay_tvms(case):
    from onnx import TensorProto, helper

    target = {"sm80": tvm.target.Target("nvidia/nvidia-a100", host="llvm"), "llvm": LLVM}.get(case, H100)
    if case == "few_columns":   # N 15: under TF32X3_MIN_N, a GEMV-like pass (a VAD's 128 -> 1 score)
        model = _fc_model(["T", 4, 96], 96, 15)[0]
    elif case in ("trans_a", "alpha"):
        attrs = dict(transA=1, transB=1) if case == "trans_a" else dict(transB=1, alpha=0.5)
        model = _fc_model([600, 64] if case == "alpha" else [64, 600], 64, 48, op="Gemm", **attrs)[0]
    elif case == "few_static_rows":
        model = _fc_model([100, 96], 96, 200)[0]
    elif case == "batched_weight":
        node = helper.make_node("MatMul", ["X", "W"], ["Y"])
        graph = helper.make_graph([node], "bmm", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 600, 96]),
                                                 helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 96, 64])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    else:
        model = _fc_model(["T", 4, 96], 96, 200)[0]
    names, _, _ = _fc_names(model, target)
    assert not any(n.startswith("fc_") for n in names), sorted(names)


def test_weight_work_of_weights_kept_out_is_lifted_into_the_transform_function():
    """weights="inputs": the split (and padding) of W depend on the weights alone: `main_transform_params` does
    them once, `main` splits only X (a run-time length: the row dispatch gets W split)."""
    from tvmseq import build, models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq="frames", batch=8, input_size=64, hidden=100, direction="forward",
                                     linear_before_reset=1)
    proto, pairs, values = build.prepare_proto(model, H100, False, "inputs", 16, {})
    mod = from_onnx(proto, target=H100)
    signature = build.signature_of(mod, proto, values, pairs)
    lifted = build.lift_weight_transforms(mod, signature)
    assert signature["transform_params"]
    main, transform = (lifted[n].script(show_meta=False) for n in ("main", "main_transform_params"))
    split = re.compile(r"gru_tf32x3_split\d*, \(")
    assert not split.findall(main) and "R.nn.pad" not in main
    assert len(split.findall(transform)) == 1 and "R.nn.pad" in transform   # 300 rows -> 384


def test_split_refuses_more_rows_than_32_bit_offsets_reach():
    """X's split checks rows x (the widest row after it) against 2^31 on the host, before its kernel runs, naming
    the node: past it the kernels' 32-bit offsets would wrap."""
    from tvmseq import runtime  # noqa: F401  (maps the error kind to TvmseqError)
    from tvmseq.errors import TvmseqError

    func = tf32x3.split_func(8, 8, row_values=1 << 28, what="ONNX node 'gru_0' (GRU)")
    split = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=LLVM)
    ok = np.ones((7, 8), np.float32)
    out = tvm.runtime.tensor(np.zeros((2, 7, 8), np.float32))
    split(tvm.runtime.tensor(ok), out)                      # 7 x 2^28 < 2^31
    with pytest.raises(TvmseqError, match=r"ONNX node 'gru_0' \(GRU\): 268435456 values a row .* at most 7 rows"):
        split(tvm.runtime.tensor(np.ones((8, 8), np.float32)), tvm.runtime.tensor(np.zeros((2, 8, 8), np.float32)))


def test_importer_checks_the_row_count_of_each_projection():
    from tvmseq import models
    from tvmseq.onnx import from_onnx

    model, _ = models.rnn_node_model("GRU", seq="frames", batch=4, input_size=64, hidden=128, direction="forward",
                                     linear_before_reset=1)
    text = from_onnx(model, target=H100).script(show_meta=False)
    assert "(GRU): 384 values a row and its kernels index in 32 bits: at most 5592405 rows" in text

