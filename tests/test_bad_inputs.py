"""A table of bad inputs, one row each, and the error each one gets.

Every row names what it does wrong, the exception type it must raise and two fragments of the message:
the key, variable or argument, and what that accepts. The raise must come from graph_opt's own code
(its innermost frame is in the graph_opt package: no paddle/torch exception leaking out, no silent
acceptance). A row with `after` then checks that nothing was left half-done: after a capture-time
error the model captures with good inputs; after a call-time error it replays a correct call.

Framework rows run for torch and for Paddle; a machine without one of them skips only its rows.
All model rows run at level 0 with simulated graphs (the runtime checks are the same at every level).
"""
import textwrap
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import pytest

import graph_opt
from graph_opt import GraphOptConfig, GraphOptConfigError, GraphOptInputError, load_config
from graph_opt.capture.passes import KNOWN_PASSES

_CI_SECONDS = 1  # what this file costs on the 2-core CI host: heavier files run first (tests/conftest.py)

HIDDEN = 4
SIZES = [1, 2, 4]


# -- the two frameworks behind one small interface -----------------------------------------------------
class Fw:
    """What a row needs from a framework: a base class, tensors, no_grad, and an eager reference."""

    def __init__(self, name):
        self.name = name
        self.mod = pytest.importorskip(name)
        if name == "torch":
            self.Base, self.Linear = self.mod.nn.Module, self.mod.nn.Linear
        else:
            self.Base, self.Linear = self.mod.nn.Layer, self.mod.nn.Linear

    def randn(self, *shape, dtype="float32"):
        if self.name == "torch":
            return self.mod.randn(*shape, dtype=getattr(self.mod, dtype))
        return self.mod.randn(list(shape)).astype(dtype)

    def no_grad(self):
        return self.mod.no_grad()

    def numpy(self, t):
        return t.detach().numpy() if self.name == "torch" else t.numpy()

    def model_class(self, two=False, dims=None, pad_values=None):
        """A fresh decorated class per row: the decorator patches the class it is given."""
        Base, Linear = self.Base, self.Linear

        if two:
            class Two(Base):
                def __init__(self):
                    super().__init__()
                    self.lin = Linear(HIDDEN, HIDDEN)

                def forward(self, x, y):
                    return self.lin(x) + y

            cls = Two
        else:
            class One(Base):
                def __init__(self):
                    super().__init__()
                    self.lin = Linear(HIDDEN, HIDDEN)

                def forward(self, x):
                    return self.lin(x) * 2.0

            cls = One
        if dims is None and pad_values is None:
            return graph_opt.support_graph_optimization(cls)
        return graph_opt.support_graph_optimization(dynamic_arg_dims=dims, pad_values=pad_values)(cls)

    def model(self, two=False, dims=None, **cfg):
        return self.model_class(two, dims)(graph_opt_config=dict(cudagraph_capture_sizes=SIZES, **cfg))

    def good_inputs(self, two):
        return (lambda bs: {"x": self.randn(bs, HIDDEN), "y": self.randn(bs, HIDDEN)}) if two else \
            (lambda bs: {"x": self.randn(bs, HIDDEN)})

    def captured(self, two=False, sizes=None):
        m = self.model(two)
        report = graph_opt.capture_model(m, self.good_inputs(two), sizes=sizes, progress=False)
        assert report.failed is None
        return m

    def answers(self, m, two=False):
        """m replays a correct call (3 rows, padded to 4) and its rows equal the eager forward's."""
        args = (self.randn(3, HIDDEN), self.randn(3, HIDDEN)) if two else (self.randn(3, HIDDEN),)
        before = graph_opt.stats(m).replays
        with self.no_grad():
            got = m(*args)
            want = type(m).forward(m, *args)
        assert graph_opt.stats(m).replays == before + 1
        assert graph_opt.stats(m).disabled_reason is None
        np.testing.assert_allclose(self.numpy(got), self.numpy(want), rtol=1e-5, atol=1e-5)

    def recaptures(self, m, two=False):
        """After a capture-time error: nothing of it stayed behind, so good inputs capture and replay."""
        assert graph_opt.stats(m).disabled_reason is None
        report = graph_opt.capture_model(m, self.good_inputs(two), progress=False)
        assert report.failed is None and graph_opt.stats(m).captured_sizes == SIZES
        self.answers(m, two)


