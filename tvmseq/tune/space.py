"""A hand-written tiled GEMM schedule template in s_tir and its search space (genes).

The problem is `C[M, N] = A[M, K] @ B (+ bias[N])`, B stored `[K, N]` ("kn") or `[N, K]` ("nk", the layout
of ONNX GRU / nn.Linear weights). The CUDA schedule is the classic SIMT SGEMM:

* a thread block computes a `bm x bn` tile of C; its threads form a `(bm/tm) x (bn/tn)` grid and each
  holds a `tm x tn` accumulator tile in registers, made of `(tm/wm) x (tn/wn)` chunks of `wm x wn`
  elements spaced a thread-grid apart (TVM's virtual threads), so the per-thread fragments are read
  from shared memory as `wm`/`wn`-wide vectors without bank conflicts;
* `warp_n` picks the warp's shape inside the thread grid (threads along N, the rest along M);
* A (and B when stored `[N, K]`) is staged in shared memory transposed to `[bk][bm]`, so the fragment
  loads are contiguous along M; `pad` floats are added per shared row against bank conflicts;
* every `bk` slice of K is copied global -> shared cooperatively with `vec`-wide loads, with
  `stages` shared buffers (software pipelining: 2 = double buffering) and optionally `cp.async`;
* the k-slice loop is fully unrolled; the epilogue (bias) is fused into the register -> global store.

Genes are the tile/thread factors above. `feasible()` rejects what cannot build or would be slow for a
known reason (tiles that do not divide, too many threads, too much shared memory, a register estimate
that would spill) without building anything. `apply()` returns the scheduled IRModule, for CUDA or,
with the same loop structure but no thread bindings, for the CPU (tests check it against numpy).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import random
from dataclasses import dataclass, field

from ..errors import TvmseqError

# tvm is imported inside the functions that build IR: GemmProblem, the genes and feasible() are pure
# Python, so the GPU-side measuring script can use them where only TVM's runtime is installed.

# Each gene's choices, smallest first. Ordered: the GA's two-point crossover cuts this sequence.
GENES: dict[str, tuple[int, ...]] = {
    "bm": (16, 32, 64, 128, 256),   # block tile rows
    "bn": (16, 32, 64, 128, 256),   # block tile columns
    "bk": (4, 8, 16, 32),           # K slice staged in shared memory per main-loop step
    "tm": (1, 2, 4, 8, 16),         # accumulator rows per thread
    "tn": (1, 2, 4, 8, 16),         # accumulator columns per thread
    "wm": (1, 2, 4),                # contiguous rows per thread chunk (vector width of A fragment loads)
    "wn": (1, 2, 4),                # contiguous columns per chunk (B fragment loads and C stores)
    "warp_n": (1, 2, 4, 8, 16, 32),  # threads of one warp along N (32 / warp_n along M)
    "vec": (1, 2, 4),               # global -> shared vector width (element copies for a transposing cp.async)
    "stages": (1, 2, 3),            # shared-memory buffers (software pipeline depth)
    "async_copy": (0, 1),           # cp.async for global -> shared (needs stages >= 2)
    "pad": (0, 4),                  # floats added per shared-memory row
}

# A smaller space (every feasible point can be built and measured in one GPU session): the choices
# that matter for large fp32 GEMMs on sm_80/sm_90. `schedules/tune_gemm.py pool` builds all of it.
COMPACT_GENES: dict[str, tuple[int, ...]] = {
    "bm": (64, 128, 256), "bn": (64, 128, 256), "bk": (8, 16), "tm": (4, 8, 16), "tn": (4, 8, 16),
    "wm": (4,), "wn": (4,), "warp_n": (4, 8), "vec": (4,), "stages": (2, 3), "async_copy": (0, 1),
    "pad": (4,),
}

# The classic 128x128x8 SGEMM with 8x8 per thread, double buffered: a safe default and a GA seed.
DEFAULT_GENES: dict[str, int] = {
    "bm": 128, "bn": 128, "bk": 8, "tm": 8, "tn": 8, "wm": 4, "wn": 4, "warp_n": 8, "vec": 4,
    "stages": 2, "async_copy": 0, "pad": 4,
}

WARP = 32
# Registers a thread needs besides its accumulators: fragments, addresses, loop state; calibrated on
# ptxas -v for sm_90a (8x8 per thread: 125-127 registers, 16x8: 208).
_REG_OVERHEAD = 32
_MAX_REGS_PER_THREAD = 255
_ELEM_BYTES = {"float32": 4, "float16": 2}


@dataclass(frozen=True)
class GemmProblem:
    """Static GEMM shape and layout: C[m, n] = A[m, k] @ B (+ bias[n])."""

    m: int
    n: int
    k: int
    dtype: str = "float32"
    b_layout: str = "kn"   # "kn": B is [k, n]; "nk": B is [n, k] (C = A @ B^T)
    bias: bool = False

    def __post_init__(self):
        if min(self.m, self.n, self.k) < 1:
            raise TvmseqError(f"GEMM sizes must be positive, got m={self.m} n={self.n} k={self.k}")
        if self.b_layout not in ("kn", "nk"):
            raise TvmseqError(f"b_layout must be 'kn' or 'nk', got {self.b_layout!r}")
        if self.dtype not in ("float32", "float16"):
            raise TvmseqError(f"GEMM dtype must be float32 or float16, got {self.dtype!r}")

    @property
    def key(self) -> str:
        """Stable name used for kernel names, database and artifact entries."""
        dt = {"float32": "f32", "float16": "f16"}[self.dtype]
        return f"gemm_m{self.m}_n{self.n}_k{self.k}_{dt}_{self.b_layout}{'_bias' if self.bias else ''}"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.k, self.n) if self.b_layout == "kn" else (self.n, self.k)

    def to_json(self) -> dict:
        return {"m": self.m, "n": self.n, "k": self.k, "dtype": self.dtype, "b_layout": self.b_layout,
                "bias": self.bias}


def gemm_func(problem: GemmProblem):
    """The unscheduled compute (PrimFunc): block "gemm" (reduction over k) and, with a bias, block
    "epilogue"."""
    import tvm
    from tvm.script import tirx as T

    m, n, k, dt = problem.m, problem.n, problem.k, problem.dtype
    nk = problem.b_layout == "nk"
    zero = tvm.tirx.const(0, dt)

    if not problem.bias:
        @T.prim_func(s_tir=True)
        def gemm(A: T.Buffer((m, k), dt), B: T.Buffer(problem.b_shape, dt), C: T.Buffer((m, n), dt)):
            T.func_attr({"tirx.noalias": True})
            for i, j, r in T.grid(m, n, k):
                with T.sblock("gemm"):
                    vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                    with T.init():
                        C[vi, vj] = zero
                    C[vi, vj] = C[vi, vj] + A[vi, vr] * (B[vj, vr] if nk else B[vr, vj])

        return gemm

    @T.prim_func(s_tir=True)
    def gemm_bias(A: T.Buffer((m, k), dt), B: T.Buffer(problem.b_shape, dt), bias: T.Buffer((n,), dt),
                  C: T.Buffer((m, n), dt)):
        T.func_attr({"tirx.noalias": True})
        acc = T.sblock_alloc_buffer((m, n), dt)
        for i, j, r in T.grid(m, n, k):
            with T.sblock("gemm"):
                vi, vj, vr = T.axis.remap("SSR", [i, j, r])
                with T.init():
                    acc[vi, vj] = zero
                acc[vi, vj] = acc[vi, vj] + A[vi, vr] * (B[vj, vr] if nk else B[vr, vj])
        for i, j in T.grid(m, n):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                C[vi, vj] = acc[vi, vj] + bias[vj]

    return gemm_bias


def _limit(target, key: str, default: int) -> int:
    value = target.attrs.get(key) if target is not None else None
    return int(value) if value is not None else default


def threads_of(genes: dict) -> int:
    return (genes["bm"] // genes["tm"]) * (genes["bn"] // genes["tn"])


def shared_bytes(genes: dict, problem: GemmProblem) -> int:
    """Shared memory of all pipeline buffers, padded rows included (rows are K-slices of the tile)."""
    elem = _ELEM_BYTES[problem.dtype]
    a_row = _padded(genes["bm"], genes["pad"])
    b_row = _padded(genes["bn"], genes["pad"])
    return genes["stages"] * genes["bk"] * (a_row + b_row) * elem


def _padded(row: int, pad: int) -> int:
    # storage_align(factor=32, offset=pad): the smallest stride >= row with stride % 32 == pad
    if pad == 0:
        return row
    return row + (pad - row) % 32


def copy_vector(genes: dict, transposed: bool) -> int:
    """Vector width of one operand's global -> shared copy: cp.async moves contiguous bytes, so a
    transposing cp.async copies element by element."""
    return 1 if transposed and genes["async_copy"] else genes["vec"]


def registers_estimate(genes: dict) -> int:
    return genes["tm"] * genes["tn"] + 2 * (genes["tm"] + genes["tn"]) + _REG_OVERHEAD


def feasible(genes: dict, problem: GemmProblem, target=None) -> str | None:
    """None if the genes give a valid, buildable schedule for this problem and target, else why not.
    Checks only arithmetic (no IR is built), so a population can be screened in microseconds."""
    missing = set(GENES) - set(genes)
    if missing:
        return f"missing genes {sorted(missing)}"
    g = genes
    for name, size, tile in (("m", problem.m, g["bm"]), ("n", problem.n, g["bn"]), ("k", problem.k, g["bk"])):
        if size % tile:
            return f"b{name}={tile} does not divide {name}={size}"
    for tile, thread, chunk in (("bm", "tm", "wm"), ("bn", "tn", "wn")):
        if g[tile] % g[thread]:
            return f"{thread}={g[thread]} does not divide {tile}={g[tile]}"
        if g[thread] % g[chunk]:
            return f"{chunk}={g[chunk]} does not divide {thread}={g[thread]}"
    threads = threads_of(g)
    max_threads = _limit(target, "max_threads_per_block", 1024)
    if threads % WARP or threads > max_threads:
        return f"{threads} threads per block (must be a multiple of {WARP}, at most {max_threads})"
    warp_m = WARP // g["warp_n"]
    if (g["bn"] // g["tn"]) % g["warp_n"] or (g["bm"] // g["tm"]) % warp_m:
        return f"a {warp_m}x{g['warp_n']} warp does not tile the {g['bm'] // g['tm']}x{g['bn'] // g['tn']} thread grid"
    b_extent, b_row = (g["bn"], problem.n) if problem.b_layout == "kn" else (g["bk"], problem.k)
    for operand, extent, row, tile_elems, transposed in (
            ("A", g["bk"], problem.k, g["bm"] * g["bk"], True),
            ("B", b_extent, b_row, g["bn"] * g["bk"], problem.b_layout == "nk")):
        vec = copy_vector(g, transposed)
        if extent % vec or row % vec:
            return f"vec={vec} does not divide {operand}'s contiguous tile extent ({extent}) or row ({row})"
        if tile_elems % (threads * vec):
            return f"{operand}'s {tile_elems}-element tile does not split over {threads} threads x vec {vec}"
    if g["async_copy"] and g["stages"] < 2:
        return "async_copy needs stages >= 2"
    if g["stages"] > 1 and problem.k // g["bk"] < g["stages"]:
        return f"{g['stages']} pipeline stages but only {problem.k // g['bk']} K steps"
    smem = shared_bytes(g, problem)
    max_smem = _limit(target, "max_shared_memory_per_block", 48 * 1024)
    if smem > max_smem:
        return f"{smem} bytes of shared memory (limit {max_smem})"
    regs = registers_estimate(g)
    if regs > _MAX_REGS_PER_THREAD or regs * threads > _limit(target, "registers_per_block", 65536):
        return f"about {regs} registers per thread x {threads} threads would spill"
    return None


def is_feasible(genes: dict, problem: GemmProblem, target=None) -> bool:
    return feasible(genes, problem, target) is None


def enumerate_feasible(problem: GemmProblem, target=None, choices: dict | None = None) -> list[dict]:
    """Every feasible point of the product of `choices` (default GENES; use COMPACT_GENES for sweeps)."""
    choices = choices or GENES
    names = list(choices)
    points = (dict(zip(names, values)) for values in itertools.product(*(choices[n] for n in names)))
    return [p for p in points if feasible(p, problem, target) is None]


def default_genes(problem: GemmProblem, target=None) -> dict:
    """Untuned genes for a problem: DEFAULT_GENES when feasible, else the feasible point of GENES with
    the most work per thread (up to 8x8), then the largest block tile, then ~256 threads. TvmseqError
    when the template has no feasible tiling for the problem (m and n must be multiples of 16, k of 4,
    and a block's tiles must split evenly over at least one warp)."""
    if feasible(DEFAULT_GENES, problem, target) is None:
        return dict(DEFAULT_GENES)
    fallback = dict(GENES, vec=(1, 4), stages=(2,), async_copy=(0,), pad=(4,))
    points = enumerate_feasible(problem, target, fallback)
    if not points:
        raise TvmseqError(f"the GEMM template cannot tile {problem.key}: m and n must be multiples of 16, "
                          f"k of 4, and the tiles must split over at least one warp")
    return max(points, key=lambda g: (min(g["tm"] * g["tn"], 64), g["bm"] * g["bn"],
                                      -abs(threads_of(g) - 256), g["wm"] * g["wn"], g["vec"], g["bk"]))


def random_genes(rng: random.Random, choices: dict | None = None) -> dict:
    choices = choices or GENES
    return {name: rng.choice(values) for name, values in choices.items()}


def genes_key(genes: dict) -> str:
    """Short stable id of a gene set (kernel names, file names, database keys)."""
    blob = json.dumps({k: int(genes[k]) for k in sorted(genes)}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def build_config(genes: dict, target=None) -> dict:
    """PassContext options this schedule needs at build time. With cp.async, StorageRewrite must stay
    off: it retypes the shared tile as float4[] and InjectPTXAsyncCopy then rejects the copy."""
    if genes.get("async_copy") and (target is None or _is_gpu(target)):
        return {"tirx.use_async_copy": True, "tirx.disable_storage_rewrite": True}
    return {}


@dataclass
class TiledGemm:
    """dlight-style rule: `apply(func, target)` schedules a prim_func that has the "gemm" block of
    `gemm_func` (and optionally its "epilogue"), or returns None when it does not match / is infeasible."""

    genes: dict = field(default_factory=lambda: dict(DEFAULT_GENES))

    def apply(self, func, target, problem: GemmProblem | None = None):
        from tvm import s_tir

        problem = problem or _problem_of(func)
        if problem is None or feasible(self.genes, problem, target if _is_gpu(target) else None):
            return None
        return _schedule(s_tir.Schedule(func), self.genes, problem, _is_gpu(target))


def schedule(genes: dict, problem: GemmProblem, target):
    """The s_tir Schedule (its trace is what tuning databases store); TvmseqError when infeasible."""
    from tvm import s_tir

    target = _as_target(target)
    reason = feasible(genes, problem, target if _is_gpu(target) else None)
    if reason:
        raise TvmseqError(f"infeasible GEMM schedule for {problem.key}: {reason}")
    return _schedule(s_tir.Schedule(gemm_func(problem)), genes, problem, _is_gpu(target))


def apply(genes: dict, problem: GemmProblem, target):
    """Scheduled IRModule (function "main", marked scheduled so Relax's dlight leaves it alone)."""
    import tvm

    mod = schedule(genes, problem, target).mod
    return tvm.IRModule({"main": mod["main"].with_attr("tirx.is_scheduled", True)})


def build(genes: dict, problem: GemmProblem, target):
    """Compile the scheduled GEMM (tvm.compile with the PassContext the genes need)."""
    import tvm

    target = _as_target(target)
    mod = apply(genes, problem, target)
    with tvm.transform.PassContext(opt_level=3, config=build_config(genes, target)):
        return tvm.compile(mod, target=target)


def _as_target(target):
    import tvm

    return tvm.target.Target(target) if isinstance(target, str) else target


def _is_gpu(target) -> bool:
    return target is not None and target.kind.name == "cuda"


def _problem_of(func) -> GemmProblem | None:
    """Recover the GemmProblem of a function shaped like gemm_func's output (None if it is not)."""
    from tvm import s_tir
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    try:
        s_tir.Schedule(func).get_sblock("gemm")
        args = [(tuple(int(x) for x in a.shape), str(a.dtype)) for a in ArgInfo.from_prim_func(func)]
    except Exception:  # noqa: BLE001 - no "gemm" block or symbolic shapes: not ours
        return None
    if len(args) not in (3, 4) or len(args[0][0]) != 2 or len(args[-1][0]) != 2:
        return None
    (m, k), dtype = args[0]
    n = args[-1][0][1]
    layout = "kn" if args[1][0] == (k, n) else "nk"
    try:
        problem = GemmProblem(m, n, k, dtype, layout, bias=len(args) == 4)
    except TvmseqError:
        return None
    return problem if args[1][0] == problem.b_shape else None


def _schedule(sch, g: dict, problem: GemmProblem, gpu: bool, consumers: tuple[str, ...] | None = None,
              inline_producers: bool = False):
    """The schedule itself. On the CPU (gpu=False) the same loops stay serial and 'shared' becomes an
    ordinary buffer, so the tiling, layout transforms and pipelining can be checked numerically.

    The "gemm" block may have leading spatial loops before (i, j, r) (a batch of GEMMs, e.g. directions
    and time steps of an input projection): the innermost is fused into the block-row axis (blockIdx.y),
    the others into blockIdx.z; the operands/output may then have leading dimensions too (the last two
    are the tile's).
    `consumers`: blocks reverse-inlined into the register -> global store, in order (default: the
    "epilogue" block when problem.bias). `inline_producers`: compute-inline the producers of the staged
    operands into the global -> shared copies (pad_einsum's zero-padding blocks)."""
    bind = sch.bind if gpu else (lambda loop, tag: None)
    shared = "shared" if gpu else "global"
    block = sch.get_sblock("gemm")
    n_ty, n_tx = g["bm"] // g["tm"], g["bn"] // g["tn"]
    threads = n_ty * n_tx
    warp_n = g["warp_n"]
    warp_m = WARP // warp_n

    # Tile: i -> (block row, chunk, thread row, row in chunk); j likewise; k -> (step, slice).
    *lead, i, j, r = sch.get_loops(block)
    by, vy, ty, iy = sch.split(i, [None, g["tm"] // g["wm"], n_ty, g["wm"]])
    bx, vx, tx, ix = sch.split(j, [None, g["tn"] // g["wn"], n_tx, g["wn"]])
    ty_o, ty_i = sch.split(ty, [None, warp_m])
    tx_o, tx_i = sch.split(tx, [None, warp_n])
    ko, ki = sch.split(r, [None, g["bk"]])
    sch.reorder(*lead, by, bx, vy, vx, ty_o, tx_o, ty_i, tx_i, ko, ki, iy, ix)
    if lead:
        # the innermost leading loop joins the block rows; any others become blockIdx.z (fusing them
        # all into blockIdx.y leaves an unprovable bound predicate when an extent is symbolic)
        by = sch.fuse(lead[-1], by)
        if len(lead) > 1:
            bind(sch.fuse(*lead[:-1]) if len(lead) > 2 else lead[0], "blockIdx.z")
    thread = sch.fuse(ty_o, tx_o, ty_i, tx_i)   # lane = ty_i * warp_n + tx_i: a warp is warp_m x warp_n
    bind(by, "blockIdx.y")
    bind(bx, "blockIdx.x")
    bind(vy, "vthread.y")
    bind(vx, "vthread.x")
    bind(thread, "threadIdx.x")

    # Registers -> global store (with the bias epilogue fused), vectorized along N.
    store = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(store, thread, preserve_unit_loops=True)
    if consumers is None:
        consumers = ("epilogue",) if problem.bias else ()
    for name in consumers:
        sch.reverse_compute_inline(sch.get_sblock(name))
    _, store_vec = sch.split(sch.get_loops(store)[-1], [None, g["wn"]])
    if gpu:
        sch.vectorize(store_vec)

    # Global -> shared, cooperatively; A (and B^T) transposed so fragments are contiguous along M/N.
    def stage(operand: int, transpose: bool):
        vec = copy_vector(g, transpose)
        copy = sch.cache_read(block, operand, shared)
        sch.compute_at(copy, ko, preserve_unit_loops=True)
        loops = sch.get_loops(copy)[-2:]
        _, t, v = sch.split(sch.fuse(*loops), [None, threads, vec])
        bind(t, "threadIdx.x")
        if gpu:
            sch.vectorize(v)
        ndim = len(sch.get(copy).writes[0].region)
        if transpose:
            sch.transform_layout(copy, ("write", 0), lambda *idx: (*idx[:-2], idx[-1], idx[-2]))
        if g["pad"]:
            sch.storage_align(copy, 0, axis=ndim - 2, factor=32, offset=g["pad"])
        if inline_producers:
            for producer in sch.get_producers(copy):
                sch.compute_inline(producer)
        return copy

    stage(0, transpose=True)
    stage(1, transpose=problem.b_layout == "nk")

    # Shared -> registers per k: one wm-vector of A and one wn-vector of B per chunk.
    for operand, width in ((0, g["wm"]), (1, g["wn"])):
        frag = sch.cache_read(block, operand, "local")
        sch.compute_at(frag, ki, preserve_unit_loops=True)
        if gpu and width > 1:
            sch.vectorize(sch.get_loops(frag)[-1])

    # Unrolling: "#pragma unroll" lets nvcc unroll (cicc takes 0.7 s instead of 7 s on the 8x16 tile,
    # same registers); cp.async pipelines need TVM's explicit unrolling (wait_group counts must be
    # compile-time constants in the emitted source).
    sch.unroll(ki)
    sch.annotate(thread, "pragma_auto_unroll_max_step", 512)
    sch.annotate(thread, "pragma_unroll_explicit", int(bool(g["async_copy"]) or not gpu))
    if g["stages"] > 1:
        # ko's body: [copy A, copy B, k-slice loop]; the copies run stages-1 steps ahead.
        sch.annotate(ko, "software_pipeline_stage", [0, 0, g["stages"] - 1])
        sch.annotate(ko, "software_pipeline_order", [0, 1, 2])
        if g["async_copy"] and gpu:   # cp.async exists on the GPU only; the CPU keeps the plain pipeline
            sch.annotate(ko, "software_pipeline_async_stages", [0])
    sch.decompose_reduction(block, ko)
    return sch
