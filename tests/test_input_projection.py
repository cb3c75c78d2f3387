"""The GRU/RNN input projection's tiled schedule (kernels/projection/gemm.py): the SGEMM template of
tvmseq.tune.space in its serial CPU variant (same loops, no thread bindings) against numpy, over
directions, batches with different M tiles, odd input/hidden sizes (zero-padded N and K) and float32 /
float16, several sequence lengths from one module (seq symbolic); the dlight fallback where no M tile
divides the batch; CUDA code generation for the H100 (no predicates on the divisible path; with nvcc,
ptxas: no spills)."""
import functools
import shutil

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
pytest.importorskip("tvm.script")

from tvmseq.kernels.projection import gemm as ip
from tvmseq.kernels.recurrent import gru  # noqa: E402
from tvmseq.tune import space  # noqa: E402


def numpy_projection(X, W, bias):
    """gate_i[d, t, b, j] = sum_k X[t, b, k] W[d, j, k] + bias[d, j], in float64."""
    return np.einsum("tbk,djk->dtbj", X.astype(np.float64), W.astype(np.float64)) + bias[:, None, None, :]


LLVM = tvm.target.Target("llvm")
H100 = tvm.target.Target("nvidia/nvidia-h100", host="llvm")


def _spec(D, B, H, I, dtype="float32"):  # noqa: E741
    return gru.GruSpec(D, B, H, I, dtype, direction="bidirectional" if D == 2 else "forward")


@functools.lru_cache(maxsize=None)
def _cpu_module(D, B, H, I, dtype, few_blocks=False):  # noqa: E741
    rule = ip.TiledInputProjection(dict(ip.FEW_BLOCKS_GENES)) if few_blocks else ip.TiledInputProjection()
    sch = rule.apply(ip.input_projection_func(_spec(D, B, H, I, dtype)), LLVM)
    assert sch is not None, "the rule must apply when an M tile divides the batch"
    return tvm.compile(sch.mod, target=LLVM)["gru_input_projection"]


# batches 16 (M tile 16, tm lowered to 4), 64 (the tuned tile), 96 (M tile 32); (I, H) = (48, 128) needs no
# padding, the odd sizes pad N = 3H and K = I; float16 on fewer shapes (the loops do not depend on dtype)
CPU_CASES = ([(D, B, I, H, "float32") for D in (1, 2) for B in (16, 64, 96)
              for I, H in ((33, 24), (100, 50), (48, 128))]
             + [(D, B, I, H, "float16") for D in (1, 2) for B, I, H in ((64, 33, 24), (16, 48, 128))]
             + [(1, 64, 19, 128, "float32"), (2, 16, 19, 128, "float32")])  # only k padded: no unpad block


@pytest.mark.parametrize("D,B,I,H,dtype,few_blocks", [c + (False,) for c in CPU_CASES]
                         + [(1, 64, 100, 50, "float32", True), (2, 64, 33, 24, "float32", True),
                            (1, 64, 48, 128, "float32", True)])   # padded-rows genes at small batch
def test_tiled_projection_matches_numpy_on_cpu(D, B, I, H, dtype, few_blocks):  # noqa: E741
    func = _cpu_module(D, B, H, I, dtype, few_blocks)
    rng = np.random.default_rng(D * 1000 + B + I + H)
    W = rng.uniform(-1, 1, (D, 3 * H, I)).astype(dtype)
    bias = rng.standard_normal((D, 3 * H)).astype(np.float32)
    for seq in (1, 3, 7):  # one compiled module, seq symbolic
        X = rng.standard_normal((seq, B, I)).astype(dtype)
        out = tvm.runtime.tensor(np.full((D, seq, B, 3 * H), np.nan, np.float32))  # every element written
        func(tvm.runtime.tensor(X), tvm.runtime.tensor(W), tvm.runtime.tensor(bias), out)
        # float16 inputs are exact in float64; both dtypes accumulate in float32
        np.testing.assert_allclose(out.numpy(), numpy_projection(X, W, bias), rtol=1e-4, atol=1e-4)


