"""PyTorch eager backend (``.pt`` fedpose checkpoints); torch is imported in the constructor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.runtime_base import Runtime
from shared.model.face_decode import FACE_OUTPUTS, ordered, split_face


class TorchRuntime(Runtime):
    """PyTorch eager on a fedpose checkpoint (``.pt``): the reference every export is checked against."""

    backend = "torch"

    def __init__(self, model_path: str | Path, *, device: str = "cpu", threads: int | None = None) -> None:
        import torch

        from shared.model.posenet import load_checkpoint

        self.model_path = Path(model_path)
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            model, _ = load_checkpoint(self.model_path, map_location=device)
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"{self.model_path} is not a readable fedpose checkpoint: {err}") from err
        self._model = model.to(device).eval()
        self._device = torch.device(device)
        self._input_size = tuple(int(v) for v in model.input_size)
        self.split_ratio = float(model.cfg.split_ratio)
        self.face_outputs = tuple(FACE_OUTPUTS[t] for t in ordered(model.cfg.face_tasks))

    def _run(self, x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        import torch

        cfg = self._model.cfg
        with torch.inference_mode():
            images = torch.from_numpy(x).to(self._device)
            if any(n in self.face_outputs for n in names):
                sx, sy, _, face = self._model.forward_with_face(images)
                out = split_face(face.cpu().numpy(), cfg.face_tasks, cfg.face_attributes)
            else:
                (sx, sy, _), out = self._model(images), {}
        out.update(simcc_x=sx.cpu().numpy(), simcc_y=sy.cpu().numpy())
        return {n: out[n] for n in names}

    def close(self) -> None:
        self._model = None
