"""DPLH's face tasks as one extra head on the pose trunk: face presence and box, five landmarks with their
visibility, head pose, and an attribute.

DPLH (HyperFace's tasks under DP-SGD) trains all tasks from one trunk with per-sample clipping of the summed
loss and weighs the tasks by learned homoscedastic uncertainty. Here the face head sits beside the SimCC head
on the same stage-4 features; its per-sample task losses join the pose losses as extra columns of the (B, T)
matrix that clipping, noise, projection and psi already work on, and each column gets its own learned weight
(``combine_task_losses``). Every loss of a sample depends on that sample only, as per-sample clipping needs.

The head's output is one (B, D) tensor, the tasks' blocks in ``FACE_TASKS`` order
(``fedpose.shared.model.face_decode``, torch-free, also holds the decode):
- detect: presence logit, box (centre x, centre y, width, height) as fractions of the input width / height;
- landmarks: 5 x (x, y) as fractions of the input size, then 5 visibility logits;
- head_pose: (yaw, pitch, roll) / 90 degrees;
- attribute: ``face_attributes`` class logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedpose.shared.data.face import NUM_LANDMARKS
from fedpose.shared.model.face_decode import ANGLE_UNIT, face_slices, ordered
from fedpose.shared.model.layers import LayerNorm2d

# The loss columns each task adds, in order (names for logs and metrics).
TASK_TERMS: dict[str, tuple[str, ...]] = {
    "detect": ("face_presence", "face_box"),
    "landmarks": ("landmarks", "landmark_visibility"),
    "head_pose": ("head_pose",),
    "attribute": ("attribute",),
}


def loss_terms(tasks: tuple[str, ...]) -> tuple[str, ...]:
    """Names of the loss columns the enabled tasks add after the three SimCC ones."""
    return tuple(term for task in ordered(tasks) for term in TASK_TERMS[task])


class FaceHead(nn.Module):
    """Features (B, C, h, w) -> (B, D) face outputs (see the module docstring for the layout).

    LayerNorm, a 1x1 reduction, one hidden layer: the layer types book-keeping clipping has exact rules for.
    """

    def __init__(self, in_channels: int, feature_size: tuple[int, int], *, tasks: tuple[str, ...], attributes: int,
                 channels: int = 32, hidden: int = 128) -> None:
        super().__init__()
        if not tasks:
            raise ValueError("FaceHead needs at least one task")
        width = max(s.stop for s in face_slices(tasks, attributes).values())
        fh, fw = feature_size
        self.norm = LayerNorm2d(in_channels)
        self.reduce = nn.Conv2d(in_channels, channels, 1)
        self.mlp = nn.Sequential(nn.Linear(channels * fh * fw, hidden), nn.GELU())
        self.out = nn.Linear(hidden, width)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        z = self.reduce(self.norm(feats))  # (B, c, h, w)
        return self.out(self.mlp(z.flatten(1)))  # (B, D)


def face_losses(out: torch.Tensor, batch: dict[str, torch.Tensor], *, tasks: tuple[str, ...], attributes: int,
                input_size: tuple[int, int]) -> torch.Tensor:
    """Per-sample face losses (B, T_face), columns as ``loss_terms(tasks)``.

    A record without face labels (``face_labelled`` 0) adds nothing; box, landmarks and head pose count only
    where the face is present; the attribute only where it is known (>= 0). Box and landmarks are compared as
    fractions of the input size, the head pose in units of 90 degrees (wrapped, so 179 and -179 are close).
    """
    h, w = input_size
    labelled = batch["face_labelled"]
    present = batch["face_present"] * labelled
    scale = out.new_tensor([w, h])
    cols: list[torch.Tensor] = []
    for task, sl in face_slices(tasks, attributes).items():
        block = out[:, sl]
        if task == "detect":
            cols.append(F.binary_cross_entropy_with_logits(block[:, 0], batch["face_present"], reduction="none")
                        * labelled)
            box = batch["face_box"]
            target = torch.cat([(box[:, :2] + box[:, 2:]) / 2 / scale, (box[:, 2:] - box[:, :2]) / scale], dim=1)
            cols.append(F.smooth_l1_loss(block[:, 1:5], target, reduction="none", beta=0.05).mean(1) * present)
        elif task == "landmarks":
            vis = batch["face_visible"]
            pts = block[:, : 2 * NUM_LANDMARKS].reshape(-1, NUM_LANDMARKS, 2)
            err = ((pts - batch["face_landmarks"] / scale) ** 2).sum(-1)  # (B, 5)
            cols.append((err * vis).sum(1) / NUM_LANDMARKS * present)
            logits = block[:, 2 * NUM_LANDMARKS:]
            cols.append(F.binary_cross_entropy_with_logits(logits, vis, reduction="none").mean(1) * present)
        elif task == "head_pose":
            diff = block - batch["head_pose"] / ANGLE_UNIT
            diff = torch.remainder(diff + 2.0, 4.0) - 2.0  # wrap: 360 degrees are 4 units
            cols.append((diff**2).mean(1) * present)
        else:  # attribute
            target = batch["face_attribute"]
            known = (target >= 0).to(out.dtype) * labelled
            cols.append(F.cross_entropy(block, target.clamp_min(0), reduction="none") * known)
    return torch.stack(cols, dim=1)
