"""Whole ONNX models built from the blocks real recurrent models use (odd sizes, random weights), checked
against onnxruntime: on the CPU by tests/test_blocks.py, on the GPU by tests/test_gpu_blocks.py.

The GPU machine has only TVM's runtime, so the CUDA models are compiled HERE:

    python -m tests.blocks build OUTDIR            # (or python tests/blocks.py build OUTDIR)
    TVMSEQ_BLOCKS_DIR=OUTDIR pytest -m gpu tests/test_gpu_blocks.py -rxX     # there

OUTDIR gets <name>.so (+ .so.json), <name>.onnx, <name>.npz (inputs `in_*` and onnxruntime's outputs
`out_*` computed here) and index.json. `STOCK_CASES` are compiled with TVM's own Conv conversion and dlight
step (tvmseq's route-arounds off): they show TVM's own CUDA result (notes/tvm_depthwise_conv_cuda.md).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))   # its sibling host_cpu under `python -m tests.blocks` too

OPSET = 17


def _model(nodes, inputs, outputs, inits, opset=OPSET):
    graph = helper.make_graph(nodes, "block", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _w(rng, name, *shape, scale=1.0):
    return numpy_helper.from_array(rng.uniform(-scale, scale, shape).astype(np.float32), name)


def _x(rng, *shape):
    return rng.uniform(-1, 1, shape).astype(np.float32)


def _conv(kind, x_shape, w_shape, feeds_shape, seed=0, **attrs):
    """One Conv/ConvTranspose + bias + Relu-free tail (the bias is what bug 1 doubles)."""
    rng = np.random.default_rng(seed)
    out_channels = w_shape[0] if kind == "Conv" else w_shape[1] * attrs.get("group", 1)
    nodes = [helper.make_node(kind, ["X", "W", "B"], ["Y"], **attrs)]
    inits = [_w(rng, "W", *w_shape), _w(rng, "B", out_channels)]
    return _model(nodes, [_f32("X", x_shape)], [_f32("Y", None)], inits), {"X": _x(rng, *feeds_shape)}


# ---------------------------------------------------------------------------------------------------
# Convolutions along the time axis
# ---------------------------------------------------------------------------------------------------
def depthwise_1x1():
    """Depthwise 1x1 Conv2d with bias on [1, C, T, 1]: TVM 0.27's CUDA pipeline adds the bias twice."""
    return _conv("Conv", [1, 5, 7, 1], [5, 1, 1, 1], [1, 5, 7, 1], group=5, kernel_shape=[1, 1])


def depthwise_1x1_symbolic():
    """The same as Conv1d with symbolic batch and time, channel multiplier 2."""
    return _conv("Conv", ["N", 5, "T"], [10, 1, 1], [1, 5, 9], seed=1, group=5, kernel_shape=[1])


def depthwise_conv1d():
    """Depthwise Conv1d, kernel 3, 'same' pads, batch 1 (TVM's GEMV rule asserts on it)."""
    return _conv("Conv", [1, 7, 11], [7, 1, 3], [1, 7, 11], seed=2, group=7, kernel_shape=[3], pads=[1, 1])


def depthwise_conv2d_time():
    """Depthwise Conv2d 3x3 over [1, C, F, T], stride 2 along time, pads. (T static: with a symbolic T
    a 3x5 kernel's 15 taps take ~35 s of LLVM codegen on the CPU; CUDA builds it in 2 s.)"""
    return _conv("Conv", [1, 5, 9, 13], [5, 1, 3, 3], [1, 5, 9, 13], seed=3, group=5, kernel_shape=[3, 3],
                 strides=[1, 2], pads=[1, 1, 1, 1])


def grouped_conv1d():
    """Grouped Conv1d: 9 -> 15 channels in 3 groups, kernel 3, dilation 2."""
    return _conv("Conv", [1, 9, 13], [15, 3, 3], [1, 9, 13], seed=4, group=3, kernel_shape=[3], dilations=[2],
                 pads=[2, 2])


