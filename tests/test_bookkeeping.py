"""Book-keeping clipping gives the clipped sum of the per-example loop, P14 included.

The pose model's private step takes ``fedpose.shared.privacy.step.bookkeeping`` (one forward, one backward per chunk);
these tests hold it to the generic ``vmap(grad)`` path, which the per-example loop tests already hold
(tests/test_privacy.py), on the real model with every training strategy and both variants.
"""

from __future__ import annotations

import pytest
import torch

from fedpose.shared.privacy.step import bookkeeping
from fedpose.shared.privacy.step.fpdp import clipped_grad_sum
from fedpose.shared.privacy.step.persample import per_sample_grads, per_sample_norms
from support.models import generic_loss, model_setup



def _close(a: dict, b: dict, rtol=2e-4, atol=2e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max()) + 1e-12
        assert torch.allclose(a[name], b[name], rtol=rtol, atol=atol * max(scale, 1.0)), (
            name, float((a[name] - b[name]).abs().max()), scale)


@pytest.mark.parametrize("variant,strategy", [
    ("tinyvit-5m", "finetune"), ("tinyvit-5m", "full"), ("tinyvit-small", "finetune"),
])
def test_clipped_sum_and_norms_equal_the_generic_path(variant, strategy):
    model, loss_fn, params, batch = model_setup(variant, strategy)
    assert bookkeeping.supports(loss_fn, params)
    fast = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=3)
    slow = clipped_grad_sum(generic_loss(loss_fn), params, batch, clip_norm=0.05, chunk_size=3)
    assert torch.allclose(fast.norms, slow.norms, rtol=1e-4)
    assert fast.zeroed == slow.zeroed == 0
    assert bool((slow.norms > 0.05).any()), "the test must clip some samples"
    _close(fast.summed, slow.summed)
    # weights that are not the model's own (a server's copy) run through the loss's parameters: same sum
    copies = clipped_grad_sum(loss_fn, {n: v.clone() for n, v in params.items()}, batch, clip_norm=0.05, chunk_size=3)
    _close(copies.summed, fast.summed, rtol=1e-5, atol=1e-7)


def test_norms_are_the_per_example_norms_and_chunks_do_not_matter():
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", task_uncertainty=True, size=4)
    reference = per_sample_norms(per_sample_grads(generic_loss(loss_fn), params, batch, chunk_size=1))
    for chunk in (1, 3, 4):
        got = clipped_grad_sum(loss_fn, params, batch, clip_norm=1e9, chunk_size=chunk)
        assert torch.allclose(got.norms, reference, rtol=1e-4)
    # with no clipping at all the sum is the plain summed gradient
    plain = torch.func.grad(lambda p: loss_fn(p, batch).sum())(params)
    _close(clipped_grad_sum(loss_fn, params, batch, clip_norm=1e9, chunk_size=2).summed, plain)


def test_every_rule_is_used_by_the_pose_model():
    """The model's trainable tensors under 'full' fall under each rule at least once (none goes unnoticed)."""
    model, loss_fn, params, _ = model_setup("tinyvit-5m", "full")
    layer_names = [n for n in params if n not in loss_fn.combine_names]
    kinds = {rule.name for _, rule, _ in bookkeeping._plan(model, layer_names).values()}
    assert kinds == {"linear", "conv", "grouped_conv", "layer_norm", "bias_table"}


def test_unsupported_loss_or_parameter_takes_the_generic_path():
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=2)
    assert not bookkeeping.supports(generic_loss(loss_fn), params)
    assert not bookkeeping.supports(loss_fn, {**params, "no.such.weight": torch.zeros(2)})


