"""DLPack tensors as TVM's compiled code takes them: a zero-copy view, made compact, 64-byte aligned and on the
kernel's device with at most one copy. Shared by compiled models (`tvmseq.runtime`) and prebuilt kernels
(`tvmseq.artifacts`).
"""
from __future__ import annotations

import numpy as np
import tvm

from .errors import TvmseqError

_ALIGNMENT = 64          # TVM's compiled code assumes 64-byte aligned, compact inputs
_KDL_CPU = 1
_KDL_CUDA = 2


def dlpack_view(value):
    """A zero-copy TVM tensor view of a DLPack tensor (any alignment, any strides: `on_device` fixes both)."""
    import tvm_ffi

    return value if isinstance(value, tvm.runtime.Tensor) else tvm_ffi.from_dlpack(value)


def on_device(tensor, original, device, name):
    """`tensor` (a zero-copy view of the DLPack input `original`) as a compact, 64-byte aligned tensor on
    `device`, as TVM's compiled code assumes: itself when it already is one, else one copy (never refused)."""
    if not tensor.is_contiguous():
        tensor = _contiguous_copy(tensor, original, name)
    same_device = (tensor.device.dlpack_device_type(), tensor.device.index) == \
        (device.dlpack_device_type(), device.index)
    if same_device and tensor.data_ptr() % _ALIGNMENT == 0:
        return tensor
    out = tvm.runtime.empty(tuple(tensor.shape), str(tensor.dtype), device)
    tensor.copyto(out)
    return out


def _contiguous_copy(tensor, original, name):
    """A compact copy of a strided device tensor, made by the library that owns it (TVM copies only
    compact tensors)."""
    if tensor.device.dlpack_device_type() == _KDL_CPU:
        import tvm_ffi

        return tvm_ffi.from_dlpack(np.array(np.from_dlpack(original), order="C"))
    maker = getattr(original, "contiguous", None)            # torch
    if maker is None and hasattr(original, "__array_namespace__"):   # CuPy, JAX, array-API libraries
        xp = original.__array_namespace__()
        maker = lambda: xp.asarray(original, copy=True)    # noqa: E731
    if maker is None:
        raise TvmseqError(f"input {name!r} is a strided device tensor and its library offers no compact copy: "
                          "pass a contiguous tensor")
    import tvm_ffi

    copy = tvm_ffi.from_dlpack(maker())
    if not copy.is_contiguous():
        raise TvmseqError(f"input {name!r} is a strided device tensor that could not be made contiguous")
    return copy
