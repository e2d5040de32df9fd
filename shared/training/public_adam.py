"""Adam whose second moment comes from public data (``train.optimizer: public-adam``).

Under DP-SGD Adam's second moment fills with the noise: sigma C / B per coordinate and step, at the ward's start
about 57 times the RMS of the mean clipped gradient, so DP-Adam divides every coordinate by about the same number
and steps like SGD with one rate for all of them. SGD with one rate is what caps record-level DP on the ward even
without noise (docs/results/index.md): the weights of a pose network take gradients of very different sizes.

Here the first moment is the step's gradient (the DP gradient, or the plain one without DP), and the second moment
is the running mean of the squared mean gradient of a public batch at the same weights (``observe_public``, called
before every ``step``): Adam's per-coordinate conditioning, read from public data only (P2). The step divides the
private first moment by a function of public data and the weights, which is post-processing of the DP output:
one record still moves the released sum by at most C, and the accountant's input is unchanged.

Where the public gradient of a coordinate is small its noisy private step is divided by a small number. ``floor``
bounds that: no coordinate is divided by less than ``floor`` times the RMS over all coordinates of the public
second moment's square root (public too). With ``floor`` 0 and the public gradient equal to the step's, this is
``torch.optim.Adam`` (``tests/test_public_adam.py``). The same idea as Li et al. 2022 (AdaDPS) and Amid et al.
2022 (public data-assisted mirror descent), with the moments of Adam.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PublicAdam(torch.optim.Optimizer):
    """m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g_pub^2 (``observe_public``);
    w <- w - lr m_hat / (max(sqrt(v_hat), floor * rms(sqrt(v_hat))) + eps).

    ``weight_decay`` adds wd * w to g (L2, as ``torch.optim.Adam``). A ``step`` without a fresh public gradient
    is refused: the second moment would be stale, or empty at the first step.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, floor: float = 0.0) -> None:
        if not lr > 0 or not eps > 0 or weight_decay < 0 or not 0 <= floor < 1 \
                or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"PublicAdam: lr={lr} and eps={eps} must be > 0, weight_decay={weight_decay} >= 0, "
                             f"floor={floor} in [0, 1) and betas={betas} in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.floor = floor
        self.fresh = False

    def _weights(self) -> list[tuple[dict, torch.Tensor]]:
        """(its param group, the weight) for every weight, in the order the weights were given."""
        return [(group, p) for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def observe_public(self, grads: Sequence[torch.Tensor]) -> None:
        """The public batch's mean gradient at the current weights, one tensor per weight in the given order."""
        weights = self._weights()
        if len(grads) != len(weights) or any(g.shape != p.shape for g, (_, p) in zip(grads, weights)):
            raise ValueError(f"observe_public needs one public gradient for each of the {len(weights)} weights, "
                             f"of its shape; got {len(grads)}")
        for (group, p), g in zip(weights, grads):
            g = g.to(p.dtype)
            state = self._state(p)
            state["public_steps"] += 1
            state["exp_avg_sq"].mul_(group["betas"][1]).addcmul_(g, g, value=1 - group["betas"][1])
        self.fresh = True

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["public_steps"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if not self.fresh:
            raise RuntimeError("PublicAdam.step needs the public batch's gradient at the current weights first "
                               "(observe_public)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weights = self._weights()
        roots: dict[torch.Tensor, torch.Tensor] = {}  # sqrt(v_hat) of each weight
        for group, p in weights:
            state = self._state(p)
            roots[p] = (state["exp_avg_sq"] / (1 - group["betas"][1] ** state["public_steps"])).sqrt()
        least = 0.0
        if self.floor > 0:  # the RMS of every divisor: only where a floor is asked for
            count = sum(root.numel() for root in roots.values())
            least = self.floor * (sum(float(root.double().pow(2).sum()) for root in roots.values()) / count) ** 0.5
        for group, p in weights:
            if p.grad is None:
                continue
            grad = p.grad
            if group["weight_decay"]:
                grad = grad.add(p, alpha=group["weight_decay"])
            state = self._state(p)
            state["step"] += 1
            state["exp_avg"].mul_(group["betas"][0]).add_(grad, alpha=1 - group["betas"][0])
            denom = roots[p].clamp_min_(least).add_(group["eps"])  # roots are >= 0: a floor of 0 changes nothing
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - group["betas"][0] ** state["step"]))
        self.fresh = False
        return loss
