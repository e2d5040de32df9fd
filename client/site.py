"""What a hospital site does with a server request (DESIGN.md sections 2 and 4b; P6, P10, P11, P12).

The server is not trusted. ``handle_train`` checks a train request against
the site's own policy before the ledger is opened, and refuses (``Refusal``,
nothing trained, ledger unchanged) anything weaker than the policy pins:

- a method the policy does not allow; another privacy unit (record or
  patient, issue #11); a sample rate other than the policy's;
  more local steps than ``steps_per_round``; another clip norm; for fdp/fpdp
  another psi kind or a weaker psi; another augmentation setting;
- sigma below the site's own minimum (``client.policy.sigma_shortfall``);
- weights or a basis V that are malformed, non-finite or of the wrong shape;
- then, inside the ledger transaction: a (federation, round) already spent,
  more rounds than ``rounds_per_federation`` or ``lifetime_rounds``, or a
  round that would push its accountant's epsilon over its budget.

What the site checks about itself (its public set matches the digest its
operator approved, public and private images are disjoint, no private image
appears twice, delta < 1/n) runs locally, once per policy and data version
(``site_check``), never as an answer to a server field: no reply depends on
private data except through the DP-noised weights (P10). Then it trains with
``shared.train.local_train``, records what actually ran in its ledger in the
same transaction, and only then returns the reply: spend is on disk before
anything leaves the site.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client.ledger import Mechanism, SiteLedger
from client.policy import (
    SitePolicy,
    load_policy,
    min_sigma_for,
    policy_from_dict,
    psi_strength,
    sigma_shortfall,
    write_policy,
)
from shared.config import Config
from shared.data.mpii import load_split
from shared.data.patients import PatientGroups, group_by_patient, stated_group_size
from shared.data.records import PoseRecord
from shared.data.split import check_disjoint, check_no_duplicates
from shared.data.split import manifest_digest as public_digest
from shared.federation_messages import (
    ARRAYS,
    BASIS,
    CONFIG,
    METRICS,
    Refusal,
    RefusalCode,
    SiteInfo,
    TrainRequest,
    record_basis,
    record_tensors,
    weights_record,
)
from shared.privacy.accountant import StepRecord, check_delta
from shared.privacy.psi import psi_label
from shared.privacy.subspace import check_orthonormal

log = logging.getLogger(__name__)

PROJECTED = ("proj", "fpdp")
WITH_PSI = ("fdp", "fpdp")
_FEDERATION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


# ---------------------------------------------------------------------------
# policy resolution (deployment: node config; simulation: partition id)
# ---------------------------------------------------------------------------


def resolve_policy(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> SitePolicy:
    """The site's policy.

    Deployment: ``--node-config "site-policy='/etc/fedpose/policy.yaml'"``: the
    policy names the data, the ledger and the public set; nothing the server
    sends can change them. Simulation: the virtual node with ``partition-id``
    i is site ``data.train_splits[i]``; its policy is
    ``<out>/sites/<split>/policy.yaml`` (written by ``fedpose simulate``, or
    created here from the config when absent).
    """
    if "site-policy" in node_config:
        if "data-path" in node_config:
            raise ValueError("node config: data-path is no longer read; the site policy's data_path names the data")
        return load_policy(str(node_config["site-policy"]))
    if "partition-id" in node_config:
        from shared.run_config import config_from_run_config, out_dir

        cfg = config_from_run_config(run_config)
        return simulation_policy(cfg, out_dir(run_config, cfg), int(node_config["partition-id"]))
    raise ValueError(
        "this SuperNode has no site policy: start it with --node-config \"site-policy='/path/policy.yaml'\""
    )


def default_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    """Simulation default for site ``index``: the config's mechanism and budget pinned, its split, a ledger under ``out``.

    The operator of a site knows its n, so it can state q = B / n in its
    policy; the server never learns n. At patient level (``privacy.unit``)
    n counts patients and q is the patient rate q_p. At record level the
    policy states the most records a patient has in the split (from its
    patient ids) as its cap, unless the config gives one: the claim's group
    bound is stated at it.
    """
    splits = cfg.data.train_splits
    if not 0 <= index < len(splits):
        raise ValueError(f"partition-id {index} has no split: data.train_splits has {len(splits)} ({list(splits)})")
    root = Path(cfg.data.root).expanduser().resolve()
    name = splits[index]
    private = load_split_dir(root / name, "site data")
    cap = cfg.privacy.max_records_per_patient
    if cfg.privacy.unit == "patient":
        n = group_by_patient(private, cap=cap)[1].count
    else:
        n = len(private)
        if cap is None:
            cap, _ = stated_group_size(private, None)
    public = load_split_dir(root / cfg.data.public_split, "public set")
    return policy_from_dict({
        "policy_version": 2,
        "site": name,
        "epsilon": cfg.privacy.epsilon,
        "delta": cfg.privacy.delta,
        "lifetime_rounds": cfg.federation.rounds,
        "rounds_per_federation": cfg.federation.rounds,
        "sample_rate": min(1.0, cfg.train.batch_size / n),
        "steps_per_round": cfg.federation.local_steps,
        "clip_norm": cfg.privacy.clip_norm,
        "psi": cfg.privacy.psi,
        "psi_min": psi_strength(cfg.privacy.psi, cfg.privacy.psi_param, cfg.data.input_size),
        "augment": cfg.data.augment,
        "data_path": str(root / name),
        "ledger_path": str(out / "sites" / name / "ledger.sqlite"),
        "public_path": str(root / cfg.data.public_split),
        "public_digest": public_digest(public),
        "accountant": cfg.privacy.accountant,
        "unit": cfg.privacy.unit,
        "max_records_per_patient": cap,
    })


def simulation_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    splits = cfg.data.train_splits
    if not 0 <= index < len(splits):
        raise ValueError(f"partition-id {index} has no split: data.train_splits has {len(splits)} ({list(splits)})")
    path = out / "sites" / splits[index] / "policy.yaml"
    if path.is_file():
        return load_policy(path)
    policy = default_policy(cfg, out, index)
    write_policy(path, policy)
    log.info("site %s: wrote default simulation policy %s", policy.site, path)
    return policy


# ---------------------------------------------------------------------------
# data and the site's own checks
# ---------------------------------------------------------------------------


def load_split_dir(path: str | Path, what: str) -> list[PoseRecord]:
    path = Path(path)
    if not (path / "annotations.json").is_file():
        raise ValueError(f"{what} {path} is not a split directory (needs annotations.json and images/)")
    records = load_split(path.parent, path.name)
    if not records:
        raise ValueError(f"{what} {path} has no records")
    return records


@dataclass(frozen=True)
class CheckedSite:
    """A site's data after its own start-up checks passed.

    ``private``: the records it trains on (at patient level at most the policy's cap per patient);
    ``patients``: their patient groups at patient level, else None.
    """

    private: list[PoseRecord]
    public: list[PoseRecord] | None
    patients: PatientGroups | None = None


_CHECKED: dict[tuple, CheckedSite] = {}


def _data_version(*paths: str | None) -> tuple:
    out = []
    for path in paths:
        if path:
            stat = (Path(path) / "annotations.json").stat()
            out.append((path, stat.st_mtime_ns, stat.st_size))
    return tuple(out)


def check_site(policy: SitePolicy) -> CheckedSite:
    """The site's own checks of its policy and data; ValueError naming the problem (for the operator).

    - the private data loads, and delta < 1/n (n: records, or patients at
      patient level, whose records are then grouped and capped);
    - record level with a stated ``max_records_per_patient``: no patient has
      more records (where the data carries patient ids);
    - no image appears twice in the private data (a duplicate is a group of
      two, which record-level DP does not cover);
    - the public set matches the digest the operator approved, and shares
      no image with the private data (P2: V would see it without noise).
    """
    private = load_split_dir(policy.data_path, "site data")
    check_no_duplicates(private, what=f"site data {policy.data_path}")
    patients = None
    if policy.unit == "patient":
        private, patients = group_by_patient(private, cap=policy.max_records_per_patient)
        check_delta(policy.delta, patients.count)
    else:
        check_delta(policy.delta, len(private))
        stated_group_size(private, policy.max_records_per_patient)
    public = None
    if policy.public_path:
        public = load_split_dir(policy.public_path, "public set")
        digest = public_digest(public)
        if digest != policy.public_digest:
            raise ValueError(f"public set {policy.public_path} has manifest digest {digest}, but the policy approves "
                             f"{policy.public_digest}: approve the new set (`fedpose site-policy --check`) or "
                             "restore the approved one")
        try:
            check_disjoint(public, private)
        except ValueError as err:
            raise ValueError(f"public set {policy.public_path} holds some of this site's private images: {err}; "
                             "then approve its new digest") from err
    return CheckedSite(private=private, public=public, patients=patients)


def site_check(policy: SitePolicy) -> CheckedSite:
    """``check_site`` once per policy and data version; a failure refuses every request, generically.

    The detail goes to the site's own log; the server only learns that the
    site is misconfigured, the same answer whatever it sends (P10).
    """
    key = (policy, _data_version(policy.data_path, policy.public_path))
    if key not in _CHECKED:
        try:
            checked = check_site(policy)
        except (OSError, ValueError) as err:
            log.error("site %s is misconfigured and refuses every request until fixed: %s", policy.site, err)
            raise Refusal(RefusalCode.MISCONFIGURED,
                          "this site's own checks failed; its operator must run `fedpose site-policy --check`") from err
        log.info("site %s: policy and data checked (public set digest, P2 disjointness, no duplicates)", policy.site)
        _CHECKED.clear()
        _CHECKED[key] = checked
    return _CHECKED[key]


def site_info(policy: SitePolicy) -> SiteInfo:
    """Answer to the server's query: what the policy declares, and the spend so far (never n)."""
    site_check(policy)
    spend = spend_so_far(policy, None)
    return SiteInfo(
        site=policy.site, epsilon=policy.epsilon, delta=policy.delta, lifetime_rounds=policy.lifetime_rounds,
        rounds_per_federation=policy.rounds_per_federation, rounds_done=int(spend["site_rounds"]),
        epsilon_spent=spend["site_epsilon"],
        min_sigma=min_sigma_for(policy), sample_rate=policy.sample_rate, steps_per_round=policy.steps_per_round,
        clip_norm=policy.clip_norm, psi=policy.psi, psi_min=policy.psi_min, augment=policy.augment,
        accountant=policy.accountant, methods=policy.methods, unit=policy.unit,
        max_records_per_patient=policy.max_records_per_patient,
    )


def spend_so_far(policy: SitePolicy, federation: str | None) -> dict[str, float]:
    """The site's lifetime and per-federation epsilon and its rounds, from its own ledger."""
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        life = ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
        run = ledger.epsilon(delta=policy.delta, accountant=policy.accountant, federation=federation) \
            if federation else 0.0
        return {"site_epsilon": life, "run_epsilon": run, "site_rounds": ledger.rounds_done()}


# ---------------------------------------------------------------------------
# basis
# ---------------------------------------------------------------------------


def _cache_path(policy: SitePolicy, federation: str, version: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", federation)
    return Path(policy.ledger_path).parent / "basis-cache" / f"{safe}-v{version}.npy"


def cache_basis(policy: SitePolicy, federation: str, version: int, basis: torch.Tensor) -> None:
    """Keep the latest V of a federation on disk (atomic), dropping older versions."""
    path = _cache_path(policy, federation, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, basis.detach().cpu().numpy(), allow_pickle=False)
    tmp.replace(path)
    prefix = path.name.rsplit("-v", 1)[0] + "-v"
    for old in path.parent.glob(f"{prefix}*.npy"):
        if old != path:
            old.unlink(missing_ok=True)


def cached_basis(policy: SitePolicy, federation: str, version: int) -> torch.Tensor | None:
    path = _cache_path(policy, federation, version)
    if not path.is_file():
        return None
    return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.float32))


