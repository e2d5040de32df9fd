"""Per-tensor gradient scales from public data (``train.tensor_scales: public``).

The weights of a pose network take gradients of very different sizes: at the proxy ward's public start the mean
gradient's RMS per tensor ranges from 2e-5 (stage-3 attention) to 0.5 (the task-uncertainty weights). Clipped as
one vector, a record's gradient then spends its bound C on its few largest tensors, and the public basis V is
built from the same lopsided gradients: 48 of 101 tensors keep a cosine under 0.3 with their own clipped gradient
once projected (benchmarks/projection_per_tensor.py). Adam hides that without DP by dividing each coordinate by
its running RMS, which under DP scales the noise too.

Here every tensor t is scaled by a_t = c / rms_t before clipping, with rms_t its per-sample gradients' RMS on
public data at the current weights and c their RMS over all coordinates: on public data every tensor then has the
same RMS c, and the overall scale is kept, so C means what it meant. The private step clips sum_i clip(a * g_i, C),
adds N(0, sigma^2 C^2 I), projects onto the V of the scaled public gradients and hands the result to the optimizer
as the step direction: the signal is preconditioned per tensor, the noise is not (Li et al. 2022, "Private
adaptive optimization with side information", per tensor). The scales are a function of public data and the
weights only (P2), so one record still changes the noisy sum by at most C: the accountant's input is unchanged.
Measured, it does not lift proj under SGD (docs/results/index.md, per-tensor steps under DP): spread evenly over
the tensors, the gradient no longer fits V's few directions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor

from fedpose.shared.errors import NonFinitePublicGradients
from fedpose.shared.privacy.step import bookkeeping, bookkeeping_plan
from fedpose.shared.privacy.step.persample import LossFn, iter_per_sample_grads


def per_sample_chunks(loss_fn: LossFn, params: Mapping[str, Tensor], batch: Mapping[str, Tensor], *,
                      chunk_size: int, randomness: str = "different") -> Iterator[dict[str, Tensor]]:
    """{name: (b, *shape)} per chunk of samples: from the book-keeping tape where it covers ``params``, else vmap
    (with ``randomness``, as ``persample.iter_per_sample_grads``)."""
    if bookkeeping_plan.supports(loss_fn, params):  # one forward and one backward per chunk
        return (tape.per_sample() for tape in bookkeeping.iter_tapes(loss_fn, params, batch, chunk_size=chunk_size))
    return iter_per_sample_grads(loss_fn, params, batch, chunk_size=chunk_size, randomness=randomness)


def public_scales(loss_fn: LossFn, params: Mapping[str, Tensor], public_batch: Mapping[str, Tensor], *,
                  chunk_size: int) -> dict[str, float]:
    """a_t = c / rms_t for every tensor of ``params`` (module docstring); 1 where a tensor has no public gradient.

    P2: the only data argument is a public batch. ``subspace.compute_scaled_basis`` gives the same scales with V.
    """
    return scales_of(per_sample_chunks(loss_fn, params, public_batch, chunk_size=chunk_size),
                     {name: value.numel() for name, value in params.items()})


def scales_of(chunks: Iterable[Mapping[str, Tensor]], sizes: Mapping[str, int]) -> dict[str, float]:
    """The scales of per-sample gradients given chunk by chunk ({name: (b, ...)}); non-finite rows are left out."""
    squares = dict.fromkeys(sizes, 0.0)
    rows = 0
    for grads in chunks:
        flat = {name: g.reshape(g.shape[0], -1).double() for name, g in grads.items()}
        finite = torch.stack([torch.isfinite(f).all(1) for f in flat.values()]).all(0)  # (b,)
        for name, f in flat.items():
            squares[name] += float(f[finite].pow(2).sum())
        rows += int(finite.sum())
    if rows == 0:
        raise NonFinitePublicGradients("no public sample gave a finite gradient; the tensor scales cannot be computed")
    c = math.sqrt(sum(squares.values()) / (rows * sum(sizes.values())))
    scales = {}
    for name, total in squares.items():
        rms = math.sqrt(total / (rows * sizes[name]))
        scales[name] = c / rms if rms > 0 and c > 0 else 1.0
    return scales


def scale(grads: Mapping[str, Tensor], scales: Mapping[str, float] | None) -> dict[str, Tensor]:
    """Each tensor times its scale (per-sample or not); ``scales`` None: as they are."""
    if scales is None:
        return dict(grads)
    return {name: g * scales[name] for name, g in grads.items()}
