"""What graph_opt's log lines reach, in a fresh interpreter each: GRAPH_OPT_LOG_LEVEL=INFO shows a capture at a
call with no logging configured, and a line is printed once whether the application configures logging
before the import, after it, or not at all."""
import os
import subprocess
import sys
import textwrap

import pytest

_CI_SECONDS = 6

_MODEL = textwrap.dedent("""
    import torch, graph_opt
    @graph_opt.support_graph_optimization
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
        def forward(self, x):
            return self.lin(x)
    with graph_opt.testing.simulate_cuda_graphs(), torch.no_grad():
        m = M(graph_opt_config=dict(cudagraph_capture_sizes=[2, 4])).eval()
        m(torch.randn(3, 4))   # size 4, captured at this call: one INFO line
        m(torch.randn(9, 4))   # above the largest size: one warning
""")

_LAZY = "capturing padded size 4 lazily"
_ABOVE = "above the largest capture size"


def _run(before="", after="", level="INFO"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPH_OPT_")}
    if level:
        env["GRAPH_OPT_LOG_LEVEL"] = level
    code = before + "\n" + _MODEL.replace("import torch, graph_opt", "import torch, graph_opt\n" + after)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_without_logging_configured_the_info_level_shows_a_capture_at_a_call_once():
    err = _run()
    assert err.count(_LAZY) == 1, err
    assert err.count(_ABOVE) == 1, err
    assert "graph_opt INFO: M: capturing padded size 4" in err


def test_without_a_level_set_warnings_still_reach_stderr_and_info_does_not():
    err = _run(level=None)
    assert err.count(_ABOVE) == 1 and _LAZY not in err, err


@pytest.mark.parametrize("where", ["before", "after"])
def test_logging_the_application_configures_prints_each_line_once(where):
    config = "import logging; logging.basicConfig(format='APP %(levelname)s %(message)s')"
    err = _run(**{where: config})
    assert err.count(_LAZY) == 1 and err.count(_ABOVE) == 1, err
    assert f"APP INFO M: {_LAZY}" in err  # through the application's handler, not graph_opt's
    assert "graph_opt INFO" not in err and "graph_opt WARNING" not in err, err


def test_a_handler_on_the_graph_opt_logger_itself_takes_the_lines():
    config = ("import logging, sys; h = logging.StreamHandler(sys.stderr); "
              "h.setFormatter(logging.Formatter('OWN %(message)s')); logging.getLogger('graph_opt').addHandler(h)")
    err = _run(after=config)
    assert err.count(_LAZY) == 1 and f"OWN M: {_LAZY}" in err, err
