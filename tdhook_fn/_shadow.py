"""Private structural copies of a model, so that calls never touch the model itself."""

# NOTE [shadow modules]
# ``torch.func.functional_call`` swaps tensors on the module it is given while it runs: two
# threads calling one model with different parameters see each other's tensors, and an
# exception at the wrong time leaves the model changed. Instead every call runs on a
# *shadow*: an instance of each submodule's class whose ``__dict__`` is refreshed from the
# original's before each call, except for its own ``_parameters``, ``_buffers``, ``_modules``
# and hook dictionaries. Values in it that refer back to the model (bound methods, partials,
# back-references: accelerate's hooks) are rebound to the shadows (NOTE [rebinding]). The
# caller's tensors are put in the shadow's slots for the duration of the call, and
# everything copied from the model is dropped afterwards.
#
# Shadows are pooled per model; one shadow serves one call at a time, so hooks registered on
# it by taps are invisible to every other call. A change to the model's structure (a
# submodule or parameter replaced or added) is seen at the next call, which then builds a
# new shadow; mode flags and other attributes (``training``, ``dropout.p``) are read from
# the model on every call.
#
# NOTE [shadows hold the model weakly]
# The pool is keyed weakly by the model, and an idle shadow keeps no strong reference to
# anything of the model (its nodes hold weak references, its ``__dict__`` is emptied down
# to its own slots after each call). Otherwise a model that refers to itself (a bound
# method as a hook, a child holding its parent) would be kept alive by its own pool entry.
#
# NOTE [pure buffers]
# The caller's params are never written. A forward may update buffers in place (BatchNorm's
# running statistics in training mode, counters): buffers are cloned for each call (they are
# small next to the parameters), so the forward computes what its mode computes and the
# updates are dropped with the copies. Parameters are used as given, never copied.
# A forward that replaces one of its *parameters* while it runs (accelerate's offloading
# hooks load weights from their own store) would silently ignore the given params, so it
# raises after the forward.
#
# NOTE [held tensors]
# A parameter or buffer of the model held outside its slots, in a plain dict, list or
# tuple attribute (a hand-rolled tie: ``self.tied = {"w": self.lin.weight}``) or as a
# plain tensor attribute (``self.alias = self.buf``), is replaced in the shadow's copy of
# that attribute by the call's tensor for its key, after the load: the forward computes
# with the given params and gradients reach their keys. A traced call (``_traced``) cannot
# do this and refuses such a model.
#
# NOTE [cached parametrizations]
# Inside ``torch.nn.utils.parametrize.cached()`` a parametrized weight is computed once and
# kept in torch's cache under ``(id(module), name)``, where ``module`` is the *model's*
# module: its shadow's property uses the same key. A call with other params would read the
# weight another call (or the model's own forward) left there, and leave its own for the
# next. So a call sets the model's entries aside when it borrows the shadow and puts them
# back when it returns it, dropping what it cached itself: within the call the cache works.

from __future__ import annotations

import itertools
import operator
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import chain
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._params import Key
from ._paths import PathError
from ._pool_layout import shadow_class
from ._reach import SCALARS
from ._rebind import Rebinder, RebindError, storage_start
from ._shadow_node import GLOBAL_HOOK_DICTS, HOOK_DICTS, Node, Slot, shape_of

__all__ = [
    "GLOBAL_HOOK_DICTS",
    "HOOK_DICTS",
    "Shadow",
    "param_marks",
    "private_buffer",
    "raise_key_mismatch",
    "raise_shape_mismatch",
    "shadow_lock",
    "shape_mismatch",
]

_ABSENT = itertools.repeat(object())  # the default of a missing attribute: no scalar
_hook_dicts = operator.itemgetter(*HOOK_DICTS)


