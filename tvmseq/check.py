"""`tvmseq check`: run a model through tvmseq and onnxruntime (CPU provider) on the same inputs and compare
every output, at one or more sizes of each dynamic axis (what Polygraphy's comparison gives TensorRT users).

Sizes: every symbolic dimension of the graph inputs (ONNX `dim_param`, or an unnamed dim, called
`<input>_dim<axis>`) takes each value of `lengths[name]` (default DEFAULT_LENGTHS, small odd numbers);
with several symbolic dims the cases are the zip of their value lists (the shortest list decides).
Dims fixed with `shapes` (or by the compiled model's signature) take that value.

Random inputs (seeded, one seed per case), by dtype:
  - floats: uniform in [-1, 1];
  - integers whose name says they are lengths (contains "len"): in [1, T], one of them T, where T is
    the size of the axis named like time ("seq", "time", "len", "frame", "T") if there is one, else
    axis 0 of the first float input (ONNX RNN layout 0 is time-major);
  - other integers: in [0, 2] (small indices); bool: random.
Inputs with a meaning random data cannot have (a sample rate, a token id) are given with
`inputs={name: array}` (CLI: --input NAME=FILE.npy); they must fit every case's sizes.

An output matches when |tvmseq - ort| <= atol + rtol * |ort| everywhere (numpy's allclose), shapes and
dtypes agree, and NaNs sit at the same places. Tolerances by dtype: TOLERANCES (rtol/atol override).
Reported max rel error: max |tvmseq - ort| / max(|ort|, atol). Times: median of `repeats` runs after
one warm-up, numpy in and out for both, the two timed in alternating bursts with pauses (`time_both`).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import TvmseqError

DEFAULT_LENGTHS = (3, 7)
TOLERANCES = {"float32": (1e-4, 1e-5), "float64": (1e-7, 1e-9), "float16": (1e-2, 1e-3), "bfloat16": (2e-2, 1e-2)}
_TIME_NAMES = re.compile(r"seq|time|len|frame|^t$", re.IGNORECASE)


@dataclass
class InputSpec:
    """A graph input: ONNX name, numpy dtype and dims (ints, or the name of a symbolic dim)."""

    name: str
    dtype: str
    dims: list


@dataclass
class OutputResult:
    name: str
    shape: list
    dtype: str
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""


@dataclass
class CaseResult:
    sizes: dict
    outputs: list[OutputResult]
    tvmseq_ms: float
    ort_ms: float

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)


@dataclass
class CheckReport:
    model: str
    target: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases)

    def to_json(self) -> dict:
        return {"model": self.model, "target": self.target, "ok": self.ok,
                "cases": [{**asdict(c), "ok": c.ok} for c in self.cases]}


# ---------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------
def input_specs(proto) -> list[InputSpec]:
    """The graph inputs that are fed (initializers listed as inputs by old exporters are not)."""
    from onnx import helper

    inits = {i.name for i in proto.graph.initializer}
    specs = []
    for value in proto.graph.input:
        if value.name in inits:
            continue
        tensor_type = value.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)).name
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or f"{value.name}_dim{axis}")
                for axis, d in enumerate(tensor_type.shape.dim)]
        specs.append(InputSpec(value.name, dtype, dims))
    return specs


def fix_dims(specs: list[InputSpec], shapes: dict | None, signature: dict | None) -> list[InputSpec]:
    """Dims fixed by --shape (by input name) or by a compiled model's signature replace symbolic ones."""
    by_onnx = {s.get("onnx_name", s["name"]): s for s in (signature or {}).get("inputs", [])}
    fixed = []
    for spec in specs:
        dims = list(spec.dims)
        if shapes and spec.name in shapes:
            if len(shapes[spec.name]) != len(dims):
                raise TvmseqError(f"--shape {spec.name}: rank {len(shapes[spec.name])}, the model's input has "
                                  f"rank {len(dims)} ({dims})")
            dims = list(shapes[spec.name])
        compiled = (by_onnx.get(spec.name) or {}).get("shape")
        if compiled and len(compiled) == len(dims):
            dims = [c if isinstance(c, int) else d for c, d in zip(compiled, dims)]
        fixed.append(InputSpec(spec.name, spec.dtype, dims))
    return fixed


def bind_given(specs: list[InputSpec], given: dict | None) -> list[InputSpec]:
    """Symbolic dims take their size from the inputs given as arrays (so random ones fit them)."""
    bound = {}
    for spec in specs:
        if given and spec.name in given:
            shape = np.shape(given[spec.name])
            if len(shape) != len(spec.dims):
                raise TvmseqError(f"--input {spec.name}: shape {list(shape)}, the model expects rank "
                                  f"{len(spec.dims)} ({spec.dims})")
            bound.update({d: n for d, n in zip(spec.dims, shape) if isinstance(d, str)})
    return [InputSpec(s.name, s.dtype, [bound.get(d, d) if isinstance(d, str) else d for d in s.dims])
            for s in specs]


