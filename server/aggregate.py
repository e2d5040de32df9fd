"""Aggregating a round: every site's update norm-bounded, the sites combined, and the server optimizer's step
that applies the result to the global weights. All of it is post-processing of DP updates; a site's weight
never comes from a number it reports (P10).

A site may be hostile to the others: its reply is a vector it chose. Without a bound, one site answering
2 x crafted - global plants crafted weights in the uniform mean, and with them whatever trigger it likes
in every other site's next round. ``bound_updates`` (the default, ``federation.update_bound: median``)
scales every update d_s = w_s - w to at most the round's lower-median update norm, so with an honest
majority no single site moves the average by more than an honest site's step. ``aggregate`` then takes a
uniform mean, a coordinate-wise median or a trimmed mean (``federation.aggregator``).

The server optimizer (``federation.server_optimizer``): with w the global weights and a the sites' combined
weights, the update is d = a - w (the negative pseudo-gradient) and

- none:     w <- a                                              (plain FedAvg)
- momentum: m <- beta m + d;                     w <- w + lr m   (FedAvgM; lr 1, beta 0 is FedAvg)
- adam:     m <- b1 m + (1-b1) d; v <- b2 v + (1-b2) d^2;
            w <- w + lr m / (sqrt(v) + tau)                      (FedAdam, Reddi et al. 2021)

It is a function of the aggregated DP outputs only: no change to any site's privacy accounting.
"""

from __future__ import annotations

import torch

from fedpose.shared.configuration.schema import Config


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


class ServerOptimizer:
    """State of the server optimizer over one federation (kept in memory; see ``state_dict``)."""

    def __init__(self, kind: str = "none", *, lr: float = 1.0, momentum: float = 0.9,
                 betas: tuple[float, float] = (0.9, 0.99), tau: float = 1e-3) -> None:
        if kind not in ("none", "momentum", "adam"):
            raise ValueError(f"server optimizer {kind!r}: expected none, momentum or adam")
        self.kind, self.lr, self.momentum, self.betas, self.tau = kind, lr, momentum, betas, tau
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def apply(self, current: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """New global weights from the current ones and the sites' average (float64 math, float32 out)."""
        if self.kind == "none":
            return {name: value.to(torch.float32) for name, value in averaged.items()}
        out = {}
        for name, avg in averaged.items():
            w = current[name].detach().to(torch.float64)
            d = avg.detach().to(torch.float64) - w
            if self.kind == "momentum":
                m = self.m.get(name)
                m = d if m is None else self.momentum * m + d
                self.m[name] = m
                step = m
            else:
                b1, b2 = self.betas
                m = self.m.get(name, torch.zeros_like(d))
                v = self.v.get(name, torch.zeros_like(d))
                m = b1 * m + (1 - b1) * d
                v = b2 * v + (1 - b2) * d * d
                self.m[name], self.v[name] = m, v
                step = m / (v.sqrt() + self.tau)
            out[name] = (w + self.lr * step).to(torch.float32)
        return out

    def state_dict(self) -> dict:
        return {"kind": self.kind, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"server optimizer state is for {state.get('kind')!r}, this run uses {self.kind!r}")
        self.m, self.v = dict(state["m"]), dict(state["v"])


def server_optimizer(cfg: Config) -> ServerOptimizer:
    """The server optimizer of ``cfg.federation`` (``none``: plain FedAvg)."""
    fed = cfg.federation
    return ServerOptimizer(fed.server_optimizer, lr=fed.server_lr, momentum=fed.server_momentum)
