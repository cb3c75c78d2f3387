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

A CUDA-graph model replays a known frame shape with no VM and no checks (`FramePlan`: the frame copied into the
capture's input buffer, one graph launch). A producer on the GPU can write the frames into those buffers itself,
as a CUDA graph's static inputs are used, and skip that copy too:

    buffers = stream.frame_buffers()          # after one call with frames: {name: device tensor}
    torch.from_dlpack(buffers["X"]).copy_(next_frame)   # or any kernel writing there
    mask = stream()                           # no arguments: the frames in place
"""
from __future__ import annotations

import numpy as np

from .errors import TvmseqError
from .tensors import _KDL_CUDA


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
        self._plans: dict = {}        # frame signature -> FramePlan (CUDA-graph models)
        self._recent = None           # the FramePlan of the last fast call (tried first: no signature built)
        self.fast_calls = 0           # calls that took a FramePlan

    @property
    def state(self) -> dict:
        """The current state tensors (on the model's device) by input name; empty after `reset`."""
        return dict(self._state)

    def reset(self) -> None:
        self._state = {}
        self._plans = {}
        self._recent = None

    def frame_buffers(self) -> dict:
        """{frame input: device tensor} the next `stream()` without arguments reads: the capture's own input
        buffers (DLPack: `torch.from_dlpack`), for a producer that writes each frame there, as a CUDA graph's
        static inputs are used (no copy a call). Valid until a call of another shape or `reset`."""
        plan = self._recent
        if plan is None or not plan.valid(self._state):
            raise TvmseqError("frame_buffers(): the stream has none yet: call it once with frames (a CUDA-graph "
                              "model), then write the next frames into these buffers and call stream()")
        return dict(zip(self.frame_inputs, plan.buffers))

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
        input given by name replaces the kept state); returns the outputs that are not state. No arguments
        (frames in the model): the frames already written into `frame_buffers()`, replayed as they are."""
        plan = self._recent
        if plan is not None and plan.valid(self._state):
            if not args and not kwargs and self.frame_inputs:
                self.fast_calls += 1
                return plan.replay_in_place()
            frames = args if not kwargs else self._frames(args, kwargs)
            if frames is not None and not plan.fits(frames):
                plan = self._plans.get(_signature(frames))
                plan = plan if plan is not None and plan.valid(self._state) else None
            if frames is not None and plan is not None:
                self.fast_calls += 1
                self._recent = plan
                return plan(frames)
        elif not args and not kwargs and self.frame_inputs:
            raise TvmseqError("stream() without frames replays the frames in frame_buffers(), which the stream has "
                              "only after a call with frames (a CUDA-graph model, frames of one shape)")
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
        self._remember_plan(self._frames(args, kwargs))
        rest = [v for k, v in self.model.named(outputs).items() if k not in self.pairs.values()]
        if self.output == "numpy":
            rest = [v.numpy() for v in rest]
        return rest[0] if len(rest) == 1 else tuple(rest)

    def _frames(self, args, kwargs) -> tuple | None:
        """The frame inputs in `frame_inputs` order when the call gives exactly them (no state input), else None."""
        if kwargs:
            if args or len(kwargs) != len(self.frame_inputs) or any(n not in kwargs for n in self.frame_inputs):
                return None
            return tuple(kwargs[n] for n in self.frame_inputs)
        return args if len(args) == len(self.frame_inputs) else None

    def _remember_plan(self, frames) -> None:
        """After a captured call that gave exactly the frame inputs, numpy arrays without run-time value checks:
        a FramePlan for calls with the same shapes and dtypes (the checks of shape and dtype it skips gave the
        same answer on this call)."""
        model = self.model
        last = getattr(model, "_last_graph", None)
        if frames is None or not model.cuda_graph or last is None or last[1].get("call") is None:
            return
        specs = {s.get("onnx_name", s["name"]): s for s in model.signature["inputs"]}
        if any(not _plain_array(a) or specs[n].get("checks") for n, a in zip(self.frame_inputs, frames)):
            return
        position, _ = model._feedback_of(tuple(self.pairs.items()))
        if any(self._state[name] is not last[1]["inputs"][position[name]] for name in self.pairs):
            return      # the state is not the capture's own buffers: the slow path copies it in
        keep = [i for i, k in enumerate(model.output_names) if k not in self.pairs.values()]
        self._recent = self._plans[_signature(frames)] = FramePlan(
            model, last, [position[n] for n in self.frame_inputs], keep, self.output, dict(self._state), frames)


class FramePlan:
    """A captured call replayed with no checks and no VM in between: each frame copied into its buffer (a numpy
    frame through a page-locked staging array, a CUDA tensor by its address; asynchronous), one graph launch, the
    outputs copied out through page-locked arrays and waited for (numpy) or returned as the device tensors the
    capture writes. Valid while the model still holds this capture (a new shape past `max_graph_shapes` or
    `set_weights` start the cache anew: a new dict) and the stream's state is in the capture's buffers."""

    def __init__(self, model, last, frame_positions: list[int], keep: list[int], output: str, state: dict, frames):
        from . import cuda_graph

        self._model, self._graphs, (_, entry), self._state = model, model._graphs, last, state
        self._buffers = [entry["inputs"][p] for p in frame_positions]
        self._kinds = [(type(f), tuple(f.shape), f.dtype) for f in frames]   # what `fits` compares
        self._nbytes = [cuda_graph.nbytes(b) for b in self._buffers]
        call = entry["call"]
        listed = (call.outputs,) if hasattr(call.outputs, "data_ptr") else tuple(call.outputs)
        self._outputs = [listed[i] for i in keep]
        self._replay, self._copy_from = call.replay, cuda_graph.copy_from_address
        self._numpy = output == "numpy"
        self._on_gpu = model.device.dlpack_device_type() == _KDL_CUDA
        staged = self._numpy and self._on_gpu    # numpy out waits for the copies: staging arrays reused safely
        self._staged_in = [cuda_graph.Pinned(tuple(b.shape), str(b.dtype)) if staged else None
                           for b in self._buffers]
        self._staged_out = [cuda_graph.Pinned(tuple(o.shape), str(o.dtype)) if staged else None
                            for o in self._outputs]
        self._upload, self._synchronize = cuda_graph.upload, cuda_graph.synchronize

    @property
    def buffers(self) -> list:
        return list(self._buffers)

    def valid(self, state: dict) -> bool:
        # the model's capture cache is only ever replaced whole (runtime.Model._reset_graphs), never pruned
        if self._model._graphs is not self._graphs:
            return False
        for name, buffer in self._state.items():
            if state.get(name) is not buffer:
                return False
        return True

    def fits(self, frames) -> bool:
        """The frames have the plan's kinds, shapes and dtypes and are contiguous (what `_signature` keys, without
        building the key: this runs on every call)."""
        if len(frames) != len(self._kinds):
            return False
        for frame, (kind, shape, dtype) in zip(frames, self._kinds):
            if type(frame) is not kind or frame.dtype != dtype or tuple(frame.shape) != shape:
                return False
            if kind is np.ndarray:
                if not frame.flags.c_contiguous:
                    return False
            elif not (frame.is_cuda and frame.is_contiguous()):
                return False
        return True

    def replay_in_place(self):
        """The frames already in the capture's buffers: launch and return the outputs."""
        self._replay()
        return self._outputs_out()

    def __call__(self, frames):
        for buffer, nbytes, staged, frame in zip(self._buffers, self._nbytes, self._staged_in, frames):
            if not isinstance(frame, np.ndarray):
                self._copy_from(buffer, frame.data_ptr(), nbytes)
            elif staged is not None:
                np.copyto(staged.array, frame)
                staged.to_device(buffer)
            else:
                self._upload(buffer, frame)
        self._replay()
        return self._outputs_out()

    def _outputs_out(self):
        if not self._numpy:
            rest = self._outputs
        elif self._on_gpu:
            for out, staged in zip(self._outputs, self._staged_out):
                staged.from_device(out)
            self._synchronize()
            rest = [staged.array.copy() for staged in self._staged_out]
        else:
            rest = [out.numpy() for out in self._outputs]
        return rest[0] if len(rest) == 1 else tuple(rest)


def _plain_array(value) -> bool:
    """A C-contiguous numpy array, or a contiguous CUDA tensor that shows its address (torch)."""
    if isinstance(value, np.ndarray):
        return value.flags.c_contiguous and value.dtype.kind in "fiub"
    return getattr(value, "is_cuda", False) is True and value.is_contiguous()


def _signature(args) -> tuple | None:
    """(shape, dtype, where) of each frame: the key of a FramePlan; None where one is not a plain array."""
    if not all(_plain_array(a) for a in args):
        return None
    return tuple((tuple(a.shape), str(a.dtype), isinstance(a, np.ndarray)) for a in args)
