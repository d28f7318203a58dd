"""The latent methods on small models: tdhook 0.1.3 as the oracle, batch sizes, transforms, errors."""

import pytest
import torch
from tdhook.latent.activation_patching import ActivationPatching
from tdhook.latent.steering_vectors import ActivationAddition
from tensordict import TensorDict
from torch import nn

import tdhook_fn
from tdhook_fn.latent import Site, activation_addition, attribution_patching, cache, patch, patching_sweep, steer


def _setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).eval()
    clean = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    corrupt = TensorDict(input=torch.randn(5, 3), batch_size=[5])
    return net, tdhook_fn.functional(net), tdhook_fn.params(net), clean, corrupt


def _tdhook_patched(net, key, clean, corrupt, patch_fn=None):
    with ActivationPatching([key], patch_fn=patch_fn).prepare(net) as hooked:
        td = TensorDict(input=clean["input"], patched=corrupt.clone(), batch_size=[5])
        return hooked(td)["patched", "output"]


@pytest.mark.parametrize("path", ["[0]", "[2]", "[3]"])
def test_patch_equals_tdhook(path):
    net, f, p, clean, corrupt = _setup()
    ours = patch(f, p, corrupt, path, cache(f, p, clean, path))["output"]
    torch.testing.assert_close(ours, _tdhook_patched(net, path, clean, corrupt), rtol=0, atol=0)


def test_patch_fn_equals_tdhook():
    net, f, p, clean, corrupt = _setup()
    ours = patch(f, p, corrupt, "[2]", cache(f, p, clean, "[2]"), fn=lambda cur, src: 0.5 * (cur + src))["output"]
    theirs = _tdhook_patched(net, "[2]", clean, corrupt,
                             patch_fn=lambda module_key, output, output_to_patch: 0.5 * (output + output_to_patch))
    torch.testing.assert_close(ours, theirs)


def test_activation_addition_equals_tdhook():
    net, f, p, positive, negative = _setup()
    with ActivationAddition(["[1]"]).prepare(net) as hooked:
        td = hooked(TensorDict(positive=positive.clone(), negative=negative.clone(), batch_size=[5]))
    torch.testing.assert_close(activation_addition(f, p, positive, negative, "[1]")["1"], td["steer", "[1]"])


def test_selections_and_batch_sizes():
    net, f, p, clean, _ = _setup()
    grid = TensorDict(input=torch.randn(2, 3, 3), batch_size=[2, 3])
    acts = cache(f, p, grid, [Site("[2]", index=([0, 2],)), Site("[2]", index=(1,))])
    full = net[2](net[1](net[0](grid["input"])))
    torch.testing.assert_close(acts["2[[0, 2]]"], full[..., [0, 2]])
    torch.testing.assert_close(acts["2[1]"], full[..., 1])
    one = TensorDict(input=clean["input"][0], batch_size=[])
    assert cache(f, p, one, "[2]")["2"].shape == (4,)
    edited = patch(f, p, one, Site("[2]", index=(1,)), TensorDict({"2[1]": torch.tensor(7.0)}))["output"]
    h = net[2](net[1](net[0](clean["input"][0]))).clone()
    h[1] = 7.0
    torch.testing.assert_close(edited, net[4](net[3](h)))


def test_vmap_and_grad_compose():
    net, f, p, clean, corrupt = _setup()
    per_sample = torch.func.vmap(lambda td: cache(f, p, td, "[2]"))(clean)
    torch.testing.assert_close(per_sample["2"], cache(f, p, clean, "[2]")["2"])
    source = cache(f, p, clean, "[2]")

    def metric_of(src):
        return patch(f, p, corrupt, "[2]", TensorDict({"2": src}, batch_size=[5]))["output"][..., 0].sum()

    g = torch.func.grad(metric_of)(source["2"])
    tanh_grad = 1 - torch.tanh(source["2"]) ** 2
    torch.testing.assert_close(g, tanh_grad * net[4].weight[0])
    alphas = torch.tensor([0.0, 0.5, 1.0])
    v = TensorDict({"1": torch.ones(4)})
    vmapped = torch.func.vmap(lambda a: steer(f, p, clean, "[1]", v, alpha=a)["output"])(alphas)
    torch.testing.assert_close(vmapped, steer(f, p, clean, "[1]", v, alpha=alphas)["output"])


