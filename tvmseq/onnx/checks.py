"""Checks of what a model or its caller hands the importer, each failing with one line that names the
node (or the option) and what is wrong.

At import: the importer options (`check_options`), `hidden_size` against R (`checked_hidden_size`),
constant `sequence_lens` and TopK `K`. At run time, for values computed in the graph (a `Cast`, shape
arithmetic, another node's output), `emit_checked_copy` compiles the check into the model: the values'
range reaches the host (`tensor_to_shape`, the way TVM's own dynamic shapes do), a small TIR function
asserts it there and copies the tensor through, so the kernel that reads the copy cannot run first and
Relax cannot drop the check as unused. The assert's error kind is "TvmseqError": `tvmseq.runtime`
registers that name with TVM's FFI, so the VM raises `tvmseq.TvmseqError` with the one-line message.
(Graph inputs are checked on the host by `tvmseq.runtime` before the model runs: `importer.add_input_check`.)
"""
from __future__ import annotations

import difflib

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.script import tirx as T

from ..errors import TvmseqError, UnsupportedOnnxError

# the error kind run-time asserts raise; tvmseq.runtime maps it to TvmseqError
ERROR_KIND = "TvmseqError"
_COPY_THREADS = 256


# ---------------------------------------------------------------------------------------------------
# importer options
# ---------------------------------------------------------------------------------------------------
# read by the importer without a module constant (from_onnx; gru.recurrence_path_option)
_OPTIONS_WITHOUT_CONSTANT = {"artifacts", "recurrence"}
# set by from_onnx itself, never by a caller
_INTERNAL_OPTIONS = {"artifacts_root", "input_checks", "target"}


def importer_option_names() -> set[str]:
    """Every option `tvmseq.onnx.from_onnx` (and so `compile_onnx`) passes on to the importer: the
    `*_OPTION` string constants of tvmseq.onnx's modules (each module that reads an option names it
    so), plus `_OPTIONS_WITHOUT_CONSTANT`."""
    import sys

    from .. import onnx as _package   # noqa: F401  (imports every converter module)

    names = set(_OPTIONS_WITHOUT_CONSTANT)
    for name, module in list(sys.modules.items()):
        if name.startswith("tvmseq.onnx.") and module is not None:
            names.update(value for key, value in vars(module).items()
                         if key.endswith("_OPTION") and isinstance(value, str))
    return names - _INTERNAL_OPTIONS


