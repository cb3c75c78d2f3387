"""The importer tests' two checks: an ONNX model compiled once for the CPU and run on each set of inputs beside
onnxruntime, every output's shape and values compared; and a model refused with one line."""
from __future__ import annotations

import numpy as np
import pytest

import tvmseq


def matches_onnxruntime(model, feeds_list, exact: bool = False, **options):
    """The compiled model (llvm; `options` go to tvmseq.compile_onnx), after checking it against onnxruntime's CPU
    provider on every feed: values equal with `exact`, else within 1e-5 relative and 1e-6 absolute."""
    import onnxruntime as ort

    data = model if isinstance(model, bytes) else model.SerializeToString()
    compiled = tvmseq.compile_onnx(data, target="llvm", **options)
    session_options = ort.SessionOptions()
    session_options.log_severity_level = 3          # onnxruntime warns about every model of an old opset
    session = ort.InferenceSession(data, session_options, providers=["CPUExecutionProvider"])
    for feeds in feeds_list:
        want = session.run(None, feeds)
        got = compiled(**feeds)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want):
            assert g.shape == w.shape, f"{ {k: v.shape for k, v in feeds.items()} }: {g.shape} != {w.shape}"
            if exact:
                np.testing.assert_array_equal(g, w)
            else:
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    return compiled


def refused_in_one_line(model, pattern: str) -> None:
    """Compiling `model` for the CPU raises a TvmseqError matching `pattern`, in one line."""
    data = model if isinstance(model, bytes) else model.SerializeToString()
    with pytest.raises(tvmseq.TvmseqError, match=pattern) as err:
        tvmseq.compile_onnx(data, target="llvm")
    assert "\n" not in str(err.value)
