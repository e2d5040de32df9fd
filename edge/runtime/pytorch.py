"""PyTorch eager backend (``.pt`` fedpose checkpoints); torch is imported in the constructor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedpose.edge.runtime.base import Runtime


class TorchRuntime(Runtime):
    """PyTorch eager on a fedpose checkpoint (``.pt``): the reference every export is checked against."""

    backend = "torch"

    def __init__(self, model_path: str | Path, *, device: str = "cpu", threads: int | None = None) -> None:
        import torch

        from fedpose.edge.export.outputs import exported_module
        from fedpose.edge.export.spec import OUTPUT_NAMES, export_outputs
        from fedpose.shared.model.posenet import load_checkpoint

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
        # What an export of this checkpoint computes, by the export's output names (edge.export.outputs).
        self._outputs = export_outputs(model)
        self._exported = exported_module(self._model)
        self.face_outputs = self._outputs[len(OUTPUT_NAMES):]

    def _run(self, x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():
            out = dict(zip(self._outputs, self._exported(torch.from_numpy(x).to(self._device)), strict=True))
        return {n: out[n].cpu().numpy() for n in names}

    def close(self) -> None:
        self._model = self._exported = None
