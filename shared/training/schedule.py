"""When and how far a training step moves: the optimizer, the learning-rate schedule, a round's place in a run."""

from __future__ import annotations

import math

import torch

from fedpose.shared.configuration.schema import TrainConfig


def make_optimizer(params: list[torch.Tensor], train: TrainConfig) -> torch.optim.Optimizer:
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
    if train.optimizer == "public-adam":
        from fedpose.shared.training.public_adam import PublicAdam

        return PublicAdam(params, lr=train.lr, weight_decay=train.weight_decay, floor=train.adam_floor)
    if train.optimizer in ("tensor-adam", "dp-tensor-adam"):
        from fedpose.shared.training.tensor_adam import TensorAdam

        return TensorAdam(params, lr=train.lr, weight_decay=train.weight_decay,
                          noise_aware=train.optimizer == "dp-tensor-adam")
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of train.lr at global step ``step`` of ``total``: 1 (constant) or cosine decay to 0.

    Decaying the learning rate matters more under DP than without: late steps
    then average the noise instead of random-walking on it.
    """
    if schedule == "constant":
        return 1.0
    if total < 1 or not 0 <= step < total:
        raise ValueError(f"schedule step {step} is outside the run of {total} steps")
    return 0.5 * (1.0 + math.cos(math.pi * step / total))


def round_span(round: int, steps: int, rounds: int) -> tuple[int, int]:
    """``LocalRun.schedule_span`` of federated round ``round`` (1-based) of ``rounds``, ``steps`` local steps each.

    Rounds beyond the plan (a resumed server with more rounds) extend the run
    instead of failing.
    """
    if round < 1 or steps < 1:
        raise ValueError(f"round={round} and steps={steps} must be >= 1")
    return (round - 1) * steps, max(rounds, round) * steps


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Expected steps for one pass over n records at expected batch size B: ceil(n / B)."""
    return max(1, math.ceil(n / batch_size))
