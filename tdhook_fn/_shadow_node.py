"""One module of a shadow (NOTE [shadow modules] in ``_shadow``): what it keeps between calls, and the checks run
when its module changes (`Shadow.refresh` fills every module for a call, in one loop)."""

# NOTE [registered while running]
# What a forward registers on its shadow (``register_buffer`` in a lazy cache, a parameter,
# a submodule, a hook) or assigns to it lives for that call only: on release the shadow's
# own slots get back the names and children they had when it was built, its hook
# dictionaries are emptied, and its ``__dict__`` (where plain assignments land) is dropped.
# ``_non_persistent_buffers_set``, which ``register_buffer`` writes, is a private copy of
# the original's for each call, so the model is never written.
#
# NOTE [checked attributes]
# Each module's attributes (and hooks) are checked, after rebinding, for what still
# reaches the model (NOTE [reaching the model]) and for the containers to copy, when the
# shadow is first used and again only when they change: a name added or removed, a value
# that is not a scalar replaced (by id, and by a weak reference where it has one, so a
# new object that got a dead one's id is seen), or a scalar replaced by an object. A
# hook dict is checked again when its handles or hooks change. So an ordinary call pays a
# length and a few ids per module. Not seen: an object *mutated* in place after it was
# checked (an attribute of it assigned anew to point at a module).

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

from ._params import Key
from ._reach import SCALARS
from ._rebind import Rebinder

__all__ = ["GLOBAL_HOOK_DICTS", "HOOK_DICTS", "Node", "Slot", "shape_of"]

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
_MUTABLE = frozenset({list, dict, set})
# NOTE [private containers]
# A forward may fill a plain dict or list it keeps as an attribute (a lazily filled cache:
# ``self._cache[n] = self.inv_freq[:n]``). Shared with the model, the call would write the
# model, and a later call would read the first call's tensors. So every plain list, dict
# and set attribute (and a tuple holding modules or tensors of the model) is copied for
# each call, nested plain containers too, from what it holds *now*: one filled in place,
# or replaced by a new one at the same id, is seen, and the modules and tensors of the
# model in it point at the shadows and the call's tensors (NOTE [held tensors]). A tuple
# of numbers (``normalized_shape``) cannot be filled: it is left shared.

# (the shadow's slot dict, the name in it, the params key, the expected shape or None)
Slot = tuple[dict[str, Any], str, Key, "torch.Size | None"]


def signature_of(module: nn.Module) -> tuple[Any, ...]:
    """What a shadow's structure depends on: the class (a shadow is made of it: ``__class__``
    assigned anew needs a new shadow), names and identities of children and tensors."""
    state = module.__dict__
    mods, params, bufs = state["_modules"], state["_parameters"], state["_buffers"]
    return (type(module), *mods, *map(id, mods.values()), None, *params, *map(id, params.values()), None, *bufs,
            *map(id, bufs.values()))


def _offloads(hook: Any) -> bool:
    """Whether an accelerate hook (or one of a ``SequentialHook``'s) offloads its module's weights."""
    return getattr(hook, "offload", False) is True or any(_offloads(h) for h in getattr(hook, "hooks", ()) or ())


def shape_of(tensor: torch.Tensor) -> torch.Size | None:
    return None if isinstance(tensor, nn.parameter.UninitializedTensorMixin) else tensor.shape  # type: ignore[attr-defined]


