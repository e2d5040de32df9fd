"""Predictions and PCKh of a model on a list of records (the evaluation of runs, federations and sites)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.data.dataset import FACE_KEYS, PoseDataset
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.metrics.pose import pckh_report
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.model.simcc_decode import decode_simcc


@torch.no_grad()
def predict(model: PoseNet, dataset: PoseDataset, *, batch_size: int = 64, progress: bool = False,
            face_out: list[tuple[np.ndarray, dict[str, np.ndarray]]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keypoints (N, 16, 2) in input-crop pixels and scores (N, 16) for every record, in order.

    ``face_out``: a list that gets, batch by batch, the face head's (B, D) outputs and the batch's face labels
    (models with face tasks; the labels come with the crops, so nothing is cropped twice).
    """
    device = next(model.parameters()).device
    model.eval()
    pts, scores = [], []
    n = len(dataset)
    for start in tqdm(range(0, n, batch_size), desc="eval", disable=not progress, leave=False):
        idx = list(range(start, min(start + batch_size, n)))
        batch = dataset.batch(idx)
        if face_out is not None:
            x_logits, y_logits, _, face = model.forward_with_face(batch["image"].to(device))
            face_out.append((face.cpu().numpy(), {k: v.numpy() for k, v in batch.items() if k in FACE_KEYS}))
        else:
            x_logits, y_logits, _ = model(batch["image"].to(device))
        kp, sc = decode_simcc(x_logits.cpu().numpy(), y_logits.cpu().numpy(), split_ratio=model.cfg.split_ratio)
        pts.append(kp)
        scores.append(sc)
    model.train()
    if not pts:
        return np.zeros((0, 16, 2), np.float32), np.zeros((0, 16), np.float32)
    return np.concatenate(pts), np.concatenate(scores)


def evaluate(
    model: PoseNet, records: list[PoseRecord], *, batch_size: int = 64, progress: bool = False
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """PCKh@0.5 / @0.1 on ``records`` (with head boxes); returns (report, keypoints in image px, scores).

    A model with face tasks also gets ``report["face"]`` (``fedpose.shared.metrics.face.face_report``, in the input
    crop's pixels) over the records that carry face labels.
    """
    from fedpose.shared.data.transforms import inverse_transform, record_boxes

    if not records:
        raise ValueError("nothing to evaluate: the split has no records")
    if any(r.headbox is None for r in records):
        raise ValueError("PCKh needs head boxes for every record (headboxes.json or mpii_gt_val.mat)")
    faces = model.face_head is not None
    dataset = PoseDataset(records, input_size=model.input_size, augment=None, face_tasks=faces)
    face_out: list[tuple[np.ndarray, dict[str, np.ndarray]]] | None = [] if faces else None
    kp_input, scores = predict(model, dataset, batch_size=batch_size, progress=progress, face_out=face_out)
    kp_image = inverse_transform(kp_input, *record_boxes(records), model.input_size)
    gt = np.stack([r.joints for r in records])
    vis = np.stack([r.visible for r in records])
    heads = np.stack([r.headbox for r in records])
    report: dict[str, Any] = pckh_report(kp_image, gt, vis, heads)
    if face_out is not None:
        report["face"] = _face_report(model, face_out)
    return report, kp_image, scores


def _face_report(model: PoseNet, face_out: list[tuple[np.ndarray, dict[str, np.ndarray]]]) -> dict[str, Any]:
    from fedpose.shared.metrics.face import face_report
    from fedpose.shared.model.face_decode import decode_face, split_face

    out = np.concatenate([o for o, _ in face_out])
    labels = {k: np.concatenate([lab[k] for _, lab in face_out]) for k in face_out[0][1]}  # canonical crops
    truth = {"labelled": labels["face_labelled"] > 0, "present": labels["face_present"] > 0,
             "box": labels["face_box"], "landmarks": labels["face_landmarks"], "visible": labels["face_visible"] > 0,
             "head_pose": labels["head_pose"], "attribute": labels["face_attribute"]}
    pred = decode_face(split_face(out, model.cfg.face_tasks, model.cfg.face_attributes), input_size=model.input_size)
    return face_report(pred, truth, input_size=model.input_size)
