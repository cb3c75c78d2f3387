"""ONNX LSTM models on the GPU (skipped without one) against tvmseq.reference.lstm (float64), on odd sizes
(hidden 37, 100, 257 x batch 3, 19, 67) with every attribute that changes the kernels, fp32 and fp16.

Two ways to run them:
    python tests/test_gpu_lstm.py build out/lstm        # HERE: compile for the H100 (sm_90a SASS embedded),
                                                        # export .so + feeds + reference outputs
    TVMSEQ_LSTM_DIR=out/lstm pytest -m gpu tests/test_gpu_lstm.py   # THERE: TVM's runtime only is enough
`test_lstm_compiled_on_gpu_matches_reference` (marked `compiles`) builds the same cases on the GPU machine.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

PREBUILT = Path(os.environ.get("TVMSEQ_LSTM_DIR", Path(__file__).resolve().parents[1] / "out" / "lstm"))
TOL = {"float32": dict(rtol=1e-4, atol=2e-5), "float16": dict(rtol=2e-2, atol=2e-2)}
OUTPUTS = ("Y", "Y_h", "Y_c")

_ACTS = (["HardSigmoid", "Tanh", "Softsign"], [0.3], [0.55])   # (activations of one direction, alpha, beta)
# name -> lstm_node_model keyword arguments (seq 9, input size 23 throughout)
CASES = {
    "h37_b3_peep_clip": dict(hidden=37, batch=3, with_peepholes=True, clip=1.5, with_initial_h=True,
                             with_initial_c=True),
    "h37_b19_bi_lens_forget": dict(hidden=37, batch=19, direction="bidirectional", with_seq_lens=True, input_forget=1),
    "h37_b67_rev_lens_acts": dict(hidden=37, batch=67, direction="reverse", with_seq_lens=True, acts=True),
    "h100_b3_bi_peep_lens": dict(hidden=100, batch=3, direction="bidirectional", with_peepholes=True,
                                 with_seq_lens=True, with_initial_h=True, with_initial_c=True),
    "h100_b19_clip_acts": dict(hidden=100, batch=19, clip=2.0, acts=True, with_initial_c=True),
    "h100_b67_bi_layout1": dict(hidden=100, batch=67, direction="bidirectional", with_peepholes=True, input_forget=1,
                                with_seq_lens=True, layout=1, with_initial_h=True),
    "h257_b3_rev_lens": dict(hidden=257, batch=3, direction="reverse", with_seq_lens=True, with_initial_h=True),
    "h257_b19_bi_all": dict(hidden=257, batch=19, direction="bidirectional", with_peepholes=True, with_seq_lens=True,
                            clip=3.0, acts=True, with_initial_h=True, with_initial_c=True),
    "h257_b67_peep_lens": dict(hidden=257, batch=67, with_peepholes=True, with_seq_lens=True),
    # 603 / 576 float32 rows, N a multiple of 128: the input projection on tf32 tensor cores (tf32x3), K 23 padded
    "h128_b67_peep_clip_tf32x3": dict(hidden=128, batch=67, with_peepholes=True, clip=2.5, with_initial_c=True),
    "h256_b64_bi_lens_tf32x3": dict(hidden=256, batch=64, direction="bidirectional", with_seq_lens=True,
                                    with_initial_h=True),
    "fp16_h100_b19_bi_peep_lens": dict(hidden=100, batch=19, direction="bidirectional", with_peepholes=True,
                                       with_seq_lens=True, with_initial_h=True, dtype="float16"),
    "fp16_h257_b67_lens": dict(hidden=257, batch=67, with_seq_lens=True, with_initial_c=True, dtype="float16"),
}


def _model(name):
    """(model, feeds, reference outputs by name) of case `name`."""
    from test_lstm_reference import _attrs, lstm_node_model, reference_outputs

    kwargs = dict(CASES[name])
    if kwargs.pop("acts", False):
        D = 2 if kwargs.get("direction") == "bidirectional" else 1
        names, alpha, beta = _ACTS
        kwargs.update(activations=names * D, activation_alpha=alpha * D, activation_beta=beta * D)
    model, feeds, inputs = lstm_node_model(seq=9, input_size=23, seed=kwargs["hidden"] + kwargs["batch"], **kwargs)
    return model, feeds, dict(zip(OUTPUTS, reference_outputs(inputs, **_attrs(model))))


def _check(name, got, want, dtype):
    for out_name, value in zip(OUTPUTS, got):
        np.testing.assert_allclose(np.asarray(value, np.float64), want[out_name], **TOL[dtype],
                                   err_msg=f"{name}: output {out_name}")


def build(out_dir, names=None) -> None:
    """Compile the cases (default all) for the H100 with sm_90a SASS; store feeds and reference outputs."""
    from tvmseq import cuda_toolchain
    from tvmseq.build import compile_onnx, export

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name in names or CASES:
        model, feeds, want = _model(name)
        with cuda_toolchain.device_binaries(("sm_90a",)):
            compiled = compile_onnx(model, target="cuda")
        export(compiled, out / f"{name}.so")
        np.savez(out / f"{name}.npz", **{f"in_{k}": v for k, v in feeds.items()},
                 **{f"out_{k}": v for k, v in want.items()})
        index[name] = {"inputs": list(feeds), "dtype": CASES[name].get("dtype", "float32")}
        print(name, flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


@pytest.mark.parametrize("name", list(CASES))
def test_prebuilt_lstm_on_gpu_matches_reference(name):
    """Models built on the CPU machine (`build`), run with TVM's runtime only."""
    from tvmseq.runtime import load_model

    if not (PREBUILT / f"{name}.so").exists():
        pytest.skip(f"no prebuilt model in {PREBUILT} (python tests/test_gpu_lstm.py build {PREBUILT})")
    index = json.loads((PREBUILT / "index.json").read_text())[name]
    data = np.load(PREBUILT / f"{name}.npz")
    got = load_model(PREBUILT / f"{name}.so")(**{k: data[f"in_{k}"] for k in index["inputs"]})
    _check(name, got, {k: data[f"out_{k}"] for k in OUTPUTS}, index["dtype"])


@pytest.mark.compiles
@pytest.mark.parametrize("name", list(CASES))
def test_lstm_compiled_on_gpu_matches_reference(name):
    import tvmseq

    model, feeds, want = _model(name)
    got = tvmseq.compile_onnx(model, target="cuda")(**feeds)
    _check(name, got, want, CASES[name].get("dtype", "float32"))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # test_lstm_reference, also under `python -m`
    args = sys.argv[1:]
    if not args or args[0] != "build" or len(args) < 2:
        sys.exit("usage: python tests/test_gpu_lstm.py build OUTDIR [case names]")
    build(args[1], args[2:] or None)