def test_sweep_chunks_and_atp_linear_case():
    net, f, p, clean, corrupt = _setup()
    grid = [Site("[3]", index=(i,)) for i in range(4)]  # the head is linear in [3]
    metric = lambda out: out["output"][..., 1]
    sweep = patching_sweep(f, p, clean, corrupt, grid, metric)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, grid, metric, chunk_size=3), sweep)
    torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, grid, metric, batching="fold"), sweep)
    mixed = [Site("[2]", index=(1,)), Site("[3]"), Site("[0]", index=(slice(0, 2),))]  # several modules, one chunk
    loop = torch.stack([metric(patch(f, p, corrupt, s, cache(f, p, clean, s))) for s in mixed])
    for batching in ("vmap", "fold"):
        torch.testing.assert_close(patching_sweep(f, p, clean, corrupt, mixed, metric, batching=batching), loop)
    exact = sweep - metric(f(p, corrupt))
    torch.testing.assert_close(attribution_patching(f, p, clean, corrupt, grid, metric), exact, atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize("metric", [
    lambda out: out["output"].argmax(-1).float(),
    lambda out: (out["output"][..., 1] > 0).float(),
    lambda out: out["output"][..., 1].detach(),
], ids=["argmax", "comparison", "detach"])
def test_atp_refuses_a_metric_without_gradient(metric):
    """Every estimate was 0 (the true effects were not): refused, as saliency refuses such a target."""
    net, f, p, clean, corrupt = _setup()
    with pytest.raises(ValueError, match="the metric does not depend differentiably .* every estimate would be 0"):
        attribution_patching(f, p, clean, corrupt, [Site("[3]", index=(i,)) for i in range(4)], metric)


def test_atp_under_inference_mode_says_autograd_is_off_and_no_grad_is_fine():
    net, f, p, clean, corrupt = _setup()
    grid = [Site("[3]", index=(i,)) for i in range(4)]
    metric = lambda out: out["output"][..., 1]
    expected = attribution_patching(f, p, clean, corrupt, grid, metric)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"autograd is off: torch.inference_mode\(\)"):
        attribution_patching(f, p, clean, corrupt, grid, metric)
    with torch.no_grad():
        torch.testing.assert_close(attribution_patching(f, p, clean, corrupt, grid, metric), expected)


BAD = [
    ("not-functional", lambda f, p, c, x: cache(lambda q, td: td, p, c, "[0]"), TypeError, "Functional"),
    ("module-as-f", lambda f, p, c, x: cache(f.model, p, c, "[0]"), TypeError, "tdhook_fn.functional(model)"),
    ("tensor-inputs", lambda f, p, c, x: cache(f, p, c["input"], "[0]"), TypeError, "inputs must be a TensorDict"),
    ("no-source", lambda f, p, c, x: patch(f, p, x, "[0]", TensorDict()), KeyError, "no entry for site '0'"),
    ("source-shape", lambda f, p, c, x: patch(f, p, x, "[0]", TensorDict({"0": torch.ones(5, 3)}, [5])),
     ValueError, "source for site '0' has shape (5, 3)"),
    ("metric-shape", lambda f, p, c, x: patching_sweep(f, p, c, x, ["[0]"], lambda out: out["output"].sum()),
     ValueError, "one value per sample"),
    ("duplicate-sites", lambda f, p, c, x: cache(f, p, c, ["[0]", "[0]"]), ValueError, "share a key"),
    ("bad-index", lambda f, p, c, x: Site("[0]", index=(1.5,)), TypeError, "ints, slices or lists"),
    ("pattern-matches-nothing", lambda f, p, c, x: tdhook_fn.latent.sites(f.model, "blocks"), ValueError,
     "no module name matches"),
    ("bad-alpha", lambda f, p, c, x: steer(f, p, c, "[0]", TensorDict({"0": torch.ones(4)}),
                                         alpha=torch.ones(2, 2)), ValueError, "1-d tensor"),
    ("bad-batching", lambda f, p, c, x: patching_sweep(f, p, c, x, ["[0]"], lambda out: out["output"][..., 0],
                                                       batching="loop"), ValueError, "'vmap' or 'fold'"),
    ("batch-mismatch", lambda f, p, c, x: patching_sweep(f, p, c, x[:2], ["[0]"], lambda out: out["output"][..., 0]),
     ValueError, "clean has batch [5], corrupted [2]"),
]


@pytest.mark.parametrize(("call", "exc", "words"), [pytest.param(c, e, w, id=i) for i, c, e, w in BAD])
def test_bad_input(call, exc, words):
    _, f, p, clean, corrupt = _setup()
    with pytest.raises(exc) as info:
        call(f, p, clean, corrupt)
    assert words in str(info.value)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


def test_a_module_that_runs_twice_needs_a_run():
    torch.manual_seed(0)
    net = _Twice().eval()
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    x = torch.randn(4, 3)
    td = TensorDict(input=x, batch_size=[4])
    first, last = net.lin(x), net.lin(torch.tanh(net.lin(x)))
    with pytest.raises(ValueError, match=r"'lin' ran 2 times.*call=k"):
        cache(f, p, td, "lin")
    torch.testing.assert_close(cache(f, p, td, Site("lin", call=0))["lin@0"], first)
    torch.testing.assert_close(cache(f, p, td, Site("lin", call=-1))["lin@-1"], last)
    zeros = TensorDict({"lin@-1": torch.zeros(4, 3), "lin@0": torch.zeros(4, 3)}, batch_size=[4])
    torch.testing.assert_close(patch(f, p, td, Site("lin", call=-1), zeros)["output"], net.head(torch.zeros(4, 3)))
    patched_first = net.head(net.lin(torch.tanh(torch.zeros(4, 3))))
    torch.testing.assert_close(patch(f, p, td, Site("lin", call=0), zeros)["output"], patched_first)
    keys = [Site("a.b").key, Site("a.b", site="input").key, Site("a.b", element=1).key, Site("a.b", call=1).key]
    assert keys == ["a.b", "a.b:input", "a.b#1", "a.b@1"]
    with pytest.raises(ValueError, match=r"call=-3 but ran 2 times"):
        cache(f, p, td, Site("lin", call=-3))


