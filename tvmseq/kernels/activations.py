"""ONNX RNN-family activation functions as TIR expressions (float32 in, float32 out).

`Activation` holds an ONNX activation name with its alpha/beta, validated at import time; `expr(x)`
builds the TIR expression, `numpy(x)` the reference. Defaults for alpha/beta follow the ONNX spec.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import TvmseqError

# name -> (default alpha, default beta); None where the function takes none
_DEFAULTS = {
    "Relu": (None, None), "Tanh": (None, None), "Sigmoid": (None, None),
    "Affine": (1.0, 0.0), "LeakyRelu": (0.01, None), "ThresholdedRelu": (1.0, None),
    "ScaledTanh": (1.0, 1.0), "HardSigmoid": (0.2, 0.5), "Elu": (1.0, None),
    "Softsign": (None, None), "Softplus": (None, None),
}
_CANONICAL = {k.lower(): k for k in _DEFAULTS}


@dataclass(frozen=True)
class Activation:
    name: str
    alpha: float | None = None
    beta: float | None = None

    @classmethod
    def make(cls, name: str | bytes, alpha: float | None = None, beta: float | None = None) -> "Activation":
        if isinstance(name, bytes):
            name = name.decode()
        canonical = _CANONICAL.get(name.lower())
        if canonical is None:
            raise TvmseqError(f"unsupported activation {name!r}; supported: {', '.join(_DEFAULTS)}")
        da, db = _DEFAULTS[canonical]
        return cls(canonical, da if alpha is None else float(alpha), db if beta is None else float(beta))

    @property
    def takes_alpha(self) -> bool:
        return _DEFAULTS[self.name][0] is not None

    @property
    def takes_beta(self) -> bool:
        return _DEFAULTS[self.name][1] is not None

    def expr(self, x, fast: bool = False):
        """TIR float32 expression of this activation applied to `x`; `fast`: Sigmoid and Tanh on CUDA's fast
        intrinsics (`fast_sigmoid`; CUDA targets only)."""
        # imported here: tvm.script needs TVM's compiler, and the numpy side must work in runtime-only TVM
        from tvm.script import tirx as T

        f32 = lambda v: T.float32(v)  # noqa: E731
        a, b, n = self.alpha, self.beta, self.name
        if n == "Relu":
            return T.max(x, f32(0))
        if n == "Tanh":
            return f32(2) * fast_sigmoid(f32(2) * x) - f32(1) if fast else T.tanh(x)
        if n == "Sigmoid":
            return fast_sigmoid(x) if fast else T.sigmoid(x)
        if n == "Affine":
            return f32(a) * x + f32(b)
        if n == "LeakyRelu":
            return T.if_then_else(x >= f32(0), x, f32(a) * x)
        if n == "ThresholdedRelu":
            return T.if_then_else(x > f32(a), x, f32(0))
        if n == "ScaledTanh":
            return f32(a) * T.tanh(f32(b) * x)
        if n == "HardSigmoid":
            return T.max(f32(0), T.min(f32(1), f32(a) * x + f32(b)))
        if n == "Elu":
            return T.if_then_else(x >= f32(0), x, f32(a) * (T.exp(x) - f32(1)))
        if n == "Softsign":
            return x / (f32(1) + T.fabs(x))
        if n == "Softplus":
            # log(1 + e^x) without overflow for large x
            return T.max(x, f32(0)) + T.log(f32(1) + T.exp(f32(0) - T.fabs(x)))
        raise AssertionError(n)

    def numpy(self, x: np.ndarray) -> np.ndarray:
        a, b, n = self.alpha, self.beta, self.name
        if n == "Relu":
            return np.maximum(x, 0)
        if n == "Tanh":
            return np.tanh(x)
        if n == "Sigmoid":
            return 1.0 / (1.0 + np.exp(-x))
        if n == "Affine":
            return a * x + b
        if n == "LeakyRelu":
            return np.where(x >= 0, x, a * x)
        if n == "ThresholdedRelu":
            return np.where(x > a, x, 0)
        if n == "ScaledTanh":
            return a * np.tanh(b * x)
        if n == "HardSigmoid":
            return np.clip(a * x + b, 0, 1)
        if n == "Elu":
            return np.where(x >= 0, x, a * (np.exp(x) - 1))
        if n == "Softsign":
            return x / (1 + np.abs(x))
        if n == "Softplus":
            return np.logaddexp(0, x)
        raise AssertionError(n)


def fast_sigmoid(x):
    """1 / (1 + e^-x) on CUDA's fast intrinsics: __expf (one multiply and ex2.approx) and __fdividef (rcp.approx
    and a multiply), about 5 instructions against ~20 for expf and an IEEE division (tanhf: ~25 with a branch);
    absolute error < 3e-7 (tanh as 2 sigmoid(2x) - 1: < 6e-7). __fdividef(1, y) is 0 for y > 2^126 and for an
    infinite e^-x, sigmoid's limit. A recurrence's gate math is on its step's critical path, once a step."""
    from tvm.script import tirx as T

    e = T.call_pure_extern("float32", "__expf", T.float32(0) - x)
    return T.call_pure_extern("float32", "__fdividef", T.float32(1), T.float32(1) + e)


def parse_onnx_activations(attr: dict, num_gates_fns: int, num_directions: int, defaults: list[str],
                           where: str) -> list[Activation]:
    """The `activations`/`activation_alpha`/`activation_beta` attributes of an ONNX RNN-family node as
    a list of num_gates_fns * num_directions Activations (direction-major, as the spec lays them out).
    alpha/beta lists are consumed in order by the functions that take them (onnxruntime's convention)."""
    names = attr.get("activations")
    want = num_gates_fns * num_directions
    if names is None:
        names = list(defaults) * num_directions
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    if len(names) == num_gates_fns and num_directions == 2:
        names = names * 2  # one set given for both directions (onnxruntime accepts this)
    if len(names) != want:
        raise TvmseqError(f"{where}: attribute 'activations' has {len(names)} entries, expected {want}")
    alphas = list(attr.get("activation_alpha", ()))
    betas = list(attr.get("activation_beta", ()))
    out = []
    for n in names:
        try:
            act = Activation.make(n)
        except TvmseqError as err:
            raise TvmseqError(f"{where}: attribute 'activations': {err}") from None
        a = alphas.pop(0) if act.takes_alpha and alphas else None
        b = betas.pop(0) if act.takes_beta and betas else None
        out.append(Activation.make(n, a, b))
    return out