@pytest.mark.invariant("P14")
def test_a_non_finite_sample_contributes_zero_and_a_huge_one_is_clipped():
    """P14 on this path: a sample whose forward overflows gives zero; the others' sum is unchanged."""
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=4)
    poisoned = dict(batch)
    poisoned["image"] = batch["image"].clone()
    poisoned["image"][2] = float("nan")
    got = clipped_grad_sum(loss_fn, params, poisoned, clip_norm=0.05, chunk_size=4)
    keep = [0, 1, 3]
    rest = clipped_grad_sum(loss_fn, params, {k: v[keep] for k, v in batch.items()}, clip_norm=0.05, chunk_size=4)
    assert got.zeroed == 1 and not bool(torch.isfinite(got.norms[2]))
    _close(got.summed, rest.summed)
    assert all(bool(torch.isfinite(v).all()) for v in got.summed.values())

    # huge but finite: the head's hidden layer scaled by 1e25 makes norms far above float32's square range
    big = dict(params)
    big["head.x_head.weight"] = params["head.x_head.weight"] * 1e25
    huge = clipped_grad_sum(loss_fn, big, batch, clip_norm=0.05, chunk_size=4)
    generic = clipped_grad_sum(generic_loss(loss_fn), big, batch, clip_norm=0.05, chunk_size=4)
    assert huge.zeroed == generic.zeroed
    total = torch.sqrt(sum(v.double().pow(2).sum() for v in huge.summed.values()))
    assert bool(torch.isfinite(total)) and float(total) <= 0.05 * 4 * (1 + 1e-4)
    finite = torch.isfinite(generic.norms)
    assert torch.allclose(huge.norms[finite], generic.norms[finite], rtol=1e-3)


def test_public_basis_from_book_keeping_spans_the_generic_one():
    from fedpose.shared.privacy.step.subspace import compute_basis

    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=12)
    fast = compute_basis(loss_fn, params, batch, k=4, chunk_size=5)
    slow = compute_basis(generic_loss(loss_fn), params, batch, k=4, chunk_size=5)
    cosines = torch.linalg.svdvals(fast.double().T @ slow.double())  # principal angles (float64: p is large)
    assert float(cosines.min()) > 0.999


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"),
                         [(3, 1, 1, 1), (3, 2, 1, 1), ((3, 5), (2, 1), (0, 2), 1), (3, 1, 2, 2)])
def test_the_depthwise_rule_gives_each_samples_weight_gradient_as_autograd_does(kernel, stride, padding, dilation):
    """The depthwise rule's grouped convolution gives each sample's weight gradient exactly as autograd does."""
    from torch import nn

    from fedpose.shared.privacy.step.layer_rules import depthwise_weight

    torch.manual_seed(0)
    conv = nn.Conv2d(6, 6, kernel, stride=stride, padding=padding, dilation=dilation, groups=6)
    x = torch.randn(3, 6, 11, 9)
    g = torch.randn_like(conv(x))
    got = depthwise_weight(conv, x, g)
    for i in range(3):
        (want,) = torch.autograd.grad((conv(x[i:i + 1]) * g[i:i + 1]).sum(), conv.weight)
        torch.testing.assert_close(got[i], want[:, 0], rtol=1e-5, atol=1e-5)


