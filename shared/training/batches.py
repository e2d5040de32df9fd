"""What a training step reads: datasets from records, batches on the device, psi of a batch (V from public data is
``fedpose.shared.privacy.step.subspace.public_basis_at``).

Every function here is a plain transformation of data the caller already holds; the privacy step itself
(``fedpose.shared.privacy.step.fpdp``) never sees a dataset, only the batches made here.
"""

from __future__ import annotations

import numpy as np
import torch

from fedpose.shared.configuration.schema import Config, PrivacyConfig
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.augment import Augment
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.privacy.step.psi import DPPixelize, FeatureMap, PsiBatch, apply_psi, make_psi


def make_dataset(records: list[PoseRecord], cfg: Config, *, train: bool, seed: int | None = None) -> PoseDataset:
    augment = Augment() if (train and cfg.data.augment) else None
    return PoseDataset(records, input_size=cfg.data.input_size, augment=augment, seed=seed,
                       face_tasks=bool(cfg.model.face_tasks))


def assembly_device(device: torch.device) -> torch.device | None:
    """Where a training process on ``device`` assembles its batches (``PoseDataset.assembled_on``): on a GPU, there
    (one grid and one sampling a batch; per image on the CPU the step would wait for it); on the CPU, None: per
    image in threads, which is faster there (benchmarks/batch_assembly.py, docs/results/benchmarks.md)."""
    return device if device.type == "cuda" else None


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "index"}


def make_psi_from(privacy: PrivacyConfig, generator: torch.Generator) -> FeatureMap:
    """psi of the config: Gaussian blur (sigma = psi_param * min(H, W)), pixelation (block psi_param px) or
    DP pixelization (its noise seeded from ``generator``, the run's noise source)."""
    if privacy.psi == "blur":
        return make_psi("gaussian_blur", blur_sigma_frac=privacy.psi_param)
    if privacy.psi == "dp-pixelize":
        seed = torch.randint(0, 2**31 - 1, (4,), generator=generator).tolist()
        return DPPixelize(PixelizeSpec(eps=privacy.psi_eps, b=int(privacy.psi_param), m=privacy.psi_m),
                          rng=np.random.default_rng(seed))
    return make_psi("pixelate", block_size=int(privacy.psi_param))


def psi_on(psi: FeatureMap, batch: dict[str, torch.Tensor], device: torch.device) -> PsiBatch:
    """``apply_psi`` on ``batch`` moved to ``device``; a per-record psi (dp-pixelize) also gets the indices."""
    moved = to_device(batch, device)
    if getattr(psi, "per_record", False):
        moved["index"] = batch["index"]
    return apply_psi(psi, moved)
