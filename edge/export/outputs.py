"""The module an export traces: the model itself, or for a model with face tasks a wrapper whose outputs are the
pose outputs and then one per face task (``spec.export_outputs`` names them)."""

from __future__ import annotations

import torch

from fedpose.shared.model.face_decode import face_slices
from fedpose.shared.model.posenet import PoseNet


class ExportedOutputs(torch.nn.Module):
    """What the exported graph computes: the pose outputs, then each face task's block as its own output."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        cfg = model.cfg
        self.slices = list(face_slices(cfg.face_tasks, cfg.face_attributes).values()) if cfg.face_tasks else []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.slices:
            return self.model(x)
        sx, sy, vis, face = self.model.forward_with_face(x)
        return (sx, sy, vis, *[face[:, sl] for sl in self.slices])


def exported_module(model: PoseNet) -> torch.nn.Module:
    """The module the graph is traced from: the model itself when it has no face tasks (its graph as always)."""
    return ExportedOutputs(model) if model.face_head is not None else model
