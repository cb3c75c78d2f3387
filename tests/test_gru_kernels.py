"""GRU TensorIR kernels (input projection + recurrence) on llvm against a plain numpy GRU."""
import functools

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from numpy_gru import numpy_gru
from tvmseq import targets
from tvmseq.kernels import gru
from tvmseq.kernels.activations import Activation


@functools.lru_cache(maxsize=None)
def _built(spec):
    tgt = targets.resolve("llvm")
    proj = tvm.compile(gru.schedule_input_projection(gru.input_projection_func(spec), tgt), target=tgt)
    rec = tvm.compile(tvm.IRModule({"main": gru.recurrence_func(spec, tgt)}), target=tgt)
    return proj["gru_input_projection"], rec["gru_recurrence"]


def _run(spec, X, W, R, Bias, lens, h0):
    H, D = spec.hidden, spec.num_directions
    lbr = spec.linear_before_reset
    bias_i = Bias[:, :3 * H] + np.concatenate([Bias[:, 3 * H:5 * H], (1 - lbr) * Bias[:, 5 * H:]], 1)
    proj, rec = _built(spec)
    tensor = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a))  # noqa: E731
    gate_i = tensor(np.full((D, X.shape[0], spec.batch, 3 * H), np.nan, np.float32))
    proj(tensor(X), tensor(W), tensor(bias_i.astype(np.float32)), gate_i)
    Y = tensor(np.full((X.shape[0], D, spec.batch, H), np.nan, spec.dtype))  # poisoned: every element must be written
    Yh = tensor(np.full((D, spec.batch, H), np.nan, spec.dtype))
    rec(gate_i, tensor(R), tensor(Bias[:, 5 * H:].astype(np.float32)), tensor(lens.astype(np.int32)),
        tensor(h0.astype(np.float32)), Y, Yh)
    return Y.numpy(), Yh.numpy()


TOL = {"float32": dict(rtol=1e-4, atol=1e-5), "float16": dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("hidden,batch,input_size", [(1, 1, 3), (7, 3, 5), (33, 2, 17)])
def test_recurrence_matches_numpy(dtype, direction, lbr, hidden, batch, input_size):
    rng = np.random.default_rng(hidden * 100 + batch)
    D = 2 if direction == "bidirectional" else 1
    seq = 6
    spec = gru.GruSpec(D, batch, hidden, input_size, dtype, lbr, direction, has_seq_lens=True)
    X = rng.standard_normal((seq, batch, input_size)).astype(dtype)
    W = rng.uniform(-0.6, 0.6, (D, 3 * hidden, input_size)).astype(dtype)
    R = rng.uniform(-0.6, 0.6, (D, 3 * hidden, hidden)).astype(dtype)
    Bias = rng.uniform(-0.5, 0.5, (D, 6 * hidden)).astype(np.float32)
    h0 = rng.standard_normal((D, batch, hidden)).astype(np.float32)
    lens = rng.integers(0, seq + 1, batch)
    lens[0] = seq
    Y, Yh = _run(spec, X, W, R, Bias, lens, h0)
    sig, tanh = (lambda x: 1 / (1 + np.exp(-x))), np.tanh
    rev = [direction == "reverse" or d == 1 for d in range(D)]
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, rev, lbr, None, [(sig, tanh)] * D)
    np.testing.assert_allclose(Y.astype(np.float64), rY, **TOL[dtype])
    np.testing.assert_allclose(Yh.astype(np.float64), rYh, **TOL[dtype])


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("acts", [("Sigmoid", "Tanh", "HardSigmoid", "Softsign"),
                                  ("LeakyRelu", "Relu", "ScaledTanh", "Elu")])
def test_recurrence_clip_and_per_direction_activations(clip, acts):
    rng = np.random.default_rng(7)
    hidden, batch, input_size, seq = 5, 2, 3, 4
    activations = tuple(Activation.make(a) for a in acts)
    spec = gru.GruSpec(2, batch, hidden, input_size, "float32", 0, "bidirectional", activations, clip)
    X = rng.standard_normal((seq, batch, input_size)).astype(np.float32)
    W = rng.uniform(-0.6, 0.6, (2, 3 * hidden, input_size)).astype(np.float32)
    R = rng.uniform(-0.6, 0.6, (2, 3 * hidden, hidden)).astype(np.float32)
    Bias = rng.uniform(-0.5, 0.5, (2, 6 * hidden)).astype(np.float32)
    h0 = rng.standard_normal((2, batch, hidden)).astype(np.float32)
    lens = np.full(batch, seq)
    Y, Yh = _run(spec, X, W, R, Bias, lens, h0)
    np_acts = [(activations[0].numpy, activations[1].numpy), (activations[2].numpy, activations[3].numpy)]
    rY, rYh = numpy_gru(X, W, R, Bias, lens, h0, [False, True], 0, clip, np_acts)
    np.testing.assert_allclose(Y, rY, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(Yh, rYh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["Relu", "Tanh", "Sigmoid", "Affine", "LeakyRelu", "ThresholdedRelu",
                                  "ScaledTanh", "HardSigmoid", "Elu", "Softsign", "Softplus"])
def test_activation_expr_matches_numpy(name):
    act = Activation.make(name, 0.7, 0.4) if name in ("Affine", "ScaledTanh", "HardSigmoid") else \
        Activation.make(name, 0.7 if name in ("LeakyRelu", "ThresholdedRelu", "Elu") else None)

    @T.prim_func
    def f(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            b[i] = act.expr(a[i])

    ex = tvm.compile(tvm.IRModule({"main": f}), target="llvm")
    x = np.linspace(-6, 6, 64).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(64, np.float32))
    ex["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), act.numpy(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_spec_rejects_bad_values():
    from tvmseq import TvmseqError

    with pytest.raises(TvmseqError, match="direction"):
        gru.GruSpec(1, 1, 4, 4, direction="sideways")
    with pytest.raises(TvmseqError, match="num_directions"):
        gru.GruSpec(1, 1, 4, 4, direction="bidirectional")
    with pytest.raises(TvmseqError, match="float32 and float16"):
        gru.GruSpec(1, 1, 4, 4, dtype="int8")
    with pytest.raises(TvmseqError, match="unsupported activation"):
        Activation.make("Gelu")
