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
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from .errors import TvmseqError
from .tensors import _ALIGNMENT, _KDL_CPU, _KDL_CUDA, on_device

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
    (`set_weights`) and passed to every call. In CUDA-graph mode (`cuda_graph=True` here or at compile
    time) each call is captured whole, once per input shape, and replayed as one launch (`tvmseq.cuda_graph`):
    the inputs are copied into device buffers kept per shape (the graph reads fixed addresses; a caller who gives
    the same compact device tensors two calls in a row gets a capture that reads them where they lie, without
    the copies) and the outputs are the same device tensors at every call of that shape, so device outputs are
    valid until the next call. `max_graph_shapes` captures are kept, then they are dropped and start anew. A
    shape whose call cannot be captured runs uncaptured (`graph_fallbacks` says why).

    On the CPU, a call with numpy inputs (Python scalars for rank-0 inputs) of the model's dtypes, by ONNX name,
    positionally or as one dict, whose shapes were seen and checked at an earlier call skips the generic
    binding: its checks are kept per combination of shapes (`_FastEntry`); any other input, or a mismatch,
    goes the generic way, which says what is wrong."""

    def __init__(self, executable, target, signature: dict, device=None, weights=None, max_graph_shapes: int = 8,
                 cuda_graph: bool | None = None):
        self.executable = executable
        self.target = target
        self.signature = signature
        self.target_kind = target if isinstance(target, str) else target.kind.name
        self.device = _device(self.target_kind, device)
        self._vm_instance = None
        self._main = None
        self.max_graph_shapes = max_graph_shapes
        self._graph_mode = bool(signature.get("cuda_graph")) if cuda_graph is None else bool(cuda_graph)
        if self._graph_mode and self.target_kind != "cuda":
            raise TvmseqError(f"cuda_graph=True needs a CUDA model, this one is for {self.target_kind}")
        self._reset_graphs()   # _graphs: input (shape, dtype)s -> staged inputs and the capture; graph_fallbacks:
        # input shapes run uncaptured -> why
        self._feedback_cache: dict = {}          # state pairs -> (input positions, feedback pairs)
        self._fast: dict = {}                    # input shapes -> _FastEntry (`__call__`'s fast path)
        self._fast_misses: dict = {}             # input shapes seen once (an entry is made at the second call)
        specs = signature["inputs"]
        self._feed_specs = [s for s in specs if not s.get("weight")]
        self._weight_specs = [s for s in specs if s.get("weight")]
        self._weights: list | None = None        # on the device, uploaded once
        self._weight_values: list | None = None  # as given
        self._host_inputs = {s["name"]: _HostInput(s) for s in specs}
        self._by_name = {}
        for spec in self._feed_specs:
            self._by_name[spec["name"]] = spec
            self._by_name.setdefault(spec.get("onnx_name", spec["name"]), spec)
        called = artifacts_called(executable)
        if called and "artifacts" not in signature:
            # prebuilt kernels registered by the importer in this process: recorded so that `export`
            # writes where they live into the model's .so.json
            signature["artifacts"] = [dict(_REGISTERED[n]) for n in called if n in _REGISTERED]
        # `__call__`'s fast path (`_FastEntry`): CPU models whose inputs all have numpy dtypes and known ranks
        self._fast_names = tuple(s.get("onnx_name", s["name"]) for s in self._feed_specs)
        self._fast_facts = tuple(self._host_inputs[s["name"]] for s in self._feed_specs)
        self._fast_ok = (self.device.dlpack_device_type() == _KDL_CPU
                         and all(f.dtype is not None and f.shape is not None for f in self._fast_facts)
                         and all(self._by_name.get(n) is s for n, s in zip(self._fast_names, self._feed_specs)))
        # TVM's Relax VM keeps one call's registers in the VM itself: two threads in it at once corrupt each
        # other's frames (seen: "reg < frame->register_file.size()"), so calls of one model take turns in it
        self._vm_lock = threading.RLock()   # re-entered: a first call uploads and transforms the weights inside it
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
            if self.target_kind != "cuda":
                from .schedule_cpu import configure_threads

                # a model loaded from a .so was never compiled in this process: without this, TVM's pool
                # would start with half the cores (one thread on a 2-core machine without SMT)
                configure_threads()
            resolve_artifacts(self.executable, self.signature.get("artifacts"))
            module = self.executable.jit() if hasattr(self.executable, "jit") else self.executable
            self._vm_instance = VirtualMachine(module, self.device)
        return self._vm_instance

    @property
    def _main_function(self):
        """The VM's "main", looked up once (creating the VM on first use): a lookup costs ~1 us a call."""
        if self._main is None:
            self._main = self._vm["main"]
        return self._main

    @property
    def cuda_graph(self) -> bool:
        return self._graph_mode

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
        self._fast, self._fast_misses = {}, {}    # their argument lists hold the old weights
        self._reset_graphs()   # captured graphs read the old weights' addresses

    def _device_weights(self) -> list:
        """The weights `main` takes: uploaded once, then (a build that lifted the work on the weights alone,
        `build.lift_weight_transforms`) through `main_transform_params`, once."""
        if self._weights is None and self._weight_values is not None:
            uploaded = [self._prepare(spec, value, {}) for spec, value in
                        zip(self._weight_specs, self._weight_values)]
            if self.signature.get("transform_params"):
                with self._vm_lock:
                    uploaded = list(self._vm["main_transform_params"](uploaded))
            self._weights = uploaded
        return self._weights or []

    # ---- binding and checking inputs ------------------------------------------------------------
    def _bind(self, args, kwargs, upload: bool = True) -> list:
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
        checked = [self._checked(spec, values[spec["name"]], symbols) for spec in specs]
        self._check_bounds(symbols)
        return self._placed(checked, symbols, upload)

    def _check_bounds(self, symbols: dict) -> None:
        bounds = (self.signature.get("cuda_graph") or {}).get("bounds") or {}
        for dim, bound in bounds.items():
            if dim in symbols and symbols[dim] > bound:
                raise TvmseqError(f"dimension {dim!r} is {symbols[dim]}, above {bound}, the largest this "
                                  "CUDA-graph model was compiled for (cuda_graph_bounds)")

    def _prepare(self, spec, value, symbols, upload: bool = True):
        """Check one input against its spec and return it as a tensor on the model's device (a host
        array left on the host when not `upload`: CUDA-graph mode copies it straight into its buffer)."""
        return self._placed([self._checked(spec, value, symbols)], symbols, upload)[0]

    def _checked(self, spec, value, symbols) -> tuple:
        """(host array or None, DLPack tensor view or None, the value, its spec), checked against `spec`
        (shape, dtype, value checks of host arrays); symbolic dims bound into `symbols`."""
        name = spec.get("onnx_name", spec["name"])
        if type(value) is np.ndarray and self._host_inputs[spec["name"]].matches(value, symbols):
            host, tensor = value, None
        else:   # not numpy, or a mismatch: the generic check says what is wrong
            host, tensor = _as_host_or_tensor(value, spec, name)
            data = host if host is not None else tensor
            _check_shape_dtype(name, spec, tuple(data.shape), str(data.dtype), symbols)
        if host is not None:
            for check in spec.get("checks", ()):
                _run_check(check, name, host, symbols)
        return host, tensor, value, spec

    def _placed(self, checked: list, symbols: dict, upload: bool) -> list:
        """Checked inputs (`_checked`) as tensors on the model's device, or host arrays when not `upload`."""
        on_cpu = upload and self.device.dlpack_device_type() == _KDL_CPU
        # tvm.runtime.tensor takes ~60 us an input (empty + copyfrom), as long as a small model's whole run on
        # the CPU: the call's numeric host inputs are copied into one aligned numpy block wrapped by DLPack
        copies = iter(_aligned_copies([h for h, _, _, _ in checked if h is not None and on_cpu
                                       and h.dtype.kind in "fiu"]))
        out = []
        for host, tensor, value, spec in checked:
            if host is None:
                name = spec.get("onnx_name", spec["name"])
                out.append(on_device(tensor, value, self.device, name) if upload or not tensor.is_contiguous()
                           else tensor)
                for check in spec.get("checks", ()):
                    _run_check(check, name, out[-1], symbols)
            elif not upload:
                out.append(_compact(host))
            elif on_cpu and host.dtype.kind in "fiu":
                out.append(tvm_ffi.from_dlpack(next(copies)))
            else:
                out.append(tvm.runtime.tensor(_compact(host), self.device))
        return out

    # ---- running --------------------------------------------------------------------------------
    def _reset_graphs(self) -> None:
        self._graphs = {}
        self._last_addresses = {}                # input shapes -> the input addresses of the last call
        self.graph_fallbacks = {}

    def _graph_run(self, inputs: list, feedback: tuple = ()):
        """CUDA-graph mode (class doc): the inputs copied into this shape's buffers, then its capture
        replayed; the first call of a shape runs once plainly (loads the kernels, fills the VM's memory
        pool, so the capture allocates nothing) and then captures. `feedback`: (output index, input index)
        pairs copied at the end of the call, output into that input's buffer (`stream_run`); an input given
        as its own buffer is not copied. Without feedback, inputs given in place two calls in a row are read where
        they lie (`_capture_in_place`). Returns (outputs, the input buffers)."""
        from .cuda_graph import CaptureError, copy_async

        key = (tuple((tuple(x.shape), str(x.dtype)) for x in inputs), feedback)
        in_place = None if feedback else self._in_place_addresses(inputs)
        repeated = in_place is not None and self._last_addresses.get(key) == in_place
        self._last_addresses[key] = in_place
        if in_place is not None:
            held = self._graphs.get((key, in_place))
            if held is not None and held["call"] is not None:
                held["call"].replay()
                return held["call"].outputs, inputs
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graph_shapes:
                self._reset_graphs()
            entry = self._graphs[key] = {"inputs": [tvm.runtime.empty(s, d, self.device) for s, d in key[0]],
                                         "call": None, "captured": False}
        buffers = entry["inputs"]
        self._last_graph = key, entry      # what a Stream's fast path replays (stream.FramePlan)
        for value, buffer in zip(inputs, buffers):
            if not isinstance(value, tvm.runtime.Tensor):
                buffer.copyfrom(value)                      # from the host
            elif value.data_ptr() == buffer.data_ptr():     # a state fed back as its own buffer: nothing to copy
                continue
            elif (value.device.dlpack_device_type(), value.device.index) == (_KDL_CUDA, buffer.device.index) and \
                    buffer.device.dlpack_device_type() == _KDL_CUDA:
                copy_async(buffer, value)
            else:
                value.copyto(buffer)
        args = [*buffers, *self._device_weights()]
        if entry["call"] is None and not entry["captured"]:
            entry["captured"] = True
            try:
                entry["call"] = self._warm_capture(args, [(out, buffers[inp]) for out, inp in feedback])
            except CaptureError as err:
                self.graph_fallbacks[key[0]] = str(err)
        if entry["call"] is None:
            outputs = self._vm["main"](*args)
            listed = (outputs,) if isinstance(outputs, tvm.runtime.Tensor) else tuple(outputs)
            for out, inp in feedback:
                listed[out].copyto(buffers[inp])
            return outputs, buffers
        if repeated and (key, in_place) not in self._graphs:   # (a capture that failed is not tried again)
            held = self._capture_in_place(key, in_place, inputs)
            if held is not None:
                held.replay()
                return held.outputs, inputs
        entry["call"].replay()
        return entry["call"].outputs, buffers

    def _warm_capture(self, args: list, copies_after=()):
        """The VM call on `args` run once plainly (loads the kernels, fills the VM's memory pool, so the capture
        allocates nothing), then captured (`cuda_graph.capture`, which raises CaptureError)."""
        from .cuda_graph import capture

        warm = self._vm["main"](*args)
        self.device.sync()
        del warm                          # its storage goes back to the pool for the capture to take
        return capture(lambda: self._vm["main"](*args), self.device, copies_after)

    def _in_place_addresses(self, inputs: list):
        """The inputs' device addresses when every input is a compact, 64-byte aligned tensor on the model's device
        (what a graph may read where it lies), else None."""
        device = (self.device.dlpack_device_type(), self.device.index)
        addresses = []
        for x in inputs:
            if not isinstance(x, tvm.runtime.Tensor) or (x.device.dlpack_device_type(), x.device.index) != device \
                    or not x.is_contiguous() or x.data_ptr() % _ALIGNMENT:
                return None
            addresses.append(x.data_ptr())
        return tuple(addresses)

    def _capture_in_place(self, key, addresses: tuple, inputs: list):
        """A capture of this shape's call reading the caller's own input tensors (the same addresses two calls in a
        row: a caller that keeps its inputs in place, as PyTorch's CUDA graphs ask), so that its replays copy
        nothing in; kept under (key, addresses) like a shape (`max_graph_shapes`). A later call at those addresses
        replays it: the tensor there then is the one the caller gives (same shape and dtype by the key). None
        where it cannot be captured (the copying capture stays in use)."""
        from .cuda_graph import CaptureError

        if len(self._graphs) >= self.max_graph_shapes:
            return None
        try:
            call = self._warm_capture([*inputs, *self._device_weights()])
        except CaptureError:
            call = None
        self._graphs[(key, addresses)] = {"call": call}
        return call

    def _feedback_of(self, pairs: tuple):
        """({input name: position}, ((output index, input position), ...)) for state pairs, worked out once."""
        cache = self._feedback_cache
        if pairs not in cache:
            position = {}
            for i, spec in enumerate(self._feed_specs):
                position[spec["name"]] = position[spec.get("onnx_name", spec["name"])] = i
            cache[pairs] = position, tuple((self.output_names.index(name_out), position[name_in])
                                           for name_in, name_out in pairs)
        return cache[pairs]

    def stream_run(self, feeds: dict, pairs: dict):
        """One streaming call (`tvmseq.Stream`): `feeds` by input name, `pairs` {state input: state output}.
        Returns (outputs as `run` returns them, {state input: the tensor to feed it next call}). In CUDA-graph
        mode the graph itself ends by copying each final state into its state input's buffer, and the
        buffers are what is fed back: a call costs the frame's copy and one launch."""
        if not self._graph_mode:
            outputs = self.run(feeds)
            named = self.named(outputs)
            return outputs, {name_in: named[name_out] for name_in, name_out in pairs.items()}
        tensors = self._bind((feeds,), {}, upload=False)
        position, feedback = self._feedback_of(tuple(pairs.items()))
        outputs, buffers = self._graph_run(tensors, feedback)
        outputs = outputs if isinstance(outputs, tvm.runtime.Tensor) else tuple(outputs)
        return outputs, {name_in: buffers[position[name_in]] for name_in in pairs}

    def run(self, *args, **kwargs):
        """Run and return TVM tensors (DLPack-capable, on the model's device): one, or a tuple."""
        tensors = self._bind(args, kwargs, upload=not self._graph_mode)
        if self._weight_specs and self._weight_values is None:
            raise TvmseqError("this model keeps its weights out of the executable: call set_weights(...) "
                              "(or tvmseq.load(path, weights=...)) first")
        if self._graph_mode:
            out = self._graph_run(tensors)[0]
        else:
            with self._vm_lock:
                out = self._main_function(*tensors, *self._device_weights())
        return out if isinstance(out, tvm.runtime.Tensor) else _items(out)

    def __call__(self, *args, **kwargs):
        if self._fast_ok and not self._graph_mode:
            # the fast path (`_FastEntry`): numpy inputs (or Python scalars for rank-0 inputs) of the model's dtypes
            # by their ONNX names, in order or as one dict; anything else, or a first call of a shape, goes the
            # generic way below, which says what is wrong
            values = self._fast_values(args, kwargs)
            key = self._fast_key(values) if values is not None else None
            if key is not None:
                table = self._fast        # (set_weights replaces it: an entry in use then goes back to the old one)
                entry = table.pop(key, None)
                if entry is not None:
                    try:
                        return entry(values)
                    finally:
                        table[key] = entry
                out = self._call(args, kwargs)
                self._fast_learn(key)
                return out
        return self._call(args, kwargs)

    def _fast_values(self, args, kwargs):
        """The inputs in the model's order when given by ONNX name, in order, or as one dict; else None."""
        names = self._fast_names
        if kwargs:
            source = kwargs if not args and len(kwargs) == len(names) else None
        elif len(args) == len(names):
            return args
        else:
            source = args[0] if len(args) == 1 and args[0].__class__ is dict and len(args[0]) == len(names) else None
        if source is None:
            return None
        try:
            return [source[n] for n in names]
        except KeyError:
            return None

    def _fast_key(self, values):
        """The inputs' shapes when every input is a numpy array of its dtype (or a Python scalar where the input is
        rank 0), else None."""
        key = []
        for value, fact in zip(values, self._fast_facts):
            if value.__class__ is np.ndarray:
                if value.dtype != fact.dtype:
                    return None
                key.append(value.shape)
            elif fact.scalar and value.__class__ in fact.scalar:
                key.append(())
            else:
                return None
        return tuple(key)

    def _call(self, args, kwargs):
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

    def _fast_learn(self, key: tuple) -> None:
        """After a generic call with inputs of these shapes succeeded (so they passed every check that depends
        only on shapes and dtypes): the second time, keep a `_FastEntry` for them."""
        misses = self._fast_misses
        if misses.pop(key, None) is None:
            if len(misses) >= 64:
                misses.clear()
            misses[key] = True
            return
        if self._weight_specs and self._weights is None:
            return
        try:
            entry = _FastEntry(self, key)
        except _NotFast:
            return
        if len(self._fast) >= _FAST_SHAPES:
            self._fast = {}
        self._fast[key] = entry

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


