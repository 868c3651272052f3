"""The torch blocks of the autocudagraph tests (tests/both/test_training_spec.py and torch's own) and their
shim: a transformer-like block, a nested block, and the tensor operations the shared tests use. On CPU
(simulated graphs) or on a CUDA device (real graphs)."""
import copy

import torch

import graph_opt


class Block(torch.nn.Module):
    """A transformer-like block: norm, two linears with a residual, dropout."""

    def __init__(self, hidden, dropout=0.0):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.fail_capture = False

    def forward(self, x):
        if self.fail_capture and graph_opt.is_capturing():
            raise RuntimeError("injected capture failure")
        y = x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))
        lora = getattr(self, "lora", None)  # a parameter a user may add after capture
        return y if lora is None else y + x @ lora


class NestedBlock(torch.nn.Module):
    """Nested inputs and outputs, an unused argument, one Linear's weight shared by another."""

    def __init__(self, hidden):
        super().__init__()
        self.a = torch.nn.Linear(hidden, hidden)
        self.b = torch.nn.Linear(hidden, hidden)
        self.b.weight = self.a.weight

    def forward(self, inp, unused):
        x = inp["x"]
        a, (c, count) = inp["pair"]
        h = torch.tanh(self.a(x) + a)
        return {"sum": self.b(h) * c, "parts": [h * 2.0, (a * c + h, "tag")], "count": count}


class NormBlock(torch.nn.Module):
    """Batch norm in training mode: its running statistics are state the forward writes."""

    def __init__(self, hidden):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.BatchNorm1d(hidden)

    def forward(self, x):
        return self.norm(self.lin(x))


class Heads(torch.nn.Module):
    """A trunk and two heads, and the input passed through: a multi-task block whose loss may skip a head."""

    def __init__(self, hidden):
        super().__init__()
        self.trunk = torch.nn.Linear(hidden, hidden)
        self.cls = torch.nn.Linear(hidden, hidden)
        self.aux = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return x, self.cls(h), self.aux(h)


class Monitored(torch.nn.Module):
    """A block that also returns, for logging, the RMS of each scaled input row (zero on a padding row,
    where sqrt's derivative is infinite)."""

    def __init__(self, hidden):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(hidden))
        self.lin = torch.nn.Linear(hidden, hidden)
        self.temperature = 1.0

    def forward(self, x):
        scaled = x * self.gain
        return self.lin(torch.tanh(scaled)) / self.temperature, scaled.pow(2).mean(-1).sqrt()


class Embeddings(torch.nn.Module):
    """Position and segment tables added to one output: autograd gives both one gradient tensor."""

    def __init__(self, hidden, rows):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.pos = torch.nn.Parameter(torch.randn(rows, hidden))
        self.seg = torch.nn.Parameter(torch.randn(rows, hidden))

    def forward(self, x):
        return self.lin(x) + self.pos + self.seg


class Reads(torch.nn.Module):
    """Reads another module's parameter without receiving it (a shared embedding, say)."""

    def __init__(self, hidden, other):
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)
        self.__dict__["other"] = other  # not a submodule: its parameter is not one of this module's

    def forward(self, x):
        return torch.tanh(self.lin(x) + self.other.weight.sum(0))


