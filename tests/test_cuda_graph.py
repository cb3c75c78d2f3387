"""CUDA-graph mode's bookkeeping, on the CPU: per-shape input buffers, the capture cache and its limit, the
fallback to uncaptured calls, and the streaming copy-back of the state. The capture itself needs a GPU
(tests/test_gpu_latency.py); here `tvmseq.cuda_graph.capture` is replaced by a stand-in that records what
it was asked to capture and replays it by calling the VM again at the same buffers, which is what a graph
replay does."""
from __future__ import annotations

import numpy as np
import pytest

from tvmseq import TvmseqError, cuda_graph
from tvmseq.build import compile_onnx
from tvmseq.models import rnn_node_model
from tvmseq.reference import gru as gru_ref


class _Replay:
    def __init__(self, call, copies_after):
        self.call, self.copies_after, self.nodes, self.replays = call, list(copies_after), 1, 0
        self.outputs = None

    def replay(self):
        """Like a graph: every replay writes the same output tensors."""
        self.replays += 1
        out = self.call()
        if self.outputs is None:
            self.outputs = out
        else:
            for kept, new in zip(_listed(self.outputs), _listed(out)):
                new.copyto(kept)
        for index, target in self.copies_after:
            _listed(self.outputs)[index].copyto(target)


def _listed(outputs):
    return (outputs,) if hasattr(outputs, "data_ptr") else tuple(outputs)


@pytest.fixture
def fake_capture(monkeypatch):
    made = []

    def capture(call, device, copies_after=()):
        made.append(_Replay(call, copies_after))
        return made[-1]

    monkeypatch.setattr(cuda_graph, "capture", capture)
    return made


def _gru(expose: bool = True):
    model, _ = rnn_node_model(op="GRU", seq="T", batch=2, input_size=5, hidden=7, linear_before_reset=1,
                              weight_scale=0.4, with_initial_h=expose)
    compiled = compile_onnx(model, target="llvm")
    compiled._graph_mode = True            # CPU stand-in for a CUDA model (the capture is faked)
    return model, compiled


def _want(model, x, h0):
    import onnx.numpy_helper as nh

    init = {i.name: nh.to_array(i) for i in model.graph.initializer}
    y, y_h = gru_ref(x, init["W"], init["R"], init.get("B"), initial_h=h0, linear_before_reset=1)
    return y, y_h


def test_each_shape_is_captured_once_and_replayed_at_its_own_buffers(fake_capture):
    model, compiled = _gru()
    rng = np.random.default_rng(0)
    calls = [(t, rng.standard_normal((t, 2, 5)).astype(np.float32)) for t in (3, 5, 3, 5, 3)]
    h0 = rng.standard_normal((1, 2, 7)).astype(np.float32)
    for t, x in calls:
        y, y_h = compiled(X=x, initial_h=h0)
        want_y, want_h = _want(model, x, h0)
        np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y_h, want_h, rtol=1e-4, atol=1e-5)
    assert len(fake_capture) == 2 and [c.replays for c in fake_capture] == [3, 2]
    assert not compiled.graph_fallbacks


def test_the_cache_starts_anew_past_max_graph_shapes(fake_capture):
    _, compiled = _gru()
    compiled.max_graph_shapes = 2
    h0 = np.zeros((1, 2, 7), np.float32)
    for t in (1, 2, 3, 1):
        compiled(X=np.ones((t, 2, 5), np.float32), initial_h=h0)
    assert len(compiled._graphs) <= 2 and len(fake_capture) == 4


def test_a_call_that_cannot_be_captured_runs_uncaptured_and_says_why(monkeypatch):
    model, compiled = _gru()

    def refuse(call, device, copies_after=()):
        raise cuda_graph.CaptureError("cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED")

    monkeypatch.setattr(cuda_graph, "capture", refuse)
    x, h0 = np.ones((4, 2, 5), np.float32), np.zeros((1, 2, 7), np.float32)
    for _ in range(2):
        np.testing.assert_allclose(compiled(X=x, initial_h=h0)[0], _want(model, x, h0)[0], rtol=1e-4, atol=1e-5)
    assert list(compiled.graph_fallbacks.values()) == ["cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"]


def test_inputs_given_in_place_twice_are_read_where_they_lie(fake_capture):
    """The same device tensors two calls in a row: a second capture reads them in place (no copies in), replayed
    while they stay; a value written into them is what the next call reads. Tensors that alternate, a host array
    or an offset view keep the copying capture."""
    import tvm

    model, compiled = _gru()
    rng = np.random.default_rng(5)
    x, h0 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 2, 5), (1, 2, 7)))
    tx, th = tvm.runtime.tensor(x), tvm.runtime.tensor(h0)
    for _ in range(3):
        np.testing.assert_allclose(compiled(X=tx, initial_h=th)[0], _want(model, x, h0)[0], rtol=1e-4, atol=1e-5)
    assert len(fake_capture) == 2 and [c.replays for c in fake_capture] == [1, 2]
    assert sum(k[1] == (tx.data_ptr(), th.data_ptr()) for k in compiled._graphs) == 1   # keyed by the addresses
    x2 = rng.standard_normal((4, 2, 5)).astype(np.float32)
    tx.copyfrom(x2)                                                 # new values where the capture reads
    np.testing.assert_allclose(compiled(X=tx, initial_h=th)[0], _want(model, x2, h0)[0], rtol=1e-4, atol=1e-5)
    assert fake_capture[1].replays == 3
    other = tvm.runtime.tensor(x)
    for xs in (other, tx, other, x):               # alternating (tx still in place), then a host array: copied in
        compiled(X=xs, initial_h=th)
    assert len(fake_capture) == 2 and [c.replays for c in fake_capture] == [4, 4]


