"""Numpy references for top-k (ONNX TopK semantics) and the beam-search step.

ONNX TopK: the k largest (or smallest) values along `axis`, sorted best first; equal values go to the
lower index first; indices are int64. NaN ranks above +inf for `largest=1` and below everything for
`largest=0`; -0.0 equals +0.0. Works for every numeric dtype (uint64 included: no negation is used).
"""
from __future__ import annotations

import numpy as np


def _order_row(row: np.ndarray, largest: bool) -> np.ndarray:
    """Indices of `row` best first, ties by lower index."""
    # dense rank of each value (equal values share a rank; NaNs rank last = largest)
    _, rank = np.unique(row, return_inverse=True)
    rank = rank.reshape(-1).astype(np.int64)
    primary = -rank if largest else rank
    return np.lexsort((np.arange(row.shape[0]), primary))


def topk(x: np.ndarray, k: int, axis: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    """(values, indices) of ONNX TopK. `sorted` is accepted; the result is always sorted."""
    x = np.asarray(x)
    axis = axis % x.ndim
    moved = np.moveaxis(x, axis, -1)
    lead, n = moved.shape[:-1], moved.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"k={k} out of range for axis of size {n}")
    flat = moved.reshape(-1, n)
    idx = np.zeros((flat.shape[0], k), np.int64)
    for r in range(flat.shape[0]):
        idx[r] = _order_row(flat[r], largest)[:k]
    vals = np.take_along_axis(flat, idx, axis=-1)
    return (np.moveaxis(vals.reshape(lead + (k,)), -1, axis),
            np.moveaxis(idx.reshape(lead + (k,)), -1, axis))


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """float64 log-softmax."""
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def beam_search_step(logits: np.ndarray, beam_scores: np.ndarray, k: int | None = None):
    """One beam-search step. logits (batch, beam, vocab) [or (batch*beam, vocab)], beam_scores
    (batch, beam). Candidate score = beam_score + log_softmax(logits); the k (default: beam) best over
    beam x vocab per batch row, ties by lower flat index beam*vocab+token.
    Returns (scores float64 (batch, k), beam ids int64, token ids int64)."""
    beam_scores = np.asarray(beam_scores, np.float64)
    batch, beam = beam_scores.shape
    logits = np.asarray(logits).reshape(batch, beam, -1)
    vocab = logits.shape[-1]
    k = beam if k is None else k
    scores = (beam_scores[:, :, None] + log_softmax(logits, -1)).reshape(batch, beam * vocab)
    vals, flat = topk(scores, k, axis=-1, largest=True)
    return vals, flat // vocab, flat % vocab
