"""graph_opt.autocudagraph, calls of one block whose backwards are pending together (graph_opt/training/
slots.py), with simulated graphs: a GAN discriminator on real and fake images in one step, the two
backwards in either order or summed, retain_graph, losses that leave outputs out, a release meanwhile.
tests/gpu/test_gpu_training.py runs the GAN on real graphs."""
import copy

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from torch_zoo.training import Discriminator, Generator, Heads, gan_steps  # noqa: E402
from graph_opt.training.api import state_of_training  # noqa: E402
from training_support import graph_warnings  # noqa: E402

_CI_SECONDS = 8  # level 1 traces with Dynamo


@pytest.fixture
def sim():
    with graph_opt.testing.simulate_cuda_graphs():
        yield


def _gan(dropout=0.0):
    torch.manual_seed(0)
    d, g = Discriminator(dropout=dropout), Generator()
    return (d, g), (copy.deepcopy(d), copy.deepcopy(g))


def _same_parameters(ref, m):
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
        assert torch.equal(p, p_ref), f"{name} differs by {(p - p_ref).abs().max().item()}"


@pytest.mark.parametrize("how", ["summed", "real_first", "fake_first"])
@pytest.mark.parametrize("level", [0, 1])
def test_a_gan_discriminator_on_real_and_fake_images_trains_as_eager(sim, caplog, how, level):
    """D(real) and D(fake) in one loss: the second call replays graphs of its own (no eager call, no
    warning), and the parameters of both networks after the steps are eager's, bitwise. Dropout on at
    level 0: the second slot's capture leaves the generator as eager would."""
    (d_ref, g_ref), (d, g) = _gan(dropout=0.2 if level == 0 else 0.0)
    graph_opt.autocudagraph(d, warmup_steps=0, level=level)
    caplog.clear()
    want = gan_steps(d_ref, g_ref, 4, how)
    got = gan_steps(d, g, 4, how)
    assert all(torch.equal(a, b) for step in zip(got, want) for a, b in zip(*step))
    _same_parameters(d_ref, d)
    _same_parameters(g_ref, g)
    s = graph_opt.stats(d)
    assert s.fallbacks == 0 and not graph_warnings(caplog), (s, graph_warnings(caplog))
    # Two keys (fake's needs an input gradient in the generator's step); the second slot holds only the
    # key called while the first one's backward was pending. Level 1's first call of a key is eager.
    assert (s.keys, s.graphs) == (2, 6), s
    assert s.replays == 3 * 4 - (2 if level else 0) and s.backward_replays == s.replays, s


def test_real_and_fake_batches_of_other_sizes_each_replay(sim):
    """Real and fake of other batch sizes are two keys: fake's lives in the second slot alone."""
    (d_ref, g_ref), (d, g) = _gan()
    graph_opt.autocudagraph(d, warmup_steps=0)
    want = gan_steps(d_ref, g_ref, 3, fake_rows=6)
    got = gan_steps(d, g, 3, fake_rows=6)
    assert all(torch.equal(a, b) for step in zip(got, want) for a, b in zip(*step))
    _same_parameters(d_ref, d)
    s = graph_opt.stats(d)
    assert s.fallbacks == 0 and s.replays == 9, s


