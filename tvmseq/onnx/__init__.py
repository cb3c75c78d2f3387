"""tvmseq's ONNX importer: TVM's Relax ONNX frontend plus converters for GRU, RNN, TopK, sparse MatMul."""
from .importer import CONVERTERS, from_onnx, load_model, register_converter  # noqa: F401
from . import gru, lstm, rnn, sparse, stack, topk  # noqa: F401,E402  (registers converters)
from . import conv  # noqa: F401,E402  (Conv: group convolutions routed around TVM's CUDA schedules)
from . import shape_ops  # noqa: F401,E402  (Pad with computed pads, Squeeze of symbolic axes, Slice of opset < 10)
from . import resize  # noqa: F401,E402  (Upsample, Resize of opset 10: scales, asymmetric)
from . import scatter  # noqa: F401,E402  (ScatterND: one thread an updated element on a GPU)
from . import quantized  # noqa: F401,E402  (int8 dynamic quantization: DynamicQuantizeLSTM, ConvInteger, ...)
from . import contrib  # noqa: F401,E402  (onnxruntime's fused ops: FusedConv, FusedMatMul)
from . import dft  # noqa: F401,E402  (DFT as matmuls with constant cosine / sine matrices)
from . import batch_dispatch, expose_state  # noqa: F401,E402  (their *_OPTION names: checks.importer_option_names)
