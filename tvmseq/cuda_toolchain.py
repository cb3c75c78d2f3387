"""The CUDA toolchain of tvmseq's builds and loads: nvcc device binaries, ptxas reports, TVM's CUDA runtime,
and the GPU architectures kernels are built for.

* Building (on any machine with nvcc, GPU or not): `device_binaries(("sm_90a",))` makes `tvm.compile` for
  CUDA embed a fatbin compiled by nvcc for those architectures instead of CUDA source, so an exported
  `.so` needs no compiler where it is loaded. On a machine without a GPU driver TVM 0.27 does not load
  its CUDA runtime library (it needs `libcuda.so.1`) and then keeps only the source; we load it anyway
  against a stub `libcuda.so.1` whose entry points all return CUDA_ERROR_NO_DEVICE (nothing is ever
  launched on such a machine: the library is only needed to create the module object).
  `ptxas_report(source)` compiles CUDA source alone and returns registers, spills and shared memory per kernel.
* Loading where only TVM's runtime is installed: `ensure_cuda_runtime()` loads TVM's CUDA backend
  (runtime-only TVM 0.27 does not) and, for modules that still carry CUDA source, registers an nvcc
  compile callback for the GPU present (`tvm.support.nvcc` needs the compiler library).
* Architectures: `present_arch()` (what this machine runs), `arch_compatible(built, present)`.

The artifact manifest that records what was built with it is `tvmseq.artifacts`.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ArtifactError, ArtifactWarning

# libtvm_runtime_cuda.so's driver imports (TVM 0.27); the stub defines each one returning an error.
_DRIVER_SYMBOLS = ("cuDeviceGetName", "cuFuncSetAttribute", "cuGetErrorName", "cuGetErrorString",
                   "cuLaunchKernelEx", "cuModuleGetFunction", "cuModuleLoadData", "cuModuleUnload",
                   "cuTensorMapEncodeTiled", "cuModuleGetGlobal", "cuLaunchKernel", "cuInit")


# ---------------------------------------------------------------------------------------------------
# Building: CUDA modules that carry compiled device code
# ---------------------------------------------------------------------------------------------------
@dataclass
class _NvccState:
    arches: tuple[str, ...] = ("sm_90a",)
    extra_flags: tuple[str, ...] = ()
    # ptxas -v per kernel of the last compile: {kernel: {"registers", "spill_stores", "spill_loads", "smem"}}
    last_report: dict = field(default_factory=dict)
    seconds: float = 0.0          # total nvcc wall time so far (for build-time accounting)


NVCC = _NvccState()


def find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def nvcc_fatbin(code: str, arches=("sm_90a",), extra_flags=()) -> tuple[bytes, dict]:
    """Compile CUDA source to a fatbin holding SASS for each arch ("sm_90a", "sm_80", ...); with the
    ptxas report per kernel. Flags mirror tvm.support.nvcc's (fast math, -O3)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise ArtifactError("nvcc not found (PATH or CUDA_HOME)")
    gencode = []
    for arch in arches:
        num = arch.removeprefix("sm_")
        gencode += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    with tempfile.TemporaryDirectory(prefix="tvmseq_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.fatbin")
        Path(src).write_text(code)
        # no --use_fast_math (TVM's nvcc default): its approximate expf/tanhf cost the GRU kernels an
        # order of magnitude of fp32 accuracy (4.5e-6 against 2.6e-7 relative, H100, 2026-11-22)
        cmd = [nvcc, "--fatbin", "-O3", "-w", "--expt-relaxed-constexpr",
               "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-Xptxas=-v",
               *gencode, *extra_flags, "-o", out, src]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        NVCC.seconds += time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        return Path(out).read_bytes(), parse_ptxas(proc.stderr + proc.stdout)


