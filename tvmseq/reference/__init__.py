"""Numpy references that follow the ONNX operator specs exactly (float64 inside).
Every kernel in tvmseq is tested against these."""
from .recurrent import recurrent_gemm  # noqa: F401
from .rnn import gru, rnn  # noqa: F401
