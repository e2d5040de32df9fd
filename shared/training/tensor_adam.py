"""Adam with one second moment per weight tensor (``train.optimizer: tensor-adam``).

Per-coordinate Adam divides every coordinate of the update by its own running RMS. Under DP the private gradient
is mostly noise in most coordinates, so Adam gives a noise-only coordinate a full-size step, and after the
projection V (V^T g) the update no longer points along the signal the projection kept. Here the second moment is
the running mean of g^2 over each tensor: inside a tensor the step is the first moment divided by one number (its
direction kept), while tensors whose gradients differ in scale by orders of magnitude (the heads, the norms, the
attention weights) still move comparable distances, which plain SGD does not give them. The same idea as NovoGrad's
layer-wise second moment (Ginsburg et al. 2019), with Adam's bias correction. Post-processing of the (noisy)
gradient: no privacy cost.
"""

from __future__ import annotations

import math

import torch


class TensorAdam(torch.optim.Optimizer):
    """m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) mean(g^2);  w <- w - lr m_hat / (sqrt(v_hat) + eps).

    ``weight_decay`` adds wd * w to g first (L2, as ``torch.optim.Adam``). ``v`` is a 0-d tensor per weight.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"TensorAdam: lr={lr}, eps={eps} must be > 0, weight_decay={weight_decay} >= 0 "
                             f"and betas={betas} in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).add_(grad.pow(2).mean(), alpha=1 - beta2)
                corrected = math.sqrt(1 - beta2 ** state["step"])
                denom = state["exp_avg_sq"].sqrt() / corrected + group["eps"]
                p.add_(state["exp_avg"] / denom, alpha=-group["lr"] / (1 - beta1 ** state["step"]))
        return loss
