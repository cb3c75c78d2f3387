"""Sparse matrices for tvmseq: `CSR` and the kernels `spmm(S, D) = S D`, `spmm_t(S, D) = S^T D`.

`spmm_t` never builds S^T. A CSR matrix carries, built once on first use and cached, a
`TransposeIndexMap`: for every column, the list of its non-zeros in column-major order, each stored
as one integer (its row and its place inside that row), plus the column pointer -- nnz + cols + 1
integers, against 2 nnz + cols + 1 numbers for a stored transpose (indices and a second copy of
the values). The kernel walks that list and reads the values from S's own row-order data.

    >>> S = CSR.from_scipy(scipy.sparse.random(1000, 300, 0.01, format="csr", dtype="float32"))
    >>> G = spmm_t(S, D)          # = S.T @ D, D of shape (1000, n), numpy or DLPack (torch) tensor

This module needs only TVM's runtime when the kernels were prebuilt (`load_kernels`); otherwise
kernels are compiled on first use per (shape, D columns, dtype, index dtypes, target).
"""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from .errors import TvmseqError

VALUE_DTYPES = ("float32", "float16")
INDEX_DTYPES = ("int32", "int64")
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# validation


def validate_csr(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, shape) -> tuple[int, int]:
    """Check a CSR triple; raise TvmseqError naming the array and the first bad entry."""
    if len(shape) != 2 or any(int(s) != s or s < 0 for s in shape):
        raise TvmseqError(f"CSR shape must be two non-negative integers, got {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    for name, arr in (("indptr", indptr), ("indices", indices), ("data", data)):
        if arr.ndim != 1:
            raise TvmseqError(f"CSR {name} must be 1-D, got shape {arr.shape}")
    for name, arr in (("indptr", indptr), ("indices", indices)):
        if str(arr.dtype) not in INDEX_DTYPES:
            raise TvmseqError(f"CSR {name} must be int32 or int64, got {arr.dtype}")
    if str(data.dtype) not in VALUE_DTYPES:
        raise TvmseqError(f"CSR data must be float32 or float16, got {data.dtype} "
                          "(pass dtype='float32' to convert)")
    if len(indptr) != rows + 1:
        raise TvmseqError(f"CSR indptr has length {len(indptr)}, expected rows + 1 = {rows + 1}")
    if indptr[0] != 0:
        raise TvmseqError(f"CSR indptr[0] must be 0, got {indptr[0]}")
    steps = np.diff(indptr)
    if (steps < 0).any():
        row = int(np.flatnonzero(steps < 0)[0])
        raise TvmseqError(f"CSR indptr is not monotone: indptr[{row + 1}] = {indptr[row + 1]} < "
                          f"indptr[{row}] = {indptr[row]}")
    nnz = int(indptr[-1])
    if len(indices) != nnz or len(data) != nnz:
        raise TvmseqError(f"CSR lengths disagree: indptr[-1] = {nnz}, len(indices) = {len(indices)}, "
                          f"len(data) = {len(data)}")
    if nnz > _INT32_MAX or rows > _INT32_MAX or cols > _INT32_MAX:
        raise TvmseqError(f"CSR of shape {shape} with {nnz} non-zeros exceeds 2^31-1 entries/rows")
    if nnz:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= cols:
            pos = int(np.flatnonzero((indices < 0) | (indices >= cols))[0])
            raise TvmseqError(f"CSR indices out of range [0, {cols}): indices[{pos}] = {indices[pos]} "
                              f"(row {_row_of(indptr, pos)})")
        rising = np.diff(indices) > 0
        row_starts = indptr[1:-1]  # a new row may start lower than the previous one ended
        rising[row_starts[(row_starts > 0) & (row_starts < nnz)] - 1] = True
        if not rising.all():
            pos = int(np.flatnonzero(~rising)[0]) + 1
            raise TvmseqError(f"CSR indices are not sorted (strictly increasing) in row "
                              f"{_row_of(indptr, pos)}: indices[{pos - 1}] = {indices[pos - 1]}, "
                              f"indices[{pos}] = {indices[pos]}")
    return rows, cols


def _row_of(indptr: np.ndarray, pos: int) -> int:
    return int(np.searchsorted(indptr, pos, side="right")) - 1


# ----------------------------------------------------------------------------------------------
# transpose index map


@dataclass(frozen=True)
class TransposeIndexMap:
    """Column-major walk over a CSR matrix without copying its values.

    col_ptr[c]..col_ptr[c+1] are the slots of column c; entries[slot] = (row << offset_bits) | place,
    where place is the non-zero's position inside its row, so its value is data[indptr[row] + place].
    Rows appear in increasing order inside each column."""

    col_ptr: np.ndarray  # (cols + 1,)
    entries: np.ndarray  # (nnz,)
    offset_bits: int

    @property
    def dtype(self) -> str:
        return str(self.entries.dtype)

    @property
    def nbytes(self) -> int:
        return self.col_ptr.nbytes + self.entries.nbytes

    @property
    def nonempty_columns(self) -> np.ndarray:
        """The columns that hold at least one non-zero."""
        return np.flatnonzero(np.diff(self.col_ptr))

    def rows(self) -> np.ndarray:
        """Row of each slot (= the CSC indices of S)."""
        return self.entries >> self.offset_bits

    def csr_positions(self, indptr: np.ndarray) -> np.ndarray:
        """For each slot of the column-major order, the non-zero's position in S's row-order data."""
        return indptr[self.rows()] + (self.entries & ((1 << self.offset_bits) - 1))

    def transposed_positions(self, indptr: np.ndarray) -> np.ndarray:
        """For each non-zero in row order, the position it takes in column-major order."""
        out = np.empty(len(self.entries), dtype=np.int64)
        out[self.csr_positions(indptr)] = np.arange(len(self.entries))
        return out


def build_transpose_map(indptr: np.ndarray, indices: np.ndarray, shape) -> TransposeIndexMap:
    rows, cols = shape
    bits = max(cols - 1, 0).bit_length()  # a place inside a row is < cols
    fits32 = rows == 0 or (rows - 1) < (1 << (31 - bits))
    map_dtype = np.int32 if fits32 else np.int64
    counts = np.bincount(indices, minlength=cols)
    col_ptr = np.zeros(cols + 1, dtype=map_dtype)
    np.cumsum(counts, out=col_ptr[1:])
    # a stable sort of the column indices lists each column's non-zeros with rows ascending
    order = np.argsort(indices, kind="stable")
    row_of = np.repeat(np.arange(rows, dtype=map_dtype), np.diff(indptr))[order]
    place = (order - indptr[row_of]).astype(map_dtype)
    entries = (row_of << map_dtype(bits)) | place
    return TransposeIndexMap(col_ptr=col_ptr, entries=entries.astype(map_dtype, copy=False), offset_bits=bits)


# ----------------------------------------------------------------------------------------------
# CSR


class CSR:
    """A validated CSR matrix (host arrays), with its transpose index map and device copies cached."""

    def __init__(self, indptr, indices, data, shape, *, dtype=None, check: bool = True):
        indptr, indices, data = (_host_array(a, n) for a, n in
                                 ((indptr, "indptr"), (indices, "indices"), (data, "data")))
        if dtype is not None:
            data = data.astype(_value_dtype(dtype), copy=False)
        if str(indptr.dtype) != str(indices.dtype) and {str(indptr.dtype), str(indices.dtype)} <= set(INDEX_DTYPES):
            indptr, indices = indptr.astype(np.int64), indices.astype(np.int64)
        shape = tuple(int(s) if isinstance(s, (int, np.integer)) else s for s in shape)
        if check:
            validate_csr(indptr, indices, data, shape)
        # read-only views: the transpose map and the device copies are built from these once
        self.indptr, self.indices, self.data = (_read_only(a) for a in (indptr, indices, data))
        self.shape: tuple[int, int] = shape
        self._device_cache: dict = {}
        self._lock = threading.Lock()

    # --- constructors -------------------------------------------------------------------------
    @classmethod
    def from_scipy(cls, matrix, dtype=None) -> "CSR":
        """Any scipy.sparse matrix/array; converted to canonical CSR (sorted, duplicates summed)."""
        m = matrix.tocsr(copy=True)
        m.sum_duplicates()
        m.sort_indices()
        return cls(m.indptr, m.indices, m.data, m.shape, dtype=dtype)

    @classmethod
    def from_dense(cls, array, dtype=None, index_dtype="int32") -> "CSR":
        """A 2-D numpy array (or anything with __dlpack__/__array__); zeros are dropped."""
        a = _host_array(array, "dense matrix")
        if a.ndim != 2:
            raise TvmseqError(f"dense matrix must be 2-D to become CSR, got shape {a.shape}")
        rows, cols = np.nonzero(a)  # row-major order, sorted
        indptr = np.zeros(a.shape[0] + 1, dtype=index_dtype)
        np.cumsum(np.bincount(rows, minlength=a.shape[0]), out=indptr[1:])
        return cls(indptr, cols.astype(index_dtype), a[rows, cols], a.shape, dtype=dtype)

    @classmethod
    def from_torch(cls, tensor, dtype=None) -> "CSR":
        """A torch sparse CSR tensor (any device), a sparse COO tensor or a dense 2-D tensor."""
        import torch

        if tensor.layout == torch.sparse_coo:
            tensor = tensor.coalesce().to_sparse_csr()
        if tensor.layout != torch.sparse_csr:
            return cls.from_dense(tensor.detach().cpu(), dtype=dtype)
        if tensor.dim() != 2:
            raise TvmseqError(f"torch sparse CSR tensor must be 2-D, got {tensor.dim()}-D (batched)")
        values = tensor.values().detach().cpu()
        if values.dtype == torch.bfloat16:
            raise TvmseqError("CSR data must be float32 or float16, got torch.bfloat16")
        return cls(tensor.crow_indices().cpu().numpy(), tensor.col_indices().cpu().numpy(),
                   values.numpy(), tuple(tensor.shape), dtype=dtype)

    @classmethod
    def from_dlpack(cls, indptr, indices, data, shape, dtype=None) -> "CSR":
        """Three DLPack-capable 1-D arrays (any device; copied to the host once for validation)."""
        return cls(indptr, indices, data, shape, dtype=dtype)

    # --- properties ---------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return len(self.data)

    @property
    def dtype(self) -> str:
        return str(self.data.dtype)

    @property
    def index_dtype(self) -> str:
        return str(self.indices.dtype)

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.shape[0] * self.shape[1])

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.indices.nbytes + self.data.nbytes

    @functools.cached_property
    def transpose_map(self) -> TransposeIndexMap:
        """Built on first use, then kept (the sparsity pattern of a CSR never changes)."""
        return build_transpose_map(self.indptr, self.indices, self.shape)

    def transpose_nbytes(self) -> int:
        """Bytes an explicitly stored transpose (CSR of S^T) would take: indptr, indices, values."""
        return (self.shape[1] + 1) * self.indptr.itemsize + self.indices.nbytes + self.data.nbytes

    def astype(self, dtype) -> "CSR":
        return self.with_data(self.data.astype(_value_dtype(dtype)))

    def with_data(self, data) -> "CSR":
        """The same sparsity pattern with new values (e.g. updated weights): shares indptr, indices
        and the transpose index map (and their device copies), so nothing is rebuilt."""
        data = _host_array(data, "data")
        if data.shape != self.data.shape or str(data.dtype) not in VALUE_DTYPES:
            raise TvmseqError(f"CSR data must be float32/float16 of shape {self.data.shape}, got "
                              f"{data.dtype} of shape {data.shape}")
        out = CSR(self.indptr, self.indices, data.copy(), self.shape, check=False)
        if "transpose_map" in self.__dict__:
            out.__dict__["transpose_map"] = self.transpose_map
        for (transposed, dev), arrays in self._device_cache.items():
            import tvm

            positions = (1,) if transposed else (2,)  # where data sits in the argument list
            out._device_cache[(transposed, dev)] = [
                tvm.runtime.tensor(_at_least_one(out.data), arrays[i].device) if i in positions else a
                for i, a in enumerate(arrays)]
        return out

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape, dtype=self.data.dtype)
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))
        out[rows, self.indices] = self.data
        return out

    def to_scipy(self):
        import scipy.sparse

        data = self.data.astype(np.float32) if self.dtype == "float16" else self.data  # scipy has no float16
        return scipy.sparse.csr_matrix((data, self.indices, self.indptr), shape=self.shape)

    def transpose_csr(self) -> "CSR":
        """An explicit CSR of S^T (what spmm_t avoids; for peers and tests)."""
        tm = self.transpose_map
        pos = tm.csr_positions(self.indptr)
        return CSR(tm.col_ptr.astype(self.index_dtype), tm.rows().astype(self.index_dtype),
                   self.data[pos], (self.shape[1], self.shape[0]), check=False)

    def __repr__(self) -> str:
        return (f"CSR(shape={self.shape}, nnz={self.nnz}, dtype={self.dtype}, "
                f"index_dtype={self.index_dtype})")

    # --- kernel arguments ---------------------------------------------------------------------
    def kernel_arrays(self, transposed: bool) -> list[np.ndarray]:
        """Host arrays in the kernels' argument order: spmm: indptr, indices, data; spmm_t: indptr,
        data, col_ptr, entries. nnz is a symbolic buffer length: an empty matrix passes 1 unused
        element."""
        if transposed:
            tm = self.transpose_map
            arrays = (self.indptr, self.data, tm.col_ptr, tm.entries)
        else:
            arrays = (self.indptr, self.indices, self.data)
        return [_at_least_one(a) for a in arrays]

    def kernel_args(self, transposed: bool, device) -> list:
        """`kernel_arrays` as TVM tensors on `device`, uploaded once per device and kept."""
        import tvm

        key = (transposed, str(device))
        with self._lock:
            if key not in self._device_cache:
                self._device_cache[key] = [tvm.runtime.tensor(a, device) for a in self.kernel_arrays(transposed)]
            return self._device_cache[key]


