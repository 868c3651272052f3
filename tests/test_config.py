"""GraphOptConfig: fields, YAML, precedence, provenance and validation. No framework needed."""
import subprocess
import sys
import textwrap

import pytest

import graph_opt
from graph_opt import GraphOptConfig, GraphOptConfigError, load_config
from graph_opt.config import field_names

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_every_design_field_exists_with_its_default():
    cfg = GraphOptConfig()
    expected = {"graph_opt_level", "use_cudagraph", "full_cuda_graph", "cudagraph_mode", "cudagraph_capture_sizes",
                "max_capture_size",
                "cudagraph_num_of_warmups", "cudagraph_splitting_ops", "use_unique_memory_pool",
                "cudagraph_copy_inputs", "program_passes", "cudagraph_max_signatures", "guarded_replays",
                "keep_outputs", "sot_warmup_sizes"}
    assert set(field_names()) == expected
    assert cfg.sot_warmup_sizes is None
    assert cfg.cudagraph_max_signatures == 8 and cfg.guarded_replays is True and cfg.keep_outputs is True
    assert cfg.capture_sizes[:4] == [1, 2, 4, 8] and cfg.capture_sizes[-1] == 256
    assert len(cfg.capture_sizes) == 35


def test_yaml_bare_and_nested_give_the_same_config(tmp_path):
    bare = write(tmp_path, "graph_opt_level: 1\ncudagraph_capture_sizes: [1, 2, 4]\n", "bare.yaml")
    nested = write(tmp_path, "graph_opt_config:\n  graph_opt_level: 1\n  cudagraph_capture_sizes: [1, 2, 4]\n",
                   "nested.yaml")
    a, b = GraphOptConfig.from_yaml(bare), GraphOptConfig.from_yaml(nested)
    assert a == b
    assert a.graph_opt_level == 1 and a.capture_sizes == [1, 2, 4]
    assert a.sources["graph_opt_level"] == f"yaml:{bare}"
    assert a.sources["use_cudagraph"] == "default"


def test_precedence_defaults_yaml_kwargs_env(tmp_path, monkeypatch):
    path = write(tmp_path, "graph_opt_level: 1\ncudagraph_num_of_warmups: 3\nfull_cuda_graph: false\n")
    cfg = load_config(path, cudagraph_num_of_warmups=4, use_unique_memory_pool=False)
    assert (cfg.graph_opt_level, cfg.cudagraph_num_of_warmups, cfg.full_cuda_graph) == (1, 4, False)
    monkeypatch.setenv("GRAPH_OPT_NUM_WARMUPS", "5")
    monkeypatch.setenv("GRAPH_OPT_CAPTURE_SIZES", "1,2,8")
    cfg = load_config(path, cudagraph_num_of_warmups=4)
    assert cfg.cudagraph_num_of_warmups == 5
    assert cfg.capture_sizes == [1, 2, 8]
    assert cfg.sources["cudagraph_num_of_warmups"] == "env:GRAPH_OPT_NUM_WARMUPS"
    assert cfg.sources["graph_opt_level"] == f"yaml:{path}"
    assert cfg.sources["cudagraph_copy_inputs"] == "default"


def test_graph_opt_config_env_names_the_yaml(tmp_path, monkeypatch):
    path = write(tmp_path, "graph_opt_config:\n  graph_opt_level: 2\n")
    monkeypatch.setenv("GRAPH_OPT_CONFIG", path)
    cfg = load_config()
    assert cfg.graph_opt_level == 2
    assert "GRAPH_OPT_CONFIG" in cfg.sources["graph_opt_level"]


def test_env_overrides_a_config_object_passed_in_code(monkeypatch):
    from graph_opt.config import resolve

    monkeypatch.setenv("GRAPH_OPT_USE_CUDAGRAPH", "0")
    cfg = resolve(GraphOptConfig(use_cudagraph=True, graph_opt_level=1))
    assert cfg.use_cudagraph is False and cfg.graph_opt_level == 1