# -- the table -------------------------------------------------------------------------------------------
@dataclass
class Row:
    id: str
    fw: Optional[str]  # "torch", "paddle" or None (no framework needed)
    action: Callable  # action(ctx) -> whatever `after` needs; must raise `exc`
    exc: Optional[type]  # None: the input is fine and must be handled correctly (see the rows)
    fragments: Sequence[str]  # the key/variable/argument, and what it accepts
    after: Optional[Callable] = None  # after(ctx, state): nothing left half-done
    env: Optional[dict] = None


class Ctx:
    def __init__(self, fw, tmp_path):
        self.fw = fw
        self.tmp_path = tmp_path
        self.state = {}

    def yaml(self, text, name="cfg.yaml"):
        path = self.tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)


ROWS = []


def row(id, fw, action, exc, *fragments, after=None, env=None):
    ROWS.append(Row(id, fw, action, exc, fragments, after, env))


# Config through keyword arguments: GraphOptConfig(...)
row("kwargs-unknown-key", None, lambda c: GraphOptConfig(levels=1), GraphOptConfigError,
    "unknown key 'levels'", "allowed keys are graph_opt_level, use_cudagraph")
row("kwargs-level-3", None, lambda c: GraphOptConfig(graph_opt_level=3), GraphOptConfigError,
    "graph_opt_level=3", "must be 0 (eager), 1 (static) or 2 (static + compiler)")
row("kwargs-bool-as-str", None, lambda c: GraphOptConfig(use_cudagraph="yes"), GraphOptConfigError,
    "use_cudagraph='yes'", "must be a boolean (true or false)")
row("kwargs-size-zero", None, lambda c: GraphOptConfig(cudagraph_capture_sizes=[0, 4]), GraphOptConfigError,
    "cudagraph_capture_sizes=[0, 4]", "every size must be a positive integer, got 0")
row("kwargs-sizes-as-str", None, lambda c: GraphOptConfig(cudagraph_capture_sizes="1,2"), GraphOptConfigError,
    "cudagraph_capture_sizes='1,2'", "must be a non-empty list of positive integers")
row("kwargs-warmups-negative", None, lambda c: GraphOptConfig(cudagraph_num_of_warmups=-1), GraphOptConfigError,
    "cudagraph_num_of_warmups=-1", "must be an integer >= 0")
row("kwargs-size-above-max", None, lambda c: GraphOptConfig(cudagraph_capture_sizes=[1, 8], max_capture_size=4),
    GraphOptConfigError, "cudagraph_capture_sizes=[1, 8]", "size 8 is above max_capture_size=4")
row("kwargs-splitting-ops-str", None, lambda c: GraphOptConfig(cudagraph_splitting_ops="attn"), GraphOptConfigError,
    "cudagraph_splitting_ops='attn'", "must be a list of non-empty names")
row("kwargs-unknown-pass", None, lambda c: GraphOptConfig(program_passes=["nope"]), GraphOptConfigError,
    "program_passes=['nope']", "known passes are " + ", ".join(KNOWN_PASSES))
# ... through a dict: GraphOptConfig.from_dict
row("dict-typo", None, lambda c: GraphOptConfig.from_dict({"graph_opt_levle": 1}), GraphOptConfigError,
    "unknown key 'graph_opt_levle'", "did you mean 'graph_opt_level'?")
row("dict-not-a-mapping", None, lambda c: GraphOptConfig.from_dict([1, 2]), GraphOptConfigError,
    "a config must be a mapping", "got list")
row("dict-bool-as-str", None, lambda c: GraphOptConfig.from_dict({"full_cuda_graph": "false"}), GraphOptConfigError,
    "full_cuda_graph='false' (from dict)", "must be a boolean")
row("dict-unknown-cudagraph-mode", None, lambda c: GraphOptConfig.from_dict({"cudagraph_mode": "pieces"}),
    GraphOptConfigError, "cudagraph_mode='pieces' (from dict)", "'full', 'piecewise', 'full_and_piecewise'")
row("dict-mode-against-its-alias", None,
    lambda c: GraphOptConfig.from_dict({"cudagraph_mode": "full", "full_cuda_graph": False}), GraphOptConfigError,
    "cudagraph_mode='full' (from dict): disagrees with full_cuda_graph=False", "set one of the two")
row("dict-key-next-to-nested", None,
    lambda c: GraphOptConfig.from_dict({"graph_opt_config": {"graph_opt_level": 1}, "extra": 1}),
    GraphOptConfigError, "unknown key 'extra' next to 'graph_opt_config'", "put every setting under graph_opt_config")
