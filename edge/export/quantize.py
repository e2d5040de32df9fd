"""INT8 Q/DQ models by onnxruntime static quantization, and their PCKh against FP32.

Two targets, because the two consumers want different integer types:
- ``"tensorrt"`` (default, what ``fedpose edge export --int8`` writes):
  symmetric INT8 activations and weights, all zero points 0, because
  TensorRT's explicit quantization requires zero points of 0 (onnx-tensorrt
  operators.md: QuantizeLinear/DequantizeLinear). onnxruntime runs this file
  correctly but slowly on x86 (no fused S8 x S8 kernels there).
- ``"cpu"``: UINT8 (asymmetric) activations x INT8 weights, the layout
  onnxruntime's x86 kernels are fast for; TensorRT cannot build it.
Only Conv and MatMul inputs are quantized: they hold almost all the
arithmetic, and TensorRT fuses exactly those Q/DQ pairs into INT8 kernels;
LayerNorm, Softmax and the SimCC logits stay in float.

Calibration images come from the public split only (crops of public
records), never from a site's private data: the activation ranges stored in
the file are a function of public data (DESIGN P2 in spirit: nothing private
is baked into a released artefact).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedpose.shared.data.records import PoseRecord

log = logging.getLogger(__name__)

CalibrationName = Literal["minmax", "percentile", "entropy"]
Target = Literal["tensorrt", "cpu"]
QUANTIZED_OPS: tuple[str, ...] = ("Conv", "MatMul")


def record_crops(records: Sequence[PoseRecord], input_size: tuple[int, int]) -> np.ndarray:
    """Un-augmented crops of records' person boxes: (N, 3, H, W) float32 RGB in [0, 1]."""
    from fedpose.shared.data.dataset import PoseDataset

    if not records:
        raise ValueError("no records to crop: the split is empty")
    dataset = PoseDataset(records, input_size=input_size, augment=None, cache_images=False)
    return dataset.batch(list(range(len(records))))["image"].numpy()


