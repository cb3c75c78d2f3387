"""An `onnx.backend.base.Backend` for tvmseq, so onnx's own backend node tests run through it."""
from __future__ import annotations

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .. import targets
from ..build import compile_onnx


class TvmseqBackendRep(BackendRep):
    def __init__(self, model, compiled):
        self._compiled = compiled
        self._names = [i.name for i in model.graph.input
                       if i.name not in {t.name for t in model.graph.initializer}]

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            inputs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = dict(zip(self._names, inputs))
        out = self._compiled(**{k: v for k, v in feeds.items() if k in self._compiled.input_names})
        return list(out) if isinstance(out, tuple) else [out]


class TvmseqBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs):
        super().prepare(model, device, **kwargs)
        target = "cuda" if device.upper().startswith("CUDA") else "llvm"
        return TvmseqBackendRep(model, compile_onnx(model, target=target))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU" or (device.upper().startswith("CUDA") and targets.has_gpu())


prepare = TvmseqBackend.prepare
run_model = TvmseqBackend.run_model
supports_device = TvmseqBackend.supports_device
