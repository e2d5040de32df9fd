"""What a hospital site does with a server request (docs/explanation/design.md: the round, the threat model;
P6, P10-P15).

The server is not trusted. ``handle_train`` checks a train request against the site's own policy
and refuses (``Refusal``, nothing trained, ledger unchanged) anything weaker than the policy pins:

- a method the policy does not allow; another privacy unit; a sample rate other than the policy's;
  more local steps than ``steps_per_round``; another clip norm; for fdp/fpdp another psi kind or a
  weaker psi; another augmentation setting; a model or an input larger than the policy's bounds;
- sigma below the site's own minimum (``fedpose.client.policy.sigma_shortfall``);
- weights or a basis V that are malformed, non-finite or of the wrong shape;
- a site whose own checks are not current for its policy and files (``site_ready``);
- then, inside the ledger transaction: more rounds than ``rounds_per_federation`` or
  ``lifetime_rounds``, or a round that would push its accountant's epsilon over its budget.

None of this reads a private record, so a refusal's text and time do not depend on private data.

Charge on attempt (P13): the round's row is committed (state ``charged``, with a secret noise seed)
BEFORE the first private record is read. Whatever happens after, a crash, an error, an exhausted
memory, the round has been paid for. The round then trains with the site's pinned resources (its
chunk size, its normaliser, P15) and a reply checked finite is stored, and the row marked done,
before it leaves.

A charged round is one release (P16): its row is bound to the digest of the whole request
(``fedpose.client.request.request_digest``: weights, basis, every config field, the app bundle). A
(federation, round) asked again gets its stored reply when it is done, and its stored failure when it
failed after the charge (final: the noise seed is erased, nothing runs again). An interruption after the
charge, a stopped run's SIGINT included, is final in the same way, during training or while the answer is
held (a reply that never left is dropped). Only a round whose process died stays charged, and only the
identical request replays it, on the same seed and the same data, at most ``MAX_ATTEMPTS`` times in all, so
it is never spent twice and never evaluated on other inputs. With ``round_seconds`` in the policy every
answer about a charged round (a fresh reply or failure, a stored one, the refusal of another request for
it) leaves at a multiple of that period after its own request arrived (``on_the_clock``, ``hold_reply``),
not when training happened to end; one site runs one round at a time, across processes (``site_lock``).

This module is the round itself, its lock and its held answer; the steps it calls live beside it:
``fedpose.client.request`` (parse, check against the policy, load weights, the digest a charge is bound to),
``fedpose.client.data`` (the site's own checks), ``fedpose.client.basis`` (V), ``fedpose.client.replies``
(stored replies) and ``fedpose.client.policy_resolve`` (which policy a node runs under).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpose.client.capacity import check_round_cost, round_chunk
from fedpose.client.ledger import MAX_ATTEMPTS, Mechanism, SiteLedger
from fedpose.client.policy import SitePolicy
from fedpose.client.replies import drop_reply, repeated_round, store_reply
from fedpose.client.request import (check_model_size, check_request, load_weights, parse_request, request_digest,
                                    running_bundle)
from fedpose.shared.configuration.methods import PROJECTED, WITH_PUBLIC
from fedpose.client.basis import cache_basis, drop_basis_cache, obtain_basis
from fedpose.client.data import SiteCheck, load_checked, site_ready
from fedpose.shared.flower.messages import ARRAYS, METRICS, Refusal, RefusalCode, weights_record
from fedpose.shared.privacy.accounting.accountant import StepRecord
from fedpose.shared.privacy.step.psi import psi_label_of

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

log = logging.getLogger(__name__)


class SiteFailure(RuntimeError):
    """A charged round that could not produce a reply; its spend stays on the ledger (P13)."""


def _augment_seed(secret: int) -> int:
    """The round's augmentation seed, derived from its secret so that a replay draws the same crops."""
    return int.from_bytes(hashlib.sha256(b"fedpose-augment" + secret.to_bytes(8, "big")).digest()[:4], "big")


