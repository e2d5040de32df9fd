"""Why proj ends below dpsgd: where the signal and the noise of a private step go, under Adam and under SGD.

At fixed weights (the public-pretrained start, or a trained model.pt), for the default config's private data
and its planned noise (eps 0.8, 30 epochs), this measures:

* how much of the private gradient the public basis V keeps: ``||V V^T g*||^2 / ||g*||^2``, where g* is the
  clipped mean gradient over a large batch (the signal a step estimates);
* the signal-to-noise energy of one noisy step, ``||g||^2 / ||z||^2``, before and after the projection;
* the direction each optimizer would move in after ``--steps`` noisy steps at these weights: the cosine of the
  update u with g*, the first-order loss decrease per unit learning rate ``<u, g*>``, and what one step of
  that update does to the training loss on 256 held records (its first and second order together), for
  dpsgd and proj (the same noisy gradients, projected or not) under Adam (the config's betas) and under SGD
  with momentum, at each optimizer's learning rates.

``--train`` first runs the outcome: centralized 30-epoch runs (eps 0.8, one seed) of dpsgd and proj under Adam at
the config's learning rate and a tenth of it, and under SGD with momentum at two learning rates (resumable: a run
whose metrics.json exists in ``--runs`` is read back).

Run: python benchmarks/proj_diagnosis.py [--weights runs/.../model.pt ...] [--train] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


import torch
from tqdm import tqdm

from fedpose.shared.configuration.schema import load_config, replace
from fedpose.shared.model.posenet import load_checkpoint
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_train_strategy
from fedpose.shared.privacy.step.fpdp import clipped_grad_sum
from fedpose.shared.privacy.step.noise import gaussian_noise_like
from fedpose.shared.privacy.step.sampling import poisson_sample
from fedpose.shared.privacy.step.subspace import flat_vector, from_flat_vector, public_basis_at
from fedpose.shared.training.provenance import provenance
from fedpose.shared.training.runs import ensure_data, ensure_pretrained, load_records, plan_sigma, private_records
from fedpose.shared.training.batches import make_dataset, to_device
from fedpose.shared.training.schedule import steps_per_epoch


LEARNING_RATES = {"adam": (1e-4, 1e-3), "sgd": (0.01, 0.1, 1.0)}  # one step of each size along the last update


def clipped_mean(loss_fn, params, dataset, idx, cfg) -> torch.Tensor:
    total = None
    for start in range(0, len(idx), 64):
        batch = to_device(dataset.batch(idx[start:start + 64]), torch.device("cpu"))
        summed, _, _ = clipped_grad_sum(loss_fn, params, batch, clip_norm=cfg.privacy.clip_norm,
                                        chunk_size=cfg.privacy.chunk_size)
        flat = flat_vector(summed)
        total = flat if total is None else total + flat
    return total / len(idx)


class Adam:
    """Adam's update direction m_hat / (sqrt(v_hat) + eps) on flat gradients (torch.optim.Adam's arithmetic)."""

    def __init__(self, like: torch.Tensor, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.m, self.v, self.t = torch.zeros_like(like), torch.zeros_like(like), 0
        self.betas, self.eps = betas, eps

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        b1, b2 = self.betas
        self.t += 1
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        return (self.m / (1 - b1 ** self.t)) / ((self.v / (1 - b2 ** self.t)).sqrt() + self.eps)


class Momentum:
    """SGD with momentum's update direction (torch.optim.SGD's buffer, dampening 0)."""

    def __init__(self, like: torch.Tensor, momentum: float = 0.9) -> None:
        self.buf, self.momentum, self.started = torch.zeros_like(like), momentum, False

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        self.buf = g.clone() if not self.started else self.buf.mul_(self.momentum).add_(g)
        self.started = True
        return self.buf


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def diagnose(cfg, weights: Path, *, steps: int, signal_batch: int, seed: int) -> dict:
    torch.manual_seed(seed)
    root = ensure_data(cfg, progress=False)
    private = private_records(root, cfg)
    public = make_dataset(load_records(root, cfg.data.public_split), cfg, train=False)
    dataset = make_dataset(private, cfg, train=True, seed=seed)
    model, _ = load_checkpoint(weights)
    trainable = apply_train_strategy(model, cfg.train)
    named = dict(model.named_parameters())
    params = {name: named[name].detach() for name in trainable}
    loss_fn = make_loss_fn(model, trainable)
    n = len(private)
    sigma = plan_sigma(replace(cfg, **{"train.method": "dpsgd"}), n=n,
                       steps=cfg.train.epochs * steps_per_epoch(n, cfg.train.batch_size))
    basis = public_basis_at(model, loss_fn, trainable, public, cfg.privacy, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    signal_idx = torch.randperm(n, generator=generator)[:signal_batch].tolist()
    g_star = clipped_mean(loss_fn, params, dataset, signal_idx, cfg)
    kept = basis @ (basis.T @ g_star)
    q, batch_size = cfg.train.batch_size / n, float(cfg.train.batch_size)
    optimizers = {(m, o): (Adam(g_star) if o == "adam" else Momentum(g_star))
                  for m in ("dpsgd", "proj") for o in ("adam", "sgd")}
    trace: dict[str, list[float]] = {f"{m}/{o}": [] for m, o in optimizers}
    snr = {"dpsgd": [], "proj": []}
    def noisy_step() -> tuple[torch.Tensor, torch.Tensor]:
        """One private step's (clipped mean of a Poisson batch, its noise), both scaled by 1 / B as training does."""
        idx = poisson_sample(n, sample_rate=q, generator=generator).tolist()
        clean = clipped_mean(loss_fn, params, dataset, idx, cfg) * (len(idx) / batch_size) if idx else g_star * 0
        noise = flat_vector(gaussian_noise_like(params, std=sigma * cfg.privacy.clip_norm / batch_size,
                                            generator=generator))
        return clean, noise

    def directions(clean: torch.Tensor, noise: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
        noisy = {"dpsgd": clean + noise, "proj": basis @ (basis.T @ (clean + noise))}
        return {(m, o): state.direction(noisy[m]) for (m, o), state in optimizers.items()}

    for _ in tqdm(range(steps), desc=f"noisy steps at {weights.parent.name}", leave=False):
        clean, noise = noisy_step()
        snr["dpsgd"].append(float(clean.norm() ** 2 / noise.norm() ** 2))
        p_clean, p_noise = basis @ (basis.T @ clean), basis @ (basis.T @ noise)
        snr["proj"].append(float(p_clean.norm() ** 2 / p_noise.norm() ** 2))
        for (method, opt), u in directions(clean, noise).items():
            trace[f"{method}/{opt}"].append(cosine(u, g_star))
    last = {}
    for name, cosines in trace.items():
        last[name] = {"cosine_last": cosines[-1], "cosine_mean_last10": statistics.mean(cosines[-10:])}
    # One more noisy step, the same for every optimizer, gives each update's first-order gain along g*.
    updates = directions(*noisy_step())
    for (method, opt), u in updates.items():
        last[f"{method}/{opt}"].update({"gain_per_lr": float(u @ g_star), "update_norm": float(u.norm())})
    held = to_device(make_dataset(private, cfg, train=False).batch(signal_idx[:256]), torch.device("cpu"))
    with torch.no_grad():
        before = float(loss_fn(params, held).mean())
        for name, o in last.items():
            u = from_flat_vector(updates[tuple(name.split("/"))], like=params)
            o["loss_change"] = {f"{lr:g}": float(loss_fn({k: params[k] - lr * u[k] for k in params}, held).mean())
                                - before
                                for lr in LEARNING_RATES[name.split("/")[1]]}
    return {
        "weights": str(weights), "loss": before, "sigma": sigma, "q": q, "p": int(g_star.numel()),
        "k": int(basis.shape[1]),
        "signal_norm": float(g_star.norm()), "signal_kept": float(kept.norm() ** 2 / g_star.norm() ** 2),
        "noise_kept": float(basis.shape[1] / g_star.numel()),
        "snr_step": {m: statistics.mean(v) for m, v in snr.items()},
        "optimizers": last, "trace": trace,
    }


# (method, optimizer, learning rate) of the --train runs
TRAIN_RUNS = tuple((method, "adam", lr) for lr in (1e-3, 1e-4, 3e-4, 3e-5) for method in ("dpsgd", "proj")) + tuple(
    (method, "sgd", lr) for lr in (0.01, 0.001) for method in ("dpsgd", "proj")) + (("proj", "adam", 1e-5),)


def train_runs(cfg, runs: Path, seed: int, threads: int, on_run=None) -> list[dict]:
    from fedpose.shared.training.runs import run_train

    rows = []
    for method, optimizer, lr in tqdm(TRAIN_RUNS, desc="training runs"):
        out = runs / f"{method}-{optimizer}-{lr:g}-{seed}"
        row = {"method": method, "optimizer": optimizer, "lr": lr, "seed": seed}
        if (out / "failed.txt").is_file():  # a run that broke down is a result too: it is not rerun
            row["failed"] = (out / "failed.txt").read_text().strip()
        elif (out / "metrics.json").is_file():
            metrics = json.loads((out / "metrics.json").read_text())
        else:
            run = replace(cfg, **{"train.method": method, "train.optimizer": optimizer, "train.lr": lr,
                                  "train.seed": seed, "train.out": str(out), "runtime.threads": threads})
            try:
                metrics = run_train(run, out, progress=False)
            except ValueError as err:  # e.g. the model collapsed and its public gradients lost their rank
                out.mkdir(parents=True, exist_ok=True)
                (out / "failed.txt").write_text(str(err) + "\n")
                row["failed"] = str(err)
        if "failed" not in row:
            row.update(pckh=metrics["pckh"]["mean"], start=metrics["initial_pckh_mean"], epsilon=metrics["epsilon"],
                       seconds=metrics["seconds"])
        rows.append(row)
        tqdm.write(f"{method} {optimizer} lr {lr:g}: " + (f"FAILED ({row['failed']})" if "failed" in row else
                                                         f"PCKh {row['pckh']:.2f} (start {row['start']:.2f})"))
        if on_run is not None:
            on_run(list(rows))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--weights", nargs="*", default=[],
                        help="model.pt files (default: the pretrained start and, with --train, the weights dpsgd and "
                             "proj end with under Adam at 1e-3)")
    parser.add_argument("--steps", type=int, default=40, help="noisy steps fed to each optimizer at fixed weights")
    parser.add_argument("--signal-batch", type=int, default=512, help="records in g*, the clipped mean gradient")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help="also run the 30-epoch training comparison")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of each run")
    parser.add_argument("--runs", default="runs/proj-diagnosis", help="where --train's runs go (resumable)")
    parser.add_argument("--out", default="benchmarks/results/proj_diagnosis.json")
    args = parser.parse_args()
    cfg = load_config(args.config)
    t0 = time.perf_counter()
    result = {"points": [], "training": [], "steps": args.steps, "signal_batch": args.signal_batch,
              "seed": args.seed, "config": args.config, **provenance(command=" ".join(sys.argv))}

    def write(**values) -> None:  # after each training run and after each diagnosis point
        result.update(values, seconds=round(time.perf_counter() - t0, 1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    if args.train:  # first: the diagnosis then also looks at the weights dpsgd and proj end with under Adam 1e-3
        train_runs(cfg, Path(args.runs), seed=1, threads=args.threads, on_run=lambda rows: write(training=rows))
    ends = [Path(args.runs) / f"{m}-adam-0.001-1" / "model.pt" for m in ("dpsgd", "proj")] if args.train else []
    weights = [Path(w) for w in args.weights] or [Path(ensure_pretrained(cfg, progress=True))] + [
        p for p in ends if p.is_file()]
    for w in weights:
        point = diagnose(cfg, w, steps=args.steps, signal_batch=args.signal_batch, seed=args.seed)
        write(points=[*result["points"], point])
        print(f"{w}: sigma {point['sigma']:.3f}, V keeps {100 * point['signal_kept']:.1f} % of g*'s energy and "
              f"{100 * point['noise_kept']:.4f} % of the noise's; step SNR dpsgd {point['snr_step']['dpsgd']:.2e}, "
              f"proj {point['snr_step']['proj']:.2e}")
        for name, o in point["optimizers"].items():
            change = "  ".join(f"lr {lr}: {d:+.4f}" for lr, d in o["loss_change"].items())
            print(f"  {name:11s} cos(u, g*) {o['cosine_mean_last10']:+.4f}  <u, g*> {o['gain_per_lr']:+.4f}  "
                  f"|u| {o['update_norm']:.1f}  loss change {change}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
