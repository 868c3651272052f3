"""`python -m graph_opt bench models --smoke`: the Hugging Face models benchmark runs end to end on CPU with
simulated graphs and tiny models (in-process; about 15 s), writes every row, and the plugin's outputs
match eager's."""
import json

import pytest

pytest.importorskip("transformers")

from graph_opt.benchmarks import torch_models  # noqa: E402

_CI_SECONDS = 25  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)


def test_models_bench_smoke(tmp_path):
    assert torch_models.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "models_bench.json").read_text())
    assert data["problems"] == []
    batches = [str(bs) for bs in torch_models.SMOKE_BATCHES]
    assert set(data["inference"]) == set(torch_models.INFERENCE_CASES)
    for name, row in data["inference"].items():
        assert set(row["ms"]) == {"eager", "plugin L0", "plugin L1"}, name
        for col in ("plugin L0", "plugin L1"):
            assert sorted(row["ms"][col]) == batches, (name, col)
            # simulated replays run eager's own kernels on CPU: bitwise
            assert all(d == 0 for d in row["rel_diff"][col].values()), (name, col, row["rel_diff"][col])
            stats = row["plugin_stats"][col]
            assert stats["fallbacks"] == 0 and stats["replays"] > 0, (name, col, stats)
    assert set(data["training"]) == set(torch_models.TRAINING_CASES)
    mbs = [str(mb) for mb in torch_models.SMOKE_MICRO_BATCHES]
    for case, variants in data["training"].items():
        assert {"eager", "autocudagraph"} <= set(variants), case
        for name, res in variants.items():
            assert res["failed"] is None, (case, name, res["failed"])
            assert sorted(res["ms"]) == mbs, (case, name)
        stats = variants["autocudagraph"]["stats"]
        assert stats["fallbacks"] == 0 and stats["replays"] > 0 and stats["backward_replays"] > 0, (case, stats)


def test_training_runs_summary_gives_each_variants_ratio_to_reduce_overhead_as_median_and_range(tmp_path):
    from graph_opt.benchmarks import training_runs

    files = []
    for i, (auto, compiled) in enumerate([(4.0, 5.0), (5.0, 5.0), (6.0, 4.8)]):
        run = {"device": "GPU", "torch": "x", "training": {"bert": {
            "autocudagraph": {"ms": {"1": auto}, "host_ms": {"1": {"forward": 1.0, "backward": 0.5, "optimizer": 0.5}}},
            "reduce-overhead": {"ms": {"1": compiled}}}}}
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(run))
        files.append(str(path))
    assert torch_models.main(["--summarize", *files, "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "training_runs.json").read_text())["summary"]["bert"]["1"]["autocudagraph"]
    assert row["ratios"] == pytest.approx([1.25, 1.0, 0.8]) and row["ratios_median"] == 1.0
    assert (row["min"], row["max"]) == pytest.approx((0.8, 1.25))
    assert row["host_share_median"] == 2.0 / 5.0


def test_runs_and_variants_are_refused_outside_the_training_half():
    with pytest.raises(SystemExit):
        torch_models.main(["--smoke", "--runs", "2"])
    with pytest.raises(SystemExit):
        torch_models.main(["--smoke", "--only", "training", "--variants", "nope"])


def test_the_plot_of_training_runs_without_eager_is_drawn(tmp_path, monkeypatch):
    """--variants may leave eager out (runs compared with reduce-overhead only): no speed-up bars then,
    and the figure is still drawn (it raised KeyError: 'eager' after the results were saved)."""
    from unittest import mock

    import numpy as np

    fig, ax = mock.MagicMock(), mock.MagicMock()
    fig.subplots.return_value = (mock.MagicMock(), mock.MagicMock())
    drawn, saved = [], []
    monkeypatch.setattr(torch_models, "new_figure", lambda: (fig, ax))
    monkeypatch.setattr(torch_models, "grouped_bars", lambda axis, groups, series: drawn.append(series))
    monkeypatch.setattr(torch_models, "save_figure", lambda *a: saved.append(a[3]))
    results = {"device": "GPU", "inference": {}, "micro_batches": [1, 8], "training": {"bert": {
        "autocudagraph": {"ms": {1: 5.2, 8: 8.5}}, "reduce-overhead": {"ms": {1: 5.8, 8: 5.1}}}}}
    torch_models.plot(str(tmp_path), results)
    assert saved == ["models_bench.png"]
    assert drawn and all(np.isnan(v) for series in drawn[0].values() for v in series)
    results["training"]["bert"]["eager"] = {"ms": {1: 52.0, 8: 51.0}}
    torch_models.plot(str(tmp_path), results)
    assert drawn[1]["autocudagraph"] == [52.0 / 5.2, 51.0 / 8.5]
