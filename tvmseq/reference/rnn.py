"""Numpy references for ONNX GRU and RNN (opsets 7, 14, 22), computed in float64.

They follow the operator specs (https://onnx.ai/onnx/operators/onnx__GRU.html): gate order z, r, h;
`linear_before_reset`; forward / reverse / bidirectional; `sequence_lens` (outputs past a sequence's end
are zero, Y_h is the state at its last valid step, the reverse direction starts at its last valid step);
`initial_h` (a zero-length sequence yields Y_h = 0, as in onnxruntime); `layout` 0 ([seq, batch, ...]) and 1 ([batch, seq, ...]); `clip` (applied to every gate's
pre-activation, as onnxruntime does); `activations` with alpha/beta.
"""
from __future__ import annotations

import numpy as np

from ..kernels.activations import Activation

DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


def _as_acts(acts, defaults: list[str], num_directions: int) -> list[Activation]:
    if acts is None:
        acts = defaults * num_directions
    acts = [a if isinstance(a, Activation) else Activation.make(a) for a in acts]
    if len(acts) == len(defaults) and num_directions == 2:
        acts = acts * 2
    return acts


def _prepare(X, sequence_lens, initial_h, layout, num_directions, hidden_size):
    X = np.asarray(X, np.float64)
    if layout == 1:  # [batch, seq, input] -> [seq, batch, input]
        X = X.transpose(1, 0, 2)
    seq_length, batch = X.shape[:2]
    lens = (np.full(batch, seq_length, np.int64) if sequence_lens is None
            else np.asarray(sequence_lens, np.int64))
    if initial_h is None:
        h0 = np.zeros((num_directions, batch, hidden_size))
    else:
        h0 = np.asarray(initial_h, np.float64)
        if layout == 1:
            h0 = h0.transpose(1, 0, 2)
    return X, lens, h0


def _finish(Y, Y_h, layout):
    if layout == 1:  # Y [seq, dir, batch, hidden] -> [batch, seq, dir, hidden]; Y_h -> [batch, dir, hidden]
        return Y.transpose(2, 0, 1, 3), Y_h.transpose(1, 0, 2)
    return Y, Y_h


def _run(X, lens, h0, direction, step_fn):
    """Drive `step_fn(d, x_t[b], h[b]) -> h_new[b]` over time for every direction and batch row."""
    seq_length, batch = X.shape[:2]
    num_directions, _, hidden = h0.shape
    Y = np.zeros((seq_length, num_directions, batch, hidden))
    Y_h = h0.copy()
    for d in range(num_directions):
        reverse = direction == "reverse" or d == 1
        for b in range(batch):
            h = h0[d, b].copy()
            n = int(lens[b])
            for s in range(n):
                t = n - 1 - s if reverse else s
                h = step_fn(d, X[t, b], h)
                Y[t, d, b] = h
            # a zero-length sequence gives a zero Y_h (onnxruntime's behaviour; the spec is silent)
            Y_h[d, b] = h if n > 0 else 0.0
    return Y, Y_h


def _clip(x, clip):
    return x if clip is None else np.clip(x, -clip, clip)


def gru(X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, direction="forward",
        linear_before_reset=0, layout=0, clip=None, activations=None):
    """ONNX GRU. Shapes as in the spec (layout 0): X [T, N, I], W [D, 3H, I], R [D, 3H, H], B [D, 6H].
    Returns (Y [T, D, N, H], Y_h [D, N, H]) in float64 (layout 1 transposes as the spec says)."""
    D = DIRECTIONS[direction]
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    H = hidden_size or R.shape[-1]
    Bias = np.zeros((D, 6 * H)) if B is None else np.asarray(B, np.float64)
    acts = _as_acts(activations, ["Sigmoid", "Tanh"], D)
    X, lens, h0 = _prepare(X, sequence_lens, initial_h, layout, D, H)

    def step(d, x, h):
        f, g = acts[2 * d], acts[2 * d + 1]
        Wz, Wr, Wh = np.split(W[d], 3)
        Rz, Rr, Rh = np.split(R[d], 3)
        Wbz, Wbr, Wbh, Rbz, Rbr, Rbh = np.split(Bias[d], 6)
        z = f.numpy(_clip(x @ Wz.T + h @ Rz.T + Wbz + Rbz, clip))
        r = f.numpy(_clip(x @ Wr.T + h @ Rr.T + Wbr + Rbr, clip))
        if linear_before_reset:
            hh = g.numpy(_clip(x @ Wh.T + r * (h @ Rh.T + Rbh) + Wbh, clip))
        else:
            hh = g.numpy(_clip(x @ Wh.T + (r * h) @ Rh.T + Rbh + Wbh, clip))
        return (1 - z) * hh + z * h

    return _finish(*_run(X, lens, h0, direction, step), layout)


def rnn(X, W, R, B=None, sequence_lens=None, initial_h=None, *, hidden_size=None, direction="forward",
        layout=0, clip=None, activations=None):
    """ONNX RNN: h' = f(x W^T + h R^T + Wb + Rb). W [D, H, I], R [D, H, H], B [D, 2H]."""
    D = DIRECTIONS[direction]
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    H = hidden_size or R.shape[-1]
    Bias = np.zeros((D, 2 * H)) if B is None else np.asarray(B, np.float64)
    acts = _as_acts(activations, ["Tanh"], D)
    X, lens, h0 = _prepare(X, sequence_lens, initial_h, layout, D, H)

    def step(d, x, h):
        return acts[d].numpy(_clip(x @ W[d].T + h @ R[d].T + Bias[d, :H] + Bias[d, H:], clip))

    return _finish(*_run(X, lens, h0, direction, step), layout)