_FAST_SHAPES = 8                 # input shape combinations a model keeps a _FastEntry for
# inputs above this (all together) take the generic path. The entry's buffers are reused call after call: a fresh
# block a call cost more than the copy (the 16-core Xeon of the GPU machine, an LSTM node's 6.5 MB input: ~6 ms of
# page faults and copy into new memory against ~8 ms for its two kernels, 2026-11-27)
_FAST_MAX_BYTES = 64 << 20
_IN_PLACE_MIN_BYTES = 64 << 10    # inputs below this are copied (a copy of 64 KB ~3 us, a DLPack wrap ~2)
_Array = tvm_ffi.Array
_array_item = getattr(getattr(tvm_ffi, "_ffi_api", None), "ArrayGetItem", None)


def _items(out) -> tuple:
    """A tvm_ffi Array as a tuple: one C call an item (iterating it from Python, or `tuple(out)`, took ~1 us
    an item more)."""
    if _array_item is None or out.__class__ is not _Array:
        return tuple(out)
    return tuple([_array_item(out, i) for i in range(len(out))])


class _NotFast(Exception):
    pass


class _FastEntry:
    """What a CPU model's call with numpy inputs of one combination of shapes needs, worked out once (the
    generic path took ~17 us a call around a small model, a third of silero VAD's call): its inputs already
    checked (names, dtypes, ranks, static and symbolic dims, bounds: a call's inputs only have to have the
    model's dtypes and these shapes), aligned device buffers the inputs are copied into (TVM's code needs
    64-byte aligned compact inputs; a numpy copy into a view of the buffer costs ~0.3 us) and the argument
    list. Taken out of the model's table while a call uses it, so concurrent calls never share buffers.
    Value checks of inputs (`_run_check`) still run at every call."""
    __slots__ = ("views", "args", "main", "vm_lock", "checks", "symbols", "outs", "fresh", "first", "in_place")

    def __init__(self, model: Model, shapes: tuple):
        facts = model._fast_facts
        if sum(int(np.prod(shape)) * fact.dtype.itemsize for shape, fact in zip(shapes, facts)) > _FAST_MAX_BYTES:
            raise _NotFast
        self.symbols = {}   # the symbolic dims' values, bound by `_HostInput.matches` as the generic path does
        buffers, self.views = [], []
        for shape, fact in zip(shapes, facts):
            buffer = tvm.runtime.empty(shape, str(fact.dtype), model.device)
            try:
                view = np.from_dlpack(buffer)
            except (RuntimeError, BufferError, TypeError) as err:
                raise _NotFast from err
            if not fact.matches(view, self.symbols) or not view.flags.writeable or buffer.data_ptr() % _ALIGNMENT:
                raise _NotFast
            buffers.append(buffer)
            self.views.append(view)
        self.args = [*buffers, *model._device_weights()]
        # (input, byte boundary) of the inputs the model reads in place at that boundary (the signature's `in_place`,
        # `build.in_place_inputs`), where copying costs more than wrapping them (~2 us)
        alignments = [_in_place_alignment(spec) if view.nbytes >= _IN_PLACE_MIN_BYTES else None
                      for spec, view in zip(model._feed_specs, self.views)]
        self.in_place = tuple((i, a) for i, a in enumerate(alignments) if a)
        self.main, self.vm_lock = model._main_function, model._vm_lock
        self.checks = [(i, check, spec.get("onnx_name", spec["name"]))
                       for i, spec in enumerate(model._feed_specs) for check in spec.get("checks", ())]
        self.outs = None
        self.fresh = None    # per output: handed out without a copy (`_learn_fresh`), once two calls were seen
        self.first = None    # the first call's output views, kept alive until the second call

    def __call__(self, values):
        args, read = self.args, self.views
        if self.in_place:
            args, read = list(args), list(read)
            for i, alignment in self.in_place:
                value = values[i]
                if value.flags.c_contiguous and value.flags.writeable and \
                        value.__array_interface__["data"][0] % alignment == 0:
                    args[i], read[i] = tvm_ffi.from_dlpack(value), value
        for view, value, source in zip(self.views, values, read):
            if source is view:
                view[...] = value
        for i, check, name in self.checks:
            _run_check(check, name, read[i], self.symbols)
        with self.vm_lock:
            out = self.main(*args)
        # each output copied out (a numpy copy through DLPack, ~0.5 us) unless it was found to be memory the VM
        # allocated for this call alone: the VM may hand back a constant of the model, one of these input buffers
        # (reused at the next call) or two views of one tensor
        if out.__class__ is _Array and _array_item is not None:
            outs = self.outs
            if outs is None:
                outs = self.outs = range(len(out))
            try:
                views = [np.from_dlpack(_array_item(out, i)) for i in outs]
            except (RuntimeError, BufferError, TypeError, AttributeError):   # nested, or a dtype numpy lacks
                return _to_numpy(out)
            fresh = self.fresh
            if fresh is None:
                fresh = self._learn_fresh(views)
            return tuple([v if f else v.copy() for v, f in zip(views, fresh)])
        return _to_numpy(out)

    def _learn_fresh(self, views: list) -> tuple:
        """Which outputs can be handed out without a copy: those whose memory shares nothing with the previous
        call's outputs while those are still alive (a constant, or an input buffer, comes back at the same
        address), nor with an input buffer or another output. Decided at the second call; until then every
        output is copied."""
        if self.first is None:
            self.first = views
            return (False,) * len(views)
        fresh = []
        for i, (view, before) in enumerate(zip(views, self.first)):
            others = self.views + views[:i] + views[i + 1:]
            fresh.append(view.nbytes > 0 and not np.may_share_memory(view, before)
                         and not any(np.may_share_memory(view, o) for o in others))
        self.fresh, self.first = tuple(fresh), None
        return (False,) * len(views)


