"""Poisson subsampling of a site's private records (invariant P4).

The accountants (RDP and PRV for the Poisson-subsampled Gaussian mechanism)
assume that every record enters each step's batch independently with
probability q. Fixed-size shuffled batches are a different mechanism with a
different (and, for RDP, not covered) analysis, so the private batch must be
drawn with this function and with the q reported to the accountant.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def check_sample_rate(sample_rate: float) -> float:
    """Validate q in (0, 1] and return it as a float."""
    try:
        value = float(sample_rate)
    except (TypeError, ValueError) as err:
        raise ValueError(f"sample_rate={sample_rate!r} must be a number in (0, 1]") from err
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(
            f"sample_rate={sample_rate!r} must be in (0, 1] (q = expected batch size / "
            "site size n)"
        )
    return value


def poisson_sample(n: int, *, sample_rate: float, generator: torch.Generator) -> Tensor:
    """Indices of a Poisson batch: each of range(n) kept independently with prob q.

    Returns a sorted int64 CPU tensor; its length is random (Binomial(n, q)),
    possibly 0 - an empty batch is a valid step (the noise is still added).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"n={n!r} must be an int (number of private records at the site)")
    if n < 1:
        raise ValueError(
            f"n={n} records: the site is empty, there is nothing to sample; give the site data "
            "or leave it out of the federation"
        )
    q = check_sample_rate(sample_rate)
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be a torch.Generator (see noise.make_generator), got "
            f"{type(generator).__name__}"
        )
    draws = torch.rand(n, generator=generator, device=generator.device)  # (n,)
    return torch.nonzero(draws < q, as_tuple=False).reshape(-1).to(device="cpu", dtype=torch.long)


def augmented_copies(indices: Tensor, copies: int) -> tuple[Tensor, Tensor]:
    """Rows of a batch with ``copies`` augmented copies of every sampled record, and the record of each row.

    Augmentation multiplicity (De et al. 2022): (B,) record indices -> rows (B * K,), each index K times in a
    row (the dataset draws a fresh augmentation for every row), and groups (B * K,) = 0, ..., 0, 1, ..., B - 1,
    the form ``fpdp.clipped_group_sum`` clips one mean per group with. The Poisson draw itself is unchanged:
    the accountant's q is the records', not the rows'.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies={copies!r} must be a positive int (privacy.augment_multiplicity)")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-d, got shape {tuple(indices.shape)}")
    rows = indices.repeat_interleave(copies)  # (B * K,)
    groups = torch.arange(indices.numel(), dtype=torch.long).repeat_interleave(copies)  # (B * K,)
    return rows, groups
