"""One local-training loop, used by centralized runs (``fedpose train``) and by sites.

``local_train`` runs a ready ``LocalRun`` (the DP step's spec, how many steps, where they sit in the run) on a
``LocalData`` (the private records, their patients, the public set V is computed from): the FP-DP step of
docs/explanation/design.md (Algorithm 1 of the paper) or one of its four comparison methods. It reports what
actually ran (sigma, q, steps) so that the caller's accountant, not the plan, produces every epsilon.
``select_device`` picks the device it trains on (``train.device``), for centralized runs and sites alike.

``StepPhases`` is built once per ``local_train`` call from its ready ``LocalRun``; the loop then calls, every
step, the four phases of one local training step:

1. ``sample``: a Poisson sample of the private records (q = the spec's sample rate; P4), or of patients at
   patient level, or K augmented copies of each sampled record (augmentation multiplicity), or each record's
   image beside psi of its canonical crop (``train.images: raw+psi``); nonprivate draws a plain batch;
2. ``public_batch``: for fdp / fpdp, psi of exactly ``train.public_batch_size`` canonical crops (P3, P13, P17);
3. ``gradient``: V refreshed from public data when due (P2), then ``fpdp.dp_gradient`` (P1, P14, P15);
4. ``update``: the optimizer step at the schedule's learning rate, and the iterate average.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.training.allocator import keep_freed_memory
from fedpose.shared.training.chunk_memory import chunk_for
from fedpose.shared.training.batches import assembly_device, make_psi_from, psi_on, to_device
from fedpose.shared.privacy.step.subspace import column_major, public_basis_at, public_scaled_basis_at, public_scales_at
from fedpose.shared.configuration.schema import PrivacyConfig, TrainConfig
from fedpose.shared.configuration.methods import Method, raw_psi_conflict, rows_per_record
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.patients import PatientGroups
from fedpose.shared.errors import ConfigError, NonFinitePublicGradients
from fedpose.shared.model.lora import add_adapters, merge_adapters
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.model.pose_loss import make_loss_fn
from fedpose.shared.model.strategy import apply_train_strategy
from fedpose.shared.privacy.audit.hooks import AuditHooks, ReleasedStep
from fedpose.shared.privacy.step.fpdp import DPSpec, StepAudit, dp_gradient
from fedpose.shared.privacy.step.persample import mean_grad
from fedpose.shared.privacy.step.psi import PsiBatch
from fedpose.shared.privacy.step.sampling import augmented_copies, poisson_sample
from fedpose.shared.training.public_adam import PublicAdam
from fedpose.shared.training.schedule import lr_factor, make_optimizer
from fedpose.shared.training.tensor_adam import noise_variances
from fedpose.shared.training.weight_average import WeightAverage


def select_device(name: str) -> torch.device:
    """``auto``: CUDA when a GPU is present (hospital GPU boxes), else CPU; one code path for both."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


@dataclass(frozen=True)
class LocalData:
    """What one ``local_train`` call trains on.

    private: the site's (or the pooled) private records. patients: at ``privacy.unit: patient``, the records
    of ``private`` grouped by patient (``fedpose.shared.data.patients.group_by_patient``, which has already left
    out records beyond the cap); each step then samples patients and clips each one's mean gradient. public:
    the public set V is recomputed from every ``privacy.basis_every`` steps (proj / fpdp without a given V).
    public_pool: the fixed set of records (indices of ``private``) fdp / fpdp's public term draws from; None: all.
    """

    private: PoseDataset
    patients: PatientGroups | None = None
    public: PoseDataset | None = None
    # fdp / fpdp at a site with ``public_records``: the indices of ``private`` its public term draws from (P17)
    public_pool: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.private) == 0:
            raise ValueError("the private dataset is empty: a site needs at least one record to train")
        if self.patients is not None and sorted(i for m in self.patients.members for i in m) != list(
                range(len(self.private))):
            raise ValueError(f"the patient groups cover {sum(self.patients.sizes)} records, not the "
                             f"{len(self.private)} records of the dataset (build both from group_by_patient's kept "
                             "records)")
        pool = self.public_pool
        if pool is not None and (not pool or len(set(pool)) != len(pool)
                                 or not all(0 <= i < len(self.private) for i in pool)):
            raise ValueError(f"public_pool must be distinct indices of the {len(self.private)} private records")

    def units(self, unit: str) -> int:
        """n, the privacy units held: records, or patients at patient level."""
        if unit != "patient":
            return len(self.private)
        if self.patients is None:
            raise ValueError("privacy.unit is 'patient' but no patient groups were given (group_by_patient)")
        return self.patients.count


