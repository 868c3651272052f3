"""graph_opt.capture.ranks with a scripted group: what each rank raises or reports, given what its peers said.
The exchange itself, over real processes, is tested in tests/multirank."""
import pytest

from graph_opt import GraphOptConfigError, GraphOptInputError
from graph_opt.capture import ranks


class Scripted:
    """A group of 3 ranks seen from `rank`: all_gather puts this rank's object among the peers' scripted ones."""

    def __init__(self, rank, peers):
        self.rank, self.world_size = rank, 3
        self.peers = list(peers)  # one list per exchange: the objects of the other ranks, in rank order
        self.sent = []

    def all_gather(self, obj):
        self.sent.append(obj)
        others = self.peers.pop(0)
        return others[:self.rank] + [obj] + others[self.rank:]


def test_without_a_group_nothing_is_exchanged_and_errors_pass_through():
    with pytest.raises(ValueError, match="boom"):
        with ranks.all_or_none(None, "m: make_inputs(8)", GraphOptInputError):
            raise ValueError("boom")
    ranks.check_same_sizes(None, "m", [8, 4], [4, 8])
    assert ranks.agree_on_capture(None, 8, RuntimeError("x")) is None


def test_a_peers_error_raises_here_naming_the_rank_and_its_error():
    group = Scripted(0, [[None, "GraphOptInputError: make_inputs(8) returned None"]])
    with pytest.raises(GraphOptInputError) as info:
        with ranks.all_or_none(group, "M: make_inputs(8)", GraphOptInputError):
            pass
    assert str(info.value) == ("M: make_inputs(8) failed on rank 2 (GraphOptInputError: make_inputs(8) returned None); "
                               "every rank stops here")


def test_the_failing_rank_raises_its_own_error_after_telling_the_peers():
    group = Scripted(1, [[None, None]])
    with pytest.raises(KeyError):
        with ranks.all_or_none(group, "M: make_inputs(8)", GraphOptInputError):
            raise KeyError("x")
    assert group.sent == ["KeyError: 'x'"]


def test_different_sizes_name_every_ranks_list():
    group = Scripted(0, [[([8, 4, 2], [2, 4, 8]), ([8, 4], [2, 4, 8])]])
    with pytest.raises(GraphOptConfigError, match=r"rank 0: \[8, 4, 2\], rank 1: \[8, 4, 2\], rank 2: \[8, 4\]"):
        ranks.check_same_sizes(group, "M", [8, 4, 2], [2, 4, 8])
    group = Scripted(0, [[([8], [8, 16]), ([8], [8])]])
    with pytest.raises(GraphOptConfigError, match=r"pad to the capture sizes.*rank 2: \[8\]"):
        ranks.check_same_sizes(group, "M", [8], [8, 16])


def test_a_capture_outcome_names_each_failing_rank_and_its_cause():
    assert ranks.agree_on_capture(Scripted(0, [[(8, None), (8, None)]]), 8, None) is None
    one = ranks.agree_on_capture(Scripted(0, [[(8, "RuntimeError: oom"), (8, None)]]), 8, None)
    assert one == "capture of size 8 failed on rank 1 (RuntimeError: oom), so every rank of 3 drops its graphs"
    two = ranks.agree_on_capture(Scripted(0, [[(8, None), (8, "CaptureError: y")]]), 8, RuntimeError("x"))
    assert two.startswith("capture of size 8 failed on ranks 0, 2 (rank 0: RuntimeError: x; rank 2: CaptureError: y)")
    sizes = ranks.agree_on_capture(Scripted(0, [[(4, None), (8, None)]]), 8, None)
    assert "different sizes at once (rank 0: 8, rank 1: 4, rank 2: 8)" in sizes


def test_agreement_off_or_no_framework_means_no_group():
    class Fake:
        name = "fake"

    assert ranks.group_for(Fake()) is None
    ranks.set_agreement(False)
    try:
        class Torchy:
            name = "torch"

        assert ranks.group_for(Torchy()) is None  # not even the backend is asked
    finally:
        ranks.set_agreement(True)
