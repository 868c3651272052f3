"""`python -m graph_opt bench ddp --smoke`: the data-parallel training benchmark runs end to end on CPU (gloo,
simulated graphs, tiny blocks) on two and four ranks, writes its world size and every row, the graphed
replicas replay without fallbacks and the ranks' parameters agree."""
import json

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

from graph_opt.benchmarks import torch_ddp  # noqa: E402

_CI_SECONDS = 10  # the spawned ranks import torch and graph_opt each


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_bench_smoke(tmp_path, world):
    assert torch_ddp.main(["--smoke", "--world", str(world), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / ("ddp_bench.json" if world == 2 else f"ddp_bench_world{world}.json")).read_text())
    assert data["world_size"] == world and data["problems"] == [] and data["failed"] == {}
    mbs = [str(mb) for mb in torch_ddp.SMOKE_MICRO_BATCHES]
    assert {name: sorted(row) for name, row in data["ms"].items()} == {torch_ddp.EAGER: mbs, torch_ddp.AUTO: mbs}
    assert data["ranks_agree"] == {torch_ddp.EAGER: True, torch_ddp.AUTO: True}
    stats = data["stats"][torch_ddp.AUTO]
    assert stats["replays"] > 0 and stats["backward_replays"] == stats["replays"] and stats["fallbacks"] == 0, stats


def test_ddp_bench_without_the_gpus_measures_nothing_and_says_so(tmp_path, capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs: the bench would run")
    assert torch_ddp.main(["--out", str(tmp_path)]) == 0
    assert "needs 2 CUDA devices" in capsys.readouterr().out and not (tmp_path / "ddp_bench.json").exists()