def check_basis(basis: torch.Tensor, *, p: int, k: int) -> None:
    """Refuse a V that is not (p, k), not finite, or without orthonormal columns (to 1e-3)."""
    if basis.dim() != 2 or tuple(basis.shape) != (p, k):
        raise Refusal(
            RefusalCode.BAD_BASIS,
            f"basis has shape {tuple(basis.shape)}, expected ({p}, {k}) for the trainable parameters of this strategy",
        )
    if not bool(torch.isfinite(basis).all()):
        raise Refusal(RefusalCode.BAD_BASIS, "basis contains NaN or Inf")
    try:
        check_orthonormal(basis, tol=1e-3)
    except ValueError as err:
        raise Refusal(RefusalCode.BAD_BASIS, str(err)) from err


def obtain_basis(content: Any, request: TrainRequest, model: torch.nn.Module, trainable: list[str],
                 checked: CheckedSite, policy: SitePolicy) -> tuple[torch.Tensor, float]:
    """V for this round: received (checked), cached by version, or computed here (basis_mode site).

    Nothing is written here: ``handle_train`` caches V only once the round is recorded, so a server
    cannot fill the site's disk with bases under new federation ids while every request is refused.
    """
    cfg = request.config
    named = dict(model.named_parameters())
    p = sum(named[name].numel() for name in trainable)
    k = cfg.privacy.k
    if BASIS in content.array_records:
        try:
            version, basis = record_basis(content[BASIS])
        except ValueError as err:
            raise Refusal(RefusalCode.BAD_BASIS, str(err)) from err
        if version != request.basis_version:
            raise Refusal(RefusalCode.BAD_BASIS, f"basis version {version} != requested {request.basis_version}")
        check_basis(basis, p=p, k=k)
        return basis, 0.0
    cached = cached_basis(policy, request.federation, request.basis_version)
    if cached is not None:
        check_basis(cached, p=p, k=k)
        return cached, 0.0
    if request.basis_mode == "broadcast":
        raise Refusal(RefusalCode.NEED_BASIS, f"basis version {request.basis_version} is not cached here; send V")
    # basis_mode "site": V from the site's copy of the PUBLIC set at the received global weights (P2).
    if checked.public is None:
        raise Refusal(RefusalCode.POLICY, "basis_mode 'site' needs public_path in the site policy")
    from shared.model.posenet import make_loss_fn
    from shared.train import make_dataset, public_basis_at

    public = checked.public  # approved by digest and disjoint from the private data (site_check, P2)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    basis = public_basis_at(model, make_loss_fn(model, trainable), trainable,
                            make_dataset(public, cfg, train=False), cfg.privacy, device).cpu()
    seconds = time.perf_counter() - t0
    check_basis(basis, p=p, k=k)
    return basis, seconds


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------


