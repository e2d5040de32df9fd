"""PyTorch eager backend (``.pt`` fedpose checkpoints); torch is imported in the constructor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.runtime_base import Runtime


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

    def _run(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            sx, sy, _ = self._model(torch.from_numpy(x).to(self._device))
        return sx.cpu().numpy(), sy.cpu().numpy()

    def close(self) -> None:
        self._model = None
