"""Per-sample gradients (and their norms), generic over any functional loss, and the primitives every private
contribution is bounded with (P14).

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
sums them (``fedpose.shared.privacy.step.fpdp.clipped_grad_sum``) holds chunk_size x p at most,
regardless of the (Poisson, hence random) batch size.

What every private-step function checks of its inputs is here too (a batch dict of tensors that share their
leading dimension, a dict of floating-point trainable tensors, a positive chunk size), and whether the tensors a
step is given are the model's own trainable weights: then a plain forward of the model builds the graph the step
needs, with no functional swap of every tensor (``mean_grad``, ``bookkeeping``).

P14: DP-SGD bounds one record's influence on the step by clipping each per-sample gradient to L2 norm C before
the sum; patient-level DP clips each patient's mean gradient instead (McMahan et al. 2018). Every contribution is
finite with norm <= C whatever the weights: a non-finite gradient contributes zero (never an error, which would
tell whoever chose the weights that the record was sampled), a huge finite one is clipped like any other.
``bound_contributions`` is that rule; both ways of forming the clipped sum (``fpdp``'s vmap path and the
book-keeping tape, ``bookkeeping``) apply it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import Tensor, nn

LossFn = Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Tensor]


def batch_size_of(batch: Mapping[str, Tensor]) -> int:
    """Return the common leading dimension B of a batch dict, validating it.

    Every value must be a tensor with at least one dimension, and all must
    agree on B, otherwise per-sample slicing would silently pair sample i of
    one tensor with sample j of another.
    """
    if not isinstance(batch, Mapping) or len(batch) == 0:
        raise ValueError(
            f"batch must be a non-empty dict of batched tensors, got {type(batch).__name__} "
            f"of length {len(batch) if isinstance(batch, Mapping) else 'n/a'}"
        )
    sizes = {}
    for name, value in batch.items():
        if not isinstance(value, Tensor):
            raise ValueError(
                f"batch[{name!r}] is a {type(value).__name__}, not a Tensor: "
                "keep only batched tensors in the batch dict"
            )
        if value.dim() == 0:
            raise ValueError(
                f"batch[{name!r}] is a 0-d tensor: every batch tensor needs a leading "
                "batch dimension"
            )
        sizes[name] = int(value.shape[0])
    distinct = set(sizes.values())
    if len(distinct) != 1:
        raise ValueError(f"batch tensors disagree on the batch size: {sizes}")
    return distinct.pop()


def check_params(params: Mapping[str, Tensor]) -> None:
    """Refuse anything but a non-empty dict of floating point tensors."""
    if not isinstance(params, Mapping) or len(params) == 0:
        raise ValueError("params must be a non-empty dict of trainable tensors")
    for name, value in params.items():
        if not isinstance(value, Tensor) or not value.is_floating_point():
            found = value.dtype if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"params[{name!r}] must be a floating point Tensor, got {found}: pass "
                "only the trainable parameters"
            )


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r} must be a positive int (samples per vmap call; "
            "lower it to save memory)"
        )


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def own_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``dict(model.named_parameters())``, kept per model and checked by identity on every call: every private
    step asks it, and walking a pose model's modules costs about 1% of a small model's step. A parameter
    replaced by another object is seen and the walk done again."""
    slots = _SLOTS.get(model)
    if slots is None or any(module._parameters.get(attr) is not param for _, module, attr, param in slots):
        slots, seen = [], set()
        for prefix, module in model.named_modules():
            for attr, param in module._parameters.items():
                if param is not None and id(param) not in seen:  # shared weights: the first name, as torch does
                    seen.add(id(param))
                    slots.append((f"{prefix}.{attr}" if prefix else attr, module, attr, param))
        _SLOTS[model] = slots
    return {name: param for name, _, _, param in slots}


def are_the_models_own(model: nn.Module, params: Mapping[str, Tensor], combine_names: list[str]) -> bool:
    """True when ``params`` hold the model's trainable weights themselves and nothing else in it trains.

    Then a plain forward builds the same graph as one through ``params`` (only the gradients at the
    layers' outputs are asked for, never the weights'), without swapping every tensor of the model.
    ``combine_names``: parameters the loss uses after the model, which may be given as copies.
    """
    own = own_parameters(model)
    for name, param in own.items():
        value = params.get(name)
        if value is None:
            if param.requires_grad:
                return False
        elif name not in combine_names and (
            not param.requires_grad or value.data_ptr() != param.data_ptr() or value.shape != param.shape
            or value.stride() != param.stride() or value.dtype != param.dtype
        ):
            return False
    return all(name in own for name in params)


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


