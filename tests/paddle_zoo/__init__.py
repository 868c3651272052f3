"""The Paddle model zoo of the tests: every model the CPU tests share, and the shims through which the tests
of tests/both run on Paddle (the `fw` fixture of tests/conftest.py hands this package over). It mirrors
tests/torch_zoo: small (the demo decoder's helpers), replay and replay_ops (inference replay safety: the
models, the tensor operations), training (autocudagraph), host_outputs, soak (the soak and fault suite).
Graphs are simulated: no Paddle GPU build runs here.
"""
import paddle

from graph_opt.benchmarks import paddle_demo as demo  # noqa: F401  (the dispatch tests' decoder)

no_grad = paddle.no_grad


def reset():
    """Nothing carries over between Paddle tests that a reset would clear."""


# The shims load their modules when asked: a module registers its splitting ops as it loads, and a test
# that imports the zoo for one model registers no other.
def replay_shim():
    from paddle_zoo.replay_ops import PaddleF

    return PaddleF()


def training_shim():
    from paddle_zoo.training import PaddleShim

    return PaddleShim()


def host_outputs_shim():
    from paddle_zoo.host_outputs import PaddleHostShim

    return PaddleHostShim()


def soak_kit():
    from paddle_zoo.soak import KIT

    return KIT
