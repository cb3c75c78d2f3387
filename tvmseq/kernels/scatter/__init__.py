"""Scatter kernels (ONNX ScatterND)."""
