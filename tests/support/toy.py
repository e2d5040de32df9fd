"""A tiny toy pose model and its batches: what the privacy step's tests run on.

conv + LayerNorm + linear (no BatchNorm), 8x8 images, 16 joints, through the same functional loss interface
the pose model uses: loss_fn(params, batch) -> (B,) per-sample losses.
"""

from __future__ import annotations

import torch
from torch import nn

H = W = 8
JOINTS = 16


class ToyPose(nn.Module):
    """conv -> LayerNorm -> ReLU -> linear to (B, 16, 2) joint coordinates."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.norm = nn.LayerNorm([4, H // 2, W // 2])
        self.head = nn.Linear(4 * (H // 2) * (W // 2), JOINTS * 2)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.conv(image)))  # (B, 4, 4, 4)
        return self.head(hidden.flatten(1)).view(-1, JOINTS, 2)  # (B, 16, 2)


def make_batch(size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(size, 3, H, W, generator=gen),
        "joints": torch.rand(size, JOINTS, 2, generator=gen) * 4 - 2,
        "visible": (torch.rand(size, JOINTS, generator=gen) > 0.2).float(),
    }