def _in_place_alignment(spec) -> int | None:
    """The byte boundary at which a call may pass this input in place (the signature's `in_place`), else None (a
    signature without one, or any other value, copies it)."""
    value = spec.get("in_place")
    return value if type(value) is int and value > 0 else None


def _to_numpy(out):
    if not isinstance(out, tvm.runtime.Tensor):
        return tuple(_to_numpy(o) for o in _items(out))
    if out.device.dlpack_device_type() == _KDL_CPU:
        # Tensor.numpy() takes ~30 us; a copy through DLPack ~1 (a copy: the output may be a constant of the model)
        try:
            return np.from_dlpack(out).copy()
        except (RuntimeError, BufferError, TypeError):   # a dtype numpy does not take through DLPack (bfloat16)
            pass
    return out.numpy()


class _HostInput:
    """An input's dtype and shape as numpy compares them, worked out once: checking a numpy input against the
    signature's strings took ~8 us an input (str(dtype) alone ~5), a good part of a small model's call."""
    __slots__ = ("dtype", "shape", "scalar")

    def __init__(self, spec):
        try:
            self.dtype = np.dtype(spec["dtype"])
        except TypeError:          # a dtype numpy lacks (bfloat16): only the generic check takes it
            self.dtype = None
        self.shape = None if spec["shape"] is None else tuple(spec["shape"])
        # Python scalars a rank-0 input takes as they are (numpy converts them as the generic path does)
        kind = self.dtype.kind if self.dtype is not None and self.shape == () else ""
        self.scalar = (int, float) if kind == "f" else (int,) if kind == "i" else ()

    def matches(self, arr: np.ndarray, symbols: dict) -> bool:
        """Whether `arr` has this dtype and shape, its symbolic dims bound into `symbols` (False: the generic
        `_check_shape_dtype` then says what is wrong)."""
        if arr.dtype != self.dtype or self.shape is None or arr.ndim != len(self.shape):
            return False
        for got, want in zip(arr.shape, self.shape):
            if want.__class__ is int:
                if got != want:
                    return False
            elif symbols.setdefault(want, got) != got:
                return False
        return True


