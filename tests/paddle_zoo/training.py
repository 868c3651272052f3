"""The Paddle blocks of the autocudagraph tests (tests/both/test_training_spec.py and Paddle's own) and their
shim: a transformer-like block, a nested block, and the tensor operations the shared tests use."""
import paddle

import graph_opt


class Block(paddle.nn.Layer):
    """A transformer-like block: norm, two linears with a residual, dropout."""

    def __init__(self, hidden, dropout=0.0):
        super().__init__()
        self.norm = paddle.nn.LayerNorm(hidden)
        self.up = paddle.nn.Linear(hidden, 2 * hidden)
        self.down = paddle.nn.Linear(2 * hidden, hidden)
        self.drop = paddle.nn.Dropout(dropout)
        self.fail_capture = False

    def forward(self, x):
        if self.fail_capture and graph_opt.is_capturing():
            raise RuntimeError("injected capture failure")
        y = x + self.drop(self.down(paddle.nn.functional.gelu(self.up(self.norm(x)))))
        lora = getattr(self, "lora", None)  # a parameter a user may add after capture
        return y if lora is None else y + paddle.matmul(x, lora)


class NestedBlock(paddle.nn.Layer):
    """Nested inputs and outputs, an unused argument, one Linear's weight shared by another."""

    def __init__(self, hidden):
        super().__init__()
        self.a = paddle.nn.Linear(hidden, hidden)
        self.b = paddle.nn.Linear(hidden, hidden)
        self.b.weight = self.a.weight

    def forward(self, inp, unused):
        x = inp["x"]
        a, (c, count) = inp["pair"]
        h = paddle.tanh(self.a(x) + a)
        return {"sum": self.b(h) * c, "parts": [h * 2.0, (a * c + h, "tag")], "count": count}


class NormBlock(paddle.nn.Layer):
    """Batch norm in training mode: its running statistics are state the forward writes."""

    def __init__(self, hidden):
        super().__init__()
        self.lin = paddle.nn.Linear(hidden, hidden)
        self.norm = paddle.nn.BatchNorm1D(hidden)

    def forward(self, x):
        return self.norm(self.lin(x))


class Heads(paddle.nn.Layer):
    """A trunk and two heads, and the input passed through: a multi-task block whose loss may skip a head."""

    def __init__(self, hidden):
        super().__init__()
        self.trunk = paddle.nn.Linear(hidden, hidden)
        self.cls = paddle.nn.Linear(hidden, hidden)
        self.aux = paddle.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = paddle.tanh(self.trunk(x))
        return x, self.cls(h), self.aux(h)


class Monitored(paddle.nn.Layer):
    """A block that also returns, for logging, the RMS of each scaled input row (zero on a padding row,
    where sqrt's derivative is infinite)."""

    def __init__(self, hidden):
        super().__init__()
        self.gain = self.create_parameter([hidden], default_initializer=paddle.nn.initializer.Constant(1.0))
        self.lin = paddle.nn.Linear(hidden, hidden)
        self.temperature = 1.0

    def forward(self, x):
        scaled = x * self.gain
        return self.lin(paddle.tanh(scaled)) / self.temperature, scaled.pow(2).mean(-1).sqrt()


class Embeddings(paddle.nn.Layer):
    """Position and segment tables added to one output: autograd may give both one gradient tensor."""

    def __init__(self, hidden, rows):
        super().__init__()
        self.lin = paddle.nn.Linear(hidden, hidden)
        self.pos = self.create_parameter([rows, hidden])
        self.seg = self.create_parameter([rows, hidden])

    def forward(self, x):
        return self.lin(x) + self.pos + self.seg


class Reads(paddle.nn.Layer):
    """Reads another layer's parameter without receiving it (a shared embedding, say)."""

    def __init__(self, hidden, other):
        super().__init__()
        self.lin = paddle.nn.Linear(hidden, hidden)
        self.__dict__["other"] = other  # not a sublayer: its parameter is not one of this layer's

    def forward(self, x):
        return paddle.tanh(self.lin(x) + self.other.weight.sum(0))


def _copy(layer):
    twin = type(layer).__new__(type(layer))
    twin.__init__(*layer._init_args)
    twin.set_state_dict(layer.state_dict())
    return twin


