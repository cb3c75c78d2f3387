"""A linear layer on sparse inputs, trained a few SGD steps with tvmseq's sparse kernels.

    Y  = X W + b                   forward:  spmm(X, W)      (X: batch x features, CSR)
    dW = X^T dY                    backward: spmm_t(X, dY)   (no transpose of X is ever built)
    db = sum over the batch of dY

The same steps are computed densely in numpy (float64) and the weights compared after every step.

    python examples/sparse_training.py [--target llvm|cuda] [--steps 5]
"""
from __future__ import annotations

import argparse

import numpy as np
import scipy.sparse

from tvmseq import sparse


def make_problem(batch=96, features=500, outputs=24, density=0.02, seed=0):
    """Sparse inputs (bag-of-words-like), targets from a hidden linear model, a zero-initialised layer."""
    rng = np.random.default_rng(seed)
    X = scipy.sparse.random(batch, features, density=density, format="csr", random_state=rng,
                            data_rvs=lambda k: rng.uniform(0.5, 1.5, k)).astype(np.float32)
    W_true = rng.standard_normal((features, outputs)).astype(np.float32)
    T = (X @ W_true + 0.1 * rng.standard_normal((batch, outputs))).astype(np.float32)
    W = np.zeros((features, outputs), np.float32)
    b = np.zeros(outputs, np.float32)
    return X, T, W, b


def train_sparse(X_csr, T, W, b, steps, lr, target):
    """SGD on 0.5 * mean squared error with tvmseq's kernels; returns (W, b, losses)."""
    X = sparse.CSR.from_scipy(X_csr)  # validated once; its transpose index map is built on first use
    W, b, losses = W.copy(), b.copy(), []
    for _ in range(steps):
        Y = sparse.spmm(X, W, target=target) + b  # forward
        dY = (Y - T) / len(T)
        losses.append(float(0.5 * np.sum((Y - T) ** 2) / len(T)))
        dW = sparse.spmm_t(X, dY.astype(np.float32), target=target)  # X^T dY, read from X's rows
        W -= lr * dW
        b -= lr * dY.sum(axis=0)
    return W, b, losses


def train_dense(X_csr, T, W, b, steps, lr):
    """The same steps with a dense X in float64 (the reference)."""
    X = X_csr.toarray().astype(np.float64)
    W, b, losses = W.astype(np.float64), b.astype(np.float64), []
    for _ in range(steps):
        Y = X @ W + b
        dY = (Y - T) / len(T)
        losses.append(float(0.5 * np.sum((Y - T) ** 2) / len(T)))
        W -= lr * (X.T @ dY)
        b -= lr * dY.sum(axis=0)
    return W, b, losses


def main(target=None, steps=5, lr=0.5, seed=0, verbose=True) -> dict:
    X, T, W0, b0 = make_problem(seed=seed)
    W, b, losses = train_sparse(X, T, W0, b0, steps, lr, target)
    W_ref, b_ref, losses_ref = train_dense(X, T, W0, b0, steps, lr)
    err_w = float(np.abs(W - W_ref).max() / np.abs(W_ref).max())
    err_b = float(np.abs(b - b_ref).max() / np.abs(b_ref).max())
    if verbose:
        for i, (l, r) in enumerate(zip(losses, losses_ref)):
            print(f"step {i}: loss {l:.6f} (dense numpy {r:.6f})")
        print(f"max relative difference to dense numpy after {steps} steps: W {err_w:.2e}, b {err_b:.2e}")
    return {"losses": losses, "losses_ref": losses_ref, "err_w": err_w, "err_b": err_b}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="llvm or cuda (default: the GPU if present)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    main(args.target, args.steps)
