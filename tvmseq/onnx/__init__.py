"""tvmseq's ONNX importer: TVM's Relax ONNX frontend plus converters for GRU, RNN, TopK, sparse MatMul."""
from .importer import CONVERTERS, from_onnx, load_model, register_converter  # noqa: F401
from . import gru, rnn, sparse, stack, topk  # noqa: F401,E402  (registers converters)
