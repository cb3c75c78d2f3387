"""ScatterND (reduction "none") with one thread per updated element.

TVM 0.27's CUDA ScatterND (topi `scatter_nd`, what Relax legalizes `relax.op.scatter_nd` to) runs one thread per
element of an update slice and loops over the index tuples serially inside it, so that a later duplicate index
wins. When every index tuple addresses a single element (indices [..., rank(data)], what `x[..., a:b] = y` in a
PyTorch export becomes) the whole update runs on ONE thread: gtcrn's 18 ScatterND nodes took 3.1 of its 3.9 ms
a frame on the H100 (ncu). ONNX leaves the result undefined when reduction "none" meets duplicate indices, so the
index tuples can go to threads of their own: out = data, then out[idx(k) + j] = updates[k, j] for every (k, j)
in parallel. An index tuple outside data (after the negative ones are wrapped, which the converter does) is
skipped rather than written out of bounds.
"""
from __future__ import annotations

import math

THREADS = 256


def scatter_nd_func(data_shape, indices_shape, dtype: str, index_dtype: str, gpu: bool = True):
    """prim_func(data, indices, updates, out) for static shapes: data [d0..dn-1], indices [k0..kq-1, m],
    updates [k0..kq-1, dm..dn-1], out like data. gpu=False: the same loops serial (the CPU tests run it)."""
    from tvm.script import tirx as T

    data_shape, indices_shape = [int(d) for d in data_shape], [int(d) for d in indices_shape]
    m = indices_shape[-1]
    tuples = math.prod(indices_shape[:-1])
    slice_size = math.prod(data_shape[m:])
    size = math.prod(data_shape)
    strides = [math.prod(data_shape[t + 1:]) for t in range(m)]
    updates_shape = indices_shape[:-1] + data_shape[m:]
    writes = tuples * slice_size
    copy_blocks, write_blocks = max(1, -(-size // THREADS)), max(1, -(-writes // THREADS))

    def offset(idx, k):
        total = T.int64(0)
        for t in range(m):
            total = total + T.Cast("int64", idx[k, t]) * T.int64(strides[t])
        return total

    def inside(idx, k):
        ok = True
        for t in range(m):
            v = T.Cast("int64", idx[k, t])
            ok = T.And(ok, T.And(v >= T.int64(0), v < T.int64(data_shape[t])))
        return ok

    if gpu:   # a thread an element; else the same loops serial
        block_loop = lambda n: T.thread_binding(n, thread="blockIdx.x")  # noqa: E731
        thread_loop = lambda n: T.thread_binding(n, thread="threadIdx.x")  # noqa: E731
    else:
        block_loop = thread_loop = T.serial

    @T.prim_func(private=True)
    def main(data: T.Buffer(data_shape, dtype), indices: T.Buffer(indices_shape, index_dtype),
             updates: T.Buffer(updates_shape, dtype), out: T.Buffer(data_shape, dtype)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        src = T.decl_buffer((size,), dtype, data=data.data)
        dst = T.decl_buffer((size,), dtype, data=out.data)
        upd = T.decl_buffer((writes,), dtype, data=updates.data)
        idx = T.decl_buffer((tuples, m), index_dtype, data=indices.data)
        for b in block_loop(copy_blocks):
            for t in thread_loop(THREADS):
                if b * THREADS + t < size:
                    dst[b * THREADS + t] = src[b * THREADS + t]
        for b in block_loop(write_blocks):
            for t in thread_loop(THREADS):
                if b * THREADS + t < writes:
                    k = T.meta_var((b * THREADS + t) // slice_size)
                    j = T.meta_var((b * THREADS + t) % slice_size)
                    if inside(idx, k):
                        dst[offset(idx, k) + T.Cast("int64", j)] = upd[b * THREADS + t]

    return main