def parse_request(content: Any) -> TrainRequest:
    try:
        return TrainRequest.from_record(content[CONFIG])
    except (KeyError, ValueError, TypeError, OverflowError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"malformed train request: {err}") from err


def check_request(request: TrainRequest, policy: SitePolicy) -> None:
    """Refuse (POLICY / WEAKER_NOISE) a request weaker than what the policy pins (P11); reads no private data."""
    cfg = request.config
    method = cfg.train.method
    if request.site != policy.site:
        raise Refusal(RefusalCode.BAD_REQUEST, f"request is for site {request.site!r}, this is {policy.site!r}")
    if not _FEDERATION_ID.match(request.federation):
        raise Refusal(RefusalCode.BAD_REQUEST, "federation id must be 1-64 letters, digits, '.', '_' or '-'")
    if method not in policy.methods:
        raise Refusal(RefusalCode.POLICY,
                      f"method {method!r} is not allowed by this site (allows {list(policy.methods)})")
    if cfg.privacy.unit != policy.unit:  # its q, clipping and claim are per unit (issue #11)
        raise Refusal(RefusalCode.POLICY, f"privacy unit {cfg.privacy.unit!r} is not this site's {policy.unit!r}")
    if request.sample_rate != policy.sample_rate:
        raise Refusal(RefusalCode.POLICY, f"sample rate {request.sample_rate!r} is not this site's "
                                          f"{policy.sample_rate!r}")
    if request.steps > policy.steps_per_round:
        raise Refusal(RefusalCode.POLICY, f"{request.steps} local steps exceed this site's steps_per_round="
                                          f"{policy.steps_per_round}")
    if cfg.privacy.clip_norm != policy.clip_norm:
        raise Refusal(RefusalCode.POLICY, f"clip norm {cfg.privacy.clip_norm!r} is not this site's "
                                          f"{policy.clip_norm!r}")
    if cfg.data.augment != policy.augment:
        raise Refusal(RefusalCode.POLICY, f"augment={cfg.data.augment} but this site's policy says "
                                          f"augment={policy.augment}")
    if method in WITH_PSI:
        if cfg.privacy.psi != policy.psi:
            raise Refusal(RefusalCode.POLICY, f"psi {cfg.privacy.psi!r} is not this site's {policy.psi!r}")
        strength = psi_strength(cfg.privacy.psi, cfg.privacy.psi_param, cfg.data.input_size)
        if not strength >= policy.psi_min:
            label = psi_label(cfg.privacy.psi, cfg.privacy.psi_param)
            raise Refusal(RefusalCode.POLICY, f"psi {label} has strength {strength:.4g} of min(H, W), below "
                                              f"this site's psi_min="
                                              f"{policy.psi_min:g}")
    shortfall = sigma_shortfall(policy, sigma=request.sigma)
    if shortfall is not None:
        raise Refusal(RefusalCode.WEAKER_NOISE, shortfall)


