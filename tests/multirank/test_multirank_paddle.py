"""graph_opt.capture.ranks on Paddle: two CPU ranks (gloo, paddle.distributed.spawn), level 0, simulated graphs, a
paddle.distributed.all_reduce in every forward; and autocudagraph inside paddle.DataParallel on those ranks. One spawn for the module, under a hard deadline; the checks hold
for any world size (every rank but 1 is its peer)."""
import pytest

pytest.importorskip("paddle")

import paddle_kit as kit  # noqa: E402

_CI_SECONDS = 6  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

DEADLINE_S = 120


# Two ranks only: four Paddle ranks pass every scenario run from a script (paddle_kit.run_ranks(world=4)),
# but under pytest on a 2-core host two of them stall in gloo's first all_gather until its timeout.
@pytest.fixture(scope="module", params=[2], ids=lambda world: f"world{world}")
def results(request, tmp_path_factory):
    return kit.run_ranks(str(tmp_path_factory.mktemp("paddle_ranks")), DEADLINE_S, world=request.param)


def _passed(results, name):
    per_rank = results[name]
    errors = [f"rank {rank}:\n{res['error']}" for rank, res in enumerate(per_rank) if not res["ok"]]
    assert not errors, f"scenario {name} failed\n" + "\n".join(errors)
    return per_rank


def test_ranks_capture_the_same_sizes_largest_first(results):
    ranks = _passed(results, "capture")
    assert all(res["order"] == sorted(kit.SIZES, reverse=True) for res in ranks), [res["order"] for res in ranks]


def test_different_capture_sizes_raise_on_every_rank(results):
    ranks = _passed(results, "size_mismatch")
    for res in ranks:
        assert "rank 0: [8, 4, 2, 1]" in res["error"], res["error"]
        assert all(f"rank {k}: [4, 2, 1]" in res["error"] for k in range(1, len(ranks))), res["error"]


def test_a_capture_fault_on_rank_1_drops_the_graphs_of_every_rank(results):
    ranks = _passed(results, "capture_fault")
    assert all(res["failed"] == ranks[0]["failed"] for res in ranks)
    assert "capture of size 4 failed on rank 1 (RuntimeError: injected capture fault on rank 1" in ranks[0]["failed"]
    for res in ranks:
        assert len(res["warnings"]) == 1 and res["failed"] in res["warnings"][0], res["warnings"]


def test_a_lazy_capture_fault_on_rank_1_drops_the_graphs_of_every_rank(results):
    ranks = _passed(results, "lazy")
    assert all(res["order"] == [8, 4, 2] for res in ranks), [res["order"] for res in ranks]
    for res in ranks:
        assert len(res["warnings"]) == 1 and "capture of size 2 failed on rank 1" in res["warnings"][0], res["warnings"]


def test_a_check_that_fails_on_one_rank_makes_every_rank_run_without_graphs(results):
    ranks = _passed(results, "replay_agreement")
    assert all(res["replays"] == 0 for res in ranks), ranks
    r1 = ranks[1]
    assert r1["reasons"] == {"training": len(kit.REALS)}, r1
    assert len(r1["warnings"]) == 1 and "eval mode" in r1["warnings"][0], r1["warnings"]
    for rank, res in enumerate(ranks):
        if rank != 1:
            assert res["reasons"] == {"peer": len(kit.REALS)}, (rank, res)
            assert len(res["warnings"]) == 1 and "rank 1 cannot replay this call" in res["warnings"][0], res["warnings"]
    assert all(res["replays_after"] == len(kit.REALS) for res in ranks), ranks


def test_a_graphed_data_parallel_trains_as_eager_data_parallel_on_every_rank(results):
    """The reducer's all-reduce runs outside the graphs, on the gradients the backward replays hand to
    autograd: each rank's parameters equal its eager DataParallel twin's bitwise, and the ranks' agree
    though each trained on data of its own (no_sync's micro-batch included)."""
    import numpy as np

    ranks = _passed(results, "data_parallel")
    for res in ranks:
        assert all(np.array_equal(a, b) for a, b in zip(res["params"]["graphed"], res["params"]["eager"]))
        assert res["replays"] == 5 and res["backward_replays"] == 5 and res["fallbacks"] == 0, res
        assert not [w for w in res["warnings"] if "autocudagraph" in w or "DataParallel" in w], res["warnings"]
    first = ranks[0]["params"]["graphed"]
    for res in ranks[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(first, res["params"]["graphed"]))
