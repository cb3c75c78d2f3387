"""Integer contractions on the CPU (ConvInteger / MatMulInteger after tvmseq.onnx.quantized)."""