def load_weights(content: Any, model: torch.nn.Module) -> None:
    """Load the global weights into ``model`` or refuse: exactly its tensors, its shapes, all finite."""
    if ARRAYS not in content.array_records:
        raise Refusal(RefusalCode.BAD_REQUEST, "train request carries no weights")
    expected = model.state_dict()
    try:
        tensors = record_tensors(content[ARRAYS])
    except (ValueError, TypeError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"weights cannot be read: {err}") from err
    if set(tensors) != set(expected):
        raise Refusal(RefusalCode.BAD_REQUEST, "weights do not fit the model: names differ "
                                               f"(missing {sorted(set(expected) - set(tensors))[:3]}, "
                                               f"unexpected {sorted(set(tensors) - set(expected))[:3]})")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise Refusal(RefusalCode.BAD_REQUEST, f"weights do not fit the model: {name} has shape "
                                                   f"{tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise Refusal(RefusalCode.BAD_REQUEST, f"weights contain NaN or Inf ({name})")
    model.load_state_dict(tensors, strict=True)


def _reply_path(policy: SitePolicy, federation: str, round: int) -> Path:
    return Path(policy.ledger_path).parent / "replies" / f"{federation}-r{int(round)}.pt"


def store_reply(policy: SitePolicy, federation: str, round: int, weights: dict[str, torch.Tensor],
                metrics: dict[str, float | int]) -> None:
    """Keep the latest reply of a federation (atomic), so that a repeated round gets it back unchanged.

    It is DP output already released (post-processing); only the latest round of each federation is kept.
    """
    path = _reply_path(policy, federation, round)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"weights": {k: v.detach().cpu() for k, v in weights.items()}, "metrics": dict(metrics)}, tmp)
    tmp.replace(path)
    for old in path.parent.glob(f"{federation}-r*.pt"):
        if old != path:
            old.unlink(missing_ok=True)


