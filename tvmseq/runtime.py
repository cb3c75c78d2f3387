"""Load and run compiled tvmseq models without the compiler: numpy or DLPack in, numpy out.

Inputs are checked against the model's signature (names, ranks, static and symbolic dims, dtypes) and
tvmseq's own constraints (e.g. GRU sequence_lens in [0, seq_length]) before anything runs on the device.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from .errors import TvmseqError


def _device(target_kind: str, device=None):
    if device is not None:
        return device
    return tvm.cuda(0) if target_kind == "cuda" else tvm.cpu(0)


class Model:
    """A compiled model: `model(x, ...)` or `model(X=x, ...)` -> numpy array or tuple of arrays."""

    def __init__(self, executable, target, signature: dict, device=None):
        self.executable = executable
        self.target = target
        self.signature = signature
        self.target_kind = target if isinstance(target, str) else target.kind.name
        self.device = _device(self.target_kind, device)
        self._vm_instance = None

    @property
    def _vm(self) -> VirtualMachine:
        # created on first use, so a model compiled for CUDA on a machine without a GPU can be exported
        if self._vm_instance is None:
            if self.target_kind == "cuda":
                from .artifacts import ensure_cuda_runtime

                ensure_cuda_runtime()  # runtime-only TVM does not load its CUDA backend by itself
            if self.target_kind == "cuda" and not self.device.exist:
                raise TvmseqError("this model was compiled for CUDA but no GPU is visible")
            module = self.executable.jit() if hasattr(self.executable, "jit") else self.executable
            self._vm_instance = VirtualMachine(module, self.device)
        return self._vm_instance

    @property
    def input_names(self) -> list[str]:
        return [i["name"] for i in self.signature["inputs"]]

    def _bind(self, args, kwargs) -> list:
        specs = self.signature["inputs"]
        if len(args) > len(specs):
            raise TvmseqError(f"the model takes {len(specs)} inputs ({', '.join(self.input_names)}), "
                              f"got {len(args)}")
        values = dict(zip(self.input_names, args))
        for name, val in kwargs.items():
            if name not in self.input_names:
                raise TvmseqError(f"the model has no input named {name!r}; its inputs: "
                                  f"{', '.join(self.input_names)}")
            if name in values:
                raise TvmseqError(f"input {name!r} given twice")
            values[name] = val
        missing = [n for n in self.input_names if n not in values]
        if missing:
            raise TvmseqError(f"missing model input(s): {', '.join(missing)}")
        symbols: dict[str, int] = {}
        return [self._check(spec, values[spec["name"]], symbols) for spec in specs]

    def _check(self, spec, value, symbols):
        name, want_dtype, want_shape = spec["name"], spec["dtype"], spec["shape"]
        if hasattr(value, "__dlpack__") and not isinstance(value, np.ndarray):
            tensor = tvm.runtime.from_dlpack(value)
            shape, dtype = tuple(tensor.shape), str(tensor.dtype)
        else:
            arr = np.asarray(value)
            shape, dtype, tensor = arr.shape, str(arr.dtype), arr
        if dtype != want_dtype:
            raise TvmseqError(f"input {name!r} has dtype {dtype}, the model expects {want_dtype}")
        if want_shape is not None:
            if len(shape) != len(want_shape):
                raise TvmseqError(f"input {name!r} has shape {list(shape)} (rank {len(shape)}), the model "
                                  f"expects rank {len(want_shape)}: {want_shape}")
            for axis, (got, want) in enumerate(zip(shape, want_shape)):
                if isinstance(want, int) and got != want:
                    raise TvmseqError(f"input {name!r} has shape {list(shape)}, the model expects {want_shape}"
                                      f" (axis {axis} must be {want})")
                if isinstance(want, str):
                    if symbols.setdefault(want, got) != got:
                        raise TvmseqError(f"input {name!r} axis {axis} is {got} but dimension {want!r} is "
                                          f"{symbols[want]} in another input")
        for check in spec.get("checks", []):
            _run_check(check, name, tensor, symbols)
        if isinstance(tensor, np.ndarray):
            return tvm.runtime.tensor(np.ascontiguousarray(tensor), self.device)
        return tensor

    def run(self, *args, **kwargs):
        """Run and return TVM tensors (DLPack-capable, on the model's device)."""
        out = self._vm["main"](*self._bind(args, kwargs))
        return out if isinstance(out, tvm.runtime.Tensor) else tuple(out)

    def __call__(self, *args, **kwargs):
        out = self.run(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o.numpy() for o in out)
        return out.numpy()


def _run_check(check: dict, name: str, tensor, symbols: dict):
    """Value checks recorded by converters for graph inputs (run on the host before the model)."""
    values = tensor if isinstance(tensor, np.ndarray) else tensor.numpy()
    if check["kind"] == "range":
        hi = check["max"] if isinstance(check["max"], int) else symbols.get(check["max"])
        if values.size and (values.min() < check["min"] or (hi is not None and values.max() > hi)):
            raise TvmseqError(f"input {name!r} ({check['what']}) must lie in [{check['min']}, "
                              f"{hi if hi is not None else check['max']}], got values in "
                              f"[{values.min()}, {values.max()}]")


def load_model(path, device=None) -> Model:
    """Load a `.so` written by `tvmseq compile` (reads the signature from the `.so.json` beside it)."""
    path = Path(path)
    if not path.exists():
        raise TvmseqError(f"model file not found: {path}")
    meta_path = Path(str(path) + ".json")
    if not meta_path.exists():
        raise TvmseqError(f"{meta_path} is missing: it holds the model's signature, written by tvmseq compile")
    try:
        meta = json.loads(meta_path.read_text())
        module = tvm.runtime.load_module(str(path))
    except Exception as err:  # noqa: BLE001 - corrupt files surface as many error types
        raise TvmseqError(f"could not load model {path}: {err}") from err
    return Model(module, meta["target"], meta["signature"], device)