def test_cache_outputs_clashing_with_a_site_key():
    net = nn.Sequential(nn.Linear(3, 2))
    f = tdhook_fn.functional(net, out_keys=["0"])
    with pytest.raises(ValueError, match=r"out_keys \['0'\] are also site keys"):
        cache(f, tdhook_fn.params(net), TensorDict(input=torch.ones(2, 3), batch_size=[2]), "[0]", outputs=True)


def test_a_skipping_sweep_gives_the_metric_all_of_fs_outputs():
    """The corrupted run's metric (for unchanged sites) sees what f's own taps capture, as every run does."""
    net, f, p, clean, corrupt = _setup()
    tapped = f.with_taps(tdhook_fn.capture("[1]", key="hidden"))
    metric = lambda out: out["hidden"].sum(-1) + out["output"][..., 0]
    grid = [Site(path, index=(i,)) for path in ("[1]", "[3]") for i in range(4)]
    for source in (clean, corrupt.clone()):  # every site changes; then none does (all skipped)
        skipped = patching_sweep(tapped, p, source, corrupt, grid, metric)
        every = patching_sweep(tapped, p, source, corrupt, grid, metric, skip_unchanged=False)
        torch.testing.assert_close(skipped, every, rtol=1e-6, atol=1e-6)


def test_a_zero_whose_sign_the_patch_flips_is_a_change():
    """-0.0 == 0.0 as values, but 1/x tells them apart: the run is not skipped."""
    net = nn.Sequential(nn.Identity(), nn.Identity())
    f, p = tdhook_fn.functional(net), tdhook_fn.params(net)
    clean = TensorDict(input=torch.tensor([[-0.0, 1.0]]), batch_size=[1])
    corrupt = TensorDict(input=torch.tensor([[0.0, 1.0]]), batch_size=[1])
    metric = lambda out: 1.0 / out["output"][..., 0]
    grid = [Site("[0]", index=(0,)), Site("[0]", index=(1,))]
    sweep = patching_sweep(f, p, clean, corrupt, grid, metric)
    assert sweep[0].item() == float("-inf") and sweep[1].item() == float("inf")
    torch.testing.assert_close(sweep, patching_sweep(f, p, clean, corrupt, grid, metric, skip_unchanged=False))


def test_scalar_selections_of_one_unbatched_sample():
    """Batch () and a scalar selection: the shape to restore is (), which reshape(*shape) cannot take."""
    net, f, p, clean, corrupt = _setup()
    one, other = clean[0], corrupt[0]
    site = Site("[1]", index=(2,))
    acts = cache(f, p, one, site)
    assert acts[site.key].shape == ()
    torch.testing.assert_close(acts[site.key], net[1](net[0](one["input"]))[2])
    patched = patch(f, p, other, site, acts)
    torch.testing.assert_close(patched["output"], patch(f, p, corrupt, site, cache(f, p, clean, site))["output"][0])
    grid = [Site("[1]", index=(i,)) for i in range(4)]
    metric = lambda out: out["output"][..., 0]
    torch.testing.assert_close(patching_sweep(f, p, one, other, grid, metric),
                               patching_sweep(f, p, clean, corrupt, grid, metric)[:, 0])


def test_taps_run_after_the_methods_own():
    """``taps`` attach after the method's reads and edits: the cache reads the module's output before a tap doubles
    it, the patch is doubled after it is put in, and the vectors are of the undoubled outputs."""
    net, f, p, clean, corrupt = _setup()
    doubled = tdhook_fn.intervene("[2]", lambda value: 2 * value)
    tapped = f.with_taps(doubled)
    acts = cache(f, p, clean, "[2]", outputs=True, taps=[doubled])
    torch.testing.assert_close(acts["2"], cache(f, p, clean, "[2]")["2"])
    torch.testing.assert_close(acts["output"], tapped(p, clean)["output"])
    sources = cache(f, p, clean, "[2]")
    by_hand = net[4](net[3](2 * sources["2"]))
    torch.testing.assert_close(patch(f, p, corrupt, "[2]", sources, taps=[doubled])["output"], by_hand)
    torch.testing.assert_close(activation_addition(f, p, clean, corrupt, "[2]", taps=[doubled])["2"],
                               activation_addition(f, p, clean, corrupt, "[2]")["2"])