def test_two_pending_calls_with_retain_graph_then_a_third_runs_eagerly(sim, caplog):
    """backward(retain_graph=True) through both calls twice; while their graphs are kept, a third call
    runs eagerly (once said), and after they are dropped calls replay again."""
    (d_ref, _), (d, _) = _gan()
    graph_opt.autocudagraph(d, warmup_steps=0)
    xs = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    caplog.clear()
    for model in (d_ref, d):
        a, b = model(xs[0]), model(xs[1])
        loss = (a.square() + b * 2.0).mean()
        loss.backward(retain_graph=True)
        c = model(xs[2])
        loss.backward()
        c.sum().backward()
        del a, b, c, loss
    for (name, p_ref), (_, p) in zip(d_ref.named_parameters(), d.named_parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    s = graph_opt.stats(d)
    assert s.fallback_reasons == {"backward_pending": 1} and s.backward_replays == 4, s
    warnings = graph_warnings(caplog)
    assert len(warnings) == 1 and "third" in warnings[0].getMessage()
    d(xs[0]).sum().backward()
    assert graph_opt.stats(d).replays == 3


def test_two_pending_calls_whose_losses_leave_other_outputs_out(sim):
    """Each call's loss uses other heads: each slot captures its own backward of the used outputs, and
    the gradients are eager's (the trunk's sum of both)."""
    torch.manual_seed(0)
    ref = Heads(16)
    m = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=0)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for step in range(3):
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            (_, cls_a, _), (_, _, aux_b) = model(xs[0]), model(xs[1])
            (cls_a.square().mean() + aux_b.tanh().sum()).backward()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            assert (p.grad is None) == (p_ref.grad is None), name
            assert p.grad is None or torch.equal(p.grad, p_ref.grad), f"step {step}: {name}"
    s = graph_opt.stats(m)
    assert s.fallbacks == 0 and s.graphs == 2 * 3, s  # per slot: forward, full backward, one partial


def test_a_release_between_two_pending_calls_and_their_backwards(sim):
    """clear_graphs with two backwards pending: both refuse to replay, and the next calls capture again
    from slot 0."""
    (_, _), (d, _) = _gan()
    graph_opt.autocudagraph(d, warmup_steps=0)
    x = torch.randn(4, 3, 8, 8)
    a, b = d(x), d(x * 2)
    assert state_of_training(d).pending == 2
    graph_opt.clear_graphs(d)
    assert state_of_training(d).pending == 0
    for y in (b, a):
        with pytest.raises(graph_opt.GraphOptError, match="overwrote"):
            y.sum().backward()
    del a, b
    d(x).sum().backward()
    s = graph_opt.stats(d)
    assert (s.keys, s.graphs, s.captures) == (1, 2, 3), s


def test_a_forward_replayed_in_one_slot_leaves_the_other_s_backward_as_it_was(sim):
    """Slot 0's backward pending, slot 1 replayed, its backward run, slot 1 replayed again: slot 0's
    backward still reads its own activations (each slot counts its own forward replays)."""
    torch.manual_seed(0)
    ref = Discriminator()
    d = graph_opt.autocudagraph(copy.deepcopy(ref), warmup_steps=0)
    xs = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for model in (ref, d):
        a = model(xs[0])
        model(xs[1]).sum().backward()
        model(xs[2]).square().sum().backward()
        a.mean().backward()
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), d.named_parameters()):
        assert torch.equal(p.grad, p_ref.grad), name
    s = graph_opt.stats(d)
    assert s.fallbacks == 0 and s.replays == 3 and s.graphs == 4, s


def test_a_parameter_swapped_after_both_slots_were_captured_drops_and_recaptures_both(sim):
    """A swapped weight after GAN steps: both slots' graphs are dropped, and the next steps capture each
    again (the second slot again only when its call comes) and train as eager."""
    (d_ref, g_ref), (d, g) = _gan()
    graph_opt.autocudagraph(d, warmup_steps=0)
    gan_steps(d_ref, g_ref, 2)
    gan_steps(d, g, 2)
    assert graph_opt.stats(d).graphs == 6
    new = torch.randn_like(d.head.weight)
    with torch.no_grad():
        d_ref.head.weight.data = new.clone()
        d.head.weight.data = new.clone()
    want = gan_steps(d_ref, g_ref, 2)
    got = gan_steps(d, g, 2)
    assert all(torch.equal(a, b) for step in zip(got, want) for a, b in zip(*step))
    _same_parameters(d_ref, d)
    s = graph_opt.stats(d)
    assert s.recaptures == 1 and s.captures == 6 and s.graphs == 6 and s.fallbacks == 0, s