def test_genes_per_batch():
    """The largest M tile up to the tuned one that divides the batch, tm lowered until feasible, the copy
    vector narrowed to divide the input size, N and K rounded up to the tiles."""
    def chosen(B, H=1024, I=1024, dtype="float32", target=H100):  # noqa: E741
        shape = ip.projection_shape(ip.input_projection_func(_spec(1, B, H, I, dtype)))
        return ip.projection_genes(shape, ip.PROJECTION_GENES, target)

    genes, problem = chosen(64)
    assert genes == ip.PROJECTION_GENES and (problem.n, problem.k) == (3072, 1024)
    assert chosen(256)[0]["bm"] == 64 and chosen(96)[0]["bm"] == 32
    g16, _ = chosen(16)
    assert (g16["bm"], g16["tm"]) == (16, 4)  # tm 8 would leave a 2x16 thread grid no 4x8 warp tiles
    g, p = chosen(64, H=50, I=33)
    assert g["vec"] == 1 and (p.n, p.k) == (256, 48)
    assert chosen(64, dtype="float16")[0]["async_copy"] == 0
    for B in (1, 7, 8, 24, 100):  # no M tile of the template divides these (batch 8: dlight measured faster)
        assert chosen(B) is None


@pytest.mark.parametrize("B", [7, 8])
def test_falls_back_to_dlight(B):
    """No M tile divides the batch: the rule declines and dlight's Matmul rule schedules the function
    (it binds threadIdx.y; the template binds threadIdx.x only)."""
    func = ip.input_projection_func(_spec(2, B, 40, 33))
    assert ip.TiledInputProjection().apply(func, H100) is None
    script = ip.schedule_input_projection(func, H100).script()
    assert "threadIdx.y" in script
    # the CPU keeps the unscheduled loop nest
    assert "thread_binding" not in ip.schedule_input_projection(func, LLVM).script()


def test_rule_declines_other_functions():
    problem = space.GemmProblem(64, 64, 64, "float32", "nk", bias=True)
    assert ip.TiledInputProjection().apply(space.gemm_func(problem), H100) is None


def _cuda_source(D, B, H, I, dtype):  # noqa: E741
    """Codegen only: no CUDA compile callback is registered in this process, so tvm.compile keeps the
    CUDA source in the module (as tests/test_persistent_gru.py does)."""
    mod = gru.schedule_input_projection(gru.input_projection_func(_spec(D, B, H, I, dtype)), H100)
    script = mod.script()
    return tvm.compile(mod, target=H100).mod.imports[0].inspect_source(), script


@pytest.mark.parametrize("D,B,H,I,dtype", [(1, 64, 1024, 1024, "float32"), (2, 256, 1024, 1024, "float32"),
                                           (2, 64, 1024, 1024, "float16"), (1, 64, 50, 33, "float32"),
                                           (1, 256, 512, 19, "float32")])
def test_cuda_codegen(D, B, H, I, dtype):  # noqa: E741
    """The H100 build uses the template (blockIdx.z = direction); divisible sizes need no predicate;
    with nvcc, ptxas reports no register spills for sm_90a."""
    src, script = _cuda_source(D, B, H, I, dtype)
    assert "threadIdx.y" not in script
    assert f'T.thread_binding({D}, thread="blockIdx.z")' in script
    if (H * 3) % 128 == 0 and I % 16 == 0:
        assert "T.where" not in script and "if_then_else" not in script
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


# ---- batches no M tile divides: rows padded to whole tiles (importer wiring checked on the CPU) -----------
def test_row_tile_only_where_the_batch_layout_has_no_tile():
    assert ip.row_tile(_spec(1, 8, 1024, 1024), H100) == ip.PROJECTION_GENES["bm"]
    assert ip.row_tile(_spec(2, 1, 64, 33), H100) == ip.PROJECTION_GENES["bm"]
    assert ip.row_tile(_spec(1, 64, 1024, 1024), H100) is None     # the batch layout is tiled already
    assert ip.row_tile(_spec(1, 8, 1024, 1024), LLVM) is None      # the CPU keeps its loop nest