def step_spec(method: Method, train: TrainConfig, privacy: PrivacyConfig, *, sigma: float, data: LocalData,
              sample_rate: float | None = None, expected_batch: float | None = None,
              chunk_size: int | None = None) -> DPSpec:
    """The DP step ``method`` runs on ``data``: C, sigma, the unit and its multiplicity from the configs.

    ``sample_rate``: the Poisson rate q (a site: its policy's, so that nothing released depends on n); default
    B / n. ``expected_batch``: the public normaliser B of the noisy sum (a site: its policy's declared expected
    batch; P15); default ``train.batch_size``, the B a centralized config states. Give both or neither.
    ``chunk_size``: per-sample gradients held at a time (a site: its policy's, so memory never depends on the
    request or the realised batch: every chunk is then padded to it, ``DPSpec.pad_chunks``); default
    ``privacy.chunk_size``, unpadded.
    """
    private = method != "nonprivate"
    unit = privacy.unit if private else "record"
    if (sample_rate is None) != (expected_batch is None):
        raise ValueError("give sample_rate and expected_batch together (a site's policy pins both), or neither")
    q = min(1.0, train.batch_size / data.units(unit)) if sample_rate is None else float(sample_rate)
    if not 0 < q <= 1:
        raise ValueError(f"sample_rate={sample_rate!r} must be in (0, 1]")
    return DPSpec(
        method=method,
        clip_norm=privacy.clip_norm,
        sigma=sigma if private else 0.0,
        sample_rate=q,
        expected_batch=float(train.batch_size) if expected_batch is None else float(expected_batch),
        chunk_size=privacy.chunk_size if chunk_size is None else chunk_size,
        pad_chunks=chunk_size is not None,
        unit=unit,
        without_noise=private and sigma == 0 and privacy.noise_multiplier == 0,
        # raw+psi: a record's image and psi of its crop are two rows of one group, clipped as one mean
        multiplicity=rows_per_record(train.images, privacy.augment_multiplicity) if private else 1,
    )


@dataclass(frozen=True)
class LocalRun:
    """A ready spec of one ``local_train`` call: the DP step (``step_spec``), how many steps, the configs.

    ``schedule_span`` = (offset, total) places these steps in a longer run for ``train.schedule`` (a federated
    site: offset = steps of earlier rounds, ``fedpose.shared.training.schedule.round_span``); default (0, steps).
    """

    step: DPSpec
    steps: int
    train: TrainConfig
    privacy: PrivacyConfig
    schedule_span: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        offset, total = self.span
        if offset < 0 or offset + self.steps > total:
            raise ValueError(f"schedule_span={self.schedule_span}: steps {offset}..{offset + self.steps} do not fit "
                             f"a run of {total}")
        if self.train.images == "psi" and self.step.method != "nonprivate":
            raise ValueError(f"train.images='psi' is a non-private baseline; method is {self.step.method!r}")
        conflict = raw_psi_conflict(self.train.images, self.step.method, self.step.unit,
                                    self.privacy.augment_multiplicity)
        if conflict:
            raise ValueError(conflict)

    @property
    def span(self) -> tuple[int, int]:
        return self.schedule_span if self.schedule_span is not None else (0, self.steps)


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
    # proj / fpdp: the fewest directions V had (below privacy.k when the public gradients spanned fewer)
    narrowest_basis: int | None = None
    # rows of every per-sample chunk (privacy.chunk_size, or the size chunk_memory chose; public: the machine's)
    chunk_size: int = 16


