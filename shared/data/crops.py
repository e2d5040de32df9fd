"""A dataset item's crop: what it draws from the dataset's generator, and the crop rendered from those draws.

Drawing and rendering are apart so that a batch can take every item's draws from one generator in order (the
stream is the same as item by item) and then render its crops in parallel: rendering reads no generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedpose.shared.data.augment import Augment, Jitter, apply_jitter, draw_jitter, sample_augment
from fedpose.shared.data.records import PoseRecord, inside
from fedpose.shared.data.transforms import affine_matrix, flip_horizontal, warp_image, warp_points


class Draws(NamedTuple):
    """What one item draws from the dataset's generator: the box's scale multiplier, rotation, flip, jitter."""

    scale_mult: float
    rotation: float
    flip: bool
    jitter: Jitter | None


class Crop(NamedTuple):
    """One rendered item: the crop (H, W, 3) uint8 BGR, joints (16, 2) float32 in input pixels, visible (16,)
    bool, the (2, 3) matrix, the rotation (degrees) and the flip."""

    image: np.ndarray
    joints: np.ndarray
    visible: np.ndarray
    matrix: np.ndarray
    rotation: float
    flip: bool


def draw(rng: np.random.Generator, augment: Augment | None, size_hw: tuple[int, int]) -> Draws:
    """Everything one item takes from ``rng``, in the order an item always took it (none without augment)."""
    if augment is None:
        return Draws(1.0, 0.0, False, None)
    scale_mult, rotation, flip = sample_augment(rng, augment)
    jitter = draw_jitter(rng, augment.photometric, (*size_hw, 3)) if augment.photometric > 0 else None
    return Draws(scale_mult, rotation, flip, jitter)


def render(record: PoseRecord, image: np.ndarray, draws: Draws, size_hw: tuple[int, int]) -> Crop:
    """``record``'s crop of its decoded ``image`` with ``draws`` applied; joints outside the crop are invisible
    (and 0)."""
    matrix = affine_matrix(record.center, record.scale * draws.scale_mult, size_hw, rotation=draws.rotation)
    crop = warp_image(image, matrix, size_hw)  # (H, W, 3)
    joints = warp_points(record.joints, matrix)  # (16, 2) input px
    visible = record.visible.copy()
    if draws.flip:
        crop, joints, visible = flip_horizontal(crop, joints, visible, size_hw[1])
    if draws.jitter is not None:
        crop = apply_jitter(crop, draws.jitter)
    visible &= inside(joints, size_hw)
    joints[~visible] = 0.0
    return Crop(crop, joints, visible, matrix, float(draws.rotation), bool(draws.flip))


def render_batch(items: Sequence[tuple[PoseRecord, Callable[[], np.ndarray], Draws]], size_hw: tuple[int, int],
                 threads: int) -> tuple[Tensor, list[Crop]]:
    """Each (record, its image's loader, draws) rendered by ``threads`` threads: the (N, 3, H, W) float32 RGB batch
    in [0, 1] and the crops. Each thread loads the image it renders, so images not kept in memory are decoded in
    parallel and dropped once cropped."""
    images = torch.empty((len(items), 3, *size_hw), dtype=torch.float32)

    def fill(row: int) -> Crop:
        record, load, draws = items[row]
        crop = render(record, load(), draws, size_hw)
        images[row].copy_(torch.from_numpy(crop.image).permute(2, 0, 1).flip(0))  # BGR (H, W, 3) -> RGB (3, H, W)
        return crop

    workers = min(len(items), threads)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            crops = list(pool.map(fill, range(len(items))))
    else:
        crops = [fill(row) for row in range(len(items))]
    return images.div_(255.0), crops