class Shadow:
    """A private copy of a model's module tree with empty tensor slots.

    Use `shadow_of` to borrow one.
    """

    def __init__(self, model: nn.Module, fast_pooling: bool = False):
        self.fast_pooling = fast_pooling
        self.nodes: list[Node] = []
        self.by_id: dict[int, nn.Module] = {}  # id(original submodule) -> shadow
        self.node_of: dict[int, Node] = {}
        names = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        self.root = self._copy(model, names)
        self.keys: set[Key] = set()
        canonical: dict[int, Key] = {}  # id(the model's tensor) -> its key
        storages: dict[int, Key] = {}  # where a parameter's memory starts -> its key (views of it: NOTE [held tensors])
        for prefix, module in model.named_modules(remove_duplicate=False):
            node = self.node_of[id(module)]
            for kind, slots in (("_parameters", node.params), ("_buffers", node.buffers)):
                for name, tensor in module.__dict__[kind].items():
                    if tensor is None:
                        continue
                    key = canonical.setdefault(id(tensor), tuple(f"{prefix}.{name}".lstrip(".").split(".")))
                    if kind == "_parameters" and storage_start(tensor):
                        storages.setdefault(storage_start(tensor), key)
                    self.keys.add(key)
                    slots.append((node.own[kind], name, key, shape_of(tensor)))
        self.param_slots = [slot for node in self.nodes for slot in node.params]
        self.param_keys = [key for _, _, key, _ in self.param_slots]
        self.buffer_slots = [slot for node in self.nodes for slot in node.buffers]
        self.slots_of: dict[Key, list[Slot]] = {}
        for slot in (*self.param_slots, *self.buffer_slots):
            self.slots_of.setdefault(slot[2], []).append(slot)
        self.rebinder = Rebinder(self.by_id, {type(m) for m in model.modules()}, names, canonical, storages)
        self.pending: list[Node] = []  # nodes with plain container attributes, this call (NOTE [private containers])
        # torch's cache keys of the model's parametrized tensors; what a call set aside (NOTE [cached parametrizations])
        self.cache_keys = [(id(module), name) for module in model.modules() if parametrize.is_parametrized(module)
                           for name in cast(nn.ModuleDict, module.parametrizations)]
        self.set_aside: dict[tuple[int, str], Any] | None = None

    def _copy(self, module: nn.Module, names: dict[int, str]) -> nn.Module:
        if id(module) in self.by_id:  # a submodule used twice keeps one shadow
            return self.by_id[id(module)]
        kind = shadow_class(module) if self.fast_pooling else type(module)
        shadow = kind.__new__(kind)
        self.by_id[id(module)] = shadow
        state = module.__dict__
        own: dict[str, Any] = {
            "_parameters": dict.fromkeys(state["_parameters"]),
            "_buffers": dict.fromkeys(state["_buffers"]),
            "_modules": {n: None if m is None else self._copy(m, names) for n, m in state["_modules"].items()},
        }
        own.update((name, OrderedDict()) for name in HOOK_DICTS)
        shadow.__dict__.update(own)
        node = Node(module, shadow, own, names.get(id(module), ""))
        self.nodes.append(node)
        self.node_of[id(module)] = node
        return shadow

    def is_current(self) -> bool:
        """Whether the model's structure is the one this shadow was built from (`signature_of` of every module)."""
        for node in self.nodes:  # (signature_of inline: this runs per module on every call)
            module = node.module()
            if module is None:
                return False
            state = module.__dict__
            mods, params, bufs = state["_modules"], state["_parameters"], state["_buffers"]
            if node.signature != (type(module), *mods, *map(id, mods.values()), None, *params,
                                  *map(id, params.values()), None, *bufs, *map(id, bufs.values())):
                return False
        return True

    def refresh(self, check: bool = False) -> bool:
        """Fill every shadow module from its original for one call (NOTE [shadow modules]).

        ``check``: first see, module by module, that the model's structure is the one this
        shadow was built from (`is_current`, in the same loop); where it is not, nothing is
        left filled and this returns False (build a new shadow). One loop over the modules,
        not a call per module: on a small model that call costs as much as the work.
        """
        seen: dict[int, Any] = {}  # objects walked by this refresh's checks without reaching the model
        rebinder = self.rebinder
        suspects = rebinder.suspects
        self.pending = []
        for node in self.nodes:
            module = node.module()
            if module is None:
                assert check, "the caller holds the model"
                self.unload()
                return False
            original = module.__dict__
            if check:  # (signature_of, inline, as in is_current: its class, names, then ids, in two tuples)
                mods, params, bufs = original["_modules"], original["_parameters"], original["_buffers"]
                if (type(module) is not node.kind or node.names_seen != (*mods, None, *params, None, *bufs)
                        or node.ids_seen != tuple(map(id, chain(mods.values(), params.values(), bufs.values())))):
                    self.unload()
                    return False
            state = node.shadow.__dict__
            state.clear()
            state.update(original)
            try:
                hooked = any(_hook_dicts(original))  # (mostly none: one pass in C)
            except KeyError:  # (a module missing one of them)
                hooked = any(map(original.get, HOOK_DICTS))
            if hooked:
                node.copy_hooks(rebinder, original, seen)
            state.update(node.own)
            if "_non_persistent_buffers_set" in original:  # register_buffer writes it (NOTE [registered while running])
                state["_non_persistent_buffers_set"] = set(original["_non_persistent_buffers_set"])
            # checked again where anything changed (NOTE [checked attributes]); where nothing did, what the last check
            # saw of the attributes' types (whether any may refer back to the model) still holds
            changed = (len(original) != node.size
                       or (node.watch and tuple(map(id, map(original.get, node.watch))) != node.watched)
                       or not SCALARS.issuperset(map(type, map(original.get, node.scalars, _ABSENT)))
                       or (node.refs and not all(ref() is not None for ref in node.refs)))
            if changed or node.suspect:
                if not suspects.isdisjoint(map(type, original.values())):
                    rebinder.rebind_all(state, original, node.path, "attribute ")  # own slots are dicts: never rebound
            if "gradient_checkpointing" in original or "_hf_hook" in original:
                node.refuse_unrunnable(original)
            if changed:
                node.check(rebinder, original, state, seen)
            if node.containers:
                node.copy_containers(rebinder, original, state)
            if node.containers or node.tensor_holders:  # filled after the load (NOTE [held tensors])
                self.pending.append(node)
        return True

    def set_cache_aside(self) -> None:
        """Take the model's entries out of torch's parametrization cache for one call; `unload` puts them back
        (NOTE [cached parametrizations])."""
        cache = parametrize._cache
        self.set_aside = {key: cache.pop(key) for key in self.cache_keys if key in cache}

    def _fill_held(self) -> None:
        """Point attributes holding the model's tensors at the call's tensors (NOTE [held tensors])."""
        keys = self.rebinder.tensor_keys

        def current(tensor: torch.Tensor) -> Any:
            slots, name, _, _ = self.slots_of[keys[id(tensor)]][0]
            return slots[name]

        for node in self.pending:
            original = node.original()
            assert original is not None
            state = node.shadow.__dict__
            for name in dict.fromkeys((*node.containers, *node.tensor_holders)):  # (bare tensor attributes too)
                if type(original[name]) is not set:
                    state[name] = self.rebinder.held_copy(original[name], node.path, name, current)

    def refuse_held(self) -> None:
        """Raise if an attribute holds the model's tensors: a traced call cannot point it at the params.

        Raises:
            RebindError: naming the module and the attribute.
        """
        for node in self.pending:
            original = node.original()
            assert original is not None
            held = [name for name in dict.fromkeys((*node.containers, *node.tensor_holders))
                    if self.rebinder.holds(original[name], node.path, name, {})[1]]
            if not held:
                continue
            raise RebindError(
                f"module {node.path or '<root>'!r}: its attribute {held[0]!r} holds a parameter or "
                "buffer of the model outside its registered slots, which a call under torch.compile cannot point at "
                "the params you gave. Register the tensor (a tied parameter as a parameter of the module) or call "
                "without torch.compile")

    def load(self, values: dict[Key, torch.Tensor]) -> None:
        """Put ``values`` in the slots; the keys and shapes must be exactly the model's.

        Buffers get private copies for the call (NOTE [pure buffers]).
        """
        if len(values) != len(self.keys) or not self.keys.issuperset(values):
            raise_key_mismatch(self.keys, set(values))
        wrong: list[str] = []
        for slots, name, key, shape in self.param_slots:
            value = slots[name] = values[key]
            if shape is not None and value.shape != shape:  # (shape_mismatch's test, inline: this runs per tensor)
                wrong += shape_mismatch(key, value, shape)
        copies: dict[Key, Any] = {}
        for slots, name, key, shape in self.buffer_slots:
            value = values[key]
            wrong += shape_mismatch(key, value, shape)
            slots[name] = private_buffer(copies, key, value)
        if wrong:
            self.unload()
            raise_shape_mismatch(wrong)
        if self.pending:
            self._fill_held()

    def load_own(self) -> None:
        """Put the model's own tensors in the slots (live: gradients and in-place updates reach it)."""
        for node in self.nodes:
            original = node.original()
            assert original is not None
            for kind, slots in (("_parameters", node.params), ("_buffers", node.buffers)):
                theirs = original[kind]
                for own, name, _, _ in slots:
                    own[name] = theirs[name]
        if self.pending:
            self._fill_held()

    def override(self, values: dict[Key, torch.Tensor]) -> None:
        """Put ``values`` in the slots of their keys, over what `load_own` put there.

        For a caller that runs the model's own tensors but a few replaced (compat's
        replacements, `compat.modules._scope`): the keys are the model's, the shapes must match.
        """
        for key, value in values.items():
            slots = self.slots_of.get(key)
            if slots is None:
                raise ValueError(f"overrides name {'.'.join(key)!r}, which is not a parameter or buffer of the model")
            for own, name, _, shape in slots:
                if shape is not None and value.shape != shape:
                    raise ValueError(
                        f"override {'.'.join(key)!r} has shape {tuple(value.shape)}, the model has {tuple(shape)}")
                own[name] = value
        if self.pending:
            self._fill_held()

    def check_params_kept(self, values: dict[Key, torch.Tensor], marks: dict[Key, tuple[int, int]]) -> None:
        """Raise if the forward replaced one of the given parameters (NOTE [pure buffers]), or wrote one.

        ``marks`` are `param_marks` of ``values`` before the call.
        """
        for slots, name, key, _ in self.param_slots:
            if slots[name] is not values[key]:
                raise RuntimeError(
                    f"module {'.'.join(key[:-1]) or '<root>'!r} replaced its parameter {name!r} while it ran, so it "
                    "did not compute with the params you gave (an accelerate offloading hook, or a forward assigning "
                    "to the parameter, does this). Remove the hook (accelerate.hooks.remove_hook_from_module) or load "
                    "the model without offloading"
                )
        for key, mark in marks.items():
            value = values[key]
            if (value._version, value.data_ptr()) != mark:
                raise RuntimeError(
                    f"module {'.'.join(key[:-1]) or '<root>'!r} wrote its parameter {key[-1]!r} while it ran (a "
                    "forward that clamps or renormalises its weights in place, or assigns to .data): the params you "
                    "gave were changed, and with them the model's own tensors where they share memory (as "
                    "tdhook_fn.params does). Constrain the weights outside the forward, e.g. with "
                    "torch.nn.utils.parametrize, or after an optimizer step"
                )

    def unload(self) -> None:
        """Empty the slots, and drop what each module copied from the original or the forward registered
        (NOTE [registered while running]); keep the shadow's own (emptied) slots."""
        if self.set_aside is not None:  # (NOTE [cached parametrizations])
            cache = parametrize._cache
            for key in self.cache_keys:
                cache.pop(key, None)
            cache.update(self.set_aside)
            self.set_aside = None
        for slots, name, _, _ in self.param_slots:
            slots[name] = None
        for slots, name, _, _ in self.buffer_slots:
            slots[name] = None
        for node in self.nodes:  # (one loop, not a call per module: this runs on every call)
            state = node.shadow.__dict__
            state.clear()
            if any(node.hooks):
                for hooks in node.hooks:
                    hooks.clear()
            params, buffers, modules = node.slots
            if len(params) + len(buffers) != node.size_slots or modules != node.children:
                node.restore_slots()
            state.update(node.own)

    def module_for(self, original: Any, path: str) -> nn.Module:
        shadow = self.by_id.get(id(original))
        if shadow is None:
            raise PathError(
                f"path {path!r} resolves to a {type(original).__name__}, not to a submodule of "
                "the model that its forward calls"
            )
        return shadow


