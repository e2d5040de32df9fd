"""Top-down pose dataset: record -> cropped, augmented input tensor and joints.

Targets stay as coordinates; the SimCC head builds its own 1-d labels from
``joints`` and ``visible``. DP training draws Poisson batches of arbitrary
index sets, hence ``batch(indices)``, which also handles the empty batch a
Poisson draw can produce.

An item's crop is drawn and rendered apart (``draw``, ``render``): what it draws from the dataset's
generator, and the crop rendered from those draws. So a batch can take every item's draws from one
generator in order (the stream is the same as item by item) and then render its crops in parallel
(``render_batch``): rendering reads no generator.

A dataset given a ``device`` assembles each batch there instead (a GPU site, where the per-image path on the CPU
cannot keep up with the step): each image is decoded once into the region of it its crops can reach (``Region``,
uint8, kept on the device), and a batch is one affine grid and one bilinear sampling (``render_on``), its
photometric noise one tensor drawn from a generator seeded from the dataset's. The labels are computed by the same
code as the per-image path (``place``) and the draws are the same stream, except the noise image: the same seed
gives the same labels and, within ``DEVICE_TOLERANCE``, the same crops. The code is the same on CPU and CUDA.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from fedpose.shared.data.augment import Augment, Jitter, apply_jitter, draw_jitter, sample_augment
from fedpose.shared.data.face import NUM_LANDMARKS
from fedpose.shared.data.image_files import read_image
from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.data.records import PIXEL_STD, PoseRecord, inside
from fedpose.shared.data.transforms import (affine_matrix, flip_joints, invert_affine, transform_face,
                                            warp_image, warp_points)

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
    """One rendered item: the crop (H, W, 3) uint8 BGR (None where the batch's pixels are made on the device),
    joints (16, 2) float32 in input pixels, visible (16,) bool, the (2, 3) matrix, the rotation (degrees) and the
    flip."""

    image: np.ndarray | None
    joints: np.ndarray
    visible: np.ndarray
    matrix: np.ndarray
    rotation: float
    flip: bool


class Tolerance(NamedTuple):
    """How far two renderings of the same draws may differ, in levels of 255: on average and at any pixel."""

    mean_levels: float
    max_levels: float


# The device path's crops against the per-image path's, for the same draws. Both sample bilinearly with a zero
# border, but cv2 quantises the source coordinate to 1/32 px and rounds in fixed point, so a value near a half
# level may round the other way (measured: 1 pixel in about 17,000 differs, by one level, at 256x192 from 320 px
# images); the photometric jitter's contrast (up to 1.5x) may widen such a level to two.
DEVICE_TOLERANCE = Tolerance(mean_levels=0.01, max_levels=2.0)


def draw(rng: np.random.Generator, augment: Augment | None, size_hw: tuple[int, int], *, noise: bool = True) -> Draws:
    """Everything one item takes from ``rng``, in the order an item always took it (none without augment).

    ``noise=False``: the photometric noise image is left undrawn (its strength is drawn), for a batch that draws
    every crop's noise as one tensor on the device (``jitter_noise``)."""
    if augment is None:
        return Draws(1.0, 0.0, False, None)
    scale_mult, rotation, flip = sample_augment(rng, augment)
    jitter = draw_jitter(rng, augment.photometric, (*size_hw, 3), noise=noise) if augment.photometric > 0 else None
    return Draws(scale_mult, rotation, flip, jitter)


def place(record: PoseRecord, draws: Draws, size_hw: tuple[int, int]) -> Crop:
    """``record``'s labels moved with the crop ``draws`` make (no pixels): the matrix, the joints (mirrored with
    their flip pairs swapped when flipped), those outside the crop invisible and 0. One function for both paths,
    so the device path's labels are the per-image path's exactly."""
    matrix = affine_matrix(record.center, record.scale * draws.scale_mult, size_hw, rotation=draws.rotation)
    joints = warp_points(record.joints, matrix)  # (16, 2) input px
    visible = record.visible.copy()
    if draws.flip:
        joints, visible = flip_joints(joints, visible, size_hw[1])
    visible &= inside(joints, size_hw)
    joints[~visible] = 0.0
    return Crop(None, joints, visible, matrix, float(draws.rotation), bool(draws.flip))


def render(record: PoseRecord, image: np.ndarray, draws: Draws, size_hw: tuple[int, int]) -> Crop:
    """``record``'s crop of its decoded ``image`` with ``draws`` applied; joints outside the crop are invisible
    (and 0)."""
    placed = place(record, draws, size_hw)
    crop = warp_image(image, placed.matrix, size_hw)  # (H, W, 3)
    if draws.flip:
        crop = np.ascontiguousarray(crop[:, ::-1])
    if draws.jitter is not None:
        crop = apply_jitter(crop, draws.jitter)
    return placed._replace(image=crop)


class Region(NamedTuple):
    """An image decoded once and cut to what its crops can reach: ``pixels`` (3, h, w) uint8 BGR on the device
    that assembles the batches, its top-left corner (x0, y0) in the image, and the largest box-scale multiplier
    (``reach``) whose crops, at any rotation, it holds whole."""

    pixels: Tensor
    x0: int
    y0: int
    reach: float


def cut_region(image: np.ndarray, record: PoseRecord, size_hw: tuple[int, int], *, reach: float,
               device: torch.device | None = None) -> Region:
    """(h, w, 3) uint8 image -> the ``Region`` of it that ``record``'s crops of scale multiplier <= ``reach`` can
    reach at any rotation: the disc about the box centre through the crop's corners, plus the bilinear neighbour,
    clipped to the image (outside it the crop is 0 on both paths)."""
    height, width = size_hw
    box_w = max(1.0, width / height) * float(record.scale) * PIXEL_STD * float(reach)
    radius = 0.5 * math.hypot(box_w, box_w * height / width) + 2.0
    cx, cy = (float(v) for v in np.asarray(record.center).reshape(2))
    x0, y0 = max(0, math.floor(cx - radius)), max(0, math.floor(cy - radius))
    x1, y1 = min(image.shape[1], math.ceil(cx + radius) + 1), min(image.shape[0], math.ceil(cy + radius) + 1)
    if x1 <= x0 or y1 <= y0:  # the box lies off the image: every crop is black
        return Region(torch.zeros((3, 1, 1), dtype=torch.uint8, device=device), 0, 0, float(reach))
    pixels = torch.from_numpy(np.ascontiguousarray(image[y0:y1, x0:x1])).permute(2, 0, 1).contiguous()
    return Region(pixels.to(device) if device is not None else pixels, x0, y0, float(reach))


def jitter_noise(stds: Tensor, size_hw: tuple[int, int], *, generator: torch.Generator,
                 device: torch.device) -> Tensor:
    """(N,) noise strengths -> (N, 3, H, W) float32 Gaussian sensor noise of those standard deviations, drawn as one
    tensor on ``device`` from ``generator`` (one of that device)."""
    noise = torch.randn((len(stds), 3, *size_hw), generator=generator, device=device, dtype=torch.float32)
    return noise.mul_(stds.to(device=device, dtype=torch.float32)[:, None, None, None])


def render_on(regions: Sequence[Region], records: Sequence[PoseRecord], draws: Sequence[Draws],
              size_hw: tuple[int, int], *, noise: Tensor | None) -> Tensor:
    """Each row's crop of its ``Region`` with its draws applied, on the regions' device, as one batch: the
    (N, 3, H, W) float32 RGB batch in [0, 1], the per-image path's ``render`` within ``DEVICE_TOLERANCE``.

    One affine grid and one bilinear sampling make every crop (scale, rotation and flip folded into each row's
    matrix), rounded to whole levels as the per-image crop is; then the photometric jitter of each row's draws
    (gain, contrast about the crop's mean, brightness, ``noise`` (N, 3, H, W) BGR), clipped and rounded."""
    n, (height, width) = len(regions), size_hw
    device = regions[0].pixels.device
    rows_h, rows_w = max(2, max(r.pixels.shape[1] for r in regions)), max(2, max(r.pixels.shape[2] for r in regions))
    source = torch.zeros((n, 3, rows_h, rows_w), dtype=torch.uint8, device=device)  # regions padded with the border 0
    # Output pixel -> source pixel, in the coordinates grid_sample reads (align_corners: -1 and 1 are pixel centres).
    from_out = np.array([[(width - 1) / 2.0, 0.0, (width - 1) / 2.0], [0.0, (height - 1) / 2.0, (height - 1) / 2.0],
                         [0.0, 0.0, 1.0]])
    mirror = np.array([[-1.0, 0.0, width - 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    to_in = np.array([[2.0 / (rows_w - 1), 0.0, -1.0], [0.0, 2.0 / (rows_h - 1), -1.0], [0.0, 0.0, 1.0]])
    theta = np.empty((n, 2, 3))
    for row, (region, record, drawn) in enumerate(zip(regions, records, draws, strict=True)):
        if drawn.scale_mult > region.reach:
            raise ValueError(f"row {row}: scale multiplier {drawn.scale_mult} beyond its region's {region.reach}")
        _, h, w = region.pixels.shape
        source[row, :, :h, :w] = region.pixels
        matrix = affine_matrix(record.center, record.scale * drawn.scale_mult, size_hw, rotation=drawn.rotation)
        to_image = np.vstack([invert_affine(matrix), [0.0, 0.0, 1.0]])
        to_image[:2, 2] -= (region.x0, region.y0)
        theta[row] = (to_in @ to_image @ (mirror if drawn.flip else np.eye(3)) @ from_out)[:2]
    grid = F.affine_grid(torch.from_numpy(theta).to(device=device, dtype=torch.float32), [n, 3, height, width],
                         align_corners=True)  # (N, H, W, 2)
    crops = F.grid_sample(source.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=True).round_()
    if draws[0].jitter is not None:
        jitters = [d.jitter for d in draws]
        gain = torch.from_numpy(np.stack([j.gain for j in jitters])).to(device)[:, :, None, None]  # (N, 3) BGR
        contrast, brightness = (torch.tensor([float(getattr(j, name)) for j in jitters], dtype=torch.float32,
                                             device=device)[:, None, None, None] for name in ("contrast", "brightness"))
        crops.mul_(gain)
        mean = crops.mean(dim=(1, 2, 3), keepdim=True)
        crops = (crops - mean).mul_(contrast).add_(mean + brightness)
        if noise is not None:
            crops.add_(noise)
        crops = crops.clamp_(0.0, 255.0).round_()
    return crops.flip(1).div_(255.0)  # BGR -> RGB


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

    device: None renders each crop on the CPU, image by image, in a pool of torch's thread count; a device
    assembles each batch there (module docstring), its images on that device, each record's region of its image
    cached there (3 bytes a pixel of the disc its crops can reach). ``assembled_on`` gives a view on another.
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
        device: torch.device | str | None = None,
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
        self.device = torch.device(device) if device is not None else None
        self._regions: dict[int, Region] = {}

    def __len__(self) -> int:
        return len(self.records)

    def _image(self, index: int) -> np.ndarray:
        if index in self._cache:
            return self._cache[index]
        image = read_image(str(self.records[index].image))
        if self.cache_images:
            self._cache[index] = image
        return image

    def _region(self, index: int) -> Region:
        """Record ``index``'s ``Region`` on the device, decoded once (again only for a wider reach than held)."""
        reach = 1.0 + self.augment.scale_factor if self.augment is not None else 1.0
        region = self._regions.get(index)
        if region is None or region.reach < reach:
            image = self._cache.get(index)
            image = read_image(str(self.records[index].image)) if image is None else image
            region = cut_region(image, self.records[index], self.input_size, reach=reach, device=self.device)
            self._regions[index] = region
        return region

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
        """The same records without augmentation (sharing the decoded-image caches and the device): each record's
        canonical crop."""
        view = PoseDataset(self.records, input_size=self.input_size, augment=None, cache_images=self.cache_images,
                           face_tasks=self.face_tasks, device=self.device)
        view._cache, view._regions = self._cache, self._regions
        return view

    def assembled_on(self, device: torch.device | None) -> PoseDataset:
        """This dataset with its batches assembled on ``device`` (None: per image on the CPU): the same records,
        augmentation, caches and generator object, so the draws stay one stream (a site's, seeded from its
        round's secret) whichever view draws them."""
        if device == self.device:
            return self
        view = PoseDataset(self.records, input_size=self.input_size, augment=self.augment,
                           cache_images=self.cache_images, face_tasks=self.face_tasks, device=device)
        view.rng, view._cache, view._regions = self.rng, self._cache, self._regions
        return view

    def batch(self, indices: Sequence[int]) -> dict[str, Tensor]:
        """Items at ``indices`` stacked; an empty list gives correctly shaped empty tensors."""
        if len(indices) == 0:
            height, width = self.input_size
            empty = {
                "image": torch.empty((0, 3, height, width), dtype=torch.float32, device=self.device),
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
        if self.device is not None:
            return self._batch_on_device(order)
        draws = [draw(self.rng, self.augment, self.input_size) for _ in order]
        if self.cache_images:  # decode each new image once, here, before the threads read the cache
            for i in dict.fromkeys(order):
                self._image(i)
        items = [(self.records[i], partial(self._image, i), d) for i, d in zip(order, draws)]
        images, crops = render_batch(items, self.input_size, torch.get_num_threads())
        batch = collate([self._labels(i, c) for i, c in zip(order, crops)])
        return {"image": images, **batch}

    def _batch_on_device(self, order: list[int]) -> dict[str, Tensor]:
        """``batch`` assembled on the device: the per-image path's draws in its order, but each crop's noise image
        drawn at once, after them, from a device generator seeded from the dataset's own (so a seed alone replays
        the batch, whatever torch's global generator)."""
        draws = [draw(self.rng, self.augment, self.input_size, noise=False) for _ in order]
        noise = None
        if self.augment is not None and self.augment.photometric > 0:
            generator = torch.Generator(device=self.device).manual_seed(int(self.rng.integers(2**63 - 1)))
            stds = torch.tensor([float(d.jitter.std) for d in draws if d.jitter is not None])
            noise = jitter_noise(stds, self.input_size, generator=generator, device=self.device)
        records = [self.records[i] for i in order]
        images = render_on([self._region(i) for i in order], records, draws, self.input_size, noise=noise)
        batch = collate([self._labels(i, place(r, d, self.input_size)) for i, r, d in zip(order, records, draws)])
        return {"image": images, **batch}

    @staticmethod
    def worker_init(worker_id: int) -> None:
        """DataLoader ``worker_init_fn``: reseed the worker's copy of the dataset generator."""
        info = torch.utils.data.get_worker_info()
        if info is not None and isinstance(info.dataset, PoseDataset):
            info.dataset.rng = np.random.default_rng([info.seed % (2**63), worker_id])
