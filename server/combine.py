"""Combining the sites' updates: uniform mean, coordinate-wise median or trimmed mean (post-processing
of DP updates; a site's weight never comes from a number it reports, P10).
"""

from __future__ import annotations

import torch


def aggregate(updates: list[dict[str, torch.Tensor]], how: str = "mean") -> dict[str, torch.Tensor]:
    """Combine the sites' trainable tensors: uniform mean, coordinate-wise median, or trimmed mean.

    Uniform: a site's weight never comes from a number it reports (a reply claiming 10^12 examples
    would otherwise dominate), and n stays private (P10). All three are post-processing of DP updates.
    """
    if not updates:
        raise ValueError("aggregate needs at least one update")
    if how == "trimmed-mean" and len(updates) < 3:
        raise ValueError(f"trimmed-mean needs at least 3 updates, got {len(updates)}")
    out = {}
    for name in updates[0]:
        stacked = torch.stack([u[name].to(torch.float64) for u in updates])  # (sites, *shape)
        if how == "mean":
            value = stacked.mean(dim=0)
        elif how == "median":
            value = stacked.median(dim=0).values if len(updates) % 2 else stacked.sort(dim=0).values[
                len(updates) // 2 - 1: len(updates) // 2 + 1].mean(dim=0)
        elif how == "trimmed-mean":
            value = stacked.sort(dim=0).values[1:-1].mean(dim=0)
        else:
            raise ValueError(f"aggregator {how!r} is not one of mean, median, trimmed-mean")
        out[name] = value.to(torch.float32)
    return out


def fedavg(updates: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Uniform average of the sites' trainable tensors (``aggregate(updates, "mean")``)."""
    return aggregate(updates, "mean")
