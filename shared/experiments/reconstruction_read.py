"""Read one Feature-DP reply back (docs/explanation/design.md P17): psi(x) at the crafted trunk's resolution
and the exact pose labels of the record drawn for the public term, and score both against that record.

With the weights of ``fedpose.shared.experiments.reconstruction.craft_weights``, a plain-SGD step (no momentum, no
weight decay, learning rate lr, one step) and a basis V that leaves the read tensors out, the reply's read
tensors are w - lr * g_pub exactly, and with a public batch of one record:

- ``head.final``: weight gradient delta_o y(p)^T, bias gradient delta_o, so y(p) (the head's LayerNorm of the
  trunk features at position p) is their ratio; the anchor channel (``OFFSET``) and a zero channel undo the
  LayerNorm's shift and scale; the trunk's channels hold block means of the normalised psi(x);
- ``head.x_head`` / ``head.y_head``: weight column k is u (p - t_k) w_task vis_k / K, with u joint k's gate
  value, p the uniform prediction, t_k the SimCC target (a sampled Gaussian around coordinate * split_ratio);
  two neighbouring bins of log t give the coordinate exactly;
- ``head.vis_head``: column k is u (1/2 - vis_k) w_vis / K: the visibility label.

A public batch of B records gives the mean of B such gradients: ``read_reply`` is for B = 1 (it refuses other
sizes rather than return a blend as one record); ``read_batch`` reads what the mean gives exactly, for any B: the
fraction of the drawn records with each joint visible, each joint's distribution of positions over them (the mean
of their SimCC targets), and the head's ratio, a mean of their trunk features weighted by each one's delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.experiments.reconstruction import COLOUR_BLOCK, GATE, LUMA_BLOCK, OFFSET, Crafted
from fedpose.shared.model.posenet import IMAGENET_MEAN, IMAGENET_STD


@dataclass(frozen=True)
class Readout:
    """What the server rebuilt from one reply: block-mean planes of the normalised psi(x) ("L" at
    ``LUMA_BLOCK`` px, colours 0-2 at ``COLOUR_BLOCK`` px), joints (K, 2) in input px and visibility (K,) in
    {0, 1}; coordinates of invisible joints are not in the loss and read as NaN."""

    planes: dict[str | int, np.ndarray]
    joints: np.ndarray
    visible: np.ndarray


def public_gradient_of(sent: dict[str, torch.Tensor], reply: dict[str, torch.Tensor], names: tuple[str, ...], *,
                       lr: float) -> dict[str, torch.Tensor]:
    """g_pub on ``names`` from one plain-SGD step: (w_sent - w_reply) / lr, in float64 (the subtraction of two
    float32 numbers is exact here: every read tensor was sent as zero)."""
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0")
    return {n: (sent[n].double() - reply[n].double()) / lr for n in names}


def planes_of(image: torch.Tensor) -> dict[str | int, np.ndarray]:
    """(3, H, W) RGB in [0, 1] -> the block means the crafted trunk keeps, in the model's normalised units.

    The truth a reconstruction is scored against: psi(x) downsampled exactly as the crafted trunk does.
    """
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(3, 1, 1)
    norm = ((image.double() - mean) / std).unsqueeze(0)  # (1, 3, H, W)
    luma = F.avg_pool2d(norm, LUMA_BLOCK).mean(dim=1)[0]  # (H/4, W/4)
    colour = F.avg_pool2d(norm, COLOUR_BLOCK)[0]  # (3, H/8, W/8)
    return {"L": luma.numpy(), 0: colour[0].numpy(), 1: colour[1].numpy(), 2: colour[2].numpy()}


def render(planes: dict[str | int, np.ndarray]) -> np.ndarray:
    """Planes -> an RGB image (H/4, W/4, 3) in pixel units: each colour at its 8-px mean plus the 4-px
    luminance detail (L minus its own 8-px mean). Applied alike to the truth and to a reconstruction."""
    luma = planes["L"]
    coarse = luma.reshape(luma.shape[0] // 2, 2, luma.shape[1] // 2, 2).mean(axis=(1, 3))
    up = lambda a: np.kron(a, np.ones((2, 2)))  # noqa: E731
    out = np.stack([up(planes[c]) + luma - up(coarse) for c in range(3)], axis=-1)
    return out * np.asarray(IMAGENET_STD) + np.asarray(IMAGENET_MEAN)


def _features(crafted: Crafted, grads: dict[str, torch.Tensor]) -> dict[str | int, np.ndarray]:
    """The trunk's kept values from head.final's gradient, LayerNorm undone with the anchor and zero channels."""
    h, w = crafted.input_size
    planes: dict[str | int, np.ndarray] = {"L": np.full((h // LUMA_BLOCK, w // LUMA_BLOCK), np.nan)}
    for c in range(3):
        planes[c] = np.full((h // COLOUR_BLOCK, w // COLOUR_BLOCK), np.nan)
    gw = grads["head.final.weight"][:, :, 0, 0]  # (K g, C)
    gb = grads["head.final.bias"]  # (K g,)
    cols = crafted.head_grid[1]
    for p, (_, channel) in enumerate(crafted.reader):
        if gb[channel] == 0:
            raise ValueError(f"head.final channel {channel} has no gradient: the reply was not trained on these "
                             "weights with one plain-SGD step")
        y = (gw[channel] / gb[channel]).numpy()  # LayerNorm output at head position p
        scale = (y[crafted.anchor] - y[crafted.zero]) / OFFSET
        values = (y - y[crafted.zero]) / scale - OFFSET
        i, j = divmod(p, cols)
        for c, slot in enumerate(crafted.slots):
            r, s = i * slot.step + slot.dr, j * slot.step + slot.dc
            plane = planes[slot.plane]
            if r < plane.shape[0] and s < plane.shape[1]:
                plane[r, s] = values[c]
    missing = [k for k, v in planes.items() if np.isnan(v).any()]
    if missing:
        raise ValueError(f"planes {missing} are not covered by the head's read positions")
    return planes


def _centre(target: np.ndarray, sigma: float) -> float:
    """The centre mu (in bins) of a sampled Gaussian softmax(-(b - mu)^2 / (2 sigma^2)), exactly, from the two
    neighbouring bins of largest mass: log t[b + 1] - log t[b] = (2 mu - 2 b - 1) / (2 sigma^2)."""
    b = int(np.argmax(target))
    left = b - 1 if b + 1 >= len(target) or (b > 0 and target[b - 1] > target[b + 1]) else b
    return left + 0.5 + sigma**2 * math.log(target[left + 1] / target[left])


def _labels(crafted: Crafted, grads: dict[str, torch.Tensor], model: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    gate = float(F.gelu(torch.tensor(GATE, dtype=torch.float32)))  # u_k[k]: joint k's open hidden unit
    num = crafted.joints
    vis_col = grads["head.vis_head.weight"][0].numpy()
    task = 0.5 if model.task_uncertainty else 1.0  # log_task_scale sent as 0: 1 / (2 s^2) = 1/2
    vis_weight = 0.5 if model.task_uncertainty else model.vis_weight
    visible = np.rint(0.5 - vis_col[:num] * num / (gate * vis_weight)).astype(np.float32)
    coords = np.full((num, 2), np.nan)
    for axis, name in enumerate(("head.x_head.weight", "head.y_head.weight")):
        g = grads[name].numpy()  # (bins, hidden)
        uniform = 1.0 / g.shape[0]
        for k in range(num):
            if visible[k] == 0:
                continue
            target = uniform - g[:, k] * num / (gate * task)
            coords[k, axis] = _centre(target, model.sigma[axis]) / model.split_ratio
    return coords, visible


def read_reply(crafted: Crafted, grads: dict[str, torch.Tensor], model: ModelConfig, *,
               public_batch_size: int) -> Readout:
    """Rebuild psi(x) (block means) and the labels of the one record of the public draw from g_pub."""
    if public_batch_size != 1:
        raise ValueError(f"public_batch_size={public_batch_size}: this read-out separates one record; a larger "
                         "public batch gives the mean of its records' gradients")
    joints, visible = _labels(crafted, grads, model)
    return Readout(planes=_features(crafted, grads), joints=joints, visible=visible)


@dataclass(frozen=True)
class BatchReadout:
    """What the server reads from one reply whose public batch held several records: ``planes`` as ``Readout``'s
    but a weighted mean over the records; ``visible`` (K,) the fraction of them with joint k visible; ``targets``
    (2, K, bins) per axis and joint the mean SimCC target over the records where the joint is visible (NaN where
    none is)."""

    planes: dict[str | int, np.ndarray]
    visible: np.ndarray
    targets: np.ndarray


def read_batch(crafted: Crafted, grads: dict[str, torch.Tensor], model: ModelConfig) -> BatchReadout:
    """Read g_pub of a public batch of any size: its exact label statistics and a blended picture (see the module
    docstring); for one record ``targets`` is its SimCC target and ``visible`` its labels."""
    gate = float(F.gelu(torch.tensor(GATE, dtype=torch.float32)))
    num = crafted.joints
    task = 0.5 if model.task_uncertainty else 1.0
    vis_weight = 0.5 if model.task_uncertainty else model.vis_weight
    visible = 0.5 - grads["head.vis_head.weight"][0].double().numpy()[:num] * num / (gate * vis_weight)
    axes = []
    for name in ("head.x_head.weight", "head.y_head.weight"):
        g = grads[name].double().numpy()[:, :num]  # (bins, K): u w_task / K x mean_i vis_ik (p - t_ik)
        uniform = 1.0 / g.shape[0]
        with np.errstate(invalid="ignore", divide="ignore"):
            mixed = (visible[None, :] * uniform - g * num / (gate * task)) / visible[None, :]
        mixed[:, visible < 0.5 / 1e6] = np.nan
        axes.append(mixed.T)  # (K, bins)
    return BatchReadout(planes=_features(crafted, grads), visible=visible, targets=(axes[0], axes[1]))


def psnr(a: np.ndarray, b: np.ndarray, *, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of ``a`` against ``b`` (pixel units, peak 1); inf when equal."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(peak**2 / mse)


@dataclass(frozen=True)
class Score:
    """How close the rebuilt record is: PSNR (dB) of the rendered block means, the largest joint error (px,
    visible joints), and whether the visibility labels all match."""

    psnr_db: float
    label_error_px: float
    visibility_match: bool
    visible_joints: int


def score(readout: Readout, psi_image: torch.Tensor, joints: torch.Tensor, visible: torch.Tensor) -> Score:
    """Score against the true record: its psi(x) (3, H, W) downsampled as the trunk does, its joints and
    visibility."""
    truth = render(planes_of(psi_image))
    rebuilt = render(readout.planes)
    vis = visible.numpy() > 0.5
    err = np.abs(readout.joints[vis] - joints.numpy()[vis]).max() if vis.any() else 0.0
    return Score(psnr_db=psnr(rebuilt, truth), label_error_px=float(err),
                 visibility_match=bool((readout.visible > 0.5).tolist() == vis.tolist()),
                 visible_joints=int(vis.sum()))


def find_record(readout: Readout, joints: torch.Tensor, visible: torch.Tensor) -> tuple[int, float]:
    """The record (index into ``joints`` (N, K, 2) / ``visible`` (N, K)) whose labels the reply gave: the same
    visibility and the smallest largest joint error (px); that error is returned with it. Used by the scoring
    only: the server's read-out does not need the site's records."""
    best, error = -1, math.inf
    pattern = readout.visible > 0.5
    for i in range(len(joints)):
        vis = visible[i].numpy() > 0.5
        if vis.tolist() != pattern.tolist():
            continue
        err = float(np.abs(readout.joints[vis] - joints[i].numpy()[vis]).max()) if vis.any() else 0.0
        if err < error:
            best, error = i, err
    if best < 0:
        raise ValueError("no record has the visibility labels the reply gave")
    return best, error
