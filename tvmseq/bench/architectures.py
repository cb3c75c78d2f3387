"""The whole-model benchmark architectures, defined once in torch.nn and exported to ONNX from there.

| name | what | input (time-major) | streams |
|---|---|---|---|
| denoiser | FC 161->400, GRU 400 x 2, FC 600, 600, 161, sigmoid mask (NSNet-like) | X [frames, batch, 161] | state exposed by tvmseq (`expose_state`) |
| vad | per-frame conv front end (two Conv1d over the 64 features), FC 128, LSTM 128 with state in/out, FC 1, sigmoid | X [frames, batch, 64], h0/c0 [1, batch, 128] | its own state in/out |
| crnn | CNN over a 32-pixel-high line (three conv + pool stages, width 4 per frame), 2-layer BiLSTM 256, FC 37 | X [batch, 1, 32, 4 * frames] | no (bidirectional) |
| asr | 5-layer bidirectional GRU 512 on 80 filterbanks, FC 29 | X [frames, batch, 80] | no (bidirectional) |

Weights are a pure function of each parameter's name and shape (`deterministic_state`), so the GPU
machine rebuilds the same weights with numpy and needs no weight files: the ONNX model travels as its graph
plus, for each initializer, the positions in the parameters it was copied from (`initializer_sources`,
found by exporting twice with parameters set to their own element and parameter numbers) and is filled in
there (`materialize`).
"""
from __future__ import annotations

import io
import zlib

import numpy as np

ARCHITECTURES = ("denoiser", "vad", "crnn", "asr")
STREAMING = ("denoiser", "vad")
SEED = 2026


def _torch():
    import torch

    return torch


