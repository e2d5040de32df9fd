"""One local-training loop, used by centralized runs (``fedpose train``) and by sites.

``local_train`` runs the FP-DP step of docs/explanation/design.md (Algorithm 1 of the
paper) or one of its four comparison methods for a number of steps on one
private dataset and reports what actually ran (sigma, q, steps) so that the
caller's accountant, not the plan, produces every epsilon.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.allocator import keep_freed_memory
from fedpose.shared.config import Config, ConfigError, Method, PrivacyConfig, TrainConfig
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.patients import PatientGroups
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.transforms import Augment
from fedpose.shared.evaluation import evaluate, predict  # noqa: F401  (re-exported: runs, sites and tests import them from here)
from fedpose.shared.model.posenet import PoseNet, apply_strategy, make_loss_fn
from fedpose.shared.pixelization.spec import PixelizeSpec
from fedpose.shared.privacy.audit_hooks import AuditHooks, ReleasedStep
from fedpose.shared.privacy.fpdp import DPSpec, dp_gradient
from fedpose.shared.privacy.psi import DPPixelize, FeatureMap, PsiBatch, apply_psi, make_psi
from fedpose.shared.privacy.sampling import augmented_copies, poisson_sample
from fedpose.shared.privacy.subspace import column_major, compute_basis
from fedpose.shared.weight_average import WeightAverage

log = logging.getLogger(__name__)

PROJECTED = ("proj", "fpdp")
WITH_PUBLIC = ("fdp", "fpdp")
PRIVATE = ("dpsgd", "proj", "fdp", "fpdp")


def select_device(name: str) -> torch.device:
    """``auto``: CUDA when a GPU is present (hospital GPU boxes), else CPU; one code path for both."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def make_psi_from(privacy: PrivacyConfig, generator: torch.Generator) -> FeatureMap:
    """psi of the config: Gaussian blur (sigma = psi_param * min(H, W)), pixelation (block psi_param px) or
    DP pixelization (its noise seeded from ``generator``, the run's noise source)."""
    if privacy.psi == "blur":
        return make_psi("gaussian_blur", blur_sigma_frac=privacy.psi_param)
    if privacy.psi == "dp-pixelize":
        seed = torch.randint(0, 2**31 - 1, (4,), generator=generator).tolist()
        return DPPixelize(PixelizeSpec(eps=privacy.psi_eps, b=int(privacy.psi_param), m=privacy.psi_m),
                          rng=np.random.default_rng(seed))
    return make_psi("pixelate", block_size=int(privacy.psi_param))


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "index"}


