"""Membership inference on trained pose models: loss / confidence thresholds and LiRA.

Setting (Carlini et al., "Membership inference attacks from first
principles", S&P 2022, "LiRA"): a pool of records; K models of one training
method, each trained with ``fedpose.shared.training.loop.local_train`` on an independent
random half of the pool (each record IN with probability 1/2 per model).
Every model in turn is the target and the other K - 1 its shadow models, so
each record has about (K - 1) / 2 IN and (K - 1) / 2 OUT shadows:

- loss attack: score = -loss of the target on the record (members fit better);
- confidence attack: score = mean SimCC keypoint confidence of the target;
- LiRA online: the per-record statistic (the loss) is modelled as Gaussian over
  the IN shadows and over the OUT shadows, with a variance pooled over all
  records (the fixed-variance variant for few shadows); score = log-likelihood
  ratio IN vs OUT of the target's statistic;
- LiRA offline: OUT shadows only; score = (mu_out - loss) / sigma_out.

Scores of all K targets are pooled into one ROC. With a pool of N records the
ROC has about K N / 2 negatives, so TPR at 0.1% FPR rests on K N / 2000 false
positives: small pools make it coarse, as the result says.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.configuration.schema import Config
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.privacy.accounting.accountant import (
    StepRecord,
    calibrate_sigma,
    check_delta,
    epsilon_spent,
)
from fedpose.shared.privacy.step.noise import make_generator
from fedpose.shared.training.runs import ensure_data, initial_model, load_records
from fedpose.shared.training.batches import make_dataset, to_device
from fedpose.shared.training.schedule import steps_per_epoch
from fedpose.shared.training.loop import LocalData, LocalRun, local_train, select_device, step_spec
from fedpose.shared.configuration.methods import PRIVATE
from fedpose.shared.configuration.yaml_io import write_json

log = logging.getLogger(__name__)

ATTACKS = ("loss", "confidence", "lira_online", "lira_offline")
FPR_POINTS = (0.01, 0.001)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MiaSpec:
    """methods: training methods compared; models: K per method; pool: records drawn from ``split``."""

    methods: tuple[str, ...] = ("nonprivate", "dpsgd", "fpdp")
    models: int = 8
    pool: int = 200
    split: str = "site-0"
    epsilon: float | None = None  # None: the config's privacy.epsilon
    seed: int | None = None

    def __post_init__(self) -> None:
        from fedpose.shared.configuration.methods import METHODS

        if not self.methods or any(m not in METHODS for m in self.methods):
            raise ValueError(f"methods={self.methods!r} must be a non-empty subset of {METHODS}")
        if isinstance(self.models, bool) or not isinstance(self.models, int) or self.models < 3:
            raise ValueError(f"models={self.models!r} must be an int >= 3 (a target and at least 2 shadows)")
        if isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 4:
            raise ValueError(f"pool={self.pool!r} must be an int >= 4")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon={self.epsilon!r} must be positive and finite")


# ----------------------------------------------------------------------------- ROC


def roc_curve(scores: np.ndarray, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) of the rule "member iff score >= t" over every threshold t, from (0, 0) to (1, 1).

    Tied scores move together (one point per distinct score), so the curve
    does not depend on the order of tied records.
    """
    scores = np.asarray(scores, dtype=np.float64)
    members = np.asarray(members, dtype=bool)
    if scores.shape != members.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and members {members.shape} must both be (N,)")
    positives, negatives = int(members.sum()), int((~members).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("a ROC needs both members and non-members")
    if not np.all(np.isfinite(scores)):
        raise ValueError("attack scores contain NaN/inf")
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], members[order]
    last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]  # last index of every run of equal scores
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    return np.r_[0.0, fp / negatives], np.r_[0.0, tp / positives]


def roc_summary(scores: np.ndarray, members: np.ndarray) -> dict[str, float]:
    """AUC (trapezoid) and the largest TPR at FPR <= 1% and <= 0.1%."""
    fpr, tpr = roc_curve(scores, members)
    auc = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))
    out = {"auc": auc}
    for point in FPR_POINTS:
        out[f"tpr@{point:g}fpr"] = float(tpr[fpr <= point].max())
    return out


# ----------------------------------------------------------------------------- attacks


