"""Benchmark: how fast a training process assembles its batches on the CPU, by thread count (not a test).

A training step reads its batch from ``PoseDataset.batch``: each item's augmentation is drawn from the dataset's
generator in order, then the crops are rendered (warp, flip, jitter, into the float batch) by a pool of torch's
thread count. On a GPU the step waits for this. Three kinds of batch, on a ward generated at the paper's
320 px and cropped to the input size:

- ``train``: a private step's batch (scale, rotation and flip);
- ``pretrain``: public pretraining's batch (the same plus the photometric jitter, whose noise is drawn in order);
- ``canonical``: the unaugmented crops psi is applied to (raw+psi, fpdp's public term).

Each thread count runs in interleaved rounds (kind after kind, count after count), images decoded beforehand;
prints images per second, the median over rounds with its min-max, and each count's speed-up over one thread.

    python benchmarks/batch_assembly.py [--threads 1,2] [--batch 256] [--input 256x192] [--out FILE]
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

KINDS = {"train": Augment(), "pretrain": Augment(photometric=0.5), "canonical": None}


def measure(root: Path, *, threads: list[int], batch: int, size_hw: tuple[int, int], rounds: int) -> dict:
    records = load_records(root, "site-0")
    datasets = {kind: PoseDataset(records, input_size=size_hw, augment=augment, seed=0)
                for kind, augment in KINDS.items()}
    cache = datasets["train"]._cache
    for ds in datasets.values():  # one decoded copy of every image, as a training process holds after its first use
        ds._cache = cache
    datasets["train"].batch(list(range(len(records))))
    rates: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in threads} for kind in KINDS}
    indices = [i % len(records) for i in range(batch)]
    for r in range(rounds):
        for kind, ds in datasets.items():
            for n in threads[r % len(threads):] + threads[:r % len(threads)]:  # the count that starts rotates
                torch.set_num_threads(n)
                started = time.perf_counter()
                ds.batch(indices)
                rates[kind][n].append(batch / (time.perf_counter() - started))
    return {kind: {str(n): {"median": statistics.median(v), "min": min(v), "max": max(v)} for n, v in by.items()}
            for kind, by in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input", default="256x192", help="HxW crop (default 256x192, the paper's)")
    parser.add_argument("--images", type=int, default=128, help="ward images at 320 px to draw the batches from")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if min(threads) < 1 or args.batch < 1 or args.images < 1 or args.rounds < 1:
        parser.error("--threads, --batch, --images and --rounds must be positive")
    height, width = (int(v) for v in args.input.lower().split("x"))
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = generate_ward(Path(tmp), WardSpec(sites=1, per_site=args.images, public=1, val=1, image_size=320),
                             progress=False)
        result = measure(root, threads=threads, batch=args.batch, size_hw=(height, width), rounds=args.rounds)
    print(f"batch {args.batch} at {height}x{width}, images per second (median, min-max over {args.rounds} rounds)")
    for kind, by in result.items():
        one = by[str(threads[0])]["median"]
        cells = [f"{n} thr {v['median']:7.0f} ({v['min']:.0f}-{v['max']:.0f}) x{v['median'] / one:.2f}"
                 for n, v in by.items()]
        print(f"{kind:>10}: " + " | ".join(cells))
    if args.out:
        command = "python benchmarks/batch_assembly.py " + " ".join(
            f"--{k} {v}" for k, v in [("threads", args.threads), ("batch", args.batch), ("input", args.input)])
        args.out.write_text(json.dumps({"batch": args.batch, "input": [height, width], "rounds": args.rounds,
                                        "images_per_second": result,
                                        "provenance": provenance(command=command, seconds=time.time() - started,
                                                                 threads=args.threads)},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
