"""graph_opt.autocudagraph(DistributedDataParallel(...)), with simulated graphs on CPU and gloo: the wrapped
module is graphed and the DDP object returned, so DDP's forward and its reducer's all-reduce hooks stay
outside the graphs. One rank in this process; two and four ranks in spawned processes under a deadline."""
import copy
import logging

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

import graph_opt  # noqa: E402
from torch_zoo import ddp as kit  # noqa: E402
from training_support import graph_warnings  # noqa: E402

_CI_SECONDS = 20  # the two, then four, spawned ranks import torch and graph_opt each

DEADLINE_S = 120


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with graph_opt.testing.simulate_cuda_graphs():
            yield
    finally:
        dist.destroy_process_group()


def _same(a, b):
    for (name, p_a), (_, p_b) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p_a, p_b), f"{name} differs by {(p_a - p_b).abs().max().item()}"


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_graphed_ddp_trains_as_eager_ddp_with_its_all_reduce_outside_the_graphs(one_rank, caplog, bucket_view):
    caplog.set_level(logging.INFO, logger="graph_opt")
    ref, m, (seen_ref, seen) = kit.twins(gradient_as_bucket_view=bucket_view)
    said = [r.getMessage() for r in caplog.records if r.name == "graph_opt"]
    assert any("graphed its wrapped Block (.module)" in s for s in said), said
    kit.steps(ref, 4)
    kit.steps(m, 4)
    _same(ref, m)
    # The reducer's hook ran per step, on eager's gradients (laid out in the order they became ready,
    # which differs: the replay hands them all at once)
    assert len(seen) == len(seen_ref) >= 4
    assert all(torch.equal(a.sort().values, b.sort().values) for a, b in zip(seen, seen_ref))
    s = graph_opt.stats(m)  # the DDP object finds the block of its module
    # the first step eager (warmup_steps=0 here): DDP lays out its buckets from it, at the second forward
    assert s is not None and s.replays == 3 and s.backward_replays == 3 and s.fallbacks == 0, s
    assert not graph_warnings(caplog)


def test_no_sync_accumulates_micro_batches_as_eager_ddp(one_rank):
    ref, m, (seen_ref, seen) = kit.twins()
    kit.steps(ref, 3, accumulate=3)
    kit.steps(m, 3, accumulate=3)
    _same(ref, m)
    assert len(seen) == len(seen_ref) == 3  # the all-reduce once per step, after the no_sync micro-batches
    assert graph_opt.stats(m).backward_replays == 6  # the first step's three eager: DDP's first synced backward


def test_graphing_the_ddp_or_its_module_twice_is_refused(one_rank):
    _, m, _ = kit.twins()
    for again in (m, m.module):
        with pytest.raises(graph_opt.GraphOptInputError, match="already graphed"):
            graph_opt.autocudagraph(again)


@pytest.mark.parametrize("world, warmup_steps, accumulate, static_unused",
                         [(2, 0, 1, False), (4, 1, 1, False), (4, 0, 1, False), (4, 1, 3, False), (2, 0, 1, True)])
def test_ranks_keep_equal_parameters_and_match_eager_ddp(tmp_path, world, warmup_steps, accumulate, static_unused):
    """Each rank trains on data of its own: equal parameters across ranks show that the all-reduce
    averaged the replayed gradients; each rank's equal the eager DDP's it trained beside. A rank still
    running at the deadline (a hang) fails the test. static_unused: DDP(static_graph=True) around a block
    with a parameter its forward leaves out. tests/gpu/test_gpu_ddp.py runs these on GPUs."""
    kit.check_ranks(str(tmp_path), world, warmup_steps, cuda=False, deadline_s=DEADLINE_S, accumulate=accumulate,
                    static_unused=static_unused)


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)  # never in the forward
        self.scale = torch.nn.Parameter(torch.full((8,), 0.5))  # read without a gradient

    def forward(self, x):
        return torch.tanh(self.used(x)) * self.scale.detach()


@pytest.mark.parametrize("level, bucket_view, late", [(0, False, False), (0, True, False), (1, False, False),
                                                     (0, False, True)])
def test_a_static_graph_ddp_with_a_parameter_the_forward_leaves_out_replays_as_eager_ddp(one_rank, caplog, level,
                                                                                         bucket_view, late):
    """The replay gives the unused parameters no autograd edge, as eager's backward never reaches them: an empty
    gradient on that edge would still run DDP's hook, which static_graph=True takes for a graph that changed.
    At level 1 the warm-ups run the eager forward, whose backward leaves them out too (a traced one would not).
    late: static graph turned on after autocudagraph (DDP._set_static_graph(), as before torch 1.11)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ref = DDP(_WithUnused(), static_graph=not late, gradient_as_bucket_view=bucket_view)
    m = DDP(_WithUnused(), static_graph=not late, gradient_as_bucket_view=bucket_view)
    m.module.load_state_dict(ref.module.state_dict())
    graph_opt.autocudagraph(m, level=level)
    if late:
        ref._set_static_graph()
        m._set_static_graph()
    grads = {}
    for model in (ref, m):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            grads[model] = {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}
            opt.step()
    _same(ref, m)
    for name, g in grads[ref].items():  # the last step's: the unused parameter's as eager DDP left it
        got = grads[m][name]
        assert (g is None) == (got is None), name
        assert g is None or torch.equal(g, got), name
    s = graph_opt.stats(m)
    assert s.capture_failures == 0 and s.replays >= 3 and s.backward_replays == s.replays, s
    assert not graph_warnings(caplog)


def test_calls_without_grad_through_ddp_are_graphed_before_ddp_lays_out_its_buckets(one_rank):
    """Only keys with a backward wait for DDP's bucket layout: an evaluation under no_grad replays."""
    ref, m, _ = kit.twins(warmup_steps=1)
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert graph_opt.stats(m).replays == 2


class _LMLoss(torch.nn.Module):
    """A user's training module around a Hugging Face causal LM: ids and labels in, the loss out."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels, use_cache=False).loss


@pytest.mark.parametrize("level", [0, 1])
def test_a_hugging_face_model_inside_ddp_trains_as_eager_ddp(one_rank, caplog, level):
    transformers = pytest.importorskip("transformers")
    from torch.nn.parallel import DistributedDataParallel as DDP

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)
    ref = DDP(_LMLoss(lm))
    m = DDP(_LMLoss(copy.deepcopy(lm)))
    assert graph_opt.autocudagraph(m, level=level) is m
    for model in (ref, m):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
            model(ids, ids).backward()
            opt.step()
    _same(ref, m)
    s = graph_opt.stats(m)
    # eager: the first step (DDP lays out its buckets from it) and, at level 1, the trace's own warm-up
    assert s.warmups == 1 + level and s.replays == s.backward_replays == 3 - level and s.fallbacks == 0, s
    assert not graph_warnings(caplog)
