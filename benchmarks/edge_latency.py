"""Per-frame latency of PyTorch eager vs onnxruntime FP32 vs onnxruntime INT8, and pipeline FPS.

    python benchmarks/edge_latency.py [--threads 2] [--repeats 200] [--frames 200] [--checkpoint model.pt]

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
tinyvit-small at 128x96 (decode + crop + infer + decode SimCC + JSON line).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    # Running as a script: make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = (("tinyvit-small", (128, 96)), ("tinyvit-5m", (256, 192)))


def _time_rounds(fns: dict, x: np.ndarray, repeats: int, warmup: int, rounds: int = 4) -> dict[str, list[float]]:
    """ms per call of every function: ``rounds`` rounds, each timing every function in its own block.

    Blocks, not call-by-call interleaving: onnxruntime's worker threads spin for a
    while after each run and would steal the cores from the next PyTorch call.
    Rounds: a change of background load during the run affects every row alike.
    """
    out: dict[str, list[float]] = {name: [] for name in fns}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(warmup):
                fn(x)
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn(x)
                out[name].append((time.perf_counter() - t0) * 1000.0)
    return out


def _stats(ms: list[float]) -> tuple[float, float]:
    return statistics.median(ms), float(np.percentile(ms, 95))


def bench_case(variant: str, size: tuple[int, int], root: Path, *, threads: int, repeats: int,
               checkpoint: Path | None) -> dict[str, tuple[float, float]]:
    from edge.export import export_onnx
    from edge.quantize import quantize_int8
    from edge.onnx_runtime import OnnxRuntime
    from shared.config import ModelConfig
    from shared.model.posenet import build_model, load_checkpoint

    if checkpoint is not None:
        model, _ = load_checkpoint(checkpoint)
        if model.cfg.variant != variant or tuple(model.input_size) != size:
            model = build_model(ModelConfig(variant=variant), size)
    else:
        torch.manual_seed(0)
        model = build_model(ModelConfig(variant=variant), size)
    model.eval()
    fp32 = root / f"{variant}_{size[0]}x{size[1]}.onnx"
    export_onnx(model, fp32, batch=1)
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
        times = _time_rounds(fns, x, repeats, warmup)
    return {name: _stats(ms) for name, ms in times.items()}


def bench_pipeline(root: Path, *, threads: int, frames: int) -> tuple[float, float, float, int]:
    """End-to-end FPS of ``run_pipeline`` (tinyvit-small 128x96, onnxruntime fp32) on the demo clip."""
    from edge.demo_video import DemoSpec, load_truth, write_demo_video
    from edge.pipeline import FrameSource, PipelineOptions, run_pipeline
    from edge.onnx_runtime import OnnxRuntime

    clip = root / "demo.mp4"
    write_demo_video(clip, DemoSpec(frames=frames, size=(320, 240), seed=0))
    roi = tuple(load_truth(clip)["roi"])
    onnx_path = root / "tinyvit-small_128x96.onnx"
    with OnnxRuntime(onnx_path, threads=threads) as rt:
        report = run_pipeline(rt, FrameSource(str(clip)), PipelineOptions(out_dir=root / "run", roi=roi))
    return report.fps, report.latency(50), report.latency(95), report.frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--frames", type=int, default=200, help="demo clip length for the pipeline FPS")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="trained tinyvit-small 128x96 checkpoint (default: random weights)")
    parser.add_argument("--skip-5m", action="store_true", help="only tinyvit-small (quick run)")
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
            res = bench_case(variant, size, root, threads=args.threads, repeats=args.repeats,
                             checkpoint=args.checkpoint)
            rows.append((variant, size, res))
        fps, p50, p95, n = bench_pipeline(root, threads=args.threads, frames=args.frames)

    header = f"{'model':<15}{'input':>9}{'backend':>19}{'p50 ms':>9}{'p95 ms':>9}{'speed-up':>10}"
    print()
    print(header)
    print("-" * len(header))
    verdicts = []
    for variant, (h, w), res in rows:
        eager = res["PyTorch eager"][0]
        for backend, (p50_ms, p95_ms) in res.items():
            print(f"{variant:<15}{f'{h}x{w}':>9}{backend:>19}{p50_ms:>9.2f}{p95_ms:>9.2f}{eager / p50_ms:>9.2f}x")
        ratio = eager / res["onnxruntime fp32"][0]
        verdicts.append(f"{variant} {h}x{w}: onnxruntime fp32 = {ratio:.2f}x eager "
                        f"({'meets' if ratio >= 1.8 else 'MISSES'} the 1.8x target)")
    print()
    print(f"pipeline (tinyvit-small 128x96, onnxruntime fp32, 320x240 demo clip, {n} frames): "
          f"{fps:.1f} FPS end to end; infer path p50 {p50:.2f} ms, p95 {p95:.2f} ms "
          f"({'meets' if fps >= 60 else 'MISSES'} the 60 FPS target)")
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
