"""graph_opt.autocudagraph on real CUDA graphs: tests/both/test_training_spec.py with the torch shim on
the GPU, and what only a device shows (memory of one pool across keys, masks of a seeded
dropout, the autocast cache). Skipped without a CUDA device."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_tests"))  # torch's own cases, below

import graph_opt  # noqa: E402
from sections import shared_tests  # noqa: E402
from torch_zoo.training import Block, TorchShim  # noqa: E402
from test_torch_training_module_state import (  # noqa: E402,F401  the module's state, on real graphs
    test_a_generator_of_the_module_s_own_draws_as_in_eager,
    test_hooks_of_parameters_that_get_no_gradient_run_as_in_eager,
    test_hooks_stay_as_in_eager_upstream_after_a_raising_backward_and_for_multi_grad_hooks,
    test_a_submodule_added_after_capture_has_its_training_flag_in_the_key,
    test_a_tensor_attribute_set_anew_is_read_as_eager_reads_it,
    test_a_tensor_attribute_the_forward_updates_in_place_is_updated_once_per_step,
    test_tensor_attributes_the_forward_binds_itself_keep_the_graphs,
    test_a_submodule_trains_with_graphs_while_its_decorated_model_serves_with_graphs,
    test_torch_compile_around_a_block_breaks_its_graph_there_and_the_block_replays,
    test_a_math_mode_change_between_steps_gets_a_graph_of_its_own,
    test_a_hook_on_a_submodule_registered_or_removed_after_capture_is_captured_again,
    test_a_submodule_given_another_class_after_capture_is_captured_again,
)

globals().update(shared_tests("test_training_spec"))


@pytest.fixture
def device():
    return "cuda"


@pytest.fixture
def T():
    shim = TorchShim("cuda")
    shim.hidden = 64
    yield shim
    torch.cuda.synchronize()


@pytest.fixture
def autocast_tolerance():
    return 0.0  # the graphs hold the very bf16 kernels eager runs; the casts are recorded, not cached


def test_real_graphs_are_used():
    m = graph_opt.autocudagraph(Block(64).cuda(), warmup_steps=1)
    for _ in range(3):
        m(torch.randn(4, 64, device="cuda", requires_grad=True)).sum().backward()
    s = graph_opt.stats(m)
    assert s.mode == "training graphs" and s.graphs == 2 and s.backward_replays == 2
    assert s.graph_memory_bytes is not None and s.graph_memory_bytes > 0


def test_keys_share_one_pool():
    """Three batch sizes, each a forward and a backward graph, in about one key's memory."""
    def memory(sizes):
        torch.manual_seed(0)
        m = graph_opt.autocudagraph(Block(512).cuda(), warmup_steps=0, max_graphs=8)
        for rows in sizes:
            for _ in range(2):
                m(torch.randn(rows, 128, 512, device="cuda", requires_grad=True)).sum().backward()
        s = graph_opt.stats(m)
        assert s.keys == len(sizes)
        graph_opt.clear_graphs(m)
        return s.graph_memory_bytes

    one = memory([16])
    three = memory([16, 12, 8])
    print(f"\ngraph memory: one key {one / 2**20:.1f} MiB, three keys {three / 2**20:.1f} MiB")
    assert three <= 1.3 * one