def attack_scores(loss: np.ndarray, conf: np.ndarray, members: np.ndarray, target: int) -> dict[str, np.ndarray]:
    """Scores (N,) of every attack against model ``target``; loss, conf, members are (K, N)."""
    shadows = np.array([k for k in range(loss.shape[0]) if k != target])
    stat, shadow_stat, shadow_in = loss[target], loss[shadows], members[shadows]  # (N,), (S, N), (S, N)
    out = {"loss": -stat, "confidence": conf[target]}
    n_in, n_out = shadow_in.sum(0), (~shadow_in).sum(0)  # (N,)
    mu_in = np.where(shadow_in, shadow_stat, 0.0).sum(0) / np.maximum(n_in, 1)
    mu_out = np.where(~shadow_in, shadow_stat, 0.0).sum(0) / np.maximum(n_out, 1)
    # a record with no IN (or no OUT) shadow falls back to the mean over all records of that side
    mu_in = np.where(n_in > 0, mu_in, mu_in[n_in > 0].mean() if (n_in > 0).any() else stat.mean())
    mu_out = np.where(n_out > 0, mu_out, mu_out[n_out > 0].mean() if (n_out > 0).any() else stat.mean())
    resid_in = np.where(shadow_in, shadow_stat - mu_in, 0.0)
    resid_out = np.where(~shadow_in, shadow_stat - mu_out, 0.0)
    var_in = max((resid_in**2).sum() / max(int(shadow_in.sum()) - 1, 1), 1e-12)  # pooled (fixed) variance
    var_out = max((resid_out**2).sum() / max(int((~shadow_in).sum()) - 1, 1), 1e-12)
    log_in = -0.5 * (stat - mu_in) ** 2 / var_in - 0.5 * math.log(var_in)
    log_out = -0.5 * (stat - mu_out) ** 2 / var_out - 0.5 * math.log(var_out)
    out["lira_online"] = log_in - log_out
    out["lira_offline"] = (mu_out - stat) / math.sqrt(var_out)  # one-sided: lower loss than OUT models
    return out


def evaluate_attacks(loss: np.ndarray, conf: np.ndarray, members: np.ndarray) -> dict[str, Any]:
    """Every attack with every model as target, pooled: {attack: {auc, tpr@..., fpr, tpr}}."""
    pooled: dict[str, list[np.ndarray]] = {a: [] for a in ATTACKS}
    for target in range(loss.shape[0]):
        for name, scores in attack_scores(loss, conf, members, target).items():
            pooled[name].append(scores)
    truth = members.reshape(-1)
    out: dict[str, Any] = {}
    for name in ATTACKS:
        scores = np.concatenate(pooled[name])
        fpr, tpr = roc_curve(scores, truth)
        out[name] = {**roc_summary(scores, truth), "fpr": fpr, "tpr": tpr}
    return out


# ----------------------------------------------------------------------------- models


