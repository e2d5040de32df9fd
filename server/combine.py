"""Combining the sites' updates: each update's norm bounded, then a uniform mean, coordinate-wise median or
trimmed mean (post-processing of DP updates; a site's weight never comes from a number it reports, P10).

A site may be hostile to the others: its reply is a vector it chose. Without a bound, one site answering
2 x crafted - global plants crafted weights in the uniform mean, and with them whatever trigger it likes
in every other site's next round. ``bound_updates`` (the default, ``federation.update_bound: median``)
scales every update d_s = w_s - w to at most the round's lower-median update norm, so with an honest
majority no single site moves the average by more than an honest site's step.
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


def bound_updates(updates: list[dict[str, torch.Tensor]], global_weights: dict[str, torch.Tensor], how: str,
                  ) -> tuple[list[dict[str, torch.Tensor]], float | None, list[int]]:
    """Scale every site's update w_s - w to norm <= tau, tau the lower median of this round's update norms.

    Returns (the bounded weights w + d_s', tau, the indices of the updates that were scaled). ``how``:
    ``median`` (the bound) or ``none`` (updates unchanged, tau None). The lower median (the ceil(S/2)-th
    smallest norm) is one of the honest norms whenever more than half of the sites are honest; with two
    sites it is the smaller one.
    """
    if how == "none":
        return updates, None, []
    if how != "median":
        raise ValueError(f"update bound {how!r} is not one of median, none")
    if not updates:
        raise ValueError("bound_updates needs at least one update")
    deltas = [{name: u[name].to(torch.float64) - global_weights[name].to(torch.float64) for name in u}
              for u in updates]
    # as_tensor: sum() of tensors is typed Tensor | 0; each delta has tensors, so it returns its (exact) sum
    norms = [float(torch.sqrt(torch.as_tensor(sum((d * d).sum() for d in delta.values())))) for delta in deltas]
    tau = sorted(norms)[(len(norms) + 1) // 2 - 1]
    out, scaled = [], []
    for i, (delta, norm) in enumerate(zip(deltas, norms)):
        factor = 1.0 if norm <= tau or norm == 0 else tau / norm
        if factor < 1.0:
            scaled.append(i)
        out.append({name: (global_weights[name].to(torch.float64) + factor * d).to(torch.float32)
                    for name, d in delta.items()})
    return out, tau, scaled
