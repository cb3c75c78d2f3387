"""A plain float64 numpy GRU (ONNX gate order z, r, h) shared by the kernel tests; imports no TVM, so the
GPU tests can use it where only TVM's runtime is installed."""
import numpy as np


def numpy_gru(X, W, R, Bias, lens, h0, reverse_dirs, lbr, clip, acts):
    """Plain float64 GRU, ONNX gate order z, r, h; acts = [(f, g)] per direction as numpy callables."""
    T_, B, _ = X.shape
    D, _, H = h0.shape
    c = (lambda x: x) if clip is None else (lambda x: np.clip(x, -clip, clip))
    Y, Yh = np.zeros((T_, D, B, H)), np.zeros((D, B, H))
    for d in range(D):
        f, g = acts[d]
        Wz, Wr, Wh = np.split(W[d].astype(np.float64), 3)
        Rz, Rr, Rh = np.split(R[d].astype(np.float64), 3)
        wbz, wbr, wbh, rbz, rbr, rbh = np.split(Bias[d].astype(np.float64), 6)
        for b in range(B):
            h = h0[d, b].astype(np.float64)
            for s in range(lens[b]):
                t = lens[b] - 1 - s if reverse_dirs[d] else s
                x = X[t, b].astype(np.float64)
                z = f(c(x @ Wz.T + wbz + h @ Rz.T + rbz))
                r = f(c(x @ Wr.T + wbr + h @ Rr.T + rbr))
                if lbr:
                    hh = g(c(x @ Wh.T + wbh + r * (h @ Rh.T + rbh)))
                else:
                    hh = g(c(x @ Wh.T + wbh + (r * h) @ Rh.T + rbh))
                h = (1 - z) * hh + z * h
                Y[t, d, b] = h
            Yh[d, b] = h if lens[b] > 0 else 0
    return Y, Yh
