"""Sparse weights in ONNX models (sparse_initializer, Constant(sparse_value), and mostly-zero dense
initializers when sparse_threshold is given) routed to tvmseq's spmm / spmm_t kernels; outputs checked
against onnxruntime."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm

if getattr(tvm.base, "_RUNTIME_ONLY", False):  # importing ONNX models needs TVM's compiler
    pytest.skip("TVM runtime only: the ONNX importer needs TVM's compiler", allow_module_level=True)

import tvmseq  # noqa: E402
from tvmseq import TvmseqError  # noqa: E402
from tvmseq.onnx import from_onnx  # noqa: E402
from tvmseq.onnx import sparse as onnx_sparse  # noqa: E402

try:
    import onnxruntime as ort
except ImportError:  # the GPU machine may lack it: only the comparisons with it are skipped
    ort = None

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float16": dict(rtol=1e-2, atol=1e-2)}
ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def sparse_weight(rows, cols, density, dtype="float32", seed=0):
    """Dense matrix with non-zeros (|w| in [0.1, 1]) at `density`, at least one of them."""
    rng = np.random.default_rng(seed)
    mask = rng.random((rows, cols)) < density
    mask[rows // 2, cols // 2] = True
    w = rng.uniform(0.1, 1.0, (rows, cols)) * rng.choice([-1.0, 1.0], (rows, cols))
    return np.where(mask, w, 0.0).astype(dtype)


def sparse_proto(w, name, coordinates=False):
    """SparseTensorProto of `w`: linear indices, or [nnz, rank] coordinates."""
    flat = np.flatnonzero(w)
    values = numpy_helper.from_array(w.reshape(-1)[flat], name)
    if coordinates:
        idx = np.stack(np.unravel_index(flat, w.shape), axis=1).astype(np.int64)
    else:
        idx = flat.astype(np.int64)
    return helper.make_sparse_tensor(values, numpy_helper.from_array(idx, name + "_indices"), list(w.shape))


def make_model(nodes, inputs, initializers=(), sparse_initializers=(), opset=17, out_type=TensorProto.FLOAT,
               out_shape=None):
    graph = helper.make_graph(nodes, "sparse_test", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info("Y", out_type, out_shape)],
                              initializer=list(initializers), sparse_initializer=list(sparse_initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def compile_model(model, **options):
    """preprocess_sparse (idempotent: a no-op where the importer already runs it) + compile for llvm."""
    model, options = onnx_sparse.preprocess_sparse(model, options)
    return tvmseq.compile_onnx(model, target="llvm", **options)


def kernels_in(model, **options):
    model, options = onnx_sparse.preprocess_sparse(model, options)
    mod = from_onnx(model, target="llvm", **options)
    return sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.startswith("spmm"))


def check_against_ort(model, feeds, dtype="float32", **options):
    if ort is None:
        pytest.skip("onnxruntime is not installed")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = compile_model(model, **options)(**feeds)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), **TOL[dtype])


def rand(shape, dtype="float32", seed=1):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(dtype)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("coordinates", [False, True])
@pytest.mark.parametrize("x_shape", [(5, 37), (2, 3, 37), (37,)])
def test_matmul_sparse_initializer(x_shape, coordinates, dtype):
    w = sparse_weight(37, 23, 0.1, dtype)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", ONNX_TYPE[dtype], list(x_shape))],
                       sparse_initializers=[sparse_proto(w, "W", coordinates)], out_type=ONNX_TYPE[dtype])
    check_against_ort(model, {"X": rand(x_shape, dtype)}, dtype)
    assert kernels_in(model) == [f"spmm_t_37x23_n{int(np.prod(x_shape[:-1]))}_{dtype}_int32_int32"]


def test_matmul_constant_sparse_value():
    w = sparse_weight(19, 11, 0.2)
    nodes = [helper.make_node("Constant", [], ["W"], sparse_value=sparse_proto(w, "W")),
             helper.make_node("MatMul", ["X", "W"], ["Y"])]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [4, 19])])
    check_against_ort(model, {"X": rand((4, 19))})
    assert kernels_in(model) == ["spmm_t_19x11_n4_float32_int32_int32"]


def test_matmul_sparse_on_the_left():
    w = sparse_weight(13, 19, 0.2)
    model = make_model([helper.make_node("MatMul", ["W", "X"], ["Y"])], [("X", TensorProto.FLOAT, [19, 6])],
                       sparse_initializers=[sparse_proto(w, "W")])
    check_against_ort(model, {"X": rand((19, 6))})
    assert kernels_in(model) == ["spmm_13x19_n6_float32_int32"]


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("sparse_input", ["A", "B"])
def test_gemm_variants(sparse_input, trans_a, trans_b):
    M, K, N = 6, 29, 17
    a_shape = [K, M] if trans_a else [M, K]
    b_shape = [N, K] if trans_b else [K, N]
    w = sparse_weight(*(a_shape if sparse_input == "A" else b_shape), 0.15, seed=trans_a + 2 * trans_b)
    dense_name, dense_shape = ("B", b_shape) if sparse_input == "A" else ("A", a_shape)
    c = rand((N,), seed=7)
    node = helper.make_node("Gemm", ["A", "B", "C"], ["Y"], transA=trans_a, transB=trans_b, alpha=0.75, beta=-1.5)
    model = make_model([node], [(dense_name, TensorProto.FLOAT, dense_shape)],
                       initializers=[numpy_helper.from_array(c, "C")],
                       sparse_initializers=[sparse_proto(w, sparse_input)])
    check_against_ort(model, {dense_name: rand(dense_shape, seed=3)})
    assert len(kernels_in(model)) == 1


def test_gemm_without_c_opset_11():
    w = sparse_weight(17, 29, 0.1)
    node = helper.make_node("Gemm", ["A", "W"], ["Y"], transB=1)
    model = make_model([node], [("A", TensorProto.FLOAT, [3, 29])], sparse_initializers=[sparse_proto(w, "W")],
                       opset=11)
    check_against_ort(model, {"A": rand((3, 29))})
    assert kernels_in(model) == ["spmm_17x29_n3_float32_int32"]


def test_mostly_zero_dense_initializer_goes_sparse_only_when_asked():
    w = sparse_weight(41, 20, 0.05)  # ~95% zeros
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [7, 41])],
                       initializers=[numpy_helper.from_array(w, "W")])
    assert kernels_in(model) == []  # the automatic route is opt-in: dense semantics by default
    check_against_ort(model, {"X": rand((7, 41))})
    assert kernels_in(model, sparse_threshold=0.9) == ["spmm_t_41x20_n7_float32_int32_int32"]
    check_against_ort(model, {"X": rand((7, 41))}, sparse_threshold=0.9)
    assert kernels_in(model, sparse_threshold=0.99) == []  # not enough zeros for 99%
    assert kernels_in(model, sparse_threshold=None) == []  # off


def test_nan_in_the_input_spreads_as_dense_math_spreads_it_by_default():
    """A NaN in X meets every column of W: dense math (and onnxruntime) gives NaN in every output of
    its row. The sparse kernels (asked for with sparse_threshold) multiply only the stored non-zeros:
    the NaN reaches only the outputs whose column of W holds a non-zero in its row (README)."""
    w = sparse_weight(41, 20, 0.05)
    w[3, :] = 0.0
    w[3, 7] = 0.5     # row 3 of W: one non-zero, in column 7
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [2, 41])],
                       initializers=[numpy_helper.from_array(w, "W")])
    x = rand((2, 41))
    x[0, 3] = np.nan
    if ort is None:
        pytest.skip("onnxruntime is not installed")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    assert np.isnan(want[0]).all() and not np.isnan(want[1]).any()
    dense = compile_model(model)(X=x)
    np.testing.assert_array_equal(np.isnan(dense), np.isnan(want))
    np.testing.assert_allclose(dense[1], want[1], **TOL["float32"])
    sparse = compile_model(model, sparse_threshold=0.9)(X=x)
    assert np.flatnonzero(np.isnan(sparse[0])).tolist() == [7] and not np.isnan(sparse[1]).any()


def test_dense_constant_node_below_the_threshold_stays_dense():
    w = sparse_weight(12, 9, 0.5)
    nodes = [helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w, "W")),
             helper.make_node("MatMul", ["X", "W"], ["Y"])]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [2, 12])])
    assert kernels_in(model) == []
    assert kernels_in(model, sparse_threshold=0.3) == ["spmm_t_12x9_n2_float32_int32_int32"]
    check_against_ort(model, {"X": rand((2, 12))}, sparse_threshold=0.3)


def test_symbolic_batch_uses_a_symbolic_kernel():
    w = sparse_weight(37, 23, 0.1)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, ["batch", 3, 37])],
                       sparse_initializers=[sparse_proto(w, "W")])
    compiled = compile_model(model)
    if ort is None:
        pytest.skip("onnxruntime is not installed")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        x = rand((batch, 3, 37), seed=batch)
        np.testing.assert_allclose(compiled(X=x), sess.run(None, {"X": x})[0], **TOL["float32"])
    assert kernels_in(model) == ["spmm_t_37x23_ndyn_float32_int32_int32"]


def test_sparse_weight_also_read_by_another_node_keeps_a_dense_copy():
    w = sparse_weight(8, 8, 0.2)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["P"]), helper.make_node("Add", ["P", "W"], ["Y"])]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [8, 8])], sparse_initializers=[sparse_proto(w, "W")])
    check_against_ort(model, {"X": rand((8, 8))})
    assert kernels_in(model) == ["spmm_t_8x8_n8_float32_int32_int32"]


def test_two_nodes_share_one_sparse_weight_and_unnamed_nodes_get_names():
    w = sparse_weight(10, 10, 0.2)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["P"]), helper.make_node("MatMul", ["P", "W"], ["Y"])]
    model = make_model(nodes, [("X", TensorProto.FLOAT, [3, 10])], sparse_initializers=[sparse_proto(w, "W")])
    check_against_ort(model, {"X": rand((3, 10))})
    pre, options = onnx_sparse.preprocess_sparse(model)
    assert len(options["sparse_operands"]) == 2 and not pre.graph.sparse_initializer
    again, options2 = onnx_sparse.preprocess_sparse(pre, options)  # idempotent
    assert again is pre and options2["sparse_operands"] == options["sparse_operands"]


def test_all_zero_sparse_weight():
    w = np.zeros((6, 4), np.float32)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [2, 6])],
                       sparse_initializers=[sparse_proto(w, "W")])
    check_against_ort(model, {"X": rand((2, 6))})


def test_non_2d_sparse_initializer_is_densified():
    w = sparse_weight(4, 15, 0.3).reshape(2, 2, 15)
    model = make_model([helper.make_node("Add", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [2, 2, 15])],
                       sparse_initializers=[sparse_proto(w, "W")])
    check_against_ort(model, {"X": rand((2, 2, 15))})


@pytest.mark.parametrize("indices,match", [
    (np.array([0, 99], np.int64), "linear index 99 out of range"),
    (np.array([3, 3], np.int64), r"index \[0, 3\] appears twice"),
    (np.array([0], np.int64), "1 indices for 2 values"),
    (np.array([[0, 0], [5, 0]], np.int64), r"index \[5, 0\] out of range"),
])
def test_invalid_sparse_tensor_is_rejected(indices, match):
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "W")
    sparse_t = helper.make_sparse_tensor(values, numpy_helper.from_array(indices, "W_indices"), [5, 4])
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [2, 5])],
                       sparse_initializers=[sparse_t])
    with pytest.raises(TvmseqError, match=f"sparse tensor 'W': {match}"):
        onnx_sparse.preprocess_sparse(model)


@pytest.mark.parametrize("value", [1.5, -0.1, "most"])
def test_invalid_threshold_is_rejected(value):
    w = sparse_weight(6, 4, 0.2)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm")], [("X", TensorProto.FLOAT, [2, 6])],
                       initializers=[numpy_helper.from_array(w, "W")])
    with pytest.raises(TvmseqError, match="node 'mm' .*sparse_threshold"):
        kernels_in(model, sparse_threshold=value)


def test_dense_matmul_and_gemm_still_use_tvms_converters():
    a, b = rand((3, 5)), rand((5, 4), seed=2)
    nodes = [helper.make_node("MatMul", ["A", "B"], ["P"]), helper.make_node("Gemm", ["P", "C"], ["Y"], transB=1)]
    model = make_model(nodes, [("A", TensorProto.FLOAT, [3, 5]), ("B", TensorProto.FLOAT, [5, 4])],
                       initializers=[numpy_helper.from_array(rand((2, 4), seed=4), "C")])
    check_against_ort(model, {"A": a, "B": b})
    assert kernels_in(model) == []


def test_cuda_build_keeps_the_hand_scheduled_kernels():
    """Import and build for CUDA (no GPU needed: the module carries the CUDA source); dlight must leave
    the sparse kernels alone (they are marked scheduled)."""
    from tvmseq.build import build_relax

    w = sparse_weight(37, 23, 0.1)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, ["batch", 37])],
                       sparse_initializers=[sparse_proto(w, "W")])
    pre, options = onnx_sparse.preprocess_sparse(model)
    mod = from_onnx(pre, target="nvidia/nvidia-h100", **options)
    func = mod["spmm_t_37x23_ndyn_float32_int32_int32"]
    assert func.attrs["tirx.is_scheduled"]
    assert "blockIdx.x" in func.script()
    build_relax(mod, "nvidia/nvidia-h100")


def test_onnx_model_checker_accepts_the_preprocessed_model():
    w = sparse_weight(9, 4, 0.2)
    model = make_model([helper.make_node("MatMul", ["X", "W"], ["Y"])], [("X", TensorProto.FLOAT, [2, 9])],
                       sparse_initializers=[sparse_proto(w, "W")], out_shape=[2, 4])
    onnx.checker.check_model(model)
    pre, _ = onnx_sparse.preprocess_sparse(model)
    onnx.checker.check_model(pre)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sparse_models_on_gpu(dtype):
    """MatMul (dynamic batch) and Gemm(transB=1) with sparse weights, compiled for CUDA and run there,
    against float64 numpy."""
    import tvm

    if tvm.base._RUNTIME_ONLY:
        pytest.skip("compiles the model on the GPU machine: needs TVM's compiler, not only its runtime")
    w1, w2 = sparse_weight(300, 130, 0.02, dtype, seed=1), sparse_weight(50, 130, 0.1, dtype, seed=2)
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"]),
             helper.make_node("Gemm", ["H", "W2", "C"], ["Y"], transB=1)]
    c = rand((50,), dtype, seed=3)
    model = make_model(nodes, [("X", ONNX_TYPE[dtype], ["batch", 300])], out_type=ONNX_TYPE[dtype],
                       initializers=[numpy_helper.from_array(c, "C")],
                       sparse_initializers=[sparse_proto(w1, "W1"), sparse_proto(w2, "W2")])
    pre, options = onnx_sparse.preprocess_sparse(model)
    compiled = tvmseq.compile_onnx(pre, target="cuda", **options)
    for batch in (1, 77):
        x = rand((batch, 300), dtype, seed=batch)
        h = (x.astype(np.float64) @ w1.astype(np.float64)).astype(dtype).astype(np.float64)
        want = h @ w2.astype(np.float64).T + c
        np.testing.assert_allclose(compiled(X=x).astype(np.float64), want, **TOL[dtype])
