"""Per-frame latency of PyTorch eager vs onnxruntime FP32 vs onnxruntime INT8, and pipeline FPS.

    python benchmarks/edge_latency.py [--threads 2] [--repeats 200] [--frames 200] [--pipeline-runs 3]
                                      [--checkpoint model.pt] [--out benchmarks/results/edge_latency.json]

Models have RANDOM weights unless --checkpoint is given: latency does not
depend on the weight values (no data-dependent control flow in the graph),
only on the architecture and input size. INT8 is calibrated on random
images for the same reason (its accuracy is reported by
``fedpose edge export --int8``, not here).

Rows: tinyvit-small at 128x96 and tinyvit-5m at 256x192, batch 1, one frame
at a time as the camera pipeline runs. "onnxruntime int8" is the CPU layout
(UINT8 activations x INT8 weights); "ort int8 TRT-QDQ" is the symmetric
S8 x S8 file made for TensorRT, timed on onnxruntime for reference (x86 has no
fast kernels for it; on a Jetson it runs in TensorRT instead). Targets on the 2-core CPU of the
project machine: onnxruntime >= 1.8x eager; pipeline >= 60 FPS for
tinyvit-small at 128x96 (decode + crop + infer + decode SimCC + JSON line),
and at >= 0.8 of the onnxruntime-only bound (the FPS of the same session
running alone on as many frames, timed just before: the camera loop costing
nothing beside inference), both models. Speed-ups and shares are taken within
a round and their median reported, since a shared machine's speed drifts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


CASES = (("tinyvit-small", (128, 96)), ("tinyvit-5m", (256, 192)))


def _time_rounds(fns: dict, x: np.ndarray, repeats: int, warmup: int, rounds: int = 8) -> dict[str, list[list[float]]]:
    """ms per call of every function, per round: ``rounds`` rounds, each timing every function in its own block.

    Blocks, not call-by-call interleaving: onnxruntime's worker threads spin for a
    while after each run and would steal the cores from the next PyTorch call.
    Rounds: the speed of a shared machine drifts over seconds, so ratios are taken
    within a round (both sides timed moments apart) and their median reported.
    """
    out: dict[str, list[list[float]]] = {name: [] for name in fns}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(warmup):
                fn(x)
            times = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn(x)
                times.append((time.perf_counter() - t0) * 1000.0)
            out[name].append(times)
    return out


def _stats(ms: list[float]) -> tuple[float, float]:
    return statistics.median(ms), float(np.percentile(ms, 95))


def bench_case(variant: str, size: tuple[int, int], root: Path, *, threads: int, repeats: int,
               checkpoint: Path | None) -> tuple[dict[str, tuple[float, float]], list[float]]:
    """(p50, p95) ms per backend, and onnxruntime fp32's speed-up over eager in each round."""
    from fedpose.edge.export.exporter import export_onnx
    from fedpose.edge.export.spec import ExportOptions
    from fedpose.edge.export.quantize import quantize_int8
    from fedpose.edge.runtime.onnx import OnnxRuntime
    from fedpose.shared.configuration.schema import ModelConfig
    from fedpose.shared.model.posenet import build_model, load_checkpoint

    if checkpoint is not None:
        model, _ = load_checkpoint(checkpoint)
        if model.cfg.variant != variant or tuple(model.input_size) != size:
            model = build_model(ModelConfig(variant=variant), size)
    else:
        torch.manual_seed(0)
        model = build_model(ModelConfig(variant=variant), size)
    model.eval()
    fp32 = root / f"{variant}_{size[0]}x{size[1]}.onnx"
    export_onnx(model, fp32, ExportOptions(batch=1))
    rng = np.random.default_rng(0)
    calib = rng.random((32, 3, *size), dtype=np.float32)
    int8_cpu = quantize_int8(fp32, root / f"{variant}_{size[0]}x{size[1]}.cpu.int8.onnx", calib, target="cpu")
    int8_trt = quantize_int8(fp32, root / f"{variant}_{size[0]}x{size[1]}.trt.int8.onnx", calib, target="tensorrt")
    x = rng.random((1, 3, *size), dtype=np.float32)
    warmup = max(3, repeats // 20)

    torch.set_num_threads(threads)
    xt = torch.from_numpy(x)

    def eager(_):
        with torch.inference_mode():
            return model(xt)

    with (
        OnnxRuntime(fp32, threads=threads) as rt32,
        OnnxRuntime(int8_cpu, threads=threads) as rt8,
        OnnxRuntime(int8_trt, threads=threads) as rtq,
    ):
        fns = {
            "PyTorch eager": eager,
            "onnxruntime fp32": rt32.infer,
            "onnxruntime int8": rt8.infer,
            "ort int8 TRT-QDQ": rtq.infer,
        }
        times = _time_rounds(fns, x, repeats, max(3, warmup // 8))
    stats = {name: _stats([t for block in blocks for t in block]) for name, blocks in times.items()}
    ratios = [statistics.median(e) / statistics.median(o) for e, o in zip(times["PyTorch eager"],
                                                                          times["onnxruntime fp32"])]
    return stats, ratios


def bench_pipeline(root: Path, variant: str, size: tuple[int, int], *, threads: int, frames: int,
                   rounds: int) -> list[tuple[float, float, float]]:
    """Per round: onnxruntime alone on ``frames`` crops (the bound, FPS), then ``run_pipeline`` on the demo clip
    with the same session (FPS, infer-path p50 ms); the two timed moments apart, so their ratio is fair."""
    from fedpose.edge.pipeline.demo_video import DemoSpec, load_truth, write_demo_video
    from fedpose.edge.pipeline.source import FrameSource
    from fedpose.edge.pipeline.options import PipelineOptions
    from fedpose.edge.pipeline.loop import run_pipeline
    from fedpose.edge.runtime.onnx import OnnxRuntime

    clip = root / f"demo-{frames}.mp4"
    if not clip.exists():
        write_demo_video(clip, DemoSpec(frames=frames, size=(320, 240), seed=0))
    roi = tuple(load_truth(clip)["roi"])
    x = np.random.default_rng(0).random((1, 3, *size), dtype=np.float32)
    out = []
    with OnnxRuntime(root / f"{variant}_{size[0]}x{size[1]}.onnx", threads=threads) as rt:
        for _ in range(rounds):
            for _ in range(10):
                rt.infer(x)
            t0 = time.perf_counter()
            for _ in range(frames):
                rt.infer(x)
            bound = frames / (time.perf_counter() - t0)
            report = run_pipeline(rt, FrameSource(str(clip)), PipelineOptions(out_dir=root / "run", roi=roi))
            out.append((bound, report.fps, report.latency(50)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--frames", type=int, default=200, help="demo clip length for the pipeline FPS")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="trained tinyvit-small 128x96 checkpoint (default: random weights)")
    parser.add_argument("--skip-5m", action="store_true", help="only tinyvit-small (quick run)")
    parser.add_argument("--pipeline-runs", type=int, default=5,
                        help="rounds of onnxruntime alone then the pipeline, per model (their spread)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    weights = "random weights (latency does not depend on them)"
    if args.checkpoint:
        weights = f"weights from {args.checkpoint}"
    print(f"threads {args.threads}, {args.repeats} timed runs per row, batch 1; {weights}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at start: {load:.2f} (numbers are noisy when other jobs run)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedpose-bench-") as tmp:
        root = Path(tmp)
        for variant, size in CASES:
            if args.skip_5m and variant != "tinyvit-small":
                continue
            res, ratios = bench_case(variant, size, root, threads=args.threads, repeats=args.repeats,
                                     checkpoint=args.checkpoint)
            rows.append((variant, size, res, ratios))
        pipelines = []
        for variant, size, _, _ in rows:
            runs = bench_pipeline(root, variant, size, threads=args.threads, frames=args.frames,
                                  rounds=args.pipeline_runs)
            shares = [fps / bound for bound, fps, _ in runs]
            pipelines.append({"model": variant, "input": list(size), "frames": args.frames,
                              "fps_runs": [fps for _, fps, _ in runs], "bound_runs": [b for b, _, _ in runs],
                              "fps": statistics.median(fps for _, fps, _ in runs),
                              "infer_p50_ms": statistics.median(p for _, _, p in runs),
                              "ort_bound_fps": statistics.median(b for b, _, _ in runs),
                              "share_runs": shares, "share_of_bound": statistics.median(shares)})

    header = f"{'model':<15}{'input':>9}{'backend':>19}{'p50 ms':>9}{'p95 ms':>9}{'speed-up':>10}"
    print()
    print(header)
    print("-" * len(header))
    verdicts = []
    for variant, (h, w), res, ratios in rows:
        eager = res["PyTorch eager"][0]
        for backend, (p50_ms, p95_ms) in res.items():
            print(f"{variant:<15}{f'{h}x{w}':>9}{backend:>19}{p50_ms:>9.2f}{p95_ms:>9.2f}{eager / p50_ms:>9.2f}x")
        ratio = statistics.median(ratios)
        verdicts.append(f"{variant} {h}x{w}: onnxruntime fp32 = {ratio:.2f}x eager (median of {len(ratios)} rounds, "
                        f"{min(ratios):.2f}-{max(ratios):.2f}) ({'meets' if ratio >= 1.8 else 'MISSES'} the 1.8x "
                        "target)")
    print()
    for p in pipelines:
        print(f"pipeline ({p['model']} {p['input'][0]}x{p['input'][1]}, onnxruntime fp32, 320x240 demo clip, "
              f"{p['frames']} frames, {len(p['fps_runs'])} rounds): {p['fps']:.1f} FPS end to end, infer path p50 "
              f"{p['infer_p50_ms']:.2f} ms ({'meets' if p['fps'] >= 60 else 'MISSES'} the 60 FPS target); "
              f"{p['share_of_bound']:.2f} of onnxruntime alone ({p['ort_bound_fps']:.0f} FPS; rounds "
              f"{', '.join(f'{r:.2f}' for r in p['share_runs'])}) "
              f"({'meets' if p['share_of_bound'] >= 0.8 else 'MISSES'} the 0.8 target)")
    for v in verdicts:
        print(v)
    if args.out is not None:
        from fedpose.shared.training.provenance import provenance

        result = {
            "threads": args.threads, "repeats": args.repeats, "weights": weights,
            "rows": [{"model": v, "input": list(size), "backend": b, "p50_ms": p50_ms, "p95_ms": p95_ms,
                      "speedup": res["PyTorch eager"][0] / p50_ms}
                     for v, size, res, _ in rows for b, (p50_ms, p95_ms) in res.items()],
            "ort_speedup_rounds": {f"{v} {size[0]}x{size[1]}": ratios for v, size, _, ratios in rows},
            "pipelines": pipelines,
            **provenance(command=" ".join(["python", "benchmarks/edge_latency.py", *(argv or sys.argv[1:])])),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
