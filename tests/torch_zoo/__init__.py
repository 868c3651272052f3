"""The torch model zoo of the tests: every model the CPU tests share, and the shims through which the tests
of tests/both run on torch (the `fw` fixture of tests/conftest.py hands this package over). tests/paddle_zoo
mirrors it. Each module holds one section's models and shim: small (the stack, host metadata, a custom
all-reduce), replay and replay_ops (inference replay safety: the models, the tensor operations), training
(autocudagraph), host_outputs, soak (the soak and fault suite). tests/gpu builds the same shims on a CUDA
device.
"""
import torch

from graph_opt.benchmarks import torch_demo as demo  # noqa: F401  (the dispatch tests' decoder)

no_grad = torch.no_grad


def reset():
    """Each test traces from scratch: no Dynamo cache entries or recompile budget carried over."""
    torch._dynamo.reset()


# The shims load their modules when asked: a module registers its splitting ops as it loads, and a test
# that imports the zoo for one model registers no other.
def replay_shim(device="cpu"):
    from torch_zoo.replay_ops import TorchF

    return TorchF(device)


def training_shim(device="cpu"):
    from torch_zoo.training import TorchShim

    return TorchShim(device)


def host_outputs_shim(device="cpu"):
    from torch_zoo.host_outputs import TorchHostShim

    return TorchHostShim(device)


def soak_kit():
    from torch_zoo.soak import KIT

    return KIT

