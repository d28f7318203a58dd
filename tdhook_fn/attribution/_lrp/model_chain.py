"""A model that is a chain of modules, run one module at a time by the caller."""

# NOTE [chains]
# In a hook-free ``nn.Sequential`` (nested ones included) each module's output is the next
# module's input and nothing else, and the last output is the model's. A method that wants
# to act between modules (LRP hands relevance back module by module) can then run the
# modules itself, one ``step`` each, instead of wrapping them in taps. `chain_of`
# says whether ``f``'s model is such a chain, and `run_chain` runs it on the call's
# shadow (NOTE [shadow modules]), so the model is never touched. The test is structural
# and conservative: any hook (the model's, a submodule's or a global one), an instance
# ``forward`` (accelerate), a ``Sequential`` subclass with its own ``forward``, keyword
# inputs or several inputs or outputs: no chain, and the caller takes its general path.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn

from ..._forward_values import get_input
from ..._functional import Functional, pack, run
from ..._model_plans import global_hooks
from ..._shadow import HOOK_DICTS

__all__ = ["Link", "chain_of", "model_chain", "reads_one_key", "run_chain"]

Link = tuple[str, nn.Module]  # (name, module): the name is the path in the Sequentials, as named_modules gives it
Step = Callable[[Link, nn.Module, Any], Any]

def _is_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _hook_free(model: nn.Module) -> bool:
    if global_hooks():
        return False
    return all("forward" not in m.__dict__ and not any(m.__dict__.get(h) for h in HOOK_DICTS) for m in model.modules())


def _links(module: nn.Module, name: str, whole: Callable[[str, nn.Module], bool], out: list[Link]) -> None:
    if _is_sequential(module) and not whole(name, module):
        for child_name, child in module._modules.items():
            if child is not None:
                _links(child, f"{name}.{child_name}" if name else child_name, whole, out)
    else:
        out.append((name, module))


def chain_of(f: Any, whole: Callable[[str, nn.Module], bool] = lambda _n, _m: False) -> list[Link] | None:
    """The modules ``f``'s model runs one after the other, if it is a chain (NOTE [chains]); else ``None``.

    Nested ``Sequential`` s are opened, except where ``whole(name, module)`` is true.
    """
    return model_chain(f.model, whole) if reads_one_key(f) else None


def reads_one_key(f: Any) -> bool:
    """What a chain asks of ``f`` itself: a Functional without taps or keywords, one input and one output."""
    return isinstance(f, Functional) and not f.taps and not f.keywords and len(f.in_keys) == 1 and len(f.out_keys) == 1


def model_chain(model: nn.Module, whole: Callable[[str, nn.Module], bool] = lambda _n, _m: False,
                ) -> list[Link] | None:
    """`chain_of` for the model alone (a plan of the model may keep it: NOTE [plans per model])."""
    if not (_is_sequential(model) and _hook_free(model)):
        return None
    links: list[Link] = []
    _links(model, "", whole, links)
    return links


def run_chain(f: Functional, params: TensorDictBase, td: TensorDictBase, links: list[Link], step: Step) -> TensorDict:
    """``f(params, td)`` with each module of the chain run by ``step(link, shadow, input) -> output``.

    ``shadow`` is the call's shadow of the link's module, holding ``params``; what ``step``
    returns is the next module's input, and the last one is ``f``'s output. A module that
    is in the chain twice is a link twice, with one shadow.
    """
    x = get_input(td, f.in_keys[0])

    def invoke(root: nn.Module) -> Any:
        h = x
        for link in links:  # the shadow tree mirrors the model's: a link's name finds its shadow
            h = step(link, root.get_submodule(link[0]), h)
        return h

    output, captured = run(f.model, params, (), invoke)
    return pack(td.batch_size, {f.out_keys[0]: output}, captured)

