"""Tests for fedpose.shared.pixelization: DP pixelization (Fan 2018, uniform and region adaptive)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from fedpose.shared.pixelization.frame import PixelizedFrame
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.pixelization.masks import body_mask_from_keypoints, load_mask
from fedpose.shared.pixelization.storage import load_npz, restore, save_npz
from fedpose.shared.pixelization.mechanism import pixelize
from fedpose.shared.pixelization.claim import pixelize_claim

REPO = Path(__file__).resolve().parents[1]


def _bench():
    """benchmarks/pixelize.py by path (a top-level 'benchmarks' package from opacus shadows the folder)."""
    spec = importlib.util.spec_from_file_location("bench_pixelize", REPO / "benchmarks" / "pixelize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _image(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _box_mask(h, w, y0, y1, x0, x1):
    mask = np.zeros((h, w), dtype=bool)
    mask[y0:y1, x0:x1] = True
    return mask


# ----------------------------------------------------------------------------- output format


@pytest.mark.parametrize("shape", [(37, 45), (37, 45, 3)])
@pytest.mark.parametrize("noise", ["discrete", "laplace"])
@pytest.mark.invariant("P9")
def test_output_shape_dtype_and_clipping(shape, noise):
    img = _image(shape)
    mask = _box_mask(37, 45, 5, 20, 10, 30)
    spec = PixelizeSpec(eps=1e-3, b=8, m=16, n=2, noise=noise)  # huge noise: almost everything clips
    frame = pixelize(img, spec, mask=mask, rng=np.random.default_rng(1))
    out = frame.render()
    assert out.shape == img.shape and out.dtype == np.uint8
    assert frame.channels == (3 if len(shape) == 3 else 1)
    for means in (frame.simple_means, frame.complex_means):
        assert means.min() >= 0.0 and means.max() <= 255.0
    # Clipped to the range (not wrapped around): nearly every pixel saturates at 0 or 255.
    assert np.isin(out, (0, 255)).mean() > 0.95
    assert (out == 0).any() and (out == 255).any()


def test_uniform_output_is_constant_per_cell():
    img = _image((40, 48))
    out = pixelize(img, PixelizeSpec(eps=1.0, b=8, m=1), rng=np.random.default_rng(2)).render()
    blocks = out.reshape(5, 8, 6, 8)
    assert (blocks == blocks[:, :1, :, :1]).all()


# ----------------------------------------------------------------------------- means (noise off)


@pytest.mark.parametrize("channels", [1, 3])
def test_noise_off_means_equal_cell_means_per_level(channels):
    h, w, b, n = 48, 64, 8, 2
    shape = (h, w) if channels == 1 else (h, w, channels)
    img = _image(shape, seed=5)
    # Mask touching cells (1..2, 2..4) partially: a cell is complex when ANY pixel is covered.
    mask = _box_mask(h, w, 12, 17, 20, 33)
    spec = PixelizeSpec(eps=1.0, b=b, m=1, n=n)
    frame = pixelize(img, spec, mask=mask, rng=np.random.default_rng(0), _noise_off_for_tests=True)

    expected_mask = np.zeros((h // b, w // b), dtype=bool)
    expected_mask[1:3, 2:5] = True
    np.testing.assert_array_equal(frame.cell_mask, expected_mask)

    img3 = img.reshape(h, w, channels).astype(np.float64)
    simple, complex_ = [], []
    for i in range(h // b):
        for j in range(w // b):
            cell = img3[i * b : (i + 1) * b, j * b : (j + 1) * b]
            if expected_mask[i, j]:
                s = b // n
                sub = cell.reshape(n, s, n, s, channels)
                complex_.append([[sub[u, :, v].mean(axis=(0, 1)) for v in range(n)] for u in range(n)])
            else:
                simple.append(cell.mean(axis=(0, 1)))
    np.testing.assert_allclose(frame.simple_means, np.array(simple), rtol=0, atol=1e-4)
    np.testing.assert_allclose(frame.complex_means, np.array(complex_), rtol=0, atol=1e-4)
    assert frame.complex_means.shape == (6, n, n, channels)


def test_mirror_padding_symmetric():
    # 22 x 22 frame, b = 8: the last cell row/column holds 6 real lines + 2 padded ones.
    rows = np.array([200] * 16 + [10, 20, 30, 40, 50, 60], dtype=np.float64)
    cols = np.array([0] * 16 + [1, 2, 3, 4, 5, 6], dtype=np.float64)
    img = (rows[:, None] + cols[None, :]).astype(np.uint8)
    frame = pixelize(img, PixelizeSpec(eps=1.0, b=8, m=1), rng=np.random.default_rng(0), _noise_off_for_tests=True)
    grid = frame.simple_means.reshape(3, 3)
    # Symmetric mirror: padded rows 22, 23 copy rows 21, 20 -> 10 20 30 40 50 60 60 50, mean 40.
    # ('reflect' would give 37.5, edge replication 42.5, zeros 26.25, real pixels only 35.)
    row_mean = np.mean([10, 20, 30, 40, 50, 60, 60, 50])
    col_mean = np.mean([1, 2, 3, 4, 5, 6, 6, 5])
    assert grid[2, 0] == pytest.approx(row_mean)  # straddles the bottom border
    assert grid[0, 2] == pytest.approx(200 + col_mean)  # straddles the right border
    assert grid[2, 2] == pytest.approx(row_mean + col_mean)  # the corner
    out = frame.render()
    assert out.shape == (22, 22)
    assert (out[16:, :8] == round(row_mean)).all()


# ----------------------------------------------------------------------------- noise scale


def _expected_mean_sd(spec: PixelizeSpec, side: int, *, channels: int = 1, k: int = 1) -> float:
    """Standard deviation of a released mean's noise, computed from the definition."""
    lam = 255 * spec.m * channels * k / (side**2 * spec.eps)  # Laplace scale on the mean (P9)
    if spec.noise == "laplace":
        return math.sqrt(2) * lam
    alpha = math.exp(-spec.eps / (255 * spec.m * channels * k))  # discrete Laplace on the sum
    return math.sqrt(2 * alpha / (1 - alpha) ** 2) / side**2