def test_max_capture_size_is_derived_from_sizes_and_appended():
    assert GraphOptConfig(cudagraph_capture_sizes=[8, 2, 4]).effective_max_capture_size == 8
    assert GraphOptConfig(cudagraph_capture_sizes=[4, 1], max_capture_size=6).capture_sizes == [1, 4, 6]
    assert GraphOptConfig(max_capture_size=20).capture_sizes == [1, 2, 4, 8, 16, 20]


def test_describe_lists_every_field_with_its_source(tmp_path):
    path = write(tmp_path, "graph_opt_level: 1\n")
    text = load_config(path, full_cuda_graph=False).describe()
    for name in field_names():
        assert name in text
    assert f"yaml:{path}" in text and "kwargs" in text and "default" in text


def test_cli_config_prints_effective_config_and_sources(tmp_path):
    path = write(tmp_path, "graph_opt_config:\n  graph_opt_level: 1\n")
    out = subprocess.run([sys.executable, "-m", "graph_opt", "config", "--config", path], cwd=ROOT,
                         capture_output=True, text=True, env={"PATH": "", "GRAPH_OPT_FULL_CUDA_GRAPH": "false"})
    assert out.returncode == 0, out.stderr
    assert "graph_opt_level" in out.stdout and f"yaml:{path}" in out.stdout
    assert "env:GRAPH_OPT_FULL_CUDA_GRAPH" in out.stdout


def test_cli_config_rejects_bad_file_with_message(tmp_path):
    path = write(tmp_path, "graph_opt_level: 7\n")
    out = subprocess.run([sys.executable, "-m", "graph_opt", "config", "--config", path], cwd=ROOT,
                         capture_output=True, text=True, env={"PATH": ""})
    assert out.returncode == 2
    assert "graph_opt_level=7" in out.stderr


def test_presets_load():
    for name in ("default", "decode_full_graph", "decode_piecewise", "static_no_graphs"):
        cfg = GraphOptConfig.from_yaml(str(ROOT / "configs" / f"{name}.yaml"))
        assert isinstance(cfg, GraphOptConfig)
    assert GraphOptConfig.from_yaml(str(ROOT / "configs" / "decode_piecewise.yaml")).full_cuda_graph is False
    assert GraphOptConfig.from_yaml(str(ROOT / "configs" / "static_no_graphs.yaml")).use_cudagraph is False


def test_a_preset_loads_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = GraphOptConfig.from_yaml("decode_full_graph")
    assert by_name.to_dict() == GraphOptConfig.from_yaml(str(ROOT / "configs" / "decode_full_graph.yaml")).to_dict()
    assert load_config("static_no_graphs").use_cudagraph is False
    (tmp_path / "default").write_text("graph_opt_level: 2\n")  # a file of that name wins over the preset
    assert load_config("default").graph_opt_level == 2


def test_a_folder_named_as_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "decode_piecewise").mkdir()  # a project folder that happens to share the preset's name
    assert GraphOptConfig.from_yaml("decode_piecewise").full_cuda_graph is False
    assert load_config("decode_piecewise").graph_opt_level == 1
    (tmp_path / "mine").mkdir()  # no preset of that name: still said to be a folder, not a file
    with pytest.raises(GraphOptConfigError, match="is not a file"):
        load_config("mine")


