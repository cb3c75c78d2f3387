"""Softmax kernels (the CPU path of relax.nn.softmax over the last axis)."""
