"""Numpy reference for ONNX LSTM (opsets 7, 14, 22), computed in float64.

It follows the operator spec (https://onnx.ai/onnx/operators/onnx__LSTM.html) and onnxruntime where the
spec is silent: gate order i, o, f, c in W, R and B (B = [Wb, Rb]); peepholes P = [P_i, P_o, P_f], where
i and f see C_{t-1} and o sees C_t; `input_forget` couples f = 1 - i; `clip` bounds every gate's
pre-activation (peephole and biases included) but not the cell state; activations f, g, h per direction
with alpha/beta; `sequence_lens`, `initial_h`/`initial_c` and `layout` as for GRU and RNN (a zero-length
row yields Y_h = Y_c = 0, as in onnxruntime). The time loop, layouts and activations are those of the
GRU/RNN references (rnn.py).
"""
from __future__ import annotations

import numpy as np

from ..kernels.activations import Activation, parse_onnx_activations
from .rnn import DIRECTIONS, _as_acts, _clip, _finish, _prepare, _run

DEFAULT_ACTIVATIONS = ["Sigmoid", "Tanh", "Tanh"]


def lstm_activations(activations, activation_alpha, activation_beta, num_directions) -> list[Activation]:
    """3 * num_directions Activations (f, g, h of each direction) from names or Activation objects;
    alpha/beta lists are consumed in order by the functions that take them, as in an ONNX node."""
    if activations is not None and all(isinstance(a, Activation) for a in activations):
        return _as_acts(activations, DEFAULT_ACTIVATIONS, num_directions)
    attr = {"activations": activations} if activations is not None else {}
    if activation_alpha is not None:
        attr["activation_alpha"] = activation_alpha
    if activation_beta is not None:
        attr["activation_beta"] = activation_beta
    return parse_onnx_activations(attr, 3, num_directions, DEFAULT_ACTIVATIONS, "LSTM reference")


def lstm(X, W, R, B=None, sequence_lens=None, initial_h=None, initial_c=None, P=None, *, direction="forward",
         hidden_size=None, activations=None, activation_alpha=None, activation_beta=None, clip=None,
         input_forget=0, layout=0):
    """ONNX LSTM. Shapes as in the spec (layout 0): X [T, N, I], W [D, 4H, I], R [D, 4H, H], B [D, 8H],
    initial_h / initial_c [D, N, H], P [D, 3H]. Returns (Y [T, D, N, H], Y_h [D, N, H], Y_c [D, N, H]) in
    float64 (layout 1: [N, T, D, H] and [N, D, H])."""
    D = DIRECTIONS[direction]
    W, R = np.asarray(W, np.float64), np.asarray(R, np.float64)
    H = hidden_size or R.shape[-1]
    Bias = np.zeros((D, 8 * H)) if B is None else np.asarray(B, np.float64)
    Peep = np.zeros((D, 3 * H)) if P is None else np.asarray(P, np.float64)
    acts = lstm_activations(activations, activation_alpha, activation_beta, D)
    X, lens, h0 = _prepare(X, sequence_lens, initial_h, layout, D, H)
    c0 = np.zeros_like(h0) if initial_c is None else np.asarray(initial_c, np.float64)
    if layout == 1 and initial_c is not None:   # [batch, D, H] -> [D, batch, H], as _prepare does for h0
        c0 = c0.transpose(1, 0, 2)

    def step(d, x, hc):
        h, c_prev = hc[:H], hc[H:]
        f, g, hact = acts[3 * d: 3 * d + 3]
        pre = x @ W[d].T + h @ R[d].T + Bias[d, :4 * H] + Bias[d, 4 * H:]
        pre_i, pre_o, pre_f, pre_c = np.split(pre, 4)
        p_i, p_o, p_f = np.split(Peep[d], 3)
        i = f.numpy(_clip(pre_i + p_i * c_prev, clip))
        forget = 1.0 - i if input_forget else f.numpy(_clip(pre_f + p_f * c_prev, clip))
        c = forget * c_prev + i * g.numpy(_clip(pre_c, clip))
        o = f.numpy(_clip(pre_o + p_o * c, clip))
        return np.concatenate([o * hact.numpy(c), c])

    # the GRU/RNN time loop carries [h, c] as one state of 2H: its zeroing past a row's end and for
    # zero-length rows applies to both halves, as the spec and onnxruntime want
    Yhc, Yhc_last = _run(X, lens, np.concatenate([h0, c0], -1), direction, step)
    Y, Y_h = _finish(Yhc[..., :H], Yhc_last[..., :H], layout)
    Y_c = Yhc_last[..., H:]
    return Y, Y_h, (Y_c.transpose(1, 0, 2) if layout == 1 else Y_c)