def param_marks(values: dict[Key, Any], keys: Sequence[Key]) -> dict[Key, tuple[int, int]]:
    """The version and storage of each given parameter among ``keys``, to see a forward writing it.

    Not for tensors a functorch transform wraps (they have no storage of their own; the
    params are constants of the methods' transforms, so those are seen).
    """
    marks: dict[Key, tuple[int, int]] = {}
    if torch._C._functorch.peek_interpreter_stack() is None:  # (no transform: nothing is wrapped)
        for key in keys:  # (a loop, the mark inline: a comprehension or a call per tensor costs, on every call)
            value = values[key]
            marks[key] = value._version, value.data_ptr()
        return marks
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for key in keys:
        value = values[key]
        if isinstance(value, torch.Tensor) and not wrapped(value):
            marks[key] = value._version, value.data_ptr()
    return marks


def shape_mismatch(key: Key, value: Any, shape: torch.Size | None) -> list[str]:
    """``[description]`` if ``value`` is not shaped as the model's slot, else ``[]``."""
    if shape is None or value.shape == shape:
        return []
    return [f"{'.'.join(key)}: {tuple(value.shape)}, the model has {tuple(shape)}"]


def raise_shape_mismatch(wrong: list[str]) -> None:
    raise ValueError(f"params do not match the model's shapes: {'; '.join(wrong)}")


def private_buffer(copies: dict[Key, Any], key: Key, value: Any) -> Any:
    """The call's copy of buffer ``key`` (NOTE [pure buffers]); a buffer shared by two modules stays shared."""
    if key not in copies:
        copies[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return copies[key]


def raise_key_mismatch(expected: set[Key], given: set[Key]) -> None:
    def names(keys: set[Key]) -> list[str]:
        return sorted(".".join(k) for k in keys)

    missing, extra = names(expected - given), names(given - expected)
    raise ValueError(f"params do not match the model: missing {missing}, unexpected {extra}")


shadow_lock = threading.Lock()  # guards the pools of shadows (`shadow_of`) and of traced plans
