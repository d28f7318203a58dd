"""A tap at the input of a module called with its input by name reads and replaces that argument
(NOTE [a module's input]); where no argument is the input, it raises, naming the module."""

import functools

import pytest
import torch
import transformers
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn import call_with_taps, capture, intervene, map_grad
from tdhook_fn.attribution import Pass, deconvolution, deeplift, guided_backprop, layer_deeplift, lrp, saliency


class Called(nn.Module):
    """``lin -> act -> head``, the activation called with its input by name or by position."""

    def __init__(self, by_name: bool, act: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act, self.head = nn.Linear(4, 6), act or nn.Tanh(), nn.Linear(6, 3)
        self.by_name = by_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(self.act(input=h) if self.by_name else self.act(h))


def _both(act: type[nn.Module] = nn.Tanh) -> tuple[nn.Module, nn.Module]:
    return Called(True, act()).double(), Called(False, act()).double()


X = torch.randn(5, 4, dtype=torch.float64)


def test_a_capture_reads_the_input_passed_by_name():
    by_name, by_position = _both()
    taps = [capture("act", site="input")]
    _, seen = call_with_taps(by_name, tdhook_fn.params(by_name), taps, X)
    _, expected = call_with_taps(by_position, tdhook_fn.params(by_position), taps, X)
    assert isinstance(seen["act"], torch.Tensor)
    torch.testing.assert_close(seen["act"], expected["act"], rtol=0, atol=0)


def test_an_intervention_replaces_the_input_passed_by_name():
    by_name, by_position = _both()
    taps = [intervene("act", lambda h: h * 0 + 1, site="input")]
    out, _ = call_with_taps(by_name, tdhook_fn.params(by_name), taps, X)
    expected, _ = call_with_taps(by_position, tdhook_fn.params(by_position), taps, X)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.allclose(out, by_name(X))  # (it did replace it: the intervention used to do nothing here)


def test_a_map_of_the_gradient_at_the_input_passed_by_name():
    by_name, by_position = _both()
    maps = []
    for model in (by_name, by_position):
        f = tdhook_fn.functional(model)
        maps.append(saliency(f, tdhook_fn.params(model), X, target=0, taps=[map_grad("act", lambda g: -2 * g,
                                                                                        site="input")]))
    torch.testing.assert_close(maps[0], maps[1], rtol=0, atol=0)


def test_the_root_called_by_name_reads_its_first_parameter():
    model = Called(False).double()
    f = tdhook_fn.functional(model, in_keys={"input": "x"})  # (f calls the model with x by name)
    out = f.with_taps(capture("", site="input"))(tdhook_fn.params(model), TensorDict(input=X, batch_size=[5]))
    torch.testing.assert_close(out["root"], X, rtol=0, atol=0)


class Optional2(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(y)


class Star(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.lin(kwargs["h"])


class Outer(nn.Module):
    def __init__(self, inner: nn.Module, name: str):
        super().__init__()
        self.inner, self.name = inner, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(**{self.name: x})


@pytest.mark.parametrize("inner, name", [(Optional2(), "y"), (Star(), "h")], ids=["first-parameter-left-out",
                                                                                   "star-args"])
@pytest.mark.parametrize("tap", [capture, map_grad], ids=["capture", "map_grad"])
def test_no_argument_that_is_the_input_raises_naming_the_module(inner, name, tap):
    model = Outer(inner, name)
    made = tap("inner", site="input") if tap is capture else tap("inner", lambda g: g, site="input")
    with pytest.raises(ValueError, match=r"input of the module 'inner'.*keyword arguments only \('" + name
                       + r"'\).*first parameter.*output of the module that computes"):
        call_with_taps(model, tdhook_fn.params(model), [made], torch.randn(2, 4))


def test_an_instance_forward_wrapped_as_accelerate_does_reads_the_wrapped_signature():
    by_name, by_position = _both()
    old = by_name.act.forward

    def new_forward(module: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return old(*args, **kwargs)

    by_name.act.forward = functools.update_wrapper(functools.partial(new_forward, by_name.act), old)
    taps = [intervene("act", lambda h: 2 * h, site="input")]
    out, _ = call_with_taps(by_name, tdhook_fn.params(by_name), taps, X)
    expected, _ = call_with_taps(by_position, tdhook_fn.params(by_position), taps, X)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_module_hooked_by_accelerate_and_called_by_name():
    from accelerate.hooks import ModelHook, add_hook_to_module

    by_name, by_position = _both()
    add_hook_to_module(by_name.act, ModelHook())  # (accelerate's own wrapped instance forward)
    taps = [capture("act", site="input"), intervene("act", lambda h: 2 * h, site="input")]
    out, seen = call_with_taps(by_name, tdhook_fn.params(by_name), taps, X)
    expected, expected_seen = call_with_taps(by_position, tdhook_fn.params(by_position), taps, X)
    torch.testing.assert_close(seen["act"], expected_seen["act"], rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class Rereads(nn.Module):
    """An in-place ReLU called with its input by name, the input read again (``other(h)``)."""

    def __init__(self, twin: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act = nn.Linear(4, 6), nn.ReLU(inplace=not twin)
        self.head, self.other = nn.Linear(6, 3), nn.Linear(6, 3)
        self.twin = twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = self.act(input=h)
        return self.head(y) + self.other(y if self.twin else h)  # (the twin reads the ReLU's output: the same numbers)


@pytest.mark.parametrize("method", [guided_backprop, deconvolution], ids=["guided_backprop", "deconvolution"])
def test_a_rule_at_an_in_place_module_called_by_name_writes_back(method):
    model, twin = Rereads().double(), Rereads(twin=True).double()
    got = method(tdhook_fn.functional(model), tdhook_fn.params(model), X, target=0)
    expected = method(tdhook_fn.functional(twin), tdhook_fn.params(twin), X, target=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert model.act.inplace and torch.equal(model(X), twin(X))  # (the model as it was)


@pytest.mark.parametrize("method", ["deeplift", "layer_deeplift", "lrp"])
def test_lrp_rules_refuse_a_module_called_by_name_under_the_method_s_own_name(method):
    model = Rereads().double()
    f, p = tdhook_fn.functional(model), tdhook_fn.params(model)
    calls = {
        "deeplift": lambda: deeplift(f, p, X, torch.zeros_like(X), target=0),
        "layer_deeplift": lambda: layer_deeplift(f, p, X, torch.zeros_like(X), target=0, layers=["act"]),
        "lrp": lambda: lrp(f, p, X, target=0, rules={nn.ReLU: Pass()}, warn_on_missing_rule=False),
    }
    with pytest.raises(TypeError, match=rf"^{method}: module 'act' is called with .*tensor keyword arguments"):
        calls[method]()


def test_compiled_map_at_an_input_passed_by_name_is_the_eager_one():
    model = Called(True).double()
    f = tdhook_fn.functional(model).with_taps(map_grad("act", lambda g: -2 * g, site="input"))
    p = tdhook_fn.params(model)
    compiled = torch.compile(lambda x: saliency(f, p, x, target=0), fullgraph=True, backend="eager")(X)  # (first)
    eager = saliency(f, p, X, target=0)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_llamas_attention_called_with_hidden_states_by_name():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    f = tdhook_fn.functional(model, in_keys={"input_ids": "input_ids"}, out_keys=["last_hidden_state"])
    taps = [capture("layers[0].self_attn", site="input", key="attention_input"),
            capture("layers[0].input_layernorm", key="normed")]
    ids = TensorDict(input_ids=torch.randint(0, 50, (2, 5)), batch_size=[2])
    out = f.with_taps(*taps)(tdhook_fn.params(model), ids)
    torch.testing.assert_close(out["attention_input"], out["normed"], rtol=0, atol=0)