class StepPhases:
    """The state one ``local_train`` call steps with, and its four phases (see the module docstring).

    Everything a step could refuse is checked here, before the first step: nothing trains on a request that cannot
    finish.
    """

    def __init__(self, model: PoseNet, data: LocalData, run: LocalRun, generator: torch.Generator, *,
                 basis: torch.Tensor | None, optimizer: torch.optim.Optimizer | None, audit: AuditHooks | None) -> None:
        spec, train, privacy = run.step, run.train, run.privacy
        method = spec.method
        if audit is not None and method == "nonprivate" and (audit.canaries is not None or audit.observe):
            raise ValueError("the audit's canaries and observer watch a DP step; method='nonprivate' has none")
        if spec.projects and basis is None and data.public is None:
            raise ValueError(f"method {method!r} needs a projection basis or a public set to compute one")
        if train.tensor_scales != "none" and (data.public is None or spec.unit != "record" or
                                                 spec.multiplicity > 1):
            raise ValueError("train.tensor_scales: public scales each record's gradient from the public split: it "
                             "needs the public split at hand (a centralized run; a site does not hold it) and "
                             "record-level DP without augmentation multiplicity")
        if train.optimizer == "public-adam" and data.public is None:
            raise ValueError("train.optimizer: public-adam reads its second moment from the public split at every "
                             "step: it needs the public split at hand (a centralized run; a site does not hold it)")
        self.run, self.data, self.audit, self.generator = run, data, audit, generator
        self.model = model
        self.trainable = apply_train_strategy(model, train)
        self.named = dict(model.named_parameters())
        params = [self.named[name] for name in self.trainable]
        self.loss_fn = make_loss_fn(model, self.trainable)
        if privacy.chunk_memory is not None and method != "nonprivate" and not spec.pad_chunks:
            # once, before the first step, from a blank chunk at the public input size: every step runs this chunk.
            # A site's spec is padded to the chunk it sized itself (its policy's chunk_memory), never resized here.
            choice = chunk_for(model, self.trainable, input_size=data.private.input_size,
                               face_tasks=model.cfg.face_tasks, grouped=spec.grouped,
                               cap=spec.chunk_size, fraction=privacy.chunk_memory)
            run = self.run = dataclasses.replace(run, step=dataclasses.replace(spec, chunk_size=choice.size))
        self.opt = optimizer or make_optimizer(params, train)
        self.public_moment = isinstance(self.opt, PublicAdam)  # its second moment: the public split's gradient
        self.ema = WeightAverage(params, decay=train.ema) if train.ema > 0 else None
        self.device = next(model.parameters()).device
        self.basis = column_major(basis) if basis is not None else None  # the layout project() reads fastest
        self.n = data.units(spec.unit)
        # on a GPU the batches are assembled there; the view draws from the private set's own generator (one stream)
        self.private = data.private.assembled_on(assembly_device(self.device))
        self.psi_images = make_psi_from(privacy, generator) if train.images != "raw" else None
        # psi of each record's canonical crop, as fdp / fpdp's public term: all the rows (psi) or beside each (raw+psi)
        self.crops = self.private.canonical() if train.images != "raw" else None
        if train.images == "psi":
            self.private = self.crops
        self.psi = make_psi_from(privacy, generator) if spec.uses_public else None
        self.canonical = None
        if self.psi is not None:
            source = audit.psi_source if audit is not None else None
            self.canonical = source if source is not None else self.private.canonical()
        # the records the public draw may reach: a site's fixed set (public_records), else all of them
        self.pool = None if data.public_pool is None or self.canonical is None else np.asarray(data.public_pool)
        if self.canonical is not None:
            reach = len(self.pool) if self.pool is not None else len(self.canonical)
            if reach < train.public_batch_size:  # a site's own check refuses this policy earlier
                raise ValueError(f"train.public_batch_size={train.public_batch_size} is larger than the "
                                 f"{reach} records its psi images are drawn from (without replacement)")
        # Public-batch sampling needs no privacy-grade randomness: psi(x) is public by assumption.
        self.pub_rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        self.watched = audit is not None and audit.observe is not None
        self.batch_sizes: list[int] = []
        self.zeroed = self.public_zeroed = 0
        self.seconds_basis = 0.0
        self.narrowest = None if self.basis is None else self.basis.shape[1]  # V's fewest columns (compute_basis)
        self.scales: dict[str, float | torch.Tensor] | None = None  # train.tensor_scales, refreshed with V
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

        The count never depends on how many records the site holds: the step's memory and time do not (P13). Each
        step draws afresh, so over many steps the draws reach every record they may draw from (P17): all of the
        site's (the server can then count them), or the site's fixed set (``LocalData.public_pool``).
        """
        if self.psi is None or self.canonical is None:
            return None
        reach = len(self.pool) if self.pool is not None else len(self.canonical)
        pub_idx = self.pub_rng.choice(reach, size=self.run.train.public_batch_size, replace=False)
        if self.pool is not None:
            pub_idx = self.pool[pub_idx]
        return psi_on(self.psi, self.canonical.batch(pub_idx.tolist()), self.device)

    def gradient(self, step: int, batch: dict[str, torch.Tensor], groups: torch.Tensor | None,
                 psi_batch: PsiBatch | None) -> tuple[dict[str, torch.Tensor], dict]:
        """Phase 3: V from public data when due (P2), then the step's update direction (``dp_gradient``)."""
        spec, privacy = self.run.step, self.run.privacy
        scaled = self.run.train.tensor_scales != "none"
        per_coordinate = self.run.train.tensor_scales == "coordinate"
        if (spec.projects or scaled) and self.data.public is not None and step % privacy.basis_every == 0:
            started = time.perf_counter()
            public = (self.model, self.loss_fn, self.trainable, self.data.public, privacy, self.device)
            try:
                if spec.projects and scaled:  # one pass: the scales, and V of the scaled public gradients
                    self.basis, self.scales = public_scaled_basis_at(*public, per_coordinate=per_coordinate)
                elif spec.projects:
                    self.basis = public_basis_at(*public)
                else:
                    self.scales = public_scales_at(*public, per_coordinate=per_coordinate)
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

    def public_adam_gradient(self) -> list[torch.Tensor]:
        """public-adam's second-moment input: the mean gradient of public_batch_size records of the public split at
        the current weights (the weights the step's gradient was taken at), in the optimizer's order (P2)."""
        public = self.data.public
        idx = self.pub_rng.choice(len(public), size=min(self.run.train.public_batch_size, len(public)), replace=False)
        current = {name: self.named[name].detach() for name in self.trainable}
        grads = mean_grad(self.loss_fn, current, to_device(public.batch(idx.tolist()), self.device))
        return [grads[name] for name in self.trainable]

    def update(self, step: int, grads: dict[str, torch.Tensor]) -> None:
        """Phase 4: one optimizer step at the schedule's learning rate, then the iterate average."""
        train = self.run.train
        offset, total = self.run.span
        if self.public_moment:
            self.opt.observe_public(self.public_adam_gradient())
        for name in self.trainable:
            self.named[name].grad = grads[name].to(self.named[name].dtype)
        for group in self.opt.param_groups:
            group["lr"] = train.lr * lr_factor(train.schedule, offset + step, total)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()