def test_padded_rows_genes_by_block_count(monkeypatch):
    """The 64 x 64 tile where PROJECTION_GENES' tiles would give under 4 blocks an SM (static seq, float32);
    PROJECTION_GENES for a symbolic seq, float16, or many blocks. (The SIMT template: tf32x3 turned off.)"""
    monkeypatch.setattr(ip, "tf32x3_projection", lambda *args, **kwargs: None)
    few, big = ip.FEW_BLOCKS_GENES, ip.PROJECTION_GENES
    assert ip.padded_rows_genes(_spec(1, 8, 1024, 1024), 100, H100) is few        # 13 x 24 = 312 blocks
    assert ip.padded_rows_genes(_spec(2, 8, 512, 512), 100, H100) is few          # 2 x 13 x 12 = 312
    assert ip.padded_rows_genes(_spec(1, 1, 1024, 1024), 100, H100) is few
    assert ip.padded_rows_genes(_spec(2, 8, 1024, 1024), 100, H100) is big        # 624 >= 4 x 132
    assert ip.padded_rows_genes(_spec(1, 8, 1024, 1024), 1000, H100) is big       # 125 x 24 = 3000
    assert ip.padded_rows_genes(_spec(1, 8, 1024, 1024), None, H100) is big       # any length
    assert ip.padded_rows_genes(_spec(1, 8, 1024, 1024, "float16"), 100, H100) is big
    few_func, tile = ip.projection_for(_spec(1, 8, 1024, 1024), H100, 100)
    big_func, tile2 = ip.projection_for(_spec(1, 8, 1024, 1024), H100)
    assert tile == tile2 == few["bm"] and few_func.script() != big_func.script()


def test_few_blocks_genes_build_without_spills():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: ptxas not checked")
    from tvmseq.cuda_toolchain import ptxas_report

    func, _ = ip.projection_for(_spec(1, 8, 1024, 1024), H100, 100)
    src = tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()
    (info,) = ptxas_report(src).values()
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


