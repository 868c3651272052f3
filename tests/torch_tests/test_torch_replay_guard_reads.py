"""Level >= 1 on torch: what the forward read through an object whose attribute reads run Python (a
Hugging Face config's __getattribute__) is taken out of Dynamo's guards and checked as dict reads
(backends/torch/guard_reads.py, dict_reads.Reads). Every change Dynamo's guards caught is still
caught: a value read, the object replaced, a name the forward asked for and did not find set on the
object or its class; what the forward never read changes nothing. Simulated graphs on CPU."""
import copy

import pytest
import torch

import graph_opt
from graph_opt.decorator import state_of
from graph_opt.watch.dict_reads import Reads
from graph_opt.watch.module_watch import GONE
from replay_support import HIDDEN, capture, captured_pair, pair, replays_as_eager

_CI_SECONDS = 2
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_INDUCTOR_ON_CPU = set()


class Settings:
    """A config whose every attribute read runs Python, as transformers' PreTrainedConfig does."""

    def __init__(self):
        self.scale = 2.0
        self.note = "unread"

    def __getattribute__(self, name):
        return super().__getattribute__(name)


class ReadsSettings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.settings = Settings()

    def forward(self, x):
        y = self.lin(x) * self.settings.scale
        if hasattr(self.settings, "shift"):  # absent at capture
            y = y + self.settings.shift
        return y


def _captured(F, level=1):
    return captured_pair(F, ReadsSettings, level)


_call = replays_as_eager


def _both(m, twin, change):
    for model in (m, twin):
        change(model)


def test_the_settings_reads_leave_dynamos_guards_and_the_captured_graph_replays(F):
    m, twin = _captured(F)
    reads = [r for _, r in state_of(m).runner.strategy._guards._reads.values()]
    # Before torch 2.12 Dynamo reads the value through object.__getattribute__ (C, no Python call): that
    # guard is taken out as a walked dict read (guard_paths.py), the hasattr one as a Python object's read.
    names = ["scale"]
    own = [[n for d, n in zip(r.dicts, r.names) if d is vars(m.settings)] for r in reads]
    assert reads and all(n == names for n in own), own
    assert all(("shift" in r.absent_names) for r in reads)
    _call(F, m, twin)
    assert graph_opt.stats(m).replays == 1 and not graph_opt.stats(m).fallback_reasons


@pytest.mark.parametrize("change", ["value", "type of the value", "object replaced", "name set on the object",
                                    "name set on the class"])
def test_a_change_of_what_the_forward_read_stops_replays_until_undone(F, change, graph_opt_warnings, monkeypatch):
    m, twin = _captured(F)
    originals = (m.settings, twin.settings)
    if change == "value":
        _both(m, twin, lambda model: setattr(model.settings, "scale", 3.0))
    elif change == "type of the value":
        _both(m, twin, lambda model: setattr(model.settings, "scale", 2))
    elif change == "object replaced":
        def replace(model):
            model.settings = copy.copy(model.settings)
            model.settings.scale = 5.0
        _both(m, twin, replace)
    elif change == "name set on the object":
        _both(m, twin, lambda model: setattr(model.settings, "shift", 1.0))
    else:
        monkeypatch.setattr(Settings, "shift", 1.0, raising=False)
    _call(F, m, twin)
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"guard": 1}, s.fallback_reasons
    said = [w for w in graph_opt_warnings() if "changed since capture" in w and
            ("ReadsSettings.settings" in w or "settings" in w and "Dynamo's guard" in w)]
    assert said, graph_opt_warnings()
    if change == "name set on the class":
        monkeypatch.undo()
    for model, original in zip((m, twin), originals):
        model.settings = original
        vars(original).pop("shift", None)
        original.scale = 2.0
    _call(F, m, twin, seed=2)
    assert graph_opt.stats(m).replays == 1, graph_opt.stats(m).fallback_reasons


def _shift_by_getattr(self, name):
    if name == "shift":
        return 1.0
    raise AttributeError(name)


def _scale_by_getattribute(self, name):
    return 5.0 if name == "scale" else object.__getattribute__(self, name)