@pytest.mark.parametrize("shape", [(4, 6), (8, 128), (3, 17)])
def test_a_broadcast_incoming_gradient_is_within_the_stated_tolerance(shape):
    """loss = out.sum(): eager's incoming gradient is a stride-0 expanded tensor, the backward graph's a
    dense copy, and cuBLAS may reduce in another order. The README states the bound: 8 float32 epsilons of
    the largest gradient element. Every other gradient the kit checks is bitwise."""
    torch.manual_seed(0)
    ref = Block(64).cuda()
    m = graph_opt.autocudagraph(Block(64).cuda(), warmup_steps=0)
    m.load_state_dict(ref.state_dict())
    worst = 0.0
    for step in range(3):
        x = torch.randn(*shape, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model in (ref, m):
            model.zero_grad(set_to_none=True)
            model(x.clone().requires_grad_(True)).sum().backward()
        for (name, p_ref), (_, p) in zip(ref.named_parameters(), m.named_parameters()):
            bound = 8 * torch.finfo(torch.float32).eps * p_ref.grad.abs().max().item()
            diff = (p.grad - p_ref.grad).abs().max().item()
            worst = max(worst, diff / bound)
            assert diff <= bound, f"step {step}: grad of {name} differs by {diff:.3g} > {bound:.3g}"
    print(f"\nout.sum() at {shape}: worst difference {worst:.2f} of the stated bound")
    assert graph_opt.stats(m).backward_replays == 3


# torch's own cases that real graphs decide (cuDNN picks kernels by layout; a hook baked into a capture)
from test_torch_training import (  # noqa: E402,F401
    test_a_parameter_s_tensor_hook_runs_once_per_backward, test_channels_last_inputs_keep_their_layout_and_eager_s_gradients,
    test_one_tensor_passed_as_several_arguments_stays_one_tensor)
from test_torch_training_levels import (  # noqa: E402,F401
    test_a_forward_that_makes_device_constants_from_python_numbers_is_traced,
    test_a_plain_attribute_set_after_capture_is_traced_and_captured_again,
    test_a_traced_block_with_several_outputs_is_captured_from_its_eager_forward, test_traced_levels_train_as_eager_does)


class _Masked(torch.nn.Module):
    """transformers' eager attention mask: `torch.tensor(0.0, device=...)` in the forward, a pageable
    host-to-device copy that a capture of the eager forward refuses."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        return h + torch.where(h > 0, torch.tensor(0.0, device=h.device), -1.0)


def test_the_eager_capture_of_a_device_constant_fails_and_the_key_is_traced():
    """At the default level the eager forward's capture is refused, saying why, and the key is traced at
    level 1 instead, as is the next key (without another failed capture: the failed capture's memory pool
    is not reused); at level 1 both keys are traced from the start."""
    for level, failures in ((None, 1), (1, 0)):
        m = graph_opt.autocudagraph(_Masked().cuda(), level=level)
        for rows in (4, 4, 4, 4, 4, 8, 8, 8):  # default: warm-up, failed capture, first call, warm-up, capture
            m(torch.randn(rows, 64, device="cuda")).sum().backward()
        s = graph_opt.stats(m)
        assert s.captures == 2 and s.capture_failures == failures and s.key_levels == {1: 2}, s
        assert s.retraced == (2 if level is None else 0) and s.fallbacks == 0, s


def test_a_key_traced_after_its_eager_capture_failed_trains_as_eager_does(caplog):
    """The default level on a forward that makes a device constant: one warning naming the line's cause and
    level 1; outputs, gradients and parameters after each SGD step equal eager's (level 1 runs eager's
    kernels)."""
    import copy
    torch.manual_seed(0)
    ref = _Masked().cuda()
    m = graph_opt.autocudagraph(copy.deepcopy(ref))
    caplog.set_level("WARNING", logger="graph_opt")
    opts = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ref, m)]
    for step in range(7):
        x = torch.randn(4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        outs = []
        for model, opt in zip((ref, m), opts):
            opt.zero_grad(set_to_none=True)
            y = model(x)
            y.pow(2).mean().backward()
            opt.step()
            outs.append(y)
        assert torch.equal(*outs), f"step {step}"
        for p_ref, p in zip(ref.parameters(), m.parameters()):
            assert torch.equal(p, p_ref), f"step {step}"
    s = graph_opt.stats(m)
    assert s.key_levels == {1: 1} and s.replays >= 3, s
    said = [r.getMessage() for r in caplog.records if r.name == "graph_opt"]
    assert len(said) == 1 and "traced at level 1" in said[0] and "Cannot copy between CPU and CUDA" in said[0], said


def test_each_key_is_traced_once_under_bf16_autocast():
    """Six sequence lengths under bf16 autocast at level 1: six traces (the warm-up and the capture see the
    same autocast cache state), all six keys captured traced, none past Dynamo's limit."""
    import torch._dynamo.utils as dynamo_utils
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    m = graph_opt.autocudagraph(Block(64).cuda(), level=1)
    for n in (3, 4, 5, 6, 7, 8):
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = m(torch.randn(2, n, 64, device="cuda"))
            y.float().pow(2).mean().backward()
    s = graph_opt.stats(m)
    assert s.key_levels == {1: 6} and s.untraced == 0 and s.capture_failures == 0 and s.replays == 6, s
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 6


@pytest.mark.parametrize("how", ["summed", "fake_first"])
def test_a_gan_discriminator_on_real_and_fake_images_replays_both_calls(how):
    """D(real) and D(fake) in one loss on real graphs: the second call replays graphs of its own, in a
    pool of their own (a replay in the first pool would overwrite the activations the first call's
    backward reads), and training follows eager's to the stated bound."""
    import copy

    from torch_zoo.training import Discriminator, Generator, gan_steps

    torch.manual_seed(0)
    d_ref, g_ref = Discriminator().cuda(), Generator().cuda()
    d, g = copy.deepcopy(d_ref), copy.deepcopy(g_ref)
    graph_opt.autocudagraph(d, warmup_steps=1)
    want = gan_steps(d_ref, g_ref, 4, how, device="cuda")
    got = gan_steps(d, g, 4, how, device="cuda")
    for step, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, rtol=0, atol=8 * torch.finfo(torch.float32).eps * y.abs().max().item()), step
    for (name, p_ref), (_, p) in list(zip(d_ref.named_parameters(), d.named_parameters())) + \
            list(zip(g_ref.named_parameters(), g.named_parameters())):
        bound = 8 * torch.finfo(torch.float32).eps * p_ref.abs().max().item()
        assert (p - p_ref).abs().max().item() <= bound, name
    s = graph_opt.stats(d)
    # two keys (fake's needs an input gradient in the generator's step), the second slot holding one
    assert s.fallbacks == 0 and (s.keys, s.graphs) == (2, 6), s
    assert s.backward_replays == s.replays and s.replays >= 9, s