def as_csr(x, shape=None, dtype=None) -> CSR:
    """CSR from a CSR, a scipy.sparse matrix, a torch sparse/dense tensor, a numpy/DLPack dense
    matrix, or an (indptr, indices, data) tuple with `shape`. Without `dtype`, values the kernels have no
    form for (float64, integers, bool: scipy's and numpy's defaults) become float32; float16 and float32
    stay as they are."""
    if isinstance(x, CSR):
        return x if dtype is None or x.dtype == _value_dtype(dtype) else x.astype(dtype)
    if dtype is None:
        dtype = _float32_unless_supported(_source_value_dtype(x))
    if isinstance(x, tuple) and len(x) == 3:
        if shape is None:
            raise TvmseqError("an (indptr, indices, data) tuple needs shape=(rows, cols)")
        return CSR(*x, shape, dtype=dtype)
    if hasattr(x, "tocsr") and hasattr(x, "nnz"):
        return CSR.from_scipy(x, dtype=dtype)
    if type(x).__module__.startswith("torch"):
        return CSR.from_torch(x, dtype=dtype)
    return CSR.from_dense(x, dtype=dtype)


def _source_value_dtype(x):
    """The dtype of the values `as_csr` would read from x (None when it cannot tell without converting)."""
    if isinstance(x, tuple) and len(x) == 3:
        return getattr(x[2], "dtype", None) or np.asarray(x[2]).dtype
    if isinstance(x, (list, np.ndarray)):
        return np.asarray(x).dtype
    return getattr(x, "dtype", None)


