"""Re-identification of people in DP-pixelized frames (what ``--pixelize`` does against a re-ID attacker).

The synthetic ward draws every person with identity cues (skin, hair, face
pattern, clothing colours and patterns, build) and shows each person in
``images_per_identity`` consecutive images of a split (``identities.json``).
The attacker knows the people: it trains a small CNN classifier on clean
crops of the first ``train_per_identity`` images of every person, then names
the person in each remaining frame after that frame was released as

- clean (upper baseline: the camera frame itself),
- plain Gaussian blur (a non-DP redaction baseline),
- DP pixelization (``fedpose.shared.pixelization``), uniform grid (Algorithm 2) or region
  adaptive (Algorithm 3, the body cells split n x n, mask from the
  ground-truth joints), for each eps and cell side b.

Crops are taken from the released frame at the annotated person box (the
attacker is given where the person is). Top-1 accuracy against chance 1 / #identities.
The attacker is trained with blur augmentation, so it is not broken merely by
the loss of detail; it is not trained on DP-noised frames (an adaptive
attacker could be: these numbers are a lower bound on what re-ID achieves).
``color`` (default True) releases colour frames (the pipeline's ``color=1``,
noise scaled by the 3 channels): clothing colours are the strongest cue;
``color=False`` is the pipeline's default grayscale release.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from fedpose.shared.pixelization.masks import body_mask_from_keypoints
from fedpose.shared.pixelization.mechanism import pixelize
from fedpose.shared.pixelization.spec import PixelizeSpec

log = logging.getLogger(__name__)

CROP = (64, 64)  # (H, W) of the attacker's input: square, so that a person lying in bed fills it too


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReidSpec:
    """The sweep: eps values, cell sides b, m-neighbourhood, adaptive split n, attacker training."""

    epsilons: tuple[float, ...] = (0.1, 0.5, 1.0, 5.0)
    cells: tuple[int, ...] = (8, 16)
    m: int = 16
    n: int = 4
    blur_sigma: float = 3.0
    train_per_identity: int = 5
    steps: int = 800
    color: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.epsilons or any(not (e > 0 and math.isfinite(e)) for e in self.epsilons):
            raise ValueError(f"epsilons={self.epsilons!r} must be positive finite numbers")
        if not self.cells or any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in self.cells):
            raise ValueError(f"cells={self.cells!r} must be ints >= 2")
        for b in self.cells:
            if b % self.n:
                raise ValueError(f"cell side b={b} must be a multiple of the adaptive split n={self.n}")
        if self.train_per_identity < 1 or self.steps < 1 or self.m < 1:
            raise ValueError("train_per_identity, steps and m must be >= 1")


def person_crop(frame: np.ndarray, center: np.ndarray, scale: float) -> np.ndarray:
    """(H, W[, 3]) frame -> (C, 64, 64) float32 crop in [0, 1] of the person box (C = 1 or 3)."""
    from fedpose.shared.data.transforms import affine_matrix, warp_image

    matrix = affine_matrix(center, scale, CROP)
    crop = warp_image(frame, matrix, CROP).astype(np.float32) / 255.0
    return crop[None] if crop.ndim == 2 else np.ascontiguousarray(crop.transpose(2, 0, 1))


def block_means(frame: np.ndarray, b: int) -> np.ndarray:
    """Plain (non-DP) pixelization: every b x b cell replaced by its mean, (H, W[, C]) uint8 -> the same shape."""
    img = frame if frame.ndim == 3 else frame[:, :, None]  # (H, W, C)
    h, w, c = img.shape
    hp, wp = -(-h // b) * b, -(-w // b) * b
    padded = np.pad(img.astype(np.float64), ((0, hp - h), (0, wp - w), (0, 0)), mode="symmetric")
    means = padded.reshape(hp // b, b, wp // b, b, c).mean(axis=(1, 3))
    out = np.rint(np.repeat(np.repeat(means, b, 0), b, 1)[:h, :w]).astype(np.uint8)
    return out if frame.ndim == 3 else out[:, :, 0]


def _net(channels: int, classes: int) -> Any:
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (16, 32, 32)
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (32, 16, 16)
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((4, 4)),  # (32, 4, 4)
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(32 * 16, classes),
    )


def _augment(crops: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Flip, shift, brightness/contrast and a random blur (sigma 0..3 px): (B, C, H, W) -> (B, C, H, W)."""
    out = np.empty_like(crops)
    for i, crop in enumerate(crops):
        c = crop[:, :, ::-1] if rng.random() < 0.5 else crop
        dy, dx = rng.integers(-3, 4, size=2)
        c = np.roll(c, (int(dy), int(dx)), axis=(1, 2))
        sigma = rng.uniform(0.0, 3.0)
        if sigma > 0.3:
            c = np.stack([cv2.GaussianBlur(np.ascontiguousarray(ch), (0, 0), sigma) for ch in c])
        c = c * rng.uniform(0.8, 1.2) + rng.uniform(-0.1, 0.1) + rng.normal(0, 0.03, c.shape)
        out[i] = np.clip(c, 0, 1)
    return out