# ... through load_config(**kw)
row("load-config-typo", None, lambda c: load_config(use_cuda_graph=True), GraphOptConfigError,
    "keyword argument: unknown key 'use_cuda_graph'", "did you mean 'use_cudagraph'?")
row("load-config-max-zero", None, lambda c: load_config(max_capture_size=0), GraphOptConfigError,
    "max_capture_size=0 (from kwargs)", "must be a positive integer, or null")
# ... through YAML: malformed, not a mapping, missing, bad values
row("yaml-malformed", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level: [1\n")), GraphOptConfigError,
    "cfg.yaml' is not valid YAML", "expected a mapping of graph_opt_config keys")
row("yaml-tab-indent", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level:\t1\n  x: : :\n")),
    GraphOptConfigError, "cfg.yaml' is not valid YAML", "expected a mapping of graph_opt_config keys")
row("yaml-a-list", None, lambda c: GraphOptConfig.from_yaml(c.yaml("- 1\n- 2\n")), GraphOptConfigError,
    "cfg.yaml' must hold a mapping, got list", "expected graph_opt_config keys")
row("yaml-a-scalar", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level\n")), GraphOptConfigError,
    "cfg.yaml', line 1: 'graph_opt_level' is not a `key: value` pair", "expected graph_opt_config keys")
row("yaml-nested-not-a-mapping", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_config: 5\n")),
    GraphOptConfigError, "graph_opt_config must be a mapping", "got int")
row("yaml-missing-file", None, lambda c: GraphOptConfig.from_yaml(str(c.tmp_path / "none.yaml")),
    GraphOptConfigError, "none.yaml' does not exist", "expected the path of a YAML file")
row("preset-misspelt", None, lambda c: GraphOptConfig.from_yaml("decode_ful_graph"), GraphOptConfigError,
    "'decode_ful_graph' does not exist", "or a preset's name (decode_full_graph, decode_piecewise, default")
row("yaml-a-directory", None, lambda c: load_config(str(c.tmp_path)), GraphOptConfigError,
    "is not a file", "expected the path of a YAML file")
row("yaml-path-none", None, lambda c: GraphOptConfig.from_yaml(None), GraphOptConfigError,
    "got NoneType", "expected the path of a YAML file")
row("yaml-bad-value", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level: two\n")),
    GraphOptConfigError, "graph_opt_level='two' (from yaml:", "must be 0 (eager), 1 (static) or 2")
row("yaml-unknown-key", None, lambda c: load_config(c.yaml("graph_opt_config:\n  levle: 1\n")), GraphOptConfigError,
    "unknown key 'levle'", "allowed keys are graph_opt_level")

row("yaml-not-utf8", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level: 1\n") and _latin1(c)),
    GraphOptConfigError, "latin1.yaml' is not UTF-8 text", "expected a YAML mapping of graph_opt_config keys")
row("yaml-key-twice", None, lambda c: GraphOptConfig.from_yaml(c.yaml("graph_opt_level: 1\ngraph_opt_level: 2\n")),
    GraphOptConfigError, "cfg.yaml' is not valid YAML", "key 'graph_opt_level' appears twice in one mapping")
row("kwargs-max-size-absurd", None, lambda c: GraphOptConfig(max_capture_size=10**15), GraphOptConfigError,
    "max_capture_size=1000000000000000", "must be at most 1048576")
row("kwargs-size-absurd", None, lambda c: GraphOptConfig(cudagraph_capture_sizes=[1, 2**21]), GraphOptConfigError,
    "cudagraph_capture_sizes=[1, 2097152]", "every size must be at most 1048576")


def _set_field(name, value):
    def action(c):
        cfg = c.state["cfg"] = GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=[1, 2, 4])
        setattr(cfg, name, value)
    return action


def _kept(name, value):
    # The bad value was refused whole: the config keeps its old value and still validates.
    def after(c):
        cfg = c.state["cfg"]
        assert getattr(cfg, name) == value and cfg.sources.get(name) != "set after construction"
        cfg.graph_opt_level = 2  # a good value is taken, and said where it came from
        assert cfg.graph_opt_level == 2 and cfg.sources["graph_opt_level"] == "set after construction"
    return after


# ... a field set on a GraphOptConfig after it was made: validated as at construction
row("set-level-7", None, _set_field("graph_opt_level", 7), GraphOptConfigError,
    "graph_opt_level=7 (from set after construction)", "must be 0 (eager), 1 (static) or 2",
    after=_kept("graph_opt_level", 1))