def chunks_of(batch: Mapping[str, Tensor], size: int, chunk_size: int, *,
              pad: bool = False) -> Iterator[tuple[dict[str, Tensor], int]]:
    """The batch in chunks of ``chunk_size`` rows, each with its count of real rows.

    ``pad`` (a site's private step): every chunk is filled up to ``chunk_size`` rows with zero rows, and an empty
    batch still gives one chunk, so what a chunk allocates (activations, per-sample gradients) has one shape
    whatever the realised batch: its peak memory, and a failure for want of memory, cannot depend on the private
    data (P13). The caller makes the padding rows contribute nothing (they are not records).
    """
    for start in range(0, max(size, 1) if pad else size, chunk_size):
        stop = min(start + chunk_size, size)
        chunk = {name: value[start:stop] for name, value in batch.items()}
        real = max(stop - start, 0)
        if pad and real < chunk_size:
            chunk = {name: torch.cat([value, value.new_zeros((chunk_size - real, *value.shape[1:]))])
                     for name, value in chunk.items()}
        yield chunk, real


def iter_per_sample_grads(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Mapping[str, Tensor],
    *,
    chunk_size: int,
    randomness: str = "different",
    pad: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Yield per-sample gradients chunk by chunk, {name: (b, *param.shape)}, b <= chunk_size.

    Lets callers consume the gradients (clip and sum, or copy into a
    preallocated matrix) without ever holding all B of them. ``pad``: every
    chunk is computed on ``chunk_size`` rows (``chunks_of``) and its real rows
    are yielded, a view of that allocation (a chunk of no real row is not yielded).
    """
    check_params(params)
    check_chunk_size(chunk_size)
    size = batch_size_of(batch)
    if size == 0 and not pad:
        return
    detached = _detached(params)
    fn = _per_sample_grad_fn(loss_fn, randomness)
    for chunk, real in chunks_of(batch, size, chunk_size, pad=pad):
        grads = fn(detached, chunk)
        if real:
            yield grads if not pad else {name: value[:real] for name, value in grads.items()}
        del grads


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
    ``fpdp.clipped_grad_sum``. ``randomness`` is passed to vmap ("different":
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


# Added to the norm before dividing, as in Opacus, so that a zero gradient
# gets the factor min(1, C / 1e-6) = 1 instead of a division by zero.
NORM_EPS = 1e-6


# Below this a float32 clip factor is subnormal and loses precision: a row that needs it (a gradient of norm
# above ~1e30 C, which only a crafted model produces) is scaled in float64 so its norm stays <= C. Both the
# generic path (fpdp.py) and the book-keeping tape (bookkeeping.py) use it.
SMALLEST_FLOAT32_FACTOR = 1e-30


class Contributions(NamedTuple):
    """What each per-sample (per-patient) gradient of a chunk may add to the clipped sum (P14): (b,) each."""

    factors: Tensor  # float64 min(1, C / (||g_i|| + 1e-6)); 0 where the norm is not finite
    finite: Tensor  # bool: the rows that contribute; the others are zeroed before scaling (0 x NaN is NaN)

    @property
    def zeroed(self) -> int:
        """How many rows contribute nothing (private: the site's own log only)."""
        return int((~self.finite).sum())


def bound_contributions(norms: Tensor, clip_norm: float) -> Contributions:
    """P14's enforcing function: every contribution to the noisy sum is finite with norm <= C, whatever the weights.

    ``norms`` (b,) float64 are the rows' L2 norms as ``robust_norms`` (or the book-keeping tape) gives
    them: recomputed in float64 where float32 overflowed, so a norm is not finite exactly when its gradient holds
    an inf or a NaN. Such a row contributes zero (never an error: an error would tell whoever chose the weights
    that the record was sampled); a huge finite one is scaled to norm C like any other. The sums add
    ``factors_i g_i`` over the ``finite`` rows only (``zero_rows`` first).
    """
    finite = torch.isfinite(norms)
    factors = (clip_norm / (norms + NORM_EPS)).clamp(max=1.0)
    return Contributions(torch.where(finite, factors, torch.zeros_like(factors)), finite)


def clip_factors(norms: Tensor, clip_norm: float) -> Tensor:
    """min(1, C / (||g_i|| + 1e-6)) per sample: (B,); 0 for a non-finite norm (P14: it contributes nothing)."""
    return bound_contributions(norms, clip_norm).factors


def check_clip_norm(clip_norm: float) -> float:
    try:
        value = float(clip_norm)
    except (TypeError, ValueError) as err:
        raise ValueError(f"clip_norm={clip_norm!r} must be a positive number") from err
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"clip_norm={clip_norm!r} must be a positive finite number (the per-sample "
            "L2 bound C; the paper uses C in {0.01, 0.1, 1.0})"
        )
    return value


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
