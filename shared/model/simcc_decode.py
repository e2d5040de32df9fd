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
        z = logits.astype(np.float64).reshape(-1, logits.shape[-1])  # (N*K, bins)
        rows, bins = np.arange(z.shape[0]), z.shape[1]
        peak = z.argmax(-1)  # the log-softmax is a shift of each row: the same arg-max
        top = z[rows, peak]
        lse = top + np.log(np.exp(z - top[:, None]).sum(-1))  # log-sum-exp of each row
        # log-probabilities of the peak and its two neighbours (edges clipped, as the parabola is not used there)
        mid = top - lse
        left = z[rows, np.maximum(peak - 1, 0)] - lse
        right = z[rows, np.minimum(peak + 1, bins - 1)] - lse
        curv = left - 2.0 * mid + right
        inside = (peak > 0) & (peak < bins - 1) & (curv < -1e-9)
        offset = np.where(inside, 0.5 * (left - right) / np.where(inside, curv, -1.0), 0.0)
        loc = peak + np.clip(offset, -0.5, 0.5)
        shape = logits.shape[:-1]
        return (loc / split_ratio).reshape(shape), np.exp(mid).reshape(shape)

    x, px = one_axis(x_logits)
    y, py = one_axis(y_logits)
    keypoints = np.stack([x, y], axis=-1).astype(np.float32)
    return keypoints, np.minimum(px, py).astype(np.float32)
