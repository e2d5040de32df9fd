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

This module is the round itself (``handle_train``); the steps it calls live
beside it: ``client.request`` (parse, check against the policy, load
weights), ``client.site_data`` (the site's own checks, ``site_info``),
``client.site_basis`` (V), ``client.replies`` (repeated rounds) and
``client.policy_resolve`` (which policy a node runs under).
"""

from __future__ import annotations

import logging
from typing import Any

from client.ledger import Mechanism, SiteLedger
from client.policy import SitePolicy
from client.replies import repeated_round, store_reply
from client.request import PROJECTED, WITH_PSI, check_request, load_weights, parse_request
from client.site_basis import cache_basis, obtain_basis
from client.site_data import site_check
from shared.federation_messages import ARRAYS, METRICS, Refusal, RefusalCode, weights_record
from shared.privacy.accountant import StepRecord
from shared.privacy.psi import psi_label_of

# Names other code and the tests have imported from client.site; their homes are the modules above.
from client.policy_resolve import default_policy, resolve_policy, simulation_policy  # noqa: F401
from client.site_data import check_site, load_split_dir, public_digest, site_info, spend_so_far  # noqa: F401

log = logging.getLogger(__name__)


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
    trainable = apply_strategy(model, cfg.train.strategy)
    basis, seconds_basis = None, 0.0
    if method in PROJECTED:
        basis, seconds_basis = obtain_basis(content, request, model, trainable, checked, policy)
        basis = basis.to(device)

    psi = psi_label_of(cfg.privacy) if method in WITH_PSI else None
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
        # Only a request that will train gets the received model scored: a refused one (any number of
        # them) costs the site no evaluation and no evaluation.jsonl row. The weights are still the global ones.
        evaluate_global(model, policy, checked.private, federation=request.federation, rnd=request.round)
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