# -- bad input: every case names the key or variable and what is accepted -----------------------------
BAD_CONFIGS = [
    ({"graph_opt_levle": 1}, "unknown key 'graph_opt_levle' (did you mean 'graph_opt_level'?)"),
    ({"cuda_graph": True}, "unknown key 'cuda_graph'"),
    ({"capture_sizes": [1, 2]}, "unknown key 'capture_sizes' (did you mean 'cudagraph_capture_sizes'?)"),
    ({"graph_opt_level": 3}, "graph_opt_level=3"),
    ({"graph_opt_level": -1}, "must be 0 (eager), 1 (static) or 2"),
    ({"graph_opt_level": "1"}, "graph_opt_level='1'"),
    ({"graph_opt_level": True}, "graph_opt_level=True"),
    ({"graph_opt_level": 1.0}, "graph_opt_level=1.0"),
    ({"use_cudagraph": "yes"}, "use_cudagraph='yes'"),
    ({"use_cudagraph": 1}, "use_cudagraph=1 (from dict): must be a boolean"),
    ({"full_cuda_graph": None}, "full_cuda_graph=None"),
    ({"use_unique_memory_pool": "true"}, "use_unique_memory_pool"),
    ({"cudagraph_copy_inputs": 0}, "cudagraph_copy_inputs=0"),
    ({"guarded_replays": "no"}, "guarded_replays='no'"),
    ({"keep_outputs": 1}, "keep_outputs=1"),
    ({"cudagraph_max_signatures": 0}, "cudagraph_max_signatures=0 (from dict): must be a positive integer"),
    ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes=[]"),
    ({"cudagraph_capture_sizes": [1, 0, 4]}, "every size must be a positive integer, got 0"),
    ({"cudagraph_capture_sizes": [1, -2]}, "got -2"),
    ({"cudagraph_capture_sizes": [1, 2, 2, 4]}, "sizes must be unique, 2 appears more than once"),
    ({"cudagraph_capture_sizes": [1, 2.5]}, "got 2.5"),
    ({"cudagraph_capture_sizes": "1,2"}, "must be a non-empty list of positive integers"),
    ({"cudagraph_capture_sizes": [1, 64], "max_capture_size": 32}, "size 64 is above max_capture_size=32"),
    ({"max_capture_size": 0}, "max_capture_size=0"),
    ({"max_capture_size": "big"}, "max_capture_size='big'"),
    ({"cudagraph_num_of_warmups": -1}, "cudagraph_num_of_warmups=-1 (from dict): must be an integer >= 0"),
    ({"cudagraph_num_of_warmups": 1.5}, "cudagraph_num_of_warmups=1.5"),
    ({"cudagraph_splitting_ops": "attention"}, "cudagraph_splitting_ops='attention'"),
    ({"cudagraph_splitting_ops": ["a", ""]}, "must be a list of non-empty names"),
    ({"cudagraph_splitting_ops": ["a", "a"]}, "names must be unique"),
    ({"program_passes": ["no_such_pass"]}, "unknown pass 'no_such_pass'; known passes are protect_inplace_writes, remove_loop_carried_copies"),
    ({"program_passes": "remove_loop_carried_copies"}, "program_passes='remove_loop_carried_copies'"),
    ({"graph_opt_config": {"graph_opt_level": 1}, "extra": 1}, "unknown key 'extra' next to 'graph_opt_config'"),
    ({"graph_opt_config": [1, 2]}, "graph_opt_config must be a mapping"),
]