row("set-mode-typo", None, _set_field("cudagraph_mode", "fulll"), GraphOptConfigError,
    "cudagraph_mode='fulll'", "'full', 'piecewise', 'full_and_piecewise'", after=_kept("cudagraph_mode", None))
row("set-unknown-attribute", None, _set_field("graph_opt_levl", 1), GraphOptConfigError,
    "GraphOptConfig: unknown key 'graph_opt_levl'", "did you mean 'graph_opt_level'?",
    after=lambda c: c.state["cfg"].__dict__.get("graph_opt_levl") is None or pytest.fail("stored"))
row("delete-a-field", None, lambda c: delattr(GraphOptConfig(), "graph_opt_level"), GraphOptConfigError,
    "GraphOptConfig.graph_opt_level cannot be deleted", "set it to a value it accepts")
row("set-max-below-sizes", None, _set_field("max_capture_size", 2), GraphOptConfigError,
    "size 4 is above max_capture_size=2", "cudagraph_capture_sizes", after=_kept("max_capture_size", None))


def _latin1(c):
    path = c.tmp_path / "latin1.yaml"
    path.write_bytes("# caf\xe9\ngraph_opt_level: 1\n".encode("latin-1"))
    return str(path)


# Every GRAPH_OPT_* variable with a bad value (load_config reads and checks them all).
BOOL = "expected a boolean (1/0, true/false, yes/no, on/off)"
for var, value, fragments in [
    ("GRAPH_OPT_CONFIG", "", ("GRAPH_OPT_CONFIG is set but empty", "expected the path of a YAML file")),
    ("GRAPH_OPT_CONFIG", "/no/such/graph_opt.yaml", ("does not exist (GRAPH_OPT_CONFIG)", "expected the path of a YAML file")),
    ("GRAPH_OPT_DISABLE", "maybe", ("GRAPH_OPT_DISABLE='maybe'", BOOL)),
    ("GRAPH_OPT_LEVEL", "abc", ("GRAPH_OPT_LEVEL='abc': expected an integer", "0, 1 or 2")),
    ("GRAPH_OPT_LEVEL", "3", ("graph_opt_level=3 (from env:GRAPH_OPT_LEVEL)", "must be 0 (eager), 1 (static) or 2")),
    ("GRAPH_OPT_USE_CUDAGRAPH", "2", ("GRAPH_OPT_USE_CUDAGRAPH='2'", BOOL)),
    ("GRAPH_OPT_USE_CUDAGRAPH", "", ("GRAPH_OPT_USE_CUDAGRAPH is set but empty", "unset it for the config's value")),
    ("GRAPH_OPT_FULL_CUDA_GRAPH", " ", ("GRAPH_OPT_FULL_CUDA_GRAPH is set but empty", BOOL)),
    ("GRAPH_OPT_FULL_CUDA_GRAPH", "yep", ("GRAPH_OPT_FULL_CUDA_GRAPH='yep'", BOOL)),
    ("GRAPH_OPT_CUDAGRAPH_MODE", "both", ("GRAPH_OPT_CUDAGRAPH_MODE='both'", "full, piecewise, full_and_piecewise")),
    ("GRAPH_OPT_CAPTURE_SIZES", "1,x", ("GRAPH_OPT_CAPTURE_SIZES='1,x'", "comma-separated list of integers, e.g. '1,2,4,8'")),
    ("GRAPH_OPT_CAPTURE_SIZES", "0,4", ("(from env:GRAPH_OPT_CAPTURE_SIZES)", "every size must be a positive integer")),
    ("GRAPH_OPT_MAX_CAPTURE_SIZE", "big", ("GRAPH_OPT_MAX_CAPTURE_SIZE='big'", "a positive integer")),
    ("GRAPH_OPT_NUM_WARMUPS", "-1", ("(from env:GRAPH_OPT_NUM_WARMUPS)", "must be an integer >= 0")),
    ("GRAPH_OPT_SPLITTING_OPS", "a,,b", ("GRAPH_OPT_SPLITTING_OPS='a,,b'", "comma-separated list of names with no empty")),
    ("GRAPH_OPT_SPLITTING_OPS", "", ("GRAPH_OPT_SPLITTING_OPS is set but empty", "unset it for the config's value")),
    ("GRAPH_OPT_USE_UNIQUE_MEMORY_POOL", "sure", ("GRAPH_OPT_USE_UNIQUE_MEMORY_POOL='sure'", BOOL)),
    ("GRAPH_OPT_COPY_INPUTS", "nah", ("GRAPH_OPT_COPY_INPUTS='nah'", BOOL)),
    ("GRAPH_OPT_MAX_SIGNATURES", "many", ("GRAPH_OPT_MAX_SIGNATURES='many'", "a positive integer")),
    ("GRAPH_OPT_GUARDED_REPLAYS", "sometimes", ("GRAPH_OPT_GUARDED_REPLAYS='sometimes'", BOOL)),
    ("GRAPH_OPT_KEEP_OUTPUTS", "always", ("GRAPH_OPT_KEEP_OUTPUTS='always'", BOOL)),
    ("GRAPH_OPT_LOG_LEVEL", "LOUD", ("GRAPH_OPT_LOG_LEVEL='LOUD'", "one of DEBUG, INFO, WARNING, ERROR, CRITICAL")),
    ("GRAPH_OPT_SIMULATE_CUDAGRAPH", "maybe", ("GRAPH_OPT_SIMULATE_CUDAGRAPH='maybe'", BOOL)),
    ("GRAPH_OPT_LEVLE", "1", ("unknown environment variable GRAPH_OPT_LEVLE", "graph_opt reads GRAPH_OPT_CONFIG")),
]:
    row(f"env-{var}={value}", None, lambda c: load_config(), GraphOptConfigError, *fragments, env={var: value})

