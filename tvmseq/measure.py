"""Measuring kernels on the GPU, shared by the benchmarks (`tvmseq/bench/`) and tuning (`tvmseq/tune/`,
`schedules/`): build prim_funcs with nvcc device code embedded (`compile_for_gpu`, no GPU needed), load the
modules a build wrote (`PrebuiltModules`, where only TVM's runtime is installed), time a call with CUDA events
(`time_cuda`, median after warm-up).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence


def time_cuda(fn: Callable[[], object], warmup: int = 10, iters: int = 50, rotate: Sequence[Callable] = ()) -> float:
    """Median milliseconds of `fn()` over `iters` runs, each bracketed by its own CUDA events.
    Everything runs on the legacy default stream, which TVM's runtime and torch share."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def compile_for_gpu(funcs: dict, tgt):
    """tvm.compile of prim_funcs with nvcc-compiled sm_90a SASS embedded (the GPU machine then loads the
    module in well under a second instead of compiling CUDA source); returns (executable, ptxas report per
    kernel). A CPU target (smoke tests of the benchmark scripts) compiles plainly, with no report."""
    import tvm

    from . import cuda_toolchain

    if tgt.kind.name != "cuda":
        return tvm.compile(tvm.IRModule(funcs), target=tgt), {}
    with cuda_toolchain.device_binaries(("sm_90a",)) as binary:
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
        report = dict(cuda_toolchain.NVCC.last_report) if binary else {}
    if not binary:
        report = cuda_toolchain.ptxas_report(ex.mod.imports[0].inspect_source())
    return ex, report


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (False without torch)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class PrebuiltModules:
    """The modules a benchmark's --build wrote to `root`, each loaded once. With cuda=True TVM's CUDA
    runtime is made loadable first (runtime-only TVM does not load it by itself)."""

    def __init__(self, root, cuda: bool = True):
        self.root, self.cuda, self.loaded = Path(root), cuda, {}

    def get(self, file: str):
        import time

        import tvm

        if file not in self.loaded:
            if self.cuda:
                from . import cuda_toolchain

                cuda_toolchain.ensure_cuda_runtime()
            t0 = time.time()
            self.loaded[file] = tvm.runtime.load_module(str(self.root / file))
            print(f"loaded {file} in {time.time() - t0:.1f}s", flush=True)
        return self.loaded[file]

    def func(self, entry: dict):
        """entry {"file", "func"} of an index.json -> the function."""
        return self.get(entry["file"])[entry["func"]]
