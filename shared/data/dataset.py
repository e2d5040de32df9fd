"""Top-down pose dataset: record -> cropped, augmented input tensor and joints.

Targets stay as coordinates; the SimCC head builds its own 1-d labels from
``joints`` and ``visible``. DP training draws Poisson batches of arbitrary
index sets, hence ``batch(indices)``, which also handles the empty batch a
Poisson draw can produce.

An item's crop is drawn and rendered apart (``draw``, ``render``): what it draws from the dataset's
generator, and the crop rendered from those draws. So a batch can take every item's draws from one
generator in order (the stream is the same as item by item) and then render its crops in parallel
(``render_batch``): rendering reads no generator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from fedpose.shared.data.augment import Augment, Jitter, apply_jitter, draw_jitter, sample_augment
from fedpose.shared.data.face import NUM_LANDMARKS
from fedpose.shared.data.image_files import read_image
from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.records import PoseRecord, inside
from fedpose.shared.data.transforms import (affine_matrix, flip_horizontal, transform_face, warp_image,
                                            warp_points)

log = logging.getLogger(__name__)

KEYS = ("image", "joints", "visible", "index")
# With face_tasks: whether the record has face labels at all, then the labels in input pixels / degrees.
FACE_KEYS = ("face_labelled", "face_present", "face_box", "face_landmarks", "face_visible", "head_pose",
             "face_attribute")


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


def collate(items: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack a non-empty list of dataset items into a batch (use ``PoseDataset.batch`` for empty ones)."""
    if not items:
        raise ValueError("collate needs at least one item; PoseDataset.batch([]) returns an empty batch")
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _empty_face(n: int, *, squeeze: bool = False) -> dict[str, Tensor]:
    """Face items of ``n`` records without face labels (``squeeze``: one item, no batch axis)."""
    shapes = {"face_labelled": (), "face_present": (), "face_box": (4,), "face_landmarks": (NUM_LANDMARKS, 2),
              "face_visible": (NUM_LANDMARKS,), "head_pose": (3,)}
    lead = () if squeeze else (n,)
    out = {key: torch.zeros(lead + shape) for key, shape in shapes.items()}
    out["face_attribute"] = torch.full(lead, -1, dtype=torch.int64)
    return out


def _out_of_range(index: int, size: int) -> IndexError:
    return IndexError(f"index {index} out of range for a dataset of {size} records")


