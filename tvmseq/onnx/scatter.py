"""ONNX ScatterND: on a GPU, with reduction "none" and static shapes, tvmseq's kernel that gives every updated
element a thread of its own (`kernels.scatter.scatter_nd`: TVM's CUDA ScatterND loops over the index tuples on one
thread); everything else (the CPU, add / mul / min / max reductions, symbolic shapes) goes to TVM's converter.
Negative indices are wrapped by TVM's own normalization first, as in its converter."""
from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend as _tvm_onnx

from ..kernels.scatter.scatter_nd import scatter_nd_func
from ..targets import is_gpu
from .importer import register_converter


def _static_dims(expr):
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(d, tirx.IntImm) for d in values):
        return None
    return [int(d) for d in values]


@register_converter("ScatterND")
class ScatterND(_tvm_onnx.ScatterND):
    @classmethod
    def _parallel(cls, bb, inputs, attr, reduction: str):
        """The parallel kernel's call, or None where it does not apply."""
        data, indices, updates = inputs
        target = attr["tvm_custom"]["importer_options"].get("target")
        if reduction != "update" or target is None or not is_gpu(target):
            return None
        data_dims, indices_dims = _static_dims(data), _static_dims(indices)
        if data_dims is None or indices_dims is None or _static_dims(updates) is None:
            return None
        indices = cls._normalize_indices(bb, data, indices)
        func = scatter_nd_func(data_dims, indices_dims, str(data.ty.dtype), str(indices.ty.dtype))
        gv = bb.add_func(func, "scatter_nd_parallel")
        return bb.emit(relax.call_tir(gv, [data, indices, updates], relax.TensorType(data_dims, data.ty.dtype)))

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        call = cls._parallel(bb, inputs, attr, "update")
        return call if call is not None else super()._impl_v11(bb, inputs, attr, params)

    @classmethod
    def _impl_v16(cls, bb, inputs, attr, params):
        call = cls._parallel(bb, inputs, attr, cls._reduction_check(attr, ["update", "add", "mul"]))
        return call if call is not None else super()._impl_v16(bb, inputs, attr, params)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        call = cls._parallel(bb, inputs, attr, cls._reduction_check(attr, ["update", "add", "mul", "min", "max"]))
        return call if call is not None else super()._impl_v18(bb, inputs, attr, params)
