"""Benchmark: vectorized DP pixelization vs a per-cell Python loop.

Run from the repository root:  python benchmarks/pixelize.py

Times uniform (Algorithm 2) and region-adaptive (Algorithm 3, n=2, body-like
mask) pixelization of grayscale frames at 768x576 and 1920x1080 with b=16,
m=16, eps=0.5, against ``pixelize_loop`` (the straightforward one-iteration-
per-cell implementation) in the same run, and prints ms/frame, the speedup
and whether the targets are met: >= 20x faster than the loop, <= 3 ms
(768x576) and <= 10 ms (1080p) per frame, pixelize + render.

``pixelize_loop`` is also the reference the tests compare the library with;
it lives here, not in the library, on purpose.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.pixelization.masks import body_mask_from_keypoints
from fedpose.shared.pixelization.mechanism import pixelize


def _source_index(r: int, length: int) -> int:
    """Index of the real pixel that padded position r copies ('symmetric' mirror, any pad length)."""
    q = r % (2 * length)
    return q if q < length else 2 * length - 1 - q


def pixelize_loop(
    image: np.ndarray,
    spec: PixelizeSpec,
    *,
    mask: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference DP pixelization, one Python iteration per cell (benchmark and tests only).

    Same definition as ``fedpose.shared.pixelization.mechanism.pixelize`` written the obvious way:
    symmetric mirror padding, a cell is complex when the mask touches one of
    its real pixels, per-cell noise scale 255 m C K / (s^2 eps) with K the
    largest multiplicity of a mirrored pixel in the cell, noise drawn in the
    library's documented order (so the same generator state gives the same
    noise). ``rng=None`` switches the noise off.

    Returns (image uint8 of the input shape, simple means (Ns, C) float32,
    complex subcell means (Nc, n, n, C) float32).
    """
    img = image if image.ndim == 3 else image[:, :, None]
    h, w, c = img.shape
    b, n = spec.b, spec.n
    s = b // n
    hp, wp = -(-h // b) * b, -(-w // b) * b
    padded = np.pad(img, ((0, hp - h), (0, wp - w), (0, 0)), mode="symmetric")

    row_count: dict[int, int] = {}
    for r in range(hp):
        row_count[_source_index(r, h)] = row_count.get(_source_index(r, h), 0) + 1
    col_count: dict[int, int] = {}
    for q in range(wp):
        col_count[_source_index(q, w)] = col_count.get(_source_index(q, w), 0) + 1

    def multiplicity(y0: int, x0: int, side: int) -> int:
        ky = max(row_count[_source_index(r, h)] for r in range(y0, y0 + side))
        kx = max(col_count[_source_index(q, w)] for q in range(x0, x0 + side))
        return ky * kx

    use_mask = mask is not None and n > 1
    simple_sums, simple_k, simple_pos = [], [], []
    complex_sums, complex_k, complex_pos = [], [], []
    for y0 in range(0, hp, b):
        for x0 in range(0, wp, b):
            is_complex = use_mask and bool(mask[y0 : min(y0 + b, h), x0 : min(x0 + b, w)].any())
            if not is_complex:
                simple_sums.append(padded[y0 : y0 + b, x0 : x0 + b].sum(axis=(0, 1), dtype=np.int64))
                simple_k.append(multiplicity(y0, x0, b))
                simple_pos.append((y0, x0))
                continue
            block_sums, block_k = [], []
            for i in range(n):
                for j in range(n):
                    ys, xs = y0 + i * s, x0 + j * s
                    block_sums.append(padded[ys : ys + s, xs : xs + s].sum(axis=(0, 1), dtype=np.int64))
                    block_k.append(multiplicity(ys, xs, s))
            complex_sums.append(np.array(block_sums).reshape(n, n, c))
            complex_k.append(np.array(block_k).reshape(n, n))
            complex_pos.append((y0, x0))

    s_sums = np.array(simple_sums, dtype=np.int64).reshape(-1, c)
    c_sums = np.array(complex_sums, dtype=np.int64).reshape(-1, n, n, c)
    s_sens = np.broadcast_to(255 * spec.m * c * np.array(simple_k, dtype=np.int64).reshape(-1, 1), s_sums.shape)
    c_sens = np.broadcast_to(255 * spec.m * c * np.array(complex_k, dtype=np.int64).reshape(-1, n, n, 1), c_sums.shape)

    def noise(sens: np.ndarray) -> np.ndarray:
        if rng is None:
            return np.zeros(sens.shape)
        if spec.noise == "laplace":
            return rng.laplace(0.0, 1.0, size=sens.shape) * (sens / spec.eps)
        p = -np.expm1(-spec.eps / sens)
        return rng.geometric(p) - rng.geometric(p)

    s_noise, c_noise = noise(s_sens), noise(c_sens)

    out = np.empty((hp, wp, c), dtype=np.uint8)
    s_means = np.empty(s_sums.shape, dtype=np.float32)
    for k, (y0, x0) in enumerate(simple_pos):
        for ch in range(c):
            v = np.float32(min(max((int(s_sums[k, ch]) + s_noise[k, ch]) / (b * b), 0.0), 255.0))
            s_means[k, ch] = v
            out[y0 : y0 + b, x0 : x0 + b, ch] = np.uint8(np.rint(v))
    c_means = np.empty(c_sums.shape, dtype=np.float32)
    for k, (y0, x0) in enumerate(complex_pos):
        for i in range(n):
            for j in range(n):
                for ch in range(c):
                    v = np.float32(min(max((int(c_sums[k, i, j, ch]) + c_noise[k, i, j, ch]) / (s * s), 0.0), 255.0))
                    c_means[k, i, j, ch] = v
                    ys, xs = y0 + i * s, x0 + j * s
                    out[ys : ys + s, xs : xs + s, ch] = np.uint8(np.rint(v))
    out = out[:h, :w]
    return (out if image.ndim == 3 else out[:, :, 0]), s_means, c_means


# ----------------------------------------------------------------------------- benchmark


def standing_pose(height: int, width: int) -> np.ndarray:
    """(16, 2) MPII keypoints of a person standing in the frame centre, ~70 % of its height."""
    # Unit coordinates: x relative to the body centre line, y from head top (0) to ankles (1).
    unit = np.array(
        [
            [-0.10, 1.00], [-0.09, 0.75], [-0.08, 0.50], [0.08, 0.50], [0.09, 0.75], [0.10, 1.00],
            [0.00, 0.50], [0.00, 0.20], [0.00, 0.14], [0.00, 0.00],
            [-0.30, 0.50], [-0.25, 0.35], [-0.15, 0.20], [0.15, 0.20], [0.25, 0.35], [0.30, 0.50],
        ]
    )
    body_h = 0.7 * height
    return np.stack([width / 2 + unit[:, 0] * body_h, 0.15 * height + unit[:, 1] * body_h], axis=1)


def _time_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed runs of the vectorized version")
    parser.add_argument("--loop-repeats", type=int, default=3, help="timed runs of the per-cell loop")
    parser.add_argument("--noise", choices=("discrete", "laplace"), default="discrete")
    args = parser.parse_args(argv)

    targets = {(576, 768): 3.0, (1080, 1920): 10.0}
    rows = []
    all_ok = True
    for (h, w), target_ms in targets.items():
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, size=(h, w), dtype=np.uint8)
        mask = body_mask_from_keypoints((h, w), standing_pose(h, w))
        for mode, spec, m in (
            ("uniform", PixelizeSpec(eps=0.5, b=16, m=16, n=1, noise=args.noise), None),
            ("adaptive", PixelizeSpec(eps=0.5, b=16, m=16, n=2, noise=args.noise), mask),
        ):
            frame_ms = _time_ms(lambda: pixelize(image, spec, mask=m, rng=rng), args.repeats)
            full_ms = _time_ms(lambda: pixelize(image, spec, mask=m, rng=rng).render(), args.repeats)
            loop_ms = _time_ms(lambda: pixelize_loop(image, spec, mask=m, rng=rng), args.loop_repeats)
            speedup = loop_ms / full_ms
            ok = speedup >= 20 and full_ms <= target_ms
            all_ok &= ok
            complex_share = 0.0 if m is None else float(pixelize(image, spec, mask=m, rng=rng).cell_mask.mean())
            rows.append((f"{w}x{h}", mode, complex_share, frame_ms, full_ms, loop_ms, speedup, target_ms, ok))

    print(f"DP pixelization, grayscale, b=16 m=16 eps=0.5 noise={args.noise} (n=2 for adaptive); median ms/frame")
    header = (
        f"{'frame':>10} {'mode':>9} {'complex':>8} {'pixelize':>9} {'+render':>8} {'loop':>9} "
        f"{'speedup':>8} {'target':>7}  met"
    )
    print(header)
    print("-" * len(header))
    for size, mode, share, frame_ms, full_ms, loop_ms, speedup, target_ms, ok in rows:
        print(
            f"{size:>10} {mode:>9} {share:>7.0%} {frame_ms:>9.3f} {full_ms:>8.3f} {loop_ms:>9.1f} "
            f"{speedup:>7.0f}x {target_ms:>6.0f}ms  {'yes' if ok else 'NO'}"
        )
    print("targets: >= 20x faster than the per-cell loop and <= 3 ms (768x576) / <= 10 ms (1080p), pixelize + render")
    print("all targets met" if all_ok else "SOME TARGETS NOT MET")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
