"""Prebuilt kernel artifacts: `.so` files per architecture under `artifacts/<arch>/` plus a `manifest.json`.

`export_artifact` writes a `.so` and its entry (op, shapes or shape ranges, dtype, attributes, arch, schedule
hash, TVM version, file hash); `find_kernel` picks the entry for an op, shape, dtype and the GPU present, loads
it and returns a `Kernel` callable on numpy or DLPack tensors. A missing, corrupt or mismatched artifact (other
arch, other TVM version, hash mismatch) gives an `ArtifactWarning` saying why and `None`, so the caller compiles
instead (`kernel_or_compile`). Building device code into the `.so` files and loading TVM's CUDA runtime where
they run is `tvmseq.cuda_toolchain`.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .cuda_toolchain import arch_compatible, device_code_of, ensure_cuda_runtime, present_arch
from .errors import ArtifactError, ArtifactWarning, TvmseqError

ARTIFACTS_ROOT = Path(os.environ.get("TVMSEQ_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts"))
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


# ---------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------
@dataclass
class ArtifactEntry:
    """One kernel `.so` in `artifacts/<arch>/`. `shapes` maps each size name to an int or an inclusive
    [lo, hi] range; `signature` lists inputs and outputs ({"name", "shape", "dtype"}, shapes may use the
    size names) in call order (outputs last, destination-passing style)."""

    op: str
    name: str
    file: str
    dtype: str
    arch: str
    shapes: dict
    signature: dict
    attrs: dict = field(default_factory=dict)
    function: str = "main"
    device_code: str = "fatbin"       # "fatbin" (compiled SASS), "cuda-source" or "llvm"
    schedule_hash: str = ""
    tvm: str = ""
    sha256: str = ""
    genes: dict | None = None
    built: str = ""

    def covers(self, op: str, shapes: dict, dtype: str, attrs: dict | None = None) -> bool:
        if op != self.op or dtype != self.dtype or set(shapes) != set(self.shapes):
            return False
        if attrs is not None and any(self.attrs.get(k) != v for k, v in attrs.items()):
            return False
        for key, value in shapes.items():
            want = self.shapes[key]
            if isinstance(want, list):
                if not want[0] <= value <= want[1]:
                    return False
            elif value != want:
                return False
        return True


def read_manifest(arch_dir: Path) -> list[ArtifactEntry]:
    """Entries of `arch_dir/manifest.json`; ArtifactError when it is missing or unreadable."""
    path = Path(arch_dir) / MANIFEST
    if not path.exists():
        raise ArtifactError(f"no artifact manifest at {path}")
    try:
        data = json.loads(path.read_text())
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {MANIFEST_FORMAT}")
        return [ArtifactEntry(**e) for e in data["entries"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ArtifactError(f"corrupt artifact manifest {path}: {err}") from err


def write_manifest(arch_dir: Path, entries: list[ArtifactEntry]) -> Path:
    arch_dir = Path(arch_dir)
    arch_dir.mkdir(parents=True, exist_ok=True)
    path = arch_dir / MANIFEST
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "entries": [asdict(e) for e in entries]}, indent=1))
    os.replace(tmp, path)
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def export_artifact(executable, root: Path | None = None, *, op: str, name: str, shapes: dict, dtype: str,
                    signature: dict, arch: str, attrs: dict | None = None, schedule_hash: str = "",
                    genes: dict | None = None, function: str = "main") -> ArtifactEntry:
    """Export `executable` to `<root>/<arch>/<name>.so` and add (or replace) its manifest entry."""
    import tvm

    arch_dir = Path(root or ARTIFACTS_ROOT) / arch
    arch_dir.mkdir(parents=True, exist_ok=True)
    path = arch_dir / f"{name}.so"
    executable.export_library(str(path))
    entry = ArtifactEntry(op=op, name=name, file=path.name, dtype=dtype, arch=arch, shapes=dict(shapes),
                          signature=signature, attrs=dict(attrs or {}), function=function,
                          device_code=device_code_of(executable), schedule_hash=schedule_hash,
                          tvm=tvm.__version__, sha256=file_sha256(path), genes=genes,
                          built=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    try:
        entries = [e for e in read_manifest(arch_dir) if e.name != name]
    except ArtifactError:
        entries = []
    write_manifest(arch_dir, entries + [entry])
    return entry


# ---------------------------------------------------------------------------------------------------
# Finding and loading
# ---------------------------------------------------------------------------------------------------
class Kernel:
    """A loaded artifact: `kernel(*inputs)` allocates the outputs, runs, and returns them (numpy when
    every input was numpy, else TVM tensors, which are DLPack-capable). Inputs are checked against the
    entry's signature first."""

    def __init__(self, entry: ArtifactEntry, module, device):
        self.entry, self.module, self.device = entry, module, device
        self.func = module[entry.function]

    def __repr__(self):
        return f"Kernel({self.entry.name}, {self.entry.arch}, {self.entry.device_code})"

    def __call__(self, *inputs):
        import numpy as np
        import tvm

        specs = self.entry.signature["inputs"]
        if len(inputs) != len(specs):
            raise TvmseqError(f"{self.entry.name} takes {len(specs)} inputs "
                              f"({', '.join(s['name'] for s in specs)}), got {len(inputs)}")
        sizes = {k: v for k, v in self.entry.shapes.items() if isinstance(v, int)}
        all_numpy = all(isinstance(x, np.ndarray) for x in inputs)
        args = [self._tensor(x, spec, sizes) for x, spec in zip(inputs, specs)]
        outs = [tvm.runtime.empty(tuple(_dim(d, sizes, o["name"]) for d in o["shape"]), o["dtype"], self.device)
                for o in self.entry.signature["outputs"]]
        self.func(*args, *outs)
        if all_numpy:
            outs = [o.numpy() for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _tensor(self, x, spec: dict, sizes: dict):
        import numpy as np
        import tvm

        if isinstance(x, np.ndarray) or not hasattr(x, "__dlpack__"):
            x = np.ascontiguousarray(x)
            shape, dtype = x.shape, str(x.dtype)
        else:
            from .tensors import dlpack_view

            original, x = x, dlpack_view(x)
            shape, dtype = tuple(x.shape), str(x.dtype)
        name = spec["name"]
        if dtype != spec["dtype"]:
            raise TvmseqError(f"{self.entry.name}: input {name!r} has dtype {dtype}, expected {spec['dtype']}")
        want = spec["shape"]
        if len(shape) != len(want):
            raise TvmseqError(f"{self.entry.name}: input {name!r} has shape {list(shape)}, expected rank {len(want)}")
        for axis, (got, dim) in enumerate(zip(shape, want)):
            if isinstance(dim, str) and dim not in sizes:
                sizes[dim] = got
            if got != _dim(dim, sizes, name):
                raise TvmseqError(f"{self.entry.name}: input {name!r} has shape {list(shape)}, axis {axis} "
                                  f"must be {_dim(dim, sizes, name)}")
        if isinstance(x, np.ndarray):
            return tvm.runtime.tensor(x, self.device)
        if (x.device.dlpack_device_type(), x.device.index) != (self.device.dlpack_device_type(), self.device.index):
            raise TvmseqError(f"{self.entry.name}: input {name!r} is on {x.device}, the kernel runs on {self.device}")
        from .tensors import on_device

        return on_device(x, original, self.device, name)   # a misaligned or strided view: copied once


def _dim(dim, sizes: dict, name: str) -> int:
    if isinstance(dim, int):
        return dim
    if dim not in sizes:
        raise TvmseqError(f"size {dim!r} of {name!r} is not fixed by any input")
    return sizes[dim]


def load_entry(entry: ArtifactEntry, arch_dir: Path, present: str | None = None) -> Kernel:
    """Check an entry against this machine (arch, TVM version, file hash) and load it; ArtifactError
    says why not."""
    import tvm

    present = present or present_arch()
    path = Path(arch_dir) / entry.file
    if entry.tvm != tvm.__version__:
        raise ArtifactError(f"artifact {path} was built with TVM {entry.tvm}, this is TVM {tvm.__version__}")
    if not arch_compatible(entry.arch, present, entry.device_code):
        raise ArtifactError(f"artifact {path} is built for {entry.arch}, this device is {present}")
    if not path.exists():
        raise ArtifactError(f"artifact {path} listed in the manifest is missing")
    if entry.sha256 and file_sha256(path) != entry.sha256:
        raise ArtifactError(f"artifact {path} does not match its manifest hash (corrupt or replaced)")
    gpu = not entry.arch.startswith("cpu")
    if gpu and not ensure_cuda_runtime():
        raise ArtifactError(f"artifact {path} needs CUDA, which is not usable here")
    try:
        module = tvm.runtime.load_module(str(path))
        device = tvm.cuda(0) if gpu else tvm.cpu(0)
        return Kernel(entry, module, device)
    except Exception as err:  # noqa: BLE001 - a corrupt .so fails in many ways
        raise ArtifactError(f"artifact {path} could not be loaded: {str(err).splitlines()[0] if str(err) else err!r}") from err


def find_kernel(op: str, shapes: dict, dtype: str, attrs: dict | None = None, *, root: Path | None = None,
                arch: str | None = None) -> Kernel | None:
    """The loaded artifact for op/shapes/dtype/attrs on this machine's architecture, or None: silently
    when no entry covers the request, with an ArtifactWarning when one does but cannot be used."""
    arch = arch or present_arch()
    root = Path(root or ARTIFACTS_ROOT)
    for arch_dir in _candidate_dirs(root, arch):
        try:
            entries = read_manifest(arch_dir)
        except ArtifactError as err:
            if (arch_dir / MANIFEST).exists():
                warnings.warn(f"{err}; compiling instead", ArtifactWarning, stacklevel=2)
            continue
        for entry in entries:
            if not entry.covers(op, shapes, dtype, attrs):
                continue
            try:
                return load_entry(entry, arch_dir, arch)
            except ArtifactError as err:
                warnings.warn(f"{err}; compiling instead", ArtifactWarning, stacklevel=2)
    return None


def _candidate_dirs(root: Path, arch: str) -> list[Path]:
    """artifacts/<arch>/ first, then other directories whose code may run here (e.g. sm_80 on sm_86)."""
    if not root.is_dir():
        return []
    dirs = [root / arch] if (root / arch).is_dir() else []
    dirs += sorted(d for d in root.iterdir() if d.is_dir() and d.name != arch and not d.name.startswith(".")
                   and (d / MANIFEST).exists() and arch_compatible(d.name, arch, "fatbin"))
    return dirs


def kernel_or_compile(op: str, shapes: dict, dtype: str, compile_fn: Callable[[], object],
                      attrs: dict | None = None, **kwargs):
    """`find_kernel(...)` if an artifact fits, else `compile_fn()` (the importer's path)."""
    kernel = find_kernel(op, shapes, dtype, attrs, **kwargs)
    return kernel if kernel is not None else compile_fn()
