"""What the host CPU offers, for tests whose kernel path or whose peer depends on it.

- The CPU GEMMs' packed-panel path (`step_gemm`: R and W packed into 64-row panels, the fused LSTM step) is built
  for x86 targets with AVX-512 only; elsewhere the kernels keep the weights as stored, so tests of the panels
  skip on a host without it (the kernels' numerics are tested on every host by the other tests).
- onnxruntime's uint8 x int8 GEMM (MLAS) on x86 without VNNI sums pairs of byte products into int16 with
  saturation (vpmaddubsw), so its MatMulInteger / QLinear / DynamicQuantize results are not exact there: measured
  on an AVX2 host (AMD Zen 3), MatMulIntegerToFloat 7 x 37 x 19 off by up to 8.5 from the exact int32 product,
  which tvmseq matches to 2e-6. Comparisons with onnxruntime on such operands need a host with AVX512-VNNI or
  AVX-VNNI; the exact (numpy) references run everywhere."""
from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def has(feature: str) -> bool:
    """Whether the host's llvm target (what `tvmseq.targets.resolve("llvm")` builds for) has an LLVM feature."""
    try:
        from tvm.target import codegen

        from tvmseq.targets import resolve

        return bool(codegen.target_has_features(feature, resolve("llvm")))
    except Exception:  # noqa: BLE001 - a runtime-only TVM cannot tell: the tests that ask build CPU kernels anyway
        return False


def ort_u8s8_exact() -> bool:
    """Whether onnxruntime's uint8 x int8 products are exact int32 sums on this host (VNNI)."""
    return has("avx512vnni") or has("avxvnni")


needs_avx512 = pytest.mark.skipif(not has("avx512f"),
                                  reason="the host CPU has no AVX-512: the packed-panel CPU path is not built for it")


def skip_unless_ort_u8s8_exact():
    if not ort_u8s8_exact():
        pytest.skip("onnxruntime's uint8 x int8 GEMM saturates int16 pair sums on this CPU (no VNNI): not a reference")
