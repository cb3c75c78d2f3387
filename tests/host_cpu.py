"""What the host CPU offers, for tests whose kernel path or whose peer depends on it.

- The CPU GEMMs' packed-panel path (`step_gemm`: R and W packed into panels of 4 vectors, the fused LSTM step) is
  built for x86 targets with AVX-512 (64-row panels) or AVX2 and FMA (32-row panels); elsewhere the kernels keep
  the weights as stored, so tests of the panels skip on such a host.
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


def panel_rows() -> int:
    """Rows of a CPU panel on this host (`step_gemm.cpu_panel_size`): 64 (AVX-512), 32 (AVX2), 0 (none)."""
    try:
        from tvmseq.kernels.recurrent.step_gemm import cpu_panel_size
        from tvmseq.targets import resolve

        return cpu_panel_size(resolve("llvm"))
    except Exception:  # noqa: BLE001 - a runtime-only TVM
        return 0


needs_panels = pytest.mark.skipif(not panel_rows(),
                                  reason="the host CPU has neither AVX-512 nor AVX2: no packed-panel CPU path")


def skip_unless_ort_u8s8_exact():
    if not ort_u8s8_exact():
        pytest.skip("onnxruntime's uint8 x int8 GEMM saturates int16 pair sums on this CPU (no VNNI): not a reference")


needs_fused_lstm = pytest.mark.skipif(panel_rows() != 64,
                                      reason="the fused LSTM step (gate math in the panel GEMM) is built for AVX-512 only")
