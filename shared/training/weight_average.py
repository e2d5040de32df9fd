"""An exponential moving average of the trained weights (``train.ema``), kept beside the training loop.

De et al. 2022 ("Unlocking high-accuracy differentially private image classification through scale",
section 3.2) average the iterates of DP-SGD: each step's update carries fresh Gaussian noise, the average
of the last ~1 / (1 - decay) weights carries less of it, and the model released at the end is the average.
It is post-processing of the DP updates (a function of the released iterates only): no privacy cost.
"""

from __future__ import annotations

import torch


class WeightAverage:
    """w_ema <- decay * w_ema + (1 - decay) * w after every optimizer step; ``copy_to`` puts w_ema in the model.

    ``params`` are the trained tensors (the strategy's); frozen ones do not move and need no average. The
    average starts at the weights the run starts from.
    """

    def __init__(self, params: list[torch.Tensor], *, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay={decay!r} must be in (0, 1) (train.ema; 0 turns the average off)")
        self.decay = float(decay)
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        for avg, p in zip(self.shadow, self.params):
            avg.lerp_(p.detach(), 1.0 - self.decay)  # avg + (1 - decay) (p - avg)

    @torch.no_grad()
    def copy_to(self) -> None:
        """Write the average into the trained tensors (the model the run releases)."""
        for avg, p in zip(self.shadow, self.params):
            p.copy_(avg)
