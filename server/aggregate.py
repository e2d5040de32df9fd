"""Server-side optimizer on the averaged update (FedAvgM / FedAdam; ``federation.server_optimizer``).

With w the global weights and a = fedavg of the sites' weights, the update is
d = a - w (the negative pseudo-gradient) and

- none:     w <- a                                              (plain FedAvg)
- momentum: m <- beta m + d;                     w <- w + lr m   (FedAvgM; lr 1, beta 0 is FedAvg)
- adam:     m <- b1 m + (1-b1) d; v <- b2 v + (1-b2) d^2;
            w <- w + lr m / (sqrt(v) + tau)                      (FedAdam, Reddi et al. 2021)

Everything here is a function of the aggregated DP outputs only: post-processing,
no change to any site's privacy accounting.
"""

from __future__ import annotations

import torch

from fedpose.shared.configuration.schema import Config


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