CLASS_CHANGES = {
    "a __getattr__ set on the class": lambda mp: mp.setattr(Settings, "__getattr__", _shift_by_getattr,
                                                            raising=False),
    "a property set on the class": lambda mp: mp.setattr(Settings, "scale", property(lambda self: 5.0),
                                                         raising=False),
    "the class's __getattribute__ replaced": lambda mp: mp.setattr(Settings, "__getattribute__",
                                                                   _scale_by_getattribute),
}


@pytest.mark.parametrize("change", list(CLASS_CHANGES) + ["the object's __dict__ replaced"])
def test_a_change_of_how_the_object_answers_its_reads_stops_replays_until_undone(F, change, monkeypatch):
    """Dynamo's guard ran the class's __getattribute__; the dict reads standing for it see the class's
    lookup change (a property or __getattr__ added, __getattribute__ replaced) and the object's __dict__
    replaced (the dict read at capture is not written)."""
    m, twin = _captured(F)
    dicts = (vars(m.settings), vars(twin.settings))
    if change in CLASS_CHANGES:
        CLASS_CHANGES[change](monkeypatch)
    else:
        _both(m, twin, lambda model: setattr(model.settings, "__dict__", dict(vars(model.settings), scale=5.0)))
    _call(F, m, twin)
    s = graph_opt.stats(m)
    assert s.replays == 0 and s.fallback_reasons == {"guard": 1}, s.fallback_reasons
    monkeypatch.undo()
    for model, d in zip((m, twin), dicts):
        model.settings.__dict__ = d
    _call(F, m, twin, seed=2)
    assert graph_opt.stats(m).replays == 1, graph_opt.stats(m).fallback_reasons


class _AnswersShift:
    def __getattribute__(self, name):  # super() as Settings': the same one free variable, __class__
        if name == "shift":
            return 1.0
        return super().__getattribute__(name)


def test_the_classs_getattribute_given_other_code_stops_replays_until_undone(F, graph_opt_warnings):
    """The same __getattribute__ function object, its __code__ swapped: it now answers hasattr(settings,
    'shift') with True. No dict holds __code__; it is pinned with the function and compared through
    gc.get_referents (dict_reads.Reads._same_referents: no audit event per function)."""
    m, twin = _captured(F)
    reads = [r for _, r in graph_opt.decorator.state_of(m).runner.strategy._guards._reads.values()]
    assert any(name == "__code__" for r in reads for _, _, name, _ in r.ref_pins)
    fn = Settings.__dict__["__getattribute__"]
    code = fn.__code__
    _call(F, m, twin)
    fn.__code__ = _AnswersShift.__dict__["__getattribute__"].__code__
    try:
        _call(F, m, twin, seed=2)
        s = graph_opt.stats(m)
        assert s.fallback_reasons == {"guard": 1}, s.fallback_reasons
        assert any("__getattribute__.__code__" in w for w in graph_opt_warnings()), graph_opt_warnings()
    finally:
        fn.__code__ = code
    _call(F, m, twin, seed=3)
    assert graph_opt.stats(m).replays == 2, graph_opt.stats(m).fallback_reasons


def test_reads_through_a_walked_object_that_runs_python_name_its_place():
    """What a change's message names: the object's place (`settings.__getattribute__.__code__ (on class
    Settings)`), for reads recorded by a walk of Dynamo's source as for the others."""
    from graph_opt.backends.torch import guard_paths
    from graph_opt.backends.torch.guard_reads import _Steps

    holder = torch.nn.Module()
    holder.settings = Settings()
    steps = _Steps(holder, {})
    steps._add_walked(guard_paths.walk("object.__getattribute__(self.settings, 'scale')", holder, {}))
    places = [w for w, o, *_ in [*steps.owners.values(), *steps.classes.values(), *steps.pinned.values()]
              if o is holder.settings or getattr(o, "__qualname__", "").startswith("Settings.")]
    assert places and all(w.startswith("settings.") for w in places), places


