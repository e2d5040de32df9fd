"""SimCC coordinate-classification head, its targets, loss and decoder.

SimCC (Li et al., ECCV 2022) treats each coordinate of each joint as a
classification over ``split_ratio`` bins per input pixel: x over W*s bins,
y over H*s bins. Targets are 1-D Gaussians (label smoothing), the loss is
the KL divergence between target and predicted distributions. A third task
predicts whether each joint is visible. The three task losses can be weighted
by learned homoscedastic uncertainty (Kendall et al. 2018, as used for DP
multi-task learning in DPLH): sum_i L_i / (2 s_i^2) + log s_i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedpose.shared.model.layers import LayerNorm2d


class SimCCHead(nn.Module):
    """Features (B, C, h, w) -> x logits (B, K, W*s), y logits (B, K, H*s), vis logits (B, K).

    A 1x1 conv gives each joint ``joint_channels`` feature maps; a joint-shared
    MLP turns each joint's flattened maps into the two 1-D distributions.
    ``norm`` sits first so the key ``head.norm.*`` matches timm's TinyViT.
    """

    def __init__(
        self,
        in_channels: int,
        feature_size: tuple[int, int],
        input_size: tuple[int, int],
        *,
        num_joints: int,
        split_ratio: float,
        joint_channels: int,
        hidden: int,
        task_uncertainty: bool,
        num_tasks: int = 3,
    ) -> None:
        super().__init__()
        fh, fw = feature_size
        h, w = input_size
        self.num_joints = num_joints
        self.joint_channels = joint_channels
        self.norm = LayerNorm2d(in_channels)
        self.final = nn.Conv2d(in_channels, num_joints * joint_channels, 1)
        self.mlp = nn.Sequential(nn.Linear(joint_channels * fh * fw, hidden), nn.GELU())
        self.x_head = nn.Linear(hidden, int(round(w * split_ratio)))
        self.y_head = nn.Linear(hidden, int(round(h * split_ratio)))
        self.vis_head = nn.Linear(hidden, 1)
        # log s_i for (x, y, visibility) and any face task after them (shared.model.face_head); trained like any
        # other parameter (also under DP).
        self.log_task_scale = nn.Parameter(torch.zeros(num_tasks)) if task_uncertainty else None

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b = feats.shape[0]
        z = self.final(self.norm(feats))  # (B, K*g, h, w)
        z = z.reshape(b, self.num_joints, -1)  # (B, K, g*h*w)
        z = self.mlp(z)  # (B, K, hidden)
        return self.x_head(z), self.y_head(z), self.vis_head(z).squeeze(-1)


def gaussian_targets(coords: torch.Tensor, bins: int, *, split_ratio: float, sigma: float) -> torch.Tensor:
    """1-D Gaussian label distributions: coords (B, K) in input px -> (B, K, bins), rows sum to 1.

    Bin b covers [b/s, (b+1)/s) px; the Gaussian is centred on coords*s with
    standard deviation ``sigma`` bins.
    """
    grid = torch.arange(bins, dtype=coords.dtype, device=coords.device)  # (bins,)
    mu = (coords * split_ratio).unsqueeze(-1)  # (B, K, 1)
    logits = -((grid - mu) ** 2) / (2.0 * sigma**2)
    return torch.softmax(logits, dim=-1)


def simcc_losses(
    x_logits: torch.Tensor,
    y_logits: torch.Tensor,
    vis_logits: torch.Tensor,
    joints: torch.Tensor,
    visible: torch.Tensor,
    *,
    split_ratio: float,
    sigma: tuple[float, float],
) -> torch.Tensor:
    """Per-sample task losses (B, 3): KL for x, KL for y, BCE for visibility.

    KL terms are averaged over joints and weighted by visibility (an
    invisible joint has no coordinate target); each sample's loss depends
    only on that sample, as per-sample clipping requires.
    """
    tx = gaussian_targets(joints[..., 0], x_logits.shape[-1], split_ratio=split_ratio, sigma=sigma[0])
    ty = gaussian_targets(joints[..., 1], y_logits.shape[-1], split_ratio=split_ratio, sigma=sigma[1])
    k = joints.shape[1]

    def kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits, dim=-1)
        per_joint = (target * (torch.log(target.clamp_min(1e-12)) - logp)).sum(-1)  # (B, K)
        return (per_joint * visible).sum(-1) / k

    vis_loss = F.binary_cross_entropy_with_logits(vis_logits, visible, reduction="none").mean(-1)
    return torch.stack([kl(tx, x_logits), kl(ty, y_logits), vis_loss], dim=-1)


def combine_task_losses(
    task_losses: torch.Tensor, log_task_scale: torch.Tensor | None, *, vis_weight: float
) -> torch.Tensor:
    """(B, T) task losses (SimCC x, y, visibility, then any face terms) -> (B,) total.

    With uncertainty weighting: sum_i L_i / (2 s_i^2) + log s_i (s_i = exp(log s_i)).
    Without: L_x + L_y + vis_weight * L_vis + the face terms at weight 1.
    ``log_task_scale`` is (T,), or (B, T): one copy per row, each row weighed by its own.
    """
    if log_task_scale is None:
        weights = torch.ones(task_losses.shape[-1], dtype=task_losses.dtype, device=task_losses.device)
        weights[2] = vis_weight
        return (task_losses * weights).sum(-1)
    inv_var = torch.exp(-2.0 * log_task_scale)  # 1 / s^2
    return (task_losses * 0.5 * inv_var).sum(-1) + log_task_scale.sum(-1)