@torch.no_grad()
def per_record_stats(model: torch.nn.Module, dataset: PoseDataset,
                     device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """(loss (N,), mean keypoint confidence (N,)) of the model on every record's canonical crop."""
    model.eval()
    losses, confs = [], []
    for start in range(0, len(dataset), 64):
        batch = to_device(dataset.batch(list(range(start, min(start + 64, len(dataset))))), device)
        losses.append(model.losses(batch).double().cpu().numpy())
        x_logits, y_logits, _ = model(batch["image"])
        conf = torch.minimum(x_logits.softmax(-1).amax(-1), y_logits.softmax(-1).amax(-1))  # (B, J)
        confs.append(conf.mean(-1).double().cpu().numpy())
    model.train()
    return np.concatenate(losses), np.concatenate(confs)


def run_mia(cfg: Config, spec: MiaSpec, out: str | Path | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Train K models per method on random halves of the pool, attack each, write mia.json and mia.png."""
    t0 = time.perf_counter()
    device = select_device(cfg.train.device)
    root = ensure_data(cfg, progress=progress)
    records = load_records(root, spec.split)
    if spec.pool > len(records):
        raise ValueError(f"pool={spec.pool} exceeds the {len(records)} records of split {spec.split!r}")
    rng = np.random.default_rng(spec.seed)
    pool = [records[int(i)] for i in np.sort(rng.choice(len(records), size=spec.pool, replace=False))]
    members = rng.random((spec.models, spec.pool)) < 0.5  # (K, N)
    eval_set = PoseDataset(pool, input_size=cfg.data.input_size, augment=None)
    public = make_dataset(load_records(root, cfg.data.public_split), cfg, train=False)
    epsilon = spec.epsilon if spec.epsilon is not None else cfg.privacy.epsilon
    # every model trains on about N / 2 records: one plan (q, steps, sigma) for all of them
    half = spec.pool // 2
    q = min(1.0, cfg.train.batch_size / half)
    steps = cfg.train.epochs * steps_per_epoch(half, cfg.train.batch_size)
    results: dict[str, Any] = {"pool": spec.pool, "models": spec.models, "split": spec.split, "steps": steps,
                               "epochs": cfg.train.epochs, "methods": {}}
    bar = tqdm(total=len(spec.methods) * spec.models, desc="mia: models", disable=not progress, dynamic_ncols=True)
    for method in spec.methods:
        sigma = 0.0
        if method in PRIVATE:
            check_delta(cfg.privacy.delta, half)
            sigma = calibrate_sigma(target_epsilon=epsilon, delta=cfg.privacy.delta, sample_rate=q, steps=steps,
                                    accountant=cfg.privacy.accountant)
        loss = np.zeros((spec.models, spec.pool))
        conf = np.zeros((spec.models, spec.pool))
        for k in range(spec.models):
            subset = [r for r, keep in zip(pool, members[k]) if keep]
            seed = None if spec.seed is None else spec.seed * 1000 + k
            generator, _ = make_generator(seed, "cpu")
            if seed is not None:
                torch.manual_seed(seed)
            model = initial_model(cfg, progress=False).to(device)
            data = LocalData(make_dataset(subset, cfg, train=True, seed=seed), public=public)
            step = step_spec(method, cfg.train, cfg.privacy, sigma=sigma, data=data,
                             sample_rate=q if method in PRIVATE else None,
                             expected_batch=float(cfg.train.batch_size) if method in PRIVATE else None)
            local_train(model, data, LocalRun(step, steps, cfg.train, cfg.privacy), generator=generator, bar=None)
            loss[k], conf[k] = per_record_stats(model, eval_set, device)
            bar.update(1)
        attacks = evaluate_attacks(loss, conf, members)
        # q = B / (N / 2) for every model (the realised halves differ a little; the plan is what the claim uses)
        eps = (epsilon_spent([StepRecord(sigma, q, steps)], delta=cfg.privacy.delta,
                             accountant=cfg.privacy.accountant) if method in PRIVATE else None)
        results["methods"][method] = {
            "epsilon": eps, "sigma": sigma, "sample_rate": q if method in PRIVATE else None,
            "attacks": {a: {k: v for k, v in r.items() if k not in ("fpr", "tpr")} for a, r in attacks.items()},
            "roc": {a: {"fpr": r["fpr"].tolist(), "tpr": r["tpr"].tolist()} for a, r in attacks.items()},
            "train_loss_in": float(loss[members].mean()), "train_loss_out": float(loss[~members].mean()),
        }
    bar.close()
    results["delta"] = cfg.privacy.delta
    results["seconds"] = round(time.perf_counter() - t0, 2)
    if out is not None:
        out = Path(out)
        write_json(out / "mia.json", results)
        plot_roc(results, out / "mia.png")
    return results


def plot_roc(results: dict[str, Any], path: str | Path) -> None:
    """ROC of the LiRA (online) and loss attacks per method, log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    floor = 1.0 / (results["models"] * results["pool"])
    for method, res in results["methods"].items():
        for attack, style in (("lira_online", "-"), ("loss", ":")):
            roc = res["roc"][attack]
            fpr, tpr = np.maximum(roc["fpr"], floor), np.maximum(roc["tpr"], floor)
            auc = res["attacks"][attack]["auc"]
            eps = f", eps={res['epsilon']:.2g}" if res["epsilon"] is not None else ""
            ax.plot(fpr, tpr, style, label=f"{method}{eps} {attack} (AUC {auc:.2f})")
    ax.plot([floor, 1], [floor, 1], color="grey", lw=0.8, label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"membership inference, {results['models']} models x {results['pool']} records", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mia_summary(res: dict[str, Any], out: str | Path | None = None) -> list[str]:
    """The lines ``fedpose attack mia`` prints of ``run_mia``'s result: a row per method and attack, and what it
    wrote."""
    lines = [f"membership inference: {res['models']} models per method, each on a random half of {res['pool']} "
             f"records of {res['split']} ({res['steps']} steps); every model attacked with the others as shadows",
             f"{'method':<11} {'eps':>6} {'attack':<13} {'AUC':>6} {'TPR@1%':>7} {'TPR@0.1%':>8}"]
    for method, r in res["methods"].items():
        eps = f"{r['epsilon']:.3g}" if r["epsilon"] is not None else "-"
        for attack, a in r["attacks"].items():
            lines.append(f"{method:<11} {eps:>6} {attack:<13} {a['auc']:6.3f} {a['tpr@0.01fpr']:7.3f} "
                         f"{a['tpr@0.001fpr']:8.3f}")
    lines.append("chance is AUC 0.5 and TPR = FPR; eps is the accountant's value for the plan every model ran (delta "
                 f"{res['delta']:g})")
    if out:
        lines.append(f"wrote {Path(out) / 'mia.json'} and {Path(out) / 'mia.png'} ({res['seconds']:.0f} s)")
    return lines