@contextmanager
def site_lock(policy: SitePolicy) -> Iterator[None]:
    """One round at a time per site, across processes (Flower starts one per message); released on death."""
    from fedpose.shared.private_files import open_private, private_dir

    path = Path(policy.ledger_path).with_suffix(".lock")
    private_dir(path.parent)  # made 0700, the lock 0600, whatever the umask (secrets at rest)
    with open(path, "a+", opener=open_private) as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def hold_reply(arrived: float, period: float | None) -> None:
    """Hold a charged round's answer until the first multiple of ``period`` (the policy's ``round_seconds``) after
    its request ``arrived`` (time.monotonic()) that has not passed yet.

    A round that ran past its deadline then leaves at the next multiple, never when training happened to end, so
    the departure time moves with the private data only when a round crosses a multiple (pinned resources and the
    pinned public batch keep rounds inside one); the site's operator is told each time it happens.
    """
    if period is None:
        return
    elapsed = time.monotonic() - arrived
    periods = max(1, math.ceil(elapsed / period))
    if periods > 1:
        log.warning("a round took %.1f s, more than round_seconds=%g: its answer leaves at %g s; raise round_seconds "
                    "so that every round fits", elapsed, period, periods * period)
    left = arrived + periods * period - time.monotonic()
    if left > 0:
        time.sleep(left)


@contextmanager
def on_the_clock(arrived: float, period: float | None) -> Iterator[None]:
    """Every answer about a charged round, a reply or a failure or a refusal, leaves at the clock of its own
    request (``hold_reply``): a stored reply is not answered at once. An interruption (``BaseException`` that is
    not an ``Exception``: the run was stopped) is not held; nothing is sent then."""
    try:
        yield
    except Exception:
        hold_reply(arrived, period)
        raise
    hold_reply(arrived, period)


def handle_train(content: Any, policy: SitePolicy, *, progress: bool = False) -> Any:
    """Run one requested round or raise ``Refusal`` (nothing spent) or ``SiteFailure`` (spent); returns the reply."""
    arrived = time.monotonic()
    request = parse_request(content)
    check_request(request, policy)
    ready = site_ready(policy)
    with site_lock(policy):
        with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
            row = ledger.row_of(request.federation, request.round)
        if row is None:
            prepared = _prepare(content, request, policy)
            # its chunk and its worst case on the clock (P13), measured on blank rows: before the charge, nothing read
            chunk = round_chunk(request, policy, prepared.model, prepared.trainable)
            check_round_cost(request, policy, prepared.model, prepared.trainable,
                             elapsed=time.monotonic() - arrived, chunk_size=chunk)
            row = _charge(request, policy, ready, prepared.digest)
            return _release(request, policy, ready, row, prepared, chunk, arrived=arrived, progress=progress)
        with on_the_clock(arrived, policy.round_seconds):  # an answer about a round charged already (P16)
            if row["state"] == "done":
                return repeated_round(policy, request.federation, request.round)
            if row["state"] == "failed":  # final (P16): the stored answer, nothing runs again
                raise SiteFailure(f"round {request.round} of federation {request.federation} failed after its "
                                  f"charge ({row['outcome']}); that failure is its answer, it is never trained again")
            if row["data_version"] != ready.data_version:
                raise Refusal(RefusalCode.ALREADY_SPENT, f"round {request.round} of federation {request.federation} "
                                                         "was already charged here; it is never trained twice")
            prepared = _prepare(content, request, policy)
            if row["request_digest"] != prepared.digest:  # the same noise on other inputs: a second release (P16)
                raise Refusal(RefusalCode.ALREADY_SPENT, f"round {request.round} of federation {request.federation} "
                                                         "was charged here for another request; only that identical "
                                                         "request replays it, and it is never trained twice")
        log.warning("site %s: round %d of federation %s was charged but its process died: replaying the identical "
                    "request on its own seed (not spent again)", policy.site, request.round, request.federation)
        # charged already: its chunk is sized inside the release, where a failure is its final answer
        return _release(request, policy, ready, row, prepared, None, arrived=arrived, progress=progress)


@dataclass(frozen=True)
class Prepared:
    """What a round trains, made from the request and public data only, before the charge: the model with the
    received weights on the round's device, the names it trains, V (None for methods that do not project) and
    the seconds V took, and the digest of the whole request that a charge is bound to (P16)."""

    model: Any
    trainable: list[str]
    basis: torch.Tensor | None
    seconds_basis: float
    digest: str


def _prepare(content: Any, request: Any, policy: SitePolicy) -> Prepared:
    from fedpose.shared.model.posenet import build_model
    from fedpose.shared.model.strategy import apply_train_strategy
    from fedpose.shared.training.loop import select_device

    cfg = request.config
    device = select_device(cfg.train.device)
    model = build_model(cfg.model, cfg.data.input_size)
    check_model_size(model, policy)
    load_weights(content, model)
    model.to(device)
    trainable = apply_train_strategy(model, cfg.train)
    basis, seconds_basis = None, 0.0
    if cfg.train.method in PROJECTED:  # from public data only (P2): before the charge
        basis, seconds_basis = obtain_basis(content, request, model, trainable, policy)
        basis = basis.to(device)
    digest = request_digest(content, basis, bundle=running_bundle())
    return Prepared(model, trainable, basis, seconds_basis, digest)


