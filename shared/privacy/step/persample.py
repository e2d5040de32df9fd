"""Per-sample gradients (and their norms), generic over any functional loss.

DP-SGD (Abadi et al. 2016; FP-DP Algorithm 1, line "g_i = grad l(w, x_i)")
needs the gradient of every sample separately so that each one can be clipped
to norm C before they are summed: that bounds one record's influence on the
sum (the L2 sensitivity) by C, which is what the accountant assumes.

The loss interface shared with the model and the training loop is

    loss_fn(params: dict[str, Tensor], batch: dict[str, Tensor]) -> Tensor (B,)

where ``params`` are the trainable parameters (the caller closes over frozen
ones, e.g. with ``torch.func.functional_call``) and ``batch`` holds batched
tensors that share their leading dimension B. A per-sample call is the same
function with B = 1: we ``vmap`` over ``grad`` of that single-sample loss.

Memory: per-sample gradients cost B x p floats. ``iter_per_sample_grads``
yields them in chunks of ``chunk_size`` samples, so a consumer that clips and
sums them (``fedpose.shared.privacy.step.clipping``) holds chunk_size x p at most,
regardless of the (Poisson, hence random) batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from fedpose.shared.privacy.step.batch_checks import batch_size_of, check_chunk_size, check_params
from fedpose.shared.privacy.step.own_weights import are_the_models_own, own_parameters

LossFn = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Tensor]


def _detached(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    # torch.func.grad differentiates w.r.t. its own inputs; detaching keeps the
    # caller's autograd graph (if any) out of the per-sample computation.
    return {name: value.detach() for name, value in params.items()}


def _per_sample_grad_fn(loss_fn: LossFn, randomness: str) -> Callable:
    """vmap(grad(single-sample loss)) over the batch dimension of ``batch``."""

    def single_loss(params: dict[str, Tensor], sample: dict[str, Tensor]) -> Tensor:
        # Under vmap a "sample" has lost its batch dimension: give it back a
        # batch of one so the model sees the usual (1, ...) shapes.
        one = {name: value.unsqueeze(0) for name, value in sample.items()}
        losses = loss_fn(params, one)  # (1,)
        if losses.dim() != 1 or losses.shape[0] != 1:
            raise ValueError(
                "loss_fn must return per-sample losses of shape (B,); for B = 1 it "
                f"returned shape {tuple(losses.shape)}"
            )
        return losses.sum()

    return torch.func.vmap(
        torch.func.grad(single_loss), in_dims=(None, 0), randomness=randomness
    )


def _chunks(batch: Mapping[str, Tensor], size: int, chunk_size: int):
    for start in range(0, size, chunk_size):
        stop = min(start + chunk_size, size)
        yield {name: value[start:stop] for name, value in batch.items()}


def iter_per_sample_grads(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    *,
    chunk_size: int,
    randomness: str = "different",
) -> Iterator[dict[str, Tensor]]:
    """Yield per-sample gradients chunk by chunk, {name: (b, *param.shape)}, b <= chunk_size.

    Lets callers consume the gradients (clip and sum, or copy into a
    preallocated matrix) without ever holding all B of them.
    """
    check_params(params)
    check_chunk_size(chunk_size)
    size = batch_size_of(batch)
    if size == 0:
        return
    detached = _detached(params)
    fn = _per_sample_grad_fn(loss_fn, randomness)
    for chunk in _chunks(batch, size, chunk_size):
        yield fn(detached, chunk)


def per_sample_grads(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    *,
    chunk_size: int,
    randomness: str = "different",
) -> dict[str, Tensor]:
    """Unclipped per-sample gradients, {name: (B, *param.shape)}.

    This materialises all B gradients (B x p floats): use it for tests and
    small batches, never for the private step, which uses
    ``clipping.clipped_grad_sum``. ``randomness`` is passed to vmap ("different":
    independent dropout masks per sample).
    """
    check_params(params)
    parts: dict[str, list[Tensor]] = {name: [] for name in params}
    for grads in iter_per_sample_grads(
        loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness
    ):
        for name in parts:
            parts[name].append(grads[name])
    if not next(iter(parts.values())):  # empty batch
        return {name: value.new_zeros((0, *value.shape)) for name, value in params.items()}
    return {name: torch.cat(chunks, dim=0) for name, chunks in parts.items()}


def per_sample_norms(grads: Mapping[str, Tensor]) -> Tensor:
    """Flat L2 norm over ALL parameters of each sample's gradient: (B,) float64.

    The clipping bound C applies to the whole gradient vector of a sample
    (flat clipping), which is the sensitivity the accountant assumes. A float32
    norm overflows for gradients above ~1e19 (its squares exceed the float32
    range) although they are finite: such rows are recomputed in float64, where
    the squares of any float32 value cannot overflow. A row is non-finite here
    exactly when the gradient holds an inf or a NaN (P14).
    """
    flats = [g.reshape(g.shape[0], -1) for g in grads.values()]
    return robust_norms(flats)


def robust_norms(flats: list[Tensor]) -> Tensor:
    """(B,) float64 norms of the rows of the per-parameter blocks ``flats`` (each (B, numel))."""
    per_param = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flats], dim=0)  # (params, B)
    norms = torch.linalg.vector_norm(per_param.to(torch.float64), dim=0)  # (B,)
    odd = ~torch.isfinite(norms)
    if bool(odd.any()):  # an overflowed float32 norm, or a real inf / NaN: decide in float64
        rows = odd.nonzero().flatten()
        exact = [torch.linalg.vector_norm(f[rows], dim=1, dtype=torch.float64) for f in flats]
        norms[rows] = torch.linalg.vector_norm(torch.stack(exact, dim=0), dim=0)
    return norms


def zero_rows(rows: Tensor, keep: Tensor) -> Tensor:
    """``rows`` (b, ...) with the rows where ``keep`` (b,) is False set to zero, in its dtype and device.

    P14: a row left out of a clipped sum is zeroed before it is scaled and summed, since 0 x NaN is NaN.
    """
    shape = (keep.shape[0],) + (1,) * (rows.dim() - 1)
    return torch.where(keep.view(shape), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _check_losses(losses: Tensor, size: int) -> None:
    if losses.dim() != 1 or losses.shape[0] != size:
        raise ValueError(f"loss_fn must return per-sample losses of shape ({size},), got {tuple(losses.shape)}")


def mean_grad(
    loss_fn: LossFn, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Plain (non-private) gradient of the mean loss over the batch.

    Used for the non-private baseline and for the public gradient on psi(x).
    An empty batch gives zeros (no samples, no signal) rather than NaN.
    """
    check_params(params)
    size = batch_size_of(batch)
    detached = _detached(params)
    if size == 0:
        return {name: torch.zeros_like(value) for name, value in detached.items()}
    model = getattr(loss_fn, "model", None)
    if isinstance(model, nn.Module) and hasattr(loss_fn, "parts") and hasattr(loss_fn, "combine") \
            and are_the_models_own(model, params, []):
        # the model's own weights: one plain forward and backward, as a non-private step runs it (the
        # functional transform below costs a tenth more on a small model)
        own = own_parameters(model)
        weights = {name: own[name] for name in params}
        with torch.enable_grad():
            losses = loss_fn.combine(loss_fn.parts(None, batch), weights)
            _check_losses(losses, size)
            grads = torch.autograd.grad(losses.mean(), list(weights.values()), allow_unused=True)
        return {name: torch.zeros_like(weights[name]) if g is None else g for name, g in zip(weights, grads)}

    def mean_loss(p: dict[str, Tensor]) -> Tensor:
        losses = loss_fn(p, batch)
        _check_losses(losses, size)
        return losses.mean()

    return torch.func.grad(mean_loss)(detached)