def build(name: str):
    """A fresh torch.nn.Module of the architecture (eval mode, weights from `deterministic_state`)."""
    torch = _torch()
    nn = torch.nn

    class Denoiser(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc_in = nn.Linear(161, 400)
            self.gru = nn.GRU(400, 400, num_layers=2)
            self.fc1, self.fc2, self.fc_out = nn.Linear(400, 600), nn.Linear(600, 600), nn.Linear(600, 161)

        def forward(self, x, h=None):
            y, h_n = self.gru(torch.relu(self.fc_in(x)), h)
            y = torch.relu(self.fc2(torch.relu(self.fc1(y))))
            return torch.sigmoid(self.fc_out(y)), h_n

    class Vad(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv1d(1, 8, 5, stride=2), nn.Conv1d(8, 16, 5, stride=2)
            self.fc_in = nn.Linear(16 * 13, 128)
            self.lstm = nn.LSTM(128, 128)
            self.fc_out = nn.Linear(128, 1)

        def forward(self, x, h0, c0):
            frames, batch, feats = x.shape
            f = torch.relu(self.conv2(torch.relu(self.conv1(x.reshape(frames * batch, 1, feats)))))
            f = torch.relu(self.fc_in(f.reshape(frames, batch, 16 * 13)))
            y, (h_n, c_n) = self.lstm(f, (h0, c0))
            return torch.sigmoid(self.fc_out(y)), h_n, c_n

    class Crnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn = nn.Sequential(
                nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
                nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
                nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d((8, 1), (8, 1)))
            self.lstm = nn.LSTM(256, 256, num_layers=2, bidirectional=True)
            self.fc = nn.Linear(512, 37)

        def forward(self, x):
            f = self.cnn(x).squeeze(2).permute(2, 0, 1)          # [frames, batch, 256]
            y, _ = self.lstm(f)
            return self.fc(y)

    class Asr(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(80, 512, num_layers=5, bidirectional=True)
            self.fc = nn.Linear(1024, 29)

        def forward(self, x):
            y, _ = self.gru(x)
            return self.fc(y)

    module = {"denoiser": Denoiser, "vad": Vad, "crnn": Crnn, "asr": Asr}[name]()
    module.load_state_dict({k: torch.from_numpy(v) for k, v in deterministic_state(module).items()})
    return module.eval()


def deterministic_state(module) -> dict:
    """Each parameter/buffer as a function of its name and shape only: uniform in +-1/sqrt(fan-in)
    (biases +-0.1), from numpy's PCG64 seeded by SEED and a CRC of the name (the same on every machine)."""
    state = {}
    for key, value in module.state_dict().items():
        shape = tuple(value.shape)
        rng = np.random.default_rng([SEED, zlib.crc32(key.encode())])
        bound = 0.1 if len(shape) < 2 else 1.0 / np.sqrt(int(np.prod(shape[1:])))
        state[key] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return state


def inputs(name: str, batch: int, frames: int, seed: int = 0) -> dict:
    """Random inputs by ONNX input name (numpy float32)."""
    rng = np.random.default_rng(seed)
    if name == "denoiser":
        return {"X": rng.uniform(0, 1, (frames, batch, 161)).astype(np.float32)}
    if name == "vad":
        return {"X": rng.standard_normal((frames, batch, 64)).astype(np.float32),
                "h0": np.zeros((1, batch, 128), np.float32), "c0": np.zeros((1, batch, 128), np.float32)}
    if name == "crnn":
        return {"X": rng.uniform(0, 1, (batch, 1, 32, 4 * frames)).astype(np.float32)}
    return {"X": rng.standard_normal((frames, batch, 80)).astype(np.float32)}


def io_names(name: str) -> tuple[list[str], list[str]]:
    return {"denoiser": (["X"], ["mask", "h_n"]), "vad": (["X", "h0", "c0"], ["prob", "h_n", "c_n"]),
            "crnn": (["X"], ["logits"]), "asr": (["X"], ["logits"])}[name]


def time_axes(name: str) -> dict:
    return {"X": {3: "width"} if name == "crnn" else {0: "frames"}}


def export_onnx(name: str, module, batch: int, frames: int = 8, dtype=np.float32) -> bytes:
    """torch.onnx.export (TorchScript exporter: it writes ONNX GRU/LSTM nodes) with the time axis dynamic,
    the batch static (tvmseq's GRU needs it), opset 14. The denoiser is exported without its state (an
    offline export: tvmseq exposes it for streaming)."""
    torch = _torch()
    in_names, out_names = io_names(name)
    feeds = inputs(name, batch, frames)
    args = tuple(torch.from_numpy(feeds[n].astype(dtype)) for n in in_names)
    if name == "denoiser":
        out_names = ["mask"]

        class MaskOnly(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x)[0]

        module = MaskOnly(module)
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, args, buf, input_names=in_names, output_names=out_names,
                          dynamic_axes=time_axes(name), opset_version=14, dynamo=False)
    return buf.getvalue()


# ---- weights travel as sources, not values ---------------------------------------------------------------
def _flat(state: dict) -> tuple[np.ndarray, dict]:
    keys = sorted(state)
    offsets, pos = {}, 0
    for k in keys:
        offsets[k] = pos
        pos += state[k].size
    return np.concatenate([state[k].ravel() for k in keys]) if keys else np.zeros(0, np.float32), offsets


def initializer_sources(name: str, batch: int) -> tuple[bytes, dict, dict]:
    """(ONNX model with real weights, {initializer: flat positions into the sorted parameters}, {initializer:
    array} for initializers that are not copies of parameters). The positions come from a float64 export
    with every parameter element set to its own position + 1 (exact in float64, and no two tensors alike,
    so the exporter merges none); they are checked to reproduce every initializer of the real export."""
    import onnx
    from onnx import numpy_helper

    torch = _torch()
    module = build(name)
    real = export_onnx(name, module, batch)
    state = {k: v.numpy() for k, v in module.state_dict().items()}
    flat, offsets = _flat(state)
    tagged = build(name).double()
    tagged.load_state_dict({k: torch.from_numpy(np.arange(offsets[k] + 1, offsets[k] + 1 + state[k].size,
                                                          dtype=np.float64).reshape(state[k].shape))
                            for k in state})
    ids = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(
        export_onnx(name, tagged, batch, dtype=np.float64)).graph.initializer}
    sources, literal = {}, {}
    for init in onnx.load_from_string(real).graph.initializer:
        value = numpy_helper.to_array(init)
        tag = ids.get(init.name)
        positions = None
        if tag is not None and tag.shape == value.shape and value.dtype == np.float32 and value.size \
                and np.all(tag == np.round(tag)) and tag.min() >= 1 and tag.max() <= flat.size:
            positions = tag.astype(np.int64).ravel() - 1
            if not np.array_equal(flat[positions].reshape(value.shape), value):
                positions = None
        if positions is None:
            literal[init.name] = value
        else:
            sources[init.name] = positions
    return real, sources, literal


def pack_sources(sources: dict) -> dict:
    """Positions as arrays for np.savez_compressed: delta-coded (runs of consecutive positions, the
    common case, compress to almost nothing)."""
    return {k: np.diff(v, prepend=0) for k, v in sources.items()}


def unpack_sources(packed) -> dict:
    return {k: np.cumsum(packed[k]) for k in packed}


def skeleton(model_bytes: bytes, keep: set) -> bytes:
    """The ONNX model with every initializer not in `keep` emptied (its name, type and dims stay)."""
    import onnx

    model = onnx.load_from_string(model_bytes)
    for init in model.graph.initializer:
        if init.name not in keep:
            dims, dtype, nm = list(init.dims), init.data_type, init.name
            init.Clear()
            init.name, init.data_type = nm, dtype
            init.dims.extend(dims)
    return model.SerializeToString()


def materialize(skeleton_bytes: bytes, sources: dict, state: dict) -> bytes:
    """Fill the emptied initializers from the parameters (`deterministic_state` of the same module)."""
    import onnx
    from onnx import numpy_helper

    flat, _ = _flat(state)
    model = onnx.load_from_string(skeleton_bytes)
    for init in model.graph.initializer:
        if init.name in sources:
            value = flat[sources[init.name]].reshape(list(init.dims)).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(value, init.name))
    return model.SerializeToString()
