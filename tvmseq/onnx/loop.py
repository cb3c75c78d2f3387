"""ONNX `Loop` as recursive Relax functions (TVM's Relax frontend has no Loop converter).

    Loop(M, cond, v_initial...) -> (v_final..., scan...)      body(i, cond, v...) -> (cond', v'..., s...)

The body becomes a function of its own (`<node>_body`, its outer-scope values as extra parameters), and the loop
one that calls itself while `i < M and cond`:

    step(i, M, cond, v..., scans..., outer...):
        if i < M and cond:  (cond', v'..., s...) = body(i, cond, v..., outer...)
                            return step(i + 1, M, cond', v'..., concat(scans, s[None])..., outer...)
        else:               return (v..., scans...)

A scan output's element shape is known only once the body has run, so a loop with scan outputs runs its first
iteration before `step` (`start`), and with zero iterations returns scans of zero rows. The trip count and the
condition are decided at run time, so tf2onnx's while loops (a batch `map_fn`, a decoder run until end of
sequence) keep their dynamic trip counts; a loop-carried value may change shape between iterations (a decoder's
growing key/value cache): where the body returns it in another shape, the loop carries it with a fresh symbolic
dim where it changes.
Each iteration is a few calls of the Relax VM and reads the condition on the host: a loop is as slow as its trip
count, not fused."""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from ..errors import TvmseqError

NO_LIMIT = np.iinfo(np.int64).max        # an absent trip count


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _same_type(a, b) -> bool:
    """Equal types, a symbolic dim of one matching the same-placed one of the other (the body function has
    symbolic vars of its own)."""
    return tvm_ffi.structural_equal(a, b, map_free_vars=True)


def _rank_only(ty):
    return relax.TensorType(ndim=ty.ndim, dtype=ty.dtype)


def with_dims(bb, value, prefix: str):
    """A tensor known by its rank only, cast to fresh symbolic dims (TVM's legalization needs a shape)."""
    ty = value.ty
    if not isinstance(ty, relax.TensorType) or isinstance(ty.shape, relax.ShapeExpr) or ty.ndim < 0:
        return value
    dims = [tvm.tirx.Var(f"{prefix}_{k}", "int64") for k in range(ty.ndim)]
    return bb.match_cast(value, relax.TensorType(dims, ty.dtype))


def with_sizes(params, args, seq):
    """(params, args) of a function made of `seq`, with the symbolic sizes it uses that its parameters' types do not
    define added as one shape parameter (If branches, a Loop's functions)."""
    scratch = relax.Function(params, seq, seq.body.ty, is_pure=False)
    defined = {v for p in params for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
    sizes = [v for v in relax.analysis.free_symbolic_vars(scratch) if v not in defined]
    if sizes:
        return params + [relax.Var("sizes", relax.ShapeType(sizes))], args + [relax.ShapeExpr(sizes)]
    return params, args


def _prim_to_tensor(bb, value):
    """A PrimValue (a dim read from a shape) as a rank-0 int64 tensor."""
    while bb.lookup_binding(value) is not None:        # TVM 0.27: a PrimValue is the PrimExpr itself
        value = bb.lookup_binding(value)
    return relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([value])), [])


def _scalar(bb, value, dtype: str):
    """An ONNX scalar input (M or cond; ONNX also allows one element of rank 1) as a rank-0 tensor."""
    if isinstance(value, relax.Expr) and isinstance(value.ty, tvm.ir.PrimType):
        value = _prim_to_tensor(bb, value)
    elif isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType):
        value = relax.op.shape_to_tensor(value)
    value = bb.normalize(value)
    if value.ty.ndim != 0:
        value = bb.normalize(relax.op.reshape(value, []))
    return value if str(value.ty.dtype) == dtype else bb.normalize(relax.op.astype(value, dtype))


