"""The camera's accuracy on the demo clip against what the same model scores on the validation split's crops.

    python benchmarks/edge_accuracy.py [--model NAME=CHECKPOINT ...] [--data runs/data/ward] [--split val]
                                       [--threads 1] [--work DIR] [--out benchmarks/results/edge_accuracy.json]

For each checkpoint (default: the public-pretrained start, runs/pretrained/model.pt, and the main command's
federated model, runs/federation/model.pt, where they exist): the ONNX file ``fedpose edge export`` writes,
then PCK@0.2 of the person's height (``fedpose.edge.pipeline.accuracy.pck_against_truth``: a joint counts when
it lies within 0.2 of the longer side of the person's true joint box) on

- ``val_crops``: the validation split's people, each cropped from its ground-truth box as in training and
  evaluation (what the model itself can do);
- ``clip_true_boxes``: the default demo clip (``fedpose edge demo-video``), cropped at the clip's true person
  boxes (the model on the clip's camera style, with a perfect detector);
- ``clip_tracked``: the same clip as ``fedpose edge run`` sees it, the person found and followed by the
  pipeline's own tracker from the whole frame (what a camera user gets).

``ratio`` is clip_tracked / val_crops (the target is >= 0.8); the gap splits into the camera style and the
model on the clip (val_crops -> clip_true_boxes) and the tracker (clip_true_boxes -> clip_tracked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


DEFAULT_MODELS = (("pretrained", "runs/pretrained/model.pt"), ("federated", "runs/federation/model.pt"))


def val_crops_pck(runtime: Any, records: list) -> dict[str, Any]:
    """PCK@0.2 of the person's height of a runtime on records' ground-truth crops (the validation split's)."""
    from fedpose.edge.pipeline.accuracy import pck_against_truth
    from fedpose.edge.export.quantize import predict_records

    pred = predict_records(runtime, records)
    return pck_against_truth(pred, np.stack([r.joints for r in records]), np.stack([r.visible for r in records]))


def clip_pck(runtime: Any, clip: Path, out_dir: Path, *, true_boxes: bool) -> dict[str, Any]:
    """The pipeline's accuracy on a demo clip: tracked from the whole frame, or cropped at the true boxes."""
    from fedpose.edge.pipeline.demo_video import load_truth
    from fedpose.edge.pipeline.source import FrameSource
    from fedpose.edge.pipeline.options import PipelineOptions
    from fedpose.edge.pipeline.loop import run_pipeline

    truth = load_truth(clip)
    boxes = truth["boxes"]
    options = PipelineOptions(out_dir=out_dir, truth=truth, boxes=(lambda i: boxes[i]) if true_boxes else None)
    report = run_pipeline(runtime, FrameSource(str(clip)), options)
    acc = dict(report.accuracy or {})
    acc.pop("truth", None)
    if not true_boxes:
        acc["reacquired"] = report.reacquired
        acc["track_lost"] = report.track_lost
    return acc


def measure(name: str, checkpoint: Path, records: list, clip: Path, work: Path, threads: int) -> dict[str, Any]:
    from fedpose.edge.export.exporter import export_onnx
    from fedpose.edge.runtime import make_runtime
    from fedpose.shared.model.posenet import load_checkpoint

    model, _ = load_checkpoint(checkpoint)
    onnx = export_onnx(model, work / name / "model.onnx").path
    with make_runtime(onnx, threads=threads) as runtime:
        val = val_crops_pck(runtime, records)
        boxes = clip_pck(runtime, clip, work / name / "boxes", true_boxes=True)
        tracked = clip_pck(runtime, clip, work / name / "tracked", true_boxes=False)
    row = {"checkpoint": str(checkpoint), "variant": model.cfg.variant,
           "input_size": list(model.input_size), "val_crops": val, "clip_true_boxes": boxes, "clip_tracked": tracked,
           "ratio": round(tracked["pck@0.2"] / val["pck@0.2"], 3),
           "ratio_true_boxes": round(boxes["pck@0.2"] / val["pck@0.2"], 3)}
    print(f"{name}: PCK@0.2 val crops {val['pck@0.2']:.3f} ({val['frames']} people), demo clip true boxes "
          f"{boxes['pck@0.2']:.3f}, tracked {tracked['pck@0.2']:.3f} (median {tracked['median_error_px']:.1f} px); "
          f"clip / val {row['ratio']:.2f} (true boxes {row['ratio_true_boxes']:.2f})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None, metavar="NAME=CHECKPOINT",
                        help="a checkpoint to measure (repeat); default: runs/pretrained and runs/federation")
    parser.add_argument("--data", type=Path, default=Path("runs/data/ward"), help="the ward holding the split")
    parser.add_argument("--split", default="val", help="the split whose crops are scored (default val)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads")
    parser.add_argument("--work", type=Path, default=None, help="keep the ONNX files, clip and runs here")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/edge_accuracy.json"))
    args = parser.parse_args(argv)

    from fedpose.edge.pipeline.demo_video import DemoSpec, write_demo_video
    from fedpose.shared.data.mpii import load_split

    models = ([tuple(m.split("=", 1)) for m in args.model] if args.model
              else [(n, p) for n, p in DEFAULT_MODELS if Path(p).is_file()])
    if not models or any(len(m) != 2 for m in models):
        parser.error("give --model NAME=CHECKPOINT (no default checkpoint exists)")
    records = load_split(args.data, args.split)
    if not records:
        parser.error(f"the split {args.split!r} under {args.data} is empty")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        spec = DemoSpec()
        clip = work / "demo.mp4"
        write_demo_video(clip, spec)  # the clip, its ground truth beside it
        rows = {name: measure(name, Path(path), records, clip, work, args.threads) for name, path in models}
    result = {
        "what": "PCK@0.2 of the person's height: the validation split's ground-truth crops against the default "
                "demo clip, cropped at its true boxes and tracked by the camera pipeline from the whole frame",
        "data": str(args.data), "split": args.split,
        "clip": {"frames": spec.frames, "size_wh": list(spec.size), "seed": spec.seed, "style": spec.style},
        "threads": args.threads, "models": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
