"""Constant-weight layouts on llvm, chosen so tvmseq.schedule_cpu vectorizes convs and matmul heads.

A model's convolutions come from ONNX as conv2d(NCHW data, OIHW weight): the output's contiguous axis is the
image width, which an OCR model (PP-OCR, ddddocr) leaves symbolic, so schedule_cpu's `Contraction` rule
(vector along the output's last axis, static) declined and those convs ran as scalar loops (ddddocr 150 ms
against onnxruntime's 8 at 64x64, 90% in its convs). With the weight in HWIO, the output channels are the
weight's contiguous axis and the input ignores them: `Contraction` vectorizes along them (register tiles of
a few output columns x whole vectors of channels, the stores strided by the image plane).

`weight_layouts` rewrites each dense `relax.nn.conv2d` (groups 1, NCHW/OIHW) to take
`permute_dims(weight, [2, 3, 1, 0])` with kernel_layout "HWIO"; the data and the output keep NCHW, so no
activation is transposed. A constant weight's transpose is folded at build time (FoldConstant in TVM's
legalize passes); a weight passed in (`weights="inputs"`) is transposed on each call (one small kernel).

Dense NCW conv1d calls over a symbolic frame axis get the same treatment (weight OIW -> WIO: silero v5's
k=3 convs over 129-128 channels ran scalar, 57% of a call), a constant weight's output channels padded to whole
vectors and the output sliced back (silero's STFT as a conv, 258 channels); `_conv1d_channels` says which.

It also pads the columns of a constant matmul weight [K, N] to a multiple of PAD_COLUMNS and slices the product
back to N (the OCR models' classifier heads: N = 8210 or 6625 classes). Contraction otherwise pads with
pad_einsum, which copied the whole weight on every call (ddddocr: 1024 x 8210 floats, 34 MB written and read
again: 3.9 of its 11 ms; 2.4 ms after). Only weights computed from constants alone (FoldConstant pads them).

A constant float32 matmul weight of PANEL_MIN_COLUMNS or more goes in panels instead, [N' / P, K, P] of two of
the target's vectors (`_panel_matmul`): a register tile walks k down P columns, which in W as stored lie a row of
W apart, a new page every k (ddddocr's head on an AVX2 host: 4.6 ms for 8 frames, 2.2 in panels, onnxruntime 1.9).

Tried first: TVM's ConvertLayout to NHWC/HWIO (channels-last activations). It took ddddocr to the same speed
but failed on PP-OCR (0.27's ConvertLayout neither takes a MatchCast of a call nor remaps the variable of a
MatchCast whose layout it leaves alone), and it put transposes wherever an op does not carry the layout
(Clip as call_tir, the depthwise convs tvmseq.onnx.conv turns into sums of slices).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

_HWIO = [2, 3, 1, 0]    # OIHW -> HWIO
_WIO = [2, 1, 0]        # OIW -> WIO
PAD_COLUMNS = 16        # a constant matmul weight's columns padded to a multiple of this (one AVX-512 vector)
PANEL_MIN_COLUMNS = 1024    # a constant float32 matmul weight this wide (a row 4 KB or more) goes in panels


def _dense_channels_first(call, data: str, kernel: str) -> bool:
    attrs = call.attrs
    return (str(attrs.data_layout) == data and str(attrs.kernel_layout) == kernel
            and str(attrs.out_layout) == data and int(attrs.groups) == 1)


def _conv1d_channels(conv1d, constant: bool) -> int | None:
    """Output channels a dense NCW conv1d's WIO weight gets (padded to whole vectors where it is a constant), or
    None to leave the conv as it is (module doc). Only over a symbolic frame axis: a static one is vectorized
    along the frames, or, one frame long, along the taps by schedule_cpu's InnerReduction (dtln's pointwise
    convs; 2x slower as WIO). Channels that are no whole number of vectors leave a partial vector in the tile,
    predicated and so scalar: a constant weight is padded instead where that adds little (silero's STFT, 258
    channels: 1.3-1.6x); else WIO only for a short filter (a long one keeps OIW, its taps summed in vector
    lanes by InnerReduction)."""
    data, weight = (getattr(arg.ty, "shape", None) for arg in conv1d.args)
    if data is None or weight is None or isinstance(data.values[-1], tvm.tirx.IntImm) \
            or not all(isinstance(d, tvm.tirx.IntImm) for d in weight.values):
        return None
    channels, _, taps = (int(d) for d in weight.values)
    padded = -(-channels // PAD_COLUMNS) * PAD_COLUMNS
    if constant and 8 * padded <= 9 * channels:     # at most an eighth more work (258 -> 272; not 34 -> 48)
        return padded
    return channels if taps < PAD_COLUMNS else None


def _constant_derived(expr, lookup, depth: int = 0) -> bool:
    """Whether `expr` is a constant, or computed by ops from constants alone (FoldConstant folds it)."""
    if isinstance(expr, tvm.ir.GenericConst):
        return True
    if isinstance(expr, relax.Var) and depth < 8:
        bound = lookup(expr)
        return bound is not None and _constant_derived(bound, lookup, depth + 1)
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.args and depth < 8:
        return all(_constant_derived(a, lookup, depth + 1) for a in expr.args)
    return False


@mutator
class _WeightLayouts(PyExprMutator):
    def __init__(self, mod, panel: int = 0):
        super().__init__(mod)
        self.panel = panel
        self.conv2d = tvm.ir.Op.get("relax.nn.conv2d")
        self.conv1d = tvm.ir.Op.get("relax.nn.conv1d")
        self.matmul = tvm.ir.Op.get("relax.matmul")
        self.changed = 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.same_as(self.matmul):
            return self._padded_matmul(call)
        if call.op.same_as(self.conv2d) and _dense_channels_first(call, "NCHW", "OIHW"):
            return self._relaid(call, relax.op.nn.conv2d, _HWIO, "NCHW", "HWIO")
        if call.op.same_as(self.conv1d) and _dense_channels_first(call, "NCW", "OIW"):
            return self._conv1d(call)
        return call

    def _conv1d(self, call):
        """A dense NCW conv1d with its weight in WIO, its channels padded to whole vectors and the output sliced
        back where `_conv1d_channels` says so; else the call as it is."""
        data, weight = call.args
        padded = _conv1d_channels(call, _constant_derived(weight, self.lookup_binding))
        if padded is None:
            return call
        channels = int(weight.ty.shape.values[0])
        if padded == channels:
            return self._relaid(call, relax.op.nn.conv1d, _WIO, "NCW", "WIO")
        self.changed += 1
        a = call.attrs
        weight = relax.op.nn.pad(relax.op.permute_dims(weight, _WIO), [0, 0, 0, 0, 0, padded - channels])
        out = self.builder_.emit(relax.op.nn.conv1d(data, weight, strides=a.strides, padding=a.padding,
                                                    dilation=a.dilation, data_layout="NCW", kernel_layout="WIO",
                                                    out_layout="NCW", out_dtype=a.out_dtype))
        return relax.op.strided_slice(out, axes=[1], begin=[0], end=[channels], assume_inbound=True)

    def _relaid(self, call, conv, axes, data_layout: str, kernel_layout: str):
        """The conv with its weight permuted to `kernel_layout` (output channels last); data and output as they were."""
        data, weight = call.args
        a = call.attrs
        self.changed += 1
        return conv(data, relax.op.permute_dims(weight, axes), strides=a.strides, padding=a.padding,
                    dilation=a.dilation, groups=1, data_layout=data_layout, kernel_layout=kernel_layout,
                    out_layout=data_layout, out_dtype=a.out_dtype)

    def _padded_matmul(self, call):
        """matmul(x, W [K, N]) with a constant W whose N is not a whole number of SIMD vectors:
        matmul(x, W padded to N') sliced to N, the padding folded at build time (module doc); a wide one in
        panels (`_panel_matmul`)."""
        x, weight = call.args
        ty = weight.ty
        shape = getattr(ty, "shape", None)
        if shape is None or ty.ndim != 2 or not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
            return call
        n = int(shape.values[1])
        if self.panel and n >= PANEL_MIN_COLUMNS and str(ty.dtype) == "float32" \
                and _constant_derived(weight, self.lookup_binding):
            panelled = self._panel_matmul(call)
            if panelled is not None:
                return panelled
        if n % PAD_COLUMNS == 0 or n < 2 * PAD_COLUMNS or str(ty.dtype) not in ("float32", "int32", "int16", "int8") \
                or not _constant_derived(weight, self.lookup_binding):
            return call
        padded = -(-n // PAD_COLUMNS) * PAD_COLUMNS
        self.changed += 1
        weight = relax.op.nn.pad(weight, [0, 0, 0, padded - n])
        out = self.builder_.emit(relax.op.matmul(x, weight, out_dtype=call.attrs.out_dtype))
        axis = out.ty.ndim - 1
        return relax.op.strided_slice(out, axes=[axis], begin=[0], end=[n], assume_inbound=True)


    def _panel_matmul(self, call):
        """matmul(x [..., M, K], W [K, N]) with W in panels of `panel` columns, [N' / panel, K, panel] (N padded
        to N'): a batched matmul of x against each panel, [..., N' / panel, M, panel], its axes put back and
        sliced to N. A tile then reads its weight columns contiguously along k; in W as stored they lie a row of
        W apart, a page or more for N >= PANEL_MIN_COLUMNS. None where x's shape is unknown."""
        x, weight = call.args
        xshape = getattr(x.ty, "shape", None)
        if xshape is None or x.ty.ndim < 2 or not hasattr(xshape, "values"):
            return None
        k, n = (int(d) for d in weight.ty.shape.values)
        panel = self.panel
        padded = -(-n // panel) * panel
        self.changed += 1
        if padded != n:
            weight = relax.op.nn.pad(weight, [0, 0, 0, padded - n])
        panels = relax.op.permute_dims(relax.op.reshape(weight, [k, padded // panel, panel]), [1, 0, 2])
        out = self.builder_.emit(relax.op.matmul(relax.op.expand_dims(x, -3), panels,
                                                 out_dtype=call.attrs.out_dtype))
        rank = out.ty.ndim
        out = relax.op.permute_dims(out, [*range(rank - 3), rank - 2, rank - 3, rank - 1])
        out = relax.op.reshape(out, [*xshape.values[:-1], padded])
        if padded == n:
            return out
        return relax.op.strided_slice(out, axes=[rank - 2], begin=[0], end=[n], assume_inbound=True)


def weight_layouts(mod: tvm.IRModule, panel: int = 0) -> tvm.IRModule:
    """`mod` with its dense NCHW conv2d calls taking HWIO weights and its constant matmul weights padded, or with
    `panel` > 0 the wide ones in panels of `panel` columns (module doc); `mod` itself when nothing changes."""
    return rewrite_functions(_WeightLayouts(mod, panel), mod)


def rewrite_functions(rewrite, mod: tvm.IRModule) -> tvm.IRModule:
    """Every Relax function of `mod` through `rewrite` (a PyExprMutator built on `mod` that counts its rewrites in
    `changed`): the rewritten module, or `mod` itself when it changed nothing."""
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewrite.builder_.update_func(gv, rewrite.visit_expr(func))
    return rewrite.builder_.get() if rewrite.changed else mod


def weight_layouts_pass(target=None) -> tvm.transform.Pass:
    """`weight_layouts` as a module pass (llvm only: run it before legalization), wide matmul weights in panels of
    two of `target`'s float32 vectors (none without a target)."""
    panel = 0
    if target is not None:
        from .schedule_cpu import vector_lanes

        panel = 2 * vector_lanes(target, "float32")
    return tvm.transform.module_pass(lambda mod, _ctx: weight_layouts(mod, panel), opt_level=0,
                                     name="TvmseqWeightLayouts")
