"""What a training step reads: datasets from records, batches on the device, psi of a batch, V from public data.

Every function here is a plain transformation of data the caller already holds; the privacy step itself
(``fedpose.shared.privacy.step.fpdp``) never sees a dataset, only the batches made here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fedpose.shared.training.allocator import keep_freed_memory
from fedpose.shared.configuration.schema import Config, PrivacyConfig
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.augment import Augment
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.privacy.step.psi import PsiBatch, apply_psi
from fedpose.shared.privacy.step.psi_maps import DPPixelize, FeatureMap, make_psi
from fedpose.shared.privacy.step.subspace import compute_basis, compute_scaled_basis
from fedpose.shared.privacy.step.tensor_scales import public_scales


def make_dataset(records: list[PoseRecord], cfg: Config, *, train: bool, seed: int | None = None) -> PoseDataset:
    augment = Augment() if (train and cfg.data.augment) else None
    return PoseDataset(records, input_size=cfg.data.input_size, augment=augment, seed=seed,
                       face_tasks=bool(cfg.model.face_tasks))


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


def public_basis_at(
    model: PoseNet,
    loss_fn: Callable,
    trainable: list[str],
    public: PoseDataset,
    privacy: PrivacyConfig,
    device: torch.device,
) -> torch.Tensor:
    """V (p x k) from m public per-sample gradients at the current weights (P2: public data only)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=True)
    return compute_basis(loss_fn, current, batch, k=privacy.k, chunk_size=privacy.chunk_size, clip=privacy.basis_clip)


def public_scaled_basis_at(model: PoseNet, loss_fn: Callable, trainable: list[str], public: PoseDataset,
                           privacy: PrivacyConfig, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """``train.tensor_scales: public`` with a projection: V of the scaled public gradients and the scales (P2)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=True)
    return compute_scaled_basis(loss_fn, current, batch, k=privacy.k, chunk_size=privacy.chunk_size,
                                clip=privacy.basis_clip)


def public_scales_at(model: PoseNet, loss_fn: Callable, trainable: list[str], public: PoseDataset,
                     privacy: PrivacyConfig, device: torch.device) -> dict[str, float]:
    """``train.tensor_scales: public`` without a projection: each tensor's scale from the m public samples (P2)."""
    current, batch = _public_inputs(model, trainable, public, privacy, device, basis=False)
    return public_scales(loss_fn, current, batch, chunk_size=privacy.chunk_size)


def _public_inputs(model: PoseNet, trainable: list[str], public: PoseDataset, privacy: PrivacyConfig,
                   device: torch.device, *, basis: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The trained weights (detached) and the first m public samples on the device; for a ``basis``, k <= m."""
    m = min(privacy.m, len(public))
    if basis and privacy.k > m:
        raise ValueError(f"privacy.k = {privacy.k} exceeds the {m} public samples available; lower k")
    batch = to_device(public.batch(list(range(m))), device)
    keep_freed_memory()
    named = dict(model.named_parameters())
    return {name: named[name].detach() for name in trainable}, batch
