"""The four phases of one local training step: sample, public batch, DP gradient, update.

``StepPhases`` is built once per ``fedpose.shared.training.loop.local_train`` call from its ready ``LocalRun``; the loop
then calls, every step:

1. ``sample``: a Poisson sample of the private records (q = the spec's sample rate; P4), or of patients at
   patient level, or K augmented copies of each sampled record (augmentation multiplicity), or each record's
   image beside psi of its canonical crop (``train.images: raw+psi``); nonprivate draws a plain batch;
2. ``public_batch``: for fdp / fpdp, psi of exactly ``train.public_batch_size`` canonical crops (P3, P13, P17);
3. ``gradient``: V refreshed from public data when due (P2), then ``fpdp.dp_gradient`` (P1, P14, P15);
4. ``update``: the optimizer step at the schedule's learning rate, and the iterate average.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fedpose.shared.training.batches import (make_psi_from, psi_on, public_basis_at, public_scaled_basis_at,
                                              public_scales_at, to_device)
from fedpose.shared.errors import NonFinitePublicGradients
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_strategy
from fedpose.shared.privacy.audit.hooks import AuditHooks, ReleasedStep
from fedpose.shared.privacy.step.spec import StepAudit
from fedpose.shared.privacy.step.fpdp import dp_gradient
from fedpose.shared.privacy.step.psi import PsiBatch
from fedpose.shared.privacy.step.sampling import augmented_copies, poisson_sample
from fedpose.shared.privacy.step.subspace import column_major
from fedpose.shared.training.schedule import lr_factor, make_optimizer
from fedpose.shared.training.tensor_adam import noise_variances
from fedpose.shared.training.weight_average import WeightAverage


class StepPhases:
    """The state one ``local_train`` call steps with, and its four phases (see the module docstring).

    ``run``, ``data`` are ``fedpose.shared.training.loop.LocalRun`` and ``LocalData``. Everything a step could
    refuse is checked here, before the first step: nothing trains on a request that cannot finish.
    """

    def __init__(self, model: PoseNet, data, run, generator: torch.Generator, *, basis: torch.Tensor | None,
                 optimizer: torch.optim.Optimizer | None, audit: AuditHooks | None) -> None:
        spec, train, privacy = run.step, run.train, run.privacy
        method = spec.method
        if audit is not None and method == "nonprivate" and (audit.canaries is not None or audit.observe):
            raise ValueError("the audit's canaries and observer watch a DP step; method='nonprivate' has none")
        if spec.projects and basis is None and data.public is None:
            raise ValueError(f"method {method!r} needs a projection basis or a public set to compute one")
        if train.tensor_scales == "public" and (data.public is None or spec.unit != "record" or
                                                 spec.multiplicity > 1):
            raise ValueError("train.tensor_scales: public scales each record's gradient from the public split: it "
                             "needs the public split at hand (a centralized run; a site does not hold it) and "
                             "record-level DP without augmentation multiplicity")
        self.run, self.data, self.audit, self.generator = run, data, audit, generator
        self.model = model
        self.trainable = apply_strategy(model, train.strategy)
        self.named = dict(model.named_parameters())
        params = [self.named[name] for name in self.trainable]
        self.loss_fn = make_loss_fn(model, self.trainable)
        self.opt = optimizer or make_optimizer(params, train)
        self.ema = WeightAverage(params, decay=train.ema) if train.ema > 0 else None
        self.device = next(model.parameters()).device
        self.basis = column_major(basis) if basis is not None else None  # the layout project() reads fastest
        self.n = data.units(spec.unit)
        self.private = data.private
        self.psi_images = make_psi_from(privacy, generator) if train.images != "raw" else None
        # psi of each record's canonical crop, as fdp / fpdp's public term: all the rows (psi) or beside each (raw+psi)
        self.crops = data.private.canonical() if train.images != "raw" else None
        if train.images == "psi":
            self.private = self.crops
        self.psi = make_psi_from(privacy, generator) if spec.uses_public else None
        self.canonical = None
        if self.psi is not None:
            source = audit.psi_source if audit is not None else None
            self.canonical = source if source is not None else data.private.canonical()
            if len(self.canonical) < train.public_batch_size:  # a site's own check refuses this policy earlier
                raise ValueError(f"train.public_batch_size={train.public_batch_size} is larger than the "
                                 f"{len(self.canonical)} records its psi images are drawn from (without replacement)")
        # Public-batch sampling needs no privacy-grade randomness: psi(x) is public by assumption.
        self.pub_rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        self.watched = audit is not None and audit.observe is not None
        self.batch_sizes: list[int] = []
        self.zeroed = self.public_zeroed = 0
        self.seconds_basis = 0.0
        self.narrowest = None if self.basis is None else self.basis.shape[1]  # V's fewest columns (compute_basis)
        self.scales: dict[str, float] | None = None  # train.tensor_scales: public, refreshed with V
        self.tell_noise()

    def tell_noise(self) -> None:
        """dp-tensor-adam: each trained tensor's noise variance per coordinate in this step's update (public:
        sigma, C, B and V). Called again whenever V changes."""
        if not getattr(self.opt, "noise_aware", False):
            return
        spec = self.run.step
        std = 0.0 if spec.method == "nonprivate" else spec.sigma * spec.clip_norm / spec.expected_batch
        sizes = [(name, self.named[name].numel()) for name in self.trainable]
        self.opt.set_noise_variance(noise_variances(sizes, sorted(self.trainable), std=std,
                                                    basis=self.basis if spec.projects else None))

    def sample(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Phase 1: the private batch on the device, and its clipping groups (patients, augmented copies)."""
        spec, n, groups = self.run.step, self.n, None
        if spec.method == "nonprivate":
            idx = torch.from_numpy(self.pub_rng.choice(n, size=min(self.run.train.batch_size, n), replace=False))
            self.batch_sizes.append(int(idx.numel()))
        elif spec.unit == "patient":
            sampled = poisson_sample(n, sample_rate=spec.sample_rate, generator=self.generator)  # patients
            rows, group_ids = self.data.patients.expand(sampled.tolist())
            idx, groups = torch.tensor(rows, dtype=torch.long), torch.tensor(group_ids, dtype=torch.long)
            self.batch_sizes.append(int(sampled.numel()))
        else:
            idx = poisson_sample(n, sample_rate=spec.sample_rate, generator=self.generator)
            self.batch_sizes.append(int(idx.numel()))
            copies = self.run.privacy.augment_multiplicity  # spec.multiplicity counts raw+psi's pair too
            if copies > 1:  # K augmented copies of each sampled record, clipped as one mean
                idx, groups = augmented_copies(idx, copies)
        raw = self.private.batch(idx.tolist())
        if self.run.train.images == "psi":  # the psi(x)-only baseline trains on psi of its (canonical) batch
            return self._psi_of(raw), groups
        if self.run.train.images == "raw+psi":  # each record's image, then psi of its canonical crop
            blurred = self._psi_of(self.crops.batch(idx.tolist()))
            rows = {k: torch.stack([v, blurred[k]], 1).flatten(0, 1) for k, v in to_device(raw, self.device).items()}
            pairs = torch.arange(idx.numel(), dtype=torch.long).repeat_interleave(2)  # (2B,): the record of each row
            return rows, (pairs if spec.method != "nonprivate" else None)
        return to_device(raw, self.device), groups

    def _psi_of(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = psi_on(self.psi_images, batch, self.device).tensors
        return {k: v for k, v in tensors.items() if k != "index"}

    def public_batch(self) -> PsiBatch | None:
        """Phase 2: psi of exactly public_batch_size distinct canonical crops (fdp / fpdp), else None.

        The count never depends on how many records the site holds: the step's memory and time do not (P13), and
        the draw shows the server psi(x) and the labels of that many records, nothing about how many there are (P17).
        """
        if self.psi is None or self.canonical is None:
            return None
        pub_idx = self.pub_rng.choice(len(self.canonical), size=self.run.train.public_batch_size, replace=False)
        return psi_on(self.psi, self.canonical.batch(pub_idx.tolist()), self.device)

    def gradient(self, step: int, batch: dict[str, torch.Tensor], groups: torch.Tensor | None,
                 psi_batch: PsiBatch | None) -> tuple[dict[str, torch.Tensor], dict]:
        """Phase 3: V from public data when due (P2), then the step's update direction (``dp_gradient``)."""
        spec, privacy = self.run.step, self.run.privacy
        scaled = self.run.train.tensor_scales == "public"
        if (spec.projects or scaled) and self.data.public is not None and step % privacy.basis_every == 0:
            started = time.perf_counter()
            public = (self.model, self.loss_fn, self.trainable, self.data.public, privacy, self.device)
            try:
                if spec.projects and scaled:  # one pass: the scales, and V of the scaled public gradients
                    self.basis, self.scales = public_scaled_basis_at(*public)
                elif spec.projects:
                    self.basis = public_basis_at(*public)
                else:
                    self.scales = public_scales_at(*public)
            except NonFinitePublicGradients as error:
                if step == 0:  # at the start: the public samples or the start themselves
                    raise
                raise RuntimeError(
                    f"training diverged: at step {step} no public sample has a finite gradient at the current "
                    f"weights, so V and the tensor scales cannot be computed; lower train.lr (now "
                    f"{self.run.train.lr:g})") from error
            if spec.projects:
                width = self.basis.shape[1]
                self.narrowest = width if self.narrowest is None else min(self.narrowest, width)
            self.seconds_basis += time.perf_counter() - started
            self.tell_noise()
        canaries = None
        if self.audit is not None and self.audit.canaries is not None:
            canaries = self.audit.canaries.draw(step, sample_rate=spec.sample_rate, generator=self.generator)
        released: list[dict[str, torch.Tensor]] = []
        current = {name: self.named[name].detach() for name in self.trainable}
        audit = None
        if canaries is not None or self.watched:
            audit = StepAudit(canaries=canaries, on_private=released.append if self.watched else None)
        grads, info = dp_gradient(self.loss_fn, current, spec=spec, private_batch=batch, psi_batch=psi_batch,
                                  generator=self.generator, basis=self.basis, groups=groups, audit=audit,
                                  scales=self.scales)
        self.zeroed += int(info["zeroed"])
        self.public_zeroed += int(info["public_zeroed"])
        if self.watched:
            self.audit.observe(ReleasedStep(step=step, update=grads, private=released[0], basis=self.basis))
        return grads, info

    def update(self, step: int, grads: dict[str, torch.Tensor]) -> None:
        """Phase 4: one optimizer step at the schedule's learning rate, then the iterate average."""
        train = self.run.train
        offset, total = self.run.span
        for name in self.trainable:
            self.named[name].grad = grads[name].to(self.named[name].dtype)
        for group in self.opt.param_groups:
            group["lr"] = train.lr * lr_factor(train.schedule, offset + step, total)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