# The stored answer of a round interrupted after its charge (a stopped run): said to every later request for it.
INTERRUPTED = "interrupted before its answer left: its run was stopped"


def _release(request: Any, policy: SitePolicy, ready: SiteCheck, row: dict[str, Any], prepared: Prepared,
             chunk: int | None, *, arrived: float, progress: bool) -> Any:
    """A charged round from its first private read until its answer leaves, on the clock (P13, P16).

    Every outcome but the process dying is final: a failure is stored as the round's answer, and so is an
    interruption (Flower turns a stopped run into SIGINT and ``SystemExit`` in the ClientApp), during training or
    while the answer is held, with the noise seed erased and a stored reply that never left dropped. Otherwise a
    server could stop a round at times of its choosing and replay it on the same sample, reading the round's
    duration, which tracks the realised batch. A process that dies leaves the round charged, replayed by the
    identical request at most ``MAX_ATTEMPTS`` times in all.
    """
    federation, rnd = request.federation, request.round
    try:
        with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
            if not ledger.start_attempt(federation, rnd):
                raise SiteFailure(f"round {rnd} of federation {federation} failed after its charge (its process died "
                                  f"{MAX_ATTEMPTS} times); that failure is its answer, it is never trained again")
        reply = _train_charged(request, policy, ready, row, prepared.model, prepared.trainable, basis=prepared.basis,
                               seconds_basis=prepared.seconds_basis, chunk=chunk, progress=progress)
    except Exception as err:
        _final(policy, federation, rnd, str(err) if isinstance(err, SiteFailure)
               else "the site failed; the detail is in its own log")
        hold_reply(arrived, policy.round_seconds)
        raise
    except BaseException:
        _final(policy, federation, rnd, INTERRUPTED)
        raise
    try:
        hold_reply(arrived, policy.round_seconds)
    except BaseException:  # stopped while the answer was held: it never left
        _final(policy, federation, rnd, INTERRUPTED)
        raise
    return reply


def _final(policy: SitePolicy, federation: str, rnd: int, outcome: str) -> None:
    """The round's answer is ``outcome``, for good: its row failed, its seed erased, a stored reply dropped."""
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        ledger.fail(federation, rnd, outcome)
    drop_reply(policy, federation, rnd)
    log.warning("site %s: round %d of federation %s is final: %s (spent, never trained again)", policy.site, rnd,
                federation, outcome)


def _charge(request: Any, policy: SitePolicy, ready: SiteCheck, digest: str) -> dict[str, Any]:
    """Check the budget and commit the round's spend (state charged) before any private record is read."""
    from fedpose.shared.privacy.step.noise import round_secret

    method = request.config.train.method
    psi = psi_label_of(request.config.privacy) if method in WITH_PUBLIC else None
    mechanism = Mechanism(method=method, psi=psi, clip_norm=policy.clip_norm, augment=policy.augment,
                          unit=policy.unit)
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger, ledger.round() as open_round:
        if open_round.has_round(request.federation, request.round):  # pragma: no cover - the site lock prevents it
            raise Refusal(RefusalCode.ALREADY_SPENT, f"round {request.round} of federation {request.federation} was "
                                                     "already charged here; it is never trained twice")
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
        # Reproducible noise (tests only, P7) is seeded from the ledger, never from a server field (P11).
        secret = round_secret() if policy.seed is None else policy.seed + open_round.rounds_done
        open_round.record(site=policy.site, budget=policy.epsilon, federation=request.federation,
                          round=request.round, sigma=request.sigma, sample_rate=policy.sample_rate,
                          steps=request.steps, delta=policy.delta, accountant=policy.accountant, mechanism=mechanism,
                          state="charged", noise_seed=secret, data_version=ready.data_version,
                          request_digest=digest)
        return dict(open_round.rows[-1])


