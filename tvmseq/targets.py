"""Target presets: `cuda` (the GPU present, or an H100 when building for one without a GPU) and `llvm`."""
from __future__ import annotations

import functools

import tvm

from .errors import TvmseqError

# The tag carries max_threads_per_block, shared memory limits etc., which MetaSchedule and dlight need.
DEFAULT_GPU_TAG = "nvidia/nvidia-h100"

_ARCH_TAGS = {"sm_90": "nvidia/nvidia-h100", "sm_80": "nvidia/nvidia-a100", "sm_89": "nvidia/geforce-rtx-4090"}


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """True when TVM can see a CUDA device (False on CPU-only machines, never raises)."""
    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - a missing driver can surface as any error
        return False


def gpu_arch() -> str | None:
    """sm_XY of the GPU present, or None."""
    if not has_gpu():
        return None
    return "sm_" + tvm.cuda(0).compute_version.replace(".", "")


def resolve(name: str | tvm.target.Target | None = None) -> tvm.target.Target:
    """`None`/"auto": cuda if a GPU is present else llvm; "cuda"/"gpu": the GPU present's tag (or H100);
    "llvm"/"cpu": the host CPU; anything else is passed to tvm.target.Target (a tag or JSON dict)."""
    if isinstance(name, tvm.target.Target):
        return name
    if name in (None, "auto"):
        name = "cuda" if has_gpu() else "llvm"
    if name in ("cuda", "gpu"):
        tag = _ARCH_TAGS.get(gpu_arch() or "", DEFAULT_GPU_TAG)
        return tvm.target.Target(tag, host="llvm")
    if name in ("llvm", "cpu"):
        return host_cpu_target()
    try:
        return tvm.target.Target(name)
    except Exception as err:  # noqa: BLE001
        raise TvmseqError(f"unknown target {name!r}: use cuda, llvm or a TVM target tag") from err


@functools.lru_cache(maxsize=None)
def host_cpu_target() -> tvm.target.Target:
    """llvm for this machine's CPU (`-mcpu` of the host, e.g. znver4): plain "llvm" is generic x86-64 (SSE2
    only, no FMA), 2-3x slower on the recurrent kernels' SIMD loops. A .so built with it needs a CPU with
    the same instruction set extensions."""
    try:
        from tvm.target import codegen

        return tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
    except Exception:  # noqa: BLE001 - a TVM without LLVM (runtime only): nothing is compiled anyway
        return tvm.target.Target("llvm")


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"


def device_for(target: tvm.target.Target):
    return tvm.cuda(0) if is_gpu(target) else tvm.cpu(0)
