"""Per tensor, how much of the clipped private gradient the public projection keeps, with and without the
per-tensor public scales (``train.tensor_scales``), at a config's public start.

At the public-pretrained weights: V from ``privacy.m`` public per-sample gradients (the run's own V: k
directions, ``privacy.basis_clip`` as configured), the mean of ``--records`` private per-sample gradients each
clipped to C (no noise), its projection V V^T g. Per tensor: the RMS of the mean gradient, of the clipped mean and
of its projection, and the cosine of the projection with the clipped mean; overall, the cosine of the projected
and of the clipped mean gradient with the plain mean gradient, as they are and in tensor-adam's frame (each tensor
divided by its RMS). The same with every tensor scaled by its public scale before clipping and before V.
Then a V per tensor instead of one for the whole vector: each tensor's own top ``k_t`` directions of its public
per-sample gradients (``--per-tensor-k``; the scales leave a tensor's own V unchanged), which fits every tensor's
gradient, against the noise such a V keeps: per tensor, the norm of its projected clipped mean gradient over
the norm one step's noise keeps in its k_t directions, sigma C sqrt(k_t) / B (sigma the accountant's for the
config's run: what a tensor-wise step would have to learn from).
A diagnostic of a run's start; the private records are read on this machine and only statistics are printed.

Run: python benchmarks/projection_per_tensor.py --config configs/default.yaml --set data.synth.seed=7 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


import torch

from fedpose.shared.configuration.schema import load_config, replace
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_train_strategy
from fedpose.shared.privacy.step.subspace import compute_basis, compute_scaled_basis, from_flat_vector, project
from fedpose.shared.privacy.step.bookkeeping import per_sample_chunks
from fedpose.shared.training.batches import make_dataset, to_device
from fedpose.shared.training.provenance import provenance
from fedpose.shared.training.runs import ensure_data, initial_model, load_records, plan_sigma, private_records
from fedpose.shared.training.schedule import steps_per_epoch


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def _tensor_frame(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every tensor divided by its RMS (tensor-adam's frame), flattened in sorted-name order."""
    return torch.cat([(parts[n] / (_rms(parts[n]) + 1e-30)).flatten() for n in sorted(parts)])


def per_tensor_basis(public_rows: dict[str, torch.Tensor], k_t: int) -> dict[str, torch.Tensor]:
    """Each tensor's top ``k_t`` right singular vectors of its public per-sample gradients (m x numel), fewer where
    its rank is lower (singular values under 1e-6 of the largest dropped)."""
    bases = {}
    for name, rows in public_rows.items():
        _, values, vh = torch.linalg.svd(rows.double(), full_matrices=False)
        rank = int((values > values[0] * 1e-6).sum()) if values.numel() and values[0] > 0 else 0
        bases[name] = vh[:min(k_t, rank)].T.float()
    return bases


def measure_per_tensor(public_rows: dict[str, torch.Tensor], clipped: dict[str, torch.Tensor],
                       mean: dict[str, torch.Tensor], *, k_t: int, noise: float) -> dict:
    """With a V per tensor: how many tensors keep a cosine under 0.3 with their own clipped gradient, the cosine of
    the projected gradient with the mean gradient in tensor-adam's frame, and per tensor the projected signal's norm
    over one step's noise norm in its directions (``noise`` = sigma C / B per direction)."""
    bases = per_tensor_basis(public_rows, k_t)
    projected, ratios = {}, []
    for name, basis in bases.items():
        flat = clipped[name].flatten()
        projected[name] = (basis @ (basis.T @ flat)).reshape(clipped[name].shape)
        if basis.shape[1]:
            ratios.append(float(projected[name].norm()) / (noise * basis.shape[1] ** 0.5))
    return {"k_t": k_t, "directions": sum(b.shape[1] for b in bases.values()),
            "tensors_below_0.3": sum(_cos(projected[n], clipped[n]) < 0.3 for n in bases),
            "tensor_frame_cos_projected_mean": _cos(_tensor_frame(projected), _tensor_frame(mean)),
            "signal_to_step_noise_median": statistics.median(ratios), "signal_to_step_noise_max": max(ratios)}


def public_rows_of(loss_fn, params, public_batch, chunk_size: int) -> dict[str, torch.Tensor]:
    """{name: (m, numel)}: the public per-sample gradients, tensor by tensor."""
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    for grads in per_sample_chunks(loss_fn, params, public_batch, chunk_size=chunk_size):
        for name in params:
            parts[name].append(grads[name].reshape(grads[name].shape[0], -1))
    return {name: torch.cat(rows) for name, rows in parts.items()}


