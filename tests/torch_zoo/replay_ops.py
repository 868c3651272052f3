"""The torch shim of the inference replay-safety tests: the tensor operations they use, on CPU with
simulated graphs or on a CUDA device with real graphs (tests/gpu)."""
import collections
import contextlib
import io

import torch

import graph_opt
from replay_support import HIDDEN
from torch_zoo import replay


class TorchF:
    static_writes_inputs = True  # Dynamo's graphs write a mutated input back
    static_makes_python_stores = True  # Dynamo's transformed code makes a forward's Python stores

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.simulate = self.device.type != "cuda"
        # Inductor's CUDA code folds a -0.0 constant to 0.0 (torch.compile alone, measured with torch 2.11)
        self.inductor_drops_the_sign_of_zero = self.device.type == "cuda"

    def graphs(self):
        """Where captures happen: simulated graphs on CPU, real ones on a CUDA device."""
        return graph_opt.testing.simulate_cuda_graphs() if self.simulate else contextlib.nullcontext()

    def place(self, model):
        return model.to(self.device)

    @staticmethod
    def models():
        return replay.MODELS

    @staticmethod
    def seed(n):
        torch.manual_seed(n)

    @staticmethod
    def copy_weights(dst, src):
        dst.load_state_dict(src.state_dict())

    def randn(self, *shape, seed=0):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(self.device)

    def arange(self, n, start=0):
        return torch.arange(start, start + n, device=self.device)

    def ids(self, values):
        return torch.tensor(values, device=self.device)

    def parameter(self, shape, value):
        return torch.nn.Parameter(torch.full(shape, value, device=self.device))

    @staticmethod
    def no_grad():
        return torch.no_grad()

    @staticmethod
    def equal(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    @staticmethod
    def close(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5)

    @staticmethod
    def same_with_nan(a, b, exact=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.allclose(a, b, rtol=0 if exact else 1e-5, atol=0, equal_nan=True)

    @staticmethod
    def shape(t):
        return list(t.shape)

    @staticmethod
    def dtype_name(t):
        return str(t.dtype).replace("torch.", "")

    @staticmethod
    def clone(t):
        return t.clone()

    @staticmethod
    def scale(t, k):
        return t * k

    @staticmethod
    def pre_hook(model, fn):
        model.register_forward_pre_hook(lambda mod, args: fn(args))

    @staticmethod
    def post_hook(model, fn):
        return model.register_forward_hook(lambda mod, args, out: fn(out))

    @staticmethod
    def zero_buffer(t):
        t.zero_()

    @staticmethod
    def rows(t, start, stop):
        return t[start:stop]

    @staticmethod
    def pad_rows(t, size, value=0):
        """t with rows of `value` appended up to `size` rows, as a padded call's static buffer holds it."""
        return torch.cat([t, t.new_full((size - t.shape[0], *t.shape[1:]), value)])

    def containers(self, n, seed=0):
        return replay.Batch(self.randn(n, HIDDEN, seed=seed)), collections.OrderedDict(b=self.randn(n, HIDDEN, seed=seed + 7))

    def state_object(self):
        return replay.State(torch.zeros(HIDDEN, device=self.device))

    @staticmethod
    def full_like_row(x, value):
        return torch.full(x.shape[1:], value, device=x.device)

    @staticmethod
    def replace_weight(module, value):
        module.weight = torch.nn.Parameter(torch.full_like(module.weight, value))

    @staticmethod
    def to_double(x):
        return x.double()

    @staticmethod
    def parameters(m):
        return list(m.parameters())

    @staticmethod
    def freeze(p):
        p.requires_grad_(False)

    @staticmethod
    def numpy(t):
        return t.detach().cpu().numpy()

    @staticmethod
    def tolist(t):
        return t.tolist()

    @staticmethod
    def transpose(t):
        return t.t()

    @staticmethod
    def set_global_scale(value):
        replay.GLOBAL_SCALE = value

    @staticmethod
    def set_closure_scale(value):
        replay.set_closure_scale(value)

    def picklable_model(self, level):
        torch.manual_seed(0)
        return replay.Picklable(graph_opt_config=graph_opt.GraphOptConfig(
            graph_opt_level=level, cudagraph_capture_sizes=[2, 4, 8])).to(self.device)

    @staticmethod
    def save_load(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)
