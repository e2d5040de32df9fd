"""Adam with one second moment per weight tensor (``train.optimizer: tensor-adam``).

Per-coordinate Adam divides every coordinate of the update by its own running RMS. Under DP the private gradient
is mostly noise in most coordinates, so Adam gives a noise-only coordinate a full-size step, and after the
projection V (V^T g) the update no longer points along the signal the projection kept. Here the second moment is
the running mean of g^2 over each tensor: inside a tensor the step is the first moment divided by one number (its
direction kept), while tensors whose gradients differ in scale by orders of magnitude (the heads, the norms, the
attention weights) still move comparable distances, which plain SGD does not give them. The same idea as NovoGrad's
layer-wise second moment (Ginsburg et al. 2019), with Adam's bias correction. Post-processing of the (noisy)
gradient: no privacy cost.

Under DP that is not enough: a tensor whose projected gradient is mostly noise has a second moment of about the
noise variance, so it too takes full-size steps, of noise. ``train.optimizer: dp-tensor-adam`` is told each
tensor's noise variance per coordinate, which is public (sigma C / B, and V's rows in the tensor:
``noise_variances``), and scales each tensor's step by its signal share s^2 / (s^2 + the noise variance left in the
first moment), with s^2 the running mean of g^2 less the noise variance: a noise-dominated tensor barely moves,
a signal-dominated one steps as with tensor-adam (the per-tensor form of a Wiener filter). Told no noise, it is
tensor-adam.

Measured on the record-level proxy (docs/results/index.md, per-tensor steps under DP): without DP tensor-adam
comes within 2 points of Adam; under the projection neither beats SGD with momentum, because V's few directions
keep the tensors with large gradients and little of the others' (benchmarks/projection_per_tensor.py).
"""

from __future__ import annotations

import math

import torch


class TensorAdam(torch.optim.Optimizer):
    """m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) mean(g^2);  w <- w - lr m_hat / (sqrt(v_hat) + eps).

    ``weight_decay`` adds wd * w to g first (L2, as ``torch.optim.Adam``). ``v`` is a 0-d tensor per weight.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, noise_aware: bool = False) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"TensorAdam: lr={lr}, eps={eps} must be > 0, weight_decay={weight_decay} >= 0 "
                             f"and betas={betas} in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.noise_aware = noise_aware
        self.noise: dict[torch.Tensor, float] = {}

    def set_noise_variance(self, variances: list[float]) -> None:
        """Each weight's DP noise variance per coordinate, in the order the weights were given (noise_aware only)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if not self.noise_aware:
            raise ValueError("this optimizer does not take the noise variance; use train.optimizer: dp-tensor-adam")
        if len(variances) != len(params) or not all(math.isfinite(v) and v >= 0 for v in variances):
            raise ValueError(f"set_noise_variance needs one finite variance >= 0 for each of the {len(params)} "
                             f"weight tensors, got {len(variances)}")
        self.noise = dict(zip(params, (float(v) for v in variances)))

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
                t = state["step"]
                second = state["exp_avg_sq"] / (1 - beta2 ** t)  # v_hat
                noise = self.noise.get(p, 0.0)
                gain: torch.Tensor | float = 1.0
                if noise > 0:
                    # the noise variance left in m_hat (an exponential average of t independent draws)
                    in_first = noise * (1 - beta1) * (1 - beta1 ** (2 * t)) / ((1 + beta1) * (1 - beta1 ** t) ** 2)
                    second = (second - noise).clamp_min(0.0)  # s^2: the signal's share of v_hat
                    gain = second / (second + in_first)
                step = state["exp_avg"] * (gain / (second.sqrt() + group["eps"]))
                p.add_(step, alpha=-group["lr"] / (1 - beta1 ** t))
        return loss


def noise_variances(sizes: list[tuple[str, int]], sorted_names: list[str], *, std: float,
                    basis: torch.Tensor | None) -> list[float]:
    """Each weight's DP noise variance per coordinate in the step's update, in the order of ``sizes``.

    ``sizes``: (name, numel) of the trained weights in the optimizer's order; ``std``: the noise std per coordinate
    before projection (sigma C / B). Without V the noise is N(0, std^2 I): std^2 everywhere. Projected,
    V (V^T z) = V w with w ~ N(0, std^2 I_k), so a tensor's rows V_t of V carry std^2 ||V_t||_F^2 of it, spread
    over its coordinates. ``basis`` rows follow ``sorted_names`` (``subspace.flat_vector``'s order).
    """
    if basis is None:
        return [std ** 2] * len(sizes)
    numel = dict(sizes)
    offset, rows = 0, {}
    for name in sorted_names:
        rows[name] = float(basis[offset:offset + numel[name]].double().pow(2).sum())
        offset += numel[name]
    if offset != basis.shape[0]:
        raise ValueError(f"V has {basis.shape[0]} rows, the trained weights {offset} coordinates")
    return [std ** 2 * rows[name] / n for name, n in sizes]