def parse_ptxas(log: str) -> dict:
    """{kernel: {"registers", "spill_stores", "spill_loads", "smem"}} from `ptxas -v` output (the last
    architecture compiled wins when there are several)."""
    report, kernel = {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = m.group(1)
            report[kernel] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
        elif kernel and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            report[kernel].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            report[kernel]["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                report[kernel]["smem"] = int(s.group(1))
    return report


def ptxas_report(cuda_source: str, arch: str = "sm_90a") -> dict[str, dict]:
    """Compile CUDA source with nvcc (no GPU needed) and return per-kernel ptxas numbers:
    {kernel: {"registers", "spill_stores", "spill_loads", "stack", "smem"}}."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.cu"
        src.write_text(cuda_source)
        res = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-w", "-Xptxas", "-v", "-o",
                              str(Path(d) / "k.cubin"), str(src)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{res.stderr[-4000:]}")
    report, kernel = {}, None
    for line in (res.stdout + res.stderr).splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or re.search(r"Function properties for (\w+)", line)
        if m:
            kernel = m.group(1)
            report.setdefault(kernel, {})
            continue
        if kernel is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            report[kernel].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            report[kernel]["registers"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            report[kernel]["smem"] = int(sm.group(1)) if sm else 0
    return report


def _compile_callback(code, *_):
    binary, report = nvcc_fatbin(code, NVCC.arches, NVCC.extra_flags)
    NVCC.last_report = report
    return bytearray(binary)


def _stub_libcuda() -> Path:
    """Build (once, cached) a libcuda.so.1 whose every entry point returns CUDA_ERROR_NO_DEVICE."""
    cache = Path(os.environ.get("TVMSEQ_CACHE", Path.home() / ".cache" / "tvmseq")) / "stub-libcuda"
    lib = cache / "libcuda.so.1"
    if lib.exists():
        return lib
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise ArtifactError("no C compiler to build the libcuda stub")
    cache.mkdir(parents=True, exist_ok=True)
    body = ["/* tvmseq: stand-in for the CUDA driver on machines without a GPU; never launches. */"]
    for sym in _DRIVER_SYMBOLS:
        if sym in ("cuGetErrorName", "cuGetErrorString"):
            body.append(f'int {sym}(int e, const char** s) {{ if (s) *s = "no CUDA driver (tvmseq stub)"; return 100; }}')
        else:
            body.append(f"int {sym}() {{ return 100; }}")
    src, tmp = cache / f"stub.{os.getpid()}.c", cache / f"libcuda.so.1.{os.getpid()}"   # parallel workers
    src.write_text("\n".join(body) + "\n")
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
                       check=True, capture_output=True)
        os.replace(tmp, lib)
    finally:
        src.unlink(missing_ok=True)
    return lib


def _cuda_module_factory() -> bool:
    import tvm_ffi

    return tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None


def _load_tvm_cuda_runtime(allow_stub: bool) -> None:
    """Load libtvm_runtime_cuda.so (registers the CUDA module factory and loader)."""
    import tvm

    if _cuda_module_factory():
        return
    libdir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        if not allow_stub:
            raise ArtifactError("libcuda.so.1 (the NVIDIA driver) is not installed") from None
        ctypes.CDLL(str(_stub_libcuda()), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(libdir / "libtvm_runtime_cuda.so"), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
    tvm.base._LOADED_LIBS.setdefault("tvm_runtime_cuda", lib)
    if not _cuda_module_factory():
        raise ArtifactError("libtvm_runtime_cuda.so loaded but registered no CUDA module factory")


def enable_device_binaries(arches=("sm_90a",), extra_flags=()) -> bool:
    """From now on (in this process), `tvm.compile` for CUDA embeds nvcc-compiled SASS for `arches` (a
    fatbin), also on machines without a GPU. False (with a warning) when impossible (no nvcc, no C
    compiler for the driver stub): modules then carry CUDA source as usual.

    Meant for build worker processes: on a machine without a GPU it loads TVM's CUDA runtime against
    the driver stub, which cannot be undone, and from then on every CUDA module this process creates
    is compiled when it is created (by this callback), never left as source."""
    import tvm_ffi

    try:
        if find_nvcc() is None:
            raise ArtifactError("nvcc not found")
        _load_tvm_cuda_runtime(allow_stub=True)
    except (ArtifactError, OSError, subprocess.CalledProcessError) as err:
        warnings.warn(f"CUDA modules will carry source, not device code: {err}", ArtifactWarning, stacklevel=2)
        return False
    NVCC.arches, NVCC.extra_flags = tuple(arches), tuple(extra_flags)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_callback, override=True)
    return True


@contextlib.contextmanager
def device_binaries(arches=("sm_90a",), extra_flags=()):
    """`enable_device_binaries` for the duration of a with-block (the previous compile callback and
    architectures are restored after; the CUDA runtime it may have loaded stays, see there). Yields
    whether device code is embedded."""
    import tvm_ffi

    previous = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    saved = (NVCC.arches, NVCC.extra_flags)
    try:
        yield enable_device_binaries(arches, extra_flags)
    finally:
        NVCC.arches, NVCC.extra_flags = saved
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", previous, override=True)


# ---------------------------------------------------------------------------------------------------
# Loading where only TVM's runtime is installed
# ---------------------------------------------------------------------------------------------------
def ensure_cuda_runtime() -> bool:
    """Make CUDA modules loadable and runnable: load TVM's CUDA backend if runtime-only TVM did not,
    and register an nvcc compile callback (for the GPU present) when none is, so modules that carry
    CUDA source also load. Idempotent; never raises: False (with a warning) if CUDA stays unusable."""
    import tvm
    import tvm_ffi

    try:
        if not _cuda_module_factory():
            from tvm_ffi.libinfo import load_lib_ctypes

            libdir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
            tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
                package="tvm", target_name="tvm_runtime_cuda", mode="RTLD_GLOBAL", extra_lib_paths=[libdir])
        present = bool(tvm.cuda(0).exist)
        if find_nvcc() and (present or tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
                            is None):
            # where a GPU is present ours replaces TVM's (`tvm.support.nvcc` registers it on import, so import
            # it first): with no target current, as when a module carrying source is loaded, TVM's compiles
            # for sm_90, and sm_90a code (wgmma) then fails in ptxas
            with contextlib.suppress(ImportError):
                import tvm.support.nvcc  # noqa: F401
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", _present_gpu_compile, override=True)
        return present
    except Exception as err:  # noqa: BLE001 - any loader error means: no CUDA here
        warnings.warn(f"TVM's CUDA runtime could not be loaded: {err}", ArtifactWarning, stacklevel=2)
        return False


def _present_gpu_compile(code, *_):
    """nvcc for the current target's architecture when one is set (a build), else for the GPU present (a load)."""
    import tvm

    try:
        target = tvm.target.Target.current(allow_none=True)
    except AttributeError:   # TVM's runtime only has no targets: a load
        target = None
    arch = arch_of_target(target) if target is not None and target.kind.name == "cuda" else present_arch()
    binary, _report = nvcc_fatbin(code, (arch,))
    return bytearray(binary)


# ---------------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------------
def cpu_arch() -> str:
    return f"cpu-{platform.machine()}"


def present_arch(device=None) -> str:
    """The architecture kernels must be built for here: "sm_90a" on an H100 (sm_90 and newer get the
    'a' variant, as TVM's own targets do), "cpu-x86_64" without a GPU."""
    import tvm

    dev = device if device is not None else tvm.cuda(0)
    try:
        if dev.dlpack_device_type() == tvm.cuda(0).dlpack_device_type() and dev.exist:
            major, minor = dev.compute_version.split(".")
            return f"sm_{major}{minor}" + ("a" if int(major) >= 9 else "")
    except Exception:  # noqa: BLE001 - no driver
        pass
    return cpu_arch()


def arch_of_target(target) -> str:
    if target.kind.name == "cuda":
        return str(target.attrs.get("arch", "sm_90a"))
    return cpu_arch()


def arch_compatible(built: str, present: str, device_code: str = "fatbin") -> bool:
    """Can code built for `built` run on `present`? SASS runs on the same major version with an equal
    or newer minor; 'a' (architecture-specific) variants only on exactly their architecture; CUDA
    source compiles for any GPU."""
    if built.startswith("cpu") or present.startswith("cpu"):
        return built == present
    if device_code in ("cuda-source", "ptx"):   # compiled for the GPU present when loaded
        return True
    b, p = _sm(built), _sm(present)
    if b is None or p is None:
        return False
    if b[2] or p[2]:
        return b[:2] == p[:2]
    return b[0] == p[0] and p[1] >= b[1]


def _sm(arch: str):
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None



def device_code_of(module) -> str:
    """"fatbin" if the CUDA module inside an executable/module carries compiled code, "cuda-source" if
    it carries source, "llvm" if there is no CUDA module."""
    mod = getattr(module, "mod", module)
    for imp in mod.imports:
        if imp.kind != "cuda":
            continue
        # inspect_source(fmt) returns the code only when the module's format is fmt; compiled code
        # is labelled "cubin" (also for a fatbin) or "ptx", raw source "cuda".
        for fmt, label in (("cubin", "fatbin"), ("ptx", "ptx")):
            try:
                if imp.inspect_source(fmt):
                    return label
            except UnicodeDecodeError:  # binary code does not decode as text: it is there
                return label
        return "cuda-source"
    return "llvm"
