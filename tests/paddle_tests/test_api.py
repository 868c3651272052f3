"""The user-facing API on Paddle: decorator forms, call shapes, nested IO, dispatch keys, splitting."""
import pytest

paddle = pytest.importorskip("paddle")

import graph_opt  # noqa: E402
from graph_opt.backends.paddle.sot import translate_count  # noqa: E402
from paddle_zoo.small import HIDDEN, SIZES, capture, config, decoder, inputs, max_diff, same  # noqa: E402

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


class Nested(paddle.nn.Layer):
    """Nested dict/list/tuple inputs and outputs, a static (non-batch) tensor and a non-tensor switch."""

    def __init__(self):
        super().__init__()
        self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, batch, bias, mode="decode", scale=1.0):
        h = self.lin(batch["x"]) + batch["pair"][0] * batch["pair"][1] + bias
        if mode == "decode":
            h = paddle.tanh(h) * scale
        else:
            h = h * 3.0
        return {"hidden": h, "extra": [h.sum(axis=-1), (bias * 2.0,)]}


NestedModel = graph_opt.support_graph_optimization(dynamic_arg_dims={"batch": 0})(
    type("NestedModel", (Nested,), {}))


def nested_inputs(bs, seed=0):
    paddle.seed(seed)
    batch = {"x": paddle.randn([bs, HIDDEN]), "pair": [paddle.randn([bs, HIDDEN]), paddle.randn([bs, HIDDEN])]}
    return batch, paddle.randn([HIDDEN])


def assert_nested_close(out, ref, tol=1e-5):
    assert set(out) == {"hidden", "extra"}
    assert max_diff(out["hidden"], ref["hidden"]) <= tol
    assert max_diff(out["extra"][0], ref["extra"][0]) <= tol
    assert isinstance(out["extra"][1], tuple) and max_diff(out["extra"][1][0], ref["extra"][1][0]) <= tol


@pytest.mark.parametrize("level", [0, 1])
def test_nested_inputs_outputs_positional_and_keyword_calls(level):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(1)
        model = NestedModel(graph_opt_config=config(graph_opt_level=level))
        reference = Nested()
        reference.set_state_dict(model.state_dict())

        def make(bs):
            batch, bias = nested_inputs(bs)
            return {"batch": batch, "bias": bias}

        report = graph_opt.capture_model(model, make, progress=False)
        assert report.failed is None and report.captured_sizes == SIZES
        for bs in (2, 3, 8):
            batch, bias = nested_inputs(bs, seed=bs)
            expected = reference(batch, bias)
            assert_nested_close(model(batch, bias), expected)
            assert_nested_close(model(batch=batch, bias=bias), expected)
            assert_nested_close(model(batch, bias, "decode"), expected)
            assert_nested_close(model(batch, bias=bias, scale=1.0), expected)
            assert model(batch, bias)["hidden"].shape == [bs, HIDDEN]
            assert model(batch, bias)["extra"][1][0].shape == [HIDDEN]  # not a batch dim: not sliced
        st = graph_opt.stats(model)
        assert st.fallbacks == 0 and st.replays == 18


@pytest.mark.parametrize("level", [0, 1])
def test_non_tensor_value_never_seen_at_capture_runs_without_graphs(level, graph_opt_warnings):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(1)
        model = NestedModel(graph_opt_config=config(graph_opt_level=level))
        reference = Nested()
        reference.set_state_dict(model.state_dict())
        graph_opt.capture_model(model, lambda bs: dict(zip(("batch", "bias"), nested_inputs(bs))), progress=False)
        batch, bias = nested_inputs(4, seed=7)
        for mode, scale in (("prefill", 1.0), ("decode", 2.0)):
            out = model(batch, bias, mode, scale)
            assert_nested_close(out, reference(batch, bias, mode, scale))
        st = graph_opt.stats(model)
        assert st.fallbacks == 2 and st.replays == 0
        assert len([w for w in graph_opt_warnings() if "not seen at capture" in w]) == 1