class LoopConverter:
    """One ONNX Loop node of `importer` (a tvmseq.onnx.importer.TvmseqGraphImporter) -> its output values."""

    def __init__(self, importer, node, name: str):
        self.importer, self.bb, self.node = importer, importer.bb, node
        self.hint = _safe(name)
        self.body = importer._parse_attr(node.attribute)["body"]
        self.n_carried = len(node.input) - 2
        self.n_scans = len(self.body.output) - 1 - self.n_carried
        if self.n_carried < 0:
            raise ValueError(f"it has {len(node.input)} inputs, at least 2 (trip count, condition) expected")
        values = f"the {self.n_carried} loop-carried value{'s' if self.n_carried != 1 else ''}"
        if len(self.body.input) != 2 + self.n_carried:
            raise ValueError(f"its body takes {len(self.body.input)} inputs, {2 + self.n_carried} expected "
                             f"(iteration number, condition, {values})")
        if self.n_scans < 0:
            raise ValueError(f"its body returns {len(self.body.output)} outputs, at least {1 + self.n_carried} "
                             f"expected (condition, {values})")
        if len(node.output) > self.n_carried + self.n_scans:
            raise ValueError(f"it has {len(node.output)} outputs, its body gives {self.n_carried + self.n_scans} "
                             f"({values} and {self.n_scans} scan output{'s' if self.n_scans != 1 else ''})")

    # -- the values the loop starts from ----------------------------------------------------------------
    def _initial(self):
        nodes, inputs = self.importer._nodes, list(self.node.input)
        trip = _scalar(self.bb, nodes[inputs[0]], "int64") if inputs[0] else relax.const(NO_LIMIT, "int64")
        cond = _scalar(self.bb, nodes[inputs[1]], "bool") if inputs[1] else relax.const(True, "bool")
        carried = []
        for name in inputs[2:]:
            value = nodes[name]
            if isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType):
                value = self.bb.normalize(relax.op.shape_to_tensor(value))
            elif isinstance(value, relax.Expr) and isinstance(value.ty, tvm.ir.PrimType):
                value = self.bb.normalize(_prim_to_tensor(self.bb, value))
            if not isinstance(value, relax.Expr) or not isinstance(value.ty, relax.TensorType):
                raise TvmseqError(f"ONNX node '{self.node.name}' (Loop): loop-carried value '{name}' is not a tensor "
                                  "(sequences and optionals are not supported)")
            carried.append(value)
        return trip, cond, carried

    # -- the body -----------------------------------------------------------------------------------------
    def _body_function(self, carried_types):
        """The body as a function (i, cond, v..., outer...) -> (cond', v'..., s...); returns it, the outer values
        it reads (in parameter order) and the types of its results."""
        imp, bb = self.importer, self.bb
        names = [i.name for i in self.body.input]
        params = [relax.Var(_safe(names[0]) or "i", relax.TensorType((), "int64")),
                  relax.Var(_safe(names[1]) or "cond", relax.TensorType((), "bool"))]
        params += [relax.Var(_safe(n) or f"v{k}", t) for k, (n, t) in enumerate(zip(names[2:], carried_types))]
        outer = dict(imp._nodes)
        bb._begin_binding_block()
        try:
            for k, (name, var) in enumerate(zip(names, params)):
                imp._nodes[name] = with_dims(bb, var, f"{self.hint}_v{k}")
            outputs = imp._branch_outputs(self.body)
            outputs[0] = _scalar(bb, outputs[0], "bool")
            for k, value in enumerate(outputs):
                if not isinstance(value, relax.Expr) or not isinstance(value.ty, relax.TensorType):
                    raise TvmseqError(f"ONNX node '{self.node.name}' (Loop): body output "
                                      f"'{self.body.output[k].name}' is not a tensor")
            for k in range(self.n_carried):
                outputs[1 + k] = self._as_carried(outputs[1 + k], params[2 + k], params, k)
            result = bb.emit(relax.Tuple(outputs))
        finally:
            block = bb._end_block()
            imp._nodes = outer
        seq = bb.normalize(relax.SeqExpr([block], result))
        free = [v for v in relax.analysis.free_vars(seq) if not any(v.same_as(p) for p in params)]
        func_params, args = with_sizes(params + free, list(free), seq)
        func = relax.utils.copy_with_new_vars(relax.Function(func_params, seq, seq.ty, is_pure=True))
        return func, args, list(seq.ty.fields)       # in the caller's symbolic vars (the copy has its own)

    def _as_carried(self, value, param, params, k: int):
        """A loop-carried result with dims Relax cannot relate to anything (computed from data: a Slice at the
        iteration number) where ONNX's shape inference says it keeps the incoming static dims: cast back to
        the incoming type, checked at run time. Every other result stays as computed."""
        have, want = value.ty, param.ty
        inferred = self.importer.value_shapes.get(self.body.output[1 + k].name)
        if not isinstance(have.shape, relax.ShapeExpr) or not isinstance(want.shape, relax.ShapeExpr) \
                or have.ndim != want.ndim or str(have.dtype) != str(want.dtype) or inferred is None \
                or len(inferred) != want.ndim:
            return value
        known = {v for p in params for v in relax.analysis.definable_tir_vars_in_type(p.ty)}
        for h, w, i in zip(have.shape.values, want.shape.values, inferred):
            unknown = isinstance(h, tvm.tirx.Var) and h not in known
            if not tvm_ffi.structural_equal(h, w) and not (unknown and isinstance(w, tvm.tirx.IntImm) and i == int(w)):
                return value
        return self.bb.match_cast(value, want)

    @staticmethod
    def _merged(came, went):
        """The type a loop carries a value in: the dims it keeps, a fresh symbolic dim for each it changes
        (a decoder's key / value cache grows along one), its rank only where the body's result has no shape."""
        if not isinstance(came.shape, relax.ShapeExpr) or not isinstance(went.shape, relax.ShapeExpr):
            return _rank_only(came)
        dims = [c if tvm_ffi.structural_equal(c, w) else tvm.tirx.Var(f"carried_{k}", "int64")
                for k, (c, w) in enumerate(zip(came.shape.values, went.shape.values))]
        return relax.TensorType(dims, came.dtype)

    def _settled_body(self, carried):
        """The body function with loop-carried types that its results keep: each value the body returns in
        another shape is carried in a type with a fresh dim where it changes (the body then converted again on
        those types)."""
        types = [v.ty for v in carried]
        for _ in range(2):
            body, outer, results = self._body_function(types)
            back = results[1:1 + self.n_carried]
            if all(_same_type(t, r) for t, r in zip(types, back)):
                return body, outer, types, results
            for t, r in zip(types, back):
                if t.ndim != r.ndim or str(t.dtype) != str(r.dtype):
                    raise TvmseqError(f"ONNX node '{self.node.name}' (Loop): a loop-carried value changes rank or "
                                      f"dtype in the body ({t} -> {r})")
            types = [t if _same_type(t, r) else self._merged(t, r) for t, r in zip(types, back)]
        return body, outer, types, results

    def _body(self, carried):
        body, outer, types, results = self._settled_body(carried)
        return self.bb.add_func(body, f"{self.hint}_body"), outer, types, results

    # -- the recursion ------------------------------------------------------------------------------------
    def _branch_call(self, build, hint, ret_ty=None):
        """A branch as a call of a function of its own (see importer._branch: inlined branches may share
        storage the memory planner should not share). `ret_ty`: the type both branches declare (else the If
        casts one branch's result, and TVM's FuseOps fails on the cast)."""
        bb = self.bb
        bb._begin_binding_block()
        try:
            result = build()
            if ret_ty is not None and isinstance(result, relax.Tuple):
                # each field cast to its declared type: a function's body narrower than its declared return type
                # makes the function's type the narrower one
                result = relax.Tuple([f if _same_type(bb.normalize(f).ty, t) else bb.match_cast(f, t)
                                      for f, t in zip(result.fields, ret_ty.fields)])
            result = bb.emit(result)
        finally:
            block = bb._end_block()
        seq = bb.normalize(relax.SeqExpr([block], result))
        free = list(relax.analysis.free_vars(seq))
        func_params, args = with_sizes(free, list(free), seq)
        func = relax.utils.copy_with_new_vars(relax.Function(func_params, seq, ret_ty or seq.ty, is_pure=True))
        return relax.Call(bb.add_func(func, hint), args)

    def _iterate(self, body, i, cond, carried, outer):
        """One body call -> (cond', v'..., s...) as values."""
        out = self.bb.emit(relax.Call(body, [i, cond, *carried, *outer]))
        return [with_dims(self.bb, self.bb.emit(relax.TupleGetItem(out, k)), f"{self.hint}_r{k}")
                for k in range(1 + self.n_carried + self.n_scans)]

    def _grow(self, scan, new, k: int):
        """scan + [new] along a new first axis. The rows so far are cast to the new row's element shape (ONNX:
        every iteration gives a scan output of the same shape), checked at run time; cast the other way round
        (the new row to the rows' shape), TVM's CanonicalizeTIRVariables drops the cast and the concat is left
        without a shape."""
        bb = self.bb
        row = bb.emit(relax.op.expand_dims(new, 0))
        count = tvm.tirx.Var(f"{self.hint}_rows{k}", "int64")
        rows = bb.match_cast(scan, relax.TensorType([count, *row.ty.shape.values[1:]], new.ty.dtype))
        return bb.emit(relax.op.concat([rows, row], 0))

    def _step_function(self, body, carried_types, scan_types, outer):
        """The recursive `step` (module docstring); returns its GlobalVar."""
        bb = self.bb
        params = [relax.Var("i", relax.TensorType((), "int64")), relax.Var("trip", relax.TensorType((), "int64")),
                  relax.Var("cond", relax.TensorType((), "bool"))]
        params += [relax.Var(f"v{k}", t) for k, t in enumerate(carried_types)]
        params += [relax.Var(f"scan{k}", t) for k, t in enumerate(scan_types)]
        params += [relax.Var(f"outer{k}", v.ty) for k, v in enumerate(outer)]
        i, trip, cond = params[:3]
        carried = params[3:3 + self.n_carried]
        scans = params[3 + self.n_carried:3 + self.n_carried + self.n_scans]
        outer_params = params[3 + self.n_carried + self.n_scans:]
        ret_ty = relax.TupleType(list(carried_types) + list(scan_types))
        # declared first with a body that returns its own arguments, so the body below can call it
        stub = relax.Function(params, relax.Tuple(carried + scans), ret_ty, is_pure=True)
        step = bb.add_func(relax.utils.copy_with_new_vars(stub), f"{self.hint}_step")

        def again():
            got = self._iterate(body, i, cond, carried, outer_params)
            grown = [self._grow(scan, new, k) for k, (scan, new) in enumerate(zip(scans, got[1 + self.n_carried:]))]
            nxt = bb.emit(relax.op.add(i, relax.const(1, "int64")))
            return relax.Call(step, [nxt, trip, got[0], *got[1:1 + self.n_carried], *grown, *outer_params])

        bb._begin_binding_block()
        try:
            go = bb.emit(relax.op.logical_and(relax.op.less(i, trip), cond))
            result = bb.emit(relax.If(go, self._branch_call(again, f"{self.hint}_next", ret_ty),
                                      self._branch_call(lambda: relax.Tuple(carried + scans), f"{self.hint}_done",
                                                        ret_ty)))
        finally:
            block = bb._end_block()
        func = relax.Function(params, relax.SeqExpr([block], result), ret_ty, is_pure=True)
        bb.update_func(step, relax.utils.copy_with_new_vars(func))
        return step

    @staticmethod
    def _empty_scans(element_types):
        """Zero iterations: each scan output with zero rows (its other dims where the body's type knows them,
        else 0)."""
        empties = []
        for t in element_types:
            dims = list(t.shape.values) if isinstance(t.shape, relax.ShapeExpr) else [0] * t.ndim
            dims = [d if isinstance(d, (int, tvm.tirx.IntImm)) else 0 for d in dims]
            empties.append(relax.op.zeros([0, *dims], t.dtype))
        return empties

    def convert(self):
        trip, cond, carried = self._initial()
        body, outer, carried_types, results = self._body(carried)
        element_types = results[1 + self.n_carried:]
        scan_types = [relax.TensorType(ndim=t.ndim + 1, dtype=t.dtype) for t in element_types]
        step = self._step_function(body, carried_types, scan_types, outer)
        bb = self.bb
        if not self.n_scans:
            out = bb.emit(relax.Call(step, [relax.const(0, "int64"), trip, cond, *carried, *outer]))
        else:
            def first():
                zero = relax.const(0, "int64")
                got = self._iterate(body, zero, cond, carried, outer)
                rows = [bb.emit(relax.op.expand_dims(s, 0)) for s in got[1 + self.n_carried:]]
                return relax.Call(step, [relax.const(1, "int64"), trip, got[0], *got[1:1 + self.n_carried],
                                         *rows, *outer])
            ret_ty = relax.TupleType(list(carried_types) + scan_types)

            def start():       # a function of its own: TVM's FuseOps fails on an If in main's dataflow block
                go = bb.emit(relax.op.logical_and(relax.op.less(relax.const(0, "int64"), trip), cond))
                return relax.If(go, self._branch_call(first, f"{self.hint}_first", ret_ty),
                                self._branch_call(lambda: relax.Tuple(carried + self._empty_scans(element_types)),
                                                  f"{self.hint}_none", ret_ty))
            out = bb.emit(self._branch_call(start, f"{self.hint}_start", ret_ty))
        return [bb.emit(relax.TupleGetItem(out, k)) for k in range(self.n_carried + self.n_scans)]
