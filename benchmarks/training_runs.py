"""Several runs of bench models' training half, and what they agree on: each variant's step against
reduce-overhead's, as a ratio within each run, its median and range over the runs.

    python -m graph_opt bench models --only training --runs 3 [--cases LIST] [--variants LIST] [--out results]
    python -m graph_opt bench models --summarize RUN.json RUN.json ... [--out results]

--runs N runs the half N times, each in a process of its own (a fresh compile and capture), into
<out>/training_runs/run_<i>/models_bench.json; --summarize reads runs made earlier (or on other
hosts). Per case, micro-batch and variant: reduce-overhead's ms per step over the variant's in each run
(above 1: the variant is faster), the median of those ratios and their range; the host's share of the
step (forward + backward + optimizer on the host, over the step's time; near 1: host-bound). The best
autocudagraph variant of a row is the one with the highest median. Writes <out>/training_runs.json and
prints the table last.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

from .report import write_json

COMPILE = "reduce-overhead"
RUN_TIMEOUT_S = 1800  # one run of the training half: about 5 minutes on an H200


def runs(n: int, out_dir: str, argv: List[str], prog: str) -> int:
    rest = _without(argv, {"--runs": 1, "--out": 1})
    files, failed = [], []
    for i in range(1, n + 1):
        run_dir = os.path.join(out_dir, "training_runs", f"run_{i}")
        cmd = [sys.executable, "-m", "graph_opt", "bench", "models", *rest, "--out", run_dir]
        print(f"{prog}: run {i} of {n}: {' '.join(cmd[1:])}", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out"
        path = os.path.join(run_dir, "models_bench.json")
        if rc != 0:
            failed.append(f"run {i}: {rc}")
        if os.path.exists(path):
            files.append(path)
    code = summarize(files, out_dir)
    if failed:
        print("runs that failed or found problems: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else code


def summarize(files: List[str], out_dir: str) -> int:
    results = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            results.append(json.load(fh))
    if not results:
        print("no run to summarize", file=sys.stderr)
        return 1
    table = summary(results)
    write_json(out_dir, "training_runs.json", {"runs": files, "device": [r.get("device") for r in results],
                                               "torch": [r.get("torch") for r in results], "summary": table})
    print_summary(table, results)
    return 0


def summary(results: List[dict]) -> Dict[str, Dict[str, Dict[str, dict]]]:
    """case -> micro-batch -> variant -> {ratios, median, min, max, host_share}, ratios = reduce-overhead's ms
    over the variant's, one per run that measured both."""
    out: Dict[str, Dict[str, Dict[str, dict]]] = {}
    for res in results:
        for case, variants in res.get("training", {}).items():
            compiled = variants.get(COMPILE, {}).get("ms", {})
            for variant, r in variants.items():
                for mb, ms in r.get("ms", {}).items():
                    row = out.setdefault(case, {}).setdefault(str(mb), {}).setdefault(
                        variant, {"ratios": [], "ms": [], "host_share": []})
                    row["ms"].append(ms)
                    if compiled.get(mb):
                        row["ratios"].append(compiled[mb] / ms)
                    host = r.get("host_ms", {}).get(mb)
                    if host:
                        row["host_share"].append(sum(host.values()) / ms)
    for mbs in out.values():
        for variants in mbs.values():
            for row in variants.values():
                for key in ("ratios", "ms", "host_share"):
                    values = row[key]
                    row[f"{key}_median"] = statistics.median(values) if values else None
                row["min"] = min(row["ratios"]) if row["ratios"] else None
                row["max"] = max(row["ratios"]) if row["ratios"] else None
    return out


def print_summary(table, results: List[dict]) -> None:
    devices = sorted({str(r.get("device")) for r in results})
    print(f"\nTraining step against reduce-overhead over {len(results)} runs on {', '.join(devices)}: reduce-overhead's "
          "ms over the variant's (above 1: faster), median [range]; ms median; host share of the step")
    print("| model | mb | variant | x reduce-overhead | ms | host share |")
    print("|---|---|---|---|---|---|")
    for case, mbs in table.items():
        for mb, variants in mbs.items():
            best = max((v for v in variants if v.startswith("autocudagraph") and variants[v]["ratios"]),
                       key=lambda v: variants[v]["ratios_median"], default=None)
            for variant, row in variants.items():
                ratio = "-" if row["min"] is None else \
                    f"{row['ratios_median']:.2f} [{row['min']:.2f}-{row['max']:.2f}]"
                share = "-" if row["host_share_median"] is None else f"{row['host_share_median']:.2f}"
                mark = " (best)" if variant == best else ""
                print(f"| {case} | {mb} | {variant}{mark} | {ratio} | {row['ms_median']:.2f} | {share} |")


def _without(argv: List[str], options: Dict[str, int]) -> List[str]:
    """argv less the given options and their values (`--runs 3` and `--runs=3`)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in options:
            skip = 0 if "=" in arg else options[name]
            continue
        out.append(arg)
    return out