def test_a_settings_attribute_the_forward_never_read_changes_nothing(F):
    m, twin = _captured(F)
    _both(m, twin, lambda model: setattr(model.settings, "note", "changed"))
    _both(m, twin, lambda model: setattr(model.settings, "added", 7))
    _call(F, m, twin)
    s = graph_opt.stats(m)
    assert s.replays == 1 and not s.fallback_reasons, s.fallback_reasons


def test_a_change_kept_by_capturing_again_is_traced_anew(F):
    """Dynamo's cache no longer checks the reads taken out: a capture after a change traces anew rather
    than reuse the trace that baked the old value."""
    m, twin = _captured(F)
    _both(m, twin, lambda model: setattr(model.settings, "scale", 3.0))
    graph_opt.clear_graphs(m)
    translations = graph_opt.stats(m).translations
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    assert graph_opt.stats(m).translations > translations
    _call(F, m, twin)
    assert graph_opt.stats(m).replays == 1, graph_opt.stats(m).fallback_reasons


def test_unguarded_replays_take_nothing_out_and_check_nothing(F):
    m, twin = pair(F, ReadsSettings, 1, config=dict(guarded_replays=False))
    capture(F, m, lambda n: F.randn(n, HIDDEN, seed=n))
    _call(F, m, twin)
    assert graph_opt.stats(m).replays == 1


def test_reads_compare_values_by_type_and_sign_objects_by_identity_and_names_by_presence():
    class Holder:
        pass

    obj, d = Holder(), {"k": Holder()}
    obj.z = 0.0
    reads = Reads(hops=[("d.k", d, "k", d["k"])], values=[("obj.z", vars(obj), "z", 0.0)],
                  absent=[("obj.gone", vars(obj), "gone")], present=[("Holder.x", {"x": 1}, "x")],
                  classes=[("obj.__class__", obj, Holder)])
    assert not reads.differs() and reads.first_change() is None
    obj.z = -0.0
    assert reads.differs() and reads.first_change() == ("obj.z", -0.0, 0.0)
    obj.z = 0
    assert reads.differs()
    obj.z = 0.0
    obj.gone = 1
    assert reads.differs() and reads.first_change() == ("obj.gone", 1, GONE)
    del obj.gone
    d["k"] = Holder()  # another object at a step on the way: not the one at capture
    assert reads.differs() and reads.first_change()[0] == "d.k"


def test_reads_with_dict_versions_see_every_write_and_look_again_only_after_one():
    """Before Python 3.12 each dict's version is compared; from 3.12 one dict watcher answers for all."""
    from graph_opt.backends.torch.guard_reads import dict_version
    from graph_opt.watch import dict_watch

    class Holder:
        pass

    obj = Holder()
    obj.scale = 2.0
    d = vars(obj)
    reads = Reads(hops=[], values=[("obj.scale", d, "scale", 2.0)], absent=[("obj.shift", d, "shift")],
                  present=[], classes=[("obj.__class__", obj, Holder)])
    looked = []
    full = reads._differs
    reads._differs = lambda: looked.append(1) or full()
    reads.versioned(dict_version, [d])
    assert not reads.differs() and not reads.differs()
    assert len(looked) == 1  # the second call: no dict moved
    assert callable(reads._seen) == dict_watch.can_watch()  # the watcher where there is one
    obj.other = 1  # a write the forward never read: looked at again, still holds
    assert not reads.differs() and len(looked) == 2
    obj.scale = 3.0
    assert reads.differs() and reads.differs() and len(looked) == 4
    obj.scale = 2.0
    assert not reads.differs()
    obj.__class__ = type("Other", (Holder,), {})  # no dict write: compared at every call
    assert reads.differs()


def test_reads_see_a_dict_on_the_way_replaced_though_no_dict_read_moved():
    """`holder.__dict__ = {...}` writes none of the dicts read at capture: each object whose __dict__ a
    read went through is compared with that dict, with and without the dict versions' fast path."""
    from graph_opt.backends.torch.guard_reads import dict_version

    class Holder:
        pass

    holder = Holder()
    holder.scale = 2.0
    d = vars(holder)
    for fast in (False, True):
        reads = Reads(hops=[], values=[("holder.scale", d, "scale", 2.0)], absent=[], present=[],
                      owners=[("holder.__dict__", holder, d)])
        if fast:
            reads.versioned(dict_version, [d])
        assert not reads.differs() and not reads.differs()
        holder.__dict__ = {"scale": 5.0}
        assert reads.differs() and reads.first_change()[0] == "holder.__dict__"
        holder.__dict__ = d
        assert not reads.differs()



