"""FastDeploy users' ordinary usage, checked against docs/fastdeploy.md (found while red-teaming the
FastDeploy compatibility): valid JSON is read as JSON, a subclass that forwards *args/**kwargs still reads
fd_config, a nested fd_config mapping is unwrapped as every other mapping is, and a level >= 1 model
without graphs warms up at sot_warmup_sizes only."""
import json
import types

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from graph_opt.config import resolve, load_config  # noqa: E402
from graph_opt.decorator import state_of  # noqa: E402
from graph_opt.errors import GraphOptConfigError  # noqa: E402


class Eager(torch.nn.Module):
    def __init__(self, fd_config, prefix=""):
        super().__init__()
        self.prefix = prefix
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _fd(**graph):
    return types.SimpleNamespace(graph_opt_config=dict(graph))


def test_valid_json_with_tab_indentation_is_json(tmp_path, monkeypatch):
    """json.dumps(..., indent="\\t") is valid JSON (FastDeploy reads it with json.loads); YAML refuses tabs."""
    text = json.dumps({"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 2]}, indent="\t")
    assert resolve(text).capture_sizes == [1, 2]
    monkeypatch.setenv("GRAPH_OPT_CONFIG", text)
    assert load_config().graph_opt_level == 1
    monkeypatch.delenv("GRAPH_OPT_CONFIG")
    path = tmp_path / "graph_opt.json"
    path.write_text(text)
    assert resolve(str(path)).graph_opt_level == 1
    with pytest.raises(GraphOptConfigError, match="appears twice"):  # still: a key given twice is an error
        resolve('{"graph_opt_level": 1,\n\t"graph_opt_level": 2}')
    assert resolve("{graph_opt_level: 1}").graph_opt_level == 1  # a YAML flow mapping still reads


def test_a_decorated_subclass_forwarding_args_reads_a_positional_fd_config():
    @graph_opt.support_graph_optimization
    class Forwarding(Eager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    for m in (Forwarding(_fd(graph_opt_level=1)), Forwarding(fd_config=_fd(graph_opt_level=1)),
              Forwarding(_fd(graph_opt_level=1), "model.")):
        cfg = state_of(m).config
        assert (cfg.graph_opt_level, cfg.sources["graph_opt_level"]) == (1, "fd_config.graph_opt_config")


def test_an_fd_config_mapping_nested_under_graph_opt_config_is_unwrapped():
    """As graph_opt_config={...}, a YAML file or JSON text: the keys may sit under graph_opt_config:."""
    @graph_opt.support_graph_optimization
    class Model(Eager):
        pass

    nested = {"graph_opt_config": {"graph_opt_level": 1}}
    assert state_of(Model(types.SimpleNamespace(graph_opt_config=nested))).config.graph_opt_level == 1


def test_level_1_without_graphs_warms_up_at_the_sot_warmup_sizes_only():
    """use_cudagraph false, sot_warmup_sizes [16]: capture_model runs the static path at 16, and asks
    make_inputs for no batch larger than the caller's buffers (not the default max capture size, 256)."""
    @graph_opt.support_graph_optimization
    class Model(Eager):
        pass

    asked = []
    buffer = torch.randn(16, 8)

    def make_inputs(n):
        asked.append(n)
        assert n <= 16, f"make_inputs({n}): FastDeploy's buffers hold max(sot_warmup_sizes) rows"
        return (buffer[:n],)

    m = Model(_fd(graph_opt_level=1, use_cudagraph=False, sot_warmup_sizes=[4, 16])).eval()
    report = graph_opt.capture_model(m, make_inputs, progress=False)
    assert asked == [4, 16] and report.translations >= 1
    before = graph_opt.stats(m).translations
    with torch.no_grad():
        x = torch.randn(16, 8)
        assert torch.equal(m(x), Eager.forward(m, x))
    assert graph_opt.stats(m).translations == before


def test_fd_config_json_text_sits_above_graph_opt_config_as_a_mapping_does(monkeypatch, tmp_path):
    """docs/fastdeploy.md: defaults < GRAPH_OPT_CONFIG < fd_config.graph_opt_config, whatever its form; JSON
    text (or a YAML path) there dropped GRAPH_OPT_CONFIG entirely and named its values 'json'."""
    @graph_opt.support_graph_optimization
    class Model(Eager):
        pass

    monkeypatch.setenv("GRAPH_OPT_CONFIG", '{"cudagraph_capture_sizes": [1, 2]}')
    path = tmp_path / "fd.yaml"
    path.write_text("graph_opt_config:\n  graph_opt_level: 1\n")
    for given in ('{"graph_opt_level": 1}', {"graph_opt_level": 1}, str(path)):
        cfg = state_of(Model(types.SimpleNamespace(graph_opt_config=given))).config
        assert (cfg.graph_opt_level, cfg.capture_sizes) == (1, [1, 2]), given
        assert cfg.sources["graph_opt_level"] == "fd_config.graph_opt_config", given