def measure(loss_fn, params, public_batch, private_batch, cfg, scaled: bool) -> dict:
    """The per-tensor and overall figures of the module docstring, with the public scales or without."""
    options = {"k": cfg.privacy.k, "chunk_size": cfg.privacy.chunk_size, "clip": cfg.privacy.basis_clip}
    basis, scales = (compute_scaled_basis(loss_fn, params, public_batch, **options) if scaled
                     else (compute_basis(loss_fn, params, public_batch, **options), None))
    total = clipped = None
    rows = 0
    for grads in per_sample_chunks(loss_fn, params, private_batch, chunk_size=cfg.privacy.chunk_size):
        names = sorted(grads)
        flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) * (1.0 if scales is None else scales[n])
                          for n in names], dim=1)
        factors = (cfg.privacy.clip_norm / (flat.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
        total = flat.sum(0) if total is None else total + flat.sum(0)
        clipped = (flat * factors).sum(0) if clipped is None else clipped + (flat * factors).sum(0)
        rows += flat.shape[0]
    assert total is not None and clipped is not None
    like = {n: params[n] for n in sorted(params)}
    mean, clip_mean = total / rows, clipped / rows
    projected = project(basis, clip_mean)
    g, gc, pg = (from_flat_vector(v, like=like) for v in (mean, clip_mean, projected))
    tensors = [{"name": n, "numel": params[n].numel(), "rms_mean": _rms(g[n]), "rms_clipped": _rms(gc[n]),
                "rms_projected": _rms(pg[n]), "cos_projected_clipped": _cos(pg[n], gc[n])} for n in sorted(params)]
    return {"k": basis.shape[1], "tensors": tensors, "clipped": gc, "mean": g,
            "tensors_below_0.3": sum(t["cos_projected_clipped"] < 0.3 for t in tensors),
            "cos_clipped_mean": _cos(clip_mean, mean), "cos_projected_mean": _cos(projected, mean),
            "tensor_frame_cos_clipped_mean": _cos(_tensor_frame(gc), _tensor_frame(g)),
            "tensor_frame_cos_projected_mean": _cos(_tensor_frame(pg), _tensor_frame(g))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--records", type=int, default=192, help="private records in the mean gradient")
    parser.add_argument("--per-tensor-k", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="directions per tensor of the per-tensor V")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/projection_per_tensor.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    overrides = dict(item.split("=", 1) for item in args.set)
    cfg = replace(cfg, **{k: (int(v) if v.isdigit() else v) for k, v in overrides.items()})
    t0 = time.perf_counter()
    model = initial_model(cfg, progress=False)
    names = apply_train_strategy(model, cfg.train)
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in names}
    loss_fn = make_loss_fn(model, names)
    root = ensure_data(cfg, progress=False)
    cpu = torch.device("cpu")
    public = make_dataset(load_records(root, cfg.data.public_split), cfg, train=False)
    public_batch = to_device(public.batch(list(range(min(cfg.privacy.m, len(public))))), cpu)
    private = make_dataset(private_records(root, cfg), cfg, train=True, seed=1)
    private_batch = to_device(private.batch(list(range(min(args.records, len(private))))), cpu)
    n, batch_size = len(private), cfg.train.batch_size
    steps = cfg.train.epochs * steps_per_epoch(n, batch_size)
    sigma = plan_sigma(replace(cfg, **{"train.method": "proj"}), n=n, steps=steps)
    public_by_tensor = public_rows_of(loss_fn, params, public_batch, cfg.privacy.chunk_size)
    results = {}
    for label, scaled in (("unscaled", False), ("public scales", True)):
        row = measure(loss_fn, params, public_batch, private_batch, cfg, scaled)
        clipped, mean = row.pop("clipped"), row.pop("mean")
        results[label] = row
        print(f"{label:14s}: k={row['k']}, {row['tensors_below_0.3']} of {len(row['tensors'])} tensors with "
              f"cos(projected, clipped) < 0.3; cos with the mean gradient: clipped {row['cos_clipped_mean']:.2f}, "
              f"projected {row['cos_projected_mean']:.2f}; in tensor-adam's frame: clipped "
              f"{row['tensor_frame_cos_clipped_mean']:.2f}, projected {row['tensor_frame_cos_projected_mean']:.2f}",
              flush=True)
        per_tensor = []
        for k_t in args.per_tensor_k:
            # a tensor's own V is the same with its public scale or without
            cell = measure_per_tensor(public_by_tensor, clipped, mean, k_t=k_t,
                                      noise=sigma * cfg.privacy.clip_norm / batch_size)
            per_tensor.append(cell)
            print(f"{'':14s}  V per tensor, {k_t} each ({cell['directions']} in all): {cell['tensors_below_0.3']} "
                  f"tensors under 0.3; tensor-adam's frame {cell['tensor_frame_cos_projected_mean']:.2f}; a "
                  f"tensor's signal over one step's noise in its directions: median "
                  f"{cell['signal_to_step_noise_median']:.3f}, largest {cell['signal_to_step_noise_max']:.3f}",
                  flush=True)
        row["per_tensor_basis"] = per_tensor
    rms = sorted(t["rms_mean"] for t in results["unscaled"]["tensors"])
    print(f"per-tensor RMS of the mean gradient: {rms[0]:.1e} .. {rms[-1]:.1e}")
    out = {"results": results, "sigma": sigma, "batch_size": batch_size, "steps": steps, "config": args.config,
           "overrides": overrides, "records": args.records,
           "seconds": round(time.perf_counter() - t0, 1), **provenance(command=" ".join(sys.argv))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
