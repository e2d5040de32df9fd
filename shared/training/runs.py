"""Centralized runs: data on first use, cached public pretraining, private training, evaluation.

These are the plain functions behind ``fedpose data synth``, ``pretrain``,
``train`` and ``eval``; the federation reuses ``ensure_data`` and
``ensure_pretrained`` so a fresh clone needs no manual preparation.

Pretraining (``pretrain_loop``) is non-private, on public data only: the starting point of finetune / full
training. BatchNorm is active there (batch statistics are fine without privacy) and is folded into the
convolutions before any private step (``fedpose.shared.model.tinyvit.fuse_batchnorm``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.configuration.schema import Config, dump_config
from fedpose.shared.errors import ConfigError
from fedpose.shared.data.mpii import load_split
from fedpose.shared.data.patients import PatientGroups, group_by_patient, stated_group_size
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.split import check_disjoint, check_no_duplicates
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.digest import data_identity
from fedpose.shared.data.synth.ward import ensure_faces, ensure_ward
from fedpose.shared.data.augment import Augment
from fedpose.shared.model.posenet import (
    PoseNet,
    build_model,
    build_pretrain_model,
    load_checkpoint,
    load_tinyvit_weights,
    save_checkpoint,
)
from fedpose.shared.model.tinyvit import fuse_batchnorm
from fedpose.shared.privacy.accounting.accountant import StepRecord, calibrate_sigma, check_delta, epsilon_spent
from fedpose.shared.privacy.accounting.claims import privacy_claim
from fedpose.shared.privacy.accounting.group import group_privacy
from fedpose.shared.privacy.step.psi import psi_label_of
from fedpose.shared.privacy.step.noise import make_generator
from fedpose.shared.training.provenance import configure_numerics, provenance
from fedpose.shared.training.batches import assembly_device, make_dataset, to_device
from fedpose.shared.configuration.flat import config_fingerprint
from fedpose.shared.metrics.evaluation import evaluate
from fedpose.shared.training.schedule import steps_per_epoch
from fedpose.shared.training.loop import LocalData, LocalResult, LocalRun, local_train, select_device, step_spec
from fedpose.shared.configuration.methods import PRIVATE, PROJECTED, WITH_PUBLIC
from fedpose.shared.configuration.yaml_io import write_json

log = logging.getLogger(__name__)


def run_splits(cfg: Config) -> list[str]:
    """The splits a centralized run reads: the private ones, the public and validation splits, and V's held-out
    public split where there is one (data.basis_split)."""
    return [*cfg.data.train_splits, cfg.data.public_split, cfg.data.val_split,
            *([cfg.data.basis_split] if cfg.data.basis_split else [])]


def ensure_data(cfg: Config, *, progress: bool = True) -> Path:
    """The data root of ``cfg.data.source``: the synthetic ward (generated there when absent, checked when present)
    or the splits already on disk (files: a missing directory is an error, never filled with synthetic data)."""
    root = Path(cfg.data.root)
    source = cfg.data.source
    if source is None:
        raise ConfigError("data.source is not set: say 'synthetic' (generate the embedded ward at data.root) or "
                          "'files' (read the splits at data.root)")
    if source == "files":
        hint = f" {cfg.data.help}" if cfg.data.help else " (convert a dataset first: fedpose data convert)"
        if not root.is_dir():
            raise FileNotFoundError(
                f"no such directory: {root} (data.source is files; check data.root or --data).{hint}")
        missing = [s for s in run_splits(cfg) if not (root / s / "annotations.json").is_file()]
        if missing:
            raise FileNotFoundError(f"{root} has no split {', '.join(missing)} (each needs annotations.json and "
                                    f"images/).{hint}")
        if not (root / cfg.data.val_split / "headboxes.json").is_file():  # before pretraining, not after it
            raise ConfigError(f"data.val_split {cfg.data.val_split!r} ({root / cfg.data.val_split}) has no head boxes "
                              "(headboxes.json), so PCKh cannot score it: convert it again with fedpose data convert "
                              "--headboxes (MPII's valid.json: the official mpii_gt_val.mat), or name a split that "
                              "has them")
        return root
    ward = ensure_ward(root, cfg.data.synth, progress=progress)
    if cfg.model.face_tasks:  # the face labels are a sidecar, written on first use
        for split in dict.fromkeys([*cfg.data.train_splits, cfg.data.public_split, cfg.data.val_split]):
            ensure_faces(ward, cfg.data.synth, split)
    return ward


def begin(cfg: Config) -> None:
    """The numeric settings every run of ``cfg`` uses: its fixed thread count, deterministic kernels."""
    configure_numerics(cfg.runtime.threads, deterministic=cfg.runtime.deterministic)


def run_identity(cfg: Config, root: Path, splits: list[str], command: str) -> dict[str, Any]:
    """metrics.json's record of where the numbers came from: the data (source and digest) and the software."""
    return {"data": data_identity(root, splits), "provenance": provenance(command=command)}