@pytest.mark.parametrize("noise", ["laplace", "discrete"])
@pytest.mark.invariant("P9")
def test_noise_scale_per_region(noise):
    h = w = 480
    spec = PixelizeSpec(eps=4.0, b=8, m=1, n=2, noise=noise)
    img = np.full((h, w), 128, dtype=np.uint8)
    mask = _box_mask(h, w, 0, h, 0, w // 2)  # left half complex: 1800 cells, 7200 subcells
    frame = pixelize(img, spec, mask=mask, rng=np.random.default_rng(11))
    for values, side in ((frame.simple_means, 8), (frame.complex_means, 4)):
        dev = values.astype(np.float64).ravel() - 128.0
        assert dev.size >= 1800
        assert abs(dev.mean()) < 0.15 * _expected_mean_sd(spec, side)  # centred
        if noise == "laplace":
            # E|X| = lambda; sd of the sample mean is lambda / sqrt(N) (< 2.4 % here).
            lam = 255 * spec.m / (side**2 * spec.eps)
            assert np.abs(dev).mean() == pytest.approx(lam, rel=0.10)
        else:
            # Sample variance vs 2 alpha / (1 - alpha)^2 (in sum units); rel. sd ~ sqrt(5 / N).
            assert dev.std() == pytest.approx(_expected_mean_sd(spec, side), rel=0.10)
            # Exact support: every released mean is an integer sum divided by the area.
            scaled = values.astype(np.float64) * side**2
            np.testing.assert_array_equal(scaled, np.round(scaled))
    # The subcells (side b / n) are noisier by n^2 = 4: sensitivity 255 m / s^2.
    ratio = frame.complex_means.std() / frame.simple_means.std()
    assert ratio == pytest.approx(4.0, rel=0.15)


@pytest.mark.parametrize("noise", ["laplace", "discrete"])
@pytest.mark.invariant("P9")
def test_noise_scale_rgb_splits_eps_over_channels(noise):
    spec = PixelizeSpec(eps=12.0, b=8, m=1, noise=noise)
    img = np.full((240, 240, 3), 128, dtype=np.uint8)
    frame = pixelize(img, spec, rng=np.random.default_rng(3))
    dev = frame.simple_means.astype(np.float64).ravel() - 128.0  # 900 cells x 3 channels
    assert dev.std() == pytest.approx(_expected_mean_sd(spec, 8, channels=3), rel=0.12)


@pytest.mark.invariant("P9")
def test_border_cells_with_mirrored_copies_get_double_noise():
    # 12 rows, b = 8: padded rows 12..15 copy rows 11..8, so each of those pixels enters
    # the last cell row twice -> K = 2 there; the first cell row is untouched (K = 1).
    spec = PixelizeSpec(eps=4.0, b=8, m=1, noise="laplace")
    img = np.full((12, 8000), 128, dtype=np.uint8)
    frame = pixelize(img, spec, rng=np.random.default_rng(4))
    dev = np.abs(frame.simple_means.astype(np.float64).reshape(2, 1000) - 128.0)
    lam = 255 * spec.m / (64 * spec.eps)
    assert dev[0].mean() == pytest.approx(lam, rel=0.12)
    assert dev[1].mean() == pytest.approx(2 * lam, rel=0.12)


def test_noise_is_random_and_seeded():
    img = _image((32, 32))
    spec = PixelizeSpec(eps=1.0, b=8, m=4)
    a = pixelize(img, spec, rng=np.random.default_rng(7)).simple_means
    b = pixelize(img, spec, rng=np.random.default_rng(7)).simple_means
    c = pixelize(img, spec, rng=np.random.default_rng(8)).simple_means
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


# ----------------------------------------------------------------------------- storage


@pytest.mark.parametrize("shape", [(37, 45), (37, 45, 3)])
@pytest.mark.parametrize("noise", ["discrete", "laplace"])
def test_npz_restore_is_bit_exact(tmp_path, shape, noise):
    img = _image(shape, seed=9)
    mask = _box_mask(37, 45, 3, 30, 12, 25)
    frame = pixelize(img, PixelizeSpec(eps=0.5, b=8, m=16, n=4, noise=noise), mask=mask, rng=np.random.default_rng(5))
    path = tmp_path / "frame.npz"
    save_npz(frame, path)
    restored = restore(path)
    rendered = frame.render()
    assert restored.dtype == rendered.dtype and restored.shape == rendered.shape == img.shape
    np.testing.assert_array_equal(restored, rendered)
    loaded = load_npz(path)
    np.testing.assert_array_equal(loaded.simple_means, frame.simple_means)
    np.testing.assert_array_equal(loaded.complex_means, frame.complex_means)
    np.testing.assert_array_equal(loaded.cell_mask, frame.cell_mask)
    assert (loaded.b, loaded.s_b, loaded.height, loaded.width, loaded.channels) == (8, 2, 37, 45, frame.channels)
    # Only the released quantities are stored, never the image.
    with np.load(path) as data:
        stored = {"simple_means", "complex_means", "cell_mask", "b", "s_b", "height", "width", "channels"}
        assert set(data.files) == stored
        assert sum(data[k].size for k in data.files) < img.size // 2


def test_load_npz_rejects_other_files(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, image=np.zeros((4, 4)))
    with pytest.raises(ValueError, match="missing arrays"):
        load_npz(path)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps": 0.0, "b": 16, "m": 16}, "eps must be > 0"),
        ({"eps": -1.0, "b": 16, "m": 16}, "eps must be > 0"),
        ({"eps": float("nan"), "b": 16, "m": 16}, "finite"),
        ({"eps": 1.0, "b": 16, "m": 0}, "m .* integer >= 1"),
        ({"eps": 1.0, "b": 0, "m": 16}, "b .* integer >= 1"),
        ({"eps": 1.0, "b": 16, "m": 16, "n": 3}, r"n=3 does not divide b=16: choose n in \[1, 2, 4, 8, 16\]"),
        ({"eps": 1.0, "b": 16, "m": 16, "noise": "gaussian"}, "noise must be one of"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PixelizeSpec(**kwargs)


def test_spec_is_keyword_only():
    with pytest.raises(TypeError):
        PixelizeSpec(0.5, 16, 16)  # type: ignore[misc]


def test_pixelize_input_validation():
    spec = PixelizeSpec(eps=1.0, b=8, m=1, n=2)
    img = _image((16, 16))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="uint8"):
        pixelize(img.astype(np.float32), spec, rng=rng)
    with pytest.raises(ValueError, match=r"\(H, W\) or \(H, W, 3\)"):
        pixelize(_image((16, 16, 4)), spec, rng=rng)
    with pytest.raises(ValueError, match="empty"):
        pixelize(np.zeros((0, 16), np.uint8), spec, rng=rng)
    with pytest.raises(ValueError, match="mask must have the frame shape"):
        pixelize(img, spec, mask=np.zeros((8, 8), bool), rng=rng)
    with pytest.raises(ValueError, match="mask must be bool"):
        pixelize(img, spec, mask=np.zeros((16, 16), np.uint8), rng=rng)
    with pytest.raises(ValueError, match="Generator"):
        pixelize(img, spec, rng=np.random.RandomState(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="complex_means has shape"):
        PixelizedFrame(
            simple_means=np.zeros((4, 1), np.float32),
            complex_means=np.zeros((1, 2, 2, 1), np.float32),
            cell_mask=np.zeros((2, 2), bool),
            b=8, s_b=4, height=16, width=16, channels=1,
        )


def test_mask_ignored_for_uniform_grid():
    img = _image((16, 16))
    spec = PixelizeSpec(eps=1.0, b=8, m=1, n=1)
    frame = pixelize(img, spec, mask=np.ones((16, 16), bool), rng=np.random.default_rng(0))
    assert not frame.cell_mask.any() and frame.complex_means.shape[0] == 0


# ----------------------------------------------------------------------------- vs the per-cell loop


@pytest.mark.parametrize("shape", [(37, 45), (37, 45, 3), (12, 5)])
@pytest.mark.parametrize("noise", [None, "discrete", "laplace"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_vectorized_equals_loop(shape, noise, n):
    pixelize_loop = _bench().pixelize_loop
    h, w = shape[:2]
    img = _image(shape, seed=13)
    mask = _box_mask(h, w, h // 3, h - 2, w // 4, w // 2 + 3)
    spec = PixelizeSpec(eps=2.0, b=8, m=3, n=n, noise=noise or "discrete")
    frame = pixelize(img, spec, mask=mask, rng=np.random.default_rng(21), _noise_off_for_tests=noise is None)
    loop_rng = None if noise is None else np.random.default_rng(21)
    ref_img, ref_simple, ref_complex = pixelize_loop(img, spec, mask=mask, rng=loop_rng)
    np.testing.assert_array_equal(frame.simple_means, ref_simple)
    np.testing.assert_array_equal(frame.complex_means, ref_complex)
    np.testing.assert_array_equal(frame.render(), ref_img)
    assert ref_img.shape == img.shape


# ----------------------------------------------------------------------------- masks and claim


def test_body_mask_from_keypoints():
    kpts = _bench().standing_pose(200, 160)  # (16, 2)
    mask = body_mask_from_keypoints((200, 160), kpts)
    assert mask.shape == (200, 160) and mask.dtype == bool
    xi, yi = np.rint(kpts).astype(int).T
    assert mask[yi, xi].all()  # every joint inside
    assert 0.05 < mask.mean() < 0.6  # a body, not the frame
    assert not mask[:, :10].any() and not mask[:5].any()

    scores = np.ones(16)
    scores[[0, 5]] = 0.1  # ankles unsure -> dropped
    lower = body_mask_from_keypoints((200, 160), kpts, scores, margin=2)
    assert not lower[int(kpts[0, 1]), int(kpts[0, 0])]
    assert lower.sum() < mask.sum()

    skel = body_mask_from_keypoints((200, 160), kpts, style="skeleton", margin=3)
    assert skel[yi, xi].all() and skel.sum() < mask.sum()
    assert not body_mask_from_keypoints((50, 50), kpts, np.zeros(16)).any()
    with pytest.raises(ValueError, match=r"\(K, 2\)"):
        body_mask_from_keypoints((50, 50), np.zeros((16, 3)))


def test_load_mask_png(tmp_path):
    cv2 = pytest.importorskip("cv2")
    m = np.zeros((10, 12), np.uint8)
    m[2:5, 3:9] = 255
    path = tmp_path / "mask.png"
    cv2.imwrite(str(path), m)
    np.testing.assert_array_equal(load_mask(path), m != 0)
    with pytest.raises(FileNotFoundError):
        load_mask(tmp_path / "missing.png")


@pytest.mark.invariant("P9")
def test_pixelize_claim():
    spec = PixelizeSpec(eps=0.5, b=16, m=16, n=2)
    text = pixelize_claim(spec, mask_source="keypoints", frames=30)
    assert "0.5-DP" in text and "m=16" in text
    assert "F*eps = 15" in text  # 30 frames x 0.5
    assert "mask" in text and "reveals where the body is" in text
    assert f"{255 * 16 / (16**2 * 0.5):.4g} for 16x16" in text and f"{255 * 16 / (8**2 * 0.5):.4g} for 8x8" in text
    uniform = pixelize_claim(spec, mask_source="none", frames=1)
    assert "reveals" not in uniform and "F*eps = 0.5" in uniform
    stills = pixelize_claim(spec, mask_source="none", frames=4, kind="images")
    assert "Video" not in stills and "each of the 4 images is 0.5-DP on its own" in stills and "2 if in all" in stills
    assert "Video" not in pixelize_claim(spec, mask_source="none", frames=1, kind="image")
    with pytest.raises(ValueError, match="kind"):
        pixelize_claim(spec, mask_source="none", frames=1, kind="album")
    with pytest.raises(ValueError, match="mask_source"):
        pixelize_claim(spec, mask_source="pose", frames=1)
    with pytest.raises(ValueError, match="frames"):
        pixelize_claim(spec, mask_source="none", frames=0)
