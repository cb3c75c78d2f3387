"""Per-call overhead of a CPU model (issue #23: small models such as silero VAD and dtln spend a good part of a call
outside their kernels). The numpy call path checks inputs against facts worked out once (`_HostInput`), copies
a call's inputs into one 64-byte aligned block (`_aligned_copies`) and reads outputs back through DLPack; these
tests hold it to the generic path's results and errors, at odd symbolic sizes."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")
if getattr(tvm.base, "_RUNTIME_ONLY", False):   # models are compiled here: TVM's compiler is needed
    pytest.skip("TVM runtime only: these tests compile models", allow_module_level=True)

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tvmseq  # noqa: E402
from tvmseq import runtime  # noqa: E402
from tvmseq.errors import TvmseqError  # noqa: E402


def _model():
    """Y = X * s + b over symbolic (B, T, 5), plus Z = Cast(K, int32) + 1 over (B,) and a bool output: three
    inputs sharing the symbolic B, outputs of three dtypes."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", "T", 5])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    k = helper.make_tensor_value_info("K", TensorProto.INT64, ["B"])
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "T", 5]),
            helper.make_tensor_value_info("Z", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("P", TensorProto.BOOL, ["B", "T", 5])]
    nodes = [helper.make_node("Mul", ["X", "s"], ["xs"]), helper.make_node("Add", ["xs", "b"], ["Y"]),
             helper.make_node("Cast", ["K"], ["k32"], to=TensorProto.INT32),
             helper.make_node("Add", ["k32", "one"], ["Z"]), helper.make_node("Greater", ["Y", "zero"], ["P"])]
    inits = [numpy_helper.from_array(np.linspace(-1, 1, 5, dtype=np.float32), "b"),
             numpy_helper.from_array(np.array(1, np.int32), "one"),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    graph = helper.make_graph(nodes, "m", [x, s, k], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def compiled():
    return tvmseq.compile_onnx(_model(), target="llvm")


def _feeds(batch, time, seed=0):
    rng = np.random.default_rng(seed)
    return {"X": rng.standard_normal((batch, time, 5)).astype(np.float32), "s": np.array(1.5, np.float32),
            "K": rng.integers(-9, 9, batch).astype(np.int64)}


def _check(outputs, feeds):
    """Y as numpy computes it (TVM may fuse the multiply-add: within an ulp), Z exactly, P from the Y given."""
    y, z, p = outputs
    assert (y.dtype, z.dtype, p.dtype) == (np.float32, np.int32, np.bool_)
    np.testing.assert_allclose(y, feeds["X"] * np.float32(feeds["s"]) + np.linspace(-1, 1, 5, dtype=np.float32),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(z, feeds["K"].astype(np.int32) + 1)
    np.testing.assert_array_equal(p, y > 0)


@pytest.mark.parametrize("batch, time", [(1, 1), (3, 7), (5, 129)])
def test_numpy_inputs_take_the_fast_checks_and_match_the_generic_path(compiled, batch, time, monkeypatch):
    """Numpy inputs never reach the generic check (whose str(dtype) alone took ~5 us an input); the outputs
    equal those of the same inputs fed as TVM tensors (the generic path) and the numpy formula."""
    feeds = _feeds(batch, time)
    generic = compiled(**{k: tvm.runtime.tensor(v) for k, v in feeds.items()})

    def refuse(*_):
        raise AssertionError("the generic check ran for a numpy input")

    monkeypatch.setattr(runtime, "_check_shape_dtype", refuse)
    fast = compiled(**feeds)
    for got, same in zip(fast, generic):
        assert got.dtype == same.dtype and got.shape == same.shape
        np.testing.assert_array_equal(got, same)
    _check(fast, feeds)


@pytest.mark.parametrize("change, message", [
    (dict(X=np.zeros((2, 3, 5), np.float64)), "input 'X' has dtype float64, the model expects float32"),
    (dict(X=np.zeros((2, 3, 4), np.float32)), r"input 'X' has shape \[2, 3, 4\], the model expects"),
    (dict(X=np.zeros((2, 3), np.float32)), r"input 'X' has shape \[2, 3\] \(rank 2\)"),
    (dict(K=np.zeros(3, np.int64)), "input 'K' axis 0 is 3 but dimension 'B' is 2 in another input"),
    (dict(s=np.zeros(1, np.float32)), r"input 's' has shape \[1\]"),
])
def test_mismatched_numpy_inputs_keep_the_generic_one_line_errors(compiled, change, message):
    feeds = {**_feeds(2, 3), **change}
    with pytest.raises(TvmseqError, match=message) as err:
        compiled(**feeds)
    assert "\n" not in str(err.value)


def test_strided_misaligned_and_scalar_inputs(compiled):
    """A strided view, a view 4 bytes past an aligned start and a Python scalar: copied, right results, the
    caller's arrays untouched."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(2 * 9 * 10 + 1).astype(np.float32)
    x = base[1:].reshape(2, 9, 10)[:, :, ::2]                 # strided and misaligned
    k = np.arange(4, dtype=np.int64)[::2]
    before = base.copy()
    _check(compiled(X=x, s=2.0, K=k), {"X": x, "s": 2.0, "K": k})
    np.testing.assert_array_equal(base, before)


@pytest.mark.parametrize("arrays", [
    [np.float32(1.5) * np.ones((), np.float32)],
    [np.arange(7, dtype=np.float32), np.arange(3, dtype=np.int64), np.zeros((0, 4), np.float32)],
    [np.arange(30, dtype=np.float64).reshape(5, 6)[:, ::2], np.arange(13, dtype=np.int8), np.ones(1, np.float16)],
], ids=["rank0", "mixed-with-empty", "strided-int8-half"])
def test_aligned_copies_are_compact_aligned_and_equal(arrays):
    copies = runtime._aligned_copies(arrays)
    assert len(copies) == len(arrays)
    for arr, copy in zip(arrays, copies):
        assert copy.dtype == arr.dtype and copy.shape == arr.shape and copy.flags.c_contiguous
        assert copy.ctypes.data % runtime._ALIGNMENT == 0
        assert not np.shares_memory(copy, arr)
        np.testing.assert_array_equal(copy, arr)
    for a, b in zip(copies, copies[1:]):                     # one block, the copies side by side, no overlap
        assert not np.shares_memory(a, b)


def test_outputs_are_numpy_copies_of_every_dtype(compiled):
    """float32, int32 and bool outputs come back through DLPack as arrays the caller owns."""
    feeds = _feeds(2, 3)
    first = compiled(**feeds)
    kept = [o.copy() for o in first]
    for out in first:
        out[...] = 0
    again = compiled(**feeds)
    _check(again, feeds)
    for got, want in zip(again, kept):
        np.testing.assert_array_equal(got, want)


def test_host_input_facts(compiled):
    """_HostInput: static and symbolic dims, symbols shared between inputs, dtypes numpy lacks left to the
    generic check."""
    fact = runtime._HostInput({"shape": ["B", 4, "B"], "dtype": "float32"})
    symbols = {}
    assert fact.matches(np.zeros((3, 4, 3), np.float32), symbols) and symbols == {"B": 3}
    assert not fact.matches(np.zeros((3, 4, 2), np.float32), {})
    assert not fact.matches(np.zeros((2, 4, 2), np.float32), {"B": 3})
    assert not fact.matches(np.zeros((3, 4, 3), np.float64), {})
    assert not fact.matches(np.zeros((3, 4), np.float32), {})
    assert not runtime._HostInput({"shape": [2], "dtype": "bfloat16"}).matches(np.zeros(2, np.float32), {})
    assert not runtime._HostInput({"shape": None, "dtype": "float32"}).matches(np.zeros(2, np.float32), {})


# ---- the fast path: a call's inputs checked once per combination of shapes (runtime._FastEntry) ----------------
def _warm(model, feeds, calls=3):
    """Calls enough for the fast path to keep an entry for these shapes (one is made at the second call)."""
    for _ in range(calls):
        out = model(**feeds)
    return out


def test_fast_path_is_taken_and_gives_the_generic_outputs(compiled, monkeypatch):
    """From the second call of a shape on, numpy inputs skip the generic binding (`_bind`) altogether; every
    call's outputs equal those of the generic path (TVM tensor inputs) for new values of the same shapes, fed by
    name, positionally or as one dict."""
    _warm(compiled, _feeds(3, 7))
    assert ((3, 7, 5), (), (3,)) in compiled._fast

    def refuse(*_, **__):
        raise AssertionError("the generic binding ran on the fast path")

    monkeypatch.setattr(type(compiled), "_bind", refuse)
    for seed in range(1, 4):
        feeds = _feeds(3, 7, seed)
        for got in (compiled(**feeds), compiled(feeds["X"], feeds["s"], feeds["K"]), compiled(dict(feeds))):
            _check(got, feeds)
    monkeypatch.undo()
    for seed in range(4, 6):
        feeds = _feeds(3, 7, seed)
        generic = compiled(**{k: tvm.runtime.tensor(v) for k, v in feeds.items()})
        for got, same in zip(compiled(**feeds), generic):
            assert got.dtype == same.dtype and got.shape == same.shape
            np.testing.assert_array_equal(got, same)


@pytest.mark.parametrize("change, message", [
    (dict(X=np.zeros((2, 3, 5), np.float64)), "input 'X' has dtype float64, the model expects float32"),
    (dict(X=np.zeros((2, 3, 5), np.float32).astype(">f4")), "input 'X' has dtype"),
    (dict(X=np.zeros((2, 3, 4), np.float32)), r"input 'X' has shape \[2, 3, 4\], the model expects"),
    (dict(X=np.zeros((2, 3), np.float32)), r"input 'X' has shape \[2, 3\] \(rank 2\)"),
    (dict(K=np.zeros(3, np.int64)), "input 'K' axis 0 is 3 but dimension 'B' is 2 in another input"),
    (dict(K=np.zeros(2, np.int32)), "input 'K' has dtype int32, the model expects int64"),
    (dict(s=np.zeros(1, np.float32)), r"input 's' has shape \[1\]"),
    (dict(s="1.5"), "input 's'"),
    (dict(Q=np.zeros(2, np.float32)), "the model has no input named 'Q'"),
    (dict(K=None), "input 'K'"),
])
def test_fast_path_keeps_the_one_line_errors_after_good_calls(compiled, change, message):
    """A wrong dtype, rank, static or symbolic dim, or an unknown input after calls of the right shapes were
    cached: the same one-line errors as the generic path, and the cache still serves good calls."""
    good = _feeds(2, 3)
    _warm(compiled, good)
    assert ((2, 3, 5), (), (2,)) in compiled._fast
    feeds = {**good, **change}
    with pytest.raises(TvmseqError, match=message) as err:
        compiled(**feeds)
    assert "\n" not in str(err.value)
    _check(compiled(**good), good)


def test_fast_path_missing_or_extra_inputs(compiled):
    good = _feeds(2, 3)
    _warm(compiled, good)
    with pytest.raises(TvmseqError, match="missing model input\\(s\\): K"):
        compiled(X=good["X"], s=good["s"])
    with pytest.raises(TvmseqError, match="the model takes 3 inputs"):
        compiled(good["X"], good["s"], good["K"], good["K"])
    with pytest.raises(TvmseqError, match="given twice"):
        compiled(good["X"], good["s"], K=good["K"], X=good["X"])


def test_fast_path_scalars_strided_inputs_and_fresh_outputs(compiled):
    """Python scalars for the rank-0 input, strided and misaligned views (copied into the entry's buffers, the
    caller's arrays untouched), and outputs the caller owns: a later call neither changes them nor shares them."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal(2 * 9 * 10 + 1).astype(np.float32)
    x = base[1:].reshape(2, 9, 10)[:, :, ::2]
    k = np.arange(4, dtype=np.int64)[::2]
    before = base.copy()
    firsts = []
    for s in (2.0, 3, 0.5, 2.0):
        out = compiled(X=x, s=s, K=k)
        _check(out, {"X": x, "s": s, "K": k})
        firsts.append(out)
    assert ((2, 9, 5), (), (2,)) in compiled._fast
    np.testing.assert_array_equal(base, before)
    _check(firsts[0], {"X": x, "s": 2.0, "K": k})              # not overwritten by the later calls
    assert not np.shares_memory(firsts[0][0], firsts[3][0])
    firsts[3][0][...] = 0
    _check(compiled(X=x, s=2.0, K=k), {"X": x, "s": 2.0, "K": k})
    with pytest.raises(TvmseqError, match="input 'K' is 1.5, the model expects an integer"):
        compiled(X=np.zeros((1, 1, 5), np.float32), s=1.0, K=1.5)


def test_fast_path_runs_value_checks_at_every_call(compiled):
    """A range check recorded for an input (as converters record them) runs on the fast path too."""
    sig = {**compiled.signature, "inputs": [dict(s) for s in compiled.signature["inputs"]]}
    for spec in sig["inputs"]:
        if spec.get("onnx_name", spec["name"]) == "K":
            spec["checks"] = [{"kind": "range", "min": 0, "max": "B", "what": "K"}]
    model = runtime.Model(compiled.executable, compiled.target, sig)
    good = {**_feeds(3, 2), "K": np.array([0, 3, 1], np.int64)}
    _warm(model, good)
    assert model._fast
    with pytest.raises(TvmseqError, match=r"input 'K' \(K\) must lie in \[0, 3\], got values in \[0, 4\]"):
        model(**{**good, "K": np.array([0, 4, 1], np.int64)})


def test_fast_path_shapes_are_bounded_and_threads_do_not_share_buffers(compiled):
    """At most _FAST_SHAPES combinations are kept; calls from several threads at once get their own buffers."""
    from concurrent.futures import ThreadPoolExecutor

    for t in range(1, runtime._FAST_SHAPES + 4):
        _warm(compiled, _feeds(1, t), calls=2)
    assert 0 < len(compiled._fast) <= runtime._FAST_SHAPES
    feeds = [_feeds(2, 5, seed) for seed in range(16)]

    def call(f):
        return f, compiled(**f)

    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            for f, out in pool.map(call, feeds * 4):
                _check(out, f)


def _aliasing_model():
    """Y = 2 X (memory of its own), I = X passed through, C = a constant, V = Y reshaped (a view of Y's memory)."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["B", 4])
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", 4]),
            helper.make_tensor_value_info("I", TensorProto.FLOAT, ["B", 4]),
            helper.make_tensor_value_info("C", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("V", TensorProto.FLOAT, None)]
    nodes = [helper.make_node("Mul", ["X", "two"], ["Y"]), helper.make_node("Identity", ["X"], ["I"]),
             helper.make_node("Identity", ["c"], ["C"]), helper.make_node("Reshape", ["Y", "flat"], ["V"])]
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array([1, 2, 3], np.float32), "c"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    graph = helper.make_graph(nodes, "m", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_fast_path_hands_out_fresh_outputs_and_copies_aliases():
    """After two calls of a shape, outputs in memory the VM allocated for the call alone are returned without a copy;
    an input passed through, a constant and two views of one tensor are still copied: every call's outputs stay
    as they were, and writing into one changes neither the model nor another output."""
    model = tvmseq.compile_onnx(_aliasing_model(), target="llvm")
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(6)]
    outs = [model(X=x) for x in xs]
    (entry,) = model._fast.values()
    assert entry.fresh is not None and entry.fresh[1] is False and entry.fresh[2] is False
    assert not (entry.fresh[0] and entry.fresh[3])        # Y and its view never both handed out uncopied
    for x, (y, i, c, v) in zip(xs, outs):
        np.testing.assert_array_equal(y, 2 * x)
        np.testing.assert_array_equal(i, x)
        np.testing.assert_array_equal(c, [1, 2, 3])
        np.testing.assert_array_equal(v, (2 * x).ravel())
    outs[-1][2][...] = -1                                  # the returned constant is the caller's
    outs[-1][0][...] = 0                                   # so is Y: its view V keeps the call's values
    np.testing.assert_array_equal(outs[-1][3], (2 * xs[-1]).ravel())
    y, i, c, v = model(X=xs[0])
    np.testing.assert_array_equal(c, [1, 2, 3])
    np.testing.assert_array_equal(y, 2 * xs[0])


def test_fast_path_outputs_of_their_own_are_not_copied(compiled):
    """The three outputs of `_model` are each computed into memory of their own: from the third call of a shape
    they are the VM's tensors (no copy), and each call's stay as they were."""
    feeds = [_feeds(3, 4, seed) for seed in range(5)]
    outs = [compiled(**f) for f in feeds]
    assert compiled._fast[((3, 4, 5), (), (3,))].fresh == (True, True, True)
    assert not any(o.flags.owndata for o in outs[-1])
    for f, out in zip(feeds, outs):
        _check(out, f)
