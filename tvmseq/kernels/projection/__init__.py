"""Input projections of the recurrent nodes: gate_i = X W^T + bias for all time steps in one GEMM.

* `gemm`: the projection's compute, its SIMT template schedule and the choice of kernel (`projection_for`).
* `mma`: the mma.sync tensor-core kernel (float16, sm_80+).
* `wgmma`: the Hopper warpgroup tensor-core kernel (float16, sm_90a).
"""
