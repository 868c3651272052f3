"""PyTorch side of graph_opt.autocudagraph: autograd, parameters, autocast and random state.

The replayed forward enters autograd as a torch.autograd.Function whose backward replays the backward
graph; this follows torch.cuda.make_graphed_callables, with the differences graph_opt.training.api lists
(outputs copied, leaves' first gradients copied, a second forward before a pending backward replaying
graphs of its own).
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from . import grad_hooks, math_mode
from .data_parallel import data_parallel
from .grad_hooks import accumulates as _accumulates, graph_nodes, leaves_reached
from ...errors import TraceLimitReached


_data_ptr = torch.Tensor.data_ptr
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_default_dtype = torch.get_default_dtype
_float32 = torch.float32
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: False)
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


_pack_view = torch.Tensor.detach  # saved tensors as detached views: no reference cycle through a grad_fn


def _unpack_view(t):
    return t


_math_changes = math_mode.counter()


class _ReplayStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, graphs, *tensors):
        return block.forward_for_grad(ctx, graphs, tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, None) + tuple(ctx.block.backward_for_grad(ctx, grads))  # none for block and graphs


class TorchAutogradBridge:
    def __init__(self):
        self._math_seen = -1
        self._math_id = 0  # the math mode's number: 0 for the first seen (math_mode.py)
        self._math_ids = {}
        self._tensor = torch.Tensor

    # -- tensors ---------------------------------------------------------------------------------
    def is_tensor(self, x) -> bool:
        return isinstance(x, self._tensor)

    def shape(self, t):
        return t.shape

    def leaf_key(self, t):
        # A layout other than the contiguous one (channels_last) is kept by the static copy, and kernels
        # pick their algorithm by it: it is part of the key
        return t.shape, t.dtype, t.requires_grad, t.device, None if t.is_contiguous() else t.stride()

    def requires_grad(self, t) -> bool:
        return t.requires_grad

    def static_input(self, t):
        with torch.inference_mode(False):  # never an inference tensor: calls under no_grad copy into it
            s = t.detach().clone(memory_format=torch.preserve_format)
        return s.requires_grad_(True) if t.requires_grad else s

    def detach(self, t):
        return t.detach()

    def clone(self, t):
        return t.clone()

    def zero_(self, t) -> None:
        t.zero_()

    def zeros_like(self, t):
        with torch.inference_mode(False):  # t's layout, as eager's incoming gradient has (channels_last)
            return torch.zeros_like(t, memory_format=torch.preserve_format)

    def ones_like(self, t):
        return torch.ones_like(t)

    @staticmethod
    def same_memory(a, b) -> bool:
        return _data_ptr(a) == _data_ptr(b)

    @staticmethod
    @contextlib.contextmanager
    def leaf_hooks_off(tensors):
        """Tensor hooks of these leaves (a parameter's `register_hook`) off for the block's own
        autograd.grad: the outer backward runs them once, on the gradient the replay hands out. Run at
        capture, a hook would be baked into the graph and applied twice."""
        held = []
        for t in tensors:
            hooks = t._backward_hooks  # the dict autograd's pre-hook reads at each call
            if hooks:
                held.append((hooks, list(hooks.items())))
                hooks.clear()
        try:
            yield
        finally:
            for hooks, items in held:
                hooks.update(items)

    @staticmethod
    def unshared(grads, taken):
        """grads, each a tensor over memory of its own: one whose storage another gradient or a tensor of
        `taken` already uses is cloned."""
        seen = {t.untyped_storage().data_ptr() for t in taken if t.numel()}
        out = []
        for g in grads:
            if g is not None and g.numel():
                ptr = g.untyped_storage().data_ptr()
                if ptr in seen:
                    g = g.clone()
                    ptr = g.untyped_storage().data_ptr()
                seen.add(ptr)
            out.append(g)
        return out

    @staticmethod
    def reached_from(outputs, leaves):
        """Per leaf: the indices of the outputs whose autograd graph reaches it."""
        reached = [{id(o)} if o.grad_fn is None else leaves_reached([o.grad_fn])[0].keys() for o in outputs]
        return [tuple(i for i, r in enumerate(reached) if id(t) in r) for t in leaves]

    @staticmethod
    def root_output(outputs):
        """The index of the output whose autograd graph holds the node of every other output (a loss
        computed from the logits it is returned with), or None. A traced backward gives the outputs a loss
        leaves out zero gradients; where they all feed the one it uses, that adds zeros to gradients
        computed anyway, and the backward is eager's."""
        nodes = [o.grad_fn for o in outputs]
        if any(n is None for n in nodes):
            return None
        keys = [(n.name(), n._sequence_nr()) for n in nodes]  # a node's Python object is made anew per access
        for i in sorted(range(len(nodes)), key=lambda k: -keys[k][1]):  # the latest made first: the usual root
            if keys.count(keys[i]) > 1:  # outputs of one node (x.chunk(2), split, unbind): neither is made
                continue                  # from the other, and a loss may use either alone
            others = set(keys) - {keys[i]}
            if others <= graph_nodes(nodes[i], others):
                return i
        return None

    def copy_detached(self, dst, src) -> None:
        with torch.no_grad():
            dst.copy_(src)

    def set_grad(self, t, grad) -> None:
        with torch.no_grad():
            t.grad = grad

    def hand_out(self, buffers, inputs, lent, nodes):
        """The gradients backward returns, one per input. Where autograd accumulates it into a leaf's
        .grad (loss.backward()), the static buffer itself: added in place into an existing .grad, or
        lent to a leaf without one (a tensor over the buffer, no copy, recorded in `lent`: the block gives
        it a copy before the next replay if it still holds it). Anywhere else the caller may keep it
        (torch.autograd.grad's result, a hook's argument, a non-leaf input's upstream): a copy, since
        the next backward replay rewrites the buffer."""
        out = []
        for buf, t in zip(buffers, inputs):
            if buf is not None:
                if t.is_leaf and not t._backward_hooks and _accumulates(t, nodes):
                    if t.grad is None:
                        lent.append((t, buf))
                        buf = buf.detach()
                else:
                    buf = buf.clone()
            out.append(buf)
        if any(b is None for b in buffers):  # not `None in`: that compares each tensor with ==, 14 µs apiece
            grad_hooks.hold_without_grad(buffers, inputs)
        return out

    @staticmethod
    def traced(fn, level: int, name: str):
        """fn traced by Dynamo and AOTAutograd into forward and backward graphs: run by eager kernels
        (level 1) or compiled by Inductor (level 2). No CUDA graphs of torch.compile's own: the block
        captures the compiled forward and backward itself. Shapes are static: a key is one shape."""
        # No donated buffers (a backward reusing the forward's saved tensors for its own): the backward is
        # captured retaining them, for a second backward through one forward. AOTAutograd reads the flag
        # when it compiles a forward and again at each backward, so it is turned off process-wide.
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False

        compiled = torch.compile(fn, backend="aot_eager" if level == 1 else "inductor", dynamic=False)
        import torch._dynamo.config as dynamo_config
        from torch._dynamo.exc import FailOnRecompileLimitHit

        # Every key is a trace of its own (static shapes), and all blocks of a class share their forward's
        # code, so Dynamo's limit of traces per code object (8) is spent by the keys of one or two blocks;
        # past it Dynamo runs the forward untraced, saying so only in its log. Here the limit is raised,
        # and hitting it raises (TraceLimitReached), so the block captures that key from the eager forward
        # and says so. Dynamo's guards skip module hooks by default: with them, a hook a submodule gained
        # or lost since is traced again, in every frame (one after a graph break too).
        settings = {"recompile_limit": max(dynamo_config.recompile_limit, _TRACES_PER_FORWARD),
                    "fail_on_recompile_limit_hit": True}
        if hasattr(dynamo_config, "skip_nnmodule_hook_guards"):
            settings["skip_nnmodule_hook_guards"] = False
        # These guards run at a key's warm-ups and captures only, never at a replay: nothing to gain from
        # skipping module subtrees or tensors by their dict tags (torch 2.11's defaults), which miss a
        # submodule given another class and a parameter frozen or unfrozen (no dict written) and would hand
        # a capture the trace made before.
        settings["use_recursive_dict_tags_for_guards"] = False
        if hasattr(dynamo_config, "skip_tensor_guards_with_matching_dict_tags"):
            settings["skip_tensor_guards_with_matching_dict_tags"] = False
        patch = dynamo_config.patch(**settings)
        owner = getattr(fn, "__self__", None)
        owner = owner if isinstance(owner, torch.nn.Module) else None

        def traced_forward(*args, **kwargs):
            # The autocast cache is off in every traced run, as in the capture (amp_cache_disabled): its
            # state is one of Dynamo's guards, and a capture seeing another state than the warmup traced
            # would trace the key twice. Only a key's warm-ups and capture run this, never a replay.
            held = _running_stats_versions(owner)
            with patch, _amp_cache_off():
                try:
                    return compiled(*args, **kwargs)
                except FailOnRecompileLimitHit as exc:
                    raise TraceLimitReached(
                        f"{name}: Dynamo traced this forward {settings['recompile_limit']} times (one per key, of "
                        "every block of its class), its limit (torch._dynamo.config.recompile_limit)") from None
                finally:
                    _put_back_versions(held)

        return traced_forward

    @staticmethod
    def check_nested_grad() -> None:
        pass  # torch's autograd runs a nested torch.autograd.grad inside a backward

    @staticmethod
    def saved_as_views():
        """Autograd saves detached views (no reference cycle through an output's grad_fn) and checks no
        versions when it reads them back."""
        return torch.autograd.graph.saved_tensors_hooks(_pack_view, _unpack_view)

    @staticmethod
    def keeps_graph() -> bool:
        """Inside a backward: whether it runs with retain_graph=True (a second backward may follow)."""
        return _keeps_graph()

    @staticmethod
    def saved_tensor_hooks_active() -> bool:
        """Whether saved-tensor hooks are on (torch.utils.checkpoint without reentrance, offloading): the
        block's activations are the hooks' to keep, and a replayed graph's would be overwritten."""
        if _saved_tensor_hooks is None:
            return False
        top = _saved_tensor_hooks(False)
        return top is not None and top[0] is not _pack_view  # graph_opt's own, around a capture: not the user's

    # -- what the block reads without receiving it -------------------------------------------------
    @staticmethod
    def graph_mark():
        """A point in autograd's node sequence: nodes made after it belong to the forward that follows."""
        with torch.enable_grad():
            return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr()

    @staticmethod
    def outside_tensors(outputs, known, mark):
        """(leaves, computed_outside): the leaves requiring grad that `outputs` depend on, other than
        `known` (inputs and parameters: {id: tensor}); and whether they depend on a tensor computed before
        the forward (a node older than `mark`)."""
        found, outside = leaves_reached([o.grad_fn for o in outputs if o.grad_fn is not None], mark)
        return [t for i, t in found.items() if i not in known], outside

    @staticmethod
    def addresses(tensors):
        return [0 if isinstance(t, torch.nn.parameter.UninitializedTensorMixin) else _data_ptr(t) for t in tensors]

    @staticmethod
    def data_parallel(wrapper):
        return data_parallel(wrapper)

    @staticmethod
    def uninitialized(module) -> bool:
        """Whether a parameter or buffer is still lazy (LazyLinear before its first call)."""
        from torch.nn.parameter import is_lazy

        return any(is_lazy(t) for t in module.parameters()) or any(is_lazy(t) for t in module.buffers())

    # -- autograd --------------------------------------------------------------------------------
    def grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def enable_grad(self):
        return torch.enable_grad()

    def grad(self, outputs, inputs, grad_outputs, retain_graph: bool = False):
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True)
        if any(g is not None and g.layout != torch.strided for g in grads):
            raise RuntimeError("a sparse gradient (Embedding(sparse=True), say): a graph replays dense buffers; "
                               "use sparse=False for the graphed block")
        # Dense, as eager's .grad is: an expanded gradient (of w.sum(0), say) shares one element between
        # rows, and a buffer like that can be neither copied into nor handed out as a .grad.
        return [g if g is None or g.is_contiguous() else g.contiguous() for g in grads]

    def apply(self, block, graphs, tensors):
        return _ReplayStep.apply(block, graphs, *tensors)

    # -- parameters ------------------------------------------------------------------------------
    def trainable_parameters(self, module):
        return [p for p in module.parameters() if p.requires_grad]

    @staticmethod
    def trainable_flags(params) -> list:
        return [p.requires_grad for p in params]

    def all_parameters(self, module):
        return list(module.parameters())

    @staticmethod
    def snapshot_buffers(module):
        """Copies of the buffers (batch norm's running stats): a capture runs the forward, and its
        in-place updates of them must not count as a step."""
        with torch.no_grad():
            return [(b, b.clone()) for b in module.buffers()]

    @staticmethod
    def restore_buffers(snapshot) -> None:
        """Written through `.data`, which moves no version counter: an eager call of the block earlier in
        this step (a GAN discriminator's warm-up on real images, its backward pending while the call on
        fake ones captures) saved batch norm's running statistics for its backward, and eager's own
        updates of them (in the kernel) move none either, so a bump here would make that backward raise."""
        with torch.no_grad():
            for b, values in snapshot:
                b.data.copy_(values)

    def owned_tensors(self, module):
        """(owner dict, name, tensor) for every parameter and buffer, and every tensor a module holds as a
        plain attribute (tensor_attributes): replacing one shows in its owner."""
        out = []
        for sub in module.modules():
            for owner in (sub._parameters, sub._buffers):
                out.extend((owner, name, t) for name, t in owner.items() if t is not None)
        return out + self.tensor_attributes(module)

    @staticmethod
    def tensor_attributes(module):
        """(a module's __dict__, name, tensor) for every tensor a module holds as a plain attribute (a class
        weight, a mask), neither parameter nor buffer."""
        return [(sub.__dict__, name, t) for sub in module.modules()
                for name, t in sub.__dict__.items() if isinstance(t, torch.Tensor)]

    @contextlib.contextmanager
    def parameters_for_capture(self, module, params):
        """Within the block, `module` holds fresh Parameters over the same storage as `params` (a tied
        parameter stays tied); yields them in the order of `params`."""
        aliases = {id(p): torch.nn.Parameter(p.detach(), requires_grad=True) for p in params}
        swapped = []
        for sub in module.modules():
            owner = sub._parameters
            for name, p in owner.items():
                if p is not None and id(p) in aliases:
                    swapped.append((owner, name, p))
        try:
            for owner, name, p in swapped:
                owner[name] = aliases[id(p)]
            yield [aliases[id(p)] for p in params]
        finally:
            for owner, name, p in swapped:
                owner[name] = p

    def snapshot_grads(self, tensors):
        return [(t, t.grad, None if t.grad is None else t.grad.clone()) for t in tensors if t.is_leaf]

    def restore_grads(self, snapshot) -> None:
        with torch.no_grad():
            for t, grad, values in snapshot:
                if grad is None:
                    t.grad = None
                else:
                    if t.grad is not grad:
                        t.grad = grad
                    grad.copy_(values)

    # -- autocast and random state ---------------------------------------------------------------
    def amp_state(self):
        """Autocast, and the math mode (TF32, reduced-precision reductions, deterministic algorithms: a
        graph replays the kernels chosen at its capture), for the dispatch key."""
        if len(_math_changes) != self._math_seen:
            self._math_seen = len(_math_changes)
            self._math_id = self._math_ids.setdefault(math_mode.now(), len(self._math_ids))
        default = _default_dtype()  # a tensor the forward makes without a dtype takes it
        if not _any_autocast():  # one call on the common path instead of four
            return (self._math_id or None) if default is _float32 else (self._math_id, default)
        return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), self._math_id, default)

    def amp_cache_disabled(self):
        """Autocast caches the low-precision copies of weights for the length of a region. A graph that
        read a copy cached before its capture would keep reading it after the weights changed, so the
        cache is off while capturing: the casts become part of the graph."""
        return _amp_cache_off()

    def rng_state(self, module=None):
        """The default generators' states, and those of generators the module's submodules hold
        (`self.gen = torch.Generator(...)`): a capture's runs must not draw from any of them."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        own = [] if module is None else [(g, g.get_state()) for g in _generators(module)]
        return torch.get_rng_state(), cuda, own

    def set_rng_state(self, state) -> None:
        cpu, cuda, own = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for generator, saved in own:
            generator.set_state(saved)


def _generators(module, depth: int = 4) -> list:
    """The torch.Generator objects the module's submodules hold, also in lists, dicts and plain objects."""
    found, seen = [], set()

    def visit(obj, left):
        if id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found.append(obj)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, left - 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, left - 1)
        elif not isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes, int, float, type)):
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                for v in d.values():
                    visit(v, left - 1)

    skip = _MODULE_KEYS | {"forward"}  # nn.Module's own, and a graphed block's patched forward
    for sub in module.modules():
        for key, value in sub.__dict__.items():
            if key not in skip:
                visit(value, depth)
    return found


_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)


BRIDGE = TorchAutogradBridge()


def _running_stats_versions(module):
    """The version counters of the batch norms' running statistics in `module`. Eager's kernel updates
    them without moving their counters, where a traced forward writes them back with copy_, which moves
    them: an eager call of the block earlier in the step (a traced key's first call, a GAN
    discriminator's on real images, its backward pending) saved them, and its backward would raise."""
    if module is None:
        return ()
    held = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.batchnorm._NormBase):
            for t in (sub.running_mean, sub.running_var):
                if t is not None:
                    held.append((t, t._version))
    return held


_set_versions = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)  # tuples: torch >= 2.6


def _put_back_versions(held) -> None:
    moved = [(t, v) for t, v in held if t._version != v]
    if moved and _set_versions is not None:
        _set_versions(tuple(t for t, _ in moved), tuple(v for _, v in moved))


@contextlib.contextmanager
def _amp_cache_off():
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


_TRACES_PER_FORWARD = 64
