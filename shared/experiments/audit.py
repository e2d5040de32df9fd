"""``fedpose audit``: an empirical lower bound on epsilon from ONE run of the real training loop.

Steinke, Nasr, Jagielski, "Privacy auditing with one (1) training run"
(NeurIPS 2023). m canaries are each included independently with probability
1/2, one private run of ``fedpose.shared.training.loop.local_train`` (the loop ``fedpose
train`` and every site use) trains with them, the auditor scores each canary,
guesses the top ones IN and the bottom ones OUT, and the number of correct
guesses gives eps_LB (``fedpose.shared.privacy.audit.bound``). A sound mechanism gives
eps_LB <= the accountant's epsilon except with probability 5%.

Two kinds of canaries:
- ``gradient`` (white-box): Dirac gradient canaries C e_j, each on a coordinate
  of its own (``fedpose.shared.privacy.audit.canaries``), Poisson-sampled, clipped and noised
  with the records. The auditor sees every released update direction (the
  noisy, projected-if-any private gradient plus g_pub) and scores canary c by
  the sum over steps of its coordinate j_c. Releasing every step's noisy
  gradient is what the accountant's composition covers, so this is the
  strongest observer the claim allows.
- ``input`` (black-box): mislabelled images (held-out people with their pose
  turned upside down) added to the private records; the auditor sees only the
  final model and scores a canary by how much training lowered its loss.

For proj / fpdp the projection is post-processing of the noisy gradient, so the
bound must still hold; a Dirac coordinate mostly outside span(V) is then
largely projected away and that audit has no power. Those methods therefore
default to in-span gradient canaries +-C V_t u_j (``placement='span'``), built
inside ``dp_gradient`` on the V_t each step projects with and scored on the
private release in V_t's coordinates (``span_scores``). For
fdp / fpdp the claim is Feature-DP: psi(x) and the labels are public, so
canaries differ only in x with psi(x) and the labels fixed: gradient canaries
enter the private branch only, and input canaries are in the psi source in
both worlds (IN and OUT).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpose.shared.configuration.schema import Config
from fedpose.shared.data.dataset import PoseDataset
from fedpose.shared.data.patients import PatientGroups
from fedpose.shared.data.records import PoseRecord
from fedpose.shared.data.split import check_disjoint
from fedpose.shared.model.posenet import PoseNet
from fedpose.shared.privacy.accounting.accountant import (
    StepRecord,
    calibrate_sigma,
    check_delta,
    epsilon_spent,
)
from fedpose.shared.privacy.audit.bound import best_lower_bound
from fedpose.shared.privacy.audit.canaries import DiracCanaries, SpanCanaries
from fedpose.shared.privacy.step.noise import make_generator
from fedpose.shared.privacy.step.psi import psi_label_of
from fedpose.shared.privacy.step.subspace import flat_vector
from fedpose.shared.training.runs import (
    check_batch_size,
    ensure_data,
    initial_model,
    load_records,
    private_records,
    training_records,
)
from fedpose.shared.training.batches import make_dataset, to_device
from fedpose.shared.privacy.audit.hooks import AuditHooks, ReleasedStep
from fedpose.shared.training.schedule import steps_per_epoch
from fedpose.shared.training.loop import LocalData, LocalRun, local_train, select_device, step_spec
from fedpose.shared.configuration.yaml_io import write_json
from fedpose.shared.configuration.methods import PRIVATE, PROJECTED, RECORD_LEVEL, WITH_PUBLIC

log = logging.getLogger(__name__)

MODES = ("gradient", "input")
PLACEMENTS = ("dirac", "span")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditSpec:
    """What one audit run does; validated here, at the boundary.

    canaries: m. noise_scale: the noise actually added is noise_scale x the
    calibrated sigma; 1 is the real mechanism, anything smaller is the positive
    control (a deliberately wrong sigma: the claim is then false and the audit
    must catch it). seed: canary choice, inclusion and training noise (None:
    OS entropy). placement (gradient mode): ``dirac`` (C e_j) or ``span``
    (+-C V_t u_j inside the projection's span, proj / fpdp only); None picks
    span for proj / fpdp, where the projection removes a Dirac canary, and
    dirac otherwise. span_skip: leading columns of V the in-span canaries avoid
    (``SpanCanaries.random``).
    """

    method: str
    epsilon: float
    canaries: int
    mode: str = "gradient"
    confidence: float = 0.95
    noise_scale: float = 1.0
    seed: int | None = None
    placement: str | None = None
    span_skip: int = 1

    def __post_init__(self) -> None:
        if self.method not in PRIVATE:
            raise ValueError(f"method={self.method!r} cannot be audited; choose one of {PRIVATE} "
                             "(nonprivate claims nothing)")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {MODES}")
        if isinstance(self.canaries, bool) or not isinstance(self.canaries, int) or self.canaries < 2:
            raise ValueError(f"canaries={self.canaries!r} must be an int >= 2")
        if not (isinstance(self.epsilon, (int, float)) and self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon={self.epsilon!r} must be a positive finite number")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence={self.confidence!r} must be in (0, 1)")
        if not (0 < self.noise_scale <= 1 and math.isfinite(self.noise_scale)):
            raise ValueError(f"noise_scale={self.noise_scale!r} must be in (0, 1] (1 = the real mechanism)")
        if self.mode == "input":
            if self.placement is not None:
                raise ValueError("placement applies to gradient canaries; input canaries are images")
            return
        if self.placement is None:  # resolved here, once, and reported in every result
            object.__setattr__(self, "placement", "span" if self.method in PROJECTED else "dirac")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is unknown; choose one of {PLACEMENTS}")
        if self.placement == "span" and self.method not in PROJECTED:
            raise ValueError(f"placement='span' puts canaries inside span(V); method={self.method!r} has no V "
                             "(use 'dirac')")
        if isinstance(self.span_skip, bool) or not isinstance(self.span_skip, int) or self.span_skip < 0:
            raise ValueError(f"span_skip={self.span_skip!r} must be an int >= 0")


def mislabel(record: PoseRecord) -> PoseRecord:
    """The record with its pose turned upside down about the person-box centre (a wrong, in-box label)."""
    joints = np.where(record.visible[:, None], 2.0 * record.center[None, :] - record.joints, 0.0)
    return dataclasses.replace(record, joints=joints.astype(np.float32))


@torch.no_grad()
def canary_losses(model: torch.nn.Module, dataset: PoseDataset, device: torch.device,
                  batch_size: int = 64) -> np.ndarray:
    """Per-record training loss (m,) of the model on the (un-augmented) canaries."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(dataset), batch_size):
        idx = list(range(start, min(start + batch_size, len(dataset))))
        out.append(model.losses(to_device(dataset.batch(idx), device)).double().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out)


def audit_note(method: str, mode: str, psi: str | None, placement: str | None = None, *,
               unit: str = "record") -> str:
    """What the printed bound is about, per method and privacy unit (P8 wording)."""
    parts = []
    if method in RECORD_LEVEL and unit == "patient":
        parts.append("the claim audited is patient-level DP (add/remove one patient and all of their records): "
                     "each canary is one canary patient, its clipped mean gradient one C-vector, sampled at q_p")
    elif method in RECORD_LEVEL:
        parts.append("the claim audited is record-level DP (add/remove one record): each canary is one record")
    elif unit == "patient":
        parts.append(f"the claim audited is patient-level Feature-DP relative to psi = {psi}: each canary is one "
                     "canary patient, differing in x with psi(x) and the labels fixed")
    else:
        parts.append(f"the claim audited is Feature-DP relative to psi = {psi}: canaries differ in x with psi(x) "
                     "and the labels fixed (psi(x) and the labels are public by assumption), not record-level DP")
    if method in PROJECTED:
        if mode == "gradient" and placement == "dirac":
            parts.append("the projection onto span(V) is post-processing, so the bound must still hold; a Dirac "
                         "canary coordinate mostly outside span(V) is largely projected away, so this audit is weak "
                         "for this method (a low eps_LB does not show a tight claim)")
        elif mode == "gradient":
            parts.append("the projection onto span(V) is post-processing, so the bound must still hold; in-span "
                         "canaries +-C V_t u_j follow the basis V_t of every step, so the projection keeps all of "
                         "each (V_t is public, so choosing a canary's gradient from it is covered by adaptive "
                         "composition)")
        else:
            parts.append("the projection onto span(V) is post-processing, so the bound must still hold")
    return "; ".join(parts)


def span_scores(released: np.ndarray, directions: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Score of in-span canary j: sum_t signs[t, j] <y_t, u_j>, y_t (steps, k) the releases in V_t coordinates.

    With y_t = V_t^T g_t B / C (B the public normaliser), a drawn canary adds signs[t, j] u_j to y_t, so
    an included canary scores about its number of draws; everything else in y_t
    (other canaries, the records' gradient inside span(V), the noise) enters with
    a random sign and only adds variance. (Weighting the columns of y by their
    inverse power was tried and was no better on the test ward.)
    """
    per_step = released @ directions.T  # (steps, m) = <y_t, u_j>
    return np.sum(signs * per_step, axis=0)  # (m,)


@dataclasses.dataclass(frozen=True)
class AuditPlan:
    """The audited run as it is fixed before any canary is drawn: its data, privacy units, steps and sigmas."""

    device: torch.device
    root: Path
    private: list[PoseRecord]  # patient level: the records within the cap
    public: list[PoseRecord]
    patients: PatientGroups | None
    n: int  # privacy units: records, or patients at patient level
    q: float
    steps: int
    sigma_claimed: float  # calibrated to the claimed epsilon
    sigma_ran: float  # noise_scale x sigma_claimed: what the run adds


@dataclasses.dataclass(frozen=True)
class AuditStart:
    """The run's draws and objects, made in this order (the canaries' inclusion first, then the training noise's
    generator, the model and the datasets), so that one seed gives one audit."""

    rng: np.random.Generator  # the canaries' draws: their inclusion here, their coordinates or records later
    included: np.ndarray  # (m,) bool: each canary IN with probability 1/2
    generator: torch.Generator
    seeded: bool
    model: PoseNet
    dataset: PoseDataset  # the private records as training augments them
    public_eval: PoseDataset
    psi: str | None
    bar: str | None  # the progress bar's label (None: no bar)


@dataclasses.dataclass(frozen=True)
class CanaryScores:
    """What the trained run tells about each canary."""

    scores: np.ndarray  # (m,)
    trained_coordinates: int | None = None  # gradient mode: the coordinates Dirac canaries are drawn from
    released_coords: np.ndarray | None = None  # span placement: (steps, k) the releases in V_t's coordinates


@dataclasses.dataclass(frozen=True)
class AuditBound:
    """eps_LB from the scores, next to the epsilon claimed and the epsilon of what ran."""

    bound: dict[str, float | int]
    eps_claimed: float
    eps_ran: float


def _prepare(cfg: Config, spec: AuditSpec, *, progress: bool) -> AuditPlan:
    """Phase 1: the private and public records, the privacy units, the steps and the sigma the claim calibrates."""
    device = select_device(cfg.train.device)
    root = ensure_data(cfg, progress=progress)
    private = private_records(root, cfg)
    public = load_records(root, cfg.data.public_split)
    check_disjoint(public, private)
    unit = cfg.privacy.unit
    if unit == "patient" and spec.mode != "gradient":
        raise ValueError("input-space canaries at patient level (a held-out canary patient with several images) "
                         "are not built yet: audit a patient-level run with --mode gradient")
    private, patients = training_records(private, cfg)  # patient level: records within the cap, their groups
    n = patients.count if patients is not None else len(private)  # privacy units
    check_batch_size(cfg.train.batch_size, n, unit)
    check_delta(cfg.privacy.delta, n)
    q = min(1.0, cfg.train.batch_size / n)
    steps = cfg.train.epochs * steps_per_epoch(n, cfg.train.batch_size)
    sigma_claimed = calibrate_sigma(target_epsilon=spec.epsilon, delta=cfg.privacy.delta, sample_rate=q, steps=steps,
                                    accountant=cfg.privacy.accountant)
    return AuditPlan(device=device, root=root, private=private, public=public, patients=patients, n=n, q=q,
                     steps=steps, sigma_claimed=sigma_claimed, sigma_ran=sigma_claimed * spec.noise_scale)


def _start(cfg: Config, spec: AuditSpec, plan: AuditPlan, *, progress: bool) -> AuditStart:
    """Phase 2: which canaries are IN, the training noise's generator, the starting model and the datasets."""
    rng = np.random.default_rng(spec.seed)
    included = rng.random(spec.canaries) < 0.5  # (m,) each canary IN with probability 1/2
    generator, seeded = make_generator(None if spec.seed is None else spec.seed + 1, "cpu")
    model = initial_model(cfg, progress=progress).to(plan.device)
    if spec.seed is not None:
        torch.manual_seed(spec.seed)
    dataset = make_dataset(plan.private, cfg, train=True, seed=spec.seed)
    public_eval = make_dataset(plan.public, cfg, train=False)
    psi = psi_label_of(cfg.privacy) if spec.method in WITH_PUBLIC else None
    desc = f"audit {spec.method} ({spec.mode} canaries)"
    return AuditStart(rng=rng, included=included, generator=generator, seeded=seeded, model=model, dataset=dataset,
                      public_eval=public_eval, psi=psi, bar=desc if progress else None)


def _trained_coordinates(model: PoseNet, cfg: Config) -> int:
    """p, the coordinates the run trains (what gradient canaries index; ``apply_strategy`` is applied to ``model``,
    or under lora to a copy with the adapters ``local_train`` will put on)."""
    from fedpose.shared.model.strategy import apply_train_strategy

    probe = model
    if cfg.train.strategy == "lora":  # local_train puts the adapters on: count the coordinates it will train
        from fedpose.shared.model.lora import add_adapters

        probe = copy.deepcopy(model)
        add_adapters(probe, cfg.train.lora_rank, torch.Generator())
    trainable = apply_train_strategy(probe, cfg.train)
    named = dict(probe.named_parameters())
    return sum(named[name].numel() for name in trainable)


def _dirac_canaries(cfg: Config, spec: AuditSpec, start: AuditStart, p: int,
                    device: torch.device) -> tuple[DiracCanaries, Callable[[ReleasedStep], None], np.ndarray]:
    """Dirac canaries C e_j on distinct trained coordinates, the observer that scores them, and their scores
    (filled in place as the run releases its steps: canary c scores the sum of its coordinate's releases)."""
    if spec.canaries > p:
        raise ValueError(f"{spec.canaries} Dirac canaries need as many distinct coordinates; the model "
                         f"trains {p}")
    coords = torch.from_numpy(np.sort(start.rng.choice(p, size=spec.canaries, replace=False))).to(torch.int64)
    canaries = DiracCanaries(coords=coords, included=torch.from_numpy(start.included), value=cfg.privacy.clip_norm)
    scores = np.zeros(spec.canaries)

    def observe(seen: ReleasedStep) -> None:
        # flat_vector is in sorted-name order over exactly the trainable tensors: canary coordinates index it
        scores[:] += flat_vector(seen.update)[coords.to(device)].double().cpu().numpy()

    return canaries, observe, scores


def _span_canaries(cfg: Config, spec: AuditSpec, start: AuditStart,
                   steps: int) -> tuple[SpanCanaries, Callable[[ReleasedStep], None], list[np.ndarray]]:
    """In-span canaries +-C V_t u_j, the observer, and the releases in V_t's coordinates it collects (one per
    step, scored after the run by ``span_scores``)."""
    if spec.span_skip >= cfg.privacy.k:
        raise ValueError(f"span_skip={spec.span_skip} leaves none of the k={cfg.privacy.k} columns of V")
    canaries = SpanCanaries.random(m=spec.canaries, k=cfg.privacy.k, steps=steps,
                                   included=torch.from_numpy(start.included), value=cfg.privacy.clip_norm,
                                   seed=int(start.rng.integers(2**62)), skip=spec.span_skip)
    # y_t = V_t^T g_t * B / C: the release in V_t's coordinates, one drawn canary = +-u_j (B: the public
    # normaliser the mechanism divides by, train.batch_size)
    coords_seen: list[np.ndarray] = []

    def observe(seen: ReleasedStep) -> None:
        flat = flat_vector(seen.private).to(torch.float64)
        y = seen.basis.to(torch.float64).T @ flat * (cfg.train.batch_size / cfg.privacy.clip_norm)  # (k,)
        coords_seen.append(y.cpu().numpy())

    return canaries, observe, coords_seen


def _gradient_audit(cfg: Config, spec: AuditSpec, plan: AuditPlan, start: AuditStart) -> CanaryScores:
    """Phase 3, white-box: gradient canaries drawn into the private steps, scored on every released step."""
    p = _trained_coordinates(start.model, cfg)
    if spec.placement == "dirac":
        canaries, observe, dirac_scores = _dirac_canaries(cfg, spec, start, p, plan.device)
        hooks = AuditHooks(canaries=canaries, observe=observe)
    else:
        span, observe, coords_seen = _span_canaries(cfg, spec, start, plan.steps)
        hooks = AuditHooks(canaries=span, observe=observe)
    # At patient level each canary stands for a canary patient whose clipped mean gradient is the canary's
    # C-vector: drawn at q_p with the patients and added to their per-patient sum before the noise.
    data = LocalData(start.dataset, patients=plan.patients, public=start.public_eval)
    run = LocalRun(step_spec(spec.method, cfg.train, cfg.privacy, sigma=plan.sigma_ran, data=data), plan.steps,
                   cfg.train, cfg.privacy)
    local_train(start.model, data, run, generator=start.generator, audit=hooks, bar=start.bar)
    # The released gradient divides by B: a canary drawn k times contributes k C / B to its coordinate.
    if spec.placement == "dirac":
        return CanaryScores(dirac_scores, trained_coordinates=p)
    released_coords = np.stack(coords_seen)  # (steps, k)
    scores = span_scores(released_coords, span.directions.numpy(), span.signs.numpy())
    return CanaryScores(scores, trained_coordinates=p, released_coords=released_coords)


def _input_audit(cfg: Config, spec: AuditSpec, plan: AuditPlan, start: AuditStart) -> CanaryScores:
    """Phase 3, black-box: mislabelled held-out images, IN ones added to the private records, scored by how much
    training lowered their loss."""
    held_out = load_records(plan.root, cfg.data.val_split)
    if spec.canaries > len(held_out):
        raise ValueError(f"{spec.canaries} input canaries need as many held-out records; split "
                         f"{cfg.data.val_split!r} has {len(held_out)}")
    picked = start.rng.choice(len(held_out), size=spec.canaries, replace=False)
    canary_records = [mislabel(held_out[int(i)]) for i in picked]
    canary_set = PoseDataset(canary_records, input_size=cfg.data.input_size, augment=None)
    before = canary_losses(start.model, canary_set, plan.device)
    members = [r for r, keep in zip(canary_records, start.included) if keep]
    train_set = make_dataset(plan.private + members, cfg, train=True, seed=spec.seed)
    psi_source = None
    if spec.method in WITH_PUBLIC:  # psi(x) and labels of every canary, IN or OUT, are public
        psi_source = PoseDataset(plan.private + canary_records, input_size=cfg.data.input_size, augment=None)
    hooks = AuditHooks(psi_source=psi_source)
    # The mechanism as it runs: Poisson rate q over the records the run was planned for, the noisy sum
    # divided by the public constant B = train.batch_size whatever the canaries included (P15).
    data = LocalData(train_set, public=start.public_eval)
    step = step_spec(spec.method, cfg.train, cfg.privacy, sigma=plan.sigma_ran, data=data, sample_rate=plan.q,
                     expected_batch=float(cfg.train.batch_size))
    local_train(start.model, data, LocalRun(step, plan.steps, cfg.train, cfg.privacy), generator=start.generator,
                audit=hooks, bar=start.bar)
    return CanaryScores(before - canary_losses(start.model, canary_set, plan.device))  # the loss each lost


def _bound(cfg: Config, spec: AuditSpec, plan: AuditPlan, scored: CanaryScores, included: np.ndarray) -> AuditBound:
    """Phase 4: eps_LB from the scores, and the accountant's epsilon for the sigma claimed and the sigma run."""
    delta, accountant = cfg.privacy.delta, cfg.privacy.accountant
    bound = best_lower_bound(scored.scores, included, delta=delta, confidence=spec.confidence)
    eps_claimed = epsilon_spent([StepRecord(plan.sigma_claimed, plan.q, plan.steps)], delta=delta,
                                accountant=accountant)
    eps_ran = epsilon_spent([StepRecord(plan.sigma_ran, plan.q, plan.steps)], delta=delta, accountant=accountant)
    return AuditBound(bound=bound, eps_claimed=eps_claimed, eps_ran=eps_ran)


def _report(cfg: Config, spec: AuditSpec, plan: AuditPlan, start: AuditStart, scored: CanaryScores,
            bound: AuditBound, *, seconds: float) -> dict[str, Any]:
    """Phase 5: the result audit.json holds (and ``fedpose audit`` prints)."""
    unit, n, included, eps_claimed = cfg.privacy.unit, plan.n, start.included, bound.eps_claimed
    result: dict[str, Any] = {
        "method": spec.method,
        "mode": spec.mode,
        "placement": spec.placement,
        "canaries": spec.canaries,
        "included": int(included.sum()),
        "unit": unit,
        "n": n,  # privacy units: records, or patients at patient level
        "records": len(plan.private),
        **({"patients": n} if unit == "patient" else {}),
        "steps": plan.steps,
        "sample_rate": plan.q,
        "clip": cfg.privacy.clip_norm,
        "delta": cfg.privacy.delta,
        "accountant": cfg.privacy.accountant,
        "target_epsilon": spec.epsilon,
        "sigma_claimed": plan.sigma_claimed,
        "epsilon_claimed": eps_claimed,
        "noise_scale": spec.noise_scale,
        "sigma_ran": plan.sigma_ran,
        "epsilon_ran": bound.eps_ran,
        "psi": start.psi,
        # where Dirac canaries are drawn
        **({"trained_coordinates": scored.trained_coordinates} if spec.mode == "gradient" else {}),
        **bound.bound,
        "sound": bool(bound.bound["epsilon_lb"] <= eps_claimed),
        "note": audit_note(spec.method, spec.mode, start.psi, spec.placement, unit=unit),
        "seeded": start.seeded,
        "seconds": seconds,
        "scores": [float(s) for s in scored.scores],
        "membership": [bool(b) for b in included],
    }
    if scored.released_coords is not None:
        result["span_skip"] = spec.span_skip
        result["released_coords"] = scored.released_coords.tolist()
    if spec.noise_scale != 1.0:
        result["note"] += (f"; POSITIVE CONTROL: the run added noise {spec.noise_scale:g} x the calibrated sigma, "
                           f"so the claimed eps={eps_claimed:.4g} is false (the accountant gives "
                           f"eps={bound.eps_ran:.4g} for what ran) and eps_LB should exceed the claim")
    return result


def run_audit(cfg: Config, spec: AuditSpec, out: str | Path | None = None, *, progress: bool = True) -> dict[str, Any]:
    """One training run with canaries, scored and bounded; writes audit.json and audit.png under ``out``.

    Phases: prepare (the records and the sigma claimed), start (the draws, the model, the datasets), the
    canaries with their training and scores (gradient or input mode), the bound, the report.
    """
    t0 = time.perf_counter()
    plan = _prepare(cfg, spec, progress=progress)
    start = _start(cfg, spec, plan, progress=progress)
    if spec.mode == "gradient":
        scored = _gradient_audit(cfg, spec, plan, start)
    else:
        scored = _input_audit(cfg, spec, plan, start)
    bound = _bound(cfg, spec, plan, scored, start.included)
    result = _report(cfg, spec, plan, start, scored, bound, seconds=round(time.perf_counter() - t0, 2))
    if out is not None:
        out = Path(out)
        write_json(out / "audit.json", result)
        plot_audit(result, out / "audit.png")
    return result


def plot_audit(result: dict[str, Any], path: str | Path) -> None:
    """Histogram of canary scores, IN vs OUT, with eps_LB next to the claim in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = np.asarray(result["scores"])
    member = np.asarray(result["membership"], dtype=bool)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bins = np.histogram_bin_edges(scores, bins=40)
    ax.hist(scores[~member], bins=bins, alpha=0.6, label=f"OUT ({int((~member).sum())})")
    ax.hist(scores[member], bins=bins, alpha=0.6, label=f"IN ({int(member.sum())})")
    ax.set_xlabel("canary score" + (" (sum of its released gradient coordinate)" if result["mode"] == "gradient"
                                    else " (loss decrease)"))
    ax.set_ylabel("canaries")
    ax.set_title(f"{result['method']} ({result['mode']}): eps_LB = {result['epsilon_lb']:.3g} vs claimed "
                 f"eps = {result['epsilon_claimed']:.3g}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)



def audit_summary(result: dict[str, Any], out: str | Path | None = None) -> list[str]:
    """The lines ``fedpose audit`` prints of ``run_audit``'s result: the claim next to eps_LB, and what it wrote."""
    placed = f" ({result['placement']} placement)" if result["placement"] else ""
    lines = [f"audit of {result['method']} with {result['canaries']} {result['mode']} canaries{placed} "
             f"({result['included']} included), one run of {result['steps']} steps, {result['unit']} level, "
             f"q = {result['sample_rate']:.4f}, "
             f"sigma = {result['sigma_ran']:.4f}, C = {result['clip']}, delta = {result['delta']:g}",
             f"  claimed eps  = {result['epsilon_claimed']:.4f}  ({result['accountant'].upper()} accountant, "
             f"sigma {result['sigma_claimed']:.4f})"]
    if result["noise_scale"] != 1.0:
        lines.append(f"  ran eps      = {result['epsilon_ran']:.4g}  (accountant on the sigma that actually ran)")
    lines.append(f"  eps_LB       = {result['epsilon_lb']:.4f}  at {result['confidence']:.0%} confidence "
                 f"({result['v']} of {result['r']} guesses correct, best of {result['tests']} guess counts, "
                 "Bonferroni)")
    lines.append(f"  {'sound: eps_LB <= claimed eps' if result['sound'] else 'VIOLATION: eps_LB > claimed eps'}")
    lines.append(f"note: {result['note']}")
    if out:
        lines.append(f"wrote {Path(out) / 'audit.json'} and {Path(out) / 'audit.png'} ({result['seconds']:.0f} s)")
    return lines
