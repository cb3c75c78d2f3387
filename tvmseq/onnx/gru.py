"""ONNX GRU (opsets 1-22) -> tvmseq GRU kernels (input-projection GEMM + recurrence) via call_tir."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tvm
from tvm import relax, tirx

from ..errors import TvmseqError, UnsupportedOnnxError
from ..kernels.activations import parse_onnx_activations
from ..kernels.recurrent import gru as gru_kernels
from .importer import OnnxOpConverter, register_converter

# output_sequence (opset 1 only) merely says whether Y is wanted; tvmseq always computes Y
_SUPPORTED_ATTRS = {"hidden_size", "direction", "linear_before_reset", "layout", "clip", "activations",
                    "activation_alpha", "activation_beta", "output_sequence"}


def _static_dims(expr, what, node, op="GRU"):
    shape = expr.ty.shape
    if shape is None:
        raise UnsupportedOnnxError(node, op, f"input '{what}' has unknown rank")
    return list(shape.values)


def _int(dim, what, node, op="GRU") -> int:
    if not isinstance(dim, tirx.IntImm):
        raise UnsupportedOnnxError(node, op, f"{what} must be static, got symbolic {dim} "
                                             "(pass --shape to fix it)")
    return int(dim)


RECURRENCE_PATHS = ("auto", "persistent", "persistent_mma", "persistent_wgmma", "per_step", "one_step")


def is_static(dim) -> bool:
    return isinstance(dim, (int, tirx.IntImm))


def spec_batch(batch):
    """A prepared batch (`prepare_common`'s c["batch"]: an int, or a symbolic relax dim) as a kernel spec's
    batch: the int, or None (the per-step kernels then take any batch)."""
    return int(batch) if is_static(batch) else None


def zeros(shape, dtype: str):
    """A zero tensor of `shape` (ints and symbolic dims): a constant when every dim is static."""
    if all(is_static(d) for d in shape):
        return relax.const(np.zeros([int(d) for d in shape], dtype))
    return relax.op.zeros(relax.ShapeExpr(list(shape)), dtype)


def recurrent_key(sizes: dict, dtype, attrs: dict | None = None, dynamic=("seq",)) -> "KernelKey":
    """The KernelKey of a recurrent kernel: a symbolic "batch" entry of `sizes` moves to the dynamic sizes
    (a kernel built for any batch)."""
    from .importer import KernelKey

    static = {k: v for k, v in sizes.items() if is_static(v)}
    dyn = tuple(dynamic) + tuple(k for k in sizes if k not in static)
    return KernelKey({k: int(v) for k, v in static.items()}, dtype, attrs or {}, dyn)


def _same_dim(a, b) -> bool:
    """Whether two dims may be the same batch: equal ints, or two symbolic dims (ONNX names them freely;
    the kernels check the tensors' shapes against each other when they run)."""
    if is_static(a) and is_static(b):
        return int(a) == int(b)
    return not is_static(a) and not is_static(b)


def match_state_shape(bb, state, want: list, name: str, node: str, op: str):
    """An initial state (initial_h, initial_c) of shape `want` (ints and X's batch dim): itself where its shape
    is known to agree, a run-time checked cast where some of its dims are computed in the graph (an exporter's
    Tile or Expand of a shape) and may agree, a one-line error where a dim is known to differ."""
    dims = _static_dims(state, name, node, op)
    agree = len(dims) == len(want) and all(_same_dim(g, w) for g, w in zip(dims, want))
    may_agree = len(dims) == len(want) and all(not (is_static(g) and is_static(w)) or int(g) == int(w)
                                               for g, w in zip(dims, want))
    if not may_agree:
        raise UnsupportedOnnxError(node, op, f"input '{name}' has shape {[_dim_str(d) for d in dims]}, "
                                             f"expected {[_dim_str(d) for d in want]}")
    if agree:
        return state
    return bb.match_cast(state, relax.TensorType(list(want), state.ty.dtype))


@functools.lru_cache(maxsize=64)
def build_kernels(spec, target_json: str, path: str = "auto"):
    """(recurrence, path) for a GruSpec or an RnnSpec, built once per spec/target/path. path 'auto': the
    persistent kernel (weights on chip, one launch for all steps) on a GPU when the weights fit and the batch
    is one where it was measured faster, else the per-step kernels (`paths.choose_path`); on a CPU
    always the per-step kernels. Any batch (spec.batch None): the per-step kernels (the persistent ones are
    built for one batch)."""
    from ..kernels.recurrent import paths

    if spec.batch is None:
        if path not in ("auto", "per_step"):
            raise TvmseqError(f"recurrence path {path!r} needs a static batch; this node's batch is symbolic "
                              "(use 'auto' or 'per_step', or pin the batch with --shape)")
        return _cell_kernels(spec).recurrence_func(spec, tvm.target.Target(target_json)), "per_step"
    rec, path, _why = paths.recurrence_func_auto(spec, tvm.target.Target(target_json), path=path)
    return rec, path


@functools.lru_cache(maxsize=64)
def projection_kernel(spec, target_json: str, seq=None):
    """`projection.gemm.projection_for`, built once per spec/target/length (an int when static, else None):
    (prim_func, row tile or None)."""
    from ..kernels.projection import gemm as ip

    return ip.projection_for(spec, tvm.target.Target(target_json), seq)


@functools.lru_cache(maxsize=64)
def packed_projection_kernel(spec, target_json: str):
    """The CPU projection on W packed by the importer (`cpu_projection_func(..., packed_w=True)`), once per spec."""
    from ..kernels.projection import gemm as ip

    return ip.cpu_projection_func(spec, tvm.target.Target(target_json), packed_w=True)


def packed_constant(weight, panels):
    """A constant weight (an ONNX initializer) packed into `panels` (`step_gemm.Panels`) once, here, as a new
    constant; None where there are no panels or the weight is a graph tensor (the kernel then packs it)."""
    if panels is None:
        return None
    value = constant_value(weight)
    return None if value is None else relax.const(panels.pack(value))


def _cell_kernels(spec):
    """The kernel module (`kernels.recurrent.gru`, `rnn` or `lstm`) of a GruSpec, RnnSpec or LstmSpec."""
    from ..kernels.recurrent import lstm, rnn

    return lstm if isinstance(spec, lstm.LstmSpec) else rnn if isinstance(spec, rnn.RnnSpec) else gru_kernels


@functools.lru_cache(maxsize=64)
def _packed_r_recurrence(spec, target_json: str):
    return _cell_kernels(spec).recurrence_func(spec, tvm.target.Target(target_json), packed_r=True)


def with_packed_r(spec, r, rec, attrs: dict, target) -> tuple:
    """(R, recurrence, kernel key attrs) of a node's recurrence call (attrs holding its path): for a CPU per-step
    GRU/RNN/LSTM whose R is a constant and whose kernel would pack R itself (`r_panels`), R packed here once and the
    recurrence that takes it (attrs + packed_r); else as given (R packed in each long call)."""
    target = tvm.target.Target(str(target))
    if attrs["path"] != "per_step" or target.kind.name == "cuda":
        return r, rec, attrs
    panels = _cell_kernels(spec).r_panels(spec, target)
    # a kernel built for packed R steps on panels in every call, where the one that packs for itself keeps R as
    # stored in short calls. A GRU step at batch 1 was slower on panels (hidden 400, 37 steps: 0.435 against 0.395
    # ms, 2-core Zen 4): GRU / RNN / an unfused LSTM take packed R from a static batch of 2; an LSTM whose gate
    # math fuses into the panel tiles (interleaved panels) at any batch (hidden 256-1024 at batch 1: 0.9-0.8x the time)
    fused = panels is not None and panels.interleave is not None
    r_packed = packed_constant(r, panels) if fused or (isinstance(spec.batch, int) and spec.batch >= 2) else None
    if r_packed is None:
        return r, rec, attrs
    return r_packed, _packed_r_recurrence(spec, str(target)), {**attrs, "packed_r": True}


# seq * batch (both static) at or below which a GPU input projection is a stock matmul: dlight's GEMV rule
# takes it in ~4 us on the H100 where the row-tiled kernel, shaped for many rows, took ~40 us for one frame
# of a hidden-400 GRU (ncu, 2026-11-26): what a one-frame streaming build runs
GEMV_MAX_ROWS = 4


def _gemv_projection(bb, c, bias_i, D: int, G: int, seq, B, I: int, rows_out: bool = False):
    """gate_i [D, seq, B, G] (float32) = X W^T + bias_i as Relax ops, for a frame or a few rows (`rows_out`: as
    [D, seq * B, G] rows, see `_projection_by_rows`)."""
    x = bb.emit(relax.op.reshape(c["x"], [seq * B, I]))
    w = c["w"]
    if c["dtype"] != "float32":
        x, w = bb.emit(relax.op.astype(x, "float32")), bb.emit(relax.op.astype(w, "float32"))
    # W as ONNX stores it (rows of I contiguous): the GEMV reduction reads it in order, and no transpose of W
    # runs per call when the weights are inputs of the model
    rows = bb.emit(relax.op.einsum([x, w], "rk,dgk->drg"))                           # [D, rows, G]
    bias = bias_i if bias_i.ty.dtype == "float32" else bb.emit(relax.op.astype(bias_i, "float32"))
    rows = bb.emit(relax.op.add(rows, relax.op.reshape(bias, [D, 1, G])))
    return rows if rows_out else bb.emit(relax.op.reshape(rows, [D, seq, B, G]))


def emit_input_projection(bb, cell: str, spec, c, bias_i, target):
    """gate_i [D, seq, B, gates * H] (float32) = X W^T + bias_i for a prepared GRU/RNN input `c` (a prebuilt
    artifact when one matches, see `importer.emit_kernel`). With a row tile: X's rows are padded to whole
    tiles by `pad_rows`, projected as a [tiles, tile] batch, and the valid rows sliced back; with FLAT (fp16
    on tensor cores) X is viewed as [seq * B, I] rows."""
    from ..kernels.projection import gemm as ip
    from .importer import KernelKey, emit_kernel

    D, B, H, seq, I = spec.num_directions, c["batch"], c["hidden"], c["seq"], c["input_size"]
    G = spec.gates * H
    suffix = c.get("suffix", "")   # a batch bucket's kernels (batch_dispatch): named apart
    static_seq = int(seq) if isinstance(seq, (int, tirx.IntImm)) else None
    if static_seq is not None and is_static(B) and static_seq * int(B) <= GEMV_MAX_ROWS and \
            tvm.target.Target(str(target)).kind.name == "cuda":
        return _gemv_projection(bb, c, bias_i, D, G, seq, B, I)
    proj, tile = projection_kernel(spec, str(target), static_seq)
    if tile == ip.TF32X3:   # float32 on tf32 tensor cores: few rows of a length known at run time stay stock
        def split_projection(c_, bias_, rows_out=False, row_tile=None):
            kernel = proj if row_tile is None else ip.tf32x3_tile_projection(spec, row_tile)
            return _tf32x3_projection(bb, cell, spec, c_, bias_, kernel, target, rows_out, row_tile)
        if constant_value(c["w"]) is None:   # a graph-input W split here, in `main`: lifted to load time
            c = dict(c, ws=_tf32x3_weight(bb, cell, spec, c, target))
        if static_seq is None:   # the tile by the run-time row count (`tf32x3_row_ranges`)
            from ..kernels import recurrent_gemm as rg

            ranges = ip.tf32x3_row_ranges(G, rg.gpu_facts(tvm.target.Target(str(target))).num_sms)
            by_rows = [(start, lambda c_, b_, t=t: split_projection(c_, b_, True, None if t == ip.TF32X3_TILE else t))
                       for start, t in ranges]
            dispatched = _projection_by_rows(bb, cell, c, bias_i, D, G, int(B), I, by_rows, rows_out=True)
            if dispatched is not None:
                return dispatched
        return split_projection(c, bias_i)
    if tile == ip.FLAT:   # tensor cores (GPU) or SIMD (CPU), on the seq * B rows as one matrix
        sizes = {"directions": D, "hidden": H, "input_size": I, "gates": spec.gates}
        x_rows = bb.emit(relax.op.reshape(c["x"], [seq * B, I]))
        op = f"{cell}_input_projection_flat"
        w, attrs, make = c["w"], {}, lambda: proj
        tgt = tvm.target.Target(str(target))
        w_packed = None if tgt.kind.name == "cuda" else packed_constant(c["w"], ip.w_panels(spec, tgt))
        if w_packed is not None:   # CPU: W packed into the panel GEMM's layout here, never in a call
            w, attrs, make = w_packed, {"packed_w": True}, lambda: packed_projection_kernel(spec, str(target))
        g_rows = emit_kernel(bb, op, KernelKey(sizes, c["dtype"], attrs, dynamic=("rows",)), make,
                             [x_rows, w, bias_i], relax.TensorType([D, seq * B, G], "float32"),
                             name_hint=op + suffix)
        return bb.emit(relax.op.reshape(g_rows, [D, seq, B, G]))
    if tile and STOCK_PROJECTION_MAX_ROWS > 0 and static_seq is None and is_static(B) and \
            tvm.target.Target(str(target)).kind.name == "cuda":
        # the length is known at run time only: few rows go to the stock matmul, many to the row-tiled kernel
        dispatched = _projection_by_rows(bb, cell, c, bias_i, D, G, int(B), I,
                                         lambda c_, b_: _tiled_projection(bb, cell, spec, c_, b_, target, proj, tile))
        if dispatched is not None:
            return dispatched
    return _tiled_projection(bb, cell, spec, c, bias_i, target, proj, tile)


@functools.lru_cache(maxsize=16)
def _split_kernel(K: int, Kp: int, target_json: str, row_values: int | None = None, what: str = ""):
    from ..kernels.projection import tf32x3

    return tf32x3.scheduled_split_func(K, Kp, tvm.target.Target(target_json), row_values, what)


def _tf32x3_weight(bb, cell: str, spec, c, target):
    """W [D, G, I] split into its tf32 parts, rows zero-padded to whole tiles and k to whole k steps: [2, D, Np, Kp].
    A constant W: split here, once. A graph-input W: by the split kernel, emitted where the caller is (in `main`,
    a computation of the weights alone: the build lifts it out of the call, `build.lift_weight_transforms`)."""
    from ..kernels.projection import gemm as ip
    from ..kernels.projection import tf32x3

    D, H, I = spec.num_directions, c["hidden"], c["input_size"]
    G, Kp = spec.gates * H, ip.tf32x3_k(I)
    Np = ip.tf32x3_n(G)   # W's rows zero-padded to whole tiles
    w_value = constant_value(c["w"])
    if w_value is not None:
        return relax.const(tf32x3.split_weight(w_value, Np, Kp))
    split = bb.add_func(_split_kernel(I, Kp, str(target)).without_attr("global_symbol"), f"{cell}_tf32x3_split")
    w = as_float32(bb, c["w"])
    if Np != G:
        w = bb.emit(relax.op.nn.pad(w, [0, 0, 0, Np - G, 0, 0]))
    w_rows = bb.emit(relax.op.reshape(w, [D * Np, I]))
    ws = bb.emit(relax.call_tir(split, [w_rows], relax.TensorType([2, D * Np, Kp], "float32")))
    return bb.emit(relax.op.reshape(ws, [2, D, Np, Kp]))


def _tf32x3_projection(bb, cell: str, spec, c, bias_i, proj, target, rows_out: bool = False, row_tile=None):
    """gate_i [D, seq, B, G] from the tf32x3 projection `proj`: X's rows split into tf32 parts (and zero-padded
    to whole k steps) by a kernel before it (c["split_x"](Kp, row_values, what) where the caller makes them: the
    split [2, seq * B, Kp]); W split by `_tf32x3_weight` (c["ws"] where the caller did).
    `rows_out`: as the kernel's [D, seq * B, G] rows (see `_projection_by_rows`); `row_tile`: the tile of `proj`
    where it is not the rule's default (a narrower one for few rows), named in its kernel key."""
    from ..kernels.projection import gemm as ip
    from .importer import KernelKey, emit_kernel

    D, B, H, seq, I = spec.num_directions, c["batch"], c["hidden"], c["seq"], c["input_size"]
    G, Kp = spec.gates * H, ip.tf32x3_k(I)
    # X's split checks the row count: the split parts hold 2 Kp values a row, gate_i (and the recurrence's view of
    # it) D x G
    what = f"ONNX node '{c['node']}' ({c['op']})" if c.get("node") else f"the {cell} input projection"
    if c.get("split_x") is not None:   # X's rows made and split by the caller's kernel (a Conv's im2col rows)
        xs = c["split_x"](Kp, max(2 * Kp, D * G), what)
    else:
        split = bb.add_func(_split_kernel(I, Kp, str(target), max(2 * Kp, D * G), what)
                            .without_attr("global_symbol"), f"{cell}_tf32x3_split")
        x_rows = bb.emit(relax.op.reshape(as_float32(bb, c["x"]), [seq * B, I]))
        xs = bb.emit(relax.call_tir(split, [x_rows], relax.TensorType([2, seq * B, Kp], "float32")))
    ws = c["ws"] if c.get("ws") is not None else _tf32x3_weight(bb, cell, spec, c, target)
    sizes = {"directions": D, "hidden": H, "input_size": I, "gates": spec.gates}
    op = f"{cell}_input_projection_tf32x3"
    attrs = {} if row_tile is None else {"tile_bn": row_tile.bn, "stages": row_tile.stages}
    g_rows = emit_kernel(bb, op, KernelKey(sizes, "float32", attrs, dynamic=("rows",)), lambda: proj,
                         [xs, ws, bias_i], relax.TensorType([D, seq * B, G], "float32"),
                         name_hint=op + (f"_n{row_tile.bn}" if row_tile else "") + c.get("suffix", ""))
    return g_rows if rows_out else bb.emit(relax.op.reshape(g_rows, [D, seq, B, G]))


# GPU, float32, a length known at run time: up to this many rows (seq x batch) the input projection is a stock
# matmul (`_gemv_projection`, scheduled by schedule_gpu.Matmul's 16 x 64 x 32 tile), from there the row-tiled
# kernel; 0 turns the choice off. Measured before on whole models with one form everywhere (H100, ms a call): the
# stock form faster at 100 rows (ASR 1.011 -> 0.844), slower from ~800 (ASR batch 8 100 frames 2.00 -> 2.64, 1000
# rows 6.28 -> 7.25). With the choice, both builds in one run each, two runs (2026-11-27, README): batch 1, 100
# frames denoiser 0.330 -> 0.314, VAD 0.148 -> 0.142, CRNN 0.394 -> 0.369, ASR 1.016 -> 0.900; many rows level
# (+-1%) except the ASR at batch 8 (2 directions, 800-8000 rows: +1.5 / +2.5%). With the float32 projection on
# 64-row tf32x3 blocks, three products a k step (2026-11-29, H200, CUDA graph, batch 1, two runs of each build,
# `artifacts/bench/model_stock_rows_2026-11-29.json`), every row count to the tf32x3 kernel against stock up to 256,
# ms at 10 / 30 / 100 frames: ASR 0.209 / 0.302 / 0.623-0.630 against 0.267 / 0.361 / 0.778-0.782, denoiser 0.103-
# 0.124 / 0.140 / 0.269 against 0.113-0.131 / 0.150-0.151 / 0.285-0.288, CRNN level (0.145 / 0.182 / 0.311-0.316
# against 0.149 / 0.185 / 0.317); the VAD's two small products (K 128-208) moved 0.08-0.18 ms between runs either
# way, 16.6 against 14.9 us of GPU time under ncu at 100 frames. Up to 8 rows (a streaming call of a few frames to a
# model built for any count) the stock form stays: not measured against tf32x3 there, whose 64-row block does the
# same work for 1 row as for 64.
STOCK_PROJECTION_MAX_ROWS = 8


def _projection_by_rows(bb, cell: str, c, bias_i, D: int, G: int, B: int, I: int, tiled, rows_out: bool = False):
    """gate_i through a run-time choice on the row count seq x B (X [seq, B, I] with seq symbolic): a function
    `<cell>_projection_by_rows` whose body is If(seq * B <= STOCK_PROJECTION_MAX_ROWS) calling a function of the
    stock matmul, else one of `tiled(c, bias_i)`; `tiled` may also be [(from_rows, make), ...] (ascending, each
    `make(c, bias_i)` from that row count up to the next's), chosen by a chain of such functions (each branch a
    single call, as `batch_dispatch` builds them: TVM's memory planner mishandles storage made in an If's branch and
    used after it; a nested If in an else branch segfaulted on the H100). None where X's length is not
    its own dim (nothing emitted). The branches' bodies are dataflow blocks, where reshapes are views; a reshape
    whose result a function returns is still a copy, so with `rows_out` both branches (`tiled` too) return
    [D, seq * B, G] rows and the view to [D, seq, B, G] is taken here, in the caller's dataflow block (the ASR
    encoder at batch 8, 1000 frames: five copies of 98 MB, 0.74 ms of a 14.5 ms call, before)."""
    from . import batch_dispatch as bd

    tensors = {"x": bb.normalize(c["x"]), "w": bb.normalize(c["w"]), "bias_i": bb.normalize(bias_i)}
    if c.get("ws") is not None:   # W split for the tf32x3 branch (`_tf32x3_weight`)
        tensors["ws"] = bb.normalize(c["ws"])
    x_ty = tensors["x"].ty
    if not isinstance(x_ty, relax.TensorType) or x_ty.shape is None or len(x_ty.shape.values) != 3:
        return None
    seq = x_ty.shape.values[0]
    if not isinstance(seq, tirx.Var):   # a length computed from the inputs' (a CRNN's width // 4): its own var here
        tensors["x"] = bb.match_cast(tensors["x"], relax.TensorType([tirx.Var("frames", "int64"),
                                                                     *x_ty.shape.values[1:]], x_ty.dtype))
    if bd.own_dims(tensors) is None:
        return None
    # a constant W is a parameter of the branches, so the tiled one splits it in every call: as constants of both,
    # W and its split parts tripled the weights a model embeds (ddddocr-common's .so 55 -> 140 MB)
    tensors = bd.bound(bb, tensors)
    suffix = c.get("suffix", "")

    def branch(name, make):
        ps = bd.params(tensors)
        mine = dict(c, **dict(zip(tensors, ps)), seq=ps[0].ty.shape.values[0])
        return bd._function(bb, name, ps, lambda: make(mine, ps[2]), dataflow=True)

    stock = branch(f"{cell}_projection_stock{suffix}",
                   lambda c_, b_: _gemv_projection(bb, c_, b_, D, G, c_["seq"], B, I, rows_out))
    ranges = tiled if isinstance(tiled, list) else [(1, tiled)]
    # the stock matmul up to STOCK_PROJECTION_MAX_ROWS, then each tiled range not wholly below that
    first = STOCK_PROJECTION_MAX_ROWS + 1
    ranges = [(max(start, first), make) for k, (start, make) in enumerate(ranges)
              if k + 1 == len(ranges) or ranges[k + 1][0] > first]
    chain = [(first, stock)] + [(start, branch(f"{cell}_projection_tiled{'' if k == len(ranges) - 1 else k}{suffix}",
                                               make)) for k, (start, make) in enumerate(ranges)]

    def level(k):   # rows below chain[k + 1]'s start: chain[k]'s function, else the next level
        if k == len(chain) - 1:
            return chain[k][1]
        rest, ps = level(k + 1), bd.params(tensors)
        rows = ps[0].ty.shape.values[0] * B
        name = f"{cell}_projection_by_rows{'' if k == 0 else f'_from{chain[k][0]}'}{suffix}"
        return bd._function(bb, name, ps, lambda: relax.If(relax.prim_value(rows < chain[k + 1][0]),
                                                           relax.Call(chain[k][1], ps), relax.Call(rest, ps)))
    gate_i = bb.emit(relax.Call(level(0), list(tensors.values())))
    if rows_out:
        gate_i = bb.emit(relax.op.reshape(gate_i, [D, tensors["x"].ty.shape.values[0], B, G]))
    # typed with the node's own length again (the match_cast above gave X a var of its own)
    return gate_i if seq.same_as(tensors["x"].ty.shape.values[0]) else \
        bb.match_cast(gate_i, relax.TensorType([D, seq, B, G], "float32"))


def _tiled_projection(bb, cell: str, spec, c, bias_i, target, proj, tile):
    """gate_i from the batch-layout projection kernel (tile None) or the row-tiled one (X's rows padded to whole
    tiles, projected, the valid rows viewed / sliced back)."""
    from ..kernels.projection import gemm as ip
    from .importer import emit_kernel

    D, B, H, seq, I = spec.num_directions, c["batch"], c["hidden"], c["seq"], c["input_size"]
    G = spec.gates * H
    suffix = c.get("suffix", "")
    static_seq = int(seq) if isinstance(seq, (int, tirx.IntImm)) else None
    sizes = {"directions": D, "batch": tile or B, "hidden": H, "input_size": I, "gates": spec.gates}
    few = tile and ip.padded_rows_genes(spec, static_seq, target) is ip.FEW_BLOCKS_GENES
    key = recurrent_key(sizes, c["dtype"], {"genes": "few_blocks"} if few else {})
    op = f"{cell}_input_projection"
    if not tile:
        return emit_kernel(bb, op, key, lambda: proj, [c["x"], c["w"], bias_i],
                           relax.TensorType([D, seq, B, G], "float32"), name_hint=op + suffix)
    rows = seq * B
    tiles = (rows + tile - 1) // tile
    pad = ip.pad_rows_func(B, I, tile, c["dtype"]).without_attr("global_symbol")
    gv = bb.add_func(pad, f"{cell}_pad_rows{suffix}")
    x_tiles = bb.emit(relax.call_tir(gv, [c["x"]], relax.TensorType([tiles, tile, I], c["dtype"])))
    g_tiles = emit_kernel(bb, op, key, lambda: proj, [x_tiles, c["w"], bias_i],
                          relax.TensorType([D, tiles, tile, G], "float32"), name_hint=op + suffix)
    if D == 1:   # the valid rows are a prefix of the tiles: a view, no copy (0.08 us a step at B8 H1024)
        return bb.emit(relax.op.memory.view(g_tiles, [D, seq, B, G]))
    g_rows = bb.emit(relax.op.reshape(g_tiles, [D, tiles * tile, G]))
    g_rows = bb.emit(relax.op.strided_slice(g_rows, axes=[1], begin=[0], end=[rows]))
    return bb.emit(relax.op.reshape(g_rows, [D, seq, B, G]))


def emit_recurrent_kernels(bb, cell: str, spec, c, rec, path, bias_i, rec_args, target):
    """Emit the input projection and the recurrence of a GRU/RNN node (prebuilt artifacts when they
    match, see `importer.emit_kernel`): (gate_i, (Y, Y_h) tuple)."""
    from .importer import emit_kernel

    D, B, H, seq = c["D"], c["batch"], c["hidden"], c["seq"]
    sizes = {"directions": D, "batch": B, "hidden": H, "input_size": c["input_size"], "gates": spec.gates}
    gate_i = emit_input_projection(bb, cell, spec, c, bias_i, target)
    # path is in the key: the persistent and the per-step kernels differ (and the persistent RNN takes rb_h)
    r, rec, attrs = with_packed_r(spec, rec_args[0], rec, {"spec": repr(spec), "path": path}, target)
    outs = emit_kernel(bb, f"{cell}_recurrence", recurrent_key(sizes, c["dtype"], attrs),
                       lambda: rec, [gate_i, r, *rec_args[1:]],
                       [relax.TensorType([seq, D, B, H], c["dtype"]), relax.TensorType([D, B, H], c["dtype"])],
                       name_hint=f"{cell}_recurrence" + c.get("suffix", ""))
    return gate_i, outs


def one_step_wanted(cell: str, spec, c, target, path_option: str) -> bool:
    """Whether a node runs as ONE kernel for its one time step, input projection included
    (`kernels.recurrent.one_step`): path 'auto' on a GPU where the time axis is static 1 and the kernel takes
    the node (static batch <= one_step.MAX_BATCH, no sequence_lens, a GRU with linear_before_reset=1), i.e. a
    model compiled for one frame a call; path 'one_step' wherever it can (the CPU runs its serial variant:
    tests), else an error naming why not."""
    from ..kernels.recurrent import one_step

    if path_option not in ("auto", "one_step"):
        return False
    seq = c["seq"]
    why = "the time axis is not a static 1" if not (is_static(seq) and int(seq) == 1) else \
        one_step.applies(cell, spec)
    if path_option == "one_step":
        if why is not None:
            raise TvmseqError(f"recurrence path 'one_step': {why}")
        return True
    return why is None and tvm.target.Target(str(target)).kind.name == "cuda"


def emit_one_step(bb, cell: str, spec, c, args, target, n_states: int = 1):
    """The node's (Y, Y_h[, Y_c]) from the one-step kernel on `args` (its interface, `one_step`'s doc)."""
    from ..kernels.recurrent import one_step
    from .importer import emit_kernel

    D, B, H = c["D"], c["batch"], c["hidden"]
    sizes = {"directions": D, "batch": B, "hidden": H, "input_size": c["input_size"], "gates": spec.gates}
    state = relax.TensorType([D, B, H], c["dtype"])
    return emit_kernel(bb, f"{cell}_one_step", recurrent_key(sizes, c["dtype"], {"spec": repr(spec)}, dynamic=()),
                       lambda: one_step.one_step_func(cell, spec, str(target)), args,
                       [relax.TensorType([1, D, B, H], c["dtype"])] + [state] * n_states,
                       name_hint=f"{cell}_one_step" + c.get("suffix", ""))


def recurrence_path_option(attr, node, op) -> str:
    """The importer option `recurrence` (one of RECURRENCE_PATHS), checked."""
    path = attr["tvm_custom"]["importer_options"].get("recurrence", "auto")
    if path not in RECURRENCE_PATHS:
        raise UnsupportedOnnxError(node, op, f"importer option recurrence={path!r}: must be one of {RECURRENCE_PATHS}")
    return path


def _direction(attr, node):
    direction = attr.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in gru_kernels.DIRECTIONS:
        raise UnsupportedOnnxError(node, "GRU", f"attribute 'direction' = {direction!r} is not one of "
                                               f"{gru_kernels.DIRECTIONS}")
    return direction


def _dim_str(dim):
    """An int, or a symbolic dim's name as the model's signature spells it (str() of a tirx.Var in TVM 0.27
    prints a uniquified name such as 'T_1', which no input's shape names)."""
    if isinstance(dim, tirx.IntImm):
        return int(dim)
    return dim.name if isinstance(dim, tirx.Var) else str(dim)


def check_attributes(attr, node, op, supported=_SUPPORTED_ATTRS):
    for key in attr:
        if key != "tvm_custom" and key not in supported:
            raise UnsupportedOnnxError(node, op, f"attribute '{key}' is not supported")
    layout = attr.get("layout", 0)
    if layout not in (0, 1):
        raise UnsupportedOnnxError(node, op, f"attribute 'layout' = {layout} must be 0 or 1")
    clip = attr.get("clip")
    if clip is not None and not clip > 0:
        raise UnsupportedOnnxError(node, op, f"attribute 'clip' = {clip} must be positive")


def prepare_common(bb, inputs, attr, node, op, gates, supported=_SUPPORTED_ATTRS, x_like=None,
                   symbolic_batch: bool = False):
    """Shared by GRU, RNN and LSTM: validated shapes, layout-0 X and h0 (float32), int32 lengths.
    x_like=(dims, dtype) stands in for a missing X (a layer of a pipelined stack takes the layer below).
    symbolic_batch: X's batch may be symbolic; c["batch"] is then X's symbolic dim (a tirx.Var of relax)
    and the zero h0 a relax zeros() of that shape (see `spec_batch`, `zeros`, `recurrent_key`); without it
    a symbolic batch is refused as before."""
    check_attributes(attr, node, op, supported)
    x, w, r = inputs[0], inputs[1], inputs[2]
    for name, val in (("X", x if x_like is None else True), ("W", w), ("R", r)):
        if val is None:
            raise UnsupportedOnnxError(node, op, f"required input '{name}' is missing")
    layout = attr.get("layout", 0)
    dtype = x.ty.dtype if x_like is None else x_like[1]
    if dtype not in ("float32", "float16"):
        raise UnsupportedOnnxError(node, op, f"input 'X' has dtype {dtype}; tvmseq supports float32 and float16")
    x_dims = (_static_dims(x, "X", node, op) if x_like is None else
              [tirx.IntImm("int64", d) if isinstance(d, int) else d for d in x_like[0]])
    if len(x_dims) != 3:
        raise UnsupportedOnnxError(node, op, f"input 'X' must have rank 3, got {len(x_dims)}")
    if layout == 1:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
        x_dims = [x_dims[1], x_dims[0], x_dims[2]]
    batch = x_dims[1] if symbolic_batch and not is_static(x_dims[1]) else \
        _int(x_dims[1], "the batch size of X", node, op)
    seq, input_size = x_dims[0], _int(x_dims[2], "the input size of X", node, op)
    w_dims = [_int(d, "W's shape", node, op) for d in _static_dims(w, "W", node, op)]
    r_dims = [_int(d, "R's shape", node, op) for d in _static_dims(r, "R", node, op)]
    direction = _direction(attr, node)
    D = 2 if direction == "bidirectional" else 1
    from .checks import checked_hidden_size, checked_lengths

    hidden = checked_hidden_size(attr, r_dims, node, op)
    want_w, want_r = [D, gates * hidden, input_size], [D, gates * hidden, hidden]
    if w_dims != want_w:
        raise UnsupportedOnnxError(node, op, f"input 'W' has shape {w_dims}, expected {want_w}")
    if r_dims != want_r:
        raise UnsupportedOnnxError(node, op, f"input 'R' has shape {r_dims}, expected {want_r}")
    if w.ty.dtype != dtype:
        w = bb.emit(relax.op.astype(w, dtype))
    if r.ty.dtype != dtype:
        r = bb.emit(relax.op.astype(r, dtype))
    bias = inputs[3] if len(inputs) > 3 else None
    bias_value = None   # B's values (float32) where it is an initializer: its derived biases fold at import
    if bias is not None:
        b_dims = [_int(d, "B's shape", node, op) for d in _static_dims(bias, "B", node, op)]
        if b_dims != [D, 2 * gates * hidden]:
            raise UnsupportedOnnxError(node, op, f"input 'B' has shape {b_dims}, expected "
                                                 f"{[D, 2 * gates * hidden]}")
        bias_value = constant_value(bias)
        if bias_value is not None:
            bias_value = bias_value.astype("float32")
            bias = relax.const(bias_value)
        else:
            bias = as_float32(bb, bias)
    else:
        bias_value = np.zeros((D, 2 * gates * hidden), "float32")
        bias = relax.const(bias_value)
    lens = inputs[4] if len(inputs) > 4 else None
    if lens is not None:
        l_dims = _static_dims(lens, "sequence_lens", node, op)
        if is_static(batch):
            if len(l_dims) != 1 or _int(l_dims[0], "sequence_lens' length", node, op) != batch:
                raise UnsupportedOnnxError(node, op, f"input 'sequence_lens' must have shape [{batch}]")
        elif len(l_dims) != 1 or not _same_dim(l_dims[0], batch):
            raise UnsupportedOnnxError(node, op, f"input 'sequence_lens' has shape {[_dim_str(d) for d in l_dims]}, "
                                                 f"expected [{_dim_str(batch)}] (X's batch)")
        lens = checked_lengths(bb, attr, lens, seq, node, op)   # int32; its values checked where they are known
    h0 = inputs[5] if len(inputs) > 5 else None
    if h0 is not None:
        want_h = [D, batch, hidden] if layout == 0 else [batch, D, hidden]
        h0 = match_state_shape(bb, h0, want_h, "initial_h", node, op)
        if layout == 1:
            h0 = bb.emit(relax.op.permute_dims(h0, [1, 0, 2]))
        h0 = as_float32(bb, h0)
    else:
        h0 = zeros((D, batch, hidden), "float32")
    return dict(node=node, op=op, x=x, w=w, r=r, bias=bias, bias_value=bias_value, gates=gates, lens=lens, h0=h0,
                seq=seq, batch=batch, input_size=input_size, hidden=hidden, D=D, direction=direction, dtype=dtype,
                layout=layout)


def constant_value(expr) -> np.ndarray | None:
    """The values of a relax constant (an ONNX initializer or Constant node), else None (a graph tensor)."""
    return expr.value.numpy() if isinstance(expr, tvm.ir.expr.Constant) else None


def as_float32(bb, expr):
    """`expr` as float32: itself where it already is (an astype to its own dtype is a copy kernel a call)."""
    return expr if expr.ty.dtype == "float32" else bb.emit(relax.op.astype(expr, "float32"))


def finish_outputs(bb, y, y_h, layout):
    if layout == 1:
        y = bb.emit(relax.op.permute_dims(y, [2, 0, 1, 3]))
        y_h = bb.emit(relax.op.permute_dims(y_h, [1, 0, 2]))
    return relax.Tuple([y, y_h])


def fold_biases(bb, c, lbr: int = 0):
    """(bias_i [D, gates * H], rb_h [D, H] or None) of a prepared GRU, RNN or LSTM node `c` (`prepare_common`):
    the biases that join the input GEMM and, for a GRU, the one that stays in the recurrence. GRU (3 gates):
    bias_i = Wb + [Rb_z, Rb_r, Rb_h if lbr == 0 else 0], rb_h = Rb_h; RNN (1) and LSTM (4): every bias is
    additive, bias_i = Wb + Rb, rb_h None.

    Where B is an initializer (c["bias_value"]) both are computed here in numpy, in float32 as the run-time
    ops would (so the values are the same bits), and enter the module as constants: no per-call kernel derives
    them from the weights (a one-frame build otherwise spent two of its ~12 kernels a GRU layer on this).
    A B computed in the graph (or a graph input) is sliced and added at run time."""
    H, gates = c["hidden"], c["gates"]
    G = gates * H
    value = c.get("bias_value")
    if value is not None:
        wb, rb = value[:, :G], value[:, G:]
        if gates != 3:
            return relax.const(wb + rb), None
        rb_h = rb[:, 2 * H:]
        rb_fold = np.concatenate([rb[:, :2 * H], rb_h * np.float32(1 - lbr)], axis=1)
        return relax.const(wb + rb_fold), relax.const(np.ascontiguousarray(rb_h))
    bias, sl = c["bias"], relax.op.strided_slice
    wb = sl(bias, axes=[1], begin=[0], end=[G])
    if gates != 3:
        return bb.emit(relax.op.add(wb, sl(bias, axes=[1], begin=[G], end=[2 * G]))), None
    rb_zr = bb.emit(sl(bias, axes=[1], begin=[3 * H], end=[5 * H]))
    rb_h = bb.emit(sl(bias, axes=[1], begin=[5 * H], end=[6 * H]))
    rb_fold = bb.emit(relax.op.concat([rb_zr, relax.op.multiply(rb_h, relax.const(float(1 - lbr)))], 1))
    return bb.emit(relax.op.add(wb, rb_fold)), rb_h


def folded_initializers(graph) -> set[str]:
    """Names of the initializers whose values the recurrent converters fold at import (`fold_biases`, LSTM
    peepholes): B of every GRU, RNN and LSTM node (DynamicQuantizeLSTM's too, and tvmseq's fused stack nodes'),
    P of every LSTM node, in `graph` and its subgraphs. `build.lift_weights` keeps them initializers
    (weights="inputs" would make them graph inputs, whose values the importer cannot see). They are small
    (D x 8H floats at most)."""
    from .stack import LSTM_STACK_OP, STACK_OP

    inits = {t.name for t in graph.initializer}
    names = set()

    def visit(g):
        for node in g.node:
            ins = list(node.input)
            if node.op_type in ("GRU", "RNN", "LSTM", "DynamicQuantizeLSTM"):   # B at 3; an LSTM's P at 7
                picked = ins[3:4] + (ins[7:8] if "LSTM" in node.op_type else [])
            elif node.op_type == STACK_OP:       # X, then W, R, B, initial_h per layer
                picked = ins[3::4]
            elif node.op_type == LSTM_STACK_OP:  # X, then W, R, B, initial_h, initial_c per layer
                picked = ins[3::5]
            else:
                picked = []
            names.update(n for n in picked if n)
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    visit(sub)

    visit(graph)
    return names & inits


def dispatch_plan(spec, target, path_option: str, choose, build) -> list:
    """`batch_dispatch.plan` for a node whose batch is symbolic (spec.batch None) on `target`: [] (the per-step
    kernels for any batch, as before) unless the path is 'auto' and the target a GPU. `choose(spec_b)` is the
    node's path at a static batch (`paths.choose_path` / `paths.choose_lstm_path`: the measured
    databases and the fit checks, as path 'auto' asks them), `build(spec_b, path)` its kernel (`build_kernels`,
    `lstm_recurrence_for`, cached: the bucket's branch takes the same one); a bucket whose kernel cannot be built
    goes to the per-step kernels."""
    from . import batch_dispatch
    from ..targets import is_gpu

    target = tvm.target.Target(str(target))
    if spec.batch is not None or path_option != "auto" or not is_gpu(target):
        return []

    def path_at(b: int) -> str:
        spec_b = dataclasses.replace(spec, batch=b)
        path = choose(spec_b)
        if path != "per_step":
            try:
                build(spec_b, path)
            except TvmseqError:
                return "per_step"
        return path

    return batch_dispatch.plan(batch_dispatch.option_value(), path_at)


def choose_gru_path(spec, target) -> str:
    """The path `paths.recurrence_func_auto` takes for a GruSpec or an RnnSpec at its static batch."""
    from ..kernels.recurrent import paths, rnn

    cell = "rnn" if isinstance(spec, rnn.RnnSpec) else "gru"
    return paths.choose_path(spec.num_directions, spec.batch, spec.hidden, spec.dtype,
                             tvm.target.Target(str(target)), None, cell,
                             getattr(spec, "linear_before_reset", 1))[0]


def _emit_gru_kernels(bb, c, spec, target, path_option: str = "auto"):
    bias_i, rb_h = fold_biases(bb, c, spec.linear_before_reset)
    if one_step_wanted("gru", spec, c, target, path_option):
        return emit_one_step(bb, "gru", spec, c, [c["x"], c["w"], c["r"], bias_i, rb_h, c["h0"]], target)
    rec, path = build_kernels(spec, str(target), path_option)
    H, B = c["hidden"], c["batch"]
    lens = c["lens"] if c["lens"] is not None else zeros((B,), "int32")
    _, outs = emit_recurrent_kernels(bb, "gru", spec, c, rec, path, bias_i, [c["r"], rb_h, lens, c["h0"]], target)
    return outs


def emit_layer(bb, cell: str, c, spec, target, path_option: str, emit_kernels, choose, build, extra=None):
    """One GRU/RNN/LSTM node's kernels, `emit_kernels(bb, c, spec, path)`, on the prepared inputs `c` (with
    `extra` added): through the run-time batch dispatch where it applies (a symbolic batch on a GPU,
    `batch_dispatch`; `choose` and `build` as `dispatch_plan` takes them), else directly."""
    from . import batch_dispatch

    outs = batch_dispatch.emit(bb, cell, c, spec, lambda: dispatch_plan(spec, target, path_option, choose, build),
                               emit_kernels, extra=extra)
    return outs if outs is not None else emit_kernels(bb, {**c, **(extra or {})}, spec, path_option)


def emit_gru_layer(bb, c, spec, target, path_option: str = "auto"):
    """One GRU node's kernels on the prepared inputs `c` (`prepare_common`): the (Y, Y_h) tuple, layout 0. A
    symbolic batch on a GPU: the persistent kernels of the batch buckets where the batch fits one, else the
    per-step kernels, chosen at run time (`emit_layer`)."""
    return emit_layer(bb, "gru", c, spec, target, path_option,
                      lambda bb_, c_, spec_, path: _emit_gru_kernels(bb_, c_, spec_, target, path),
                      lambda s: choose_gru_path(s, target), lambda s, path: build_kernels(s, str(target), path))


@register_converter("GRU")
class GRU(OnnxOpConverter):
    """ONNX GRU -> gru_input_projection (one GEMM) + gru_recurrence (host time loop of step kernels)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        node = cls.node_name(attr)
        target = attr["tvm_custom"]["importer_options"]["target"]
        c = prepare_common(bb, inputs, attr, node, "GRU", gates=3, symbolic_batch=True)
        lbr = int(attr.get("linear_before_reset", 0))
        if lbr not in (0, 1):
            raise UnsupportedOnnxError(node, "GRU", f"attribute 'linear_before_reset' = {lbr} must be 0 or 1")
        acts = parse_onnx_activations(attr, 2, c["D"], ["Sigmoid", "Tanh"], f"ONNX node '{node}' (GRU)")
        spec = gru_kernels.GruSpec(c["D"], spec_batch(c["batch"]), c["hidden"], c["input_size"], c["dtype"], lbr,
                                   c["direction"], tuple(acts), attr.get("clip"), c["lens"] is not None)
        try:
            outs = emit_gru_layer(bb, c, spec, target, recurrence_path_option(attr, node, "GRU"))
        except UnsupportedOnnxError:
            raise
        except TvmseqError as err:   # a kernel factory's refusal (e.g. a persistent path for any batch)
            raise UnsupportedOnnxError(node, "GRU", str(err)) from None
        return finish_outputs(bb, bb.emit(relax.TupleGetItem(outs, 0)), bb.emit(relax.TupleGetItem(outs, 1)),
                              c["layout"])