@pytest.mark.parametrize("data, fragment", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_bad_config_is_rejected_with_a_message_naming_it(data, fragment):
    with pytest.raises(GraphOptConfigError) as err:
        GraphOptConfig.from_dict(data)
    assert fragment in str(err.value)


BAD_ENV = [
    ({"GRAPH_OPT_LEVEL": "abc"}, "GRAPH_OPT_LEVEL='abc': expected an integer"),
    ({"GRAPH_OPT_LEVEL": "5"}, "graph_opt_level=5 (from env:GRAPH_OPT_LEVEL)"),
    ({"GRAPH_OPT_USE_CUDAGRAPH": "maybe"}, "GRAPH_OPT_USE_CUDAGRAPH='maybe': expected a boolean"),
    ({"GRAPH_OPT_FULL_CUDA_GRAPH": "2"}, "GRAPH_OPT_FULL_CUDA_GRAPH='2'"),
    ({"GRAPH_OPT_CAPTURE_SIZES": "1,,4"}, "GRAPH_OPT_CAPTURE_SIZES='1,,4': expected a comma-separated list"),
    ({"GRAPH_OPT_CAPTURE_SIZES": "1,x"}, "GRAPH_OPT_CAPTURE_SIZES='1,x'"),
    ({"GRAPH_OPT_CAPTURE_SIZES": "0,4"}, "(from env:GRAPH_OPT_CAPTURE_SIZES): every size must be a positive integer"),
    ({"GRAPH_OPT_CAPTURE_SIZES": "4,4"}, "sizes must be unique"),
    ({"GRAPH_OPT_MAX_CAPTURE_SIZE": "-3"}, "max_capture_size=-3 (from env:GRAPH_OPT_MAX_CAPTURE_SIZE)"),
    ({"GRAPH_OPT_CAPTURE_SIZES": "1,64", "GRAPH_OPT_MAX_CAPTURE_SIZE": "8"}, "size 64 is above max_capture_size=8"),
    ({"GRAPH_OPT_NUM_WARMUPS": "one"}, "GRAPH_OPT_NUM_WARMUPS='one'"),
    ({"GRAPH_OPT_SPLITTING_OPS": "a,,b"}, "GRAPH_OPT_SPLITTING_OPS='a,,b'"),
    ({"GRAPH_OPT_LOG_LEVEL": "LOUD"}, "GRAPH_OPT_LOG_LEVEL='LOUD': expected one of DEBUG"),
    ({"GRAPH_OPT_CONFIG": "/no/such/file.yaml"}, "config file '/no/such/file.yaml' does not exist"),
    ({"GRAPH_OPT_CONFIG": ""}, "GRAPH_OPT_CONFIG is set but empty"),
    ({"GRAPH_OPT_LEVLE": "1"}, "unknown environment variable GRAPH_OPT_LEVLE"),
]


@pytest.mark.parametrize("environ, fragment", BAD_ENV, ids=[str(i) for i in range(len(BAD_ENV))])
def test_bad_env_value_is_rejected_with_a_message_naming_the_variable(environ, fragment):
    with pytest.raises(GraphOptConfigError) as err:
        load_config(environ=environ)
    assert fragment in str(err.value)


def test_bad_yaml_files(tmp_path):
    with pytest.raises(GraphOptConfigError, match="is not valid YAML"):
        GraphOptConfig.from_yaml(write(tmp_path, "graph_opt_level: [1\n"))
    with pytest.raises(GraphOptConfigError, match="must hold a mapping, got list"):
        GraphOptConfig.from_yaml(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(GraphOptConfigError, match=r"yaml:.*unknown key 'levle'"):
        load_config(write(tmp_path, "levle: 1\n"))


@pytest.mark.parametrize("text, line, shown", [
    ("graph_opt_config:\n  graph_opt_level 1\n", 2, "graph_opt_level 1"),  # nested: was "must be a mapping, got str"
    ("graph_opt_config:\n  graph_opt_level 1\n  use_cudagraph true\n", 2, "graph_opt_level 1"),
    ("# decode\ngraph_opt_level:1\n", 2, "graph_opt_level:1"),  # no space after the colon: one string
    ("graph_opt_level: 1\nuse_cudagraph true\nfull_cuda_graph: false\n", 2, "use_cudagraph true"),
    ("graph_opt_config:\n  graph_opt_level: 1\n  use_cudagraph true\n", 3, "use_cudagraph true"),
])
def test_a_yaml_line_without_its_colon_is_named_with_the_file_and_line(tmp_path, text, line, shown):
    path = write(tmp_path, text)
    with pytest.raises(GraphOptConfigError) as err:
        GraphOptConfig.from_yaml(path)
    assert f"config file {path!r}, line {line}: {shown!r} is not a `key: value` pair" in str(err.value)
    assert "'graph_opt_level: 1'" in str(err.value)  # the form expected


def test_bad_keyword_argument_is_named():
    with pytest.raises(GraphOptConfigError, match="keyword argument: unknown key 'use_cuda_graph'"):
        load_config(use_cuda_graph=True)


def test_total_bad_input_cases_at_least_thirty():
    assert len(BAD_CONFIGS) + len(BAD_ENV) >= 30


def test_import_graph_opt_imports_no_framework():
    code = "import sys, graph_opt; print('paddle' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False"], out.stderr


ENV_OVERRIDES = [
    ("GRAPH_OPT_LEVEL", "2", "graph_opt_level", 2),
    ("GRAPH_OPT_USE_CUDAGRAPH", "off", "use_cudagraph", False),
    ("GRAPH_OPT_FULL_CUDA_GRAPH", "no", "full_cuda_graph", False),
    ("GRAPH_OPT_CAPTURE_SIZES", "2,4", "cudagraph_capture_sizes", [2, 4]),
    ("GRAPH_OPT_MAX_CAPTURE_SIZE", "64", "max_capture_size", 64),
    ("GRAPH_OPT_NUM_WARMUPS", "3", "cudagraph_num_of_warmups", 3),
    ("GRAPH_OPT_SPLITTING_OPS", "attention, pd_op.softmax", "cudagraph_splitting_ops", ["attention", "pd_op.softmax"]),
    ("GRAPH_OPT_USE_UNIQUE_MEMORY_POOL", "false", "use_unique_memory_pool", False),
    ("GRAPH_OPT_COPY_INPUTS", "0", "cudagraph_copy_inputs", False),
    ("GRAPH_OPT_MAX_SIGNATURES", "3", "cudagraph_max_signatures", 3),
    ("GRAPH_OPT_GUARDED_REPLAYS", "off", "guarded_replays", False),
    ("GRAPH_OPT_KEEP_OUTPUTS", "false", "keep_outputs", False),
]


@pytest.mark.parametrize("var, raw, field, value", ENV_OVERRIDES, ids=[e[0] for e in ENV_OVERRIDES])
def test_every_config_variable_overrides_its_field(var, raw, field, value):
    cfg = load_config(environ={var: raw})
    assert getattr(cfg, field) == value
    assert cfg.sources[field] == f"env:{var}"


def test_log_level_variable_sets_the_graph_opt_logger():
    import logging

    logger = logging.getLogger("graph_opt")
    old = logger.level
    try:
        load_config(environ={"GRAPH_OPT_LOG_LEVEL": "debug"})
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(old)


def test_simulate_variable_turns_simulation_on():
    from graph_opt import env, testing

    assert env.simulate_requested({"GRAPH_OPT_SIMULATE_CUDAGRAPH": "1"})
    assert not env.simulate_requested({})
    assert not testing.simulation_enabled()
    with testing.simulate_cuda_graphs():
        assert testing.simulation_enabled()
    assert not testing.simulation_enabled()


def test_a_model_keeps_its_own_copy_of_a_config_object():
    from graph_opt.config import resolve

    cfg = GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=[1, 2])
    mine = resolve(cfg)  # what a model built with graph_opt_config=cfg holds
    cfg.use_cudagraph = False  # for the next model
    cfg.cudagraph_capture_sizes.append(4)
    assert mine is not cfg and mine.use_cudagraph is True and mine.cudagraph_capture_sizes == [1, 2]
    assert mine.sources["graph_opt_level"] == "GraphOptConfig()" and mine == GraphOptConfig(graph_opt_level=1,
                                                                                               cudagraph_capture_sizes=[1, 2])


