"""FastDeploy's way of configuring a model, read by graph_opt: its fd_config constructor, its keys with
their meaning, its JSON text (torch models here: the config path is the framework's own)."""
import json
import types

import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from graph_opt.config import load_config, resolve  # noqa: E402
from graph_opt.decorator import state_of  # noqa: E402
from graph_opt.errors import GraphOptConfigError  # noqa: E402


class FDGraphOptimizationConfig:
    """FastDeploy's GraphOptimizationConfig as FastDeploy makes it: its defaults, then the given args."""

    def __init__(self, args):
        self.graph_opt_level = 0
        self.sot_warmup_sizes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128]
        self.use_cudagraph = True
        self.cudagraph_capture_sizes = None
        self.cudagraph_capture_sizes_prefill = [1, 2, 4, 8]
        self.cudagraph_num_of_warmups = 2
        self.cudagraph_copy_inputs = False
        self.cudagraph_splitting_ops = []
        self.cudagraph_only_prefill = False
        self.full_cuda_graph = True
        self.max_capture_size = None
        self.real_shape_to_captured_size = None
        self.real_bsz_to_captured_size = {}
        self.use_unique_memory_pool = True
        self.draft_model_use_cudagraph = False
        self.max_capture_shape_prefill = 512
        for key, value in args.items():
            if hasattr(self, key):
                setattr(self, key, value)


@graph_opt.support_graph_optimization
class FDModel(torch.nn.Module):
    """A model built FastDeploy's way: Model(fd_config)."""

    def __init__(self, fd_config, hidden=8):
        super().__init__()
        self.fd_config = fd_config
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _fd(**graph):
    return types.SimpleNamespace(graph_opt_config=FDGraphOptimizationConfig(graph))


def test_a_model_built_with_fd_config_takes_its_graph_opt_config():
    """Positional and keyword fd_config, an object or a mapping: the model's config is FastDeploy's, with
    FastDeploy's values (2 warmups, no input copies), every value saying where it came from."""
    for make in (lambda: FDModel(_fd(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4])),
                 lambda: FDModel(fd_config=_fd(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4])),
                 lambda: FDModel({"graph_opt_config": {"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 2, 4],
                                                       "cudagraph_num_of_warmups": 2,
                                                       "cudagraph_copy_inputs": False}})):
        cfg = state_of(make()).config
        assert (cfg.graph_opt_level, cfg.capture_sizes) == (1, [1, 2, 4])
        assert (cfg.cudagraph_num_of_warmups, cfg.cudagraph_copy_inputs) == (2, False)
        assert cfg.sources["graph_opt_level"] == "fd_config.graph_opt_config"


def test_graph_opt_config_given_wins_and_the_environment_wins_over_both(monkeypatch):
    m = FDModel(_fd(graph_opt_level=1), graph_opt_config={"graph_opt_level": 0})
    assert state_of(m).config.graph_opt_level == 0
    monkeypatch.setenv("GRAPH_OPT_LEVEL", "2")
    cfg = state_of(FDModel(_fd(graph_opt_level=1))).config
    assert cfg.graph_opt_level == 2 and cfg.sources["graph_opt_level"].startswith("env:")


def test_fastdeploy_only_keys_are_skipped_and_an_unknown_key_is_named():
    cfg = state_of(FDModel(_fd(cudagraph_capture_sizes=[2, 4], real_bsz_to_captured_size={1: 2}))).config
    assert cfg.capture_sizes == [2, 4]
    with pytest.raises(GraphOptConfigError, match="unknown key 'cuda_graph_sizes'.*allowed keys"):
        FDModel({"graph_opt_config": {"cuda_graph_sizes": [1]}})


def test_an_fd_config_without_graph_opt_config_takes_the_defaults():
    cfg = state_of(FDModel(types.SimpleNamespace(model_config=None))).config
    assert cfg.graph_opt_level == 0 and cfg.sources["graph_opt_level"] == "default"