def _compile_option_names() -> set[str]:
    """compile_onnx's own named arguments (they never reach the importer; named in suggestions)."""
    import inspect

    from ..build import compile_onnx

    return {name for name, p in inspect.signature(compile_onnx).parameters.items()
            if name != "model" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def check_options(options: dict) -> None:
    """TvmseqError (one line) for an option name no part of the importer reads: a misspelled option
    would otherwise be ignored without notice."""
    valid = importer_option_names()
    unknown = sorted(set(options) - valid)
    if not unknown:
        return
    name = unknown[0]
    if name in _compile_option_names():
        raise TvmseqError(f"option {name!r} belongs to compile_onnx (it changes the model before import or the "
                          f"build), not to from_onnx; from_onnx's options: {', '.join(sorted(valid))}")
    close = difflib.get_close_matches(name, sorted(valid | _compile_option_names()), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TvmseqError(f"unknown option {name!r}{hint}; the importer's options: {', '.join(sorted(valid))} "
                      f"(compile_onnx's own: {', '.join(sorted(_compile_option_names()))})")


# ---------------------------------------------------------------------------------------------------
# recurrent nodes: hidden_size
# ---------------------------------------------------------------------------------------------------
def checked_hidden_size(attr, r_dims: list[int], node: str, op: str) -> int:
    """The hidden size of a GRU/RNN/LSTM node: attribute `hidden_size` when given, else R's last dim;
    positive, and equal to R's last dim."""
    if len(r_dims) != 3:
        raise UnsupportedOnnxError(node, op, f"input 'R' must have rank 3 [num_directions, gates * hidden_size, "
                                             f"hidden_size], got shape {r_dims}")
    if "hidden_size" not in attr:
        hidden = r_dims[2]
    else:
        hidden = attr["hidden_size"]
        if isinstance(hidden, (bool, float)) or not isinstance(hidden, (int, np.integer)):
            raise UnsupportedOnnxError(node, op, f"attribute 'hidden_size' = {hidden!r} must be an integer")
        hidden = int(hidden)
    if hidden <= 0:
        raise UnsupportedOnnxError(node, op, f"attribute 'hidden_size' = {hidden} must be positive"
                                   if "hidden_size" in attr else f"input 'R' has shape {r_dims}: hidden size "
                                                                 f"{hidden} must be positive")
    if hidden != r_dims[2]:
        raise UnsupportedOnnxError(node, op, f"attribute 'hidden_size' = {hidden} does not match input 'R' of "
                                             f"shape {r_dims} (its last dim is the hidden size)")
    return hidden


# ---------------------------------------------------------------------------------------------------
# sequence_lens
# ---------------------------------------------------------------------------------------------------
def _is_integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def checked_lengths(bb, attr, lens, seq, node: str, op: str):
    """`sequence_lens` of a GRU/RNN/LSTM or ReverseSequence node as int32, its values refused outside [0, seq] as
    onnxruntime refuses them: a non-integer dtype and constants at import, values computed in the graph
    at run time, a graph input on the host before the model runs (`importer.add_input_check`)."""
    from .gru import _dim_str
    from .importer import add_input_check

    dtype = str(lens.ty.dtype)
    if not _is_integer(dtype):
        raise UnsupportedOnnxError(node, op, f"input 'sequence_lens' has dtype {dtype}; it must be int32 "
                                             "(lengths are not truncated from other types)")
    if isinstance(lens, relax.Var):
        add_input_check(attr, lens.name, {"kind": "range", "min": 0, "max": _dim_str(seq),
                                          "what": f"sequence_lens of {op} node '{node}'"})
    where = f"ONNX node '{node}' ({op}): input 'sequence_lens'"
    static_seq = int(seq) if isinstance(seq, (int, tirx.IntImm)) else None
    if isinstance(lens, tvm.ir.GenericConst):
        values = lens.value.numpy().astype(np.int64)
        bad = values[(values < 0) | (values > (static_seq if static_seq is not None else np.inf))]
        if bad.size:
            raise UnsupportedOnnxError(node, op, f"constant input 'sequence_lens' holds {int(bad[0])}, outside "
                                                 f"[0, {static_seq if static_seq is not None else 'seq_length'}]")
        if static_seq is None and values.size:      # the longest against the length X has at run time
            # (the range is read at run time although known: with constant bounds the check could land
            # in a CUDA graph's captured region, and an error raised while capturing breaks the stream)
            lo, hi = emit_value_range(bb, lens)
            lens = emit_checked_copy(bb, attr, lens, lo, hi, seq,
                                     f"{where} holds {int(values.max())}, more than X's sequence length")
    elif not isinstance(lens, relax.Var):   # (a graph input: checked on the host, above)
        lo, hi = emit_value_range(bb, lens)
        lens = emit_checked_copy(bb, attr, lens, lo, hi, seq,
                                 f"{where} (computed in the graph) has values outside [0, X's sequence length]; "
                                 "onnxruntime refuses them too")
    return bb.emit(relax.op.astype(lens, "int32"))


# ---------------------------------------------------------------------------------------------------
# TopK K
# ---------------------------------------------------------------------------------------------------
def checked_topk_k(bb, attr, k1, n: int, node: str):
    """K of a TopK node (a 1-element int64 tensor computed in the graph) as a symbolic dim, refused at
    run time outside [0, n] (before the kernel runs, naming the node)."""
    k_raw = emit_value_range(bb, k1)[0]
    k1 = emit_checked_copy(bb, attr, k1, k_raw, k_raw, tirx.const(n, "int64"),
                           f"ONNX node '{node}' (TopK): input 'K' (computed in the graph) is outside [0, {n}], "
                           "the size of the selected axis")
    return emit_shape_values(bb, k1, "topk_k")[0]


# ---------------------------------------------------------------------------------------------------
# run-time checks in the graph
# ---------------------------------------------------------------------------------------------------
def emit_shape_values(bb, tensor, hint: str) -> list:
    """The values of a 1-D int64 tensor of static length as symbolic dims bound at run time (read on the
    host: one device-to-host copy on a GPU)."""
    count = int(tensor.ty.shape.values[0])
    dims = [tirx.Var(f"{hint}_{len(bb.get().functions)}_{i}", "int64") for i in range(count)]
    bb.match_cast(bb.emit(relax.op.tensor_to_shape(tensor)), relax.ShapeType(dims))
    return dims


def emit_value_range(bb, values) -> tuple:
    """(min, max) of an integer tensor as symbolic dims bound at run time."""
    flat = values if values.ty.ndim == 1 else bb.emit(relax.op.reshape(values, [-1]))
    ends = [bb.emit(relax.op.astype(reduce(flat, axis=0, keepdims=True), "int64"))
            for reduce in (relax.op.min, relax.op.max)]
    return tuple(emit_shape_values(bb, bb.emit(relax.op.concat(ends, 0)), "range"))


def emit_checked_copy(bb, attr, tensor, lo, hi, bound, message: str):
    """A copy of the 1-D `tensor`, made only after asserting 0 <= lo and hi <= bound on the host (lo, hi,
    bound: PrimExprs known on the host at run time); the assert raises TvmseqError(message)."""
    target = attr["tvm_custom"]["importer_options"]["target"]
    dtype = str(tensor.ty.dtype)
    gpu = target.kind.name == "cuda"
    # without its global symbol: a model with two checked copies would hold two functions of one symbol
    gv = bb.add_func(_checked_copy_func(dtype, message, gpu).without_attr("global_symbol"), "tvmseq_checked_copy")
    args = [tensor, relax.prim_value(_int64(lo)), relax.prim_value(_int64(hi)), relax.prim_value(_int64(bound))]
    return bb.emit(relax.call_tir(gv, args, relax.TensorType(tensor.ty.shape.values, dtype)))


# the kernels (projections, recurrences, stacks) index their tensors in 32 bits; the tests of the checks below lower it
INDEX_LIMIT = 1 << 31


def index_limit_check(what: str, unit_values: int, unit: str):
    """T.macro(n): the host check a kernel whose tensors are indexed in 32 bits runs before it: n units (rows,
    steps) of `unit_values` values each must stay under INDEX_LIMIT (2^31, read when the check is built); else one
    line naming `what` and the most units that fit."""
    max_units = (INDEX_LIMIT - 1) // unit_values
    message = (f"{what}: {unit_values} values a {unit} and its kernels index in 32 bits: at most {max_units} "
               f"{unit}s; run the sequence in shorter pieces")

    @T.macro
    def check(n):
        assert n <= max_units, (ERROR_KIND, [message])

    return check


def _int64(expr):
    """Shape dims and the vars bound here are int64 already; Python ints become int64 constants."""
    return tirx.const(expr, "int64") if isinstance(expr, int) else expr


def _checked_copy_func(dtype: str, message: str, gpu: bool):
    """prim_func(src [n], lo, hi, bound, dst [n]): assert (kind TvmseqError) on the host, then dst = src
    (a kernel on a GPU)."""
    TT = _COPY_THREADS

    @T.prim_func
    def checked_copy_cpu(src_h: T.handle, lo: T.int64, hi: T.int64, bound: T.int64, dst_h: T.handle):
        n = T.int64()
        src = T.match_buffer(src_h, (n,), dtype)
        dst = T.match_buffer(dst_h, (n,), dtype)
        assert lo >= T.int64(0) and hi <= bound, (ERROR_KIND, [message])
        for i in range(n):
            dst[i] = src[i]

    @T.prim_func
    def checked_copy_gpu(src_h: T.handle, lo: T.int64, hi: T.int64, bound: T.int64, dst_h: T.handle):
        n = T.int64()
        src = T.match_buffer(src_h, (n,), dtype)
        dst = T.match_buffer(dst_h, (n,), dtype)
        assert lo >= T.int64(0) and hi <= bound, (ERROR_KIND, [message])
        for b in T.thread_binding(T.max((n + TT - 1) // TT, T.int64(1)), thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(TT), thread="threadIdx.x"):
                if b * TT + t < n:
                    dst[b * TT + t] = src[b * TT + t]

    func = checked_copy_gpu if gpu else checked_copy_cpu
    # a root block around the body: Relax's RewriteDataflowReshape expects one in every call_tir callee
    body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", func.body))
    # opaque (op_pattern 8): FuseOps must not merge the host-side assert into a neighbouring kernel
    return func.with_body(body).with_attrs({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