def quantize_int8(
    fp32_onnx: str | Path,
    out: str | Path,
    calibration: np.ndarray,
    *,
    per_channel: bool = True,
    method: CalibrationName = "minmax",
    target: Target = "tensorrt",
) -> Path:
    """Write a Q/DQ INT8 copy of ``fp32_onnx`` calibrated on ``calibration`` (N, 3, H, W) float32.

    The model's batch size (fixed or dynamic) is kept. Raises ValueError for
    calibration data of the wrong shape and RuntimeError when a "tensorrt"
    result would not build in TensorRT (non-zero zero points, unsupported ops).
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    from fedpose.edge.export.trt_ops import check_qdq_zero_points, unsupported_ops
    from fedpose.edge.export.trt_build import read_onnx_info

    info = read_onnx_info(fp32_onnx)
    if info.fp16:
        raise ValueError(f"{fp32_onnx} is an FP16 model; quantize the FP32 export instead")
    if info.qdq:
        raise ValueError(f"{fp32_onnx} is already quantized")
    x = np.ascontiguousarray(calibration, dtype=np.float32)
    if x.ndim != 4 or x.shape[1:] != (3, *info.input_size):
        raise ValueError(
            f"calibration images must be (N, 3, {info.input_size[0]}, {info.input_size[1]}), got {x.shape}"
        )
    batch = info.batch or 1
    if len(x) < batch:
        raise ValueError(f"need at least {batch} calibration images for a batch-{batch} model, got {len(x)}")
    methods = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }
    if method not in methods:
        raise ValueError(f"calibration method must be one of {sorted(methods)}, got {method!r}")
    if target not in ("tensorrt", "cpu"):
        raise ValueError(f"target must be 'tensorrt' or 'cpu', got {target!r}")
    symmetric = target == "tensorrt"

    class Reader(CalibrationDataReader):  # onnxruntime checks the base class
        """The calibration images, ``batch`` at a time (a trailing partial batch is left out)."""

        def __init__(self) -> None:
            self._iter: Iterator[dict[str, np.ndarray]] | None = None

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self._iter is None:
                self._iter = ({info.input_name: x[start : start + batch]}
                              for start in range(0, len(x) - batch + 1, batch))
            return next(self._iter, None)

        def rewind(self) -> None:
            self._iter = None

    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.onnx")
    pre = out.with_suffix(".pre.onnx")
    root_logger = logging.getLogger()
    level = root_logger.level
    # onnxruntime.quantization logs one INFO line per rescaled weight channel on the root logger.
    root_logger.setLevel(max(level, logging.WARNING))
    try:
        # Shape inference only: ORT graph optimizations could fuse ops into com.microsoft kernels TensorRT lacks.
        quant_pre_process(str(fp32_onnx), str(pre), skip_optimization=True)
        quantize_static(
            str(pre),
            str(tmp),
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(QUANTIZED_OPS),
            per_channel=per_channel,
            activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=methods[method],
            extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
        )
    finally:
        root_logger.setLevel(level)
        pre.unlink(missing_ok=True)
    model = onnx.load(str(tmp))
    problems = []
    bad_zp = check_qdq_zero_points(model) if symmetric else []
    if bad_zp:
        problems.append(f"non-zero zero points in {bad_zp[:3]}")
    bad_ops = unsupported_ops(model)
    if bad_ops:
        problems.append(f"ops TensorRT 10 does not parse: {bad_ops}")
    if problems:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"INT8 model for {fp32_onnx} is not TensorRT-ready: " + "; ".join(problems))
    tmp.replace(out)
    log.info("wrote INT8 Q/DQ model %s for %s (%d calibration images, %s)", out, target, len(x), method)
    return out


@dataclass(frozen=True)
class PrecisionReport:
    """PCKh of the FP32 and INT8 files on the same records, and the drop."""

    fp32: dict[str, dict[str, float]]
    int8: dict[str, dict[str, float]]
    records: int

    @property
    def drop(self) -> float:
        """FP32 minus INT8 PCKh@0.5 mean (positive = INT8 is worse)."""
        return float(self.fp32["pckh"]["mean"] - self.int8["pckh"]["mean"])

    @property
    def drop_at_0_1(self) -> float:
        return float(self.fp32["pckh@0.1"]["mean"] - self.int8["pckh@0.1"]["mean"])


def predict_records(runtime: Any, records: Sequence[PoseRecord], *, batch: int = 32) -> np.ndarray:
    """(N, K, 2) keypoints of any runtime on records' un-augmented crops, in the records' image pixels."""
    from fedpose.shared.data.transforms import inverse_transform, record_boxes
    from fedpose.shared.model.simcc_decode import decode_simcc

    if not records:
        raise ValueError("nothing to evaluate: no records")
    images = record_crops(records, runtime.input_size)
    h, w = runtime.input_size
    kps = []
    for start in range(0, len(images), batch):
        sx, sy = runtime.infer(images[start : start + batch])
        kp, _ = decode_simcc(sx, sy, split_ratio=sx.shape[-1] / w)
        kps.append(kp)
    centers, scales = record_boxes(records)
    return np.asarray(inverse_transform(np.concatenate(kps), centers, scales, (h, w)))


def evaluate_runtime(runtime: Any, records: Sequence[PoseRecord], *, batch: int = 32) -> dict[str, dict[str, float]]:
    """PCKh@0.5 / @0.1 of any runtime on records with head boxes (un-augmented record boxes)."""
    from fedpose.shared.metrics.pose import pckh_report

    if not records:
        raise ValueError("nothing to evaluate: no records")
    if any(r.headbox is None for r in records):
        raise ValueError("PCKh needs head boxes for every record")
    pred = predict_records(runtime, records, batch=batch)
    gt = np.stack([r.joints for r in records])
    vis = np.stack([r.visible for r in records])
    heads = np.stack([r.headbox for r in records])
    return pckh_report(pred, gt, vis, heads)


def compare_precisions(
    fp32_onnx: str | Path, int8_onnx: str | Path, records: Sequence[PoseRecord], *, threads: int | None = None
) -> PrecisionReport:
    """PCKh of both files on ``records`` (the val split), for the export report."""
    from fedpose.edge.runtime.onnx import OnnxRuntime

    with OnnxRuntime(fp32_onnx, threads=threads) as fp32, OnnxRuntime(int8_onnx, threads=threads) as int8:
        return PrecisionReport(
            fp32=evaluate_runtime(fp32, records), int8=evaluate_runtime(int8, records), records=len(records)
        )


@dataclass(frozen=True)
class Int8Export:
    """What ``quantize_on_public`` wrote: ``<fp32>.int8.onnx``, the number of public images it was calibrated on,
    and the data root they came from (the val split it is compared on lies there too)."""

    path: Path
    calibrated: int
    data_root: Path


def quantize_on_public(fp32_path: Path, cfg: Any, input_size: tuple[int, int], *, count: int,
                       method: CalibrationName = "minmax", target: Target = "tensorrt") -> Int8Export:
    """``fedpose edge export --int8``: ``fp32_path`` quantized into ``<stem>.int8.onnx`` beside it, calibrated on
    ``count`` public images of the config's data (drawn with a fixed seed; a synthetic ward is generated on first
    use)."""
    from fedpose.shared.data.mpii import load_split
    from fedpose.shared.training.runs import ensure_data

    root = ensure_data(cfg)  # data.source synthetic: the ward is generated on first use
    public = load_split(root, cfg.data.public_split)
    if not public:
        raise ValueError(f"the public split {cfg.data.public_split!r} under {root} is empty: nothing to calibrate on")
    if count < 1:
        raise ValueError(f"--calib-count must be >= 1, got {count}")
    chosen = sorted(np.random.default_rng(0).permutation(len(public))[:count].tolist())
    calib = record_crops([public[i] for i in chosen], input_size)
    int8_path = fp32_path.with_name(fp32_path.stem + ".int8.onnx")
    quantize_int8(fp32_path, int8_path, calib, method=method, target=target)
    return Int8Export(path=int8_path, calibrated=len(calib), data_root=root)


def compare_on_val(fp32_path: Path, int8: Int8Export, val_split: str, count: int | None = None) -> PrecisionReport:
    """PCKh of the FP32 file and of its INT8 export on the first ``count`` people of ``val_split`` (every one when
    None), for the export report."""
    from fedpose.shared.data.mpii import load_split

    val = load_split(int8.data_root, val_split)
    if count:
        val = val[:count]
    return compare_precisions(fp32_path, int8.path, val)