def dilated_conv1d():
    """Dense Conv1d, kernel 3, dilation 3, batch 3, symbolic time."""
    return _conv("Conv", [3, 5, "T"], [7, 5, 3], [3, 5, 17], seed=5, kernel_shape=[3], dilations=[3])


def strided_conv2d():
    """Dense Conv2d 3x3, stride 2 along time (an encoder's downsampling), odd sizes."""
    return _conv("Conv", [1, 3, 11, 13], [7, 3, 3, 3], [1, 3, 11, 13], seed=6, kernel_shape=[3, 3], strides=[1, 2],
                 pads=[1, 1, 1, 1])


def conv_transpose1d():
    """ConvTranspose1d stride 2 (a decoder's upsampling), 7 -> 5 channels, kernel 4, pads 1."""
    return _conv("ConvTranspose", [1, 7, 9], [7, 5, 4], [1, 7, 9], seed=7, kernel_shape=[4], strides=[2], pads=[1, 1])


def conv_transpose2d():
    """ConvTranspose2d stride (1, 2), kernel 3x3, output_padding along time."""
    return _conv("ConvTranspose", [1, 5, 7, 9], [5, 3, 3, 3], [1, 5, 7, 9], seed=8, kernel_shape=[3, 3],
                 strides=[1, 2], pads=[1, 1, 1, 1], output_padding=[0, 1])


def depthwise_conv_transpose1d():
    """Depthwise ConvTranspose1d (group = channels), kernel 3, stride 1, pads 1, batch 1: TVM's GEMV rule
    asserts on it (stride 2 builds)."""
    return _conv("ConvTranspose", [1, 6, 9], [6, 1, 3], [1, 6, 9], seed=17, group=6, kernel_shape=[3], pads=[1, 1])


# ---------------------------------------------------------------------------------------------------
# Linear layers and norms
# ---------------------------------------------------------------------------------------------------
def einsum_linear():
    """Einsum used as Linear ('btf,hf->bth') + bias, symbolic time."""
    rng = np.random.default_rng(9)
    nodes = [helper.make_node("Einsum", ["X", "W"], ["E"], equation="btf,hf->bth"),
             helper.make_node("Add", ["E", "B"], ["Y"])]
    return (_model(nodes, [_f32("X", [2, "T", 11])], [_f32("Y", None)], [_w(rng, "W", 13, 11), _w(rng, "B", 13)]),
            {"X": _x(rng, 2, 9, 11)})


def linear_one_feature():
    """Linear on one input feature a frame (MatMul with K = 1) + bias, symbolic batch and time: TVM's CUDA
    schedule adds the bias twice (the depthwise 1x1 bug, through the MatMul)."""
    rng = np.random.default_rng(18)
    nodes = [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Add", ["H", "B"], ["Y"])]
    return (_model(nodes, [_f32("X", ["N", "T", 1])], [_f32("Y", None)], [_w(rng, "W", 1, 6), _w(rng, "B", 6)]),
            {"X": _x(rng, 2, 9, 1)})


def matmul_gemm():
    """MatMul on [B, T, F] then Gemm (transB) on the flattened rows, Tanh between."""
    rng = np.random.default_rng(10)
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"]), helper.make_node("Tanh", ["H"], ["Ht"]),
             helper.make_node("Reshape", ["Ht", "rows"], ["R"]),
             helper.make_node("Gemm", ["R", "W2", "B2"], ["Y"], transB=1, alpha=0.7, beta=1.3)]
    inits = [_w(rng, "W1", 11, 13), _w(rng, "W2", 5, 13), _w(rng, "B2", 5),
             numpy_helper.from_array(np.array([-1, 13], np.int64), "rows")]
    return _model(nodes, [_f32("X", [3, 7, 11])], [_f32("Y", None)], inits), {"X": _x(rng, 3, 7, 11)}


