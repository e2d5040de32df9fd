"""``fedpose edge ...``: export, TensorRT build, camera pipeline, demo clip, DP pixelization.

``register(subparsers)`` is called by ``fedpose.cli.main``; every handler imports its
modules lazily so ``fedpose --help`` never loads onnx, TensorRT or torch.
Handlers raise ValueError / FileNotFoundError / ImportError / RuntimeError
with a message; ``fedpose.cli.main`` prints it in one line with its exit code.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


# ---------------------------------------------------------------------------
# export / build
# ---------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    from fedpose.edge.export.spec import INPUT_NAME, ExportOptions, parse_batch, parse_input_size
    from fedpose.edge.export.exporter import export_onnx
    from fedpose.shared.model.posenet import load_checkpoint

    batch = parse_batch(args.batch)
    input_size = parse_input_size(args.input) if args.input else None
    out = Path(args.out)
    model, _ = load_checkpoint(args.checkpoint)
    report = export_onnx(
        model, out, ExportOptions(batch=batch, opset=args.opset, input_size=input_size, fp16=args.fp16,
                                  tolerance=args.tolerance)
    )
    print(f"wrote {report.path}: input {INPUT_NAME} (N={report.batch}, 3, {report.input_size[0]}, "
          f"{report.input_size[1]}), opset {report.opset}{', fp16' if report.fp16 else ''}")
    print(f"ops: {', '.join(f'{k} x{v}' for k, v in report.ops.items())}")
    print("all ops are in the TensorRT 10 ONNX parser's support list; pad amounts are constants")
    print(f"onnxruntime vs PyTorch: max abs diff {report.max_abs_diff:.3g} (limit {args.tolerance:g})")
    if args.int8:
        _export_int8(args, model, report.path)
    return 0


def _export_int8(args: argparse.Namespace, model: Any, fp32_path: Path) -> None:
    from fedpose.cli.common import load_cli_config
    from fedpose.edge.export.quantize import compare_on_val, quantize_on_public

    cfg = load_cli_config(args, {"data.root": args.data, "data.source": "files" if args.data else None})
    int8 = quantize_on_public(fp32_path, cfg, tuple(model.input_size), count=args.calib_count,
                              method=args.calib_method, target=args.int8_target)
    layout = ("symmetric INT8, zero points 0: for TensorRT" if args.int8_target == "tensorrt"
              else "UINT8 activations x INT8 weights: for onnxruntime on CPU, not buildable by TensorRT")
    print(f"wrote {int8.path}: Q/DQ ({layout}), calibrated on {int8.calibrated} public images")
    rep = compare_on_val(fp32_path, int8, cfg.data.val_split, args.val_count)
    print(f"PCKh@0.5 on {rep.records} val people: fp32 {rep.fp32['pckh']['mean']:.2f}, "
          f"int8 {rep.int8['pckh']['mean']:.2f}, drop {rep.drop:+.2f}")
    print(f"PCKh@0.1: fp32 {rep.fp32['pckh@0.1']['mean']:.2f}, int8 {rep.int8['pckh@0.1']['mean']:.2f}, "
          f"drop {rep.drop_at_0_1:+.2f}")


def cmd_build(args: argparse.Namespace) -> int:
    from fedpose.edge.export.trt_build import (
        build_engine,
        check_build_request,
        parse_profile,
        trtexec_command,
    )

    profile = parse_profile(args.batch) if args.batch else None
    request = check_build_request(
        args.onnx, args.out, precision=args.precision, workspace_mb=args.workspace, batch=profile
    )
    print(f"equivalent trtexec (TensorRT 10.x): {trtexec_command(request)}")
    print(f"equivalent trtexec (TensorRT 11.x): {trtexec_command(request, trt_major=11)}")
    out = build_engine(args.onnx, args.out, precision=args.precision, workspace_mb=args.workspace, batch=profile)
    print(f"wrote {out} (engines are tied to this GPU and TensorRT version: build on the device that runs it)")
    return 0


# ---------------------------------------------------------------------------
# run / demo video
# ---------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from fedpose.cli.common import emit_json
    from fedpose.edge.pipeline.source import FrameSource, ReconnectPolicy
    from fedpose.edge.pipeline.options import PipelineOptions, parse_pixelize
    from fedpose.edge.pipeline.tracking import parse_roi
    from fedpose.edge.pipeline.demo_video import truth_beside
    from fedpose.edge.pipeline.loop import run_pipeline
    from fedpose.edge.runtime import make_runtime

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    pix = parse_pixelize(args.pixelize)
    truth = truth_beside(args.source)
    options = PipelineOptions(
        out_dir=Path(args.out_dir),
        roi=parse_roi(args.roi),
        max_frames=args.max_frames,
        write_video=args.video,
        show=args.show,
        overlay=args.overlay,
        pixelize=pix[0] if pix else None,
        pixelize_color=pix[1] if pix else False,
        score_threshold=args.threshold,
        seed=args.seed,
        max_eps=args.max_eps,
        store=args.store,
        truth=truth,
    )
    source = FrameSource(args.source, policy=ReconnectPolicy(tries=args.reconnect_tries))
    with make_runtime(args.model, args.backend, threads=args.threads, device=args.device) as runtime:
        used = getattr(runtime, "providers", None)  # onnxruntime: the execution providers the session really has
        print(f"model {args.model} ({runtime.backend}" + (f" with {', '.join(used)}" if used else "") +
              f", input {runtime.input_size[0]}x{runtime.input_size[1]}), source {args.source}")
        report = run_pipeline(runtime, source, options)
    if report.frames == 0:
        raise RuntimeError(f"no frame could be read from {args.source}")
    if emit_json(args, report.to_dict()):
        return 0
    print(report.summary())
    if report.claim:
        print("privacy of the published outputs:")
        print(report.claim)
    return 0


def cmd_demo_video(args: argparse.Namespace) -> int:
    from fedpose.edge.pipeline.demo_video import DemoSpec, parse_size, write_demo_video

    spec = DemoSpec(frames=args.frames, size=parse_size(args.size), seed=args.seed, fps=args.fps, style=args.style)
    sidecar = write_demo_video(args.out, spec)
    print(f"wrote {args.out} ({spec.frames} frames, {spec.size[1]}x{spec.size[0]} (HxW), {spec.fps:g} fps) "
          f"and ground truth {sidecar}")
    return 0


# ---------------------------------------------------------------------------
# pixelize / restore
# ---------------------------------------------------------------------------


def cmd_pixelize(args: argparse.Namespace) -> int:
    from fedpose.edge.pipeline.files import pixelize_files
    from fedpose.shared.pixelization.spec import PixelizeSpec

    spec = PixelizeSpec(eps=args.eps, b=args.b, m=args.m, n=args.n, noise=args.noise)
    out = Path(args.out)
    done = pixelize_files(Path(args.input), out, spec, gray=args.gray, store=args.store, mask=args.mask,
                          model=args.model, backend=args.backend, seed=args.seed)
    print(f"pixelized {done.frames} {'frame' if done.frames == 1 else 'frames'} -> {out}"
          + (" (NPZ: noisy means only; rebuild with `fedpose edge restore`)" if args.store == "npz" else ""))
    print(done.claim)
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from fedpose.edge.pipeline.files import restore_image

    src, out = Path(args.input), Path(args.out)
    image = restore_image(src, out)
    print(f"restored {src} -> {out} ({image.shape[0]}x{image.shape[1]} (HxW), "
          f"{'grayscale' if image.ndim == 2 else 'colour'}; identical to the released frame)")
    return 0


# ---------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--verbose", action="store_true", help="debug logging")


def register(subparsers: Any) -> None:
    """Add the ``edge`` command group to the main parser."""
    from fedpose.cli.common import add_config, add_json

    edge = subparsers.add_parser("edge", help="deployment on cameras: export, TensorRT, pipeline, DP pixelization")
    sub = edge.add_subparsers(dest="edge_command", required=True)

    ex = sub.add_parser("export", help="checkpoint -> ONNX (BatchNorm folded, TensorRT-checked, verified)")
    ex.add_argument("--checkpoint", required=True, help="fedpose checkpoint (model.pt)")
    ex.add_argument("--out", required=True, help="output .onnx file")
    ex.add_argument("--input", default=None, help="HxW; must match the checkpoint's input size")
    ex.add_argument("--batch", default="1", help="fixed batch size N or 'dynamic' (default 1)")
    ex.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17, what TensorRT 10 parses)")
    ex.add_argument("--fp16", action="store_true", help="half-precision ONNX (TensorRT 11 strongly typed FP16)")
    ex.add_argument("--int8", action="store_true", help="also write <out>.int8.onnx (Q/DQ) and report its PCKh drop")
    add_config(ex, help="the config naming the calibration data for --int8 (a file or a shipped name; default "
                        "default)")
    ex.add_argument("--data", default=None, help="data root (default: the config's data.root)")
    ex.add_argument("--calib-count", type=int, default=64, help="public images used for INT8 calibration")
    ex.add_argument("--calib-method", choices=("minmax", "percentile", "entropy"), default="minmax",
                    help="INT8 calibration method (default minmax)")
    ex.add_argument("--int8-target", choices=("tensorrt", "cpu"), default="tensorrt",
                    help="tensorrt: symmetric Q/DQ TensorRT can build (default); cpu: fast on onnxruntime x86")
    ex.add_argument("--val-count", type=int, default=None, help="evaluate INT8 vs FP32 on the first N val people")
    ex.add_argument("--tolerance", type=float, default=1e-4, help=argparse.SUPPRESS)
    _common(ex)
    ex.set_defaults(func=cmd_export)

    bd = sub.add_parser("build", help="ONNX -> TensorRT engine (run on the target device)")
    bd.add_argument("--onnx", required=True, help="the .onnx file from fedpose edge export")
    bd.add_argument("--out", required=True, help="engine file (.plan or .engine)")
    bd.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp16",
                    help="engine precision (default fp16)")
    bd.add_argument("--workspace", type=int, default=1024, help="builder workspace in MB (default 1024)")
    bd.add_argument("--batch", default=None, help="min,opt,max batch for a dynamic-batch ONNX (default 1,1,4)")
    _common(bd)
    bd.set_defaults(func=cmd_build)

    rn = sub.add_parser("run", help="camera pipeline: frames -> keypoints.jsonl (+ video, + DP pixelized frames)")
    rn.add_argument("--model", required=True, help="model.onnx | model.plan | model.pt")
    rn.add_argument("--source", required=True, help="camera index (0), video file or rtsp:// URL")
    rn.add_argument("--out", dest="out_dir", required=True,
                    help="folder for keypoints.jsonl, the video and the pixelized frames")
    rn.add_argument("--roi", default=None, help="x,y,w,h region where the person is (e.g. the bed)")
    rn.add_argument("--max-frames", type=int, default=None,
                    help="stop after this many frames (default: the whole source)")
    rn.add_argument("--pixelize", default=None, help="publish DP pixelized frames: eps=..,b=..,m=..,n=..[,color=1]")
    rn.add_argument("--video", action="store_true",
                    help="write annotated.mp4: skeleton over the raw frame; with --pixelize the pixelized frames only")
    rn.add_argument("--overlay", action="store_true",
                    help="with --pixelize: draw the raw frame's skeleton and box over the published video/--show "
                         "frames (NOT protected; named in the printed claim)")
    rn.add_argument("--show", action="store_true", help="display frames (needs OpenCV with GUI support)")
    rn.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default=None,
                    help="default: from the model file suffix")
    rn.add_argument("--device", choices=("cpu", "cuda", "tensorrt"), default="cpu",
                    help="where an .onnx model runs: onnxruntime's CPU, CUDA or TensorRT execution provider (the "
                         "GPU ones need fedpose[edge-gpu]); a .pt model runs on the CPU or CUDA (default cpu)")
    rn.add_argument("--threads", type=int, default=None, help="CPU threads for inference")
    rn.add_argument("--threshold", type=float, default=0.05,
                    help="keypoint score for tracking, drawing and the pixelization body mask")
    rn.add_argument("--reconnect-tries", type=int, default=6, help="reopen attempts for a dropped camera/stream")
    rn.add_argument("--max-eps", type=float, default=None,
                    help="with --pixelize: stop releasing frames once F x eps over the F released frames would pass "
                         "this (keypoints go on); default: no limit, the claim states F x eps")
    rn.add_argument("--store", choices=("npz", "png", "jpeg"), default="npz",
                    help="how pixelized frames are written: npz (the noisy cell means, restorable bit for bit with "
                         "edge restore), png or jpeg (rendered images) (default npz)")
    rn.add_argument("--seed", type=int, default=None, help="seed the pixelization noise (NOT for production)")
    add_json(rn, "summary.json's content (frames, latency, frames released, the claim)")
    _common(rn)
    rn.set_defaults(func=cmd_run)

    dv = sub.add_parser("demo-video", help="render a synthetic ward clip with ground truth (F.mp4 + F.mp4.json)")
    dv.add_argument("--out", required=True, help="the .mp4 to write (ground truth beside it as .mp4.json)")
    dv.add_argument("--frames", type=int, default=120, help="frames (default 120)")
    dv.add_argument("--size", default="240x320", help="frame size HxW, height first as every size (default 240x320)")
    dv.add_argument("--seed", type=int, default=0, help="the clip is a function of this seed (default 0)")
    dv.add_argument("--fps", type=float, default=25.0, help="frames per second (default 25)")
    dv.add_argument("--style", default="public", help="'public' or a site index (0, 1, ...)")
    _common(dv)
    dv.set_defaults(func=cmd_demo_video)

    px = sub.add_parser("pixelize", help="DP pixelization of an image, a directory of images or a video")
    px.add_argument("--in", dest="input", required=True, help="IMG | DIR | VIDEO")
    px.add_argument("--out", required=True, help="image/NPZ file for one image, else a directory")
    px.add_argument("--eps", type=float, required=True, help="per-frame privacy budget")
    px.add_argument("--b", type=int, required=True, help="cell side in pixels")
    px.add_argument("--m", type=int, required=True, help="pixels that may differ between neighbouring images")
    px.add_argument("--n", type=int, default=1, help="split complex cells into n x n subcells (n divides b)")
    px.add_argument("--mask", default=None, help="complex-region mask PNG, or 'pose' (needs --model)")
    px.add_argument("--model", default=None, help="pose model for --mask pose")
    px.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default=None,
                    help="runtime for --model (default: from the model file suffix)")
    px.add_argument("--store", choices=("png", "npz"), default="png", help="npz: keep only the noisy means")
    px.add_argument("--noise", choices=("discrete", "laplace"), default="discrete",
                    help="discrete (two-sided geometric on integer sums, the default) or continuous Laplace")
    px.add_argument("--gray", action="store_true", help="convert colour input to grayscale first")
    px.add_argument("--seed", type=int, default=None, help="seed the noise (NOT for production)")
    _common(px)
    px.set_defaults(func=cmd_pixelize)

    rs = sub.add_parser("restore", help="rebuild a pixelized frame from its NPZ (bit-identical)")
    rs.add_argument("--in", dest="input", required=True, help="a pixelized frame's .npz")
    rs.add_argument("--out", required=True, help="the image file to write (bit-identical to the release)")
    _common(rs)
    rs.set_defaults(func=cmd_restore)
