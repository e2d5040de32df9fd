"""Index tables of TinyViT's square attention windows: the relative offset between each pair of a window's
points (what the learned attention bias is indexed by), and which points of a padded window a smaller map fills.
See ``fedpose.shared.model.tinyvit_attention``.
"""

from __future__ import annotations

import torch


def offset_index(window: int) -> torch.Tensor:
    """(N, N) index into the per-head bias table of relative offsets (|dy|, |dx|).

    Offsets are numbered in first-seen order over the window's row-major points (the layout timm uses). The
    first point, (0, 0), meets every offset of the square window in row-major order, so the number of
    (|dy|, |dx|) is |dy| * window + |dx|: computed at once (a loop over the N^2 pairs took 0.1 s for a
    256x192 tinyvit-5m, on every message a site handles).
    """
    ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    return (ys[:, None] - ys[None, :]).abs() * window + (xs[:, None] - xs[None, :]).abs()


def map_positions(window: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major indices, in the padded window, of an (h, w) map's points and of the padding's points."""
    inside = torch.zeros(window, window, dtype=torch.bool)
    inside[:h, :w] = True
    flat = inside.flatten()
    return flat.nonzero().squeeze(1).to(device), (~flat).nonzero().squeeze(1).to(device)
