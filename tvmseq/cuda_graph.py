"""Whole-call CUDA graphs: a compiled model's VM call captured once per input shape, replayed as one launch.

TVM launches every kernel of a call (the VM's ops, and the host time loop inside a per-step recurrence) on
the FFI environment's current stream. Making that stream one in capture mode (`tvm_ffi.use_raw_stream`)
records the whole call, host loops included, into one CUDA graph: the VM's dispatch, shape functions and
launch loops run once, at capture, and a replay is a single `cuGraphLaunch`.

A replay reads and writes the addresses of the capture: the caller copies each input into buffers kept for
that shape first, and the outputs are the tensors the captured call returned, kept alive here so that the
VM's memory pool never hands their storage to anything else. Intermediates come from the same pool; they
are dead after each call, so graphs of different shapes may share them (all replays run in stream order).

The capture stream is a blocking stream in relaxed mode: a call that does something a graph cannot hold
(a run-time check that reads a device value on the host, a copy on the legacy stream) fails the capture
instead of being left out of it silently; `capture` then raises `CaptureError` and the caller runs that
shape uncaptured. The driver API is reached through ctypes: no CUDA Python package is needed.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Sequence

from .errors import TvmseqError
from .tensors import _KDL_CUDA

_CAPTURE_MODE_RELAXED = 2
_STREAM_DEFAULT_FLAGS = 0          # blocking: syncs with the legacy stream, so stray legacy work fails capture
_driver = None


class CaptureError(TvmseqError):
    """The call could not be captured into a CUDA graph (it then runs uncaptured)."""


def _lib():
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CaptureError(f"CUDA driver library not found: {err}") from None
        _driver.cuGraphInstantiateWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        _driver.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _driver.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _driver.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _driver.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _driver.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        _driver.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _driver.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        _driver.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        _driver.cuMemHostAlloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        _driver.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        _driver.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    return _driver


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    _lib().cuGetErrorName(code, ctypes.byref(name))
    return name.value.decode() if name.value else str(code)


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CaptureError(f"{what}: {_error_name(code)}")


class CapturedCall:
    """One captured call: `replay()` launches it on the legacy stream (where TVM's copies run, so the
    input copies before it and the output reads after it stay in order); `outputs` is what the captured
    call returned, rewritten by every replay."""

    def __init__(self, graph_exec: ctypes.c_void_p, outputs, nodes: int):
        self._exec, self.outputs, self.nodes = graph_exec, outputs, nodes

    def replay(self) -> None:
        _check(_lib().cuGraphLaunch(self._exec, None), "cuGraphLaunch")

    def __del__(self):
        if self._exec and _driver is not None:
            _driver.cuGraphExecDestroy(self._exec)
            self._exec = None


_ITEMSIZE: dict = {}   # dtype name -> bytes (np.dtype of a name took ~3 us, a third of a copy's host time)


def nbytes(tensor) -> int:
    name = str(tensor.dtype)
    size = _ITEMSIZE.get(name)
    if size is None:
        import numpy as np

        size = _ITEMSIZE[name] = np.dtype(name).itemsize
    return int(tensor.numel()) * size


def copy_async(dst, src) -> None:
    """Copy compact device tensor `src` into `dst` on the legacy stream, where replays run, without waiting
    for the GPU (TVM's `copyto` between device tensors waits, which would keep the host from running ahead)."""
    _check(_lib().cuMemcpyDtoDAsync_v2(dst.data_ptr(), src.data_ptr(), nbytes(src), None), "cuMemcpyDtoDAsync")


def copy_from_address(dst, address: int, size: int) -> None:
    """Copy `size` bytes (`dst`'s) from device address `address` (a CUDA tensor of another library) into `dst`,
    asynchronously on the legacy stream."""
    _check(_lib().cuMemcpyDtoDAsync_v2(dst.data_ptr(), address, size, None), "cuMemcpyDtoDAsync")


def upload(dst, array) -> None:
    """Copy host array `array` (C-contiguous, `dst`'s size) into device tensor `dst`, in order on the legacy
    stream where replays run. From pageable memory the driver stages the bytes before it returns, so `array`
    may be reused at once; a CPU tensor (tests) takes TVM's copy."""
    if dst.device.dlpack_device_type() != _KDL_CUDA:
        dst.copyfrom(array)
        return
    _check(_lib().cuMemcpyHtoDAsync_v2(dst.data_ptr(), array.ctypes.data, array.nbytes, None), "cuMemcpyHtoDAsync")


def download(src, shape, dtype):
    """Device tensor `src` as a new numpy array, after the work queued on the legacy stream (a replay) is done."""
    import numpy as np

    if src.device.dlpack_device_type() != _KDL_CUDA:
        return src.numpy()
    out = np.empty(shape, dtype)
    _check(_lib().cuMemcpyDtoH_v2(out.ctypes.data, src.data_ptr(), out.nbytes), "cuMemcpyDtoH")
    return out


class Pinned:
    """A page-locked host array (`array`): copies between it and the device run asynchronously and at full speed
    (a pageable one is staged by the driver, ~10 us a copy). The streaming fast path (`stream.FramePlan`) stages
    numpy frames and outputs through these."""

    def __init__(self, shape, dtype):
        import numpy as np

        self.nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
        self._ptr = ctypes.c_void_p()
        _check(_lib().cuMemHostAlloc(ctypes.byref(self._ptr), self.nbytes, 0), "cuMemHostAlloc")
        raw = (ctypes.c_byte * self.nbytes).from_address(self._ptr.value)
        self.array = np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def to_device(self, dst) -> None:
        _check(_lib().cuMemcpyHtoDAsync_v2(dst.data_ptr(), self._ptr, self.nbytes, None), "cuMemcpyHtoDAsync")

    def from_device(self, src) -> None:
        _check(_lib().cuMemcpyDtoHAsync_v2(self._ptr, src.data_ptr(), self.nbytes, None), "cuMemcpyDtoHAsync")

    def __del__(self):
        if self._ptr and _driver is not None:
            self.array = None
            _driver.cuMemFreeHost(self._ptr)
            self._ptr = None


def synchronize() -> None:
    """Wait for the work queued on the legacy stream (replays and their copies)."""
    _check(_lib().cuStreamSynchronize(None), "cuStreamSynchronize")


def capture(call: Callable[[], object], device, copies_after: Sequence[tuple[int, object]] = ()) -> CapturedCall:
    """Capture `call()` (a VM call whose inputs already sit at their replay addresses) into a graph.
    `copies_after`: (output index, device tensor) pairs; the graph ends by copying each such output into
    its tensor (streaming: the final state written straight into the next call's state input)."""
    import tvm_ffi

    lib = _lib()
    stream, graph, graph_exec = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _check(lib.cuStreamCreate(ctypes.byref(stream), _STREAM_DEFAULT_FLAGS), "cuStreamCreate")
    try:
        _check(lib.cuStreamBeginCapture_v2(stream, _CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")
        outputs, failure = None, None
        try:
            with tvm_ffi.use_raw_stream(device, stream.value):
                outputs = call()
            listed = (outputs,) if not isinstance(outputs, (tuple, list)) and hasattr(outputs, "data_ptr") \
                else tuple(outputs)
            for index, target in copies_after:
                source = listed[index]
                if nbytes(source) != nbytes(target):
                    raise CaptureError(f"output {index} has {nbytes(source)} bytes, its copy target {nbytes(target)}")
                _check(lib.cuMemcpyDtoDAsync_v2(target.data_ptr(), source.data_ptr(), nbytes(source), stream),
                       "cuMemcpyDtoDAsync")
        except Exception as err:  # noqa: BLE001 - whatever failed, the capture must still be ended
            failure = err
        code = lib.cuStreamEndCapture(stream, ctypes.byref(graph))
        if failure is not None:
            raise CaptureError(f"the call failed while captured: {str(failure).splitlines()[-1][:200]}")
        _check(code, "cuStreamEndCapture")
        count = ctypes.c_size_t(0)
        lib.cuGraphGetNodes(graph, None, ctypes.byref(count))
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(graph_exec), graph, 0), "cuGraphInstantiate")
        return CapturedCall(graph_exec, outputs, int(count.value))
    finally:
        if graph:
            lib.cuGraphDestroy(graph)
        lib.cuStreamDestroy_v2(stream)
