"""PoseNet's functional per-sample loss over the trainable parameters, the one the private step differentiates.

``PoseNet.task_losses`` computes the per-sample task losses; here they become a function of the trainable tensors
alone (``torch.func``), split into ``parts`` and ``combine`` for book-keeping clipping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from fedpose.shared.model.posenet import TASK_SCALE, PoseNet
from fedpose.shared.model.simcc import combine_task_losses


class PoseLoss:
    """Functional per-sample loss ``loss(params, batch) -> (B,)`` over the trainable params.

    Frozen parameters and buffers are closed over (detached), so ``torch.func.grad``
    differentiates only what the strategy trains. It also shows the loss's structure
    to book-keeping clipping (``fedpose.shared.privacy.step.bookkeeping``): ``parts`` runs the model
    to the per-sample task losses, ``combine`` weighs them, and ``combine_names`` are
    the parameters only ``combine`` uses (the task-uncertainty weights).
    """

    # combine() also takes the task weights as one copy per row, (B, T), each row's total using its own:
    # book-keeping then gets every sample's task-weight gradient from the step's one backward
    combine_takes_rows = True

    def __init__(self, model: PoseNet, trainable: list[str]) -> None:
        keep = set(trainable)
        unknown = keep - {n for n, _ in model.named_parameters()}
        if unknown:
            raise ValueError(f"not parameters of the model: {sorted(unknown)[:5]}")
        self.model = model
        self.combine_names = (TASK_SCALE,)
        self._wrapper = _LossModule(model, tasks=True)
        self._frozen = {f"m.{n}": p.detach() for n, p in model.named_parameters() if n not in keep}
        self._buffers = {f"m.{n}": b for n, b in model.named_buffers()}

    def parts(self, params: dict[str, torch.Tensor] | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample task losses (B, T) with the trainable tensors taken from ``params`` (None: the model's own)."""
        if params is None:
            return self._wrapper(batch)
        tensors = {**self._frozen, **self._buffers, **{f"m.{n}": p for n, p in params.items()}}
        return functional_call(self._wrapper, tensors, (batch,))

    def combine(self, parts: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T) task losses -> (B,) total, with the task weights from ``params`` when they train."""
        scale = params.get(TASK_SCALE, self._frozen.get(f"m.{TASK_SCALE}"))
        return combine_task_losses(parts, scale, vis_weight=self.model.cfg.vis_weight)

    def __call__(self, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.combine(self.parts(params, batch), params)


def make_loss_fn(model: PoseNet, trainable: list[str]) -> PoseLoss:
    """The functional per-sample loss over ``trainable`` (see ``PoseLoss``)."""
    return PoseLoss(model, trainable)


class _LossModule(nn.Module):
    """Routes ``functional_call`` to ``PoseNet.losses`` (or ``task_losses``) instead of ``forward``."""

    def __init__(self, model: PoseNet, *, tasks: bool = False) -> None:
        super().__init__()
        self.m = model
        self.tasks = tasks

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.m.task_losses(batch) if self.tasks else self.m.losses(batch)