def local_train(
    model: PoseNet,
    data: LocalData,
    run: LocalRun,
    *,
    generator: torch.Generator,
    basis: torch.Tensor | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    audit: AuditHooks | None = None,
    bar: str | None = "train",
) -> LocalResult:
    """Run ``run.steps`` optimizer steps of ``run.step`` on ``data``; the model is updated in place.

    Per step (docs/explanation/design.md, the FP-DP step; ``StepPhases``):
      sample:       private batch ~ Poisson(q) from raw images, q = the spec's sample rate  (P4)
      public batch: psi(x) of a site batch for fdp / fpdp                                  (P3)
      DP gradient:  g = (sum_i clip(g_i, C) + N(0, sigma^2 C^2 I)) / B                     (P1, P15)
                    g = V (V^T g) for proj / fpdp, V from public data only                (P2)
                    + g_pub = mean grad on psi(x)
      update:       the optimizer at the schedule's learning rate, then the iterate average
    V is either given (``basis``: federated, the server's or the site's) or, with ``data.public``, recomputed
    every ``privacy.basis_every`` steps from ``privacy.m`` public samples at the current weights.

    psi sees the canonical crop of each record (no augmentation), so the public gradient depends on x only
    through psi(x) of the record and its labels (P3), and psi's strength is exactly the stated one; the
    private batch alone is augmented.

    ``audit`` (``fedpose audit`` only, see ``AuditHooks``) adds gradient canaries to the private steps and
    lets the auditor see every released gradient and the V it was projected with; production callers leave
    it None. ``bar``: the progress bar's label (None: no bar). ``train.strategy: lora``: adapters are put on the
    model before the first step and folded into its weights after the last (``fedpose.shared.model.lora``).
    """
    keep_freed_memory()  # every step frees and takes again the same tens of MB: keep them in the process
    lora = run.train.strategy == "lora"
    if lora:  # adapters live for this call only: the model comes back a plain PoseNet, U D folded into W
        if basis is not None or optimizer is not None:
            raise ValueError("train.strategy lora runs centralized only: its adapters are made and merged inside "
                             "one run, so no basis or optimizer state from another run can match them")
        add_adapters(model, run.train.lora_rank, generator)
    try:
        phases = StepPhases(model, data, run, generator, basis=basis, optimizer=optimizer, audit=audit)
        run = phases.run  # its step at the chunk chosen for it (privacy.chunk_memory)
        model.train()
        started = time.perf_counter()
        steps = tqdm(range(run.steps), desc=bar or "", disable=bar is None, leave=False, dynamic_ncols=True)
        for step in steps:
            batch, groups = phases.sample()
            psi_batch = phases.public_batch()
            grads, info = phases.gradient(step, batch, groups, psi_batch)
            phases.update(step, grads)
            if bar is not None and run.step.method != "nonprivate":
                steps.set_postfix(B=phases.batch_sizes[-1], norm=f"{float(info['mean_norm']):.3f}")
        if phases.ema is not None:
            phases.ema.copy_to()  # the run releases the average of its iterates (post-processing)
    finally:
        if lora:
            merge_adapters(model)
    spec = run.step
    return LocalResult(
        method=spec.method,
        sigma=spec.sigma,
        sample_rate=spec.sample_rate,
        steps=run.steps,
        clip_norm=spec.clip_norm,
        n=phases.n,
        mean_batch=float(np.mean(phases.batch_sizes)),
        seconds=time.perf_counter() - started,
        seconds_basis=phases.seconds_basis,
        unit=spec.unit,
        zeroed=phases.zeroed,
        public_zeroed=phases.public_zeroed,
        narrowest_basis=phases.narrowest,
        chunk_size=spec.chunk_size,
    )

