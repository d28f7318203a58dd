import pytest
import torch
from tensordict import TensorDict

from tdhook_fn import as_target, label


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)])
def test_int_and_tuple_shortcuts_select_the_last_dimension(batch):
    td = TensorDict(output=torch.randn(*batch, 5), batch_size=list(batch))
    assert torch.equal(as_target(3)(td)["output"], td["output"][..., 3])
    picked = as_target((4, 0))(td)["output"]
    assert picked.shape == (*batch, 2)
    assert torch.equal(picked[..., 0], td["output"][..., 4]) and torch.equal(picked[..., 1], td["output"][..., 0])
    assert as_target(1)(td).batch_size == torch.Size(batch)


def test_callables_pass_through_and_label_gathers_per_sample():
    fn = lambda td: td.select("output")
    assert as_target(fn) is fn
    td = TensorDict(output=torch.randn(4, 3), y=torch.tensor([2, 0, 1, 2]), batch_size=[4])
    assert torch.equal(label("y")(td)["output"], td["output"][torch.arange(4), td["y"]])
    td.set("other", torch.zeros(4, 3))
    assert torch.equal(label("y", output="other")(td)["other"], torch.zeros(4))


def test_bad_targets():
    td = TensorDict(a=torch.randn(2, 3), b=torch.randn(2, 3), batch_size=[2])
    with pytest.raises(ValueError, match="single output"):
        as_target(0)(td)
    for bad in [True, (), (1, "x"), "output", 1.5]:
        with pytest.raises(TypeError):
            as_target(bad)


@pytest.mark.parametrize("target", [3, -4, (0, 3)])
def test_an_int_target_out_of_range_names_the_class_and_the_output(target) -> None:
    td = TensorDict(output=torch.zeros(2, 3), batch_size=[2])
    with pytest.raises(IndexError, match=r"out of range for output 'output', which has 3 classes on its last dim "
                                         r"\(valid: -3 to 2\)"):
        as_target(target)(td)


@pytest.mark.parametrize(("labels", "bad"), [([0, 3, 5, 1], "3, 5"), ([-1, 2, 0, -2], "-2, -1")])
def test_label_out_of_range_names_the_key_the_values_and_the_classes(labels, bad) -> None:
    """A raw ``gather`` error (or a negative label read from the end) before."""
    td = TensorDict(output=torch.randn(4, 3), y=torch.tensor(labels), batch_size=[4])
    with pytest.raises(ValueError, match=rf"label\('y'\): labels \[{bad}\] are not class indices .* 3 classes"):
        label("y")(td)


def test_label_range_in_a_method_and_under_vmap() -> None:
    import tdhook_fn
    from tdhook_fn.attribution import saliency

    net = torch.nn.Linear(3, 2)
    f, p = tdhook_fn.pure(net)
    x = torch.randn(4, 3)
    td = TensorDict(input=x, y=torch.tensor([0, 1, 2, 1]), batch_size=[4])
    with pytest.raises(ValueError, match=r"label\('y'\): labels \[2\] .* 2 classes"):
        saliency(f, p, td, target=label("y"))
    good = TensorDict(input=x, y=torch.tensor([0, 1, 1, 0]), batch_size=[4])
    per_sample = torch.func.vmap(lambda s: saliency(f, p, s, target=label("y"))["input"])(good)
    torch.testing.assert_close(per_sample, net.weight.detach()[good["y"]])