def _train_charged(request: Any, policy: SitePolicy, ready: SiteCheck, row: dict[str, Any], model: Any,
                   trainable: list[str], *, basis: torch.Tensor | None, seconds_basis: float, chunk: int | None,
                   progress: bool) -> Any:
    """The charged round: private data is read from here on; any failure is already paid for.

    ``basis``: the round's V (None for methods that do not project); ``seconds_basis``: the seconds it took
    (``obtain_basis``); ``chunk``: the rows every chunk is padded to (``capacity.round_chunk``, before the charge;
    None for a replayed round, sized here).
    """
    import torch
    from flwr.app import MetricRecord, RecordDict

    from fedpose.client.evaluation import evaluate_global
    from fedpose.client.optim_state import keep_site_optimizer, site_optimizer
    from fedpose.shared.privacy.step.noise import generator_from_secret, make_generator
    from fedpose.shared.training.provenance import configure_numerics
    from fedpose.shared.training.batches import make_dataset
    from fedpose.shared.training.schedule import round_span
    from fedpose.shared.training.loop import LocalData, LocalRun, local_train, step_spec

    cfg = request.config
    if chunk is None:
        chunk = round_chunk(request, policy, model, trainable)
    configure_numerics(min(cfg.runtime.site_threads, os.cpu_count() or 1), deterministic=cfg.runtime.deterministic)
    checked = load_checked(policy, ready)
    # Only a charged round gets the received model scored at the site: a refused one costs no evaluation.
    evaluate_global(model, policy, checked.private, federation=request.federation, rnd=request.round)
    secret = int(row["noise_seed"])
    if policy.seed is None:
        generator, seeded = generator_from_secret(secret), False
    else:
        generator, seeded = make_generator(secret, "cpu")
    optimizer = site_optimizer(cfg, model, trainable, policy.ledger_path, request.federation)
    data = LocalData(make_dataset(checked.private, cfg, train=True, seed=_augment_seed(secret)),
                     patients=checked.patients, public_pool=checked.public_pool)
    step = step_spec(cfg.train.method, cfg.train, cfg.privacy, sigma=request.sigma, data=data,
                     sample_rate=policy.sample_rate, expected_batch=policy.expected_batch, chunk_size=chunk)
    run = LocalRun(step, request.steps, cfg.train, cfg.privacy,
                   schedule_span=round_span(request.round, request.steps, cfg.federation.rounds))
    result = local_train(model, data, run, generator=generator, basis=basis, optimizer=optimizer,
                         bar=f"{policy.site} round {request.round}" if progress else None)
    ran = (result.sigma, result.sample_rate, result.steps)
    if ran != (row["sigma"], row["sample_rate"], row["steps"]):  # pragma: no cover - local_train runs what it is given
        raise SiteFailure(f"the round ran {ran}, not the charged {(row['sigma'], row['sample_rate'], row['steps'])}")
    named = dict(model.named_parameters())
    weights = {k: named[k].detach() for k in trainable}
    if not all(bool(torch.isfinite(w).all()) for w in weights.values()):
        # Every private contribution was finite and bounded (P14), so this is post-processing of the DP
        # release (e.g. a learning rate that overflows): saying so reveals nothing more. Spent already.
        raise SiteFailure("the round's weights are not finite (the request's optimizer settings overflow)")
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        eps = ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
        run_eps = ledger.epsilon(delta=policy.delta, accountant=policy.accountant, federation=request.federation)
        rounds_done = ledger.rounds_done()
    # Timings, the realised batch sizes and the zeroed contributions track the private data: they stay in
    # this log, never in the reply (P10, P13).
    log.info("site %s round %d: trained %d steps on %s (sigma=%.4f, q=%.4f, B=%g, mean batch %.1f) in %.1f s (+%.1f s "
             "basis); %d non-finite private contributions zeroed, %d public gradients left out; eps spent %.4f of "
             "%.4g", policy.site, request.round, result.steps, next(model.parameters()).device, result.sigma,
             result.sample_rate, policy.expected_batch, result.mean_batch, result.seconds, seconds_basis,
             result.zeroed, result.public_zeroed, eps, policy.epsilon)
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
    store_reply(policy, request.federation, request.round, weights, metrics)
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        ledger.finish(request.federation, request.round)
    keep_site_optimizer(cfg, optimizer, model, trainable, policy.ledger_path, request.federation)
    if request.round >= cfg.federation.rounds:  # the federation's last round: no later round reuses a basis
        drop_basis_cache(policy, request.federation)
    elif basis is not None:
        cache_basis(policy, request.federation, request.basis_version, basis)
    # {**metrics}: a display, so that mypy types it as the record's values (dict is invariant)
    return RecordDict({ARRAYS: weights_record(weights), METRICS: MetricRecord({**metrics})})