def psi_on(psi: FeatureMap, batch: dict[str, torch.Tensor], device: torch.device) -> PsiBatch:
    """``apply_psi`` on ``batch`` moved to ``device``; a per-record psi (dp-pixelize) also gets the indices."""
    moved = to_device(batch, device)
    if getattr(psi, "per_record", False):
        moved["index"] = batch["index"]
    return apply_psi(psi, moved)


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of train.lr at global step ``step`` of ``total``: 1 (constant) or cosine decay to 0.

    Decaying the learning rate matters more under DP than without: late steps
    then average the noise instead of random-walking on it.
    """
    if schedule == "constant":
        return 1.0
    if total < 1 or not 0 <= step < total:
        raise ValueError(f"schedule step {step} is outside the run of {total} steps")
    return 0.5 * (1.0 + math.cos(math.pi * step / total))


def round_span(round: int, steps: int, rounds: int) -> tuple[int, int]:
    """``schedule_span`` of federated round ``round`` (1-based) of ``rounds``, ``steps`` local steps each.

    Rounds beyond the plan (a resumed server with more rounds) extend the run
    instead of failing.
    """
    if round < 1 or steps < 1:
        raise ValueError(f"round={round} and steps={steps} must be >= 1")
    return (round - 1) * steps, max(rounds, round) * steps


def make_optimizer(params: list[torch.Tensor], train: TrainConfig) -> torch.optim.Optimizer:
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)


@dataclass
class LocalResult:
    """What one call of ``local_train`` actually ran (the accountant's input) and how it went."""

    method: str
    sigma: float
    sample_rate: float
    steps: int
    clip_norm: float
    n: int  # privacy units: records, or patients at patient level
    mean_batch: float  # in the same units
    seconds: float
    seconds_basis: float
    unit: str = "record"
    # P14 diagnostics (private: the site's own log only): non-finite private contributions and public
    # gradients left out over the run.
    zeroed: int = 0
    public_zeroed: int = 0


def local_train(
    model: PoseNet,
    private: PoseDataset,
    *,
    method: Method,
    train: TrainConfig,
    privacy: PrivacyConfig,
    sigma: float,
    steps: int,
    generator: torch.Generator,
    public_basis: PoseDataset | None = None,
    basis: torch.Tensor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sample_rate: float | None = None,
    expected_batch: float | None = None,
    chunk_size: int | None = None,
    schedule_span: tuple[int, int] | None = None,
    patients: PatientGroups | None = None,
    progress: bool = True,
    desc: str = "train",
    audit: AuditHooks | None = None,
) -> LocalResult:
    """Run ``steps`` optimizer steps of ``method`` on ``private``; the model is updated in place.

    Per step (docs/explanation/design.md, the FP-DP step):
      private batch ~ Poisson(q) from raw images, q = train.batch_size / n   (P4)
      g = (sum_i clip(g_i, C) + N(0, sigma^2 C^2 I)) / B                     (P1, P15)
      g = V (V^T g) for proj / fpdp, V from public data only                (P2)
      + g_pub = mean grad on psi(x) of a site batch for fdp / fpdp          (P3)
    The basis is either given (federated: broadcast by the server) or, when
    ``public_basis`` is given, recomputed every ``privacy.basis_every`` steps
    from ``privacy.m`` public samples at the current weights.
    ``schedule_span`` = (offset, total) places these steps in a longer run for
    ``train.schedule`` (a federated site: offset = steps of earlier rounds);
    default (0, steps). ``sample_rate``: the Poisson rate q (a site: its
    policy's, so that nothing released depends on n); default B / n.
    ``expected_batch``: the public normaliser B of the noisy sum (a site: its
    policy's declared expected batch; P15); default ``train.batch_size``, the
    B a centralized config states. ``chunk_size``: per-sample gradients held
    at a time (a site: its policy's, so memory never depends on the request or
    the realised batch); default ``privacy.chunk_size``.

    psi sees the canonical crop of each record (no augmentation), so the
    public gradient depends on x only through psi(x) of the record and its
    labels (P3), and psi's strength is exactly the stated one; the private
    batch alone is augmented.

    ``audit`` (``fedpose audit`` only, see ``AuditHooks``) adds gradient
    canaries to the private steps and lets the auditor see every released
    gradient and the V it was projected with; production callers leave it None.

    ``privacy.unit == "patient"`` (issue #11): ``patients`` groups the records
    of ``private`` by patient (``fedpose.shared.data.patients.group_by_patient``, which
    has already left out records beyond the cap); each step Poisson-samples
    patients with q = train.batch_size / patients (or ``sample_rate``), takes
    all of their records and clips each patient's mean gradient
    (``fpdp.dp_gradient`` with ``groups``); n and q are then in patients.
    """
    if len(private) == 0:
        raise ValueError("the private dataset is empty: a site needs at least one record to train")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    keep_freed_memory()  # every step frees and takes again the same tens of MB: keep them in the process
    unit = privacy.unit if method != "nonprivate" else "record"
    if unit == "patient":
        if patients is None:
            raise ValueError("privacy.unit is 'patient' but no patient groups were given (group_by_patient)")
        if sorted(i for m in patients.members for i in m) != list(range(len(private))):
            raise ValueError(f"the patient groups cover {sum(patients.sizes)} records, not the {len(private)} "
                             "records of the dataset (build both from group_by_patient's kept records)")
    n = patients.count if unit == "patient" else len(private)
    device = next(model.parameters()).device
    q = min(1.0, train.batch_size / n) if sample_rate is None else float(sample_rate)
    if not 0 < q <= 1:
        raise ValueError(f"sample_rate={sample_rate!r} must be in (0, 1]")
    if (sample_rate is None) != (expected_batch is None):
        raise ValueError("give sample_rate and expected_batch together (a site's policy pins both), or neither")
    normaliser = float(train.batch_size) if expected_batch is None else float(expected_batch)
    trainable = apply_strategy(model, train.strategy)
    named = dict(model.named_parameters())
    params = [named[name] for name in trainable]
    loss_fn = make_loss_fn(model, trainable)
    opt = optimizer or make_optimizer(params, train)
    if audit is not None and audit.canaries is not None and method == "nonprivate":
        raise ValueError("gradient canaries audit a DP step; method='nonprivate' has none")
    watched = audit is not None and audit.observe is not None
    if watched and method == "nonprivate":
        raise ValueError("the audit observes a DP step's release; method='nonprivate' has none")
    spec = DPSpec(
        method=method,
        clip_norm=privacy.clip_norm,
        sigma=sigma if method != "nonprivate" else 0.0,
        sample_rate=q,
        expected_batch=normaliser,
        chunk_size=privacy.chunk_size if chunk_size is None else chunk_size,
        unit=unit,
        multiplicity=privacy.augment_multiplicity if method != "nonprivate" else 1,
    )
    ema = WeightAverage(params, decay=train.ema) if train.ema > 0 else None
    psi = make_psi_from(privacy, generator) if method in WITH_PUBLIC else None
    canonical = None
    psi_only = make_psi_from(privacy, generator) if train.images == "psi" else None
    if psi_only is not None:
        if method != "nonprivate":
            raise ValueError(f"train.images='psi' is a non-private baseline; method is {method!r}")
        private = private.canonical()  # psi of each record's canonical crop, as the public term of fdp / fpdp
    if psi is not None:
        canonical = audit.psi_source if audit is not None and audit.psi_source is not None else private.canonical()
        if len(canonical) < train.public_batch_size:  # a site's own check refuses this policy before any round
            raise ValueError(f"train.public_batch_size={train.public_batch_size} is larger than the "
                             f"{len(canonical)} records its psi images are drawn from (without replacement)")
    # Public-batch sampling needs no privacy-grade randomness: psi(x) is public by assumption.
    pub_rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    if method in PROJECTED and basis is None and public_basis is None:
        raise ValueError(f"method {method!r} needs a projection basis or a public set to compute one")
    if basis is not None:
        basis = column_major(basis)  # once per call, not per step: the layout project() reads fastest
    offset, total = schedule_span if schedule_span is not None else (0, steps)
    if offset < 0 or offset + steps > total:
        raise ValueError(f"schedule_span={schedule_span}: steps {offset}..{offset + steps} do not fit a run of {total}")

    model.train()
    t0 = time.perf_counter()
    t_basis = 0.0
    batch_sizes: list[int] = []
    zeroed = public_zeroed = 0
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False, dynamic_ncols=True)
    for step in bar:
        if method in PROJECTED and public_basis is not None and step % privacy.basis_every == 0:
            tb = time.perf_counter()
            basis = public_basis_at(model, loss_fn, trainable, public_basis, privacy, device)
            t_basis += time.perf_counter() - tb
        groups = None
        if method == "nonprivate":
            idx = torch.from_numpy(pub_rng.choice(n, size=min(train.batch_size, n), replace=False))
            batch_sizes.append(int(idx.numel()))
        elif unit == "patient":
            sampled = poisson_sample(n, sample_rate=q, generator=generator)  # patients
            rows, group_ids = patients.expand(sampled.tolist())
            idx = torch.tensor(rows, dtype=torch.long)
            groups = torch.tensor(group_ids, dtype=torch.long)
            batch_sizes.append(int(sampled.numel()))
        else:
            idx = poisson_sample(n, sample_rate=q, generator=generator)
            batch_sizes.append(int(idx.numel()))
            if spec.multiplicity > 1:  # K augmented copies of each sampled record, clipped as one mean
                idx, groups = augmented_copies(idx, spec.multiplicity)
        raw = private.batch(idx.tolist())
        if psi_only is not None:  # the psi(x)-only baseline trains on psi of its (canonical) batch
            batch = {k: v for k, v in psi_on(psi_only, raw, device).tensors.items() if k != "index"}
        else:
            batch = to_device(raw, device)
        psi_batch = None
        if psi is not None:
            # Exactly public_batch_size distinct records every step: the step's memory and time never depend on
            # how many records the site holds (P13), and the draw shows the server psi(x) and the labels of that
            # many records, nothing about how many there are (P17).
            pub_idx = pub_rng.choice(len(canonical), size=train.public_batch_size, replace=False)
            psi_batch = psi_on(psi, canonical.batch(pub_idx.tolist()), device)
        canary_batch = None
        if audit is not None and audit.canaries is not None:
            canary_batch = audit.canaries.draw(step, sample_rate=q, generator=generator)
        released: list[dict[str, torch.Tensor]] = []
        current = {name: named[name].detach() for name in trainable}
        grads, info = dp_gradient(
            loss_fn,
            current,
            spec=spec,
            private_batch=batch,
            psi_batch=psi_batch,
            generator=generator,
            basis=basis,
            groups=groups,
            canaries=canary_batch,
            on_private=released.append if watched else None,
        )
        zeroed += int(info["zeroed"])
        public_zeroed += int(info["public_zeroed"])
        if watched:
            audit.observe(ReleasedStep(step=step, update=grads, private=released[0], basis=basis))
        for name in trainable:
            named[name].grad = grads[name].to(named[name].dtype)
        for group in opt.param_groups:
            group["lr"] = train.lr * lr_factor(train.schedule, offset + step, total)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        if progress and method != "nonprivate":
            bar.set_postfix(B=batch_sizes[-1], norm=f"{float(info['mean_norm']):.3f}")
    if ema is not None:
        ema.copy_to()  # the run releases the average of its iterates (post-processing)
    return LocalResult(
        method=method,
        sigma=spec.sigma,
        sample_rate=q,
        steps=steps,
        clip_norm=privacy.clip_norm,
        n=n,
        mean_batch=float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        seconds=time.perf_counter() - t0,
        seconds_basis=t_basis,
        unit=unit,
        zeroed=zeroed,
        public_zeroed=public_zeroed,
    )


