"""The SimCC decode in numpy only: what a camera needs from the model code (no torch on the edge install)."""

from __future__ import annotations

import numpy as np


def decode_simcc(
    x_logits: np.ndarray, y_logits: np.ndarray, *, split_ratio: float
) -> tuple[np.ndarray, np.ndarray]:
    """SimCC logits -> keypoints in input px and confidences (pure numpy).

    Args:
        x_logits: (N, K, Wb) float logits over x bins.
        y_logits: (N, K, Hb) float logits over y bins.
    Returns:
        keypoints (N, K, 2) float32 (x, y) in input pixels, scores (N, K) float32 in [0, 1]:
        the smaller of the two peak probabilities.
    The location is the arg-max refined by a parabola through the log-probabilities
    of the peak bin and its two neighbours (exact for Gaussian-shaped outputs,
    which is what the labels train towards).
    """
    if x_logits.ndim != 3 or y_logits.ndim != 3 or x_logits.shape[:2] != y_logits.shape[:2]:
        raise ValueError(f"expected (N, K, bins) logits, got {x_logits.shape} and {y_logits.shape}")

    def one_axis(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = logits.astype(np.float64)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))  # (N, K, bins)
        bins = logp.shape[-1]
        peak = logp.argmax(-1)  # (N, K)
        left = np.take_along_axis(logp, np.clip(peak - 1, 0, bins - 1)[..., None], -1)[..., 0]
        mid = np.take_along_axis(logp, peak[..., None], -1)[..., 0]
        right = np.take_along_axis(logp, np.clip(peak + 1, 0, bins - 1)[..., None], -1)[..., 0]
        curv = left - 2.0 * mid + right
        inside = (peak > 0) & (peak < bins - 1) & (curv < -1e-9)
        offset = np.where(inside, 0.5 * (left - right) / np.where(inside, curv, -1.0), 0.0)
        loc = peak + np.clip(offset, -0.5, 0.5)
        return loc / split_ratio, np.exp(mid)

    x, px = one_axis(x_logits)
    y, py = one_axis(y_logits)
    keypoints = np.stack([x, y], axis=-1).astype(np.float32)
    return keypoints, np.minimum(px, py).astype(np.float32)
