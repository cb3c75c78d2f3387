"""One beam-search step, fused: log-softmax of the logits + each beam's running score, then the k
best (beam, token) pairs over beam x vocab, in one pass over the logits (see
`tvmseq.kernels.topk.topk.beam_step_func` for the kernels).

    scores, beam_ids, token_ids = tvmseq.beam_search_step(logits, beam_scores, beam=4)

logits: (batch, beam, vocab) or (batch*beam, vocab), float32 or float16; beam_scores: (batch, beam)
float32. Returns scores (batch, k) float32 best first, beam ids and token ids (batch, k) int64; equal
scores go to the lower beam*vocab + token. k defaults to `beam`.
Inputs may be numpy arrays (numpy comes back) or DLPack tensors / tvm tensors on the target's device
(tvm tensors come back, on that device).
"""
from __future__ import annotations

import functools

import numpy as np
import tvm

from . import targets
from .errors import TvmseqError
from .kernels.topk import topk as _tk


def validate_beam_step(logits_shape, logits_dtype: str, scores_shape, scores_dtype: str, beam: int,
                       k: int) -> tuple[int, int]:
    """Check shapes/dtypes before any kernel runs; returns (batch, vocab)."""
    if isinstance(beam, bool) or not isinstance(beam, (int, np.integer)) or beam < 1:
        raise TvmseqError(f"beam_search_step: beam must be a positive integer, got {beam!r}")
    if str(logits_dtype) not in ("float32", "float16"):
        raise TvmseqError(f"beam_search_step: 'logits' has dtype {logits_dtype}; use float32 or float16")
    if str(scores_dtype) != "float32":
        raise TvmseqError(f"beam_search_step: 'beam_scores' has dtype {scores_dtype}; use float32")
    logits_shape, scores_shape = tuple(logits_shape), tuple(scores_shape)
    if len(scores_shape) != 2 or scores_shape[1] != beam:
        raise TvmseqError(f"beam_search_step: 'beam_scores' has shape {scores_shape}; expected (batch, {beam})")
    batch = scores_shape[0]
    if len(logits_shape) == 3:
        if logits_shape[:2] != (batch, beam):
            raise TvmseqError(f"beam_search_step: 'logits' has shape {logits_shape}; expected "
                              f"({batch}, {beam}, vocab) to match 'beam_scores'")
    elif len(logits_shape) == 2:
        if logits_shape[0] != batch * beam:
            raise TvmseqError(f"beam_search_step: 'logits' has shape {logits_shape}; expected "
                              f"({batch * beam}, vocab) = (batch*beam, vocab)")
    else:
        raise TvmseqError(f"beam_search_step: 'logits' has rank {len(logits_shape)}; expected 2 or 3")
    vocab = logits_shape[-1]
    if batch < 1 or vocab < 1:
        raise TvmseqError("beam_search_step: empty input")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= vocab:
        raise TvmseqError(f"beam_search_step: k={k!r} must be an integer in [1, vocab={vocab}]")
    return batch, vocab


def build_beam_step(batch: int, beam: int, vocab: int, k: int, dtype: str = "float32", target=None,
                    cfg: _tk.TopKConfig | None = None):
    """Compiled executable (cached); `ex["beam_step"](logits2d, beam_scores, scores, beam_ids, tokens)`."""
    return _build_beam_step(batch, beam, vocab, k, dtype, _tk.target_key(target), cfg)


@functools.lru_cache(maxsize=None)
def _build_beam_step(batch, beam, vocab, k, dtype, target_json: str, cfg):
    tgt = tvm.target.Target(target_json)
    gpu = targets.is_gpu(tgt)
    cfg = cfg or _tk.choose_config(batch * beam, vocab, k, gpu, measured=False)  # top-k winners are not beam winners
    cfg.validate(gpu)
    func = _tk.beam_step_func(batch, beam, vocab, k, dtype, gpu, cfg)
    return tvm.compile(tvm.IRModule({"beam_step": func}), target=tgt)


def beam_search_step(logits, beam_scores, beam: int, k: int | None = None, target=None,
                     cfg: _tk.TopKConfig | None = None):
    """(scores, beam_ids, token_ids) of one fused beam-search step (see the module docstring)."""
    k = beam if k is None else k
    as_numpy = isinstance(logits, np.ndarray) or isinstance(beam_scores, np.ndarray)
    batch, vocab = validate_beam_step(logits.shape, str(logits.dtype), beam_scores.shape,
                                      str(beam_scores.dtype), beam, k)
    tgt = targets.resolve(target)
    dev = targets.device_for(tgt)
    ex = build_beam_step(batch, int(beam), vocab, int(k), str(logits.dtype), tgt, cfg)
    x = _to_tensor(logits, dev)
    if len(logits.shape) == 3:
        x = x._create_view((batch * beam, vocab))
    bs = _to_tensor(beam_scores, dev)
    scores = tvm.runtime.empty((batch, k), "float32", dev)
    beam_ids = tvm.runtime.empty((batch, k), "int64", dev)
    tokens = tvm.runtime.empty((batch, k), "int64", dev)
    ex["beam_step"](x, bs, scores, beam_ids, tokens)
    if as_numpy:
        return scores.numpy(), beam_ids.numpy(), tokens.numpy()
    return scores, beam_ids, tokens


def _to_tensor(a, dev):
    if isinstance(a, np.ndarray):
        return tvm.runtime.tensor(np.ascontiguousarray(a), dev)
    if isinstance(a, tvm.runtime.Tensor):
        return a
    if hasattr(a, "__dlpack__"):
        return tvm.runtime.from_dlpack(a)
    raise TvmseqError(f"beam_search_step: cannot use an input of type {type(a).__name__} "
                      "(numpy array, DLPack tensor or tvm tensor)")
