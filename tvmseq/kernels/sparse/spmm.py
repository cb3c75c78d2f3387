"""Sparse (CSR) x dense matmul in TensorIR: `spmm(S, D) = S D` and `spmm_t(S, D) = S^T D`.

Both kernels are one "gather rows" loop: every output row is a weighted sum of rows of D,

    out[o, :] = sum over the non-zeros k of o:  value(k) * D[row(k), :]

and differ only in which non-zeros belong to output row `o` and how they are decoded:

* spmm:   o is a row of S; its non-zeros are S's CSR entries indptr[o]..indptr[o+1], row(k) =
          indices[k], value(k) = data[k].
* spmm_t: o is a column of S; its non-zeros are listed by the transpose index map
          (`tvmseq.sparse.TransposeIndexMap`): col_ptr[o]..col_ptr[o+1] are slots of a column-major
          walk, entry[k] = (row r << offset_bits) | (place of the non-zero inside row r), so value(k) =
          data[indptr[r] + place] is read from S's own row-order data. S^T is never materialised and
          S's column indices are not read at all.

Each output row is owned by `split` groups of `lanes` threads (one thread on the CPU); the lanes
divide its columns into `vec`-wide vector loads, the groups take turns over its non-zeros (batches
of `unroll`, decoded before their D rows are read so that many row loads are in flight: the
gathers are latency bound), and group 0 adds the other groups' partial sums from shared memory in
group order. Every result is therefore summed in a fixed order: deterministic, no atomics. The
split multiplies the threads working on few, long output rows (S^T of a 4096-column S has only
4096 rows) so the GPU is full. Empty rows/columns simply write zeros.

Kernels are built per (S shape, D columns, dtype, index dtypes); the number of non-zeros is
symbolic, so one build serves every sparsity pattern of that shape. `n_cols=None` makes the number
of D columns symbolic too (column tiles on blockIdx.y). `spmm_t_scatter_func` is the atomic,
row-order alternative the benchmark compares with (not deterministic).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import tvm
try:
    from tvm.script import tirx as T
except ImportError:  # runtime-only TVM (a deployment box): shapes and schedules still import, no building
    T = None

from ...errors import TvmseqError
from ...targets import is_gpu

SUPPORTED_DTYPES = ("float32", "float16")
INDEX_DTYPES = ("int32", "int64")
VECTOR_BYTES = 16  # one 128-bit load per thread per chunk on the GPU
SHARED_BYTES = 48 * 1024  # static shared memory a block may use without opting in
TARGET_THREADS = 400_000  # ~1.5 waves of 2048 threads on each of an H100's 132 SMs


@dataclass(frozen=True)
class SpmmSchedule:
    """Tunable launch shape. A GPU block has split x rows_per_block x lanes threads; on the CPU the
    block loop runs in parallel and the lanes are a serial loop. A lane accumulates `chunks`
    vectors of `vec` columns; when lanes x chunks x vec columns do not cover D (wide or symbolic D),
    column tiles of that width go to blockIdx.y (GPU) or an outer serial loop (CPU)."""

    vec: int  # elements per vector load/store (divides the number of D columns)
    lanes: int  # threads sharing one output row's columns
    rows_per_block: int  # output rows per thread block
    unroll: int  # non-zeros decoded ahead of their D-row loads
    split: int = 1  # thread groups sharing one output row's non-zeros (GPU only)
    chunks: int | None = None  # vectors per lane; None: enough to cover all columns (static D only)

    def lane_chunks(self, n_cols: int | None) -> int:
        """Vector chunks each lane handles in one column tile."""
        if self.chunks is not None:
            return self.chunks
        return -(-n_cols // (self.vec * self.lanes))

    def tile_width(self, n_cols: int | None) -> int:
        return self.vec * self.lanes * self.lane_chunks(n_cols)

    def shared_bytes(self, n_cols: int | None) -> int:
        """Shared memory for the partial sums of groups 1..split-1."""
        return 4 * (self.split - 1) * self.rows_per_block * self.tile_width(n_cols)

    def check(self, n_cols: int | None, target: tvm.target.Target) -> None:
        if min(self.vec, self.lanes, self.rows_per_block, self.unroll, self.split, self.chunks or 1) < 1:
            raise TvmseqError(f"schedule fields must be >= 1: {self}")
        if n_cols is None and (self.vec != 1 or self.chunks is None):
            raise TvmseqError(f"a kernel for a symbolic number of D columns needs vec=1 and fixed chunks: {self}")
        if n_cols is not None and n_cols % self.vec:
            raise TvmseqError(f"schedule vec={self.vec} does not divide the {n_cols} columns of D")
        if is_gpu(target):
            if self.split * self.lanes * self.rows_per_block > 1024:
                raise TvmseqError(f"schedule {self} needs more than 1024 threads per block")
            if self.shared_bytes(n_cols) > SHARED_BYTES:
                raise TvmseqError(f"schedule {self} needs {self.shared_bytes(n_cols)} bytes of shared memory")
        elif self.split != 1:
            raise TvmseqError(f"the CPU schedule takes split=1, got {self}")


def default_schedule(shape: "SpmmShape", target: tvm.target.Target, measured: bool = True) -> SpmmSchedule:
    """GPU: 16-byte loads, a warp per output row (more lanes for wide D: at most 4 chunks a lane),
    the non-zeros split over up to 8 groups until ~400k threads run, 256 threads a block, 4
    non-zeros in flight. CPU: 64-byte vectors, a serial 'lane' per block of up to 4 vectors of
    columns (the accumulators stay in registers), one output row per parallel task. Symbolic D
    columns: scalar accesses in column tiles of 128 (GPU) / 16 (CPU) columns."""
    gpu, n_cols = is_gpu(target), shape.n_cols
    if measured and gpu:  # a measured winner (schedules/tune_spmm.py -> schedules/measured/spmm.json)
        from ...tune import measured as db

        config = db.lookup("spmm", **dataclasses.asdict(shape))
        if config:
            return SpmmSchedule(**config)
    if n_cols is None:
        lanes, vec, chunks = (32, 1, 4) if gpu else (1, 1, 16)
        tiles = 1
    else:
        vec = (VECTOR_BYTES if gpu else 64) // np.dtype(shape.dtype).itemsize
        while n_cols % vec:
            vec //= 2
        per_row = n_cols // vec  # vectors in one output row
        chunks = None
        if not gpu:
            return SpmmSchedule(vec=vec, lanes=-(-per_row // 4), rows_per_block=1, unroll=4)
        lanes = min(per_row, 32 if per_row <= 128 else min(256, -(-per_row // 4)))
        divisor = next(d for d in range(lanes, 0, -1) if per_row % d == 0)
        if 2 * divisor >= lanes:  # an exact split needs no column guard
            lanes = divisor
        tiles = 1
    if not gpu:
        return SpmmSchedule(vec=vec, lanes=lanes, rows_per_block=1, unroll=4, chunks=chunks)
    split = 1
    while split < 8 and shape.out_rows * lanes * tiles * split < TARGET_THREADS and split * lanes < 256:
        split *= 2
    rows_per_block = max(1, 256 // (lanes * split))
    sched = SpmmSchedule(vec=vec, lanes=lanes, rows_per_block=rows_per_block, unroll=4, split=split,
                         chunks=chunks)
    while sched.split > 1 and sched.shared_bytes(n_cols) > SHARED_BYTES:
        sched = SpmmSchedule(vec=vec, lanes=lanes, rows_per_block=rows_per_block, unroll=4,
                             split=sched.split // 2, chunks=chunks)
    return sched


@dataclass(frozen=True)
class SpmmShape:
    """Static shape/dtype key a kernel is built for (nnz is always symbolic; n_cols=None makes the
    number of D columns symbolic too, e.g. a dynamic batch in an ONNX model)."""

    transposed: bool  # False: spmm (S D); True: spmm_t (S^T D)
    rows: int  # rows of S
    cols: int  # columns of S
    n_cols: int | None  # columns of D and of the output (None: symbolic)
    dtype: str = "float32"  # S values, D and output
    index_dtype: str = "int32"  # S.indptr (and S.indices for spmm)
    map_dtype: str = "int32"  # transpose index map entries (spmm_t)

    @property
    def out_rows(self) -> int:
        return self.cols if self.transposed else self.rows

    @property
    def d_rows(self) -> int:
        return self.rows if self.transposed else self.cols

    @property
    def offset_bits(self) -> int:
        """Bits of a map entry holding the place inside a row (< cols); the row sits above them."""
        return max(self.cols - 1, 0).bit_length()

    @property
    def name(self) -> str:
        op = "spmm_t" if self.transposed else "spmm"
        idx = self.index_dtype + (f"_{self.map_dtype}" if self.transposed else "")
        n = "dyn" if self.n_cols is None else self.n_cols
        return f"{op}_{self.rows}x{self.cols}_n{n}_{self.dtype}_{idx}"

    def check(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise TvmseqError(f"sparse matmul supports {SUPPORTED_DTYPES}, not dtype {self.dtype}")
        for what in ("index_dtype", "map_dtype"):
            if getattr(self, what) not in INDEX_DTYPES:
                raise TvmseqError(f"{what} must be int32 or int64, not {getattr(self, what)}")
        if min(self.rows, self.cols, 1 if self.n_cols is None else self.n_cols) < 1:
            raise TvmseqError(f"sparse matmul needs non-empty operands, got S {self.rows}x{self.cols} "
                              f"and {self.n_cols} columns of D")
        if self.n_cols is not None and max(self.out_rows, self.d_rows) * self.n_cols >= 2**31:
            raise TvmseqError(f"dense operand/output of {max(self.out_rows, self.d_rows)}x{self.n_cols} "
                              "elements exceeds the kernels' int32 addressing")
        if self.transposed and self.map_dtype == "int32" and (self.rows - 1) >> (31 - self.offset_bits):
            raise TvmseqError(f"S of {self.rows}x{self.cols} needs an int64 transpose index map")


def spmm_func(shape: SpmmShape, target: tvm.target.Target,
              schedule: SpmmSchedule | None = None) -> tvm.tirx.PrimFunc:
    """Ready-to-build prim_func for `shape` with the CUDA or CPU schedule of `target`.

    spmm   signature: (indptr[rows+1], indices[nnz], data[nnz], D[cols, n], out[rows, n])
    spmm_t signature: (indptr[rows+1], data[nnz], col_ptr[cols+1], entries[nnz], D[rows, n], out[cols, n])
    """
    shape.check()
    sched = schedule or default_schedule(shape, target)
    sched.check(shape.n_cols, target)
    func = _spmm_t_func(shape, sched, target) if shape.transposed else _spmm_func(shape, sched, target)
    return func.with_attr("global_symbol", shape.name).with_attr("tirx.is_scheduled", True)


def _gather_rows_macro(shape: SpmmShape, sched: SpmmSchedule, target):
    """The shared kernel body: a TIR macro over (iteration pointer, entries, indptr, data, D, out, n)."""
    gpu = is_gpu(target)
    dtype, out_rows, static_n = shape.dtype, shape.out_rows, shape.n_cols
    vec, lanes, rpb, unroll, split = sched.vec, sched.lanes, sched.rows_per_block, sched.unroll, sched.split
    chunks, width = sched.lane_chunks(static_n), sched.tile_width(static_n)
    # columns past the end exist when the tiles overhang D (always possible for a symbolic n)
    col_guard = static_n is None or static_n % width != 0
    row_guard = out_rows % rpb != 0
    n_blocks = -(-out_rows // rpb)
    step = unroll * split  # non-zeros consumed by all groups of a row in one iteration
    bits, transposed = shape.offset_bits, shape.transposed
    mask = (1 << bits) - 1
    if gpu:
        row_blocks = lambda n: T.thread_binding(n, thread="blockIdx.x")  # noqa: E731
        col_tiles = lambda n: T.thread_binding(n, thread="blockIdx.y")  # noqa: E731
        threads = lambda n: T.thread_binding(n, thread="threadIdx.x")  # noqa: E731
    else:
        row_blocks, col_tiles, threads = T.parallel, T.serial, T.serial
    i32, f32 = (lambda x: T.Cast("int32", x)), (lambda x: T.Cast("float32", x))  # noqa: E731

    @T.macro
    def body(iter_ptr, entries, indptr, data, D, out, n):
        for blk in row_blocks(n_blocks):
            for tile in col_tiles((n + width - 1) // width):
                if split > 1:  # partial sums of groups 1..split-1, added by group 0
                    partial = T.alloc_buffer((split - 1, rpb, width), "float32", scope="shared")
                for t in threads(split * rpb * lanes):
                    acc = T.alloc_buffer((chunks * vec,), "float32", scope="local")
                    src_row = T.alloc_buffer((unroll,), "int32", scope="local")
                    src_val = T.alloc_buffer((unroll,), "float32", scope="local")
                    d_tile = T.alloc_buffer((unroll, chunks * vec), dtype, scope="local")
                    o_vec = T.alloc_buffer((vec,), dtype, scope="local")
                    lane: T.let = t % lanes
                    row_in_block: T.let = t // lanes % rpb
                    group: T.let = t // (lanes * rpb)
                    o: T.let = blk * rpb + row_in_block
                    # rows past the end run zero iterations (every thread must reach the barrier)
                    start: T.let = T.if_then_else(o < out_rows, i32(iter_ptr[T.min(o, out_rows - 1)]), 0)
                    end: T.let = T.if_then_else(o < out_rows, i32(iter_ptr[T.min(o, out_rows - 1) + 1]), 0)
                    for i in T.unroll(chunks * vec):
                        acc[i] = T.float32(0)
                    for kb in T.serial((end - start + step - 1) // step):
                        # decode `unroll` non-zeros without branches: a slot past the row's end reads
                        # the row's last entry (valid) and gets the value 0
                        for u in T.unroll(unroll):
                            k_raw: T.let = start + (kb * split + group) * unroll + u
                            k: T.let = T.min(k_raw, end - 1)
                            if transposed:
                                r: T.let = i32(entries[k] >> bits)
                                src_row[u] = r
                                src_val[u] = T.Select(k_raw < end,
                                                      f32(data[i32(indptr[r]) + i32(entries[k] & mask)]),
                                                      T.float32(0))
                            else:
                                src_row[u] = i32(entries[k])
                                src_val[u] = T.Select(k_raw < end, f32(data[k]), T.float32(0))
                        # every D-row load of the batch before any arithmetic: unroll x chunks in flight
                        for u in T.unroll(unroll):
                            for c in T.unroll(chunks):
                                col0: T.let = tile * width + (c * lanes + lane) * vec
                                if not col_guard or col0 < n:
                                    for v in T.vectorized(vec):
                                        d_tile[u, c * vec + v] = D[src_row[u], col0 + v]
                        for u in T.unroll(unroll):
                            for c in T.unroll(chunks):
                                if not col_guard or tile * width + (c * lanes + lane) * vec < n:
                                    for v in T.unroll(vec):
                                        acc[c * vec + v] = acc[c * vec + v] + src_val[u] * f32(d_tile[u, c * vec + v])
                    if split > 1:
                        if group > 0:
                            for c in T.unroll(chunks):
                                for v in T.vectorized(vec):
                                    partial[group - 1, row_in_block, (c * lanes + lane) * vec + v] = acc[c * vec + v]
                        T.tvm_storage_sync("shared")
                    if (not row_guard or o < out_rows) and (split == 1 or group == 0):
                        for c in T.unroll(chunks):
                            if not col_guard or tile * width + (c * lanes + lane) * vec < n:
                                for v in T.unroll(vec):
                                    if split > 1:
                                        for g in T.unroll(split - 1):  # fixed group order: deterministic
                                            acc[c * vec + v] = acc[c * vec + v] + partial[
                                                g, row_in_block, (c * lanes + lane) * vec + v]
                                    o_vec[v] = T.Cast(dtype, acc[c * vec + v])
                                for v in T.vectorized(vec):
                                    out[o, tile * width + (c * lanes + lane) * vec + v] = o_vec[v]

    return body


def _dense_cols(shape: SpmmShape):
    """The number of D columns: an int, or a fresh symbolic var bound by D's match_buffer."""
    return shape.n_cols if shape.n_cols is not None else tvm.tirx.Var("n", "int32")


