"""What the torch and Paddle multi-rank scenarios share (no framework imported here): which padded
sizes a model's strategy captures, with a fault injected on one rank, and reading the ranks' results."""
import os
import pickle


def record_captures(model, fail_on_rank=None, fail_at=None, rank=0) -> list:
    """The padded sizes the model's strategy captures, in order. With fail_on_rank == rank, the capture
    of size fail_at raises after the strategy ran it: the fault a graph that cannot be instantiated
    gives. It comes after the forward's collectives, so on CPU, where a simulated capture runs them,
    the peers are not left waiting inside one (a real capture only records them)."""
    from graph_opt.decorator import state_of

    strategy = state_of(model).ensure_runner().strategy
    capture = strategy.capture
    order = []

    def recording(args, kwargs, padded, *rest, **kw):
        order.append(padded)
        captured = capture(args, kwargs, padded, *rest, **kw)
        if rank == fail_on_rank and padded == fail_at:
            raise RuntimeError(f"injected capture fault on rank {rank} at size {padded}")
        return captured

    strategy.capture = recording
    return order


def read_rank_results(folder: str, world: int) -> list:
    """Each rank's {scenario: result} as it wrote them ({} for a rank that wrote nothing)."""
    results = []
    for rank in range(world):
        path = os.path.join(folder, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as fh:
                results.append(pickle.load(fh))
        else:
            results.append({})
    return results
