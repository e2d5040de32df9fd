"""Non-private pretraining on public data only: the starting point of finetune / full training.

BatchNorm is active here (batch statistics are fine without privacy) and is folded
into the convolutions before any private step (``fedpose.shared.model``).
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.training.batches import to_device


def pretrain_loop(
    model: PoseNet,
    dataset: PoseDataset,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
    progress: bool = True,
) -> float:
    """Plain non-private minibatch training (AdamW, cosine LR) of an unfused model on public data.

    Used for public pretraining only: BatchNorm is active here (batch
    statistics are fine without privacy) and is folded afterwards.
    Returns the mean loss of the last 10% of steps.
    """
    if len(dataset) == 0:
        raise ValueError("the public dataset is empty: nothing to pretrain on")
    device = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    tail: list[float] = []
    order = rng.permutation(len(dataset))
    pos = 0
    bar = tqdm(range(steps), desc="pretrain (public)", disable=not progress, leave=False, dynamic_ncols=True)
    for step in bar:
        if pos + batch_size > len(order):
            order, pos = rng.permutation(len(dataset)), 0
        idx = order[pos : pos + batch_size].tolist()
        pos += batch_size
        loss = model.losses(to_device(dataset.batch(idx), device)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step >= steps - max(1, steps // 10):
            tail.append(float(loss.detach()))
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    return float(np.mean(tail))
