import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torch.func import grad, vmap
from zoo import DataclassOut, TwoInput, mlp, same, snapshot

import tdhook_fn


@pytest.mark.parametrize("batch", [[], [3], [2, 3]])
def test_functional_with_any_batch_size(batch):
    model = mlp().eval()
    td = TensorDict(input=torch.randn(*batch, 4), batch_size=batch)
    f = tdhook_fn.functional(model)
    out = f(tdhook_fn.params(model), td)
    assert out.batch_size == torch.Size(batch)
    assert torch.equal(out["output"], model(td["input"]))
    assert set(td.keys()) == {"input"}  # the input TensorDict is not written to


def test_vmap_over_a_batch_equals_the_batched_call():
    model = mlp().eval()
    td = TensorDict(input=torch.randn(2, 3, 4), batch_size=[2, 3])
    f = tdhook_fn.functional(model)
    p = tdhook_fn.params(model)
    per_sample = vmap(vmap(f, (None, 0)), (None, 0))(p, td)
    torch.testing.assert_close(per_sample["output"], f(p, td)["output"])


def test_several_inputs_and_nested_outputs():
    model = TwoInput().eval()
    td = TensorDict(x=torch.randn(5, 4), y=torch.randn(5, 3), batch_size=[5])
    out = tdhook_fn.functional(model, ["x", "y"], ["z"])(tdhook_fn.params(model), td)
    assert torch.equal(out["z"], model(td["x"], td["y"]))

    dc = DataclassOut().eval()
    f = tdhook_fn.functional(dc, ["x"], [("out", "logits"), ("out", "hidden")])
    res = f(tdhook_fn.params(dc), td)
    ref = dc(td["x"])
    assert torch.equal(res["out", "logits"], ref.logits) and torch.equal(res["out", "hidden"], ref.hidden)


class TupleDict(nn.Module):
    def forward(self, x):
        return x + 1, {"b": x * 3, "a": x * 2}


def test_tuple_and_dict_outputs_flatten_in_optree_order():
    td = TensorDict(input=torch.ones(2), batch_size=[2])
    out = tdhook_fn.functional(TupleDict(), out_keys=["p", "a", "b"])(tdhook_fn.params(TupleDict()), td)
    assert out["p"].tolist() == [2, 2] and out["a"].tolist() == [2, 2] and out["b"].tolist() == [3, 3]
    with pytest.raises(ValueError, match="3 leaves but out_keys names 1"):
        tdhook_fn.functional(TupleDict())(tdhook_fn.params(TupleDict()), td)


def test_tensordict_modules():
    torch.manual_seed(0)
    seq = TensorDictSequential(
        TensorDictModule(nn.Linear(4, 5), in_keys=["obs"], out_keys=["hidden"]),
        TensorDictModule(nn.Linear(5, 2), in_keys=["hidden"], out_keys=["action"]),
    )
    td = TensorDict(obs=torch.randn(3, 4), batch_size=[3])
    before = snapshot(seq)
    f = tdhook_fn.functional(seq)
    assert f.in_keys == ("obs",) and f.out_keys == ("hidden", "action")
    out = f(tdhook_fn.params(seq), td)
    assert torch.equal(out["action"], seq(td.clone())["action"])
    assert set(td.keys()) == {"obs"} and same(before, snapshot(seq))
    g = grad(lambda p: f(p, td)["action"].sum())(tdhook_fn.params(seq))
    assert g["module", "0", "module", "weight"].shape == (5, 4)


def test_with_taps_puts_captures_in_the_result():
    model = mlp().eval()
    td = TensorDict(input=torch.randn(3, 4), batch_size=[3])
    f = tdhook_fn.functional(model).with_taps(tdhook_fn.capture("[1]", key="hidden"))
    out = f(tdhook_fn.params(model), td)
    assert torch.equal(out["hidden"], torch.relu(model[0](td["input"])))
    per_sample = vmap(f, (None, 0))(tdhook_fn.params(model), td)
    torch.testing.assert_close(per_sample["hidden"], out["hidden"])


def test_bad_in_keys_and_models():
    model = mlp()
    td = TensorDict(x=torch.randn(3, 4), batch_size=[3])
    with pytest.raises(KeyError, match="'input'"):
        tdhook_fn.functional(model)(tdhook_fn.params(model), td)
    with pytest.raises(TypeError, match="nn.Module"):
        tdhook_fn.functional(lambda x: x)
    with pytest.raises(ValueError, match="out_keys"):
        tdhook_fn.functional(model, out_keys=[])


def test_a_single_str_key_is_one_key_as_in_tensordict_module():
    """``in_keys="x"`` names one entry (as ``TensorDictModule`` reads it), not the characters of the str."""
    model = mlp().eval()
    x = torch.randn(3, 4)
    f = tdhook_fn.functional(model, in_keys="x", out_keys="logits")
    assert f.in_keys == ("x",) and f.out_keys == ("logits",)
    assert list(f.in_keys) == TensorDictModule(model, in_keys="x", out_keys="logits").in_keys
    out = f(tdhook_fn.params(model), TensorDict(x=x, batch_size=[3]))
    assert set(out.keys()) == {"logits"} and torch.equal(out["logits"], model(x))
    g, _ = tdhook_fn.pure(model, "x", "logits")
    assert g.in_keys == ("x",) and g.out_keys == ("logits",)