def train_attacker(crops: np.ndarray, labels: np.ndarray, classes: int, *, steps: int, seed: int,
                   progress: bool = True) -> Any:
    """A small CNN classifier of identities from clean crops (N, C, H, W) in [0, 1]: ``steps`` Adam steps of 32."""
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = _net(crops.shape[1], classes)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3, weight_decay=1e-4)
    y = torch.from_numpy(labels).long()
    for _ in tqdm(range(steps), desc="re-ID attacker (clean crops)", disable=not progress, leave=False):
        idx = rng.choice(len(crops), size=min(32, len(crops)), replace=False)
        x = torch.from_numpy(_augment(crops[idx], rng))  # (B, C, H, W)
        loss = torch.nn.functional.cross_entropy(net(x), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.eval()
    return net


def top1(net: Any, crops: np.ndarray, labels: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        pred = net(torch.from_numpy(crops)).argmax(1).numpy()
    return float((pred == labels).mean())


def run_reid(root: str | Path, split: str, spec: ReidSpec, out: str | Path | None = None, *,
             progress: bool = True) -> dict[str, Any]:
    """Train the attacker on clean crops of ``split``, measure top-1 on every release; writes reid.json/png."""
    from tqdm.auto import tqdm

    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.data.synth.ward import load_identities

    t0 = time.perf_counter()
    records = load_split(Path(root), split)
    ids = load_identities(root, split)
    if len(ids) != len(records):
        raise ValueError(f"{split}: {len(ids)} identities for {len(records)} records")
    names = sorted(set(ids))
    label = np.array([names.index(i) for i in ids])
    seen: dict[int, int] = {}
    is_train = np.zeros(len(records), bool)
    for i, lab in enumerate(label):  # the first train_per_identity images of each person train the attacker
        is_train[i] = seen.get(int(lab), 0) < spec.train_per_identity
        seen[int(lab)] = seen.get(int(lab), 0) + 1
    if is_train.all():
        raise ValueError(f"every image of {split} is used for training at train_per_identity="
                         f"{spec.train_per_identity}: no query frames left")
    frames = [cv2.imread(str(r.image), cv2.IMREAD_COLOR) for r in records]
    if not spec.color:
        frames = [cv2.cvtColor(f, cv2.COLOR_BGR2GRAY) for f in frames]
    clean = np.stack([person_crop(f, r.center, r.scale) for f, r in zip(frames, records)])
    net = train_attacker(clean[is_train], label[is_train], len(names), steps=spec.steps, seed=spec.seed,
                         progress=progress)
    queries = np.nonzero(~is_train)[0]
    truth = label[queries]
    rng = np.random.default_rng(spec.seed)

    def released(transform) -> float:
        crops = np.stack([person_crop(transform(frames[i], records[i]), records[i].center, records[i].scale)
                          for i in queries])
        return top1(net, crops, truth)

    result: dict[str, Any] = {
        "split": split, "identities": len(names), "train_frames": int(is_train.sum()), "query_frames": len(queries),
        "chance": 1.0 / len(names), "color": spec.color, "m": spec.m, "n": spec.n, "blur_sigma": spec.blur_sigma,
        "clean": released(lambda f, r: f),
        "blur": released(lambda f, r: cv2.GaussianBlur(f, (0, 0), spec.blur_sigma)),
        "pixelized": [],
    }
    jobs = [(b, eps, mode) for b in spec.cells for eps in spec.epsilons for mode in ("uniform", "adaptive")]
    for b, eps, mode in tqdm(jobs, desc="re-ID on pixelized frames", disable=not progress, leave=False):
        n = 1 if mode == "uniform" else spec.n
        pspec = PixelizeSpec(eps=eps, b=b, m=spec.m, n=n)

        def dp(frame: np.ndarray, record: Any) -> np.ndarray:
            mask = None
            if n > 1:
                mask = body_mask_from_keypoints(frame.shape[:2], record.joints[record.visible])
            return pixelize(frame, pspec, mask=mask, rng=rng).render()

        result["pixelized"].append({"b": b, "eps": eps, "mode": mode, "top1": released(dp)})
    # the uniform grid without noise (plain, non-DP pixelization): what the cell size alone leaves
    result["plain_pixelization"] = [
        {"b": b, "top1": released(lambda f, r, b=b: block_means(f, b))} for b in spec.cells
    ]
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["claim"] = (f"each released frame is eps-DP for images differing in at most m={spec.m} pixels; the body "
                       "mask (adaptive) is not protected; over F frames of one person the guarantee composes to "
                       "F x eps")
    if out is not None:
        from fedpose.shared.configuration.yaml_io import write_json

        out = Path(out)
        write_json(out / "reid.json", result)
        plot_reid(result, out / "reid.png")
    return result


def plot_reid(result: dict[str, Any], path: str | Path) -> None:
    """Top-1 re-ID accuracy against eps (log x), one line per (b, mode), baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["pixelized"]
    for b in sorted({r["b"] for r in rows}):
        for mode, style in (("uniform", "-o"), ("adaptive", "--s")):
            pts = sorted((r["eps"], r["top1"]) for r in rows if r["b"] == b and r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"DP pixelization b={b} {mode}")
    ax.axhline(result["clean"], color="black", lw=1, label=f"clean ({result['clean']:.2f})")
    ax.axhline(result["blur"], color="tab:purple", lw=1, ls="-.", label=f"blur sigma {result['blur_sigma']:g} px "
               f"({result['blur']:.2f})")
    for row, colour in zip(result.get("plain_pixelization", []), ("tab:green", "tab:olive")):
        ax.axhline(row["top1"], color=colour, lw=1, ls="--", label=f"plain pixelization b={row['b']}, no noise "
                   f"({row['top1']:.2f})")
    ax.axhline(result["chance"], color="grey", lw=1, ls=":", label=f"chance ({result['chance']:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("per-frame eps (m = %d pixels)" % result["m"])
    ax.set_ylabel("top-1 re-identification accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"re-ID of {result['identities']} people, {result['query_frames']} query frames", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reid_summary(res: dict[str, Any], out: str | Path | None = None) -> list[str]:
    """The lines ``fedpose attack reid`` prints of ``run_reid``'s result: top-1 per release, and what it wrote."""
    lines = [f"re-identification of {res['identities']} people ({res['query_frames']} query frames, chance "
             f"{res['chance']:.3f}); attacker trained on {res['train_frames']} clean crops",
             f"  clean {res['clean']:.3f}   blur sigma {res['blur_sigma']:g} px {res['blur']:.3f}   " + "   ".join(
                 f"plain pixelization b={r['b']} {r['top1']:.3f}" for r in res["plain_pixelization"])]
    for r in res["pixelized"]:
        lines.append(f"  DP pixelization b={r['b']:<3} eps={r['eps']:<5g} {r['mode']:<9} top-1 {r['top1']:.3f}")
    lines.append(f"claim: {res['claim']}")
    if out:
        lines.append(f"wrote {Path(out) / 'reid.json'} and {Path(out) / 'reid.png'} ({res['seconds']:.0f} s)")
    return lines