@pytest.mark.parametrize("seq", [1, 5, 17])
def test_pad_rows_func(seq):
    B, I, tile = 3, 5, 8
    mod = tvm.compile(tvm.IRModule({"main": ip.pad_rows_func(B, I, tile, "float32")}), target="llvm")
    x = np.random.default_rng(seq).standard_normal((seq, B, I)).astype("float32")
    tiles = -(-seq * B // tile)
    y = tvm.runtime.tensor(np.full((tiles, tile, I), np.nan, "float32"))
    mod["main"](tvm.runtime.tensor(x), y)
    want = np.zeros((tiles * tile, I), "float32")
    want[:seq * B] = x.reshape(seq * B, I)
    np.testing.assert_array_equal(y.numpy().reshape(-1, I), want)


@pytest.mark.parametrize("op,direction", [("GRU", "forward"), ("GRU", "bidirectional"), ("RNN", "reverse")])
def test_importer_row_tiled_projection_matches_onnxruntime(monkeypatch, op, direction):
    """The importer's pad -> [tiles, tile] projection -> slice wiring, forced on the CPU (on a GPU it is
    taken for batches no M tile divides), against onnxruntime with a symbolic time axis."""
    ort = pytest.importorskip("onnxruntime")
    from tvmseq import models
    from tvmseq.build import build_relax, signature_of
    from tvmseq.onnx import from_onnx
    from tvmseq.onnx import gru as onnx_gru
    from tvmseq.runtime import Model

    monkeypatch.setattr(ip, "row_tile", lambda spec, target: 16)
    onnx_gru.projection_kernel.cache_clear()
    try:
        model, feeds = models.rnn_node_model(op, seq="seq", batch=3, input_size=10, hidden=6, direction=direction,
                                             linear_before_reset=1 if op == "GRU" else None, weight_scale=0.4)
        mod = from_onnx(model, target=LLVM)
        assert any(gv.name_hint.endswith("_pad_rows") for gv in mod.get_global_vars())
        got = Model(build_relax(mod, LLVM), LLVM, signature_of(mod))(**feeds)
    finally:
        onnx_gru.projection_kernel.cache_clear()
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_schedule_error_falls_back_to_dlight_with_a_warning(monkeypatch):
    """A schedule the template cannot take (a ScheduleError inside it) is not fatal: the rule declines with
    a warning naming the shape, and schedule_input_projection uses dlight."""
    from tvm.s_tir.schedule.schedule import ScheduleError

    def broken(*args, **kwargs):
        raise ScheduleError("simulated")

    monkeypatch.setattr(space, "_schedule", broken)
    func = ip.input_projection_func(_spec(1, 64, 1024, 1024))
    with pytest.warns(UserWarning, match="tiled input projection .*simulated.*using dlight"):
        assert ip.TiledInputProjection().apply(func, H100) is None
    with pytest.warns(UserWarning):
        assert "threadIdx.y" in ip.schedule_input_projection(func, H100).script()


# ---- float16 on tensor cores (flat rows): the mma.sync kernel and the wmma rule ------------------------
def test_float16_projection_takes_tensor_cores_on_the_gpu():
    from tvmseq.kernels.projection import mma as pmm

    func, tile = ip.projection_for(_spec(1, 64, 1024, 1024, "float16"), H100)
    assert tile == ip.FLAT and "gru_input_projection" == func.attrs["global_symbol"]
    src = tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()
    for needle in ("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", "fence.proxy.async.shared::cta",
                   "cp.async.cg.shared.global", "wgmma.wait_group.sync.aligned 1"):   # sm_90a: the warpgroup kernel
        assert needle in src, needle
    f640, _ = ip.projection_for(_spec(1, 64, 640, 640, "float16"), H100)   # N 1920: 256 does not divide it
    assert "m64n128k16" in tvm.compile(tvm.IRModule({"main": f640}), target=H100).mod.imports[0].inspect_source()
    f128, _ = ip.projection_for(_spec(1, 64, 128, 128, "float16"), H100)   # K 128 (two k steps): 128 x 128 first
    src128 = tvm.compile(tvm.IRModule({"main": f128}), target=H100).mod.imports[0].inspect_source()
    assert "m64n128k16" in src128 and "m64n256k16" not in src128
    a100 = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    func80, _ = ip.projection_for(_spec(1, 64, 1024, 1024, "float16"), a100)   # no wgmma there: mma.sync
    src80 = tvm.compile(tvm.IRModule({"main": func80}), target=a100).mod.imports[0].inspect_source()
    for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4"):
        assert needle in src80, needle
    odd, tile = ip.projection_for(_spec(2, 3, 37, 19, "float16"), H100)   # N, K no tile divides: wmma rule
    assert tile == ip.FLAT and "wmma" in tvm.compile(tvm.IRModule({"main": odd}), target=H100).mod.imports[0] \
        .inspect_source()
    assert ip.projection_for(_spec(1, 64, 1024, 1024, "float32"), H100)[1] == ip.TF32X3   # fp32 accuracy
    assert "T.vectorized" in ip.projection_for(_spec(1, 64, 1024, 1024, "float16"), LLVM)[0].script()   # CPU SIMD
    assert "multiple of 128" in pmm.supports(3 * 37, 64)
    if shutil.which("nvcc"):
        from tvmseq.cuda_toolchain import ptxas_report

        (info,) = ptxas_report(src).values()
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


@pytest.mark.parametrize("D,rows,N,K", [(1, 37, 128, 64), (2, 300, 256, 128)])
def test_mma_projection_cpu_variant_matches_numpy(D, rows, N, K):
    """The interface and numerics of the mma kernel's prim_func (its CPU variant: the plain loop nest)."""
    from tvmseq.kernels.projection import mma as pmm

    f = tvm.compile(tvm.IRModule({"main": pmm.projection_mma_func(D, N, K, gpu=False)}), target=LLVM)
    rng = np.random.default_rng(rows)
    X = rng.standard_normal((rows, K)).astype(np.float16)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float16)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    out = tvm.runtime.tensor(np.full((D, rows, N), np.nan, np.float32))
    f["gru_input_projection"](*[tvm.runtime.tensor(a) for a in (X, W, bias)], out)
    want = numpy_projection(X[:, None], W, bias)[:, :, 0]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


