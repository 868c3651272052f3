"""DistributedDataParallel around a graphed Block (graph_opt.autocudagraph(ddp) graphs ddp.module), next to
an eager twin: the SGD steps both take, and the worker of the two-process test (tests/torch_tests/
test_torch_training_ddp.py), which runs in a spawned process of its own."""
import contextlib
import copy
import os
import pickle
import traceback

import torch

import graph_opt
from torch_zoo.training import Block


class WithUnused(Block):
    """A Block holding a parameter its forward never uses (a head trained in another phase)."""

    def __init__(self, hidden):
        super().__init__(hidden)
        self.spare = torch.nn.Linear(hidden, hidden)


def twins(warmup_steps: int = 0, device=None, unused: bool = False, **ddp_options):
    """(eager DDP, graphed DDP, their comm hooks' records): equal Blocks, dropout off. With warmup_steps=0
    the first step still runs eagerly: DDP lays out its buckets from it. unused: a WithUnused block."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    block = (WithUnused if unused else Block)(16).to(device)
    models, seen = [], []
    for _ in range(2):
        ddp = DDP(copy.deepcopy(block), **({"device_ids": [device]} if device is not None else {}), **ddp_options)
        buckets = []

        def hook(state, bucket, buckets=buckets):
            buckets.append(bucket.buffer().clone())  # what reaches the all-reduce
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
        models.append(ddp)
        seen.append(buckets)
    ref, m = models
    assert graph_opt.autocudagraph(m, warmup_steps=warmup_steps) is m
    return ref, m, seen


def steps(model, n, rank=0, accumulate=1):
    """n SGD steps, each over `accumulate` micro-batches (all but the last under no_sync)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = next(model.parameters()).device
    for step in range(n):
        opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x = torch.randn(4, 6, 16, generator=g).to(device).requires_grad_(True)
            with model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                (model(x).float() ** 2).mean().backward()
        opt.step()


def worker(rank: int, world: int, folder: str, timeout_s: float, warmup_steps: int = 0, cuda: bool = False,
           accumulate: int = 1, static_unused: bool = False) -> None:
    """One rank: eager and graphed DDP, 3 steps each (the last with two micro-batches, one under no_sync),
    on data of its own; writes its parameters and the graphed block's stats. On CPU: gloo and simulated
    graphs; cuda: NCCL, this rank's GPU and real CUDA graphs. static_unused: DDP(static_graph=True) around
    a block with a parameter its forward leaves out."""
    import datetime

    import torch.distributed as dist

    out = {}
    try:
        device = None
        if cuda:
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        with contextlib.nullcontext() if cuda else graph_opt.testing.simulate_cuda_graphs():
            options = {"unused": True, "static_graph": True} if static_unused else {}
            ref, m, seen = twins(warmup_steps, device, **options)
            for model in (ref, m):
                steps(model, 2, rank, accumulate=accumulate)
                steps(model, 1, rank, accumulate=2)
        out = {"ok": True, "ref": [p.detach().cpu().clone() for p in ref.parameters()],
               "graphed": [p.detach().cpu().clone() for p in m.parameters()], "buckets": [len(s) for s in seen],
               "stats": graph_opt.stats(m).as_dict()}
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    os._exit(0)  # no teardown: destroying a process group can hang


def check_ranks(folder: str, world: int, warmup_steps: int, cuda: bool, deadline_s: float, accumulate: int = 1,
                static_unused: bool = False) -> None:
    """Spawn `world` workers under a deadline (a hang fails) and check what they wrote: every rank holds the
    same parameters, bitwise equal to the eager DDP's it trained beside. With more than two ranks that needs
    DDP's gradient buckets laid out as eager's: a key waits, eagerly, until DDP has laid them out from a
    backward it watched (one step here, whatever warmup_steps), since a replayed backward hands every
    gradient at once and a layout taken from it would sum each element's values in another order."""
    from multirank_kit import spawn_ranks

    hung, _ = spawn_ranks(
        worker, lambda rank: (rank, world, folder, deadline_s, warmup_steps, cuda, accumulate, static_unused),
        world, deadline_s)
    assert not hung, f"rank(s) {hung} still running after {deadline_s} s: killed"
    results = []
    for rank in range(world):
        with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
        assert results[rank]["ok"], f"rank {rank}:\n{results[rank]['error']}"
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["graphed"], r["ref"]))
        assert r["buckets"][0] == r["buckets"][1] == 3
        # eager until DDP laid out its buckets: the first step's micro-batches (with static_graph, the first
        # two steps'), or warmup_steps if more
        forwards = 2 * accumulate + 2
        eager = max(warmup_steps, accumulate * (2 if static_unused else 1))
        assert r["stats"]["replays"] == forwards - eager and r["stats"]["fallbacks"] == 0, r["stats"]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["graphed"], other["graphed"]))
