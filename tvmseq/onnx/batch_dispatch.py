"""Run-time dispatch on a symbolic batch: a GRU/RNN/LSTM node whose batch is symbolic runs, on a GPU target, the
persistent recurrence built for a batch bucket when the batch fits one, else the per-step kernels (any batch).

Buckets. The candidates are 1, 2, 4, ... up to `MAX_BUCKET` (importer option `batch_buckets`: "auto", the default;
an int, the largest candidate; a list of ints, the candidates; "off", 0 or [] for no dispatch). Batch n runs on the
smallest candidate b >= n, where the node's chooser (`kernels.recurrent.paths.choose_path` / `choose_lstm_path`,
so the measured databases and the fit checks) answers for the static batch b; a candidate where it answers
'per_step' (or whose kernel cannot be built) sends its batches to the per-step kernels, as does a batch above the
largest candidate. On a CPU target the chooser always answers 'per_step': nothing changes there. The importer option
`recurrence="per_step"` (or `batch_buckets="off"`) turns the dispatch off.

Exactness. A bucket's branch pads the batch axis of X, the initial states and sequence_lens with zero rows (length
0) up to b, runs the node's static-batch kernels for b (input projection and recurrence, exactly what a model with
batch b gets) and slices the outputs back to the real batch: rows never mix, so the real rows are exact.

Relax. `emit` adds, per node, a function `<cell>_batch_dispatch` whose body is a chain of `If`s on the batch
(`R.prim_value(N <= b)`), every branch a call of a function of its own (`<cell>_b<b>`, `<cell>_any_batch`): TVM's
static memory planner lets one branch reuse storage that the other allocates when both live in one function (the
importer's `If` does the same, `importer.TvmseqGraphImporter._branch`). The dispatch function is pure and holds
no allocation, so main calls it from its dataflow block; weights that are constants stay in main and travel to the
branches as arguments (one copy in the module). The kernels of bucket b are named `<cell>_recurrence_b<b>`,
`<cell>_input_projection_b<b>` (`suffix` in the prepared inputs), the per-step ones keep their plain names; a
second node of the cell with other sizes gets `<cell>2_...`, one with the same sizes (the layers of a GRU stack run
layer by layer) shares the first one's functions (the BlockBuilder keeps one of equal functions). Where a size in
the node's shapes is not an input's own dim (X [T, 2*N, I] after a Reshape) there is no dispatch: the per-step
kernels, as before.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import tvm
from tvm import relax, tirx

from ..errors import TvmseqError

BATCH_BUCKETS_OPTION = "batch_buckets"
# The largest bucket tried by default. The choosers answer persistent up to batch 2048-4096 for small or float16
# cells, but every bucket is one more persistent kernel to build (~1 s of import and of compile each, here) and to
# ship (~0.15 MB of sm_90a code for a small cell); whether padding a batch of 300 up to 512 beats the per-step
# kernels is not measured. `batch_buckets=<int>` raises the cap.
MAX_BUCKET = 256
OFF = ("off", "none", "per_step")

# tensors of a prepared node (`gru.prepare_common`'s dict, plus the LSTM's c0) and their batch axis
_BATCH_AXIS = {"x": 1, "h0": 1, "c0": 1, "lens": 0}


DEFAULT = "auto"


def candidates(option) -> list[int]:
    """The candidate buckets an importer option value names (module doc), ascending; [] for none."""
    if option is None or (isinstance(option, str) and option == "auto"):
        return [1 << k for k in range(MAX_BUCKET.bit_length()) if 1 << k <= MAX_BUCKET]
    if isinstance(option, str):
        if option.lower() in OFF:
            return []
        raise TvmseqError(f"importer option {BATCH_BUCKETS_OPTION}={option!r}: must be 'auto', 'off', a largest "
                          "bucket (int) or a list of buckets")
    if isinstance(option, bool):
        raise TvmseqError(f"importer option {BATCH_BUCKETS_OPTION}={option!r}: must be 'auto', 'off', an int or "
                          "a list of ints")
    if isinstance(option, int):
        if option < 0:
            raise TvmseqError(f"importer option {BATCH_BUCKETS_OPTION}={option}: must be >= 0 (0: off)")
        return [1 << k for k in range(option.bit_length()) if 1 << k <= option]
    values = list(option) if isinstance(option, (list, tuple, set, frozenset)) else None
    if values is None or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise TvmseqError(f"importer option {BATCH_BUCKETS_OPTION}={option!r}: must be 'auto', 'off', a largest "
                          "bucket (int) or a list of positive ints")
    values = sorted(set(values))
    return values


def plan(option, choose: Callable[[int], str]) -> list[tuple[int, str]]:
    """[(bucket, path)] for the candidates of `option`, each with `choose(bucket)`'s path ('per_step' included),
    cut after the last candidate whose path is persistent; [] when none is."""
    ranges = [(b, choose(b)) for b in candidates(option)]
    while ranges and ranges[-1][1] == "per_step":
        ranges.pop()
    return ranges


def option_value(options: dict | None = None):
    """The `batch_buckets` option of the node being converted (the importer's options when not given)."""
    if options is None:
        from .importer import _OPTIONS

        options = _OPTIONS.get()
    return (options or {}).get(BATCH_BUCKETS_OPTION, DEFAULT)


def _pad(bb, value, axis: int, batch, b: int):
    """`value` with its batch axis (symbolic `batch`) padded with zero rows to b: one elementwise kernel that reads
    a row below the real batch and writes zero elsewhere. (zeros of b - batch rows + concat + match_cast, the
    obvious Relax, crashed the host process on the H100 whenever b - batch > 0: notes/tvm_symbolic_concat_cuda.md.)"""
    from tvm import te

    def pad(x):
        shape = list(x.shape)
        shape[axis] = b
        return te.compute(shape, lambda *i: tirx.if_then_else(i[axis] < x.shape[axis], x(*i), tirx.const(0, x.dtype)),
                          name="pad_batch")

    return bb.emit_te(pad, value, primfunc_name_hint="pad_batch")


def _slice(bb, value, axis: int, batch):
    """The first `batch` rows of `value`'s batch axis (a bucket's outputs back to the real batch), one copy kernel."""
    from tvm import te

    def take(y):
        shape = list(y.shape)
        shape[axis] = batch
        return te.compute(shape, lambda *i: y(*i), name="take_batch")

    return bb.emit_te(take, value, primfunc_name_hint="take_batch")


def _function(bb, name: str, params: list, make_body: Callable[[], relax.Expr], dataflow: bool = False) -> \
        relax.GlobalVar:
    """A private pure function of `params` whose body `make_body()` emits with `bb` (inside the function main is
    being built in: a binding block of its own, lifted out, as the importer's If branches are). The body's sizes
    are the parameters' dims (`emit` checks it first). `dataflow`: the body a dataflow block (straight-line and
    pure: no If), where TVM turns reshapes into views (RewriteDataflowReshape rewrites only dataflow bindings;
    elsewhere each reshape stays a copy kernel)."""
    if dataflow:
        bb._begin_dataflow_block()
    else:
        bb._begin_binding_block()
    try:
        body = bb.emit_output(make_body()) if dataflow else bb.emit(make_body())
    finally:
        block = bb._end_block()
    seq = relax.SeqExpr([block], body)
    func = relax.utils.copy_with_new_vars(relax.Function(params, seq, seq.body.ty, is_pure=True))
    return bb.add_func(func, name)


def own_dims(tensors: dict) -> set | None:
    """The size vars the tensors' shapes define, when every size in them is a tensor's own dim (X [T, N, I], not
    [T, 2 * N, I] after a Reshape): then functions of the tensors alone can take them as parameters. Else None."""
    defined = {v for t in tensors.values() for v in relax.analysis.definable_tir_vars_in_type(t.ty)}
    used = {v for t in tensors.values() for v in relax.analysis.tir_vars_in_type(t.ty)}
    return defined if used <= defined else None


def bound(bb, tensors: dict) -> dict:
    """The tensors as arguments of a call: computed ones bound to vars (vars and constants as they are)."""
    return {k: v if isinstance(v, (relax.Var, tvm.ir.expr.Constant)) else bb.emit(v) for k, v in tensors.items()}


def params(tensors: dict) -> list:
    """Fresh parameters of a function taking the tensors, in their order."""
    return [relax.Var(k, t.ty) for k, t in tensors.items()]


def emit(bb, cell: str, c: dict, spec, plan_ranges: Callable[[], list[tuple[int, str]]],
         core: Callable[[object, dict, object, str], relax.Expr], extra: dict | None = None):
    """The node's outputs (the tuple `core` returns: Y [T, D, N, H], then states [D, N, H]) through the dispatch
    (module doc), or None (nothing emitted: the caller runs the per-step kernels) where the batch is static, the
    shapes do not allow it (a size that is not an input's own dim) or `plan_ranges()` (`plan`'s answer, asked only
    when the shapes allow a dispatch) is empty. `c`: the prepared inputs with a symbolic c["batch"]; `extra`: more
    tensors of the node ("c0" with a batch axis, others without) handed to `core` in c.
    `core(bb, c, spec, path_option)` emits the node's kernels for the prepared inputs `c` (the padded ones and an
    int batch in a bucket's branch) and `spec` (its batch b there, None in the per-step branch); path_option is
    the bucket's path from `ranges` there, 'per_step' in the other."""
    batch = c["batch"]
    if not isinstance(batch, tirx.Var):
        return None
    tensors = {}
    for k, v in {**c, **(extra or {})}.items():
        if isinstance(v, relax.Expr) and not isinstance(getattr(v, "ty", None), tvm.ir.PrimType):   # not a size
            v = bb.normalize(v)
            if isinstance(v.ty, relax.TensorType):
                tensors[k] = v
    # the branches are functions of the tensors alone (`own_dims`); else None: the caller runs the per-step kernels
    defined = own_dims(tensors)
    if defined is None or batch not in defined:
        return None
    ranges = plan_ranges()
    if not ranges:
        return None
    tensors = bound(bb, tensors)
    names = list(tensors)
    args = [tensors[k] for k in names]

    # names of this dispatch's functions: <cell>_..., <cell>2_... for a second node of the cell in the module (TVM's
    # own renaming would append digits to "<cell>_b1", which then reads as bucket 11)
    taken = {gv.name_hint for gv in bb.get().get_global_vars()}
    tag = next(t for t in ("", *map(str, range(2, 1 << 20))) if f"{cell}{t}_batch_dispatch" not in taken)

    def branch(b: int | None, path: str):
        ps = params(tensors)
        local = dict(zip(names, ps))

        def body():
            ins = dict(c)
            ins.update(local)
            if b is None:
                return core(bb, ins, spec, path)
            for k, axis in _BATCH_AXIS.items():
                if k in local:
                    ins[k] = _pad(bb, local[k], axis, batch, b)
            ins["batch"] = b
            ins["suffix"] = f"{tag}_b{b}"
            outs = core(bb, ins, dataclasses.replace(spec, batch=b), path)
            n = len(outs.ty.fields)
            items = [bb.emit(relax.TupleGetItem(outs, i)) for i in range(n)]
            return relax.Tuple([_slice(bb, v, 2 if i == 0 else 1, batch) for i, v in enumerate(items)])

        # a dataflow block: its reshapes (X to rows, gate_i back) are views, not copy kernels
        return _function(bb, f"{cell}{tag}_any_batch" if b is None else f"{cell}{tag}_b{b}", ps, body, dataflow=True)

    any_batch = branch(None, "per_step")     # first: its kernels keep their plain names
    bucket_fns = [(b, branch(b, path) if path != "per_step" else any_batch) for b, path in ranges]
    # buckets whose branch is the per-step one, next to the per-step tail, join it
    while bucket_fns and bucket_fns[-1][1].same_as(any_batch):
        bucket_fns.pop()

    def level(k: int) -> relax.GlobalVar:
        """The dispatch from bucket k on: If(N <= b_k) its branch, else the next level. Each If's branches are
        single calls of functions of their own: TVM's memory planner mishandles storage made in one branch of
        an If and used after it (a nested If in an else branch segfaulted on the H100)."""
        if k == len(bucket_fns):
            return any_batch
        b, fn = bucket_fns[k]
        rest = level(k + 1)
        ps = params(tensors)
        n_var = ps[names.index("x")].ty.shape.values[_BATCH_AXIS["x"]]   # the batch as this function's own var
        name = f"{cell}{tag}_batch_dispatch" + ("" if k == 0 else f"_from_b{b}")
        return _function(bb, name, ps, lambda: relax.If(relax.prim_value(n_var <= b), relax.Call(fn, ps),
                                                        relax.Call(rest, ps)))

    dispatch = level(0)
    return bb.emit(relax.Call(dispatch, args))