# Decorator misuse (no framework needed to reject these)
row("decorate-a-function", None, lambda c: graph_opt.support_graph_optimization(lambda x: x), TypeError,
    "decorates a class", "(a paddle.nn.Layer or torch.nn.Module subclass), got function")
row("decorate-a-plain-class", None,
    lambda c: graph_opt.support_graph_optimization(type("Plain", (), {"forward": lambda self, x: x})), TypeError,
    "needs a paddle.nn.Layer or torch.nn.Module subclass", "got Plain")


def _capture_with(make_inputs, two=False, sizes=None, dims=None):
    def action(c):
        m = c.state["m"] = c.fw.model(two, dims)
        graph_opt.capture_model(m, make_inputs(c.fw), sizes=sizes, progress=False)
    return action


def _recaptures(two=False):
    return lambda c: c.fw.recaptures(c.state["m"], two)


def _call_with(make_args, two=False, sizes=None):
    def action(c):
        m = c.state["m"] = c.fw.captured(two, sizes)
        args = c.state["args"] = make_args(c.fw)
        with c.fw.no_grad():
            return m(*args)
    return action


def _answers(two=False):
    return lambda c: c.fw.answers(c.state["m"], two)


MAKE_INPUTS = "a dict of forward's arguments, a tuple of positional arguments, or one tensor"
for fw in ("torch", "paddle"):
    # Decorator misuse that needs a model class of the framework
    row(f"{fw}-dims-unknown-argument", fw, lambda c: c.fw.model_class(dims={"z": 0}), GraphOptConfigError,
        "dynamic_arg_dims key 'z' is not an argument of", "its arguments are x")
    row(f"{fw}-dims-non-int", fw, lambda c: c.fw.model_class(dims={"x": "0"}), GraphOptConfigError,
        "dynamic_arg_dims['x'] must be an int dimension", "(0 for the first, -1 for the last), got '0'")
    row(f"{fw}-dims-not-a-dict", fw, lambda c: c.fw.model_class(dims=["x"]), GraphOptConfigError,
        "dynamic_arg_dims must be a non-empty dict", "e.g. {'x': 0}")
    # dim 5 of a rank-2 input: only the capture (or the first call) sees the rank
    row(f"{fw}-dims-out-of-range-at-capture", fw,
        _capture_with(lambda f: f.good_inputs(False), dims={"x": 5}), GraphOptConfigError,
        "dynamic_arg_dims['x']=5 is out of range for argument 'x' of shape [4, 4]", "must be in -2..1")
    row(f"{fw}-dims-out-of-range-at-call", fw,
        lambda c: c.fw.model(dims={"x": 5})(c.fw.randn(2, HIDDEN)), GraphOptConfigError,
        "dynamic_arg_dims['x']=5 is out of range for argument 'x' of shape [2, 4]", "must be in -2..1")
    row(f"{fw}-pad-values-unknown-argument", fw, lambda c: c.fw.model_class(pad_values={"slots": -1}),
        GraphOptConfigError, "pad_values key 'slots' is not an argument of", "its arguments are x")
    row(f"{fw}-pad-values-not-a-number", fw, lambda c: c.fw.model_class(pad_values={"x": "-1"}),
        GraphOptConfigError, "pad_values['x']='-1'", "expected a number (an int, float or bool)")
    row(f"{fw}-pad-values-not-a-dict", fw, lambda c: c.fw.model_class(pad_values=[-1]),
        GraphOptConfigError, "pad_values=[-1]", "a non-empty dict of forward argument name -> the number")
    row(f"{fw}-graph-opt-config-int", fw, lambda c: c.fw.model_class()(graph_opt_config=42), GraphOptConfigError,
        "graph_opt_config must be", "a GraphOptConfig, a dict or a YAML path (or JSON text), got int")
    row(f"{fw}-class-with-own-call", fw, lambda c: graph_opt.support_graph_optimization(
            type("Own", (c.fw.Base,), {"forward": lambda self, x: x, "__call__": lambda self, x: x + 1})),
        TypeError, "Own defines __call__", "Move that code into forward")
    row(f"{fw}-inherits-a-call-of-its-own", fw, lambda c: graph_opt.support_graph_optimization(
            type("Sub", (type("Base", (c.fw.Base,), {"__call__": lambda self, x: x + 1}),), {"forward": lambda self, x: x})),
        TypeError, "on Sub: Base defines __call__", "Move that code into forward")
    row(f"{fw}-redecorated-with-other-options", fw,
        lambda c: graph_opt.support_graph_optimization(pad_values={"x": -1})(c.fw.model_class()), GraphOptConfigError,
        "@support_graph_optimization(pad_values={'x': -1}) on", "already decorated with pad_values=None")
    row(f"{fw}-autocudagraph-on-decorated", fw, lambda c: graph_opt.autocudagraph(c.fw.model()), GraphOptInputError,
        "is decorated with @support_graph_optimization", "Wrap a submodule")
    # capture_model misuse
    row(f"{fw}-capture-model-of-a-class", fw, lambda c: graph_opt.capture_model(c.fw.model_class(), lambda bs: None),
        TypeError, "got the class One, not a model", "pass an instance (One(...))")
    row(f"{fw}-make-inputs-raises-at-a-smaller-size", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN)} if bs == 4 else {}["x"])), GraphOptInputError,
        "make_inputs(2) raised KeyError: 'x'", "Sizes captured before it stay captured ([4])", after=_recaptures())
    row(f"{fw}-make-inputs-not-callable", fw, _capture_with(lambda f: {"x": f.randn(4, HIDDEN)}), TypeError,
        "capture_model(make_inputs=...) must be a callable size -> inputs", "got dict")
    row(f"{fw}-make-inputs-returns-none", fw, _capture_with(lambda f: (lambda bs: None)), GraphOptInputError,
        "make_inputs(4) returned None", MAKE_INPUTS, after=_recaptures())
    row(f"{fw}-make-inputs-missing-argument", fw, _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN)}), two=True),
        GraphOptInputError, "do not fit Two.forward(x, y): missing a required argument: 'y'", MAKE_INPUTS,
        after=_recaptures(two=True))
    row(f"{fw}-make-inputs-extra-key", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN), "z": f.randn(bs, HIDDEN)})),
        GraphOptInputError, "do not fit One.forward(x): got an unexpected keyword argument 'z'", MAKE_INPUTS,
        after=_recaptures())
    row(f"{fw}-make-inputs-wrong-batch", fw, _capture_with(lambda f: (lambda bs: {"x": f.randn(bs + 1, HIDDEN)})),
        GraphOptInputError, "make_inputs(4): argument 'x' has 5 rows in its batch dimension 0",
        "expected 4, the size being captured", after=_recaptures())
    row(f"{fw}-make-inputs-batch-of-one-argument", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN), "y": f.randn(1, HIDDEN)}), two=True),
        GraphOptInputError, "make_inputs(4): argument 'y' has 1 rows", "expected 4, the size being captured",
        after=_recaptures(two=True))
    # wrong dtype / rank / shape: graph_opt knows what the forward takes from the sizes captured before
    # (4 first; sizes go largest first), and every size shares one static buffer per argument
    row(f"{fw}-make-inputs-wrong-dtype", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN, dtype="float32" if bs == 4 else "float64")})),
        GraphOptInputError, "make_inputs(2): argument 'x' has dtype", "float32 there", after=_recaptures())
    row(f"{fw}-make-inputs-wrong-rank", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN) if bs == 4 else f.randn(bs, 1, HIDDEN)})),
        GraphOptInputError, "make_inputs(2): argument 'x' has 3 dimensions (shape [2, 1, 4])",
        "takes a 2-dimensional tensor of shape [batch, 4]", after=_recaptures())
    row(f"{fw}-make-inputs-wrong-shape", fw,
        _capture_with(lambda f: (lambda bs: {"x": f.randn(bs, HIDDEN if bs == 4 else HIDDEN + 1)})),
        GraphOptInputError, "make_inputs(2): argument 'x' has shape [2, 5]",
        "takes a 2-dimensional tensor of shape [batch, 4]", after=_recaptures())
    row(f"{fw}-make-inputs-no-batch-dimension", fw, _capture_with(lambda f: (lambda bs: {"x": f.randn(HIDDEN).sum()})),
        GraphOptInputError, "make_inputs(4) returned no tensor with a batch dimension", "dynamic_arg_dims",
        after=_recaptures())
    for sizes, fragment in [([0], "0 is not a positive integer"), ([-1], "-1 is not a positive integer"),
                            ([2.5], "2.5 is not a positive integer"), (["4"], "'4' is not a positive integer"),
                            ([True], "True is not a positive integer"), ([3], "3 is not a capture size"),
                            (4, "capture_model(sizes=4): expected a list of capture sizes")]:
        row(f"{fw}-sizes-{sizes!r}", fw, _capture_with(lambda f: f.good_inputs(False), sizes=sizes),
            GraphOptConfigError, fragment, "capture sizes are [1, 2, 4]", after=_recaptures())
    # calls to a captured model
    row(f"{fw}-call-rank-3", fw, _call_with(lambda f: (f.randn(2, HIDDEN, 1),)), GraphOptInputError,
        "argument 'x' has 3 dimensions (shape [2, 4, 1])", "takes a 2-dimensional tensor of shape [batch, 4]",
        after=_answers())
    row(f"{fw}-call-rank-0", fw, _call_with(lambda f: (f.randn(HIDDEN).sum(),)), GraphOptInputError,
        "argument 'x' has 0 dimensions", "takes a 2-dimensional tensor of shape [batch, 4]", after=_answers())
    row(f"{fw}-call-rank-3-uncaptured-size", fw, _call_with(lambda f: (f.randn(2, HIDDEN, 1),), sizes=[4]),
        GraphOptInputError, "argument 'x' has 3 dimensions", "takes a 2-dimensional tensor of shape [batch, 4]",
        after=_answers())
    row(f"{fw}-call-wrong-dtype", fw, _call_with(lambda f: (f.randn(2, HIDDEN, dtype="float64"),)), GraphOptInputError,
        "argument 'x' has dtype", "float32 there", after=_answers())
    row(f"{fw}-call-batch-dims-disagree", fw, _call_with(lambda f: (f.randn(2, HIDDEN), f.randn(3, HIDDEN)), two=True),
        GraphOptInputError, "'x' has 2 (dim 0), 'y' has 3 (dim 0)", "must have the same size", after=_answers(two=True))