def test_an_empty_splitting_op_list_splits_at_the_default_ops_as_in_fastdeploy():
    """`cudagraph_splitting_ops: []` with full_cuda_graph false: every @splitting_op function, as
    FastDeploy fills its attention ops; not a piecewise graph split nowhere."""
    m = FDModel(_fd(full_cuda_graph=False, cudagraph_splitting_ops=[]))
    assert state_of(m).config.splitting_ops is None and state_of(m).selection.names is None


def test_a_full_graph_with_splitting_ops_warns_once_that_they_are_unused(caplog):
    """FastDeploy documents the two as exclusive; a warning, not an error: a preset may name the ops that a
    switch to piecewise uses (GRAPH_OPT_SPLITTING_OPS beside a YAML that picks the mode)."""
    caplog.set_level("WARNING", logger="graph_opt")
    for _ in range(2):
        FDModel(_fd(full_cuda_graph=True, cudagraph_splitting_ops=["attention"]))
    said = [r.getMessage() for r in caplog.records if "is unused" in r.getMessage()]
    assert len(said) == 1 and "['attention']" in said[0] and "full_cuda_graph: false" in said[0], said
    assert resolve({"full_cuda_graph": False, "cudagraph_splitting_ops": ["attention"]}).splitting_ops == ["attention"]


def test_json_text_is_read_wherever_a_config_path_is(monkeypatch):
    text = json.dumps({"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 2]})
    assert resolve(text).capture_sizes == [1, 2] and resolve(text).sources["graph_opt_level"] == "json"
    monkeypatch.setenv("GRAPH_OPT_CONFIG", text)
    cfg = load_config()
    assert cfg.graph_opt_level == 1 and cfg.sources["graph_opt_level"] == "json (GRAPH_OPT_CONFIG)"
    with pytest.raises(GraphOptConfigError, match="config JSON text .*GRAPH_OPT_CONFIG.* is not valid"):
        monkeypatch.setenv("GRAPH_OPT_CONFIG", '{"graph_opt_level": 1,')
        load_config()


def test_sot_warmup_sizes_are_checked_and_run_above_the_largest_captured_size():
    with pytest.raises(GraphOptConfigError, match="sot_warmup_sizes"):
        resolve({"sot_warmup_sizes": [0, 2]})
    asked = []

    def make_inputs(n):
        asked.append(n)
        return (torch.randn(n, 8),)

    with graph_opt.testing.simulate_cuda_graphs():
        m = FDModel(_fd(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4], sot_warmup_sizes=[2, 8, 16])).eval()
        report = graph_opt.capture_model(m, make_inputs, progress=False)
    assert report.failed is None and sorted(asked)[-2:] == [8, 16], asked  # 2 is captured: not warmed
    assert any("sot_warmup_sizes" in n and "[8, 16]" in n for n in report.notes), report.notes
    x = torch.randn(16, 8)
    with torch.no_grad():
        assert torch.equal(m(x), FDModel.forward(m, x))


def test_a_fastdeploy_yaml_loads_as_it_is(tmp_path, monkeypatch):
    """FastDeploy's keys for its own scheduler are skipped in any config source, so its YAML (and JSON)
    loads unchanged; graph_opt's keys in it take effect."""
    path = tmp_path / "fd.yaml"
    path.write_text("graph_opt_config:\n  graph_opt_level: 1\n  cudagraph_capture_sizes: [1, 2, 4]\n"
                    "  cudagraph_capture_sizes_prefill: [1, 2, 4, 8]\n  cudagraph_only_prefill: false\n"
                    "  full_cuda_graph: false\n  cudagraph_splitting_ops: []\n")
    monkeypatch.setenv("GRAPH_OPT_CONFIG", str(path))
    cfg = state_of(FDModel(types.SimpleNamespace())).config
    assert (cfg.graph_opt_level, cfg.capture_sizes, cfg.graph_mode, cfg.splitting_ops) == (1, [1, 2, 4], "piecewise",
                                                                                          None)
    assert cfg.sources["graph_opt_level"].startswith("yaml:")
