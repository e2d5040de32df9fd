"""Benchmark: how fast a training process assembles its batches, per image on the CPU or at once on a device,
by thread count (not a test).

A training step reads its batch from ``PoseDataset.batch``. Two paths, side by side in one run:

- ``per-image``: each item's augmentation drawn from the dataset's generator in order, then the crops rendered
  (cv2 warp, flip, jitter, into the float batch) by a pool of torch's thread count, on the CPU;
- ``device``: the same draws, then the whole batch made on ``--device`` (CPU or CUDA) from each image's cached
  region: one affine grid and one sampling, the jitter's noise one tensor (``PoseDataset(..., device=...)``).

Three kinds of batch, on a ward generated at the paper's 320 px and cropped to the input size:

- ``private``: a private step's batch (scale, rotation and flip);
- ``pretrain``: public pretraining's batch (the same plus the photometric jitter);
- ``psi``: the unaugmented crops psi is applied to (raw+psi, fpdp's public term).

Every (kind, path, thread count) runs once per round, in an order that rotates from round to round, images
decoded beforehand (as a training process holds them after first use); prints images per second, the median over
rounds with its min-max, and the device path's speed over the per-image path's at the same thread count.

    python benchmarks/batch_assembly.py [--threads 1,2] [--batch 256] [--input 256x192] [--device cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedpose.shared.data.augment import Augment
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.synth.ward import WardSpec, generate_ward
from fedpose.shared.training.provenance import provenance
from fedpose.shared.training.runs import load_records

KINDS = {"private": Augment(), "pretrain": Augment(photometric=0.5), "psi": None}
PATHS = ("per-image", "device")


def measure(root: Path, *, threads: list[int], batch: int, size_hw: tuple[int, int], rounds: int,
            device: torch.device) -> dict:
    records = load_records(root, "site-0")
    base = {kind: PoseDataset(records, input_size=size_hw, augment=augment, seed=0) for kind, augment in KINDS.items()}
    cache = base["private"]._cache
    for ds in base.values():  # one decoded copy of every image, as a training process holds after its first use
        ds._cache = cache
    datasets = {(kind, path): ds if path == "per-image" else ds.assembled_on(device)
                for kind, ds in base.items() for path in PATHS}
    everything = list(range(len(records)))
    base["private"].batch(everything)
    datasets["private", "device"].batch(everything)  # every region cut (the widest reach) and the device warm
    cells = [(kind, path, n) for kind in KINDS for path in PATHS for n in threads]
    rates: dict[tuple[str, str, int], list[float]] = {cell: [] for cell in cells}
    indices = [i % len(records) for i in range(batch)]
    for r in range(rounds):
        for kind, path, n in cells[r % len(cells):] + cells[:r % len(cells)]:  # the cell that starts rotates
            torch.set_num_threads(n)
            started = time.perf_counter()
            images = datasets[kind, path].batch(indices)["image"]
            if images.is_cuda:
                torch.cuda.synchronize(images.device)
            rates[kind, path, n].append(batch / (time.perf_counter() - started))
    out: dict = {kind: {path: {} for path in PATHS} for kind in KINDS}
    for (kind, path, n), v in rates.items():
        out[kind][path][str(n)] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input", default="256x192", help="HxW crop (default 256x192, the paper's)")
    parser.add_argument("--images", type=int, default=128, help="ward images at 320 px to draw the batches from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the device path assembles (cpu, cuda)")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if min(threads) < 1 or args.batch < 1 or args.images < 1 or args.rounds < 1:
        parser.error("--threads, --batch, --images and --rounds must be positive")
    height, width = (int(v) for v in args.input.lower().split("x"))
    device = torch.device(args.device)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = generate_ward(Path(tmp), WardSpec(sites=1, per_site=args.images, public=1, val=1, image_size=320),
                             progress=False)
        result = measure(root, threads=threads, batch=args.batch, size_hw=(height, width), rounds=args.rounds,
                         device=device)
    print(f"batch {args.batch} at {height}x{width}, images per second (median, min-max over {args.rounds} rounds); "
          f"device path on {device}")
    for kind, by_path in result.items():
        for path, by in by_path.items():
            cells = []
            for n, v in by.items():
                ratio = v["median"] / by_path["per-image"][n]["median"]
                cells.append(f"{n} thr {v['median']:7.0f} ({v['min']:.0f}-{v['max']:.0f}) x{ratio:.2f}")
            print(f"{kind:>9} {path:>9}: " + " | ".join(cells))
    if args.out:
        command = "python benchmarks/batch_assembly.py " + " ".join(
            f"--{k} {v}" for k, v in [("threads", args.threads), ("batch", args.batch), ("input", args.input),
                                      ("rounds", args.rounds), ("device", args.device)])
        args.out.write_text(json.dumps({"batch": args.batch, "input": [height, width], "rounds": args.rounds,
                                        "device": str(device), "images_per_second": result,
                                        "provenance": provenance(command=command, seconds=time.time() - started,
                                                                 threads=args.threads)},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
