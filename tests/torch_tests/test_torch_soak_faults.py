"""Soak and faults, torch's own case: a static call whose batch dimensions disagree (the shared suite is
tests/both/test_soak_and_faults.py)."""
import pytest

torch = pytest.importorskip("torch")

import graph_opt  # noqa: E402
from soak_support import ROW_TOLERANCE  # noqa: E402
from torch_zoo.soak import build, capture, diff, make_inputs  # noqa: E402


@pytest.mark.parametrize("level", [1, 2])
def test_a_static_call_whose_batch_dims_disagree_is_a_clear_error_and_the_model_keeps_working(level):
    model, twin = build(graph_opt_level=level, use_cudagraph=False)
    with torch.no_grad():
        capture(model)
        for bs, rows_g in ((3, 4), (5, 7)):
            x, g = make_inputs(bs, rows_g=rows_g)
            with pytest.raises(graph_opt.GraphOptInputError) as err:
                model(x, g)
            assert f"'x' has {bs} (dim 0), 'g' has {rows_g} (dim 0)" in str(err.value)
            assert "must match the size" in str(err.value.__cause__)  # Dynamo's error, kept as the cause
            x, g = make_inputs(bs)
            assert diff(model(x, g), twin(x, g)) <= ROW_TOLERANCE
        x, g = make_inputs(0, rows_g=1)  # broadcastable: without graphs the forward decides, as without the plugin
        assert diff(model(x, g), twin(x, g)) == 0.0