def public_basis_at(
    model: PoseNet,
    loss_fn: Callable,
    trainable: list[str],
    public: PoseDataset,
    privacy: PrivacyConfig,
    device: torch.device,
) -> torch.Tensor:
    """V (p x k) from m public per-sample gradients at the current weights (P2: public data only)."""
    m = min(privacy.m, len(public))
    if privacy.k > m:
        raise ValueError(f"privacy.k = {privacy.k} exceeds the {m} public samples available; lower k")
    batch = to_device(public.batch(list(range(m))), device)
    keep_freed_memory()
    named = dict(model.named_parameters())
    current = {name: named[name].detach() for name in trainable}
    return compute_basis(loss_fn, current, batch, k=privacy.k, chunk_size=privacy.chunk_size)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Expected steps for one pass over n records at expected batch size B: ceil(n / B)."""
    return max(1, math.ceil(n / batch_size))


def make_dataset(records: list[PoseRecord], cfg: Config, *, train: bool, seed: int | None = None) -> PoseDataset:
    augment = Augment() if (train and cfg.data.augment) else None
    return PoseDataset(records, input_size=cfg.data.input_size, augment=augment, seed=seed,
                       face_tasks=bool(cfg.model.face_tasks))


def config_fingerprint(cfg: Config, *sections: str) -> dict[str, Any]:
    """The config sections that determine a cached artefact (compared on reuse)."""
    from fedpose.shared.config_flat import identity_flat, unflatten

    d = unflatten(identity_flat(cfg))
    return {s: d[s] for s in sections}


def write_json(path: str | Path, obj: Any) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False))
    tmp.replace(path)