def load_records(root: Path, split: str) -> list[PoseRecord]:
    records = load_split(root, split)
    if not records:
        raise ValueError(f"split {split!r} under {root} is empty: a site needs at least one record")
    return records


def private_records(root: Path, cfg: Config) -> list[PoseRecord]:
    """The pooled private training splits (a centralized run's single private dataset)."""
    out: list[PoseRecord] = []
    for split in cfg.data.train_splits:
        out.extend(load_records(root, split))
    # One image twice (a copied file, or the same pixels in two splits) would be two records to the
    # accountant: refuse it, by decoded pixels like the P2 check.
    check_no_duplicates(out, what=f"the private training data ({', '.join(cfg.data.train_splits)})")
    return out


def check_batch_size(batch_size: int, n: int, unit: str = "record") -> None:
    """Refuse an expected batch size above the number of privacy units (q = B / n would exceed 1)."""
    if batch_size > n:
        what = "patients in the private data" if unit == "patient" else "private records"
        raise ConfigError(
            f"train.batch_size = {batch_size} is larger than the {n} {what}: the sample rate "
            f"q = B / n would be {batch_size / n:.3g} > 1; use train.batch_size <= {n}"
        )


def training_records(records: list[PoseRecord], cfg: Config) -> tuple[list[PoseRecord], PatientGroups | None]:
    """The records a run trains on and, at patient level, their patient groups (issue #11).

    Patient level: at most ``privacy.max_records_per_patient`` records of each
    patient (a fixed subset, ``group_by_patient``; its seed is train.seed or 0).
    Record level (and nonprivate): every record, unchanged.
    """
    if cfg.privacy.unit != "patient" or cfg.train.method not in PRIVATE:
        return records, None
    try:
        return group_by_patient(records, cap=cfg.privacy.max_records_per_patient, seed=cfg.train.seed or 0)
    except ValueError as err:
        raise ConfigError(f"privacy.unit: patient: {err}") from err


# ---------------------------------------------------------------------------
# pretraining (non-private, public split only)
# ---------------------------------------------------------------------------


