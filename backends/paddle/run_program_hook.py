"""The run_impl hook on Paddle's run_program (ProgramHook): sets cuda_graph_state and
cuda_graph_dispatch_key on every call, records the subgraphs a capture runs (SizeRecord), and
replays them in order. The capture's recorder (contracts.Recorder) records each: on a device, the
run_program op itself, told to; the host stand-in, as a graph that runs the program again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from paddle.jit.dy2static.utils import CUDAGraphState

from ...errors import ReplayDivergence
from .pir_analysis import shape_only_outputs


@dataclass
class SubgraphRecord:
    """One run_program call captured for one padded size."""

    layer: Any  # the PartialProgramLayer
    inputs: List[Any]  # the tensors the graph reads; replays copy new inputs into them
    outputs: List[Any]  # the tensors the graph writes; replays return these very objects
    replay: Callable[[Callable[[], Any]], None]  # given the op's call with the replay state
    graph: Any = None  # a graph to keep alive and reset (the host stand-in's), or None


@dataclass
class SizeRecord:
    key: int
    subgraphs: List[SubgraphRecord] = field(default_factory=list)
    # (code, CustomCode, FrameArguments, guard) in the order SOT was asked; see sot_guards.FrameArguments
    frames: List[Any] = field(default_factory=list)


class ProgramHook:
    """The run_impl hook: sets cuda_graph_state / cuda_graph_dispatch_key on every run_program call."""

    def __init__(self, adapter, pass_names: List[str], on_new_program):
        self.adapter = adapter
        self.pass_names = pass_names
        self.on_new_program = on_new_program
        self.state = CUDAGraphState.DISABLE
        self.record: Optional[SizeRecord] = None
        self.recorder: Any = None  # capture: the graphs that record the subgraphs (contracts.Recorder)
        self.call_index = 0
        self.off_record = False  # this replay ran a program the recording does not have at its place
        self.seen_layers: Dict[int, Any] = {}
        self.shape_only: Dict[int, Tuple[int, ...]] = {}  # id(layer) -> its outputs made from input shapes alone
        # Those outputs, as the warmups and the capture run: a host read of one decides nothing on data
        self.shape_values: Dict[int, Any] = {}

    def begin(self, state, record: Optional[SizeRecord], recorder: Any = None) -> None:
        self.state = state
        self.record = record
        self.recorder = recorder
        self.call_index = 0
        self.off_record = False
        self.shape_values.clear()

    def end(self) -> None:
        self.state = CUDAGraphState.DISABLE
        self.record = None
        self.recorder = None
        self.shape_values.clear()

    def _first_sight(self, layer) -> None:
        # Passes rewrite the program before run_program builds an executor for it: after that the
        # executor is cached per program and a rewrite would not be seen.
        self.seen_layers[id(layer)] = layer
        counts = {}
        if self.pass_names:
            from .passes import run_passes

            # SOT traced this program from dygraph code: in-place writes are seen by later reads
            # of the same tensor, in program order, as run_program traces it.
            counts = run_passes(layer.program.forward_program, self.pass_names, semantics="eager").as_dict()
        self.shape_only[id(layer)] = shape_only_outputs(layer.program.out_values)
        self.on_new_program(layer, counts)

    def __call__(self, run_impl, inputs, params, attrs):
        layer = run_impl.__self__
        if id(layer) not in self.seen_layers:
            self._first_sight(layer)
        prog_attrs, cg_attrs = attrs
        state = self.state
        if state == CUDAGraphState.DISABLE:
            return run_impl(inputs, params, attrs)
        index = self.call_index
        self.call_index = index + 1
        record = self.record
        if state == CUDAGraphState.REPLAY:
            sub = record.subgraphs[index] if index < len(record.subgraphs) else None
            if sub is None or sub.layer is not layer:
                # The forward took a path the capture did not (a branch on a tensor value): this program runs
                # as it would without graphs, on this call's tensors, and the forward's own result is the
                # call's (SotStrategy's replay). Raising here would leave the frames run so far to run again.
                self.off_record = True
                return run_impl(inputs, params, (prog_attrs, _cg_attrs(cg_attrs, CUDAGraphState.DISABLE, 0, 0)))
            copy_ = self.adapter.copy_
            for dst, src in zip(sub.inputs, inputs):
                if src is not dst:
                    if src.shape != dst.shape:
                        raise ReplayDivergence(f"run_program call #{index}: input shape {src.shape} "
                                               f"differs from the captured {dst.shape}")
                    copy_(dst, src)
            sub.replay(lambda: run_impl(sub.inputs, params,
                                        (prog_attrs, _cg_attrs(cg_attrs, state, record.key, index))))
            return sub.outputs
        if state == CUDAGraphState.WARMUP:
            key = record.key if record is not None else 0
            return self._noted(layer, run_impl(inputs, params, (prog_attrs, _cg_attrs(cg_attrs, state, key, index))))
        # CAPTURE
        captured_inputs = list(inputs)
        disabled = (prog_attrs, _cg_attrs(cg_attrs, CUDAGraphState.DISABLE, 0, 0))
        outputs, replay, graph = self.recorder.op_recorded(
            lambda: run_impl(captured_inputs, params, (prog_attrs, _cg_attrs(cg_attrs, state, record.key, index))),
            lambda: run_impl(captured_inputs, params, disabled))
        record.subgraphs.append(SubgraphRecord(layer, captured_inputs, outputs, replay, graph))
        return self._noted(layer, outputs)

    def _noted(self, layer, outputs):
        for i in self.shape_only.get(id(layer), ()):
            if i < len(outputs):
                self.shape_values[id(outputs[i])] = outputs[i]
        return outputs


def _cg_attrs(cg_attrs, state, key, index):
    attrs = dict(cg_attrs)
    attrs["cuda_graph_state"] = state
    # One dispatch key per run_program call site and size: two calls of one program in a forward
    # must not share an executor, and so a graph.
    attrs["cuda_graph_dispatch_key"] = key * 1024 + index if state != CUDAGraphState.DISABLE else 0
    return attrs