def test_the_mean_gradient_of_the_models_own_weights_equals_the_functional_one():
    """The public gradient (and the non-private step) runs the model as it is when given its own weights; the
    result is the gradient the functional path computes from copies of them."""
    from fedpose.shared.privacy.step.persample import mean_grad

    model, loss_fn, params, batch = model_setup("tinyvit-small", "finetune", size=6)
    own = mean_grad(loss_fn, params, batch)
    copies = mean_grad(loss_fn, {name: value.clone() for name, value in params.items()}, batch)
    assert own.keys() == copies.keys() == params.keys()
    for name in params:
        torch.testing.assert_close(own[name], copies[name], rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # nothing left on the model


def test_the_models_own_parameters_are_those_of_named_parameters_and_follow_a_replaced_one():
    from torch import nn

    from fedpose.shared.privacy.step.persample import own_parameters

    model, _, _, _ = model_setup("tinyvit-small", "finetune")
    assert list(own_parameters(model).items()) == list(model.named_parameters())
    old = model.head.final.weight
    model.head.final.weight = nn.Parameter(old.detach().clone())
    got = own_parameters(model)
    assert got["head.final.weight"] is model.head.final.weight and got["head.final.weight"] is not old
    assert list(got.items()) == list(model.named_parameters())


def test_the_mean_gradient_of_a_weight_the_loss_does_not_reach_is_zero_as_on_the_functional_path():
    from torch import nn

    from fedpose.shared.privacy.step.persample import mean_grad

    class Loss:
        combine_names = ()

        def __init__(self) -> None:
            torch.manual_seed(0)
            self.model = nn.ModuleDict({"used": nn.Linear(4, 3), "unused": nn.Linear(4, 3)})

        def parts(self, params, batch):
            if params is None:  # the model as it is
                return self.model["used"](batch["x"]).pow(2)
            return torch.nn.functional.linear(batch["x"], params["used.weight"], params["used.bias"]).pow(2)

        def combine(self, parts, params):
            return parts.sum(1)

        def __call__(self, params, batch):
            return self.combine(self.parts(params, batch), params)

    loss = Loss()
    batch = {"x": torch.randn(5, 4)}
    named = dict(loss.model.named_parameters())
    own = mean_grad(loss, {n: p.detach() for n, p in named.items()}, batch)
    copies = mean_grad(loss, {n: p.detach().clone() for n, p in named.items()}, batch)
    for name in named:
        torch.testing.assert_close(own[name], copies[name])
    assert not own["unused.weight"].any() and not own["unused.bias"].any()


def test_the_task_weights_taken_per_row_weigh_each_row_as_the_shared_ones_do():
    """A pose loss's ``combine`` takes its task weights as one copy per row (it says so), and each row's total
    uses its own copy only: book-keeping reads every sample's task-weight gradient off the one backward."""
    from fedpose.shared.model.posenet import TASK_SCALE

    model, loss_fn, params, batch = model_setup("tinyvit-small", "finetune", size=4)
    assert loss_fn.combine_takes_rows
    parts = torch.rand(4, 3)
    scale = params[TASK_SCALE] + torch.tensor([0.1, -0.2, 0.3])
    shared = loss_fn.combine(parts, {TASK_SCALE: scale})
    rows = torch.stack([scale, scale + 1.0, scale, scale - 0.5])  # rows 1 and 3 weigh differently
    got = loss_fn.combine(parts, {TASK_SCALE: rows})
    for i in (0, 2):
        torch.testing.assert_close(got[i], shared[i])
    for i in (1, 3):
        torch.testing.assert_close(got[i], loss_fn.combine(parts[i:i + 1], {TASK_SCALE: rows[i]})[0])


def test_a_combine_that_does_not_take_rows_gives_the_same_sum_through_vmap():
    model, loss_fn, params, batch = model_setup("tinyvit-small", "finetune", size=5)
    by_row = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=5)
    loss_fn.combine_takes_rows = False  # a loss that does not say so: vmap(grad) of combine alone
    mapped = clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=5)
    assert torch.allclose(by_row.norms, mapped.norms, rtol=1e-5)
    _close(by_row.summed, mapped.summed, rtol=1e-5, atol=1e-7)
    assert float(by_row.summed["head.log_task_scale"].abs().sum()) > 0  # the task weights do train


def test_a_chunks_tensors_are_freed_before_the_next_chunk_runs_the_model(monkeypatch):
    """Only one chunk's activations and gradients are alive at a time: the peak memory of a step follows the
    pinned chunk, not the realised Poisson batch."""
    import weakref

    grad = torch.autograd.grad
    made: list[list[weakref.ref]] = []  # per chunk: the gradients its backward gave

    def recording(*args, **kwargs):
        got = grad(*args, **kwargs)
        made.append([weakref.ref(g) for g in got if g is not None])
        return got

    monkeypatch.setattr(torch.autograd, "grad", recording)
    model, loss_fn, params, batch = model_setup("tinyvit-small", "finetune", size=4)
    tapes = bookkeeping.iter_tapes(loss_fn, params, batch, chunk_size=2)
    first = next(tapes)
    assert len(made) == 1 and len(made[0]) > 10
    del first
    alive = []
    handle = model.register_forward_pre_hook(lambda module, args: alive.append(sum(r() is not None for r in made[0])))
    try:
        second = next(tapes)
    finally:
        handle.remove()
    assert alive == [0], f"{alive} of the first chunk's {len(made[0])} gradients were alive in the second's forward"
    assert second.size == 2