def fc_rows():
    """MatMul [T, 4, 96] x [96, 200] + bias, ReLU, then Gemm (transB, bias) on the flattened rows: 600 rows, on
    sm_90a the tf32x3 projection (`tvmseq.onnx.matmul`; the run-time row count past the stock matmul's 256)."""
    rng = np.random.default_rng(19)
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["H"]), helper.make_node("Add", ["H", "B1"], ["Hb"]),
             helper.make_node("Relu", ["Hb"], ["Hr"]), helper.make_node("Reshape", ["Hr", "rows"], ["R"]),
             helper.make_node("Gemm", ["R", "W2", "B2"], ["Y"], transB=1)]
    inits = [_w(rng, "W1", 96, 200, scale=0.1), _w(rng, "B1", 200), _w(rng, "W2", 64, 200, scale=0.07),
             _w(rng, "B2", 64), numpy_helper.from_array(np.array([-1, 200], np.int64), "rows")]
    return _model(nodes, [_f32("X", ["T", 4, 96])], [_f32("Y", None)], inits), {"X": _x(rng, 150, 4, 96)}


def matmul_integer():
    """The int8 Linear of onnxruntime's quantize_dynamic: DynamicQuantizeLinear(X) -> MatMulInteger with an int8
    weight -> Cast -> Mul by both scales, over a symbolic time axis (dlight's Matmul rule gives the int32 product a
    thread-local buffer of symbolic size there, which CUDA code generation refuses)."""
    rng = np.random.default_rng(19)
    w_q = rng.integers(-127, 128, (96, 80)).astype(np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["X"], ["Xq", "Xs", "Xz"]),
             helper.make_node("MatMulInteger", ["Xq", "Wq", "Xz", "Wz"], ["P"]),
             helper.make_node("Cast", ["P"], ["Pf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["Xs", "Ws"], ["S"]),
             helper.make_node("Mul", ["Pf", "S"], ["Y"])]
    inits = [numpy_helper.from_array(w_q, "Wq"), numpy_helper.from_array(np.array(0, np.int8), "Wz"),
             numpy_helper.from_array(np.array(0.01, np.float32), "Ws")]
    return _model(nodes, [_f32("X", [2, "T", 96])], [_f32("Y", None)], inits), {"X": _x(rng, 2, 37, 96)}


def layernorm_batchnorm():
    """BatchNormalization over channels of [1, C, T], then LayerNormalization over the features."""
    rng = np.random.default_rng(11)
    C, T = 7, 9
    var = numpy_helper.from_array(rng.uniform(0.5, 1.5, C).astype(np.float32), "var")
    nodes = [helper.make_node("BatchNormalization", ["X", "g", "b", "mean", "var"], ["N"], epsilon=1e-5),
             helper.make_node("Transpose", ["N"], ["Nt"], perm=[0, 2, 1]),
             helper.make_node("LayerNormalization", ["Nt", "lg", "lb"], ["Y"], axis=-1, epsilon=1e-5)]
    inits = [_w(rng, "g", C), _w(rng, "b", C), _w(rng, "mean", C), var, _w(rng, "lg", C), _w(rng, "lb", C)]
    return _model(nodes, [_f32("X", [1, C, "T"])], [_f32("Y", None)], inits), {"X": _x(rng, 1, C, T)}


# ---------------------------------------------------------------------------------------------------
# Shape arithmetic and control flow
# ---------------------------------------------------------------------------------------------------
def computed_pad():
    """Pad whose pads come from Shape: pad time up to a multiple of 4 (right side), reflect-free constant."""
    rng = np.random.default_rng(12)
    i64 = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [helper.make_node("Shape", ["X"], ["s"]),
             helper.make_node("Gather", ["s", "two"], ["t"], axis=0),                   # [1] time length
             helper.make_node("Mod", ["t", "four"], ["r"]),
             helper.make_node("Sub", ["four", "r"], ["p0"]),
             helper.make_node("Mod", ["p0", "four"], ["p"]),                            # (4 - t % 4) % 4
             helper.make_node("Concat", ["zeros5", "p"], ["pads"], axis=0),            # [0,0,0, 0,0,p]
             helper.make_node("Pad", ["X", "pads", "padval"], ["Y"], mode="constant")]
    inits = [i64("two", [2]), i64("four", [4]), i64("zeros5", [0, 0, 0, 0, 0]),
             numpy_helper.from_array(np.array(0.5, np.float32), "padval")]
    return _model(nodes, [_f32("X", [1, 5, "T"])], [_f32("Y", None)], inits), {"X": _x(rng, 1, 5, 11)}


def if_block():
    """If on a computed condition (mean of X > 0): one branch scales, the other shifts."""
    rng = np.random.default_rng(13)
    then_g = helper.make_graph([helper.make_node("Mul", ["X", "k"], ["Yt"])], "then", [], [_f32("Yt", [3, 5])],
                               [numpy_helper.from_array(np.array(2.0, np.float32), "k")])
    else_g = helper.make_graph([helper.make_node("Sub", ["X", "c"], ["Ye"])], "else", [], [_f32("Ye", [3, 5])],
                               [numpy_helper.from_array(np.array(0.25, np.float32), "c")])
    nodes = [helper.make_node("ReduceMean", ["X"], ["m"], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["Y"], then_branch=then_g, else_branch=else_g)]
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    x = _x(rng, 3, 5)
    return _model(nodes, [_f32("X", [3, 5])], [_f32("Y", [3, 5])], inits), {"X": x + 0.3}


# ---------------------------------------------------------------------------------------------------
# Recurrent stacks
# ---------------------------------------------------------------------------------------------------
def _recurrent(op, gates, layers, *, seq, batch, features, hidden, seed, bidirectional_first=False, **attrs):
    """`layers` stacked op nodes (X -> op -> Transpose/Reshape to [seq, batch, D*H] -> op ...) + a Linear."""
    rng = np.random.default_rng(seed)
    k = hidden ** -0.5
    nodes, inits, x, size = [], [], "X", features
    for layer in range(layers):
        D = 2 if (bidirectional_first and layer == 0) else 1
        direction = "bidirectional" if D == 2 else "forward"
        inits += [_w(rng, f"W{layer}", D, gates * hidden, size, scale=k),
                  _w(rng, f"R{layer}", D, gates * hidden, hidden, scale=k),
                  _w(rng, f"B{layer}", D, 2 * gates * hidden, scale=k)]
        nodes.append(helper.make_node(op, [x, f"W{layer}", f"R{layer}", f"B{layer}"], [f"Y{layer}", f"H{layer}"],
                                      hidden_size=hidden, direction=direction, **attrs))
        nodes.append(helper.make_node("Transpose", [f"Y{layer}"], [f"T{layer}"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"T{layer}", f"shape{layer}"], [f"S{layer}"]))
        inits.append(numpy_helper.from_array(np.array([0, batch, D * hidden], np.int64), f"shape{layer}"))
        x, size = f"S{layer}", D * hidden
    nodes.append(helper.make_node("MatMul", [x, "head"], ["Y"]))
    inits.append(_w(rng, "head", size, 3))
    outputs = [_f32("Y", None), _f32(f"H{layers - 1}", None)]
    return (_model(nodes, [_f32("X", ["seq", batch, features])], outputs, inits),
            {"X": _x(rng, seq, batch, features)})


def gru_stack():
    """Bidirectional GRU -> GRU (linear_before_reset=1, PyTorch's) -> Linear; symbolic seq, batch 3."""
    return _recurrent("GRU", 3, 2, seq=9, batch=3, features=7, hidden=11, seed=14, bidirectional_first=True,
                      linear_before_reset=1)


def rnn_stack():
    """Two tanh RNN layers -> Linear; symbolic seq, batch 1."""
    return _recurrent("RNN", 1, 2, seq=13, batch=1, features=5, hidden=9, seed=15)


def lstm_stack():
    """Bidirectional LSTM -> LSTM -> Linear (an OCR CRNN's head); symbolic seq, batch 3."""
    return _recurrent("LSTM", 4, 2, seq=11, batch=3, features=7, hidden=9, seed=16, bidirectional_first=True)


BLOCKS = {f.__name__: f for f in (
    depthwise_1x1, depthwise_1x1_symbolic, depthwise_conv1d, depthwise_conv2d_time, grouped_conv1d, dilated_conv1d,
    strided_conv2d, conv_transpose1d, conv_transpose2d, depthwise_conv_transpose1d, einsum_linear, linear_one_feature,
    matmul_gemm, fc_rows, matmul_integer, layernorm_batchnorm, computed_pad, if_block, gru_stack, rnn_stack, lstm_stack)}
# name -> (block, options): TVM's own conversion (importer option stock_conv) and TVM's own dlight step
# (STOCK_SCHEDULE: tvmseq.schedule_gpu.stock_pipeline), to show its CUDA bugs (expected to fail on the GPU)
STOCK_SCHEDULE = "stock_schedule"
STOCK_CASES = {"depthwise_1x1_stock": ("depthwise_1x1", {"stock_conv": True, STOCK_SCHEDULE: True}),
               "linear_one_feature_stock": ("linear_one_feature", {STOCK_SCHEDULE: True})}
TOL = {"rtol": 1e-4, "atol": 2e-5}


def needs(name: str) -> str | None:
    """Why a block cannot be built yet (a converter another part of tvmseq adds), or None."""
    from tvmseq.onnx import CONVERTERS

    if name == "lstm_stack" and "LSTM" not in CONVERTERS:
        return "tvmseq has no LSTM converter yet (tvmseq/onnx/lstm.py)"
    if name == "matmul_integer":
        import host_cpu

        if not host_cpu.ort_u8s8_exact():
            return "onnxruntime's uint8 x int8 GEMM saturates int16 pair sums on this CPU (no VNNI): not a reference"
    return None


def onnxruntime_outputs(model, feeds) -> dict:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def max_errors(got: dict, want: dict) -> dict:
    """{output: max abs error} (inf on a shape mismatch)."""
    return {k: float(np.abs(np.asarray(got[k], np.float64) - want[k]).max()) if np.shape(got[k]) == want[k].shape
            else float("inf") for k in want}


def assert_close(got: dict, want: dict, what: str):
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, **TOL, err_msg=f"{what}: output {name}")


