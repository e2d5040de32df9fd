"""A site's private step pads every chunk of per-sample gradients to its policy's ``chunk_size``: the tensors a
chunk allocates have the same shape whatever the realised (Poisson, private) batch, so its peak memory, and an
out-of-memory failure, cannot depend on the private data; the padding rows add exactly nothing to the sum."""

from __future__ import annotations

import pytest
import torch

from fedpose.shared.privacy.step.fpdp import clipped_grad_sum, clipped_group_sum
from fedpose.shared.privacy.step.persample import iter_per_sample_grads
from support.models import generic_loss, model_setup

CHUNK = 4


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(b[name].abs().max()), 1e-6)
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-4 * scale), (name, (a[name] - b[name]).abs().max())


@pytest.mark.invariant("P13")
@pytest.mark.parametrize("path", ["tape", "vmap"])
@pytest.mark.parametrize("size", [0, 1, 3, 4, 6])
def test_padding_rows_add_nothing_to_the_clipped_sum(path, size):
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=size)
    fn = loss_fn if path == "tape" else generic_loss(loss_fn)
    padded = clipped_grad_sum(fn, params, batch, clip_norm=0.05, chunk_size=CHUNK, pad=True)
    plain = clipped_grad_sum(fn, params, batch, clip_norm=0.05, chunk_size=CHUNK, pad=False)
    assert padded.norms.shape == (size,) and padded.zeroed == plain.zeroed == 0
    assert torch.allclose(padded.norms, plain.norms, rtol=1e-5)
    _close(padded.summed, plain.summed)
    if size == 0:
        assert all(float(v.abs().max()) == 0.0 for v in padded.summed.values())


@pytest.mark.invariant("P13")
@pytest.mark.parametrize("size", [1, 5, 6])
def test_padding_rows_add_nothing_to_the_group_sum(size):
    model, loss_fn, params, batch = model_setup("tinyvit-5m", "finetune", size=size)
    groups = torch.arange(size).div(2, rounding_mode="floor")  # pairs of rows: augmented copies of one record
    padded = clipped_group_sum(loss_fn, params, batch, groups=groups, clip_norm=0.05, chunk_size=CHUNK, pad=True)
    plain = clipped_group_sum(loss_fn, params, batch, groups=groups, clip_norm=0.05, chunk_size=CHUNK, pad=False)
    assert torch.allclose(padded.norms, plain.norms, rtol=1e-5)
    _close(padded.summed, plain.summed)


@pytest.mark.invariant("P13")
def test_every_private_chunk_runs_the_model_on_chunk_size_rows_whatever_the_batch():
    model, loss_fn, params, _ = model_setup("tinyvit-5m", "finetune")
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(int(args[0].shape[0])))
    try:
        for size in (0, 1, 3, 4, 5, 9):
            seen.clear()
            _, _, _, batch = model_setup("tinyvit-5m", "finetune", size=size)
            clipped_grad_sum(loss_fn, params, batch, clip_norm=0.05, chunk_size=CHUNK, pad=True)
            assert seen and set(seen) == {CHUNK}, (size, seen)
            assert len(seen) == max(1, -(-size // CHUNK))
    finally:
        handle.remove()


@pytest.mark.invariant("P13")
def test_the_per_sample_gradients_of_a_padded_chunk_are_allocated_at_chunk_size_rows():
    model, loss_fn, params, _ = model_setup("tinyvit-5m", "finetune")
    for size in (1, 3, 6):
        _, _, _, batch = model_setup("tinyvit-5m", "finetune", size=size)
        got = list(iter_per_sample_grads(generic_loss(loss_fn), params, batch, chunk_size=CHUNK, pad=True))
        assert sum(next(iter(g.values())).shape[0] for g in got) == size  # the real rows only are handed on
        for grads in got:
            for value in grads.values():  # a view of the chunk's whole allocation, CHUNK rows of it
                assert value.untyped_storage().nbytes() >= CHUNK * value[0].nelement() * value.element_size()
