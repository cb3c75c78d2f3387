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
    "llvm"/"cpu": the host CPU; "llvm -mcpu=NAME [-mattr=+a,+b ...]": that CPU (x86: its vector width set,
    `with_vector_width`); anything else is passed to tvm.target.Target (a tag or JSON dict)."""
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
        target = tvm.target.Target(_from_cli(name) if isinstance(name, str) else name)
    except Exception as err:  # noqa: BLE001
        raise TvmseqError(f"unknown target {name!r}: use cuda, llvm (\"llvm -mcpu=x86-64-v3\" for another CPU) "
                          "or a TVM target tag") from err
    return with_vector_width(target)


def _from_cli(name: str):
    """A target string in the command-line form ("llvm -mcpu=x86-64-v3 -mattr=+avx2,+fma"), which TVM 0.27 no
    longer parses, as its JSON dict; any other string as it is."""
    kind, *options = name.split()
    if kind != "llvm" or not options or not all(o.startswith("-") and "=" in o for o in options):
        return name
    config = {"kind": kind}
    for option in options:
        key, value = option.lstrip("-").split("=", 1)
        config[key] = value.split(",") if key in ("mattr", "keys", "libs") else int(value) if value.isdigit() else value
    return config


def with_vector_width(target: tvm.target.Target) -> tvm.target.Target:
    """An x86 llvm target with an explicit -mcpu and no "vector-width", given the widest vector its features
    allow (512 with AVX-512F, 256 with AVX, else 128): TVM's llvm_get_vector_width, which sizes
    schedule_cpu's vector lanes, otherwise answers 512 for every x86-64 CPU (x86-64-v3 included: measured with
    TVM 0.27), whatever the host; with the attribute it answers that."""
    attrs = dict(target.attrs)
    if target.kind.name != "llvm" or "mcpu" not in attrs or "vector-width" in attrs:
        return target
    try:
        from tvm.target import codegen

        triple = attrs.get("mtriple") or codegen.llvm_get_system_triple()
        valid = codegen.llvm_is_valid_cpu(str(attrs["mcpu"]), str(triple))
        if not codegen.target_has_features("sse2", target):     # not x86: left to LLVM
            return target
        bits = 512 if codegen.target_has_features("avx512f", target) else \
            256 if codegen.target_has_features("avx", target) else 128
    except Exception:  # noqa: BLE001 - a TVM without LLVM (runtime only): nothing is compiled anyway
        return target
    if not valid:    # LLVM would compile for a generic CPU, with a warning lost in the build's output
        raise TvmseqError(f"-mcpu={attrs['mcpu']}: LLVM knows no such CPU for {triple}")
    config = {k: v for k, v in target.export().items() if v not in ("", None)}
    return tvm.target.Target({**config, "vector-width": bits})


@functools.lru_cache(maxsize=None)
def host_cpu_target() -> tvm.target.Target:
    """llvm for this machine's CPU (`-mcpu` of the host, e.g. znver4, its vector width set: `with_vector_width`):
    plain "llvm" is generic x86-64 (SSE2 only, no FMA), 2-3x slower on the recurrent kernels' SIMD loops. A .so
    built with it needs a CPU with the same instruction set extensions."""
    try:
        from tvm.target import codegen

        # the width matters on an AVX2 host: without it schedule_cpu tiled for 16 lanes, twice the accumulators
        # of AVX2's 16 registers (ddddocr's Gemm head 4.8 ms a call on a 2-core Zen 3, 2026-11-28)
        return with_vector_width(tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()}))
    except Exception:  # noqa: BLE001 - a TVM without LLVM (runtime only): nothing is compiled anyway
        return tvm.target.Target("llvm")


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"


def device_for(target: tvm.target.Target):
    return tvm.cuda(0) if is_gpu(target) else tvm.cpu(0)