# Non-contiguous inputs are NOT bad input: with cudagraph_copy_inputs (the default) they are copied into
# the static buffers like any other tensor, so they must replay and give the eager result (exc=None).
# Paddle 3.3.1 has non-contiguous eager tensors too (stride kernels: transpose and strided slices are views).
row("torch-call-non-contiguous-t", "torch", _call_with(lambda f: (f.randn(HIDDEN, 2).t(),)), None, after=_answers())
row("torch-call-non-contiguous-slice", "torch", _call_with(lambda f: (f.randn(2, 2 * HIDDEN)[:, ::2],)), None,
    after=_answers())
row("paddle-call-non-contiguous-t", "paddle", _call_with(lambda f: (f.randn(HIDDEN, 2).t(),)), None, after=_answers())
row("paddle-call-non-contiguous-slice", "paddle", _call_with(lambda f: (f.randn(2, 2 * HIDDEN)[:, ::2],)), None,
    after=_answers())


def test_the_table_has_at_least_forty_error_rows_per_framework():
    errors = [r for r in ROWS if r.exc is not None]
    assert len([r for r in errors if r.fw != "paddle"]) >= 40 and len([r for r in errors if r.fw != "torch"]) >= 40
    assert len({r.id for r in ROWS}) == len(ROWS)
    env_vars = {name for r in ROWS for name in (r.env or {})}
    from graph_opt.env import ENV_BY_NAME

    assert set(ENV_BY_NAME) <= env_vars


