"""ONNX `Scan` (opset 9+) rewritten as a `Loop` before import (tvmseq.onnx.loop then takes it).

    Scan(state..., x...) <body(state..., x_t...) -> (state'..., y_t...)>  ->  (final state..., y...)

Each scan input is moved to run along axis 0 and reversed where its direction says (a Transpose, a Slice of step
-1), the loop's trip count is its length, and the loop body gathers element i of every scan input from the scope
around it before the Scan's own body runs; the loop stacks the scan outputs along axis 0, which are then reversed
and moved to their axes as the attributes say. Scan of opset 8 (a batch axis and sequence_lens) is refused.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UnsupportedOnnxError

INT64_MIN = np.iinfo(np.int64).min


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Names:
    """Fresh value names prefixed by the Scan node's."""

    def __init__(self, node, index: int):
        base = "".join(c if c.isalnum() else "_" for c in (node.name or f"scan{index}"))
        self.prefix, self.count = f"{base}__loop", 0

    def __call__(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}_{what}{self.count}"


def _move_axis(name, axis, rank, to_front, new, nodes):
    """`name` with `axis` moved to the front (to_front) or the front axis moved to `axis`: a Transpose, or the
    name itself where nothing moves."""
    if axis == 0:
        return name
    perm = list(range(rank))
    perm = [axis] + [d for d in perm if d != axis] if to_front else [d for d in range(1, rank)][:axis] + [0] + \
        list(range(axis + 1, rank))
    out = new("moved")
    nodes.append(helper.make_node("Transpose", [name], [out], perm=perm))
    return out


def _reverse_front(name, new, nodes, inits):
    """`name` reversed along axis 0 (a Slice of step -1 from the last element to before the first)."""
    bounds = [(new("start"), [-1]), (new("end"), [INT64_MIN]), (new("axis"), [0]), (new("step"), [-1])]
    inits.extend(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in bounds)
    out = new("reversed")
    nodes.append(helper.make_node("Slice", [name] + [n for n, _ in bounds], [out]))
    return out


def _rank(name, ranks, node, what):
    if name not in ranks:
        raise UnsupportedOnnxError(node.name or "(unnamed)", "Scan", f"{what} needs the rank of '{name}', which "
                                   "shape inference does not know")
    return ranks[name]


def _loop_of(node, index: int, ranks: dict, inits: list) -> list:
    """The nodes that replace one Scan node (module doc)."""
    new = _Names(node, index)
    body = _attr(node, "body", None)
    m = int(_attr(node, "num_scan_inputs", 0))
    n = len(node.input) - m
    k = len(body.output) - n
    in_axes = list(_attr(node, "scan_input_axes", [0] * m))
    in_dirs = list(_attr(node, "scan_input_directions", [0] * m))
    out_axes = list(_attr(node, "scan_output_axes", [0] * k))
    out_dirs = list(_attr(node, "scan_output_directions", [0] * k))
    nodes, scanned = [], []
    for j, name in enumerate(node.input[n:]):
        axis = in_axes[j]
        rank = _rank(name, ranks, node, "a scan input axis") if axis != 0 else None
        moved = _move_axis(name, axis % rank if rank else 0, rank, True, new, nodes)
        scanned.append(_reverse_front(moved, new, nodes, inits) if in_dirs[j] else moved)
    shape, zero, trip = new("shape"), new("zero"), new("trip")
    inits.append(numpy_helper.from_array(np.array(0, np.int64), zero))
    nodes += [helper.make_node("Shape", [scanned[0]], [shape]),
              helper.make_node("Gather", [shape, zero], [trip], axis=0)]
    i, cond_in, cond_out = new("i"), new("cond_in"), new("cond_out")
    gathers = [helper.make_node("Gather", [x, i], [body.input[n + j].name], axis=0) for j, x in enumerate(scanned)]
    loop_body = helper.make_graph(
        gathers + list(body.node) + [helper.make_node("Identity", [cond_in], [cond_out])], f"{new.prefix}_body",
        [helper.make_tensor_value_info(i, onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info(cond_in, onnx.TensorProto.BOOL, []), *body.input[:n]],
        [helper.make_tensor_value_info(cond_out, onnx.TensorProto.BOOL, []), *body.output],
        initializer=list(body.initializer))
    stacked = [new("stacked") for _ in range(k)]
    nodes.append(helper.make_node("Loop", [trip, "", *node.input[:n]], [*node.output[:n], *stacked],
                                  name=f"{new.prefix}", body=loop_body))
    for j, (rows, out) in enumerate(zip(stacked, node.output[n:])):
        value = _reverse_front(rows, new, nodes, inits) if out_dirs[j] else rows
        axis = out_axes[j]
        if axis != 0:
            rank = _rank(body.output[n + j].name, ranks, node, "a scan output axis") + 1
            value = _move_axis(value, axis % rank, rank, False, new, nodes)
        nodes.append(helper.make_node("Identity", [value], [out]))
    return nodes


def scans_to_loops(model: onnx.ModelProto, ranks: dict) -> None:
    """Every Scan of the main graph replaced by a Loop (module doc); `ranks`: value name -> rank, where known."""
    graph = model.graph
    if not any(n.op_type == "Scan" for n in graph.node):
        return
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    nodes, inits = [], []
    for index, node in enumerate(graph.node):
        if node.op_type != "Scan":
            nodes.append(node)
            continue
        if opset < 9:
            raise UnsupportedOnnxError(node.name or "(unnamed)", "Scan", "Scan of opset 8 (batch axis, "
                                       "sequence_lens) is not supported: opset 9 or later")
        nodes += _loop_of(node, index, ranks, inits)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
