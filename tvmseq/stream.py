"""Streaming: run a recurrent model frame by frame (or chunk by chunk) with its state kept on the device.

A model streams when its recurrent state is a graph input and output (`initial_h`/`initial_c` in,
`Y_h`/`Y_c` out). Exporters that hide it (a GRU fed no `initial_h`) are opened up by
`compile_onnx(..., expose_state=True)` (`tvmseq.onnx.expose_state`), which also warns when other nodes
carry information across frames. The compiled model's signature lists its state pairs; `Stream` feeds
each call's final state, a device tensor returned by the VM, straight back as the next call's initial
state: no host copy, no re-upload.

    stream = tvmseq.Stream(model)            # or model.stream()
    for frame in frames:                      # frame [1, batch, features] (time-major X)
        mask = stream(X=frame)                # outputs other than the state, numpy (output="device": TVM tensors)
    stream.reset()                            # zero state again
"""
from __future__ import annotations

import numpy as np

from .errors import TvmseqError


class Stream:
    """`Stream(model, state=None, output="numpy")`: `state` overrides the model's recorded state pairs
    ({input name: output name}); `output` as in `Model.__call__`."""

    def __init__(self, model, state: dict | None = None, output: str = "numpy"):
        from .runtime import OUTPUT_KINDS

        if output not in OUTPUT_KINDS:
            raise TvmseqError(f"output={output!r}: must be one of {OUTPUT_KINDS}")
        pairs = dict(state) if state else {p["input"]: p["output"] for p in model.signature.get("state", [])}
        if not pairs:
            raise TvmseqError("the model has no recurrent state among its inputs and outputs: compile it with "
                              "expose_state=True, or name the pairs: Stream(model, state={input: output})")
        inputs = set(model.input_names) | {s["name"] for s in model.signature["inputs"]}
        for name_in, name_out in pairs.items():
            if name_in not in inputs:
                raise TvmseqError(f"state input {name_in!r} is not an input of the model ({', '.join(model.input_names)})")
            if name_out not in model.output_names:
                raise TvmseqError(f"state output {name_out!r} is not an output of the model "
                                  f"({', '.join(model.output_names)})")
        self.model, self.pairs, self.output = model, pairs, output
        self.frame_inputs = [n for n in model.input_names if n not in pairs]
        self._state: dict = {}

    @property
    def state(self) -> dict:
        """The current state tensors (on the model's device) by input name; empty after `reset`."""
        return dict(self._state)

    def reset(self) -> None:
        self._state = {}

    def _zeros(self, name: str, feeds: dict):
        """A zero state for input `name`, its symbolic dims read off the frame inputs."""
        import tvm

        specs = {s.get("onnx_name", s["name"]): s for s in self.model.signature["inputs"]}
        symbols = {}
        for fname, value in feeds.items():
            shape = getattr(value, "shape", np.shape(value))
            for want, got in zip(specs[fname]["shape"] or [], shape):
                if isinstance(want, str):
                    symbols[want] = int(got)
        spec = specs[name]
        try:
            shape = [d if isinstance(d, int) else symbols[d] for d in spec["shape"]]
        except KeyError as err:
            raise TvmseqError(f"state input {name!r} has dimension {err.args[0]!r}, which no frame input fixes: "
                              "pass the initial state once (stream(..., **{name: zeros}))") from None
        return tvm.runtime.tensor(np.zeros(shape, spec["dtype"]), self.model.device)

    def __call__(self, *args, **kwargs):
        """One frame or chunk: the frame inputs (positional in `frame_inputs` order, or by name; a state
        input given by name replaces the kept state); returns the outputs that are not state."""
        if len(args) > len(self.frame_inputs):
            raise TvmseqError(f"the stream takes {len(self.frame_inputs)} frame inputs "
                              f"({', '.join(self.frame_inputs)}), got {len(args)}")
        feeds = dict(zip(self.frame_inputs, args))
        for name, value in kwargs.items():
            if name in feeds:
                raise TvmseqError(f"input {name!r} given twice")
            feeds[name] = value
        frame_feeds = {k: v for k, v in feeds.items() if k not in self.pairs}
        for name in self.pairs:
            if name not in feeds:
                feeds[name] = self._state.get(name)
                if feeds[name] is None:
                    feeds[name] = self._zeros(name, frame_feeds)
        outputs, self._state = self.model.stream_run(feeds, self.pairs)   # device tensors, fed back as they are
        rest = [v for k, v in self.model.named(outputs).items() if k not in self.pairs.values()]
        if self.output == "numpy":
            rest = [v.numpy() for v in rest]
        return rest[0] if len(rest) == 1 else tuple(rest)