@pytest.mark.parametrize("r", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(r, tmp_path, monkeypatch):
    fw = Fw(r.fw) if r.fw else None
    for name, value in (r.env or {}).items():
        monkeypatch.setenv(name, value)
    c = Ctx(fw, tmp_path)
    with graph_opt.testing.simulate_cuda_graphs():
        if r.exc is None:  # handled correctly: replayed, and the eager forward's result
            got = r.action(c)
            m = c.state["m"]
            with fw.no_grad():
                want = type(m).forward(m, *c.state["args"])
            assert graph_opt.stats(m).replays == 1 and graph_opt.stats(m).fallbacks == 0
            np.testing.assert_allclose(fw.numpy(got), fw.numpy(want), rtol=1e-5, atol=1e-5)
        else:
            with pytest.raises(r.exc) as err:
                r.action(c)
            message = str(err.value)
            for fragment in r.fragments:
                assert fragment in message
            # graph_opt raised it itself: no framework exception leaking out, no bare Python error
            raised_in = err.traceback[-1].frame.f_globals.get("__name__", "")
            assert raised_in.split(".")[0] == "graph_opt", err.traceback[-1]
            assert type(err.value).__module__.split(".")[0] not in ("torch", "paddle")
        if r.after is not None:
            r.after(c)


def test_a_mapping_that_is_not_a_dict_is_named_with_the_remedy():
    """A tokenizer's BatchEncoding is a UserDict: its tensors are not seen, and the error says to pass
    dict(...) of it. The model keeps working eagerly."""
    torch = pytest.importorskip("torch")
    import collections

    class Embeds(torch.nn.Module):
        def __init__(self, graph_opt_config=None):
            super().__init__()
            self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, batch):
            return self.lin(batch["x"])

    m = graph_opt.support_graph_optimization(type("Embeds", (Embeds,), {}))(
        graph_opt_config=GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=SIZES))  # level 0 says it too
    with graph_opt.testing.simulate_cuda_graphs(), pytest.raises(GraphOptInputError) as raised:
        graph_opt.capture_model(m, lambda n: (collections.UserDict(x=torch.randn(n, HIDDEN)),), progress=False)
    assert "an argument is a UserDict" in str(raised.value) and "dict(...)" in str(raised.value)
    batch = {"x": torch.randn(3, HIDDEN)}
    with torch.no_grad():
        assert torch.equal(m(batch), Embeds.forward(m, batch))