def _assert_refuses_past_rows(func, K, D, N, x_dtype, limit, message):
    """The CPU build of a projection runs `limit` rows and refuses limit + 1 with one line matching `message`."""
    f = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)

    def call(rows):
        args = (np.ones((rows, K), x_dtype), np.ones((D, N, K), x_dtype), np.zeros((D, N), np.float32),
                np.zeros((D, rows, N), np.float32))
        f["gru_input_projection"](*[tvm.runtime.tensor(a) for a in args])

    call(limit)
    with pytest.raises(Exception, match=message):
        call(limit + 1)


def test_mma_projection_refuses_more_rows_than_32_bit_indices(monkeypatch):
    """rows x max(K, D x N) must stay under 2^31 (32-bit offsets): checked on the host before the kernel, one line
    naming the projection (here the limit lowered to 40 rows of 2 x 128 values)."""
    from tvmseq.kernels.projection import mma as pmm
    from tvmseq.onnx import checks

    monkeypatch.setattr(checks, "INDEX_LIMIT", 2 * 128 * 40 + 1)
    _assert_refuses_past_rows(pmm.projection_mma_func(2, 128, 64, gpu=False), 64, 2, 128, np.float16, 40,
                              r"mma input projection \(K 64, 2 x 128 gate rows\): .* at most 40 rows")


@pytest.mark.parametrize("D,rows,N,K", [(1, 37, 128, 64), (2, 300, 256, 128)])
def test_wgmma_projection_half_gate_i_cpu_variant_matches_numpy(D, rows, N, K):
    """gate_dtype float16: the float32 sum plus bias rounded once to half (the GPU epilogue's numerics): rounding
    costs 2^-11 of a value at most, so 1e-3 of the float64 result's largest value."""
    from tvmseq.kernels.projection import wgmma as pwg

    func = pwg.projection_wgmma_func(D, N, K, gpu=False, gate_dtype="float16")
    f = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
    rng = np.random.default_rng(rows)
    X = rng.standard_normal((rows, K)).astype(np.float16)
    W = (rng.standard_normal((D, N, K)) * K ** -0.5).astype(np.float16)
    bias = rng.standard_normal((D, N)).astype(np.float32)
    out = tvm.runtime.tensor(np.full((D, rows, N), np.nan, np.float16))
    f["gru_input_projection"](*[tvm.runtime.tensor(a) for a in (X, W, bias)], out)
    got, want = out.numpy(), numpy_projection(X[:, None], W, bias)[:, :, 0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=1e-3 * np.abs(want).max())


def test_wgmma_projection_half_gate_i_cuda_codegen():
    """gate_dtype float16 on the H100: a half gate_i, its column pairs stored as one 4-byte half2 each; float32
    stays float2; (with nvcc) no spills."""
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import wgmma as pwg

    def source(gate_dtype):
        func = pwg.projection_wgmma_func(2, 3072, 1024, gate_dtype=gate_dtype)
        return tvm.compile(tvm.IRModule({"main": func}), target=H100).mod.imports[0].inspect_source()

    src = source("float16")
    assert "half* __restrict__ GateI_ptr" in src and "*(half2*)(GateI_ptr" in src
    assert "*(float2*)(GateI_ptr" in source("float32")
    with pytest.raises(TvmseqError, match="gate_dtype 'float64'"):
        pwg.projection_wgmma_func(1, 128, 64, gate_dtype="float64")
    if shutil.which("nvcc"):
        from tvmseq.cuda_toolchain import ptxas_report

        (info,) = ptxas_report(src).values()
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


