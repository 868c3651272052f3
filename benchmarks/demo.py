"""python -m graph_opt demo: a small decoder in every mode of the mode table, checked against eager.

Where CUDA graphs cannot run (CPU), graph modes use the host stand-in of simulate_cuda_graphs():
correctness and the state machine are real, timings then show the plugin's overhead, not a speed-up.
"""
from __future__ import annotations

import contextlib
import importlib
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional

from graph_opt import stats as stats_of
from graph_opt.config import GraphOptConfig
from graph_opt.lifecycle import capture_model
from graph_opt.testing import simulate_cuda_graphs

MODES = [
    ("L0 eager", dict(graph_opt_level=0, use_cudagraph=False)),
    ("L0 full graph", dict(graph_opt_level=0, use_cudagraph=True, full_cuda_graph=True)),
    ("L0 piecewise", dict(graph_opt_level=0, use_cudagraph=True, full_cuda_graph=False)),
    ("L1 static", dict(graph_opt_level=1, use_cudagraph=False)),
    ("L1 full graph", dict(graph_opt_level=1, use_cudagraph=True, full_cuda_graph=True)),
    ("L1 piecewise", dict(graph_opt_level=1, use_cudagraph=True, full_cuda_graph=False)),
    ("L2 full graph", dict(graph_opt_level=2, use_cudagraph=True, full_cuda_graph=True)),
    ("L2 piecewise", dict(graph_opt_level=2, use_cudagraph=True, full_cuda_graph=False)),
    # calls alternate between the full graph and the pieces (the demo kits' MixedKey(every=2))
    ("L0 full+pieces", dict(graph_opt_level=0, use_cudagraph=True, cudagraph_mode="full_and_piecewise")),
]


class MixedKey:
    """dispatch_key_fn of a mixed workload: every `every`-th call is a mixed batch (pieces, attention
    eager), the others decode-only (the full graph). Framework-free: the demos and bench_gpu use it."""

    def __init__(self, every: int = 5):
        self.every = every
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return "piecewise" if self.calls % self.every == 0 else "full"


TOLERANCE = 1e-4  # float32 demo model; real rows of padded batches vs unpadded eager


@dataclass
class Row:
    mode: str
    correct: str
    ms: float
    ratio: float
    graphs: int
    pieces: int
    note: str = ""


def available_frameworks() -> List[str]:
    found = []
    for name in ("paddle", "torch"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        found.append(name)
    return found


def _kit(framework: str):
    return importlib.import_module(f"graph_opt.benchmarks.{framework}_demo")


def run_framework(framework: str, sizes: List[int], calls: int, hidden: int, layers: int) -> List[Row]:
    kit = _kit(framework)
    real_graphs = kit.device() != "cpu"
    sim = contextlib.nullcontext() if real_graphs else simulate_cuda_graphs()
    padded = sorted({s - 1 for s in sizes if s > 1} - set(sizes))  # real sizes that replay a larger graph
    probe = sorted(set(sizes) | set(padded))
    rows: List[Row] = []
    eager_ms: Optional[float] = None
    with sim, kit.no_grad():
        for label, overrides in MODES:
            cfg = GraphOptConfig(cudagraph_capture_sizes=list(sizes), **overrides)
            both = overrides.get("cudagraph_mode") == "full_and_piecewise"
            model, reference = kit.build(cfg, hidden=hidden, layers=layers,
                                         cls=kit.DispatchedDecoder if both else None)
            report = capture_model(model, lambda bs: kit.make_inputs(bs, hidden), progress=False)
            # Captured sizes: bitwise against eager on the same inputs. Padded sizes: the real rows
            # against an unpadded eager run, within TOLERANCE (another batch size may take another kernel).
            bitwise, worst = True, 0.0
            for i, bs in enumerate(sizes):
                inputs = kit.make_inputs(bs, hidden, seed=100 + i)
                same, diff = kit.compare(model(**inputs), reference(**inputs))
                bitwise &= same
                worst = max(worst, diff)
            padded_worst = 0.0
            for i, bs in enumerate(padded):
                inputs = kit.make_inputs(bs, hidden, seed=200 + i)
                padded_worst = max(padded_worst, kit.compare(model(**inputs), reference(**inputs))[1])
            if worst > TOLERANCE or padded_worst > TOLERANCE:
                correct = "WRONG"
            else:
                correct = ("bitwise" if bitwise else f"{worst:.0e}") + f" / {padded_worst:.0e}"
            ms = _time_calls(kit, model, probe, calls, hidden)
            st = stats_of(model)
            if eager_ms is None:
                eager_ms = ms
            pieces = max(st.pieces.values()) if st.pieces else 0
            graphs = sum(st.graphs.values()) if st.graphs else 0
            note = report.failed or ""
            rows.append(Row(label, correct, ms, eager_ms / ms if ms else 0.0, graphs, pieces, note))
    return rows


def _time_calls(kit, model, sizes, calls, hidden) -> float:
    inputs = [kit.make_inputs(bs, hidden, seed=7) for bs in sizes]
    for inp in inputs:
        model(**inp)
    samples = []
    for i in range(calls):
        inp = inputs[i % len(inputs)]
        kit.synchronize()
        start = time.perf_counter()
        model(**inp)
        kit.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def format_table(framework: str, device: str, rows: List[Row], sizes, simulated: bool) -> str:
    lines = [f"{framework} on {device}, capture sizes {list(sizes)}"
             + (" (graphs simulated on the host: timings show overhead, not speed-up)" if simulated else "")]
    lines.append("correct: captured sizes vs eager on the same inputs / real rows of padded sizes vs unpadded "
                 f"eager (tolerance {TOLERANCE:g}); graphs: captured in all sizes; pieces: per graph")
    lines.append(f"{'mode':<15} {'correct':<17} {'ms/call':>8} {'vs eager':>8} {'graphs':>7} {'pieces':>7}")
    for r in rows:
        lines.append(f"{r.mode:<15} {r.correct:<17} {r.ms:>8.3f} {r.ratio:>7.2f}x {r.graphs:>7} {r.pieces:>7}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def main(frameworks: List[str], sizes: List[int], calls: int, hidden: int, layers: int) -> int:
    if not frameworks:
        print("neither paddle nor torch is installed: pip install paddlepaddle==3.3.1 (or torch)")
        return 2
    failed = False
    for framework in frameworks:
        kit = _kit(framework)
        rows = run_framework(framework, sizes, calls, hidden, layers)
        print(format_table(framework, kit.device(), rows, sizes, kit.device() == "cpu"))
        print()
        failed |= any(r.correct == "WRONG" for r in rows)
    return 1 if failed else 0