def test_graph_opt_config_accepts_a_config_a_dict_and_a_yaml_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("graph_opt_config:\n  graph_opt_level: 1\n  cudagraph_capture_sizes: [1, 2]\n")
    from graph_opt.benchmarks.paddle_demo import GraphDecoder

    for given in (graph_opt.GraphOptConfig(graph_opt_level=1, cudagraph_capture_sizes=[1, 2]),
                  {"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 2]},
                  {"graph_opt_config": {"graph_opt_level": 1, "cudagraph_capture_sizes": [1, 2]}},
                  str(path), path):
        model = GraphDecoder(HIDDEN, 1, graph_opt_config=given)
        cfg = model._graph_opt_state.config
        assert cfg.graph_opt_level == 1 and cfg.capture_sizes == [1, 2]
    with pytest.raises(graph_opt.GraphOptConfigError, match="graph_opt_config must be a GraphOptConfig, a dict or"):
        GraphDecoder(HIDDEN, 1, graph_opt_config=42)
    with pytest.raises(graph_opt.GraphOptConfigError, match="unknown key 'levels'"):
        GraphDecoder(HIDDEN, 1, graph_opt_config={"levels": 1})


def test_decorator_rejects_what_it_cannot_handle():
    with pytest.raises(TypeError, match="needs a paddle.nn.Layer or torch.nn.Module subclass, got Plain"):
        graph_opt.support_graph_optimization(type("Plain", (), {"forward": lambda self, x: x}))
    with pytest.raises(TypeError, match="decorates a class"):
        graph_opt.support_graph_optimization(lambda x: x)
    with pytest.raises(graph_opt.GraphOptConfigError, match="dynamic_arg_dims key 'y' is not an argument of"):
        graph_opt.support_graph_optimization(dynamic_arg_dims={"y": 0})(type("N2", (Nested,), {}))
    with pytest.raises(graph_opt.GraphOptConfigError, match=r"dynamic_arg_dims\['batch'\] must be an int"):
        graph_opt.support_graph_optimization(dynamic_arg_dims={"batch": "0"})(type("N3", (Nested,), {}))
    with pytest.raises(TypeError, match="is not graph-optimized"):
        graph_opt.stats(Nested())


def test_paddle_version_check_names_the_minimum():
    from graph_opt.backends.paddle.backend import check_version

    with pytest.raises(RuntimeError, match=r"graph_opt needs PaddlePaddle >= 3.2, found 2.6.2"):
        check_version("2.6.2")
    check_version("3.2.0")
    check_version("3.3.1")
    check_version("0.0.0")  # development builds


def test_stats_and_report_describe_what_was_done():
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, _ = decoder(config(graph_opt_level=0, full_cuda_graph=False))
        report = capture(model)
        text = str(report)
        assert "size pieces graphs warmups capture ms" in text.replace("  ", " ").replace("  ", " ")
        assert text.count("\n") >= 1 + len(SIZES)
        st = graph_opt.stats(model).as_dict()
        for key in ("captures", "replays", "fallbacks", "translations", "pieces", "captured_sizes",
                    "capture_seconds", "graph_memory_bytes"):
            assert key in st
        assert st["captures"] == len(SIZES) and st["pieces"] == {s: 3 for s in SIZES}
        assert st["graph_memory_bytes"] is None  # simulated graphs hold no device memory


def test_copy_inputs_false_reads_the_callers_buffer_and_refuses_other_addresses(graph_opt_warnings):
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=0, cudagraph_copy_inputs=False))
        buffer = paddle.zeros([8, HIDDEN])
        report = graph_opt.capture_model(model, lambda bs: {"x": buffer[:bs]}, progress=False)
        assert report.failed is None
        assert graph_opt.stats(model).static_buffer_bytes == 0  # nothing allocated by the plugin
        fresh = inputs(5, seed=4)
        paddle.assign(fresh, output=buffer[:5])
        assert max_diff(model(buffer[:5]), reference(fresh)) <= 1e-5
        other = inputs(5, seed=4)  # same values, another address
        assert max_diff(model(other), reference(fresh)) <= 1e-5
        st = graph_opt.stats(model)
        assert st.replays == 1 and st.fallbacks == 1
        assert len([w for w in graph_opt_warnings() if "cudagraph_copy_inputs=false" in w]) == 1


