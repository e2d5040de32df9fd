"""PoseNet: TinyViT trunk + SimCC head, its builders and checkpoints.

Which parameters a strategy trains is ``fedpose.shared.model.strategy``; the functional per-sample loss the
private step differentiates is ``fedpose.shared.model.pose_loss``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fedpose.shared.errors import ConfigError
from fedpose.shared.configuration.schema import ModelConfig
from fedpose.shared.data.joints import NUM_JOINTS
from fedpose.shared.model.face_head import FaceHead, face_losses, loss_terms
from fedpose.shared.model.simcc import SimCCHead, combine_task_losses, simcc_losses
from fedpose.shared.model.tinyvit import (ARCHS, TinyVit, checkpoint_filter_fn, fuse_batchnorm, init_fused_convs,
                                          is_fused)

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CHECKPOINT_FORMAT = 1
# The parameter of the task-uncertainty weights (SimCCHead.log_task_scale), which the strategies and the loss
# single out.
TASK_SCALE = "head.log_task_scale"


class PoseNet(TinyVit):
    """(B, 3, H, W) RGB in [0, 1] -> SimCC logits x (B, K, W*s), y (B, K, H*s), visibility (B, K).

    Inherits the trunk so the state_dict reads ``patch_embed.*``, ``stages.*``,
    ``head.norm.*`` exactly like timm's TinyViT. Input normalisation is part of
    the model, so edge pre-processing is only crop + scale to [0, 1].
    """

    def __init__(self, cfg: ModelConfig, input_size: tuple[int, int]) -> None:
        super().__init__(ARCHS[cfg.variant])
        self.cfg = cfg
        self.input_size = tuple(input_size)
        h, w = input_size
        feature_size = (math.ceil(h / 32), math.ceil(w / 32))
        self.head = SimCCHead(
            self.num_features,
            feature_size,
            (h, w),
            num_joints=NUM_JOINTS,
            split_ratio=cfg.split_ratio,
            joint_channels=cfg.joint_channels,
            hidden=cfg.hidden,
            task_uncertainty=cfg.task_uncertainty,
            num_tasks=3 + len(loss_terms(cfg.face_tasks)),
        )
        # DPLH's face tasks (shared.model.face_head): None unless the config asks for them.
        self.face_head = (FaceHead(self.num_features, feature_size, tasks=cfg.face_tasks,
                                   attributes=cfg.face_attributes) if cfg.face_tasks else None)
        self.register_buffer("pixel_mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def _trunk(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) RGB in [0, 1] -> stage-4 features, normalised inside the model."""
        return self.forward_features((images - self.pixel_mean) / self.pixel_std)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.head(self._trunk(images))

    def forward_with_face(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` plus the face head's (B, D) outputs (``fedpose.shared.model.face_head``); needs face tasks."""
        if self.face_head is None:
            raise ValueError("this model has no face tasks (model.face_tasks is empty)")
        feats = self._trunk(images)
        return (*self.head(feats), self.face_head(feats))

    def task_losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample task losses (B, T) on ``batch``: SimCC x, y, visibility ("image", "joints", "visible"),
        then the face terms (``face_head.loss_terms``) from the face keys when the model has face tasks."""
        if self.face_head is not None:
            x_logits, y_logits, vis_logits, face = self.forward_with_face(batch["image"])
            face_cols = face_losses(face, batch, tasks=self.cfg.face_tasks, attributes=self.cfg.face_attributes,
                                    input_size=self.input_size)
        else:
            x_logits, y_logits, vis_logits = self(batch["image"])
            face_cols = None
        pose = simcc_losses(
            x_logits,
            y_logits,
            vis_logits,
            batch["joints"],
            batch["visible"],
            split_ratio=self.cfg.split_ratio,
            sigma=self.cfg.sigma,
        )
        return pose if face_cols is None else torch.cat([pose, face_cols], dim=1)

    def losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample total loss (B,) on ``batch`` (see ``task_losses``)."""
        return combine_task_losses(self.task_losses(batch), self.head.log_task_scale, vis_weight=self.cfg.vis_weight)


def build_model(cfg: ModelConfig, input_size: tuple[int, int]) -> PoseNet:
    """A fresh PoseNet with BatchNorm already folded (ready for DP training from scratch)."""
    return init_fused_convs(fuse_batchnorm(PoseNet(cfg, input_size)))


def build_pretrain_model(cfg: ModelConfig, input_size: tuple[int, int]) -> PoseNet:
    """A fresh PoseNet *with* BatchNorm, for non-private pretraining on public data only.

    BatchNorm couples the samples of a batch, which is fine without privacy;
    it is folded (``fuse_batchnorm``) before the model ever sees private data.
    """
    return PoseNet(cfg, input_size)


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


def save_checkpoint(path: str | Path, model: PoseNet, meta: dict[str, Any] | None = None) -> None:
    """Write weights + the model config + input size (+ free-form meta) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "model_config": asdict(model.cfg),
        "input_size": list(model.input_size),
        "fused": is_fused(model),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "meta": meta or {},
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[PoseNet, dict[str, Any]]:
    """Rebuild a PoseNet from a fedpose checkpoint; returns (model, meta). Always returns a fused model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for corrupt files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {path} is not a readable fedpose checkpoint: {first}") from err
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {path} is not a fedpose checkpoint (format {CHECKPOINT_FORMAT})")
    missing = [k for k in ("model_config", "input_size", "state_dict") if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}: not a complete fedpose checkpoint")
    mc, state = payload["model_config"], payload["state_dict"]
    if not isinstance(mc, dict) or not isinstance(state, dict):
        raise ValueError(f"checkpoint {path}: model_config and state_dict must be mappings")
    # Validate every dimension (ModelConfig's own bounds, DataConfig's input bounds) before building.
    from fedpose.shared.configuration.schema import DataConfig, section_from_dict

    try:
        cfg = section_from_dict(ModelConfig, dict(mc), "model_config")
        size = payload["input_size"]
        if not isinstance(size, (list, tuple)):
            raise ConfigError(f"input_size: expected [H, W], got {size!r}")
        input_size = DataConfig(input_size=tuple(size)).input_size
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in input_size):
            raise ConfigError(f"input_size: expected two integers, got {list(input_size)}")
    except (ConfigError, TypeError) as err:
        raise ValueError(f"checkpoint {path}: {err}") from err
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"checkpoint {path}: state_dict[{name!r}] is not a tensor")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"checkpoint {path}: weights hold non-finite values (NaN/inf) in {name}")
    model = PoseNet(cfg, input_size)
    try:
        if payload.get("fused", True):
            fuse_batchnorm(model)
            model.load_state_dict(state)
        else:
            model.load_state_dict(state)
            fuse_batchnorm(model)
    except RuntimeError as err:  # missing/unexpected keys, shape mismatches
        raise ValueError(f"checkpoint {path}: weights do not match its model_config: {err}") from err
    meta = payload.get("meta", {})
    return model, meta if isinstance(meta, dict) else {}


def load_tinyvit_weights(model: PoseNet, path: str | Path) -> list[str]:
    """Initialise the trunk from a TinyViT checkpoint (timm or original layout).

    The model must not be fused yet (BatchNorm statistics are loaded, then
    folded by the caller). Returns the names of parameters left at their
    initial values (the pose and face heads).
    """
    if is_fused(model):
        raise ConfigError("load TinyViT weights into an unfused PoseNet, then call fuse_batchnorm")
    try:
        sd = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"cannot read TinyViT checkpoint {path}: {err}") from err
    filtered = checkpoint_filter_fn(sd, model)
    result = model.load_state_dict(filtered, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"TinyViT checkpoint {path} has keys this model lacks: {result.unexpected_keys[:5]}")
    missing_trunk = [k for k in result.missing_keys if not k.startswith(("head.", "face_head."))]
    if missing_trunk:
        raise ValueError(f"TinyViT checkpoint {path} lacks trunk keys: {missing_trunk[:5]}")
    log.info("loaded TinyViT trunk from %s (%d tensors)", path, len(filtered))
    return result.missing_keys