def test_wgmma_projection_refuses_shapes_it_cannot_tile():
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import wgmma as pwg

    assert "multiple of 64" in pwg.supports(3072, 1024, pwg.WgmmaTile(bm=96))
    assert "up to 256" in pwg.supports(3072, 1024, pwg.WgmmaTile(bn=512))
    assert "3+ stages" in pwg.supports(3072, 1024, pwg.WgmmaTile(stages=2, inflight=True))
    assert "do not split over 512 threads" in pwg.supports(3072, 1024, pwg.WgmmaTile(bm=256, bn=32))  # 256 copies
    with pytest.raises(TvmseqError, match=r"K=1000 \(input size\) of 64"):
        pwg.projection_wgmma_func(1, 3072, 1000)
    assert pwg.projection_wgmma_func(1, 128, 64, gpu=False) is not None   # the CPU variant: mma's loop nest


def test_mma_projection_refuses_tiles_that_do_not_fit():
    from tvmseq.errors import TvmseqError
    from tvmseq.kernels.projection import mma as pmm

    assert "warp tiles must be multiples of 16" in pmm.supports(3072, 1024, pmm.MmaGemmTile(bm=96, warps_m=4))
    assert "do not split evenly" in pmm.supports(3072, 1024, pmm.MmaGemmTile(bm=48, warps_m=3))   # 704 copies, 384
    with pytest.raises(TvmseqError, match=r"K=1000 \(input size\) of 32"):
        pmm.projection_mma_func(1, 3072, 1000)


def test_tensor_core_projection_falls_back_on_a_schedule_error(monkeypatch):
    """A schedule error in the wmma rule is a warning and None (the caller then uses the SIMT template)."""
    def broken(self, func, target):
        raise RuntimeError("ScheduleError: simulated")

    monkeypatch.setattr(ip.TensorCoreProjection, "apply", broken)
    with pytest.warns(UserWarning, match="tensor-core input projection"):
        assert ip.tensor_core_projection(_spec(1, 3, 37, 19, "float16"), H100) is None


def test_cpu_projection_refuses_more_rows_than_32_bit_indices(monkeypatch):
    """The CPU projection indexes X's and gate_i's rows in 32 bits: rows x max(K, D x G) past 2^31 is refused on the
    host with one line naming it (here the limit lowered to 30 rows of 2 x 3 x 37 values)."""
    from tvmseq.onnx import checks

    monkeypatch.setattr(checks, "INDEX_LIMIT", 2 * 3 * 37 * 30 + 1)
    _assert_refuses_past_rows(ip.cpu_projection_func(_spec(2, 1, 37, 19), LLVM), 19, 2, 111, np.float32, 30,
                              r"input projection \(K 19, 2 x 111 gate rows\): .* at most 30 rows")


@pytest.mark.parametrize("flat,unit_values,unit", [(True, 255, "rows"), (False, 64 * 255, "steps")])
def test_simt_projection_keeps_its_32_bit_check_through_the_schedule(monkeypatch, flat, unit_values, unit):
    """The GPU projections that dlight or the SIMT template schedule (float32 off sm_90a, odd N) index in 32 bits
    too: the host check stays at the top of the scheduled function (flat rows: rows x max(K, D x G); the batch
    layout: steps x B x max(K, D x G)), and the schedule still binds threads (here G = 255 gate rows, batch 64,
    the limit lowered to 3 units)."""
    from tvmseq.onnx import checks

    monkeypatch.setattr(checks, "INDEX_LIMIT", 3 * unit_values + 1)
    spec = _spec(1, 64, 85, 64)
    func = ip.flat_projection_func(spec) if flat else ip.input_projection_func(spec)
    script = ip.schedule_input_projection(func, H100)["main"].script()
    assert f"at most 3 {unit}" in script and "blockIdx" in script