@pytest.mark.parametrize("level", [0, 1])
def test_a_mapping_that_is_not_a_dict_beside_another_argument_is_named_at_capture_and_at_calls(level,
                                                                                           graph_opt_warnings):
    """Beside another tensor argument the call has a batch dimension, so the capture goes on: level 0
    refuses the object (it cannot check what the forward reads from it), level 1 captures it under
    Dynamo's guards and warns once that only that very object replays. The calls' warning names the
    mapping and the remedy too. Every call equals eager."""
    torch = pytest.importorskip("torch")
    import collections

    class Scaled(torch.nn.Module):
        def __init__(self, graph_opt_config=None):
            super().__init__()
            self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, batch, scale):
            return self.lin(batch["x"]) * scale

    m = graph_opt.support_graph_optimization(type("Scaled", (Scaled,), {}))(
        graph_opt_config=GraphOptConfig(graph_opt_level=level, cudagraph_capture_sizes=SIZES))

    def make(n):
        return collections.UserDict(x=torch.randn(n, HIDDEN)), torch.randn(n, 1)

    with graph_opt.testing.simulate_cuda_graphs():
        if level == 0:
            with pytest.raises(GraphOptInputError, match=r"batch \(a UserDict, a mapping graph_opt does not look"):
                graph_opt.capture_model(m, make, progress=False)
        else:
            graph_opt.capture_model(m, make, progress=False)
            said = [w for w in graph_opt_warnings() if "UserDict" in w and "dict(...)" in w]
            assert len(said) == 1 and "very object" in said[0], graph_opt_warnings()
        for n in (4, 3):
            batch, scale = make(n)
            with torch.no_grad():
                assert torch.equal(m(batch, scale), Scaled.forward(m, batch, scale)), n
    calls = [w for w in graph_opt_warnings() if "forward argument batch (a UserDict, a mapping" in w]
    assert calls and "dict(...)" in calls[0], graph_opt_warnings()