class PaddleShim:
    hidden = 16

    def block(self, dropout=0.0, seed=0, **_):
        paddle.seed(seed)
        b = Block(self.hidden, dropout)
        b._init_args = (self.hidden, dropout)
        return b

    def nested_block(self):
        paddle.seed(0)
        b = NestedBlock(self.hidden)
        b._init_args = (self.hidden,)
        return b

    copy_block = staticmethod(_copy)

    @staticmethod
    def randn(shape, seed):
        import numpy as np

        return paddle.to_tensor(np.random.default_rng(seed).standard_normal(shape).astype("float32"))

    @staticmethod
    def leaf(t, grad):
        out = t.detach().clone()
        out.stop_gradient = not grad
        return out

    @staticmethod
    def strided(x):
        return x[:, ::2]

    @staticmethod
    def seed(n):
        paddle.seed(n)

    @staticmethod
    def loss(y):
        return (y.astype("float32") ** 2).mean()

    @staticmethod
    def grad(t):
        return t.grad

    @staticmethod
    def equal(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())

    @staticmethod
    def max_diff(a, b):
        return float((a.astype("float32") - b.astype("float32")).abs().max())

    @staticmethod
    def named_params(m):
        return list(m.named_parameters())

    @staticmethod
    def zero_grads(m):
        m.clear_gradients(set_to_zero=False)

    @staticmethod
    def sgd(m, lr=0.1):
        return paddle.optimizer.SGD(learning_rate=lr, parameters=m.parameters())

    @staticmethod
    def shape(t):
        return list(t.shape)

    @staticmethod
    def first_weight(m):
        return m.up.weight

    @staticmethod
    def replace_first_weight(m, value):
        p = paddle.create_parameter(value.shape, value.dtype)
        p.set_value(value)
        m.up.weight = p

    @staticmethod
    def fail_when_capturing(m, on):
        m.fail_capture = on

    @staticmethod
    def tanh(x):
        return paddle.tanh(x)

    @staticmethod
    def matmul(a, b):
        return paddle.matmul(a, b)

    @staticmethod
    def no_grad():
        return paddle.no_grad()

    @staticmethod
    def requires_grad(t):
        return not t.stop_gradient

    @staticmethod
    def autocast():
        return paddle.amp.auto_cast(dtype="bfloat16")

    def norm_block(self, seed=0):
        paddle.seed(seed)
        b = NormBlock(self.hidden)
        b._init_args = (self.hidden,)
        return b

    def heads_block(self, seed=0):
        paddle.seed(seed)
        b = Heads(self.hidden)
        b._init_args = (self.hidden,)
        return b

    def monitored_block(self, seed=0):
        paddle.seed(seed)
        b = Monitored(self.hidden)
        b._init_args = (self.hidden,)
        return b

    @staticmethod
    def zero_row(x, row):
        x = x.clone()
        x[row] = 0
        return x

    def embeddings_block(self, rows, seed=0):
        paddle.seed(seed)
        b = Embeddings(self.hidden, rows)
        b._init_args = (self.hidden, rows)
        return b

    def linear_pair(self, seed=0):
        """Two equal Linear layers: a user's and its eager twin."""
        paddle.seed(seed)
        lin, twin = paddle.nn.Linear(self.hidden, self.hidden), paddle.nn.Linear(self.hidden, self.hidden)
        twin.set_state_dict(lin.state_dict())
        return lin, twin

    def replace_down(self, m, seed):
        paddle.seed(seed)
        m.down = paddle.nn.Linear(2 * self.hidden, self.hidden)

    def add_lora(self, m, seed):
        value = self.randn([self.hidden, self.hidden], seed) * 0.1
        p = paddle.create_parameter(value.shape, value.dtype)
        p.set_value(value)
        m.lora = p

    @staticmethod
    def scale_grads_in_place(m, factor):
        """What gradient clipping and loss-scale unscaling do: each parameter's gradient scaled in place."""
        with paddle.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.scale_(factor)

    def reading_block(self, seed=0):
        paddle.seed(seed)
        other = paddle.nn.Linear(self.hidden, self.hidden)
        return Reads(self.hidden, other), other

    def copy_reading(self, block):
        other = paddle.nn.Linear(self.hidden, self.hidden)
        other.set_state_dict(block.other.state_dict())
        twin = Reads(self.hidden, other)
        twin.set_state_dict(block.state_dict())
        return twin, other

    @staticmethod
    def autograd_grad(output, inputs, retain_graph=False):
        return paddle.grad(output, inputs, retain_graph=retain_graph)

    @staticmethod
    def tensor_hook(t, fn):
        return t.register_hook(fn)

    module_backward_hook = None  # Paddle has no module backward hooks

    @staticmethod
    def set_trainable(p, flag):
        p.stop_gradient = not flag

    @staticmethod
    def buffers(m):
        # Paddle's batch norm keeps its running statistics as parameters with stop_gradient, not buffers
        return [t for _, t in m.named_buffers()] + [p for p in m.parameters() if p.stop_gradient]

    @staticmethod
    def save_load(m):
        # Paddle saves state dicts, not Layer objects (paddle.save refuses one, and a pickled Layer's
        # parameters come back as plain tensors): deepcopy is the copy a Paddle user makes.
        import copy

        return copy.deepcopy(m)