def symbolic_dims(specs: list[InputSpec]) -> list[str]:
    return list(dict.fromkeys(d for s in specs for d in s.dims if isinstance(d, str)))


def size_cases(symbols: list[str], lengths: dict | None) -> list[dict]:
    """One dict {dim: size} per case (see the module doc)."""
    lengths = dict(lengths or {})
    unknown = sorted(set(lengths) - set(symbols))
    if unknown:
        raise TvmseqError(f"--lengths {', '.join(unknown)}: the model has no such dynamic axis "
                          f"(its dynamic axes: {', '.join(symbols) or 'none'})")
    if not symbols:
        return [{}]
    values = [list(lengths.get(s, DEFAULT_LENGTHS)) for s in symbols]
    return [dict(zip(symbols, combo)) for combo in zip(*values)]


def _time_length(specs: list[InputSpec], sizes: dict) -> int:
    for name, size in sizes.items():
        if _TIME_NAMES.search(name):
            return size
    for spec in specs:
        if spec.dtype.startswith(("float", "bfloat")) and spec.dims:
            first = spec.dims[0]
            return sizes.get(first, first) if isinstance(first, str) else first
    return 1


def random_input(spec: InputSpec, shape: list[int], seq: int, rng) -> np.ndarray:
    """Random data for one input by dtype (module doc)."""
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        return rng.uniform(-1, 1, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        if "len" in spec.name.lower():
            values = rng.integers(1, max(seq, 1) + 1, shape).astype(dtype)
            if values.size:
                values.reshape(-1)[0] = seq         # one full-length sequence
            return values
        return rng.integers(0, 3, shape).astype(dtype)
    raise TvmseqError(f"input {spec.name!r}: no random data for dtype {dtype}; give it with --input")


def make_feeds(specs: list[InputSpec], sizes: dict, given: dict | None, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seq = _time_length(specs, sizes)
    feeds = {}
    for spec in specs:
        if given and spec.name in given:
            feeds[spec.name] = np.asarray(given[spec.name])
            continue
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.dims]
        feeds[spec.name] = random_input(spec, shape, seq, rng)
    return feeds


# ---------------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------------
def ort_session(proto):
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise TvmseqError("tvmseq check needs onnxruntime (pip install onnxruntime)") from err
    try:
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise TvmseqError(f"onnxruntime cannot load the model: {str(err).splitlines()[0]}") from None


def run_ort(session, feeds: dict) -> dict:
    names = [o.name for o in session.get_outputs()]
    try:
        outs = session.run(None, feeds)
    except Exception as err:  # noqa: BLE001
        raise TvmseqError(f"onnxruntime failed on the inputs: {str(err).splitlines()[0]}") from None
    return dict(zip(names, outs))


def run_tvmseq(model, feeds: dict, names: list[str]) -> dict:
    outs = model(dict(feeds))
    outs = outs if isinstance(outs, tuple) else (outs,)
    if len(outs) != len(names):
        raise TvmseqError(f"tvmseq's model returned {len(outs)} outputs, onnxruntime {len(names)}")
    return dict(zip(names, outs))


def time_both(model, session, feeds: dict, repeats: int) -> tuple[float, float]:
    """(tvmseq ms, onnxruntime ms): medians of `repeats` runs each, in alternating bursts with pauses between
    them (`bench.cpu.alternate`). Each runtime's idle pool threads spin for a while after a run; timed right
    after onnxruntime, a CPU model waited for a core (flashvad-stream at batch 7: 3.97 ms, 0.12 settled)."""
    from .bench.cpu import alternate

    tvm_ms, ort_ms, _, _ = alternate(lambda: model(dict(feeds)), lambda: session.run(None, feeds),
                                     reps=max(repeats, 1), warmup=1)
    return tvm_ms, ort_ms


def tolerance(dtype: str, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default = TOLERANCES.get(dtype, (0.0, 0.0))       # integers and bools: exact
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def compare(name: str, got, want, rtol: float | None, atol: float | None) -> OutputResult:
    got, want = np.asarray(got), np.asarray(want)
    r, a = tolerance(want.dtype.name, rtol, atol)
    if got.shape != want.shape:
        return OutputResult(name, list(want.shape), want.dtype.name, float("inf"), float("inf"), False,
                            f"shape {list(got.shape)} from tvmseq")
    note = "" if got.dtype == want.dtype else f"dtype {got.dtype} from tvmseq"
    g, w = got.astype(np.float64), want.astype(np.float64)
    same_nan = np.array_equal(np.isnan(g), np.isnan(w))
    finite = ~(np.isnan(g) | np.isnan(w))
    diff = np.abs(g - w)[finite]
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = float((diff / np.maximum(np.abs(w[finite]), max(a, 1e-30))).max()) if diff.size else 0.0
    ok = same_nan and not note and bool(np.all(diff <= a + r * np.abs(w[finite])))
    if not same_nan:
        note = "NaNs differ"
    return OutputResult(name, list(want.shape), want.dtype.name, max_abs, max_rel, ok, note)


# ---------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------
def load_proto(model):
    """The ONNX model (proto, path or bytes) with onnx alone: `--compiled` runs where only TVM's runtime is
    installed, and tvmseq's importer needs TVM's compiler."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, (bytes, bytearray)):
            return onnx.load_from_string(bytes(model))
        return onnx.load(str(model))
    except FileNotFoundError:
        raise TvmseqError(f"ONNX model file not found: {model}") from None
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise TvmseqError(f"could not parse ONNX model {model!r}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def obtain_model(proto, target, shapes: dict | None, compiled: str | None):
    """The tvmseq model: loaded from an exported .so, or compiled here (any failure is one TvmseqError)."""
    if compiled is not None:
        from .runtime import load_model

        return load_model(compiled)
    from .build import compile_onnx

    try:
        return compile_onnx(proto, target=target, shape_dict=shapes or None)
    except TvmseqError:
        raise
    except Exception as err:  # noqa: BLE001 - TVM's own errors: one line, not its IR
        lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
        raise TvmseqError(f"tvmseq could not compile the model: {type(err).__name__}"
                          f"{': ' + lines[-1].strip()[:300] if lines else ''}") from None


def check(model, *, target=None, shapes: dict | None = None, inputs: dict | None = None,
          lengths: dict | None = None, compiled: str | None = None, rtol: float | None = None,
          atol: float | None = None, repeats: int = 5, seed: int = 0) -> CheckReport:
    """Compile (or load `compiled`) and compare with onnxruntime at every size case; see the module doc."""
    proto = load_proto(model)
    tvm_model = obtain_model(proto, target, shapes, compiled)
    specs = bind_given(fix_dims(input_specs(proto), shapes, tvm_model.signature), inputs)
    unknown = sorted(set(inputs or {}) - {s.name for s in specs})
    if unknown:
        raise TvmseqError(f"--input {', '.join(unknown)}: the model has no such input "
                          f"(its inputs: {', '.join(s.name for s in specs)})")
    session = ort_session(proto)
    report = CheckReport(str(model) if not hasattr(model, "graph") else model.graph.name, tvm_model.target_kind)
    for index, sizes in enumerate(size_cases(symbolic_dims(specs), lengths)):
        feeds = make_feeds(specs, sizes, inputs, seed + index)
        want = run_ort(session, feeds)
        got = run_tvmseq(tvm_model, feeds, list(want))
        tvm_ms, ort_ms = time_both(tvm_model, session, feeds, repeats)
        outputs = [compare(name, got[name], want[name], rtol, atol) for name in want]
        report.cases.append(CaseResult(sizes, outputs, tvm_ms, ort_ms))
    return report


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------
def format_table(report: CheckReport) -> str:
    """Polygraphy-like table: one row per output and size case."""
    header = ["sizes", "output", "shape", "dtype", "max abs err", "max rel err", "result", "tvmseq ms", "ort ms"]
    rows = []
    for case in report.cases:
        sizes = ",".join(f"{k}={v}" for k, v in case.sizes.items()) or "-"
        for out in case.outputs:
            result = "PASS" if out.ok else "FAIL" + (f" ({out.note})" if out.note else "")
            rows.append([sizes, out.name, "x".join(map(str, out.shape)) or "scalar", out.dtype,
                         f"{out.max_abs:.3g}", f"{out.max_rel:.3g}", result,
                         f"{case.tvmseq_ms:.3f}", f"{case.ort_ms:.3f}"])
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    verdict = "all outputs match" if report.ok else "MISMATCH"
    lines.append(f"{report.model} on {report.target} vs onnxruntime (CPU): {verdict}")
    return "\n".join(lines)


def write_json(report: CheckReport, path) -> None:
    from pathlib import Path

    try:
        Path(path).write_text(json.dumps(report.to_json(), indent=1))
    except OSError as err:
        raise TvmseqError(f"--json {path}: {err.strerror or err}") from None