def test_an_in_place_capture_that_fails_is_not_tried_again(fake_capture, monkeypatch):
    import tvm

    model, compiled = _gru()
    x, h0 = np.ones((3, 2, 5), np.float32), np.zeros((1, 2, 7), np.float32)
    tx, th = tvm.runtime.tensor(x), tvm.runtime.tensor(h0)
    compiled(X=tx, initial_h=th)                                    # the copying capture
    tries = []

    def refuse(call, device, copies_after=()):
        tries.append(1)
        raise cuda_graph.CaptureError("no")

    monkeypatch.setattr(cuda_graph, "capture", refuse)
    for _ in range(3):
        np.testing.assert_allclose(compiled(X=tx, initial_h=th)[0], _want(model, x, h0)[0], rtol=1e-4, atol=1e-5)
    assert len(tries) == 1 and fake_capture[0].replays == 4


@pytest.mark.parametrize("captured", [True, False])
def test_streaming_copies_the_state_back_inside_the_call(fake_capture, monkeypatch, captured):
    """Frame by frame equals the whole sequence; the state fed back is the state input's own buffer."""
    from tvmseq.stream import Stream

    if not captured:
        monkeypatch.setattr(cuda_graph, "capture", lambda *a, **k: (_ for _ in ()).throw(cuda_graph.CaptureError("no")))
    model, compiled = _gru()
    x = np.random.default_rng(1).standard_normal((6, 2, 5)).astype(np.float32)
    stream = Stream(compiled, state={"initial_h": "Y_h"})
    frames = [stream(X=x[t:t + 1]) for t in range(6)]
    np.testing.assert_allclose(np.concatenate(frames), _want(model, x, np.zeros((1, 2, 7), np.float32))[0],
                               rtol=1e-4, atol=1e-5)
    (entry,) = compiled._graphs.values()
    assert stream.state["initial_h"].data_ptr() == entry["inputs"][1].data_ptr()
    if captured:
        assert fake_capture[0].copies_after and fake_capture[0].replays == 6


@pytest.mark.parametrize("by_name", [True, False])
def test_a_stream_replays_a_known_frame_shape_without_the_vm(fake_capture, by_name):
    """After the first captured call of a frame shape, a call with numpy frames of that shape and dtype copies
    them in, replays and copies the outputs out (stream.FramePlan): the same values as the whole sequence;
    another shape, a given state or a reset takes the checked path again."""
    from tvmseq.stream import Stream

    model, compiled = _gru()
    x = np.random.default_rng(2).standard_normal((10, 2, 5)).astype(np.float32)
    stream = Stream(compiled, state={"initial_h": "Y_h"})
    frames = [stream(X=x[t:t + 1]) if by_name else stream(x[t:t + 1]) for t in range(6)]
    assert stream.fast_calls == 5 and fake_capture[0].replays == 6
    frames.append(stream(X=x[6:8]))                                   # a new shape: checked, captured
    frames.append(stream(X=x[8:9]))                 # the first shape, its state in the other capture: checked
    frames.append(stream(X=x[9:10]))                                  # fast again
    assert stream.fast_calls == 6 and len(fake_capture) == 2
    want = _want(model, x, np.zeros((1, 2, 7), np.float32))[0]
    np.testing.assert_allclose(np.concatenate(frames), want, rtol=1e-4, atol=1e-5)
    stream.reset()
    again = stream(X=x[0:1])
    assert stream.fast_calls == 6
    np.testing.assert_allclose(again, want[:1], rtol=1e-4, atol=1e-5)
    h = np.ones((1, 2, 7), np.float32)
    stream(X=x[0:1], initial_h=h)                                     # a state given: checked
    assert stream.fast_calls == 6
    with pytest.raises(TvmseqError, match="float32"):
        stream(X=x[0:1].astype(np.float64))                            # another dtype: checked, refused


def test_a_stream_replays_frames_written_into_its_buffers(fake_capture):
    """stream() with no arguments replays the frames a producer wrote into frame_buffers() (no copy in): the
    same values as the whole sequence; before any call with frames both say what is missing."""
    from tvmseq.stream import Stream

    model, compiled = _gru()
    x = np.random.default_rng(4).standard_normal((6, 2, 5)).astype(np.float32)
    stream = Stream(compiled, state={"initial_h": "Y_h"})
    with pytest.raises(TvmseqError, match="only after a call with frames"):
        stream()
    with pytest.raises(TvmseqError, match="has none yet"):
        stream.frame_buffers()
    frames = [stream(X=x[0:1])]
    for t in range(1, 6):
        stream.frame_buffers()["X"].copyfrom(x[t:t + 1])
        frames.append(stream())
    assert stream.fast_calls == 5 and fake_capture[0].replays == 6
    want = _want(model, x, np.zeros((1, 2, 7), np.float32))[0]
    np.testing.assert_allclose(np.concatenate(frames), want, rtol=1e-4, atol=1e-5)
    stream.reset()
    with pytest.raises(TvmseqError, match="has none yet"):
        stream.frame_buffers()


def test_graph_mode_needs_a_cuda_model():
    model, _ = rnn_node_model(op="GRU", seq="T", batch=2, input_size=5, hidden=7)
    with pytest.raises(TvmseqError, match="cuda_graph=True needs a CUDA target"):
        compile_onnx(model, target="llvm", cuda_graph=True)
    compiled = compile_onnx(model, target="llvm")
    from tvmseq.runtime import Model

    with pytest.raises(TvmseqError, match="needs a CUDA model"):
        Model(compiled.executable, compiled.target, compiled.signature, cuda_graph=True)
