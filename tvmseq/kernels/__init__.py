"""tvmseq's TensorIR kernels (compute + default CUDA/CPU schedules), one package per family.

* `recurrent/`: GRU, RNN and LSTM recurrences: the per-step kernels, the persistent SIMT engine, the staged-state
  mma / wgmma kernels, the pipelined stacks, and the path chooser between them (`recurrent.paths`).
* `projection/`: the input projections of the recurrent nodes (one GEMM over all time steps): SIMT template,
  mma.sync and wgmma tensor-core kernels.
* `recurrent_gemm.py`: the persistent recurrent GEMM `C_n = f(A C_{n-1} + b)`, whose engine (weights on chip, LL
  hand-off) the recurrent family builds on.
* `sparse/`: CSR x dense matmuls `S D` and `S^T D`.
* `topk/`: hierarchical top-k and the fused beam-search step.
* `activations.py`: ONNX activation functions as TIR expressions, shared by every family.
"""
from .. import tvm_fixes

tvm_fixes.apply()
