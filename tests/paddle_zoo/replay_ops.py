"""The Paddle shim of the inference replay-safety tests: the tensor operations they use, with simulated
graphs (no Paddle GPU build runs here)."""
import collections
import pickle

import paddle

import graph_opt
from replay_support import HIDDEN
from paddle_zoo import replay


class PaddleF:
    static_writes_inputs = False  # SOT: "Paddle static graph(PIR) not support input out tensor for now"
    static_makes_python_stores = False  # its replays run SOT's programs alone

    @staticmethod
    def graphs():
        return graph_opt.testing.simulate_cuda_graphs()  # no Paddle GPU build runs here

    @staticmethod
    def place(model):
        return model

    @staticmethod
    def models():
        return replay.MODELS

    @staticmethod
    def seed(n):
        paddle.seed(n)

    @staticmethod
    def copy_weights(dst, src):
        dst.set_state_dict(src.state_dict())

    @staticmethod
    def randn(*shape, seed=0):
        import numpy as np

        return paddle.to_tensor(np.random.RandomState(seed).randn(*shape).astype("float32"))

    @staticmethod
    def arange(n, start=0):
        return paddle.arange(start, start + n, dtype="int64")

    @staticmethod
    def ids(values):
        return paddle.to_tensor(values, dtype="int64")

    @staticmethod
    def parameter(shape, value):
        return paddle.create_parameter(shape, "float32", default_initializer=paddle.nn.initializer.Constant(value))

    @staticmethod
    def no_grad():
        return paddle.no_grad()

    @staticmethod
    def equal(a, b):
        return list(a.shape) == list(b.shape) and a.dtype == b.dtype and bool((a.numpy() == b.numpy()).all())

    @staticmethod
    def close(a, b):
        import numpy as np

        return list(a.shape) == list(b.shape) and a.dtype == b.dtype and np.allclose(a.numpy(), b.numpy(), 1e-5, 1e-5)

    inductor_drops_the_sign_of_zero = False

    @staticmethod
    def same_with_nan(a, b, exact=True):
        import numpy as np

        return list(a.shape) == list(b.shape) and np.allclose(a.numpy(), b.numpy(), rtol=0 if exact else 1e-5,
                                                              atol=0, equal_nan=True)

    @staticmethod
    def shape(t):
        return list(t.shape)

    @staticmethod
    def dtype_name(t):
        return str(t.dtype).replace("paddle.", "")

    @staticmethod
    def clone(t):
        return t.clone()

    @staticmethod
    def scale(t, k):
        return t * k

    @staticmethod
    def pre_hook(model, fn):
        model.register_forward_pre_hook(lambda layer, args: fn(args))

    @staticmethod
    def post_hook(model, fn):
        return model.register_forward_post_hook(lambda layer, args, out: fn(out))

    @staticmethod
    def zero_buffer(t):
        t.zero_()

    @staticmethod
    def rows(t, start, stop):
        return t[start:stop]

    @staticmethod
    def pad_rows(t, size, value=0):
        """t with rows of `value` appended up to `size` rows, as a padded call's static buffer holds it."""
        return paddle.concat([t, paddle.full([size - t.shape[0], *t.shape[1:]], value, dtype=t.dtype)])

    def containers(self, n, seed=0):
        return replay.Batch(self.randn(n, HIDDEN, seed=seed)), collections.OrderedDict(b=self.randn(n, HIDDEN, seed=seed + 7))

    @staticmethod
    def state_object():
        return replay.State(paddle.zeros([HIDDEN]))

    @staticmethod
    def full_like_row(x, value):
        return paddle.full(x.shape[1:], value)

    @staticmethod
    def replace_weight(module, value):
        module.weight = paddle.create_parameter(module.weight.shape, "float32",
                                                default_initializer=paddle.nn.initializer.Constant(value))

    @staticmethod
    def to_double(x):
        return x.to(dtype="float64") if isinstance(x, paddle.nn.Layer) else x.astype("float64")

    @staticmethod
    def parameters(m):
        return list(m.parameters())

    @staticmethod
    def freeze(p):
        p.stop_gradient = True

    @staticmethod
    def numpy(t):
        return t.numpy()

    @staticmethod
    def tolist(t):
        return t.numpy().tolist()

    @staticmethod
    def transpose(t):
        return t.transpose([1, 0])

    @staticmethod
    def set_global_scale(value):
        replay.GLOBAL_SCALE = value

    @staticmethod
    def set_closure_scale(value):
        replay.set_closure_scale(value)

    @staticmethod
    def picklable_model(level):
        paddle.seed(0)
        return replay.Picklable(graph_opt_config=graph_opt.GraphOptConfig(graph_opt_level=level,
                                                                   cudagraph_capture_sizes=[2, 4, 8]))

    @staticmethod
    def save_load(m):
        return pickle.loads(pickle.dumps(m))
