"""A pytest plugin (`-p row_count_probe`) that makes every linear layer round by its row count.

A padded replay of 3 rows runs the forward on 4; eager on the 3 rows alone may round otherwise (some
BLAS block a product of 3 rows otherwise than one of 4: an AMD EPYC host does). A test that compares the
two bitwise passes on one CPU and fails on another. Under this plugin every torch and Paddle linear
layer scales its output by (1 + rows * eps), so such a comparison fails on every CPU, while one against
eager on the same padded rows, or one with a tolerance, still passes. tests/test_row_count_probe.py runs
the files that compare replays bitwise under it.
"""
import graph_opt.capture.capture_checks as capture_checks

# The capture check compares a padded replay with eager on fewer rows within _ULPS units in the last
# place: the probe's rounding (up to 8 rows * eps) must stay inside it, as real rounding does.
capture_checks._ULPS = 2000


def _install_torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return
    real = F.linear

    def linear(input, weight, bias=None):
        out = real(input, weight, bias)
        if input.dim() < 2 or input.layout != torch.strided or not out.is_floating_point():
            return out
        rows = torch.ones_like(input[..., :1], dtype=out.dtype).sum()  # a tensor: Dynamo traces it as such
        return out * (1 + rows * torch.finfo(out.dtype).eps)

    F.linear = linear


def _install_paddle():
    try:
        import paddle
        import paddle.nn.functional as F
    except ImportError:
        return
    real = F.linear
    eps = {paddle.float32: 2.0 ** -23, paddle.float64: 2.0 ** -52}

    def linear(x, weight, bias=None, name=None):
        out = real(x, weight, bias, name)
        if len(x.shape) < 2 or out.dtype not in eps:
            return out
        rows = paddle.ones_like(x[..., :1]).astype(out.dtype).sum()
        return out * (1 + rows * eps[out.dtype])

    F.linear = linear


_install_torch()
_install_paddle()
