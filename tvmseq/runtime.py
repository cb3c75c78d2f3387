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
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from .errors import TvmseqError
from .tensors import on_device

# run-time checks compiled into models (tvmseq.onnx.checks) raise errors of this kind: the VM raises them
# as TvmseqError (one line, naming the ONNX node)
tvm_ffi.error.register_error("TvmseqError", TvmseqError)


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


OUTPUT_KINDS = ("numpy", "device")


class Model:
    """A compiled model: `model(x, ...)`, `model(X=x, ...)` or `model({"X": x, ...})` -> numpy array or tuple.

    Inputs are fed by their ONNX names (also names that are not identifiers, e.g. "31") or by the Relax
    parameter names TVM's importer gave them; numpy arrays, Python scalars (rank-0 inputs) and DLPack tensors
    (torch, CuPy, JAX, TVM) are accepted. A DLPack tensor on the model's device is used in place when it is
    64-byte aligned and compact, else copied once into an aligned buffer. `output="device"` returns TVM
    tensors on the model's device (DLPack-capable: `torch.from_dlpack(y)`), `output="numpy"` (default)
    host arrays; `output_names` gives the ONNX names of the outputs, `named(outputs)` a dict by name.

    Weights kept out of the executable (`compile_onnx(..., weights="inputs")`) are uploaded once
    (`set_weights`) and passed to every call. A model built with `cuda_graph=True` copies each input into
    a device buffer kept per input shape (the captured graph reads fixed addresses) and TVM's VM captures
    the model once per shape and replays it; `max_graph_shapes` shapes are kept, then the captures are
    dropped and start anew. In that mode device outputs are valid until the next call."""

    def __init__(self, executable, target, signature: dict, device=None, weights=None, max_graph_shapes: int = 8):
        self.executable = executable
        self.target = target
        self.signature = signature
        self.target_kind = target if isinstance(target, str) else target.kind.name
        self.device = _device(self.target_kind, device)
        self._vm_instance = None
        self.max_graph_shapes = max_graph_shapes
        self._staging: list[dict] = []
        specs = signature["inputs"]
        self._feed_specs = [s for s in specs if not s.get("weight")]
        self._weight_specs = [s for s in specs if s.get("weight")]
        self._weights: list | None = None        # on the device, uploaded once
        self._weight_values: list | None = None  # as given
        self._by_name = {}
        for spec in self._feed_specs:
            self._by_name[spec["name"]] = spec
            self._by_name.setdefault(spec.get("onnx_name", spec["name"]), spec)
        called = artifacts_called(executable)
        if called and "artifacts" not in signature:
            # prebuilt kernels registered by the importer in this process: recorded so that `export`
            # writes where they live into the model's .so.json
            signature["artifacts"] = [dict(_REGISTERED[n]) for n in called if n in _REGISTERED]
        if weights is not None:
            self.set_weights(weights)

    @property
    def _vm(self) -> VirtualMachine:
        # created on first use, so a model compiled for CUDA on a machine without a GPU can be exported
        if self._vm_instance is None:
            if self.target_kind == "cuda":
                from .cuda_toolchain import ensure_cuda_runtime

                ensure_cuda_runtime()  # runtime-only TVM does not load its CUDA backend by itself
            if self.target_kind == "cuda" and not self.device.exist:
                raise TvmseqError("this model was compiled for CUDA but no GPU is visible")
            resolve_artifacts(self.executable, self.signature.get("artifacts"))
            module = self.executable.jit() if hasattr(self.executable, "jit") else self.executable
            self._vm_instance = VirtualMachine(module, self.device)
        return self._vm_instance

    @property
    def cuda_graph(self) -> bool:
        return bool(self.signature.get("cuda_graph"))

    @property
    def input_names(self) -> list[str]:
        """The inputs a caller feeds (ONNX names where known), in positional order."""
        return [s.get("onnx_name", s["name"]) for s in self._feed_specs]

    @property
    def output_names(self) -> list[str]:
        names = self.signature.get("output_names")
        if names:
            return list(names)
        outs = self.signature.get("outputs")
        count = len(outs) if isinstance(outs, list) else 1
        return [f"output_{i}" for i in range(count)]

    @property
    def weight_names(self) -> list[str]:
        return [s.get("onnx_name", s["name"]) for s in self._weight_specs]

    # ---- weights --------------------------------------------------------------------------------
    def set_weights(self, weights) -> None:
        """Upload the weights kept out of the executable (a dict by ONNX initializer name, or a path
        to an .npz of them) once; every later call passes these device tensors."""
        if isinstance(weights, (str, Path)):
            with np.load(weights) as data:
                weights = {k: data[k] for k in data.files}
        missing = [n for n in self.weight_names if n not in weights]
        if missing:
            raise TvmseqError(f"weights missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        values = [weights[spec.get("onnx_name", spec["name"])] for spec in self._weight_specs]
        for spec, value in zip(self._weight_specs, values):   # checked now, uploaded on the first run
            host, tensor = _as_host_or_tensor(value, spec, spec.get("onnx_name", spec["name"]))
            data = host if host is not None else tensor
            _check_shape_dtype(spec.get("onnx_name", spec["name"]), spec, tuple(data.shape), str(data.dtype), {})
        self._weight_values, self._weights = values, None
        self._reset_graphs()   # captured graphs read the old weights' addresses

    def _device_weights(self) -> list:
        if self._weights is None and self._weight_values is not None:
            self._weights = [self._prepare(spec, value, {}) for spec, value in
                             zip(self._weight_specs, self._weight_values)]
        return self._weights or []

    # ---- binding and checking inputs ------------------------------------------------------------
    def _bind(self, args, kwargs) -> list:
        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            args, kwargs = (), dict(args[0])
        specs = self._feed_specs
        if len(args) > len(specs):
            raise TvmseqError(f"the model takes {len(specs)} inputs ({', '.join(self.input_names)}), "
                              f"got {len(args)}")
        values = {spec["name"]: val for spec, val in zip(specs, args)}
        for name, val in kwargs.items():
            spec = self._by_name.get(name)
            if spec is None:
                raise TvmseqError(f"the model has no input named {name!r}; its inputs: "
                                  f"{', '.join(self.input_names)}")
            if spec["name"] in values:
                raise TvmseqError(f"input {name!r} given twice")
            values[spec["name"]] = val
        missing = [s.get("onnx_name", s["name"]) for s in specs if s["name"] not in values]
        if missing:
            raise TvmseqError(f"missing model input(s): {', '.join(missing)}")
        symbols: dict[str, int] = {}
        tensors = [self._prepare(spec, values[spec["name"]], symbols) for spec in specs]
        self._check_bounds(symbols)
        return tensors

    def _check_bounds(self, symbols: dict) -> None:
        bounds = (self.signature.get("cuda_graph") or {}).get("bounds") or {}
        for dim, bound in bounds.items():
            if dim in symbols and symbols[dim] > bound:
                raise TvmseqError(f"dimension {dim!r} is {symbols[dim]}, above {bound}, the largest this "
                                  "CUDA-graph model was compiled for (cuda_graph_bounds)")

    def _prepare(self, spec, value, symbols):
        """Check one input against its spec and return it as a tensor on the model's device (or a
        host array the caller uploads)."""
        name = spec.get("onnx_name", spec["name"])
        host, tensor = _as_host_or_tensor(value, spec, name)
        data = host if host is not None else tensor
        shape, dtype = tuple(data.shape), str(data.dtype)
        _check_shape_dtype(name, spec, shape, dtype, symbols)
        if host is not None:
            for check in spec.get("checks", []):
                _run_check(check, name, host, symbols)
            return tvm.runtime.tensor(_compact(host), self.device)
        tensor = on_device(tensor, value, self.device, name)
        for check in spec.get("checks", []):
            _run_check(check, name, tensor, symbols)
        return tensor

    # ---- running --------------------------------------------------------------------------------
    def _reset_graphs(self) -> None:
        if self.cuda_graph:
            self._vm_instance = None     # a new VM starts with no captured graphs
            self._staging = []

    def _stage(self, tensors: list) -> list:
        """Copy each input into its device buffer for this shape (CUDA-graph mode: the captured graph
        reads fixed addresses; a graph captured for a shape reads that shape's buffers)."""
        if len(self._staging) != len(tensors):
            self._staging = [{} for _ in tensors]
        keys = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        if any(k not in slots for k, slots in zip(keys, self._staging)) and \
                max(len(slots) for slots in self._staging) >= self.max_graph_shapes:
            self._reset_graphs()
            self._staging = [{} for _ in tensors]
        staged = []
        for tensor, key, slots in zip(tensors, keys, self._staging):
            if key not in slots:
                slots[key] = tvm.runtime.empty(key[0], key[1], self.device)
            tensor.copyto(slots[key])
            staged.append(slots[key])
        return staged

    def run(self, *args, **kwargs):
        """Run and return TVM tensors (DLPack-capable, on the model's device): one, or a tuple."""
        tensors = self._bind(args, kwargs)
        if self._weight_specs and self._weight_values is None:
            raise TvmseqError("this model keeps its weights out of the executable: call set_weights(...) "
                              "(or tvmseq.load(path, weights=...)) first")
        vm = self._vm
        if self.cuda_graph:
            tensors = self._stage(tensors)
        out = vm["main"](*tensors, *self._device_weights())
        return out if isinstance(out, tvm.runtime.Tensor) else tuple(out)

    def __call__(self, *args, **kwargs):
        output = "numpy"
        if "output" in kwargs and "output" not in self._by_name:
            output = kwargs.pop("output")
        if output not in OUTPUT_KINDS:
            raise TvmseqError(f"output={output!r}: must be one of {OUTPUT_KINDS}")
        out = self.run(*args, **kwargs)
        if output == "device":
            return out
        if isinstance(out, tuple):
            return tuple(_to_numpy(o) for o in out)
        return _to_numpy(out)

    def named(self, outputs) -> dict:
        """{ONNX output name: output} for what `model(...)` or `run(...)` returned."""
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        names = self.output_names
        if len(names) != len(outputs):
            names = [f"output_{i}" for i in range(len(outputs))]
        return dict(zip(names, outputs))

    def stream(self, **kwargs):
        """A `tvmseq.Stream` over this model (state kept on the device between calls)."""
        from .stream import Stream

        return Stream(self, **kwargs)


def _to_numpy(out):
    return out.numpy() if isinstance(out, tvm.runtime.Tensor) else tuple(_to_numpy(o) for o in out)


def _compact(arr: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray would turn a rank-0 array into shape (1,)
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def _as_host_or_tensor(value, spec, name):
    """(host numpy array, None) or (None, zero-copy TVM tensor view of a DLPack input)."""
    import tvm_ffi

    if isinstance(value, tvm.runtime.Tensor):
        return None, value
    if isinstance(value, (bool, int, float, np.generic)) and not isinstance(value, np.ndarray):
        want = np.dtype(spec["dtype"])
        if isinstance(value, (float, np.floating)) and want.kind in "iub" and float(value) != int(value):
            raise TvmseqError(f"input {name!r} is {value!r}, the model expects an integer ({spec['dtype']})")
        return np.asarray(value, dtype=want), None
    if isinstance(value, np.ndarray):
        return value, None
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        try:
            return None, tvm_ffi.from_dlpack(value)
        except Exception as err:  # noqa: BLE001 - producers raise many error types
            raise TvmseqError(f"input {name!r}: cannot read it through DLPack: {str(err).splitlines()[0]}") from None
    try:
        return np.asarray(value), None
    except Exception as err:  # noqa: BLE001
        raise TvmseqError(f"input {name!r}: not an array, scalar or DLPack tensor ({type(value).__name__})") from err


def _check_shape_dtype(name, spec, shape, dtype, symbols) -> None:
    want_dtype, want_shape = spec["dtype"], spec["shape"]
    if dtype != want_dtype:
        raise TvmseqError(f"input {name!r} has dtype {dtype}, the model expects {want_dtype}")
    if want_shape is None:
        return
    if len(shape) != len(want_shape):
        raise TvmseqError(f"input {name!r} has shape {list(shape)} (rank {len(shape)}), the model "
                          f"expects rank {len(want_shape)}: {want_shape}")
    for axis, (got, want) in enumerate(zip(shape, want_shape)):
        if isinstance(want, int) and got != want:
            raise TvmseqError(f"input {name!r} has shape {list(shape)}, the model expects {want_shape}"
                              f" (axis {axis} must be {want})")
        if isinstance(want, str) and symbols.setdefault(want, got) != got:
            raise TvmseqError(f"input {name!r} axis {axis} is {got} but dimension {want!r} is "
                              f"{symbols[want]} in another input")

def _symbol(symbols: dict, name: str):
    """A dim's value by name; converters that print a var called "T" record it as "T_1" (TIR's printer
    renames it away from its own prefix), the signature by its own name "T"."""
    if name in symbols:
        return symbols[name]
    match = re.fullmatch(r"(.+)_\d+", name)
    return symbols.get(match.group(1)) if match else None


def _run_check(check: dict, name: str, tensor, symbols: dict):
    """Value checks recorded by converters for graph inputs (run on the host before the model)."""
    values = tensor if isinstance(tensor, np.ndarray) else tensor.numpy()
    if check["kind"] == "range":
        hi = check["max"] if isinstance(check["max"], int) else _symbol(symbols, check["max"])
        if values.size and (values.min() < check["min"] or (hi is not None and values.max() > hi)):
            raise TvmseqError(f"input {name!r} ({check['what']}) must lie in [{check['min']}, "
                              f"{hi if hi is not None else check['max']}], got values in "
                              f"[{values.min()}, {values.max()}]")


def file_digest(path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, recorded at export and checked before loading: a truncated
    or damaged shared library can kill the process inside dlopen (SIGBUS, segfault) with no message."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return Path(path).stat().st_size, digest.hexdigest()


def read_model_meta(path) -> dict:
    """The `.so.json` beside a model `.so`, checked: it parses, it names a target and a signature, and the
    `.so` has the size and sha256 it records. TvmseqError (one line) otherwise."""
    path = Path(path)
    if not path.exists():
        raise TvmseqError(f"model file not found: {path}")
    meta_path = Path(str(path) + ".json")
    if not meta_path.exists():
        raise TvmseqError(f"{meta_path} is missing: it holds the model's signature, written by tvmseq compile")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise TvmseqError(f"{meta_path} is not valid JSON ({str(err).splitlines()[0]}): re-export the model "
                          "with tvmseq compile") from None
    sig = meta.get("signature") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("target"), str) or not isinstance(sig, dict) \
            or not isinstance(sig.get("inputs"), list) \
            or not all(isinstance(i, dict) and isinstance(i.get("name"), str) and "dtype" in i for i in sig["inputs"]):
        raise TvmseqError(f"{meta_path} is damaged: it lacks the model's target or input signature; re-export "
                          "the model with tvmseq compile")
    size, sha = meta.get("size"), meta.get("sha256")
    if size is not None or sha is not None:
        got_size, got_sha = file_digest(path)
        if size is not None and got_size != size:
            raise TvmseqError(f"model file {path} is {got_size} bytes, {meta_path.name} records {size}: "
                              "the file is truncated or was replaced; copy or export it again")
        if sha is not None and got_sha != sha:
            raise TvmseqError(f"model file {path} does not match the sha256 recorded in {meta_path.name}: "
                              "the file is damaged or was replaced; copy or export it again")
    return meta


def load_model(path, device=None, weights=None) -> Model:
    """Load a `.so` written by `tvmseq compile` (reads the signature from the `.so.json` beside it, and
    checks the `.so` against the size and sha256 recorded there before loading it). `weights`: for a
    model exported with its weights kept out (a dict by ONNX name, or an .npz path)."""
    path = Path(path)
    meta = read_model_meta(path)
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as err:  # noqa: BLE001 - corrupt files surface as many error types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TvmseqError(f"could not load model {path}: {first}") from None
    return Model(module, meta["target"], meta["signature"], device, weights=weights)
