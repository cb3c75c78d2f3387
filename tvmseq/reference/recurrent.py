"""numpy reference of the recurrent GEMM chain `C_n = f(A C_{n-1} + b)`, stored batch-major as
X_n = C_n^T: X_n = f(X_{n-1} A^T + b). Accumulates in float64; with dtype float16 the state is rounded
to float16 after every step, as the kernels store it."""
from __future__ import annotations

import numpy as np

_ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "identity": lambda x: x,
}


def recurrent_gemm(A: np.ndarray, bias: np.ndarray, x0: np.ndarray, steps: int, activation: str = "tanh",
                   return_sequences: bool = True) -> np.ndarray:
    """Every X_n for n = 1..steps ([steps, B, H]) or only X_steps ([B, H]), in A's dtype."""
    f = _ACTIVATIONS[activation.lower()] if isinstance(activation, str) else activation.numpy
    dtype = A.dtype
    a_t = A.astype(np.float64).T
    b = bias.astype(np.float64)
    x = x0.astype(np.float64)
    out = []
    for _ in range(steps):
        x = f(x @ a_t + b).astype(dtype).astype(np.float64)  # the state is stored in dtype
        out.append(x)
    return (np.stack(out) if return_sequences else out[-1]).astype(dtype)