class PoseDataset(Dataset):
    """Records -> dict(image (3, H, W) float32 RGB in [0, 1], joints (16, 2), visible (16,), index).

    ``joints`` are in input-pixel coordinates after crop and augmentation;
    ``visible`` is 0 for joints that are unannotated or fall outside the crop
    (those joints are also set to 0). Augmentation draws from a numpy
    Generator owned by the dataset (``seed``; OS entropy when None), not from
    global state. With DataLoader workers pass ``worker_init_fn=
    PoseDataset.worker_init`` so that workers do not repeat one stream.

    face_tasks adds the face labels (``FACE_KEYS``, ``fedpose.shared.data.face``) moved with the crop; a record
    without face labels gets ``face_labelled`` 0 and no face loss.

    cache_images keeps decoded images in memory (fine for the 128 px ward; for
    full-size MPII/COCO it costs ~2.7 MB per image).
    """

    def __init__(
        self,
        records: Sequence[PoseRecord],
        *,
        input_size: tuple[int, int],
        augment: Augment | None,
        seed: int | None = None,
        cache_images: bool = True,
        face_tasks: bool = False,
    ) -> None:
        if len(input_size) != 2 or min(input_size) < 1:
            raise ValueError(f"input_size must be (H, W) with positive entries, got {input_size}")
        if augment is not None and not isinstance(augment, Augment):
            raise ValueError(f"augment must be an Augment or None, got {type(augment).__name__}")
        self.records = list(records)
        self.input_size = (int(input_size[0]), int(input_size[1]))
        self.augment = augment
        self.rng = np.random.default_rng(seed)
        self.cache_images = cache_images
        self.face_tasks = bool(face_tasks)
        self._cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _image(self, index: int) -> np.ndarray:
        if index in self._cache:
            return self._cache[index]
        image = read_image(str(self.records[index].image))
        if self.cache_images:
            self._cache[index] = image
        return image

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Numpy view of one item: (crop (H, W, 3) uint8 BGR, joints (16, 2) float32, visible (16,) bool)."""
        return self._sample(index)[:3]

    def _sample(self, index: int) -> Crop:
        """``sample`` plus the augmentation drawn: the (2, 3) matrix, the rotation (degrees) and the flip."""
        if not 0 <= index < len(self.records):
            raise _out_of_range(index, len(self.records))
        return render(self.records[index], self._image(index), draw(self.rng, self.augment, self.input_size),
                      self.input_size)

    def _face_items(self, index: int, matrix: np.ndarray, rotation: float, flip: bool) -> dict[str, Tensor]:
        face = self.records[index].face
        if face is None:
            return _empty_face(1, squeeze=True)
        present, box, points, visible, pose = transform_face(
            face, matrix, rotation=rotation, flip_width=self.input_size[1] if flip else None, size_hw=self.input_size)
        return {
            "face_labelled": torch.tensor(1.0),
            "face_present": torch.tensor(float(present)),
            "face_box": torch.from_numpy(box),
            "face_landmarks": torch.from_numpy(points),
            "face_visible": torch.from_numpy(visible.astype(np.float32)),
            "head_pose": torch.from_numpy(pose),
            "face_attribute": torch.tensor(face.attribute, dtype=torch.int64),
        }

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {key: value[0] for key, value in self.batch([int(index)]).items()}

    def _labels(self, index: int, crop: Crop) -> dict[str, Tensor]:
        """Item ``index``'s tensors besides its image, from its rendered ``crop``."""
        item = {"joints": torch.from_numpy(crop.joints), "visible": torch.from_numpy(crop.visible.astype(np.float32)),
                "index": torch.tensor(index, dtype=torch.int64)}
        if self.face_tasks:
            item.update(self._face_items(index, crop.matrix, crop.rotation, crop.flip))
        return item

    def canonical(self) -> PoseDataset:
        """The same records without augmentation (sharing the decoded-image cache): each record's canonical crop."""
        view = PoseDataset(self.records, input_size=self.input_size, augment=None, cache_images=self.cache_images,
                           face_tasks=self.face_tasks)
        view._cache = self._cache
        return view

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """Items at ``indices`` stacked; an empty list gives correctly shaped empty tensors."""
        if len(indices) == 0:
            height, width = self.input_size
            empty = {
                "image": torch.empty((0, 3, height, width), dtype=torch.float32),
                "joints": torch.empty((0, NUM_JOINTS, 2), dtype=torch.float32),
                "visible": torch.empty((0, NUM_JOINTS), dtype=torch.float32),
                "index": torch.empty((0,), dtype=torch.int64),
            }
            return {**empty, **_empty_face(0)} if self.face_tasks else empty
        # The draws are taken from the generator in order, one item after another (the same stream as item by
        # item); the crops, which read no generator, are rendered by a pool of torch's thread count.
        order = [int(i) for i in indices]
        for i in order:
            if not 0 <= i < len(self.records):
                raise _out_of_range(i, len(self.records))
        draws = [draw(self.rng, self.augment, self.input_size) for _ in order]
        if self.cache_images:  # decode each new image once, here, before the threads read the cache
            for i in dict.fromkeys(order):
                self._image(i)
        items = [(self.records[i], partial(self._image, i), d) for i, d in zip(order, draws)]
        images, crops = render_batch(items, self.input_size, torch.get_num_threads())
        batch = collate([self._labels(i, c) for i, c in zip(order, crops)])
        return {"image": images, **batch}

    @staticmethod
    def worker_init(worker_id: int) -> None:
        """DataLoader ``worker_init_fn``: reseed the worker's copy of the dataset generator."""
        info = torch.utils.data.get_worker_info()
        if info is not None and isinstance(info.dataset, PoseDataset):
            info.dataset.rng = np.random.default_rng([info.seed % (2**63), worker_id])
