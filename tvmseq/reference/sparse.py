"""Numpy references for sparse x dense matmul: plain dense algebra in float64, cast back."""
from __future__ import annotations

import numpy as np


def csr_to_dense(indptr, indices, data, shape) -> np.ndarray:
    """Dense matrix of a CSR triple (duplicates summed, like scipy)."""
    out = np.zeros(shape, dtype=np.float64)
    rows = np.repeat(np.arange(shape[0]), np.diff(np.asarray(indptr)))
    np.add.at(out, (rows, np.asarray(indices)), np.asarray(data, dtype=np.float64))
    return out


def spmm_reference(indptr, indices, data, shape, D) -> np.ndarray:
    """S @ D, computed densely in float64 and returned in D's dtype."""
    D = np.asarray(D)
    return (csr_to_dense(indptr, indices, data, shape) @ D.astype(np.float64)).astype(D.dtype)


def spmm_t_reference(indptr, indices, data, shape, D) -> np.ndarray:
    """S^T @ D, computed densely in float64 and returned in D's dtype."""
    D = np.asarray(D)
    return (csr_to_dense(indptr, indices, data, shape).T @ D.astype(np.float64)).astype(D.dtype)
