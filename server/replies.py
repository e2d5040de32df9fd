"""The sites' replies to a round, as data (``Reply``), sorted into updates to average, spends to
record, refusals and rejections (``process_replies``); never averaged when rejected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fedpose.server.basis import BasisKeeper
from fedpose.server.ledger import Event, Report, Spend, attempted
from fedpose.server.plan import SitePlan
from fedpose.server.validate import parse_ran, parse_weights, update_norm
from fedpose.shared.flower.messages import RefusalCode, parse_spend_suffix

log = logging.getLogger(__name__)


def node_unavailable() -> int:
    """Flower's error code for a node that did not answer (also what ``exchange`` gives a missing reply)."""
    from flwr.common.constant import ErrorCode

    return int(ErrorCode.NODE_UNAVAILABLE)


@dataclass
class Reply:
    """A site's answer, independent of Flower's Message (so it can be processed and tested as data)."""

    site: str
    content: Any = None  # RecordDict, or None for an error reply
    error_code: int | None = None
    error_reason: str = ""
    bytes_up: int = 0


@dataclass
class RoundOutcome:
    updates: list[dict[str, torch.Tensor]] = field(default_factory=list)
    spends: list[Spend] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    statuses: dict[str, tuple[str, str]] = field(default_factory=dict)
    need_basis: list[str] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    seeded: bool = False  # a site ran with a fixed noise seed (P7: not for production)


def process_replies(replies: list[Reply], *, expected: dict[str, torch.Size], plans: dict[str, SitePlan],
                    keeper: BasisKeeper | None = None, global_weights: dict[str, torch.Tensor] | None = None,
                    max_update_norm: float | None = None) -> RoundOutcome:
    """Sort replies into updates to average, spends to record, refusals and rejections (logged, never averaged).

    A refusal's reason ends with the site's own spend: it is kept as a report, so spend the server never
    saw a reply for still counts. An update whose norm exceeds ``max_update_norm`` is rejected.
    """
    out = RoundOutcome()
    for r in replies:
        if r.error_code is not None:
            code = r.error_code
            kind = "refused" if code >= 1000 else "missed" if code == node_unavailable() else "error"
            reason, spend = parse_spend_suffix(r.error_reason)
            if spend is not None:
                out.reports.append(Report(site=r.site, source="refusal", site_epsilon=spend["site-epsilon"],
                                          run_epsilon=spend["run-epsilon"], site_rounds=int(spend["site-rounds"])))
            log.warning("site %s: %s (code %d): %s", r.site, kind, code, reason[:300])
            if code == RefusalCode.NEED_BASIS:
                out.need_basis.append(r.site)
                if keeper is not None:
                    keeper.forget(r.site)
                continue
            if spend is None and r.site in plans:
                # Only the site's own report says it spent nothing: no answer, a Flower error (a SuperNode killed
                # mid-round comes back as "node unavailable", "ClientApp crashed" or "reply unavailable") or a
                # refusal without its spend may follow a charged round (P13).
                out.spends.append(attempted(plans[r.site]))
            out.events.append(Event(site=r.site, kind=kind, code=code, reason=reason))
            if code == RefusalCode.BUDGET:
                out.statuses[r.site] = ("exhausted", reason)
            elif code in (RefusalCode.WEAKER_NOISE, RefusalCode.POLICY, RefusalCode.MISCONFIGURED):
                out.statuses[r.site] = ("refused", reason)
            elif code == RefusalCode.BAD_BASIS and keeper is not None:
                keeper.forget(r.site)
            continue
        try:
            ran = parse_ran(r.content)
        except ValueError as err:
            log.warning("site %s: reply rejected, spend unknown (counted at the plan): %s", r.site, err)
            out.events.append(Event(site=r.site, kind="rejected", code=0, reason=str(err)))
            if r.site in plans:
                out.spends.append(attempted(plans[r.site]))
            continue
        plan = plans[r.site]
        if (ran.sigma, ran.sample_rate, ran.steps) != (plan.sigma, plan.sample_rate, plan.steps_per_round):
            log.warning("site %s ran sigma=%g q=%g steps=%d, planned %g/%g/%d: recording what ran", r.site,
                        ran.sigma, ran.sample_rate, ran.steps, plan.sigma, plan.sample_rate, plan.steps_per_round)
        try:
            weights = parse_weights(r.content, expected)
            if max_update_norm is not None and global_weights is not None:
                norm = update_norm(weights, global_weights)
                if not norm <= max_update_norm:
                    raise ValueError(f"update norm {norm:.4g} exceeds federation.max_update_norm={max_update_norm:g}")
        except ValueError as err:
            log.warning("site %s: reply rejected, not averaged (its spend is recorded): %s", r.site, err)
            out.events.append(Event(site=r.site, kind="rejected", code=0, reason=str(err)))
            weights = None
        out.spends.append(Spend(site=r.site, sigma=ran.sigma, sample_rate=ran.sample_rate, steps=ran.steps,
                                site_epsilon=ran.site_epsilon, run_epsilon=ran.run_epsilon,
                                aggregated=weights is not None))
        if weights is not None:
            out.updates.append(weights)
            out.accepted.append(r.site)
            out.seeded = out.seeded or bool(r.content["metrics"]["seeded"])
            if keeper is not None:
                keeper.mark_held(r.site)
    return out