def test_a_dict_config_says_it_came_from_a_dict():
    from graph_opt.config import resolve

    assert resolve({"graph_opt_level": 1}).sources["graph_opt_level"] == "dict"
    with pytest.raises(GraphOptConfigError, match="graph_opt_config dict: unknown key 'levle'"):
        resolve({"levle": 1})


def test_yaml_anchors_and_merge_keys_load_and_a_merged_key_may_be_overridden(tmp_path):
    path = write(tmp_path, "base: &base\n  graph_opt_level: 1\n  cudagraph_capture_sizes: [1, 2]\n"
                           "graph_opt_config:\n  <<: *base\n  graph_opt_level: 2\n")
    from graph_opt.config import read_yaml

    assert dict(read_yaml(path)["graph_opt_config"]) == {"graph_opt_level": 2, "cudagraph_capture_sizes": [1, 2]}


def test_a_copy_of_a_config_has_its_own_sources():
    import copy
    import dataclasses

    cfg = GraphOptConfig()
    for twin in (dataclasses.replace(cfg), copy.copy(cfg)):
        twin.full_cuda_graph = True
        assert "full_cuda_graph" not in cfg.sources
    cfg.cudagraph_mode = "piecewise"  # cfg never set full_cuda_graph: no disagreement with a copy's
    assert cfg.graph_mode == "piecewise"


def test_the_cli_says_its_version_and_asks_which_benchmark(capsys):
    """`--version` prints it; `bench` with no name is an error listing the benchmarks (it used to run
    `overhead` quietly)."""
    from graph_opt import __version__
    from graph_opt.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and f"graph_opt {__version__}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["bench"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "overhead" in err and "models" in err, err
