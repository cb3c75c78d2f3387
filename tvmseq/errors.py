"""One exception type for every user-facing error, so callers and the CLI can catch it in one place."""


class TvmseqError(ValueError):
    """Bad input (tensor, file, model, attribute) detected before any kernel runs."""


class UnsupportedOnnxError(TvmseqError):
    """An ONNX node, attribute value or input form tvmseq does not support."""

    def __init__(self, node_name: str, op_type: str, what: str):
        super().__init__(f"ONNX node '{node_name}' ({op_type}): {what}")
        self.node_name, self.op_type = node_name, op_type


class ArtifactWarning(UserWarning):
    """An artifact could not be used (the caller falls back to compiling)."""


class ArtifactError(TvmseqError):
    """Why one artifact cannot be used (or CUDA device code cannot be built or loaded here);
    `artifacts.find_kernel` turns it into an ArtifactWarning."""
