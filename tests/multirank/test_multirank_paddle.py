"""graph_opt.capture.ranks on Paddle: two CPU ranks (gloo, paddle.distributed.spawn), level 0, simulated graphs,
a paddle.distributed.all_reduce in every forward. One spawn for the module, under a hard deadline."""
import pytest

pytest.importorskip("paddle")

import paddle_kit as kit  # noqa: E402

_CI_SECONDS = 6  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

DEADLINE_S = 120


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return kit.run_ranks(str(tmp_path_factory.mktemp("paddle_ranks")), DEADLINE_S)


def _passed(results, name):
    per_rank = results[name]
    errors = [f"rank {rank}:\n{res['error']}" for rank, res in enumerate(per_rank) if not res["ok"]]
    assert not errors, f"scenario {name} failed\n" + "\n".join(errors)
    return per_rank


def test_ranks_capture_the_same_sizes_largest_first(results):
    r0, r1 = _passed(results, "capture")
    assert r0["order"] == r1["order"] == sorted(kit.SIZES, reverse=True)


def test_different_capture_sizes_raise_on_every_rank(results):
    for res in _passed(results, "size_mismatch"):
        assert "rank 0: [8, 4, 2, 1]" in res["error"] and "rank 1: [4, 2, 1]" in res["error"], res["error"]


def test_a_capture_fault_on_rank_1_drops_the_graphs_of_every_rank(results):
    r0, r1 = _passed(results, "capture_fault")
    assert r0["failed"] == r1["failed"]
    assert "capture of size 4 failed on rank 1 (RuntimeError: injected capture fault on rank 1" in r0["failed"]
    for res in (r0, r1):
        assert len(res["warnings"]) == 1 and res["failed"] in res["warnings"][0], res["warnings"]


def test_a_lazy_capture_fault_on_rank_1_drops_the_graphs_of_every_rank(results):
    r0, r1 = _passed(results, "lazy")
    assert r0["order"] == r1["order"] == [8, 4, 2]
    for res in (r0, r1):
        assert len(res["warnings"]) == 1 and "capture of size 2 failed on rank 1" in res["warnings"][0], res["warnings"]


def test_a_check_that_fails_on_one_rank_makes_every_rank_run_without_graphs(results):
    r0, r1 = _passed(results, "replay_agreement")
    assert r0["replays"] == r1["replays"] == 0, (r0, r1)
    assert r1["reasons"] == {"training": len(kit.REALS)} and r0["reasons"] == {"peer": len(kit.REALS)}, (r0, r1)
    assert len(r1["warnings"]) == 1 and "eval mode" in r1["warnings"][0], r1["warnings"]
    assert len(r0["warnings"]) == 1 and "rank 1 cannot replay this call" in r0["warnings"][0], r0["warnings"]
    assert r0["replays_after"] == r1["replays_after"] == len(kit.REALS), (r0, r1)