def test_one_translation_serves_every_size_and_min_graph_size_is_restored():
    from paddle.jit.sot.utils.envs import ENV_MIN_GRAPH_SIZE

    outside = ENV_MIN_GRAPH_SIZE.get()
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, _ = decoder(config(graph_opt_level=1))
        report = capture(model)
        assert report.translations == 1  # dynamic dims: one symbolic program for sizes 8, 4, 2 and 1
        assert ENV_MIN_GRAPH_SIZE.get() == outside
        before = translate_count()
        for bs in range(1, 9):
            model(inputs(bs))
        assert translate_count() == before
        model(inputs(20))  # above the max: the plugin's plain SOT path, which sets MIN_GRAPH_SIZE too
        assert ENV_MIN_GRAPH_SIZE.get() == outside


def test_data_dependent_branch_that_diverges_at_replay_falls_back_correctly(graph_opt_warnings):
    class Branchy(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            h = self.lin(x)
            if float(h.mean()) > 0:  # data-dependent: SOT breaks the graph here
                return h * 2.0
            return h - 1.0

    Model = graph_opt.support_graph_optimization(type("BranchyModel", (Branchy,), {}))
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = Model(graph_opt_config=config(graph_opt_level=1, cudagraph_capture_sizes=[4]))
        reference = Branchy()
        reference.set_state_dict(model.state_dict())
        graph_opt.capture_model(model, lambda bs: {"x": paddle.ones([bs, HIDDEN])}, progress=False)
        for sign in (1.0, -1.0, 1.0, -1.0):
            x = paddle.ones([4, HIDDEN]) * sign * 5
            assert max_diff(model(x), reference(x)) <= 1e-5
        st = graph_opt.stats(model)
        assert st.replays + st.fallbacks == 4 and st.fallbacks >= 1


def test_level1_splitting_ops_by_pir_op_name_set_the_blacklist_for_the_capture_only(monkeypatch, graph_opt_warnings):
    import graph_opt.backends.paddle.sot as sot

    seen = []
    real_set_flags = paddle.set_flags

    def spy(flags):
        seen.append(dict(flags))
        return real_set_flags(flags)

    monkeypatch.setattr(sot.paddle, "set_flags", spy)
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        model, reference = decoder(config(graph_opt_level=1, full_cuda_graph=False,
                                          cudagraph_splitting_ops=["pd_op.softmax", "pd_op.flash_attn"]))
        report = capture(model)
        assert report.failed is None
        flag = "FLAGS_cuda_graph_blacklist"
        assert {flag: "pd_op.softmax,pd_op.flash_attn"} in seen
        assert seen[-1] == {flag: ""} and paddle.get_flags(flag)[flag] == ""
        # no SOT break (the names are PIR ops, not marked functions): one program, cut at each softmax
        st = graph_opt.stats(model)
        assert set(st.graphs.values()) == {1} and set(st.pieces.values()) == {3}
        assert any("never seen in any captured graph: pd_op.flash_attn" in w for w in graph_opt_warnings())
        x = inputs(3, seed=1)
        assert max_diff(model(x), reference(x)) <= 1e-5


def test_level0_splitting_op_runs_eagerly_between_pieces_with_capture_flags_off():
    calls = []

    @graph_opt.splitting_op(name="host_meta_op")
    def host_meta_op(x, lengths):
        calls.append(graph_opt.is_capturing())
        return x * lengths.astype(x.dtype).unsqueeze(-1)

    class HostMeta(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.a = paddle.nn.Linear(HIDDEN, HIDDEN)
            self.b = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x, lengths):
            return self.b(host_meta_op(self.a(x), lengths))

    Model = graph_opt.support_graph_optimization(type("HostMetaModel", (HostMeta,), {}))
    with graph_opt.testing.simulate_cuda_graphs(), paddle.no_grad():
        paddle.seed(0)
        model = Model(graph_opt_config=config(graph_opt_level=0, full_cuda_graph=False,
                                              cudagraph_splitting_ops=["host_meta_op"]))
        reference = HostMeta()
        reference.set_state_dict(model.state_dict())

        def make(bs):
            return {"x": inputs(bs), "lengths": paddle.arange(bs, dtype="int64")}

        graph_opt.capture_model(model, make, progress=False)
        assert graph_opt.stats(model).pieces == {s: 2 for s in SIZES}
        for bs in (1, 3, 8):
            x, lengths = inputs(bs, seed=bs), paddle.arange(bs, dtype="int64") * 2
            calls.clear()
            out = model(x, lengths)
            assert calls == [False]  # the replay runs it eagerly, outside any capture
            assert lengths.place.is_cpu_place()
            assert max_diff(out, reference(x, lengths)) <= 1e-5
