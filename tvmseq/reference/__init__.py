"""Numpy references that follow the ONNX operator specs exactly (float64 inside).
Every kernel in tvmseq is tested against these."""
from .recurrent import recurrent_gemm  # noqa: F401
from .rnn import gru, rnn  # noqa: F401
from .lstm import lstm  # noqa: F401
from .sparse import csr_to_dense, spmm_reference, spmm_t_reference  # noqa: F401
from .topk import beam_search_step, log_softmax, topk  # noqa: F401