def _spmm_func(shape: SpmmShape, sched: SpmmSchedule, target):
    rows, cols, dtype, idx = shape.rows, shape.cols, shape.dtype, shape.index_dtype
    body, n = _gather_rows_macro(shape, sched, target), _dense_cols(shape)

    @T.prim_func
    def spmm(indptr: T.Buffer((rows + 1,), idx), a_indices: T.handle, a_data: T.handle,
             a_dense: T.handle, a_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        nnz = T.int32()
        indices = T.match_buffer(a_indices, (nnz,), idx)
        data = T.match_buffer(a_data, (nnz,), dtype)
        D = T.match_buffer(a_dense, (cols, n), dtype)
        out = T.match_buffer(a_out, (rows, n), dtype)
        body(indptr, indices, indptr, data, D, out, n)

    return spmm


def _spmm_t_func(shape: SpmmShape, sched: SpmmSchedule, target):
    rows, cols, dtype, idx, mdt = shape.rows, shape.cols, shape.dtype, shape.index_dtype, shape.map_dtype
    body, n = _gather_rows_macro(shape, sched, target), _dense_cols(shape)

    @T.prim_func
    def spmm_t(indptr: T.Buffer((rows + 1,), idx), a_data: T.handle, col_ptr: T.Buffer((cols + 1,), mdt),
               a_entries: T.handle, a_dense: T.handle, a_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        nnz = T.int32()
        data = T.match_buffer(a_data, (nnz,), dtype)
        entries = T.match_buffer(a_entries, (nnz,), mdt)
        D = T.match_buffer(a_dense, (rows, n), dtype)
        out = T.match_buffer(a_out, (cols, n), dtype)
        body(col_ptr, entries, indptr, data, D, out, n)

    return spmm_t


def spmm_t_scatter_func(shape: SpmmShape, target: tvm.target.Target,
                        schedule: SpmmSchedule | None = None) -> tvm.tirx.PrimFunc:
    """The scatter alternative to spmm_t, for comparison only (CUDA, float32): S is read in row order,
    each row's D row is loaded once into registers, and every non-zero (r, c) atomically adds
    value * D[r, :] to out[c, :]. The order of the atomic additions varies from run to run, so the
    result is NOT deterministic; `out` must be zeroed before the call.

    signature: (indptr[rows+1], indices[nnz], data[nnz], D[rows, n], out[cols, n])"""
    if not shape.transposed or shape.dtype != "float32" or shape.n_cols is None or not is_gpu(target):
        raise TvmseqError("the scatter variant exists for spmm_t, float32, static D columns, on CUDA")
    shape.check()
    sched = schedule or default_schedule(SpmmShape(False, shape.rows, shape.cols, shape.n_cols, shape.dtype,
                                                   shape.index_dtype), target)
    rows, cols, n, idx = shape.rows, shape.cols, shape.n_cols, shape.index_dtype
    vec, lanes, rpb = sched.vec, sched.lanes, sched.rows_per_block * sched.split
    chunks = sched.lane_chunks(n)
    col_guard, row_guard = n % (vec * lanes * chunks) != 0, rows % rpb != 0
    i32 = lambda x: T.Cast("int32", x)  # noqa: E731

    @T.prim_func
    def spmm_t_scatter(indptr: T.Buffer((rows + 1,), idx), a_indices: T.handle, a_data: T.handle,
                       D: T.Buffer((rows, n), "float32"), out: T.Buffer((cols, n), "float32")):
        T.func_attr({"tirx.noalias": True})
        nnz = T.int32()
        indices = T.match_buffer(a_indices, (nnz,), idx)
        data = T.match_buffer(a_data, (nnz,), "float32")
        for blk in T.thread_binding(-(-rows // rpb), thread="blockIdx.x"):
            for t in T.thread_binding(rpb * lanes, thread="threadIdx.x"):
                d_row = T.alloc_buffer((chunks * vec,), "float32", scope="local")
                r: T.let = blk * rpb + t // lanes
                lane: T.let = t % lanes
                if not row_guard or r < rows:
                    for c in T.unroll(chunks):  # this row of D stays in registers for all its non-zeros
                        if not col_guard or (c * lanes + lane) * vec < n:
                            for v in T.vectorized(vec):
                                d_row[c * vec + v] = D[r, (c * lanes + lane) * vec + v]
                    for k in T.serial(i32(indptr[r]), i32(indptr[r + 1])):
                        for c in T.unroll(chunks):
                            if not col_guard or (c * lanes + lane) * vec < n:
                                for v in T.unroll(vec):
                                    T.evaluate(T.cuda.atomic_add(
                                        T.address_of(out[i32(indices[k]), (c * lanes + lane) * vec + v]),
                                        data[k] * d_row[c * vec + v]))

    return spmm_t_scatter.with_attr("global_symbol", shape.name + "__scatter").with_attr("tirx.is_scheduled", True)