def stored_reply(policy: SitePolicy, federation: str, round: int) -> Any:
    """The reply this site sent for (federation, round), or None when it is not kept."""
    from flwr.app import MetricRecord, RecordDict

    path = _reply_path(policy, federation, round)
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        weights, metrics = saved["weights"], saved["metrics"]
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        log.error("site %s: stored reply %s is unreadable (%s): answering 'already spent'", policy.site, path, err)
        return None
    return RecordDict({ARRAYS: weights_record(weights), METRICS: MetricRecord(metrics)})


def repeated_round(policy: SitePolicy, federation: str, round: int) -> Any:
    """The stored reply of a (federation, round) already spent, or an ALREADY_SPENT refusal: never a second spend."""
    reply = stored_reply(policy, federation, round)
    if reply is not None:
        log.info("site %s: round %d of federation %s was already spent: resending its stored reply", policy.site,
                 round, federation)
        return reply
    raise Refusal(RefusalCode.ALREADY_SPENT, f"round {round} of federation {federation} was already trained and "
                                             "spent here; it is never trained twice")


def handle_train(content: Any, policy: SitePolicy, *, progress: bool = False) -> Any:
    """Run one requested round or raise ``Refusal``; returns the reply RecordDict."""
    from flwr.app import MetricRecord, RecordDict

    from client.site_eval import evaluate_global
    from shared.model.posenet import apply_strategy, build_model
    from shared.optim_state import keep_site_optimizer, site_optimizer
    from shared.privacy.noise import make_generator
    from shared.train import local_train, make_dataset, round_span, select_device

    request = parse_request(content)
    cfg = request.config
    method = cfg.train.method
    check_request(request, policy)
    checked = site_check(policy)
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        if any(r["federation"] == request.federation and r["round"] == request.round for r in ledger.rows()):
            return repeated_round(policy, request.federation, request.round)

    device = select_device(cfg.train.device)
    model = build_model(cfg.model, cfg.data.input_size)
    load_weights(content, model)
    model.to(device)
    evaluate_global(model, policy, checked.private, federation=request.federation, rnd=request.round)
    trainable = apply_strategy(model, cfg.train.strategy)
    basis, seconds_basis = None, 0.0
    if method in PROJECTED:
        basis, seconds_basis = obtain_basis(content, request, model, trainable, checked, policy)
        basis = basis.to(device)

    psi = psi_label(cfg.privacy.psi, cfg.privacy.psi_param) if method in WITH_PSI else None
    mechanism = Mechanism(method=method, psi=psi, clip_norm=policy.clip_norm, augment=policy.augment,
                          unit=policy.unit)
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger, ledger.round() as open_round:
        if open_round.has_round(request.federation, request.round):  # a concurrent duplicate won the lock
            raise Refusal(RefusalCode.ALREADY_SPENT, f"round {request.round} of federation {request.federation} was "
                                                     "already trained and spent here; it is never trained twice")
        if open_round.rounds_done >= policy.lifetime_rounds:
            raise Refusal(RefusalCode.BUDGET, f"site already took part in {open_round.rounds_done} rounds "
                                              f"(lifetime_rounds={policy.lifetime_rounds})")
        if open_round.federation_rounds(request.federation) >= policy.rounds_per_federation:
            raise Refusal(RefusalCode.BUDGET, f"site already took part in {policy.rounds_per_federation} rounds of "
                                              f"this federation (rounds_per_federation)")
        planned = StepRecord(sigma=request.sigma, sample_rate=policy.sample_rate, steps=request.steps)
        eps_after = open_round.epsilon_after(planned, delta=policy.delta, accountant=policy.accountant)
        if eps_after > policy.epsilon:
            raise Refusal(RefusalCode.BUDGET, f"this round would spend eps={eps_after:.4g} > budget {policy.epsilon:g} "
                                              f"(delta={policy.delta:g}, {policy.accountant})")
        # Reproducible noise (tests only, P7) is seeded from the ledger row, never from a server field (P11).
        seed = None if policy.seed is None else policy.seed + open_round.rounds_done
        generator, seeded = make_generator(seed, "cpu")
        optimizer = site_optimizer(cfg, model, trainable, policy.ledger_path, request.federation)
        result = local_train(
            model, make_dataset(checked.private, cfg, train=True, seed=seed), method=method, train=cfg.train,
            privacy=cfg.privacy, sigma=request.sigma, steps=request.steps, generator=generator, basis=basis,
            sample_rate=policy.sample_rate, optimizer=optimizer, patients=checked.patients,
            schedule_span=round_span(request.round, request.steps, cfg.federation.rounds),
            progress=progress, desc=f"{policy.site} round {request.round}",
        )
        eps = open_round.record(
            site=policy.site, budget=policy.epsilon, federation=request.federation, round=request.round,
            sigma=result.sigma, sample_rate=result.sample_rate, steps=result.steps, delta=policy.delta,
            accountant=policy.accountant, mechanism=mechanism,
        )
        run_eps = open_round.epsilon(delta=policy.delta, accountant=policy.accountant, federation=request.federation)
        rounds_done = open_round.rounds_done
    keep_site_optimizer(cfg, optimizer, model, trainable, policy.ledger_path, request.federation)
    # Timings and the realised batch sizes track n: they stay in this log, never in the reply (P10).
    log.info("site %s round %d: trained %d steps (sigma=%.4f, q=%.4f, mean batch %.1f) in %.1f s (+%.1f s basis); "
             "eps spent %.4f of %.4g", policy.site, request.round, result.steps, result.sigma, result.sample_rate,
             result.mean_batch, result.seconds, seconds_basis, eps, policy.epsilon)
    named = dict(model.named_parameters())
    metrics = {
        "sigma": float(result.sigma),
        "sample-rate": float(result.sample_rate),
        "steps": int(result.steps),
        "site-epsilon": float(eps),
        "run-epsilon": float(run_eps),
        "site-delta": float(policy.delta),
        "site-rounds": int(rounds_done),
        "seeded": int(seeded),
    }
    weights = {k: named[k] for k in trainable}
    store_reply(policy, request.federation, request.round, weights, metrics)
    if basis is not None:
        cache_basis(policy, request.federation, request.basis_version, basis)
    return RecordDict({ARRAYS: weights_record(weights), METRICS: MetricRecord(metrics)})