class Node:
    """One original module (held weakly), its shadow and the shadow's own state."""

    __slots__ = ("buffers", "children", "containers", "holders", "hooks", "hooks_checked", "ids_seen", "kind", "module",
                 "names", "names_seen", "own",
                 "params", "path", "refs", "scalars", "shadow", "signature", "size", "size_slots", "slots",
                 "suspect", "tensor_holders", "watch", "watched")

    def __init__(self, module: nn.Module, shadow: nn.Module, own: dict[str, Any], path: str):
        self.module = weakref.ref(module)
        self.shadow = shadow
        self.own = own
        self.path = path
        self.signature = signature_of(module)
        state = module.__dict__  # the signature's parts, as `Shadow.refresh` compares them
        mods, params, bufs = state["_modules"], state["_parameters"], state["_buffers"]
        self.kind = type(module)
        self.names_seen = (*mods, None, *params, None, *bufs)
        self.ids_seen = (*map(id, mods.values()), *map(id, params.values()), *map(id, bufs.values()))
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
        self.scalars: tuple[str, ...] = ()  # and the names of the scalars (bool, int, float, str, None);
        self.suspect = True  # whether one of them may refer back to the model (`Rebinder.suspects`' types)
        self.hooks_checked: dict[str, tuple[tuple[Any, ...], tuple[int, ...]]] = {}
        self.holders: tuple[str, ...] = ()  # plain containers and tensors copied for each call
        self.tensor_holders: tuple[str, ...] = ()  # those holding the model's tensors (NOTE [held tensors])
        self.containers: tuple[str, ...] = ()  # copied for each call (NOTE [private containers])

    def original(self) -> dict[str, Any] | None:
        module = self.module()
        return None if module is None else module.__dict__

    def copy_hooks(self, rebinder: Rebinder, original: dict[str, Any], seen: dict[int, Any]) -> None:
        """The model's own hooks on this module, on the shadow's private copies (they still run)."""
        for name in HOOK_DICTS:
            theirs = original.get(name)
            if theirs:
                self._copy_hooks(rebinder, name, theirs, self.own[name], seen)

    def refuse_unrunnable(self, original: dict[str, Any]) -> None:
        """Raise where the module recomputes or reloads its weights behind the call's back."""
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

    def copy_containers(self, rebinder: Rebinder, original: dict[str, Any], state: dict[str, Any]) -> None:
        """Private copies of the plain containers, from what they hold now (NOTE [private containers])."""
        for name in self.containers:
            value = original[name]
            state[name] = set(value) if type(value) is set else rebinder.held_copy(value, self.path, name)

    def check(self, rebinder: Rebinder, original: dict[str, Any], state: dict[str, Any],
               seen: dict[int, Any]) -> None:
        """Refuse what reaches the model after rebinding; find the containers to copy (NOTE [checked attributes])."""
        self.size = -1  # (checked again at the next call if this raises)
        if "_hf_hook" in original:  # accelerate's hook object: it must not keep the model's modules
            rebinder.check_hook_object(original["_hf_hook"], self.path, "_hf_hook")
        holders: list[str] = []
        tensor_holders: list[str] = []
        refs: list[weakref.ref[Any]] = []
        watch = [name for name, value in original.items() if name not in _UNSCANNED and type(value) not in SCALARS]
        # torch's spectral_norm / weight_norm hooks set the tensor they name (``hook.name``) before each forward
        rebuilt = {getattr(hook, "name", None) for hook in original.get("_forward_pre_hooks", {}).values()}
        skipped: set[str] = set()
        for name in sorted(watch, key=lambda n: n != "forward"):  # the forward first: the telling message
            value = original[name]
            if (name == "_hf_hook" or (name == "_flat_weights" and isinstance(self.shadow, nn.RNNBase))
                    or (name in rebuilt and isinstance(value, torch.Tensor))):
                # accelerate's hook: checked above (the tensors it keeps are used only when offloading); an RNN's
                # flat weights: its forward rebuilds them from the registered parameters when they differ; a
                # tensor a pre-hook computes from the parameters before each forward
                skipped.add(name)
                continue
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
        mutable = (name for name in watch if type(original[name]) in _MUTABLE and name not in skipped)
        self.containers = tuple(dict.fromkeys((*holders, *mutable)))
        self.watch, self.refs = tuple(watch), tuple(refs)
        self.watched = tuple(map(id, map(original.get, self.watch)))
        self.scalars = tuple(name for name, value in original.items() if type(value) in SCALARS)
        self.suspect = not rebinder.suspects.isdisjoint(map(type, original.values()))
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

    def restore_slots(self) -> None:
        """The shadow's own slots with the names they had when it was built (a slot the forward deleted is back
        already: unload set it to None); its children as they were."""
        for slots, names in zip(self.slots, self.names, strict=False):
            kept = {name: slots.get(name) for name in names}
            slots.clear()
            slots.update(kept)
        self.slots[2].clear()
        self.slots[2].update(self.children)