class _ModeBase:
    def __init__(self):
        self._mode = "double"
        self.renamed = {}  # names the class's __getattribute__ reads elsewhere (a wrapper's overrides)

    def __getattribute__(self, name):
        renamed = super().__getattribute__("renamed")
        return super().__getattribute__(renamed.get(name, name))

    @property
    def mode(self):  # returns an attribute as it is, as transformers' config properties do
        return self._mode


class ModeSettings(_ModeBase):
    pass


class ReadsMode(torch.nn.Module):
    """Reads a config's property: torch before 2.12 guards the property's value (its getter and the
    class's __getattribute__ run at every check), later ones what the inlined getter read (the getter,
    `dict(type(settings).__dict__)['mode'].fget`, taken out of Dynamo's tree with the property holding it)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.settings = ModeSettings()

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if self.settings.mode == "double" else y


def _returns_other(self):
    return self.other


PROPERTY_CHANGES = {
    "the attribute it returns": lambda m, mp: setattr(m.settings, "_mode", "half"),
    "the name renamed by the class's __getattribute__": lambda m, mp: m.settings.renamed.update(_mode="other"),
    "the property replaced on its class": lambda m, mp: mp.setattr(_ModeBase, "mode", property(_returns_other)),
    "a property set on the object's own class": lambda m, mp: mp.setattr(ModeSettings, "mode",
                                                                       property(_returns_other), raising=False),
    "the getter's code swapped": lambda m, mp: mp.setattr(_ModeBase.__dict__["mode"].fget, "__code__",
                                                          _returns_other.__code__),
}


@pytest.mark.parametrize("change", list(PROPERTY_CHANGES))
def test_a_change_behind_a_config_property_stops_replays_until_undone(F, change, monkeypatch):
    m, twin = captured_pair(F, ReadsMode, 1)
    if _TORCH >= (2, 12):
        reads = [r for _, r in state_of(m).runner.strategy._guards._reads.values()]
        assert any(name == "fget" for r in reads for _, _, name, _ in r.pinned), "the getter left with Dynamo"
    for model in (m, twin):
        model.settings.other = "half"
    _call(F, m, twin)
    vars(m.settings)["mode"] = "ignored"  # the property wins over the instance's own entry: nothing changes
    _call(F, m, twin, seed=2)
    assert graph_opt.stats(m).replays == 2 and not graph_opt.stats(m).fallback_reasons
    for model in (m, twin):
        PROPERTY_CHANGES[change](model, monkeypatch)
    _call(F, m, twin, seed=3)  # eager's answer, not the captured branch
    s = graph_opt.stats(m)
    assert s.replays == 2 and s.fallback_reasons == {"guard": 1}, s.fallback_reasons
    monkeypatch.undo()
    for model in (m, twin):
        model.settings._mode = "double"
        model.settings.renamed.clear()
    _call(F, m, twin, seed=4)
    assert graph_opt.stats(m).replays == 3, graph_opt.stats(m).fallback_reasons


def test_a_property_given_another_getter_in_place_stops_replays_until_undone(F):
    """property.__init__ run again on the class's property object: the same property, another getter. (Not
    compared with eager: CPython 3.12 itself may keep calling the old getter where it specialized the read.)"""
    m, _ = captured_pair(F, ReadsMode, 1)
    prop = _ModeBase.__dict__["mode"]
    getter = prop.fget
    x = F.randn(3, HIDDEN, seed=1)
    with F.no_grad():
        m(x)
        prop.__init__(_returns_other)
        m.settings.other = "half"
        try:
            m(x)
            assert graph_opt.stats(m).fallback_reasons == {"guard": 1}, graph_opt.stats(m).fallback_reasons
        finally:
            prop.__init__(getter)
        m(x)
    assert graph_opt.stats(m).replays == 2, graph_opt.stats(m).fallback_reasons
