"""What a hospital site does with a server request (DESIGN.md section 2, step 3; invariant P6).

``handle_train`` checks a train request against the site's own policy and
ledger before anything runs, and refuses (``Refusal``, nothing trained,
ledger unchanged) when:

- the method is not one the policy allows;
- sigma is below the site's own minimum (``client.policy.sigma_shortfall``, the same rule as
  ``min_sigma_for`` in one accountant call);
- the site already took part in ``max_rounds`` rounds, or this round would
  push its accountant's epsilon over its budget (composed over its whole
  ledger, P5);
- the basis V has the wrong shape or is not orthonormal to 1e-3, or the
  weights do not fit the model.

Then it trains with ``shared.train.local_train``, records what actually ran
(sigma, q, steps) in its ledger in the same transaction, and only then
returns the reply: spend is on disk before anything leaves the site.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client.ledger import SiteLedger
from client.policy import (
    SitePolicy,
    load_policy,
    min_sigma_for,
    policy_from_dict,
    sigma_shortfall,
    write_policy,
)
from shared.config import Config
from shared.data.mpii import load_split
from shared.data.records import PoseRecord
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
from shared.privacy.subspace import check_orthonormal

log = logging.getLogger(__name__)

PROJECTED = ("proj", "fpdp")


# ---------------------------------------------------------------------------
# policy resolution (deployment: node config; simulation: partition id)
# ---------------------------------------------------------------------------


def resolve_policy(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> SitePolicy:
    """The site's policy.

    Deployment: ``--node-config "site-policy='/etc/fedpose/policy.yaml' data-path='/data/site'"``
    (``data-path`` overrides the policy's). Simulation: the virtual node with
    ``partition-id`` i is site ``data.train_splits[i]``; its policy is
    ``<out>/sites/<split>/policy.yaml`` (written by ``fedpose simulate``, or
    created here with the config's privacy budget when absent).
    """
    if "site-policy" in node_config:
        policy = load_policy(str(node_config["site-policy"]))
        if node_config.get("data-path"):
            from dataclasses import replace

            policy = replace(policy, data_path=str(Path(str(node_config["data-path"])).expanduser().resolve()))
        return policy
    if "partition-id" in node_config:
        from shared.run_config import config_from_run_config, out_dir

        cfg = config_from_run_config(run_config)
        return simulation_policy(cfg, out_dir(run_config, cfg), int(node_config["partition-id"]))
    raise ValueError(
        "this SuperNode has no site policy: start it with "
        "--node-config \"site-policy='/path/policy.yaml' data-path='/path/to/split'\""
    )


def default_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    """Simulation default for site ``index``: the config's budget, its split, a ledger under ``out``."""
    splits = cfg.data.train_splits
    if not 0 <= index < len(splits):
        raise ValueError(f"partition-id {index} has no split: data.train_splits has {len(splits)} ({list(splits)})")
    root = Path(cfg.data.root).expanduser().resolve()
    name = splits[index]
    return policy_from_dict({
        "site": name,
        "epsilon": cfg.privacy.epsilon,
        "delta": cfg.privacy.delta,
        "max_rounds": cfg.federation.rounds,
        "data_path": str(root / name),
        "ledger_path": str(out / "sites" / name / "ledger.sqlite"),
        "public_path": str(root / cfg.data.public_split),
        "accountant": cfg.privacy.accountant,
    })


def simulation_policy(cfg: Config, out: Path, index: int) -> SitePolicy:
    name = default_policy(cfg, out, index).site
    path = out / "sites" / name / "policy.yaml"
    if path.is_file():
        return load_policy(path)
    policy = default_policy(cfg, out, index)
    write_policy(path, policy)
    log.info("site %s: wrote default simulation policy %s", name, path)
    return policy


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def load_split_dir(path: str | Path, what: str) -> list[PoseRecord]:
    path = Path(path)
    if not (path / "annotations.json").is_file():
        raise ValueError(f"{what} {path} is not a split directory (needs annotations.json and images/)")
    records = load_split(path.parent, path.name)
    if not records:
        raise ValueError(f"{what} {path} has no records")
    return records


def site_info(policy: SitePolicy, *, batch_size: int, local_steps: int,
              public_hashes: Sequence[str] = ()) -> SiteInfo:
    """Answer to the server's query: n, budget, spend so far and the minimum sigma for this shape.

    Refuses (PUBLIC_OVERLAP) when any of this site's images is in the server's public set,
    compared by content hash (P2: V would otherwise see private images without noise).
    """
    from shared.data.records import content_hash

    private = load_split_dir(policy.data_path, "site data")
    n = len(private)
    if public_hashes:
        shared = {content_hash(path) for path in dict.fromkeys(r.image for r in private)} & set(public_hashes)
        if shared:
            raise Refusal(RefusalCode.PUBLIC_OVERLAP, f"{len(shared)} of this site's images are in the server's "
                                                      "public set (P2): remove them from the public set")
    check_delta(policy.delta, n)
    q = min(1.0, batch_size / n)
    with SiteLedger(policy.ledger_path) as ledger:
        rounds_done = ledger.rounds_done()
        spent = ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
    return SiteInfo(
        site=policy.site, n=n, epsilon=policy.epsilon, delta=policy.delta, max_rounds=policy.max_rounds,
        rounds_done=rounds_done, epsilon_spent=spent,
        min_sigma=min_sigma_for(policy, sample_rate=q, steps_per_round=local_steps),
        accountant=policy.accountant, methods=policy.methods,
    )


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
    """Refuse a V that is not (p, k) with orthonormal columns (to 1e-3)."""
    if basis.dim() != 2 or tuple(basis.shape) != (p, k):
        raise Refusal(
            RefusalCode.BAD_BASIS,
            f"basis has shape {tuple(basis.shape)}, expected ({p}, {k}) for the trainable parameters of this strategy",
        )
    try:
        check_orthonormal(basis, tol=1e-3)
    except ValueError as err:
        raise Refusal(RefusalCode.BAD_BASIS, str(err)) from err


def obtain_basis(content: Any, request: TrainRequest, model: torch.nn.Module, trainable: list[str],
                 private: list[PoseRecord], policy: SitePolicy) -> tuple[torch.Tensor, float]:
    """V for this round: received (checked, cached), cached by version, or computed here (basis_mode site)."""
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
        cache_basis(policy, request.federation, version, basis)
        return basis, 0.0
    cached = cached_basis(policy, request.federation, request.basis_version)
    if cached is not None:
        check_basis(cached, p=p, k=k)
        return cached, 0.0
    if request.basis_mode == "broadcast":
        raise Refusal(RefusalCode.NEED_BASIS, f"basis version {request.basis_version} is not cached here; send V")
    # basis_mode "site": V from the site's copy of the PUBLIC set at the received global weights (P2).
    if not policy.public_path:
        raise Refusal(RefusalCode.POLICY, "basis_mode 'site' needs public_path in the site policy")
    from shared.data.split import check_disjoint
    from shared.model.posenet import make_loss_fn
    from shared.train import make_dataset, public_basis_at

    public = load_split_dir(policy.public_path, "public set")
    check_disjoint(public, private)  # P2: V must not see this site's images
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    basis = public_basis_at(model, make_loss_fn(model, trainable), trainable,
                            make_dataset(public, cfg, train=False), cfg.privacy, device).cpu()
    seconds = time.perf_counter() - t0
    check_basis(basis, p=p, k=k)
    cache_basis(policy, request.federation, request.basis_version, basis)
    return basis, seconds


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------


def parse_request(content: Any) -> TrainRequest:
    try:
        return TrainRequest.from_record(content[CONFIG])
    except (KeyError, ValueError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"malformed train request: {err}") from err


def handle_train(content: Any, policy: SitePolicy, *, progress: bool = False) -> Any:
    """Run one requested round or raise ``Refusal``; returns the reply RecordDict."""
    from flwr.app import MetricRecord, RecordDict

    from shared.model.posenet import apply_strategy, build_model
    from shared.optim_state import keep_site_optimizer, site_optimizer
    from shared.privacy.noise import make_generator
    from shared.train import local_train, make_dataset, round_span, select_device

    request = parse_request(content)
    cfg = request.config
    method = cfg.train.method
    if request.site != policy.site:
        raise Refusal(RefusalCode.BAD_REQUEST, f"request is for site {request.site!r}, this is {policy.site!r}")
    if method not in policy.methods:
        raise Refusal(RefusalCode.POLICY,
                      f"method {method!r} is not allowed by this site (allows {list(policy.methods)})")
    private = load_split_dir(policy.data_path, "site data")
    n = len(private)
    try:
        check_delta(policy.delta, n)
    except ValueError as err:
        raise Refusal(RefusalCode.POLICY, str(err)) from err
    q = min(1.0, cfg.train.batch_size / n)
    shortfall = sigma_shortfall(policy, sigma=request.sigma, sample_rate=q, steps_per_round=request.steps)
    if shortfall is not None:
        raise Refusal(RefusalCode.WEAKER_NOISE, shortfall)

    device = select_device(cfg.train.device)
    model = build_model(cfg.model, cfg.data.input_size)
    if ARRAYS not in content.array_records:
        raise Refusal(RefusalCode.BAD_REQUEST, "train request carries no weights")
    try:
        model.load_state_dict(record_tensors(content[ARRAYS]), strict=True)
    except (RuntimeError, ValueError) as err:
        raise Refusal(RefusalCode.BAD_REQUEST, f"weights do not fit the model: {err}") from err
    model.to(device)
    trainable = apply_strategy(model, cfg.train.strategy)
    basis, seconds_basis = None, 0.0
    if method in PROJECTED:
        basis, seconds_basis = obtain_basis(content, request, model, trainable, private, policy)
        basis = basis.to(device)

    seed = None if policy.seed is None else policy.seed + request.round
    with SiteLedger(policy.ledger_path) as ledger, ledger.round() as open_round:
        if open_round.rounds_done >= policy.max_rounds:
            raise Refusal(RefusalCode.BUDGET, f"site already took part in {open_round.rounds_done} rounds "
                                              f"(max_rounds={policy.max_rounds})")
        planned = StepRecord(sigma=request.sigma, sample_rate=q, steps=request.steps)
        eps_after = open_round.epsilon_after(planned, delta=policy.delta, accountant=policy.accountant)
        if eps_after > policy.epsilon:
            raise Refusal(RefusalCode.BUDGET, f"this round would spend eps={eps_after:.4g} > budget {policy.epsilon:g} "
                                              f"(delta={policy.delta:g}, {policy.accountant})")
        generator, seeded = make_generator(seed, "cpu")
        optimizer = site_optimizer(cfg, model, trainable, policy.ledger_path, request.federation)
        result = local_train(
            model, make_dataset(private, cfg, train=True, seed=seed), method=method, train=cfg.train,
            privacy=cfg.privacy, sigma=request.sigma, steps=request.steps, generator=generator, basis=basis,
            optimizer=optimizer, schedule_span=round_span(request.round, request.steps, cfg.federation.rounds),
            progress=progress, desc=f"{policy.site} round {request.round}",
        )
        eps = open_round.record(
            site=policy.site, budget=policy.epsilon, federation=request.federation, round=request.round,
            sigma=result.sigma, sample_rate=result.sample_rate, steps=result.steps, delta=policy.delta,
            accountant=policy.accountant,
        )
        rounds_done = open_round.rounds_done + 1
    keep_site_optimizer(cfg, optimizer, model, trainable, policy.ledger_path, request.federation)
    log.info("site %s round %d: trained %d steps (sigma=%.4f, q=%.4f); eps spent %.4f of %.4g",
             policy.site, request.round, result.steps, result.sigma, result.sample_rate, eps, policy.epsilon)
    named = dict(model.named_parameters())
    metrics = MetricRecord({
        "num-examples": n,
        "sigma": float(result.sigma),
        "sample-rate": float(result.sample_rate),
        "steps": int(result.steps),
        "site-epsilon": float(eps),
        "site-delta": float(policy.delta),
        "site-rounds": rounds_done,
        "seeded": int(seeded),
        "seconds-train": float(result.seconds),
        "seconds-basis": float(seconds_basis),
    })
    return RecordDict({ARRAYS: weights_record({k: named[k] for k in trainable}), METRICS: metrics})
