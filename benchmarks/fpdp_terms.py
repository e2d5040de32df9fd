"""What each term of an fpdp step carries: the private signal, its projection, the noise, the public term.

At the public-pretrained start of a run config and of its larger wards, for ``--batches`` batches of B private
records (the config's expected batch, augmented as in training), the norms of

- ``private``: the mean clipped per-record gradient, (1/B) sum_i clip(g_i, C), before noise;
- ``private in V``: its projection V V^T onto the k directions of the public gradients (what fpdp and proj keep),
  and the part of it orthogonal to the public term (``beyond public``: what fpdp's private term adds to it);
- ``noise in V``: the projected noise V V^T N(0, sigma^2 C^2 I) / B (``noise, all``: unprojected, dpsgd's);
- ``public``: fpdp's noise-free public term, the mean gradient on psi(x) of ``train.public_batch_size`` records;

and the cosine of the projected private signal with the public term. sigma is the accountant's for the run
(epsilon, delta, q = B / n, 30 epochs by default): what the run spends, so the ratios are those of its steps.
Synthetic ward data; the private records are read only to measure (nothing leaves this machine).

Run: python benchmarks/fpdp_terms.py [--per-site 400 1600] [--config configs/default.yaml] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


import torch

from fedpose.cli.common import parse_sets
from fedpose.shared.configuration.schema import load_config, replace
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_train_strategy
from fedpose.shared.privacy.step.fpdp import clipped_grad_sum, public_gradient
from fedpose.shared.privacy.step.subspace import flat_vector, project, public_basis_at
from fedpose.shared.training.batches import make_dataset, make_psi_from, psi_on
from fedpose.shared.training.provenance import provenance
from fedpose.shared.training.runs import (
    ensure_data, initial_model, load_records, plan_sigma, private_records)
from fedpose.shared.training.schedule import steps_per_epoch

CPU = torch.device("cpu")


def measure(cfg, *, batches: int, seed: int) -> dict:
    """Mean norms (and their spread over batches) of the step's terms at the public start of ``cfg``."""
    root = ensure_data(cfg, progress=False)
    private = private_records(root, cfg)  # the pooled training splits a centralized run trains on
    n, batch_size, clip = len(private), cfg.train.batch_size, cfg.privacy.clip_norm
    steps = cfg.train.epochs * steps_per_epoch(n, batch_size)
    sigma = plan_sigma(replace(cfg, **{"train.method": "fpdp"}), n=n, steps=steps)
    model = initial_model(cfg, progress=False)
    trainable = apply_train_strategy(model, cfg.train)
    loss_fn = make_loss_fn(model, trainable)
    named = dict(model.named_parameters())
    params = {name: named[name].detach() for name in trainable}
    public = make_dataset(load_records(root, cfg.data.public_split), cfg, train=True, seed=seed)
    basis = public_basis_at(model, loss_fn, trainable, public, cfg.privacy, CPU)
    data = make_dataset(private, cfg, train=True, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    psi = make_psi_from(cfg.privacy, generator)
    rows = []
    for _ in range(batches):
        idx = torch.randperm(n, generator=generator)[:batch_size].tolist()
        batch = {k: v for k, v in data.batch(idx).items() if k != "index"}
        summed = clipped_grad_sum(loss_fn, params, batch, clip_norm=clip, chunk_size=cfg.privacy.chunk_size).summed
        signal = flat_vector(summed) / batch_size
        noise = torch.randn(signal.shape, generator=generator, dtype=signal.dtype) * (sigma * clip / batch_size)
        signal_v, noise_v = project(basis, signal), project(basis, noise)
        pub_idx = torch.randperm(n, generator=generator)[:cfg.train.public_batch_size].tolist()
        g_pub = flat_vector(public_gradient(loss_fn, params, psi_on(psi, data.batch(pub_idx), CPU)))
        beyond = signal_v - (signal_v @ g_pub) / (g_pub @ g_pub) * g_pub  # what the public term does not point to
        rows.append({"private": float(signal.norm()), "private_in_v": float(signal_v.norm()),
                     "private_in_v_beyond_public": float(beyond.norm()),
                     "noise_in_v": float(noise_v.norm()), "noise_all": float(noise.norm()),
                     "public": float(g_pub.norm()),
                     "cos_private_in_v_public": float(torch.nn.functional.cosine_similarity(signal_v, g_pub, dim=0))})
    mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    spread = {k: statistics.stdev(r[k] for r in rows) if len(rows) > 1 else 0.0 for k in rows[0]}
    return {"records": n, "batch_size": batch_size, "sigma": sigma, "steps": steps, "clip": clip,
            "k": int(basis.shape[1]), "params": int(signal.numel()), "mean": mean, "std": spread, "batches": rows}


def ward_config(path: str, sets: list[str], per_site: int):
    """The run config at ``per_site`` records per site: a larger ward and its own public start, as the scale
    study names them (``configs/study-scale.yaml``)."""
    cfg = load_config(path, parse_sets(sets))
    if per_site == cfg.data.synth.per_site:
        return cfg
    return replace(cfg, **{"data.synth.per_site": per_site, "data.root": f"runs/data/ward-{per_site}",
                           "pretrain.out": f"runs/pretrained-{per_site}"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="dotted overrides of the config")
    parser.add_argument("--per-site", nargs="+", type=int, default=[400, 1600],
                        help="records per site of each ward measured (default 400 1600)")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/fpdp_terms.json")
    args = parser.parse_args()
    if args.batches < 1 or min(args.per_site) < 1:
        parser.error("--batches and --per-site must be >= 1")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = []
    for per_site in args.per_site:
        result = {"per_site": per_site, **measure(ward_config(args.config, args.set, per_site), batches=args.batches,
                                                   seed=args.seed)}
        rows.append(result)
        m, s = result["mean"], result["std"]
        print(f"{per_site} per site: {result['records']} records, B {result['batch_size']}, sigma "
              f"{result['sigma']:.4f} ({result['steps']} steps), C {result['clip']:g}, k {result['k']}, "
              f"{result['params']} weights")
        for key in ("private", "private_in_v", "private_in_v_beyond_public", "noise_in_v", "noise_all", "public",
                    "cos_private_in_v_public"):
            print(f"  {key:28s} {m[key]:10.4f} +- {s[key]:.4f}")
        print(f"  beyond public / noise in V: {m['private_in_v_beyond_public'] / m['noise_in_v']:.3f}; beyond "
              f"public / public: {m['private_in_v_beyond_public'] / m['public']:.3f}", flush=True)
    out = {"rows": rows, "config": args.config, "set": args.set, "batches": args.batches, "seed": args.seed,
           "seconds": round(time.perf_counter() - t0, 1), "provenance": provenance(command=" ".join(sys.argv))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
