"""Private structural copies of a model, so that calls never touch the model itself.

# NOTE [shadow modules]
``torch.func.functional_call`` swaps tensors on the module it is given while it runs: two
threads calling one model with different parameters see each other's tensors, and an
exception at the wrong time leaves the model changed. Instead every call runs on a
*shadow*: an instance of each submodule's class whose ``__dict__`` is refreshed from the
original's before each call, except for its own ``_parameters``, ``_buffers``, ``_modules``
and hook dictionaries. Values in it that refer back to the model (bound methods, partials,
back-references: accelerate's hooks) are rebound to the shadows (NOTE [rebinding]). The
caller's tensors are put in the shadow's slots for the duration of the call, and
everything copied from the model is dropped afterwards.

Shadows are pooled per model; one shadow serves one call at a time, so hooks registered on
it by taps are invisible to every other call. A change to the model's structure (a
submodule or parameter replaced or added) is seen at the next call, which then builds a
new shadow; mode flags and other attributes (``training``, ``dropout.p``) are read from
the model on every call.

# NOTE [shadows hold the model weakly]
The pool is keyed weakly by the model, and an idle shadow keeps no strong reference to
anything of the model (its nodes hold weak references, its ``__dict__`` is emptied down
to its own slots after each call). Otherwise a model that refers to itself (a bound
method as a hook, a child holding its parent) would be kept alive by its own pool entry.

# NOTE [pure buffers]
The caller's params are never written. A forward may update buffers in place (BatchNorm's
running statistics in training mode, counters): buffers are cloned for each call (they are
small next to the parameters), so the forward computes what its mode computes and the
updates are dropped with the copies. Parameters are used as given, never copied.
A forward that replaces one of its *parameters* while it runs (accelerate's offloading
hooks load weights from their own store) would silently ignore the given params, so it
raises after the forward.

# NOTE [registered while running]
What a forward registers on its shadow (``register_buffer`` in a lazy cache, a parameter,
a submodule, a hook) or assigns to it lives for that call only: on release the shadow's
own slots get back the names and children they had when it was built, its hook
dictionaries are emptied, and its ``__dict__`` (where plain assignments land) is dropped.
``_non_persistent_buffers_set``, which ``register_buffer`` writes, is a private copy of
the original's for each call, so the model is never written.

# NOTE [held tensors]
A parameter or buffer of the model held outside its slots, in a plain dict, list or
tuple attribute (a hand-rolled tie: ``self.tied = {"w": self.lin.weight}``) or as a
plain tensor attribute (``self.alias = self.buf``), is replaced in the shadow's copy of
that attribute by the call's tensor for its key, after the load: the forward computes
with the given params and gradients reach their keys. A traced call (``_traced``) cannot
do this and refuses such a model.

# NOTE [checked attributes]
Each module's attributes (and hooks) are checked, after rebinding, for what still
reaches the model (NOTE [reaching the model]) and for the containers to copy, when the
shadow is first used and again only when they change: a name added or removed, a value
that is not a scalar replaced (by id, and by a weak reference where it has one, so a
new object that got a dead one's id is seen), or a scalar replaced by an object. A
hook dict is checked again when its handles or hooks change. So an ordinary call pays a
length and a few ids per module. Not seen: an object *mutated* in place after it was
checked (an attribute of it assigned anew to point at a module).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ._params import Key
from ._paths import PathError
from ._reach import SCALARS
from ._rebind import Rebinder, RebindError

__all__ = [
    "HOOK_DICTS",
    "Shadow",
    "private_buffer",
    "raise_key_mismatch",
    "raise_shape_mismatch",
    "shadow_of",
    "shape_mismatch",
]

# Hook dictionaries a forward consults; the shadow gets its own copies.
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in HOOK_DICTS  # torch's hooks for every module
                          if name != "_forward_pre_hooks_with_kwargs")  # (which has no global one)
_OWN_SLOTS = frozenset({"_parameters", "_buffers", "_modules", *HOOK_DICTS})
# what the checks of NOTE [checked attributes] skip: the own slots, and what no forward runs
_UNSCANNED = _OWN_SLOTS | {"_non_persistent_buffers_set", "_state_dict_hooks", "_state_dict_pre_hooks",
                           "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
_POOL_SIZE = 16
_ABSENT = itertools.repeat(object())  # the default of a missing attribute: no scalar

# (the shadow's slot dict, the name in it, the params key, the expected shape or None)
Slot = tuple[dict[str, Any], str, Key, "torch.Size | None"]


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """What a shadow's structure depends on: the class (a shadow is made of it: ``__class__``
    assigned anew needs a new shadow), names and identities of children and tensors."""
    state = module.__dict__
    mods, params, bufs = state["_modules"], state["_parameters"], state["_buffers"]
    return (type(module), *mods, *map(id, mods.values()), None, *params, *map(id, params.values()), None, *bufs,
            *map(id, bufs.values()))


def _offloads(hook: Any) -> bool:
    """Whether an accelerate hook (or one of a ``SequentialHook``'s) offloads its module's weights."""
    return getattr(hook, "offload", False) is True or any(_offloads(h) for h in getattr(hook, "hooks", ()) or ())


def _shape(tensor: torch.Tensor) -> torch.Size | None:
    return None if isinstance(tensor, nn.parameter.UninitializedTensorMixin) else tensor.shape  # type: ignore[attr-defined]


class _Node:
    """One original module (held weakly), its shadow and the shadow's own state."""

    __slots__ = ("buffers", "children", "holders", "hooks", "hooks_checked", "module", "names", "own", "params",
                 "path", "refs", "scalars", "shadow", "signature", "size", "size_slots", "slots", "tensor_holders",
                 "watch", "watched")

    def __init__(self, module: nn.Module, shadow: nn.Module, own: dict[str, Any], path: str):
        self.module = weakref.ref(module)
        self.shadow = shadow
        self.own = own
        self.path = path
        self.signature = _signature(module)
        self.params: list[Slot] = []
        self.buffers: list[Slot] = []
        self.hooks = tuple(own[name] for name in HOOK_DICTS)
        self.children = dict(own["_modules"])
        self.slots = (own["_parameters"], own["_buffers"], own["_modules"])
        self.names = (tuple(own["_parameters"]), tuple(own["_buffers"]))
        self.size_slots = len(own["_parameters"]) + len(own["_buffers"])
        # what the attributes were when last checked (NOTE [checked attributes])
        self.size = -1  # how many
        self.watch: tuple[str, ...] = ()  # the names of those that are not scalars,
        self.watched: tuple[int, ...] = ()  # their ids,
        self.refs: tuple[weakref.ref[Any], ...] = ()  # weak references to those that have them,
        self.scalars: tuple[str, ...] = ()  # and the names of the scalars (bool, int, float, str, None)
        self.hooks_checked: dict[str, tuple[tuple[Any, ...], tuple[int, ...]]] = {}
        self.holders: tuple[str, ...] = ()  # plain containers and tensors copied for each call
        self.tensor_holders: tuple[str, ...] = ()  # those holding the model's tensors (NOTE [held tensors])

    def original(self) -> dict[str, Any] | None:
        module = self.module()
        return None if module is None else module.__dict__

    def is_current(self) -> bool:
        module = self.module()
        return module is not None and _signature(module) == self.signature

    def refresh(self, rebinder: Rebinder, seen: dict[int, Any]) -> bool:
        """Fill the shadow from the original; whether it holds tensors of the model to fill after the load."""
        original = self.original()
        assert original is not None  # the caller holds the model
        state = self.shadow.__dict__
        state.clear()
        state.update(original)
        own = self.own
        for name in HOOK_DICTS:  # the model's own hooks still run, on a private copy
            theirs = original.get(name)
            if theirs:
                self._copy_hooks(rebinder, name, theirs, own[name], seen)
        state.update(own)
        if "_non_persistent_buffers_set" in original:  # register_buffer writes it (NOTE [registered while running])
            state["_non_persistent_buffers_set"] = set(original["_non_persistent_buffers_set"])
        if not rebinder.suspects.isdisjoint(map(type, original.values())):
            rebinder.rebind_all(state, original, self.path, "attribute ")  # own slots are dicts: never rebound
        if original.get("gradient_checkpointing") is True and original.get("training") is True:
            raise RuntimeError(
                f"module {self.path or '<root>'!r} uses activation checkpointing (gradient_checkpointing=True in "
                "training mode): its backward runs the forward again, after this call has released its private copy "
                "of the model, so it would compute with no params, or another call's. Call "
                "model.gradient_checkpointing_disable() or model.eval()")
        if "_hf_hook" in original and _offloads(original["_hf_hook"]):
            raise RuntimeError(
                f"module {self.path or '<root>'!r} has an accelerate offloading hook, which loads the weights "
                "from its own store while the module runs, so the call would not compute with the params you "
                "gave. Remove the hook (accelerate.hooks.remove_hook_from_module) or load the model without "
                "offloading")
        if (len(original) != self.size or (self.watch and tuple(map(id, map(original.get, self.watch))) != self.watched)
                or not SCALARS.issuperset(map(type, map(original.get, self.scalars, _ABSENT)))
                or (self.refs and not all(ref() is not None for ref in self.refs))):
            self._check(rebinder, original, state, seen)
        if self.holders:  # plain containers of modules or tensors (NOTE [what is scanned])
            for name in self.holders:
                state[name] = rebinder.held_copy(original[name], self.path, name)
            return bool(self.tensor_holders)
        return False

    def _check(self, rebinder: Rebinder, original: dict[str, Any], state: dict[str, Any],
               seen: dict[int, Any]) -> None:
        """Refuse what reaches the model after rebinding; find the containers to copy (NOTE [checked attributes])."""
        self.size = -1  # (checked again at the next call if this raises)
        if "_hf_hook" in original:  # accelerate's hook object: it must not keep the model's modules
            rebinder.check_hook_object(original["_hf_hook"], self.path, "_hf_hook")
        holders: list[str] = []
        tensor_holders: list[str] = []
        refs: list[weakref.ref[Any]] = []
        watch = [name for name, value in original.items() if name not in _UNSCANNED and type(value) not in SCALARS]
        for name in sorted(watch, key=lambda n: n != "forward"):  # the forward first: the telling message
            value = original[name]
            if name == "_hf_hook":
                continue  # (accelerate's hook: checked above; the tensors it keeps are used only when offloading)
            if type(value) in (list, tuple, dict) or isinstance(value, torch.Tensor):
                modules, tensors = rebinder.holds(value, self.path, name, seen)
                holders += [name] if modules or tensors else []
                tensor_holders += [name] if tensors else []
            else:
                rebinder.check_reach(state[name], self.path, "forward" if name == "forward" else f"attribute {name!r}",
                                     seen)
            with contextlib.suppress(TypeError):  # (what has no weak reference is compared by id only)
                refs.append(weakref.ref(value))
        self.holders, self.tensor_holders = tuple(holders), tuple(tensor_holders)
        self.watch, self.refs = tuple(watch), tuple(refs)
        self.watched = tuple(map(id, map(original.get, self.watch)))
        self.scalars = tuple(name for name, value in original.items() if type(value) in SCALARS)
        self.size = len(original)

    def _copy_hooks(self, rebinder: Rebinder, name: str, theirs: dict[Any, Any], ours: dict[Any, Any],
                    seen: dict[int, Any]) -> None:
        ours.update(theirs)
        if rebinder.may_refer(theirs.values()):
            rebinder.rebind_all(ours, theirs, self.path, f"{name} entry ")
        handles = tuple(theirs), tuple(map(id, theirs.values()))  # (handle ids are never reused)
        if self.hooks_checked.get(name) != handles:
            for hook in ours.values():
                rebinder.check_reach(hook, self.path, f"{name} entry", seen)
            self.hooks_checked[name] = handles

    def release(self) -> None:
        """Drop everything copied from the original, and what the forward registered on the shadow
        (NOTE [registered while running]); keep the shadow's own (emptied) slots."""
        state = self.shadow.__dict__
        state.clear()
        if any(self.hooks):
            for hooks in self.hooks:
                hooks.clear()
        params, buffers, modules = self.slots
        if len(params) + len(buffers) != self.size_slots or modules != self.children:
            self._restore_slots()
        state.update(self.own)

    def _restore_slots(self) -> None:
        """The shadow's own slots with the names they had when it was built (a slot the forward deleted is back
        already: unload set it to None); its children as they were."""
        for slots, names in zip(self.slots, self.names, strict=False):
            kept = {name: slots.get(name) for name in names}
            slots.clear()
            slots.update(kept)
        self.slots[2].clear()
        self.slots[2].update(self.children)


class Shadow:
    """A private copy of a model's module tree with empty tensor slots.

    Use :func:`shadow_of` to borrow one.
    """

    def __init__(self, model: nn.Module):
        self.nodes: list[_Node] = []
        self.by_id: dict[int, nn.Module] = {}  # id(original submodule) -> shadow
        self.node_of: dict[int, _Node] = {}
        names = {id(m): name for name, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        self.root = self._copy(model, names)
        self.keys: set[Key] = set()
        canonical: dict[int, Key] = {}  # id(the model's tensor) -> its key
        for prefix, module in model.named_modules(remove_duplicate=False):
            node = self.node_of[id(module)]
            for kind, slots in (("_parameters", node.params), ("_buffers", node.buffers)):
                for name, tensor in module.__dict__[kind].items():
                    if tensor is None:
                        continue
                    key = canonical.setdefault(id(tensor), tuple(f"{prefix}.{name}".lstrip(".").split(".")))
                    self.keys.add(key)
                    slots.append((node.own[kind], name, key, _shape(tensor)))
        self.param_slots = [slot for node in self.nodes for slot in node.params]
        self.param_keys = [key for _, _, key, _ in self.param_slots]
        self.buffer_slots = [slot for node in self.nodes for slot in node.buffers]
        self.slots_of: dict[Key, list[Slot]] = {}
        for slot in (*self.param_slots, *self.buffer_slots):
            self.slots_of.setdefault(slot[2], []).append(slot)
        self.rebinder = Rebinder(self.by_id, {type(m) for m in model.modules()}, names, canonical)
        self.pending: list[_Node] = []  # nodes holding the model's tensors in attributes, this call

    def _copy(self, module: nn.Module, names: dict[int, str]) -> nn.Module:
        if id(module) in self.by_id:  # a submodule used twice keeps one shadow
            return self.by_id[id(module)]
        shadow = type(module).__new__(type(module))
        self.by_id[id(module)] = shadow
        state = module.__dict__
        own: dict[str, Any] = {
            "_parameters": dict.fromkeys(state["_parameters"]),
            "_buffers": dict.fromkeys(state["_buffers"]),
            "_modules": {n: None if m is None else self._copy(m, names) for n, m in state["_modules"].items()},
        }
        own.update((name, OrderedDict()) for name in HOOK_DICTS)
        shadow.__dict__.update(own)
        node = _Node(module, shadow, own, names.get(id(module), ""))
        self.nodes.append(node)
        self.node_of[id(module)] = node
        return shadow

    def is_current(self) -> bool:
        for node in self.nodes:
            module = node.module()
            if module is None or _signature(module) != node.signature:
                return False
        return True

    def refresh(self) -> None:
        seen: dict[int, Any] = {}  # objects walked by this refresh's checks without reaching the model
        rebinder = self.rebinder
        self.pending = [node for node in self.nodes if node.refresh(rebinder, seen)]

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
            for name in node.tensor_holders:
                state[name] = self.rebinder.held_copy(original[name], node.path, name, current)

    def refuse_held(self) -> None:
        """Raise if an attribute holds the model's tensors: a traced call cannot point it at the params.

        Raises:
            RebindError: naming the module and the attribute.
        """
        for node in self.pending:
            raise RebindError(
                f"module {node.path or '<root>'!r}: its attribute {node.tensor_holders[0]!r} holds a parameter or "
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
        """Put ``values`` in the slots of their keys, over what :meth:`load_own` put there.

        For a caller that runs the model's own tensors but a few replaced (compat's
        params transforms): the keys are the model's, the shapes must match.
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

        ``marks`` are :func:`param_marks` of ``values`` before the call.
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
            if _mark(values[key]) != mark:
                raise RuntimeError(
                    f"module {'.'.join(key[:-1]) or '<root>'!r} wrote its parameter {key[-1]!r} while it ran (a "
                    "forward that clamps or renormalises its weights in place, or assigns to .data): the params you "
                    "gave were changed, and with them the model's own tensors where they share memory (as "
                    "tdhook_fn.params does). Constrain the weights outside the forward, e.g. with "
                    "torch.nn.utils.parametrize, or after an optimizer step"
                )

    def unload(self) -> None:
        for slots, name, _, _ in self.param_slots:
            slots[name] = None
        for slots, name, _, _ in self.buffer_slots:
            slots[name] = None
        for node in self.nodes:
            node.release()

    def module_for(self, original: Any, path: str) -> nn.Module:
        shadow = self.by_id.get(id(original))
        if shadow is None:
            raise PathError(
                f"path {path!r} resolves to a {type(original).__name__}, not to a submodule of "
                "the model that its forward calls"
            )
        return shadow


def _mark(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()


def param_marks(values: dict[Key, Any], keys: Sequence[Key]) -> dict[Key, tuple[int, int]]:
    """The version and storage of each given parameter among ``keys``, to see a forward writing it.

    Not for tensors a functorch transform wraps (they have no storage of their own; the
    params are constants of the methods' transforms, so those are seen).
    """
    if torch._C._functorch.peek_interpreter_stack() is None:  # (no transform: nothing is wrapped)
        return {key: _mark(values[key]) for key in keys}
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return {key: _mark(values[key]) for key in keys
            if isinstance(values[key], torch.Tensor) and not wrapped(values[key])}


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


_pools: weakref.WeakKeyDictionary[nn.Module, list[Shadow]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


@contextmanager
def shadow_of(model: nn.Module) -> Iterator[Shadow]:
    """Borrow a refreshed shadow of ``model`` for one call; it is cleared on return."""
    with _lock:
        pool = _pools.get(model)
        if pool is None:
            pool = _pools[model] = []
        shadow = pool.pop() if pool else None
    if shadow is None or not shadow.is_current():
        shadow = Shadow(model)
    try:
        shadow.refresh()
        yield shadow
    finally:
        shadow.unload()
        with _lock:
            if len(pool) < _POOL_SIZE:
                pool.append(shadow)
