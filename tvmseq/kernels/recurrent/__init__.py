"""GRU, RNN and LSTM recurrences (ONNX semantics), every path a node can take.

* `cells`: what describes a cell, shared by every path (gate rows, activations, clip, LSTM update math).
* `gru`, `rnn`, `lstm` + `step_gemm`: the per-step path (per step a GEMM and a fused gate kernel, any batch).
* `engine`: the persistent SIMT engine (weights in registers, one cooperative launch for all steps).
* `mma`, `wgmma`: the staged-state persistent kernels (mma.sync / Hopper warpgroup tensor cores).
* `stack`, `rows`: stacks of GRU / LSTM layers pipelined in one kernel.
* `paths`: which of those runs a node (`choose_path`, `recurrence_func_auto`, `lstm_recurrence_auto`).
"""