def pretrain_loop(
    model: PoseNet,
    dataset: PoseDataset,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    seed: int,
    progress: bool = True,
) -> float:
    """Plain non-private minibatch training (AdamW, cosine LR) of an unfused model on public data.

    Used for public pretraining only: BatchNorm is active here (batch
    statistics are fine without privacy) and is folded afterwards.
    Returns the mean loss of the last 10% of steps.
    """
    if len(dataset) == 0:
        raise ValueError("the public dataset is empty: nothing to pretrain on")
    device = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    tail: list[float] = []
    order = rng.permutation(len(dataset))
    pos = 0
    bar = tqdm(range(steps), desc="pretrain (public)", disable=not progress, leave=False, dynamic_ncols=True)
    for step in bar:
        if pos + batch_size > len(order):
            order, pos = rng.permutation(len(dataset)), 0
        idx = order[pos : pos + batch_size].tolist()
        pos += batch_size
        loss = model.losses(to_device(dataset.batch(idx), device)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step >= steps - max(1, steps // 10):
            tail.append(float(loss.detach()))
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    return float(np.mean(tail))


def run_pretrain(cfg: Config, out: str | Path | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Train from scratch, non-privately, on the public split only; writes model.pt + metrics.json."""
    out = Path(out or cfg.pretrain.out)
    t0 = time.perf_counter()
    begin(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.pretrain.threads)  # the weights depend on it (pretrain.threads); restored below
    try:
        return _pretrain(cfg, out, t0, progress=progress)
    finally:
        torch.set_num_threads(threads)


def _pretrain(cfg: Config, out: Path, t0: float, *, progress: bool) -> dict[str, Any]:
    device = select_device(cfg.train.device)
    torch.manual_seed(cfg.pretrain.seed)
    root = ensure_data(cfg, progress=progress)
    public = load_records(root, cfg.data.public_split)
    val = load_records(root, cfg.data.val_split)
    model = build_pretrain_model(cfg.model, cfg.data.input_size)
    if cfg.pretrain.init:
        init = Path(cfg.pretrain.init).expanduser()
        if not init.is_file():
            raise FileNotFoundError(f"pretrain.init: no TinyViT checkpoint at {init} (download the {cfg.model.variant} "
                                    "weights of the TinyViT release, e.g. tiny_vit_5m_22k_distill.pth, and put them "
                                    "there; or set pretrain.init: null to start from random weights)")
        load_tinyvit_weights(model, init)
    model = model.to(device)
    augment = Augment(photometric=cfg.pretrain.photometric) if cfg.data.augment else None
    dataset = PoseDataset(public, input_size=cfg.data.input_size, augment=augment, seed=cfg.pretrain.seed,
                          face_tasks=bool(cfg.model.face_tasks), device=assembly_device(device))
    steps = cfg.pretrain.epochs * steps_per_epoch(len(public), cfg.pretrain.batch_size)
    final_loss = pretrain_loop(
        model, dataset, steps=steps, batch_size=cfg.pretrain.batch_size, lr=cfg.pretrain.lr,
        weight_decay=cfg.pretrain.weight_decay, seed=cfg.pretrain.seed, progress=progress,
    )
    fuse_batchnorm(model)  # fold BatchNorm before the model can ever meet private data
    report, _, _ = evaluate(model, val, progress=progress)
    meta = {"kind": "pretrain", "fingerprint": config_fingerprint(cfg, "data", "model", "pretrain")}
    save_checkpoint(out / "model.pt", model, meta)
    metrics = {
        "kind": "pretrain",
        "data": cfg.data.public_split,
        "steps": steps,
        "final_loss": round(final_loss, 4),
        **report,
        "seconds": round(time.perf_counter() - t0, 2),
        "claim": "non-private training on the public split only; no private data was used",
        **run_identity(cfg, root, [cfg.data.public_split, cfg.data.val_split], "pretrain"),
    }
    write_json(out / "metrics.json", metrics)
    dump_config(cfg, out / "config.yaml")
    return metrics


def _what_not_where(fingerprint: Any) -> Any:
    """A weights fingerprint without the places it names (data.root, pretrain.out, data.help): the same ward and
    weights reached through another path (relative, absolute, a link) are the same start."""
    if not isinstance(fingerprint, dict):
        return fingerprint
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in fingerprint.items()}
    for section, key in (("data", "root"), ("data", "help"), ("pretrain", "out")):
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def pretrained_problem(cfg: Config) -> str | None:
    """Why the public pretrained weights of this config cannot be used as they are (None: they can)."""
    path = (Path(cfg.pretrain.out) / "model.pt").expanduser().resolve()
    if not path.exists():
        return f"no pretrained weights at {path}"
    want = json.loads(json.dumps(config_fingerprint(cfg, "data", "model", "pretrain")))
    _, meta = load_checkpoint(path)
    if _what_not_where(meta.get("fingerprint")) != _what_not_where(want):
        return f"the pretrained weights at {path} were made with another data/model/pretrain config"
    return None


def ensure_pretrained(cfg: Config, *, progress: bool = True) -> Path:
    """Path of public pretrained weights matching this config, pretraining first when absent (cached)."""
    path = Path(cfg.pretrain.out) / "model.pt"
    problem = pretrained_problem(cfg)
    if problem is not None:
        log.info("%s: pretraining on the public split first", problem)
        run_pretrain(cfg, progress=progress)
    return path


def initial_model(cfg: Config, *, progress: bool = True) -> PoseNet:
    """The starting point of a strategy: public-pretrained weights, or a fresh model for scratch."""
    if cfg.train.strategy == "scratch":
        torch.manual_seed(cfg.train.seed if cfg.train.seed is not None else 0)
        return build_model(cfg.model, cfg.data.input_size)
    model, _ = load_checkpoint(ensure_pretrained(cfg, progress=progress))
    if tuple(model.input_size) != tuple(cfg.data.input_size):
        raise ConfigError(
            f"pretrained weights are for input {model.input_size}, the config asks for {cfg.data.input_size}"
        )
    return model


# ---------------------------------------------------------------------------
# private training (centralized)
# ---------------------------------------------------------------------------


def plan_sigma(cfg: Config, *, n: int, steps: int) -> float:
    """Noise multiplier meeting the target over the whole plan (calibrated once, never overshooting).

    ``n``: privacy units (records, or patients at patient level). ``privacy.noise_factor`` multiplies it (a
    research reference with more noise; the epsilon reported is then computed from the larger sigma).
    """
    if cfg.train.method == "nonprivate":
        return 0.0
    check_delta(cfg.privacy.delta, n)
    if cfg.privacy.noise_multiplier is not None:  # a diagnostic's fixed sigma (0: clipped without noise)
        return cfg.privacy.noise_factor * cfg.privacy.noise_multiplier
    q = min(1.0, cfg.train.batch_size / n)
    return cfg.privacy.noise_factor * calibrate_sigma(
        target_epsilon=cfg.privacy.epsilon,
        delta=cfg.privacy.delta,
        sample_rate=q,
        steps=steps,
        accountant=cfg.privacy.accountant,
    )


def run_train(cfg: Config, out: str | Path | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Train with ``cfg.train.method`` on the pooled private splits, evaluate on val, write results.

    Writes ``out/model.pt`` and ``out/metrics.json``; epsilon in the metrics
    comes from the accountant applied to what ran (P5), the claim from P8.
    """
    out = Path(out or cfg.train.out)
    t0 = time.perf_counter()
    begin(cfg)
    method = cfg.train.method
    device = select_device(cfg.train.device)
    root = ensure_data(cfg, progress=progress)
    private = private_records(root, cfg)
    public = load_records(root, cfg.data.public_split)
    val = load_records(root, cfg.data.val_split)
    check_disjoint(public, private)  # P2: S_pub and private data share no image
    unit = cfg.privacy.unit if method in PRIVATE else "record"
    group_size = group_source = None
    if unit == "record" and method in PRIVATE:  # what the record-level claim means for a patient
        try:
            group_size, group_source = stated_group_size(private, cfg.privacy.max_records_per_patient)
        except ValueError as err:
            raise ConfigError(f"privacy.{err}") from err
    private, patients = training_records(private, cfg)
    n = patients.count if patients is not None else len(private)
    check_batch_size(cfg.train.batch_size, n, unit)
    steps = cfg.train.epochs * steps_per_epoch(n, cfg.train.batch_size)
    sigma = plan_sigma(cfg, n=n, steps=steps)
    generator, seeded = make_generator(cfg.train.seed, "cpu")
    model = initial_model(cfg, progress=progress).to(device)
    start, _, _ = evaluate(model, val, progress=False)  # the start every summary shows the gain from
    if cfg.train.seed is not None:
        torch.manual_seed(cfg.train.seed)
    dataset = make_dataset(private, cfg, train=True, seed=cfg.train.seed)
    public_eval = make_dataset(public, cfg, train=False)
    if cfg.data.basis_split is not None:  # V's public images: held out from pretraining, augmented (P2: public)
        held_out = load_records(root, cfg.data.basis_split)
        check_disjoint(held_out, private)
        public_eval = make_dataset(held_out, cfg, train=True, seed=cfg.train.seed)
    log.info("training %s/%s on %d private %ss (%d records): %d steps, q=%.4f, sigma=%.4f", method,
             cfg.train.strategy, n, unit, len(private), steps, min(1.0, cfg.train.batch_size / n), sigma)
    data = LocalData(dataset, patients=patients, public=public_eval)
    run = LocalRun(step_spec(method, cfg.train, cfg.privacy, sigma=sigma, data=data), steps, cfg.train, cfg.privacy)
    result = local_train(model, data, run, generator=generator, bar=f"train {method}" if progress else None)
    log.info("ran %d steps on n=%d %ss, mean Poisson batch %.1f (kept in this log only)", result.steps, n, unit,
             result.mean_batch)
    spent = _spent(cfg, result, unit, seeded, (group_size, group_source))
    report, _, _ = evaluate(model, val, progress=progress)
    metrics = {
        "method": method,
        "strategy": cfg.train.strategy,
        "epsilon": spent["epsilon"],
        "epsilon_replace_one": spent["epsilon_replace_one"],
        "unit": unit,
        # record level: the group size of the patient bound; patient level: the records cap (null: all)
        "max_records_per_patient": cfg.privacy.max_records_per_patient if unit == "patient" else group_size,
        "group_epsilon": spent["group_epsilon"],
        "group_delta": spent["group_delta"],
        "target_epsilon": cfg.privacy.epsilon if method in PRIVATE else None,
        "delta": cfg.privacy.delta if method in PRIVATE else None,
        "sigma": result.sigma,
        "sample_rate": result.sample_rate,
        "steps": result.steps,
        "clip": cfg.privacy.clip_norm if method in PRIVATE else None,
        "accountant": cfg.privacy.accountant if method in PRIVATE else None,
        "psi": spent["psi"],
        "images": cfg.train.images.replace("psi", psi_label_of(cfg.privacy)),  # raw, blur(0.03), raw+blur(0.03)
        "k": cfg.privacy.k if method in PROJECTED else None,
        "k_min": result.narrowest_basis,  # fewer than k when the public gradients spanned fewer directions
        # per-sample gradients at a time: privacy.chunk_size, or what privacy.chunk_memory chose on this machine
        "chunk_size": result.chunk_size if method in PRIVATE else None,
        "seeded": seeded,
        "claim": spent["claim"],
        "initial_pckh_mean": float(start["pckh"]["mean"]),
        **report,
        "seconds": round(time.perf_counter() - t0, 2),
        "seconds_basis": round(result.seconds_basis, 2),
        **run_identity(cfg, root, run_splits(cfg), "train"),
    }
    save_checkpoint(out / "model.pt", model, {"kind": "train", "metrics": metrics})
    write_json(out / "metrics.json", metrics)
    dump_config(cfg, out / "config.yaml")
    return metrics


def _spent(cfg: Config, result: LocalResult, unit: str, seeded: bool,
           group: tuple[int | None, str | None]) -> dict[str, Any]:
    """What a finished centralized run spent, from what ran (P5): epsilon (add/remove and replace-one), the
    group-privacy bound for a patient with ``group`` = (its most records, where that number comes from) at
    record level, and the printed claim (P8)."""
    method = cfg.train.method
    group_size, group_source = group
    spent: dict[str, Any] = {"epsilon": None, "epsilon_replace_one": None, "group_epsilon": None,
                             "group_delta": None}
    released = None
    if method in PRIVATE and result.sigma == 0:  # clipped without noise: no finite epsilon, never a guarantee
        spent.update(epsilon=math.inf, epsilon_replace_one=math.inf, psi=None,
                     claim="no privacy guarantee (epsilon unbounded): each record's gradient clipped to C without "
                           "noise (privacy.noise_multiplier: 0), a diagnostic of what the clipped step can reach")
        return spent
    if method in PRIVATE:
        ran = StepRecord(sigma=result.sigma, sample_rate=result.sample_rate, steps=result.steps)
        spent["epsilon"] = epsilon_spent([ran], delta=cfg.privacy.delta, accountant=cfg.privacy.accountant)
        # Replacing one record moves the clipped sum by up to 2C: the same mechanism at sigma / 2.
        replace_one = epsilon_spent([StepRecord(sigma=result.sigma / 2, sample_rate=result.sample_rate,
                                                steps=result.steps)],
                                    delta=cfg.privacy.delta, accountant=cfg.privacy.accountant)
        spent["epsilon_replace_one"] = replace_one
        released = (f"metrics.json and model.pt record the sample rate q = B/n (hence n): released with the model, "
                    f"n is public and the guarantee is the replace-one-{unit} one, eps={replace_one:.4g}")
        if group_size is not None:
            spent["group_epsilon"], spent["group_delta"] = group_privacy(epsilon=spent["epsilon"],
                                                                         delta=cfg.privacy.delta, k=group_size)
    spent["psi"] = psi_label_of(cfg.privacy) if method in WITH_PUBLIC else None
    spent["claim"] = privacy_claim(
        method=method, epsilon=spent["epsilon"] if spent["epsilon"] is not None else math.inf,
        delta=cfg.privacy.delta, psi=spent["psi"], seeded=seeded, accountant=cfg.privacy.accountant,
        released=released, unit=unit,
        records_per_patient=cfg.privacy.max_records_per_patient if unit == "patient" else group_size,
        records_source=group_source,
        psi_dp=(cfg.privacy.psi_eps, cfg.privacy.psi_m) if cfg.privacy.psi == "dp-pixelize" else None,
        face_tasks=cfg.model.face_tasks,
    )
    return spent
