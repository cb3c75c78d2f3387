"""Load and run compiled tvmseq models without the compiler: numpy or DLPack in, numpy out.

Inputs are checked against the model's signature (names, ranks, static and symbolic dims, dtypes) and
tvmseq's own constraints (e.g. GRU sequence_lens in [0, seq_length]) before anything runs on the device.

Prebuilt kernels (`tvmseq build`, `artifacts/<arch>/`): the importer may call a kernel of an artifact
`.so` (`call_dps_packed` of a global function named `tvmseq_artifact.<arch>.<name>.<sha256 prefix>`)
instead of compiling it into the model. Before the model's VM starts, every such function it calls
is registered: from this process's registry when the importer loaded it here, else loaded from the
artifact directory recorded in the model's `.so.json`, `$TVMSEQ_ARTIFACTS` or `artifacts/` (same
name and file hash, checked like `tvmseq.artifacts.find_kernel` does).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from .errors import TvmseqError


def _device(target_kind: str, device=None):
    if device is not None:
        return device
    return tvm.cuda(0) if target_kind == "cuda" else tvm.cpu(0)


# ---------------------------------------------------------------------------------------------------
# Prebuilt kernels called by models (registered as global functions before the VM starts)
# ---------------------------------------------------------------------------------------------------
ARTIFACT_PREFIX = "tvmseq_artifact."
_ARTIFACT_NAME = re.compile(re.escape(ARTIFACT_PREFIX) + r"([A-Za-z0-9_\-]+)\.([A-Za-z0-9_\-]+)\.([0-9a-f]{12})")
# global name -> {"arch", "name", "sha256", "arch_dir", "file", "function"}; the Kernel keeps the module alive
_REGISTERED: dict[str, dict] = {}
_KERNELS: dict[str, object] = {}


def artifact_global_name(entry) -> str:
    """The global function name a model calls for an artifact entry (arch, name and file hash in it,
    so a model never silently calls a different build)."""
    return f"{ARTIFACT_PREFIX}{entry.arch}.{entry.name}.{entry.sha256[:12]}"


def register_artifact(kernel, arch_dir) -> str:
    """Register a loaded `tvmseq.artifacts.Kernel` as the global function models call; its name."""
    import tvm_ffi

    name = artifact_global_name(kernel.entry)
    if name not in _REGISTERED:
        tvm_ffi.register_global_func(name, kernel.func, override=True)
        _KERNELS[name] = kernel
        _REGISTERED[name] = {"global": name, "arch": kernel.entry.arch, "name": kernel.entry.name,
                             "sha256": kernel.entry.sha256, "arch_dir": str(Path(arch_dir).resolve()),
                             "file": kernel.entry.file, "function": kernel.entry.function}
    return name


def artifacts_called(executable) -> list[str]:
    """Names of the artifact functions a compiled model calls (read from its VM executable)."""
    mod = getattr(executable, "mod", executable)
    try:
        stats = mod["stats"]()
    except Exception:  # noqa: BLE001 - not a Relax VM executable
        return []
    return sorted(set(m.group(0) for m in _ARTIFACT_NAME.finditer(str(stats))))


def _artifact_roots(recorded: list[dict] | None) -> list[Path]:
    roots = [Path(r["arch_dir"]) for r in recorded or [] if r.get("arch_dir")]
    env = os.environ.get("TVMSEQ_ARTIFACTS", "").strip()
    if env and env.lower() not in ("0", "off", "none"):
        roots.append(Path(env))
    roots.append(Path(__file__).resolve().parents[1] / "artifacts")
    return roots


def resolve_artifacts(executable, recorded: list[dict] | None = None) -> list[dict]:
    """Make every artifact function `executable` calls callable (see the module doc); returns their
    records. TvmseqError naming the kernel and where it was looked for when one cannot be found or used."""
    from . import artifacts

    out = []
    for name in artifacts_called(executable):
        if name not in _REGISTERED:
            arch, kernel_name, sha = _ARTIFACT_NAME.fullmatch(name).groups()
            reasons, found = [], False
            for root in _artifact_roots(recorded):
                for arch_dir in (root, root / arch):
                    if not (arch_dir / artifacts.MANIFEST).exists():
                        continue
                    try:
                        entries = artifacts.read_manifest(arch_dir)
                    except artifacts.ArtifactError as err:
                        reasons.append(str(err))
                        continue
                    for entry in entries:
                        if entry.name != kernel_name or entry.arch != arch or not entry.sha256.startswith(sha):
                            continue
                        try:
                            register_artifact(artifacts.load_entry(entry, arch_dir), arch_dir)
                            found = True
                        except artifacts.ArtifactError as err:
                            reasons.append(str(err))
                        break
                    if found:
                        break
                if found:
                    break
            if not found:
                where = ", ".join(dict.fromkeys(str(r) for r in _artifact_roots(recorded)))
                why = f" ({'; '.join(reasons)})" if reasons else ""
                raise TvmseqError(f"the model calls the prebuilt kernel {kernel_name} ({arch}, sha256 {sha}...), "
                                  f"which was not found in {where}{why}: set TVMSEQ_ARTIFACTS to the artifact "
                                  "directory it was compiled with, or recompile the model with artifacts=None")
        out.append(dict(_REGISTERED[name]))
    return out


class Model:
    """A compiled model: `model(x, ...)` or `model(X=x, ...)` -> numpy array or tuple of arrays."""

    def __init__(self, executable, target, signature: dict, device=None):
        self.executable = executable
        self.target = target
        self.signature = signature
        self.target_kind = target if isinstance(target, str) else target.kind.name
        self.device = _device(self.target_kind, device)
        self._vm_instance = None
        called = artifacts_called(executable)
        if called and "artifacts" not in signature:
            # prebuilt kernels registered by the importer in this process: recorded so that `export`
            # writes where they live into the model's .so.json
            signature["artifacts"] = [dict(_REGISTERED[n]) for n in called if n in _REGISTERED]

    @property
    def _vm(self) -> VirtualMachine:
        # created on first use, so a model compiled for CUDA on a machine without a GPU can be exported
        if self._vm_instance is None:
            if self.target_kind == "cuda":
                from .artifacts import ensure_cuda_runtime

                ensure_cuda_runtime()  # runtime-only TVM does not load its CUDA backend by itself
            if self.target_kind == "cuda" and not self.device.exist:
                raise TvmseqError("this model was compiled for CUDA but no GPU is visible")
            resolve_artifacts(self.executable, self.signature.get("artifacts"))
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
