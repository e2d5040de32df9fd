"""Batches assembled on the training device (``PoseDataset(..., device=...)``): one affine grid and one sampling per
batch, the jitter drawn as one tensor. Checked against the per-image path (cv2 crops rendered by threads): the same
draws give the same labels exactly and the same crops within the stated tolerance, the draws keep their
statistics, and a seed alone replays a batch (a private batch's seed is the round's secret)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.shared.data.augment import Augment
from fedpose.shared.data.dataset import (DEVICE_TOLERANCE, Draws, PoseDataset, cut_region, draw, jitter_noise,
                                         render, render_on)
from fedpose.shared.data.image_files import read_image
from fedpose.shared.data.joints import FLIP_PAIRS
from fedpose.shared.data.mpii import load_split
from fedpose.shared.data.synth.ward import WardSpec, generate_ward
from fedpose.shared.training.batches import assembly_device

SIZE = (48, 40)
CPU = torch.device("cpu")
INDICES = [3, 1, 3, 0, 2, 5, 4, 1]


@pytest.fixture(scope="module")
def ward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = WardSpec(sites=1, per_site=6, public=2, val=1, seed=11, image_size=96, images_per_identity=2)
    return generate_ward(tmp_path_factory.mktemp("ward") / "w", spec, progress=False)


def _close(device_images: torch.Tensor, cpu_images: torch.Tensor) -> None:
    """The stated tolerance (``DEVICE_TOLERANCE``): the two bilinear samplers round differently (cv2 quantises the
    source coordinate to 1/32 px), so a few pixels differ by a level."""
    diff = (device_images - cpu_images).abs() * 255.0
    assert float(diff.mean()) <= DEVICE_TOLERANCE.mean_levels, float(diff.mean())
    assert float(diff.max()) <= DEVICE_TOLERANCE.max_levels, float(diff.max())


@pytest.mark.parametrize("augment", [Augment(), Augment(rotation_prob=1.0, flip_prob=0.5), None])
def test_a_device_batch_is_the_per_image_batch_for_the_same_seed(ward: Path, augment: Augment | None) -> None:
    """Without photometric jitter the device path takes exactly the per-image path's draws, in order: the labels
    (joints, visibility, face labels, flip pairs swapped) are equal, the crops within the tolerance, and the
    generator is left where the per-image path leaves it."""
    records = load_split(ward, "site-0")
    cpu = PoseDataset(records, input_size=SIZE, augment=augment, seed=5, face_tasks=True)
    dev = PoseDataset(records, input_size=SIZE, augment=augment, seed=5, face_tasks=True, device=CPU)
    expected, batch = cpu.batch(INDICES), dev.batch(INDICES)
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        if key == "image":
            assert batch[key].shape == value.shape and batch[key].dtype == value.dtype
            _close(batch[key], value)
        else:
            assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key
    assert cpu.rng.random() == dev.rng.random()


def test_flipped_rows_swap_the_flip_pairs_and_mirror_the_crop(ward: Path) -> None:
    """A flipped row of the device batch is the mirror of the unflipped row drawn with the same scale and rotation:
    pixels mirrored (x -> W - 1 - x), left and right joints swapped."""
    record = load_split(ward, "site-0")[2]
    image = read_image(str(record.image))
    plain, flipped = Draws(1.1, 12.0, False, None), Draws(1.1, 12.0, True, None)
    region = cut_region(image, record, SIZE, reach=1.1)
    both = render_on([region, region], [record, record], [plain, flipped], SIZE, noise=None)
    assert torch.allclose(both[1], both[0].flip(-1), atol=1e-6)
    a, b = render(record, image, plain, SIZE), render(record, image, flipped, SIZE)
    for left, right in FLIP_PAIRS:
        if a.visible[left] and b.visible[right]:
            assert b.joints[right][0] == pytest.approx(SIZE[1] - 1 - a.joints[left][0], abs=1e-4)


def test_photometric_jitter_on_the_device_is_the_per_image_jitter_for_the_same_draws(ward: Path) -> None:
    """The same draws (gain, contrast, brightness and the very noise image) give the same jittered crop."""
    records = load_split(ward, "site-0")
    rng = np.random.default_rng(2)
    augment = Augment(photometric=0.5)
    draws = [draw(rng, augment, SIZE) for _ in records]
    images = [read_image(str(r.image)) for r in records]
    expected = torch.stack([torch.from_numpy(render(r, im, d, SIZE).image.copy()).permute(2, 0, 1).flip(0)
                            for r, im, d in zip(records, images, draws)]).float() / 255.0
    noise = torch.stack([torch.from_numpy(d.jitter.noise).permute(2, 0, 1) for d in draws])  # BGR (N, 3, H, W)
    regions = [cut_region(im, r, SIZE, reach=1.0 + augment.scale_factor) for r, im in zip(records, images)]
    _close(render_on(regions, records, draws, SIZE, noise=noise), expected)


def test_a_region_holds_every_pixel_any_draw_can_reach(ward: Path) -> None:
    """An image is decoded once into the region of it its crops can reach (the largest box scale, any rotation):
    crops from the region are the crops from the whole image (to the rounding of a half level)."""
    record = load_split(ward, "site-0")[0]
    image = read_image(str(record.image))
    small = type(record)(record.image, record.center, record.scale * 0.3, record.joints, record.visible)
    reach = 1.0 + Augment().scale_factor
    region = cut_region(image, small, SIZE, reach=reach)
    whole = cut_region(image, small, SIZE, reach=100.0)
    assert region.pixels.shape[1] < image.shape[0] and region.pixels.shape[2] < image.shape[1]
    assert whole.pixels.shape[1:] == image.shape[:2]
    draws = [Draws(m, r, f, None) for m in (1.0 - 0.25, reach) for r in (-60.0, 0.0, 45.0, 60.0) for f in (0, 1)]
    n = len(draws)
    cut = render_on([region] * n, [small] * n, draws, SIZE, noise=None)
    full = render_on([whole] * n, [small] * n, draws, SIZE, noise=None)
    # the same pixels sampled at the same points; their float32 grid coordinates differ in the last bits (another
    # padded size), so a value on a half level may round the other way
    assert float((cut - full).abs().max()) * 255.0 <= 1.0 + 1e-3


def test_the_device_draws_keep_the_augmentation_statistics() -> None:
    """Photometric draws on the device path: the same scale, rotation, flip, gain, contrast, brightness and noise
    strength distributions as the per-image path (two-sample KS tests at a fixed seed), the noise image drawn as
    one tensor instead of one numpy image per crop."""
    augment, n = Augment(photometric=0.5), 3000
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(2)
    a = [draw(rng_a, augment, (4, 4)) for _ in range(n)]
    b = [draw(rng_b, augment, (4, 4), noise=False) for _ in range(n)]
    assert all(d.jitter.noise is not None for d in a) and all(d.jitter.noise is None for d in b)
    columns = {
        "scale": lambda d: d.scale_mult, "rotation": lambda d: d.rotation, "flip": lambda d: float(d.flip),
        "gain": lambda d: float(d.jitter.gain[1]), "contrast": lambda d: float(d.jitter.contrast),
        "brightness": lambda d: float(d.jitter.brightness), "std": lambda d: float(d.jitter.std),
    }
    for name, column in columns.items():
        result = stats.ks_2samp([column(d) for d in a], [column(d) for d in b])
        assert result.pvalue > 1e-3, (name, result)
    stds = torch.tensor([float(d.jitter.std) for d in b[:64]])
    noise = jitter_noise(stds, (64, 48), generator=torch.Generator().manual_seed(0), device=CPU)
    assert noise.shape == (64, 3, 64, 48)
    measured = noise.flatten(1).std(dim=1)
    assert torch.allclose(measured, stds, rtol=0.05, atol=1e-6)


def test_a_device_batch_is_replayed_from_its_seed_alone(ward: Path) -> None:
    """A private batch's draws come from the dataset's generator only (a site seeds it from the round's secret):
    the same seed replays the batch bit for bit, whatever torch's global generator and thread count; another seed
    draws other crops."""
    records = load_split(ward, "site-0")
    augment = Augment(photometric=0.5)
    previous = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        first = PoseDataset(records, input_size=SIZE, augment=augment, seed=9, device=CPU).batch(INDICES)
        torch.manual_seed(1)
        torch.set_num_threads(2)
        again = PoseDataset(records, input_size=SIZE, augment=augment, seed=9, device=CPU).batch(INDICES)
    finally:
        torch.set_num_threads(previous)
    other = PoseDataset(records, input_size=SIZE, augment=augment, seed=10, device=CPU).batch(INDICES)
    for key in first:
        assert torch.equal(first[key], again[key]), key
    assert not torch.equal(first["image"], other["image"])


def test_a_device_batch_and_its_views_stay_on_the_device(ward: Path) -> None:
    """The images of a device batch are made on its device; the canonical view and an empty batch too; a view of
    the per-image dataset assembled on a device shares its generator (one stream) and its decoded regions."""
    records = load_split(ward, "site-0")
    base = PoseDataset(records, input_size=SIZE, augment=Augment(), seed=3)
    view = base.assembled_on(CPU)
    assert view.rng is base.rng and view.device == CPU and base.device is None
    batch = view.batch([0, 1])
    assert batch["image"].device == CPU and len(view._regions) == 2
    canonical = view.canonical()
    assert canonical.device == CPU and canonical._regions is view._regions
    assert canonical.batch([]).keys() == batch.keys() and canonical.batch([])["image"].shape == (0, 3, *SIZE)
    expected = base.canonical().batch([1, 0])
    _close(canonical.batch([1, 0])["image"], expected["image"])
    assert torch.equal(canonical.batch([1, 0])["joints"], expected["joints"])


def test_a_training_step_assembles_its_batches_on_a_gpu_and_per_image_on_the_cpu() -> None:
    """Where a training process assembles: on the GPU it trains on (the per-image path cannot feed it); on the
    CPU per image in threads, which is faster there (benchmarks/batch_assembly.py)."""
    assert assembly_device(torch.device("cpu")) is None
    assert assembly_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