def _float32_unless_supported(dtype) -> str | None:
    """"float32" for real values the kernels lack (float64, integers, bool); None (keep) for float32/float16 and for
    what the constructor should refuse with its own message (complex, bfloat16, unknown)."""
    name = str(dtype).replace("torch.", "") if dtype is not None else None
    if name is None or name in VALUE_DTYPES:
        return None
    try:
        kind = np.dtype(name).kind
    except TypeError:
        return None
    return "float32" if kind in "fiub" else None


def _value_dtype(dtype) -> str:
    name = str(np.dtype(dtype))
    if name not in VALUE_DTYPES:
        raise TvmseqError(f"CSR data must be float32 or float16, got dtype {name}")
    return name


def _host_array(x, name: str) -> np.ndarray:
    """numpy view/copy of a numpy array, list, or DLPack tensor on any device."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        return x.detach().cpu().numpy()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except Exception:  # noqa: BLE001 - device memory: go through TVM
            import tvm

            return tvm.runtime.from_dlpack(x).numpy()
    if hasattr(x, "numpy"):
        return x.numpy()
    try:
        return np.asarray(x)
    except Exception as err:  # noqa: BLE001
        raise TvmseqError(f"{name}: cannot convert {type(x).__name__} to an array") from err


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _at_least_one(a: np.ndarray) -> np.ndarray:
    return a if len(a) else np.zeros(1, dtype=a.dtype)


# ----------------------------------------------------------------------------------------------
# kernels


_PREBUILT: dict[tuple[str, str], object] = {}  # (kernel name, target kind) -> callable, from load_kernels()
_COMPILED: dict[tuple, object] = {}
_COMPILE_LOCK = threading.Lock()


def load_kernels(path) -> dict:
    """Register the kernels of a prebuilt directory (`tvmseq.bench.spmm.build_for_gpu` writes one:
    a library plus index.json listing its kernels, named like `SpmmShape.name`); `spmm`/`spmm_t`
    then use them instead of compiling (only TVM's runtime is needed). Returns name -> kernel."""
    import json

    import tvm

    index_path = os.path.join(os.fspath(path), "index.json")
    if not os.path.isfile(index_path):
        raise TvmseqError(f"no index.json in {path}: not a prebuilt sparse kernel directory")
    with open(index_path) as f:
        index = json.load(f)
    mod = tvm.runtime.load_module(os.path.join(os.fspath(path), index["library"]))
    kernels = {name: mod[name] for name in index["kernels"]}
    for name, func in kernels.items():
        _PREBUILT[(name, index.get("target_kind", "cuda"))] = func
    return kernels


def _runtime_only() -> bool:
    import tvm

    return bool(getattr(tvm.base, "_RUNTIME_ONLY", False))


def _target_kind(target):
    """(target kind name, tvm Target or None, device) for "cuda"/"llvm"/None/a Target.

    TVM's runtime-only library cannot construct a tvm.target.Target (that lives in the compiler
    library), so there the kind is resolved from the name and the device alone: enough to pick a
    prebuilt kernel, which is all that TVM can run."""
    import tvm

    if not _runtime_only() or isinstance(target, tvm.target.Target):
        from . import targets

        target = targets.resolve(target)
        return target.kind.name, target, targets.device_for(target)
    name = "auto" if target is None else str(target)
    if name == "auto":
        name = "cuda" if _cuda_present() else "llvm"
    kind = {"gpu": "cuda", "cpu": "llvm"}.get(name, name.split()[0].split("/")[0])
    if name.startswith("nvidia/"):
        kind = "cuda"
    if kind not in ("cuda", "llvm"):
        raise TvmseqError(f"target {target!r}: this TVM has only its runtime; use \"cuda\" or \"llvm\" "
                          "with prebuilt kernels (tvmseq.sparse.load_kernels)")
    return kind, None, (tvm.cuda(0) if kind == "cuda" else tvm.cpu(0))


def _cuda_present() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # noqa: BLE001 - a missing driver can surface as any error
        return False


def _kernel(shape, target, schedule=None, kind=None):
    """Callable for `shape` (a tvmseq.kernels.sparse.spmm.SpmmShape): prebuilt if registered, else compiled.
    `target` is a tvm Target, or None under runtime-only TVM (then `kind` names the target kind)."""
    kind = kind or target.kind.name
    prebuilt = _PREBUILT.get((shape.name, kind))
    if schedule is None and prebuilt is not None:
        return prebuilt
    key = (shape, str(target), schedule)
    with _COMPILE_LOCK:
        if key not in _COMPILED:
            import tvm

            if target is None or _runtime_only():
                what = "with that schedule " if schedule is not None else ""
                raise TvmseqError(f"kernel {shape.name} ({kind}) is not prebuilt {what}and this TVM has "
                                  "no compiler: build it where TVM's compiler is (python -m "
                                  "tvmseq.bench.spmm --build-only DIR) and call "
                                  "tvmseq.sparse.load_kernels(DIR)")

            from .kernels.sparse.spmm import spmm_func

            func = spmm_func(shape, target, schedule)
            _COMPILED[key] = tvm.compile(tvm.IRModule({shape.name: func}), target=target)[shape.name]
        return _COMPILED[key]


def spmm(S, D, target=None, schedule=None):
    """S @ D for a sparse S (rows x cols) and dense D (cols x n); see `spmm_t` for argument types."""
    return _run(False, S, D, target, schedule)


def spmm_t(S, D, target=None, schedule=None):
    """S^T @ D for a sparse S (rows x cols) and dense D (rows x n), without materialising S^T.

    S: a CSR (or anything `as_csr` accepts). D: a numpy array (the result is numpy) or a DLPack
    tensor on the target's device, e.g. torch (the result is a tvm Tensor: torch.from_dlpack(out)).
    target: "cuda", "llvm" or None (the GPU if present). Deterministic: same inputs, same bits."""
    return _run(True, S, D, target, schedule)


def _run(transposed: bool, S, D, target, schedule):
    import tvm

    S = as_csr(S)
    kind, target, device = _target_kind(target)
    op = "spmm_t" if transposed else "spmm"
    rows, cols = S.shape
    d_rows, out_rows = (rows, cols) if transposed else (cols, rows)
    d, as_numpy = _dense_operand(D, op, d_rows, S.dtype, device)
    n = int(d.shape[1])
    if min(rows, cols, n) == 0:  # nothing to sum: zeros (no kernel takes empty extents)
        zeros = np.zeros((out_rows, n), dtype=S.dtype)
        return zeros if as_numpy else tvm.runtime.tensor(zeros, device)
    from .kernels.sparse.spmm import SpmmShape

    shape = SpmmShape(transposed, rows, cols, n, S.dtype, S.index_dtype,
                      S.transpose_map.dtype if transposed else "int32")
    shape.check()
    kernel = _kernel(shape, target, schedule, kind)
    out = tvm.runtime.empty((out_rows, n), S.dtype, device)
    kernel(*S.kernel_args(transposed, device), d, out)
    return out.numpy() if as_numpy else out


def _dense_operand(D, op: str, rows: int, dtype: str, device):
    """(tvm tensor on device, was numpy) after checking rank, rows, dtype, layout and device."""
    import tvm

    as_numpy = isinstance(D, np.ndarray) or not hasattr(D, "__dlpack__")
    if as_numpy:
        D = np.asarray(D)
        shape, dt = D.shape, str(D.dtype)
    else:
        if hasattr(D, "is_contiguous") and not D.is_contiguous():
            raise TvmseqError(f"{op}: D must be contiguous (row-major); call .contiguous() first")
        D = D if isinstance(D, tvm.runtime.Tensor) else tvm.runtime.from_dlpack(D)
        shape, dt = tuple(D.shape), str(D.dtype)
    if len(shape) != 2:
        raise TvmseqError(f"{op}: D must be 2-D, got shape {tuple(shape)}")
    if shape[0] != rows:
        raise TvmseqError(f"{op}: D has {shape[0]} rows, the sparse operand needs {rows}")
    if dt != dtype:
        raise TvmseqError(f"{op}: D has dtype {dt} but S has {dtype}; convert one of them")
    if as_numpy:
        return tvm.runtime.tensor(np.ascontiguousarray(D), device), True
    if D.device.dlpack_device_type() != device.dlpack_device_type():
        raise TvmseqError(f"{op}: D lives on {D.device}, the kernel runs on {device}")
    return D, False
