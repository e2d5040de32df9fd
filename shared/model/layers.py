"""Layers that several models of ``fedpose.shared.model`` use (as timm keeps its shared ones in ``layers``).

TinyViT's own blocks are in ``fedpose.shared.model.tinyvit``; these are the ones the heads share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW map (timm's LayerNorm2d)."""

    channels_first = True  # read by book-keeping clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)