def _aligned_copies(arrays: list) -> list:
    """Compact copies of `arrays` in one numpy block, each starting on an _ALIGNMENT-byte boundary (TVM's
    compiled code assumes it): one allocation a call instead of one an input."""
    if not arrays:
        return []
    sizes = [-(-a.nbytes // _ALIGNMENT) * _ALIGNMENT for a in arrays]
    raw = np.empty(sum(sizes) + _ALIGNMENT, np.uint8)
    offset = -tvm_ffi.from_dlpack(raw).data_ptr() % _ALIGNMENT   # ~3x cheaper than raw.ctypes.data
    out = []
    for arr, size in zip(arrays, sizes):
        copy = np.ndarray(arr.shape, arr.dtype, raw, offset)
        copy[...] = arr
        out.append(copy)
        offset += size
    return out


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


def load_model(path, device=None, weights=None, cuda_graph: bool | None = None) -> Model:
    """Load a `.so` written by `tvmseq compile` (reads the signature from the `.so.json` beside it, and
    checks the `.so` against the size and sha256 recorded there before loading it). `weights`: for a
    model exported with its weights kept out (a dict by ONNX name, or an .npz path). `cuda_graph`: capture
    and replay whole calls (`Model`), default as the model was compiled."""
    path = Path(path)
    meta = read_model_meta(path)
    if meta["target"] == "cuda":
        from .cuda_toolchain import ensure_cuda_runtime

        # before the load: a module that carries CUDA source is compiled as it loads, by the callback this
        # registers (sm_90a code such as wgmma needs compute_90a, which other callbacks did not give it)
        ensure_cuda_runtime()
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as err:  # noqa: BLE001 - corrupt files surface as many error types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TvmseqError(f"could not load model {path}: {first}") from None
    return Model(module, meta["target"], meta["signature"], device, weights=weights, cuda_graph=cuda_graph)