class Discriminator(torch.nn.Module):
    """A GAN's discriminator: small images to one logit each (a convolution, a norm, a linear)."""

    def __init__(self, channels=3, width=8, dropout=0.0):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 8, 3, stride=2, padding=1)
        self.norm = torch.nn.LayerNorm([8, width // 2, width // 2])
        self.drop = torch.nn.Dropout(dropout)
        self.head = torch.nn.Linear(8 * (width // 2) ** 2, 1)

    def forward(self, img):
        h = torch.nn.functional.leaky_relu(self.norm(self.conv(img)), 0.2)
        return self.head(self.drop(h).flatten(1))


class Generator(torch.nn.Module):
    def __init__(self, latent=16, channels=3, width=8):
        super().__init__()
        self.shape = (channels, width, width)
        self.lin = torch.nn.Linear(latent, channels * width * width)

    def forward(self, z):
        return torch.tanh(self.lin(z)).view(-1, *self.shape)


def gan_steps(d, g, steps, how="summed", device="cpu", rows=4, fake_rows=None):
    """`steps` GAN steps (SGD): the discriminator on real and fake images in one step (`how`: one summed
    loss, or two backwards, real's or fake's first), then the generator through it. Returns the losses."""
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    opt_d, opt_g = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (d, g))
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        real = torch.randn(rows, *g.shape, generator=gen).to(device)
        z = torch.randn(fake_rows or rows, 16, generator=gen).to(device)
        torch.manual_seed(step)
        fake = g(z)
        opt_d.zero_grad(set_to_none=True)
        out_real, out_fake = d(real), d(fake.detach())
        loss_real = bce(out_real, torch.ones_like(out_real))
        loss_fake = bce(out_fake, torch.zeros_like(out_fake))
        if how == "summed":
            (loss_real + loss_fake).backward()
        else:
            for loss in ((loss_real, loss_fake) if how == "real_first" else (loss_fake, loss_real)):
                loss.backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        out = d(fake)
        loss_g = bce(out, torch.ones_like(out))
        loss_g.backward()
        opt_g.step()
        losses.append((loss_real.detach(), loss_fake.detach(), loss_g.detach()))
    return losses


class TorchShim:
    hidden = 16

    def __init__(self, device="cpu"):
        self.device = device

    def block(self, dropout=0.0, seed=0, **_):
        torch.manual_seed(seed)
        return Block(self.hidden, dropout).to(self.device)

    def nested_block(self):
        torch.manual_seed(0)
        return NestedBlock(self.hidden).to(self.device)

    copy_block = staticmethod(copy.deepcopy)

    def randn(self, shape, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).to(self.device)

    @staticmethod
    def leaf(t, grad):
        return t.detach().clone().requires_grad_(grad)

    @staticmethod
    def strided(x):
        return x[:, ::2]

    @staticmethod
    def seed(n):
        torch.manual_seed(n)

    @staticmethod
    def loss(y):
        return (y.float() ** 2).mean()

    @staticmethod
    def grad(t):
        return t.grad

    @staticmethod
    def equal(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    @staticmethod
    def max_diff(a, b):
        return (a.float() - b.float()).abs().max().item()

    @staticmethod
    def named_params(m):
        return list(m.named_parameters())

    @staticmethod
    def zero_grads(m):
        m.zero_grad(set_to_none=True)

    @staticmethod
    def sgd(m, lr=0.1):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        opt.clear_grad = lambda: opt.zero_grad(set_to_none=True)
        return opt

    @staticmethod
    def shape(t):
        return list(t.shape)

    @staticmethod
    def first_weight(m):
        return m.up.weight

    @staticmethod
    def replace_first_weight(m, value):
        m.up.weight = torch.nn.Parameter(value.clone())

    @staticmethod
    def fail_when_capturing(m, on):
        m.fail_capture = on

    @staticmethod
    def tanh(x):
        return torch.tanh(x)

    @staticmethod
    def matmul(a, b):
        return a @ b

    @staticmethod
    def no_grad():
        return torch.no_grad()

    @staticmethod
    def requires_grad(t):
        return t.requires_grad

    def norm_block(self, seed=0):
        torch.manual_seed(seed)
        return NormBlock(self.hidden).to(self.device)

    def heads_block(self, seed=0):
        torch.manual_seed(seed)
        return Heads(self.hidden).to(self.device)

    def monitored_block(self, seed=0):
        torch.manual_seed(seed)
        return Monitored(self.hidden).to(self.device)

    @staticmethod
    def zero_row(x, row):
        x = x.clone()
        x[row] = 0
        return x

    def embeddings_block(self, rows, seed=0):
        torch.manual_seed(seed)
        return Embeddings(self.hidden, rows).to(self.device)

    def linear_pair(self, seed=0):
        """Two equal Linear modules: a user's and its eager twin."""
        torch.manual_seed(seed)
        lin = torch.nn.Linear(self.hidden, self.hidden).to(self.device)
        return lin, copy.deepcopy(lin)

    def replace_down(self, m, seed):
        torch.manual_seed(seed)
        m.down = torch.nn.Linear(2 * self.hidden, self.hidden).to(self.device)

    def add_lora(self, m, seed):
        m.lora = torch.nn.Parameter(self.randn([self.hidden, self.hidden], seed) * 0.1)

    @staticmethod
    def scale_grads_in_place(m, factor):
        """What clip_grad_norm_ and GradScaler.unscale_ do: each parameter's .grad scaled in place."""
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def reading_block(self, seed=0):
        """(block, the module whose parameter it reads)."""
        torch.manual_seed(seed)
        other = torch.nn.Linear(self.hidden, self.hidden).to(self.device)
        return Reads(self.hidden, other).to(self.device), other

    @staticmethod
    def copy_reading(block):
        other = copy.deepcopy(block.other)
        twin = copy.deepcopy(block)
        twin.__dict__["other"] = other
        return twin, other

    @staticmethod
    def autograd_grad(output, inputs, retain_graph=False):
        return torch.autograd.grad(output, inputs, retain_graph=retain_graph)

    @staticmethod
    def tensor_hook(t, fn):
        return t.register_hook(fn)

    @staticmethod
    def module_backward_hook(m, fn):
        return m.register_full_backward_hook(lambda mod, grad_in, grad_out: fn(grad_in[0]))

    @staticmethod
    def set_trainable(p, flag):
        p.requires_grad_(flag)

    @staticmethod
    def buffers(m):
        return [b for _, b in m.named_buffers()]

    @staticmethod
    def save_load(m):
        import io

        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def autocast(self):
        return torch.autocast(self.device if self.device == "cpu" else "cuda", dtype=torch.bfloat16)
