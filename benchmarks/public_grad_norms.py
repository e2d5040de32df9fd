"""Per-sample gradient norms on the public split at the public start: how to pick the clip C without private data.

For each training strategy, the per-sample gradient norms of the weights it trains (with and without the
task-uncertainty weights ``head.log_task_scale``) over ``--records`` augmented public images at the
public-pretrained start, their 10th / 50th / 90th percentiles and the norm of their mean. Everything here is
public data and public weights, so choosing C from it (the median, say) spends no privacy.

Run: python benchmarks/public_grad_norms.py [--strategies bitfit full lora] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


import torch

from fedpose.shared.configuration.schema import load_config
from fedpose.shared.model.lora import add_adapters
from fedpose.shared.model.posenet import TASK_SCALE
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_strategy
from fedpose.shared.privacy.step.persample import iter_per_sample_grads, robust_norms
from fedpose.shared.training.provenance import provenance
from fedpose.shared.training.runs import ensure_data, initial_model, load_records
from fedpose.shared.training.batches import make_dataset, to_device


def norms_of(cfg, strategy: str, *, records: int, task_scale: bool, seed: int) -> dict:
    """Quantiles of the per-sample norms and the norm of the mean gradient of ``strategy``'s weights."""
    model = initial_model(cfg, progress=False)
    if strategy == "lora":  # the adapters as a run starts them (U = 0: only U and the heads have a gradient)
        add_adapters(model, cfg.train.lora_rank, torch.Generator().manual_seed(seed))
    names = apply_strategy(model, strategy)
    if task_scale and TASK_SCALE not in names:
        names = [*names, TASK_SCALE]
    if not task_scale:
        names = [n for n in names if n != TASK_SCALE]
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in names}
    public = make_dataset(load_records(ensure_data(cfg, progress=False), cfg.data.public_split), cfg, train=True,
                          seed=seed)
    batch = to_device(public.batch(list(range(min(records, len(public))))), torch.device("cpu"))
    parts, total = [], None
    for grads in iter_per_sample_grads(make_loss_fn(model, names), params, batch, chunk_size=cfg.privacy.chunk_size):
        flats = [g.reshape(g.shape[0], -1) for g in grads.values()]  # (b, numel) each
        parts.append(robust_norms(flats))
        flat = torch.cat(flats, dim=1)  # (b, p)
        total = flat.sum(0) if total is None else total + flat.sum(0)
    norms = torch.cat(parts)
    q = torch.quantile(norms, torch.tensor([0.1, 0.5, 0.9], dtype=norms.dtype)).tolist()
    return {"strategy": strategy, "task_scale": task_scale, "params": sum(p.numel() for p in params.values()),
            "records": int(norms.numel()), "p10": q[0], "median": q[1], "p90": q[2],
            "mean_gradient_norm": float((total / norms.numel()).norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--strategies", nargs="+", default=["bitfit", "bitfit-head", "full", "lora"])
    parser.add_argument("--records", type=int, default=64, help="augmented public images")
    parser.add_argument("--seed", type=int, default=0, help="the augmentations' seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/public_grad_norms.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    t0 = time.perf_counter()
    rows = []
    for strategy in args.strategies:
        for task_scale in (True, False):
            row = norms_of(cfg, strategy, records=args.records, task_scale=task_scale, seed=args.seed)
            rows.append(row)
            print(f"{strategy:12s} task weights {'in ' if task_scale else 'out'}: {row['params']:7d} weights, "
                  f"per-sample norm p10 {row['p10']:.3f} median {row['median']:.3f} p90 {row['p90']:.3f}, "
                  f"mean gradient {row['mean_gradient_norm']:.4f}", flush=True)
    out = {"rows": rows, "config": args.config, "records": args.records, "seed": args.seed,
           "seconds": round(time.perf_counter() - t0, 1), **provenance(command=" ".join(sys.argv))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
