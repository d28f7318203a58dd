"""What a job's fingerprint sees: the globals a function reads, numpy arrays, slots, the model's hooks.

Each change below changes the numbers a job computes, so it must change the fingerprint
(the job is recomputed or refused), never leave it equal (old rows returned). That the
fingerprints are the same in every process (no ids, no hash-seeded orders) is shown by
``test_data_processes``: its job's model has a hook reading a global numpy array.
"""

from __future__ import annotations

import logging
import threading
from decimal import Decimal

import accelerate.hooks
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import tdhook_fn
import tdhook_fn.data
from tdhook_fn.attribution import saliency
from tdhook_fn.data._fingerprint import fingerprint

SCALE = 1.0  # read by the functions below: its value is part of their fingerprints
CLASS = 0
LOG = logging.getLogger("tdhook_fn.tests.fingerprint")


def scaled(out):
    return out["output"][..., 0] * SCALE


def through_a_helper(out):
    return scaled(out) + 1.0


def in_a_generator(out):  # SCALE is read by the generator's own code object
    return sum(v * SCALE for v in out["output"].unbind(-1))


def chosen(out):
    return out["output"][..., CLASS]


def logged(out):  # a logger and a lock are machinery, not inputs: named, never an error
    with LOCK:
        LOG.debug("target")
    return out["output"][..., 0]


LOCK = threading.Lock()


def test_the_globals_a_function_reads_are_part_of_its_fingerprint(monkeypatch):
    functions = (scaled, through_a_helper, in_a_generator)
    before = [fingerprint(fn) for fn in functions]
    assert [fingerprint(fn) for fn in functions] == before  # stable while nothing changes
    monkeypatch.setitem(globals(), "SCALE", 2.0)
    assert all(fingerprint(fn) != old for fn, old in zip(functions, before))
    monkeypatch.undo()
    assert [fingerprint(fn) for fn in functions] == before
    assert fingerprint(logged) == fingerprint(logged)


def test_a_changed_global_of_the_target_is_another_job(tmp_path, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    data = TensorDict(input=torch.randn(8, 4), batch_size=[8])
    run = lambda: tdhook_fn.data.attribute(saliency, f, p, data, tmp_path / "r", batch_size=4, target=chosen,
                                           progress=False)
    run()
    monkeypatch.setitem(globals(), "CLASS", 2)
    with pytest.raises(ValueError, match="argument target differ"):
        run()


def _columns(columns):
    return lambda out: out["output"][..., torch.as_tensor(columns)]


def test_numpy_arrays_are_described_by_their_values():
    base = fingerprint(_columns(np.array([0, 1])))
    assert fingerprint(_columns(np.array([0, 1]))) == base
    for other in (np.array([2, 2]), np.array([0, 1], dtype=np.int32), np.array([[0, 1]]), np.array([0, 1])[::-1]):
        assert fingerprint(_columns(other)) != base
    assert fingerprint(np.int64(3)) != fingerprint(np.int64(4))  # numpy scalars, read through __array__
    assert fingerprint(np.array([Decimal(1)], dtype=object)) != fingerprint(np.array([Decimal(2)], dtype=object))


class Window:
    __slots__ = ("start", "stop")

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop


class Shifted(Window):
    __slots__ = ("__by",)  # a private slot: stored under its mangled name

    def __init__(self, start: int, stop: int, by: int):
        super().__init__(start, stop)
        self.__by = by


def test_objects_without_a_dict_are_described_by_their_slots_or_what_pickle_stores():
    assert fingerprint(Window(0, 2)) == fingerprint(Window(0, 2))
    assert fingerprint(Window(0, 2)) != fingerprint(Window(1, 2))
    assert fingerprint(Shifted(0, 2, 1)) != fingerprint(Shifted(0, 2, 5))
    unset = Window.__new__(Window)
    assert fingerprint(unset) != fingerprint(Window(None, None))  # an unset slot is not None
    assert fingerprint(Decimal("1.5")) != fingerprint(Decimal("2.5"))
    assert fingerprint(1j) != fingerprint(2j)
    assert fingerprint(torch.Generator().manual_seed(1)) != fingerprint(torch.Generator().manual_seed(2))


def test_an_object_that_cannot_be_described_is_an_error(tmp_path):
    numbers = (i for i in range(3))
    with pytest.raises(TypeError, match="generator"):
        fingerprint(numbers)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    data = TensorDict(input=torch.randn(8, 4), batch_size=[8])
    with pytest.raises(TypeError, match="argument target: .*generator"):
        tdhook_fn.data.attribute(saliency, tdhook_fn.functional(model), tdhook_fn.params(model), data, tmp_path / "r",
                                 target=lambda out, n=numbers: out["output"][..., next(n)], progress=False)
    assert not (tmp_path / "r").exists()


def _hooks():
    """Ways to make a model compute something else without touching its parameters."""
    module_hooks = torch.nn.modules.module
    return {
        "forward hook": lambda net: net[0].register_forward_hook(lambda m, i, o: o * 100),
        "forward hook with kwargs": lambda net: net[0].register_forward_hook(lambda m, i, o: o * 100,
                                                                             with_kwargs=True),
        "forward pre-hook": lambda net: net.register_forward_pre_hook(lambda m, i: (i[0] * 2,)),
        "backward hook": lambda net: net[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,)),
        "global forward hook": lambda net: module_hooks.register_module_forward_hook(lambda m, i, o: o),
    }


@pytest.mark.parametrize("kind", list(_hooks()))
def test_the_hooks_a_model_runs_are_part_of_its_fingerprint(kind):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    f = tdhook_fn.functional(net)
    plain = fingerprint(f)
    handle = _hooks()[kind](net)
    hooked = fingerprint(f)
    handle.remove()
    assert hooked != plain and fingerprint(f) == plain
    handle = _hooks()[kind](net)  # the same hook registered anew: no handle ids in the fingerprint
    try:
        assert fingerprint(f) == hooked
    finally:
        handle.remove()
    if kind == "forward hook":  # another constant in the hook's code
        other = net[0].register_forward_hook(lambda m, i, o: o * 7)
        try:
            assert fingerprint(f) not in (plain, hooked)
        finally:
            other.remove()


class Scale(accelerate.hooks.ModelHook):
    def __init__(self, by: float):
        self.by = by

    def post_forward(self, module, output):
        return output * self.by


def test_an_accelerate_hook_is_part_of_its_modules_fingerprint():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    x = TensorDict(input=torch.randn(3, 2), batch_size=[3])
    accelerate.hooks.add_hook_to_module(net[0], Scale(2.0))
    two = fingerprint(f)
    accelerate.hooks.add_hook_to_module(net[0], Scale(3.0))
    assert fingerprint(f) != two
    torch.testing.assert_close(f(p, x)["output"], 3.0 * (x["input"] @ net[0].weight.T + net[0].bias))
    accelerate.hooks.add_hook_to_module(net, accelerate.hooks.AlignDevicesHook(io_same_device=True))
    aligned = fingerprint(f)
    f(p, x)  # the hook records the input's device as it runs: where tensors live, not what is computed
    assert fingerprint(f) == aligned