# ---------------------------------------------------------------------------------------------------
# The stock CUDA schedule, run on the CPU (thread bindings turned into serial loops)
# ---------------------------------------------------------------------------------------------------
def emulate_cuda_schedule(model, feeds, stock_schedule: bool = False, **options) -> np.ndarray:
    """Run what tvmseq's CUDA pipeline schedules (legalize, fuse, `tvmseq.schedule_gpu`; with
    `stock_schedule`, TVM's own dlight step) on the CPU, with every thread-bound loop made serial and
    shared buffers made local. A block's value does not depend on how its loops are bound to threads,
    so this checks what each schedule computes (not races: the GPU tests do). Kernels of dlight's Matmul
    rule (shared-memory tiles, virtual threads) do not lower for the CPU this way; Fallback, GEMV and the
    Reduction rules do."""
    import tvmseq
    from tvmseq import targets

    mod = tvmseq.from_onnx(model, target=targets.resolve("cuda"), **options)
    return emulate_cuda_module(mod, feeds, stock_schedule)


def emulate_cuda_module(mod, feeds, stock_schedule: bool = False) -> np.ndarray:
    """`emulate_cuda_schedule` for a Relax module (its main run on `feeds`' values)."""
    import tvm
    from tvm import relax, tirx
    from tvm.relax.backend.cpu_generic import pipeline as cpu_pipeline
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline

    from tvmseq import schedule_gpu, targets

    cuda = targets.resolve("cuda")
    legalize = cuda_pipeline.legalize_passes(cuda) if stock_schedule else schedule_gpu.legalize_passes(cuda)
    with cuda:
        mod = tvm.transform.Sequential(cuda_pipeline.library_dispatch_passes(cuda) + legalize)(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc):
            text = re.sub(r'T\.thread_binding\((.*?), thread="[^"]+"\)', r"T.serial(\1)", func.script())
            # shared and thread-local buffers as one global buffer: with the threads serial a thread-local sum of
            # a run-time number of outputs is not one value a thread any more (no CPU stack allocation of it)
            text = re.sub(r'scope="(shared(\.dyn)?|local)"', 'scope="global"', text)
            mod[gv] = tvm.script.from_source(text)
    cpu = tvm.target.Target("llvm")
    lower = tvm.transform.Sequential(cpu_pipeline.dataflow_lower_passes(cpu) + cpu_pipeline.finalize_passes(cpu))
    vm = relax.VirtualMachine(tvm.compile(mod, target=cpu, relax_pipeline=lower), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()


# ---------------------------------------------------------------------------------------------------
# Building the CUDA models here for the GPU test
# ---------------------------------------------------------------------------------------------------
def all_cases() -> dict:
    """name -> (block name, options: the importer's, and STOCK_SCHEDULE)."""
    return {**{name: (name, {}) for name in BLOCKS}, **STOCK_CASES}


def build(out_dir, names=None, sass: bool = True) -> dict:
    """Compile every case for the H100 (sm_90a SASS embedded when `sass`, else CUDA source that the
    GPU machine compiles on load) into out_dir with its ONNX, inputs and onnxruntime's outputs."""
    import contextlib

    from tvmseq import cuda_toolchain, schedule_gpu
    from tvmseq.build import compile_onnx, export

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # some cases rebuilt (`names`): the others' entries stay
    index = json.loads((out / "index.json").read_text()) if names and (out / "index.json").exists() else {}
    for name, (block, options) in all_cases().items():
        if names and name not in names:
            continue
        why = needs(block)
        if why:
            print(f"{name}: skipped: {why}", flush=True)
            continue
        model, feeds = BLOCKS[block]()
        expected = onnxruntime_outputs(model, feeds)
        binaries = cuda_toolchain.device_binaries(("sm_90a",)) if sass else contextlib.nullcontext()
        importer_options = {k: v for k, v in options.items() if k != STOCK_SCHEDULE}
        schedule = schedule_gpu.stock_pipeline() if options.get(STOCK_SCHEDULE) else contextlib.nullcontext()
        try:
            with binaries, schedule:
                compiled = compile_onnx(model, target="cuda", **importer_options)
            export(compiled, out / f"{name}.so")
        except Exception as err:  # noqa: BLE001 - recorded: the GPU test reports it as the failure
            index[name] = {"block": block, "options": options, "error": f"{type(err).__name__}: {err}"[:500]}
            print(f"{name}: BUILD FAILED {index[name]['error'][:200]}", flush=True)
            continue
        onnx.save(model, str(out / f"{name}.onnx"))
        np.savez(out / f"{name}.npz", **{f"in_{k}": v for k, v in feeds.items()},
                 **{f"out_{k}": v for k, v in expected.items()})
        index[name] = {"block": block, "options": options, "inputs": list(feeds), "outputs": list(expected)}
        print(f"{name}: built", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return index


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "build":
        sys.exit("usage: python -m tests.blocks build OUTDIR [--no-sass] [names...]")
    args = sys.argv[2:]
    sass = "--no-sass" not in args
    args = [a for a in args if a != "--no-sass"]
    build(args[0], args[1:] or None, sass=sass)
