"""One local-training loop, used by centralized runs (``fedpose train``) and by sites.

``local_train`` runs a ready ``LocalRun`` (the DP step's spec, how many steps, where they sit in the run) on a
``LocalData`` (the private records, their patients, the public set V is computed from): the FP-DP step of
docs/explanation/design.md (Algorithm 1 of the paper) or one of its four comparison methods, in the four phases
of ``fedpose.shared.training.local_step``. It reports what actually ran (sigma, q, steps) so that the caller's
accountant, not the plan, produces every epsilon.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from fedpose.shared.training.allocator import keep_freed_memory
from fedpose.shared.configuration.schema import PrivacyConfig, TrainConfig
from fedpose.shared.configuration.methods import Method, raw_psi_conflict
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.patients import PatientGroups
from fedpose.shared.model.lora import add_adapters, merge_adapters
from fedpose.shared.training.local_step import StepPhases
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.privacy.audit.hooks import AuditHooks
from fedpose.shared.privacy.step.spec import DPSpec


@dataclass(frozen=True)
class LocalData:
    """What one ``local_train`` call trains on.

    private: the site's (or the pooled) private records. patients: at ``privacy.unit: patient``, the records
    of ``private`` grouped by patient (``fedpose.shared.data.patients.group_by_patient``, which has already left
    out records beyond the cap); each step then samples patients and clips each one's mean gradient. public:
    the public set V is recomputed from every ``privacy.basis_every`` steps (proj / fpdp without a given V).
    """

    private: PoseDataset
    patients: PatientGroups | None = None
    public: PoseDataset | None = None

    def __post_init__(self) -> None:
        if len(self.private) == 0:
            raise ValueError("the private dataset is empty: a site needs at least one record to train")
        if self.patients is not None and sorted(i for m in self.patients.members for i in m) != list(
                range(len(self.private))):
            raise ValueError(f"the patient groups cover {sum(self.patients.sizes)} records, not the "
                             f"{len(self.private)} records of the dataset (build both from group_by_patient's kept "
                             "records)")

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
    request or the realised batch); default ``privacy.chunk_size``.
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
        unit=unit,
        # raw+psi: a record's image and psi of its crop are two rows of one group, clipped as one mean
        multiplicity=(2 if train.images == "raw+psi" else privacy.augment_multiplicity) if private else 1,
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

    Per step (docs/explanation/design.md, the FP-DP step; ``fedpose.shared.training.local_step``):
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
    )

