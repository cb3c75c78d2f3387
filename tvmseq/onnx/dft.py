"""ONNX DFT (opsets 17 and 20; TVM's Relax frontend has no converter): the transform as two matmuls with constant
cosine / sine matrices along the signal axis.

Input [..., n, 1] (real) or [..., n, 2] (complex), the signal along `axis` (any but the last; opset 20's axis input
must be a constant); output [..., k, 2] with k = the DFT length, or length // 2 + 1 with `onesided`. `dft_length`
zero-pads or truncates the signal first. Forward X[k] = sum_n x[n] e^(-2 pi i k n / L), inverse with e^(+...)
and 1 / L; inverse with onesided is the inverse real transform of a half spectrum (onnx's reference). A matmul is O(L^2) where an FFT is O(L log L): fine for the frame-sized transforms of
streaming audio models (DeepFilterNet3's 1024-sample frame: [1, 1024] x [1024, 513] twice), what this is for;
lengths above MAX_LENGTH are refused.
"""
from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from .importer import OnnxOpConverter, register_converter

MAX_LENGTH = 8192       # a [L, L] float32 matrix pair: 512 MiB at 8192


def _static_int(value, params, what: str) -> int | None:
    if value is None:
        return None
    const = _tvm.get_constant(value, params)
    if not hasattr(const, "value"):
        raise ValueError(f"{what} computed in the graph is not supported (a constant is)")
    return int(const.value.numpy().reshape(-1)[0])


def _bases(length: int, rows: int, columns: int, inverse: bool, dtype: str, weights=None):
    """cos and sin of 2 pi r c / length as [rows, columns] matrices, scaled by 1 / length for the inverse and
    row r by weights[r] where given."""
    r, c = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
    angle = 2 * np.pi * ((r * c) % length) / length          # the product reduced first: exact angles
    scale = (1.0 / length if inverse else 1.0) * (np.ones(rows) if weights is None else weights)[:, None]
    # the dtype named: relax.const makes a float64 array float32 otherwise
    return tuple(relax.const((f(angle) * scale).astype(dtype), dtype) for f in (np.cos, np.sin))


def _halfspectrum_weights(bins: int, length: int):
    """An inverse real transform from bins 0 .. length // 2: each bin between counts for its mirror too."""
    weights = np.full(bins, 2.0)
    weights[0] = 1.0
    if length % 2 == 0 and bins > length // 2:
        weights[length // 2] = 1.0
    return weights


def _dft(bb, data, length: int | None, axis: int, inverse: bool, onesided: bool):
    """onnx's reference semantics: forward (onesided: the first length // 2 + 1 outputs), inverse, and inverse
    onesided = the inverse real transform of a half spectrum (real output [..., length, 1], length by default
    2 (bins - 1))."""
    ty = data.ty
    rank, dims = ty.ndim, list(ty.shape.values)
    if not -rank <= axis <= rank - 2:
        raise ValueError(f"axis {axis} is outside [{-rank}, {rank - 2}] for an input of rank {rank}")
    axis %= rank
    parts = int(dims[-1])
    if parts not in (1, 2):
        raise ValueError(f"the last dim is {parts}: 1 (real) or 2 (complex) expected")
    signal = int(dims[axis]) if hasattr(dims[axis], "value") else None
    half_spectrum = inverse and onesided
    if length is None and signal is not None:
        length = 2 * (signal - 1) if half_spectrum else signal
    if length is None:
        raise ValueError(f"the signal length (dim {axis} of the input: {dims[axis]}) is not static and no dft_length "
                         "is given")
    if not 0 < length <= MAX_LENGTH:
        raise ValueError(f"length {length} is not in 1..{MAX_LENGTH} (the transform is a matmul here, not an FFT)")
    used = length // 2 + 1 if half_spectrum else length            # input samples the transform reads
    # signal axis last: [..., n, parts] -> [..., parts, n], cut or zero-padded to `used`
    order = [d for d in range(rank - 1) if d != axis] + [rank - 1, axis]
    x = bb.normalize(relax.op.permute_dims(data, order))
    if signal is None or signal > used:
        x = bb.normalize(relax.op.strided_slice(x, [rank - 1], [0], [used]))
    elif signal < used:
        x = bb.normalize(relax.op.nn.pad(x, [0, 0] * (rank - 1) + [0, used - signal]))
    dtype = str(ty.dtype)
    re = bb.normalize(relax.op.take(x, relax.const(0, "int64"), axis=rank - 2))
    im = bb.normalize(relax.op.take(x, relax.const(1, "int64"), axis=rank - 2)) if parts == 2 else None
    if half_spectrum:           # y[n] = sum_k w_k (Re X_k cos - Im X_k sin) / length
        cos, sin = _bases(length, used, length, True, dtype, _halfspectrum_weights(used, length))
        y = relax.op.matmul(re, cos) if im is None else relax.op.subtract(relax.op.matmul(re, cos),
                                                                          relax.op.matmul(im, sin))
        y = bb.normalize(relax.op.expand_dims(y, rank - 1))
    else:
        outputs = length // 2 + 1 if onesided else length
        cos, sin = _bases(length, length, outputs, inverse, dtype)
        re_cos, re_sin = relax.op.matmul(re, cos), relax.op.matmul(re, sin)
        # (a + ib)(cos + sign i sin) = a cos - sign b sin + i (b cos + sign a sin); sign -1 forward
        if im is None:
            out_re, out_im = re_cos, re_sin if inverse else relax.op.negative(re_sin)
        else:
            im_cos, im_sin = relax.op.matmul(im, cos), relax.op.matmul(im, sin)
            out_re = relax.op.subtract(re_cos, im_sin) if inverse else relax.op.add(re_cos, im_sin)
            out_im = relax.op.add(im_cos, re_sin) if inverse else relax.op.subtract(im_cos, re_sin)
        y = bb.normalize(relax.op.stack([out_re, out_im], axis=rank - 1))     # [..., k, 2]
    back = [0] * rank
    for position, source in enumerate([d for d in range(rank - 1) if d != axis] + [axis]):
        back[source] = position
    back[rank - 1] = rank - 1
    return relax.op.permute_dims(y, back)


@register_converter("DFT")
class DFT(OnnxOpConverter):
    """ONNX DFT (module doc)."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        length = _static_int(inputs[1] if len(inputs) > 1 else None, params, "dft_length")
        return _dft(bb, inputs[0], length, int(attr.get("axis", 1)), bool(attr.get("inverse", 0)),
                    bool(attr.get("onesided", 0)))

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        length = _static_int(inputs[1] if len(inputs) > 1 else None, params, "dft_length")
        axis = _static_int(inputs[2] if len(inputs) > 2 else None, params, "axis")
        return _dft(bb, inputs[0], length, -2 if axis is None else axis, bool(attr.get("inverse", 0)),
                    bool(attr.get("onesided", 0)))
