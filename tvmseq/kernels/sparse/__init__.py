"""Sparse (CSR) x dense matmuls `S D` and `S^T D` (`spmm`); the user-facing API is `tvmseq.sparse`."""
