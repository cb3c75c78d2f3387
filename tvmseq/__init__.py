"""tvmseq: GPU kernels for sequence models in Apache TVM TensorIR, with an ONNX importer.

Pipeline: kernels/ (compute + default schedules, one package per kernel family; schedule_gpu / schedule_cpu for
the stock ops) -> tune/ (timing on the GPU: measure) -> build / prebuild (device code: cuda_toolchain; prebuilt
kernels: artifacts) -> runtime (load) -> onnx/ (import).
"""
from .errors import TvmseqError, UnsupportedOnnxError

__version__ = "0.1.0"


def from_onnx(model, shape_dict=None, dtype_dict=None, target=None, **options):
    """ONNX model (proto, path or bytes) -> Relax IRModule with tvmseq kernels inserted."""
    from .onnx import from_onnx as _from_onnx

    return _from_onnx(model, shape_dict, dtype_dict, target=target, **options)


def compile_onnx(model, target=None, shape_dict=None, dtype_dict=None, **options):
    """ONNX model -> compiled `tvmseq.runtime.Model` (call it with numpy or DLPack tensors)."""
    from .build import compile_onnx as _compile

    return _compile(model, target=target, shape_dict=shape_dict, dtype_dict=dtype_dict, **options)


def load(path, device=None, weights=None, cuda_graph=None):
    """Load a model `.so` exported by `tvmseq compile` (no compiler needed; its size and sha256 are
    checked against its `.so.json` first). `weights`: for a model compiled with weights="inputs";
    `cuda_graph=True`: capture each call whole once per input shape and replay it (CUDA models)."""
    from .runtime import load_model

    return load_model(path, device=device, weights=weights, cuda_graph=cuda_graph)


_SUBMODULES = ("reference", "sparse", "artifacts", "cuda_toolchain", "build", "runtime", "targets", "beam", "models")


def __getattr__(name):
    # tvmseq.Stream without importing TVM's runtime at `import tvmseq`
    if name == "Stream":
        from .stream import Stream

        return Stream
    if name in _SUBMODULES:   # tvmseq.reference.gru(...) etc. after a plain `import tvmseq`, imported on first use
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tvmseq' has no attribute {name!r}")


def beam_search_step(logits, beam_scores, beam, k=None, target=None):
    """One fused beam-search step: log-softmax(logits) + beam scores, top-k over beam x vocab.
    Returns (scores, beam ids, token ids); see tvmseq.beam."""
    from .beam import beam_search_step as _step

    return _step(logits, beam_scores, beam, k=k, target=target)
