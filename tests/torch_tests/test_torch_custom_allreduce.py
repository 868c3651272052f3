"""BufferAllReduce's paths in one process (a gloo group of one rank), and SymmMemAllReduce's error where
symmetric memory cannot run. Two ranks: tests/multirank."""
import pytest
import torch
import torch.distributed as dist

import graph_opt
from graph_opt.backends.torch.symm_mem_allreduce import BufferAllReduce, SymmMemAllReduce

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_without_torch_distributed_it_says_what_to_initialize():
    with pytest.raises(graph_opt.GraphOptError, match=r"needs torch.distributed initialized"):
        BufferAllReduce()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_symm_mem_without_cuda_names_what_is_missing(one_rank):
    with pytest.raises(graph_opt.GraphOptError, match=r"SymmMemAllReduce needs a CUDA device.*BufferAllReduce"):
        SymmMemAllReduce()


def test_registered_path_inside_capture_fallback_outside_and_for_what_does_not_fit(one_rank):
    comm = BufferAllReduce(max_bytes=4 * 16, dtype=torch.float32, device="cpu")  # 16 floats
    graph_opt.register_custom_allreduce(comm)
    try:
        x = torch.arange(8, dtype=torch.float32)
        assert torch.equal(comm.all_reduce(x), x) and (comm.registered_calls, comm.fallback_calls) == (0, 1)
        with graph_opt.capture_custom_allreduce():
            assert comm.in_capture
            y = comm.all_reduce(x)
            assert torch.equal(y, x) and y.data_ptr() != comm.buffer.data_ptr()  # a copy, not the buffer
            assert torch.equal(comm.buffer[:8], x)
            comm.all_reduce(torch.zeros(17))  # larger than the buffer
            comm.all_reduce(torch.zeros(4, dtype=torch.float64))  # another dtype
        assert (comm.registered_calls, comm.fallback_calls) == (1, 3)
        assert not comm.in_capture
    finally:
        graph_opt.unregister_custom_allreduce(comm)
        comm.close()


def test_an_unregistered_communicator_stays_on_the_fallback_path_while_graphs_are_captured(one_rank):
    comm = BufferAllReduce(max_bytes=1024, device="cpu")
    try:
        with graph_opt.capture_custom_allreduce():
            comm.all_reduce(torch.ones(4))
        assert (comm.registered_calls, comm.fallback_calls) == (0, 1)
    finally:
        comm.close()


def test_a_single_rank_exchanges_nothing(one_rank):
    from graph_opt.backends.torch.adapter import ADAPTER

    assert graph_opt.capture.ranks.group_for(ADAPTER) is None
