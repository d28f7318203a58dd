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
    with pytest.raises(IndexError, match=r"out of range for output 'output' of shape \(2, 3\) \(3 classes"):
        as_target(target)(td)
