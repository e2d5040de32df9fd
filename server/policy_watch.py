"""What each site's policy declares over a federation, and when that changes (issue #9).

A site's ClientApp reads its policy file at every message, so a hospital can edit it while a
federation runs (a smaller budget, a higher minimum sigma, a method withdrawn) or between a crash and
a restart. The server learns of it only through what the site declares when asked: it asks again a
site that refused, missed a round or came back from offline (``server/exchange.py``), compares the
declaration with the one it holds (kept in the ledger's meta, so a resumed server compares across its
own crash), and records every change as a ``policy-changed`` event (report.md, the plot). A site whose
new policy the federation's fixed plan no longer satisfies is marked ``refused`` before it is sent a
request it would refuse; its budget and spend stay exactly as accounted. A refused site is asked again
every round, and rejoins once what it declares has changed and fits the plan again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from fedpose.server.ledger import Event, ServerLedger
from fedpose.server.plan import SitePlan, incompatibility
from fedpose.shared.configuration.schema import Config
from fedpose.shared.flower.messages import SiteInfo

log = logging.getLogger(__name__)

# What a site reports about its spend, not what its policy declares: these change every round.
_NOT_POLICY = ("site", "rounds_done", "epsilon_spent")
_META = "policy/"


def declared(info: SiteInfo) -> dict[str, Any]:
    """The policy part of a site's description, JSON-ready."""
    out = {}
    for f in fields(info):
        if f.name in _NOT_POLICY:
            continue
        value = getattr(info, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``name: old -> new`` for every declared field that differs (a field new on either side counts)."""
    return [f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
            for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


def plan_conflict(plan: SitePlan, info: SiteInfo, cfg: Config) -> str | None:
    """Why the federation's plan for this site no longer fits what it declares now, or None."""
    why = incompatibility(info, cfg)
    if why is not None:
        return why
    if plan.sigma < info.min_sigma:
        return f"needs sigma >= {info.min_sigma:.4g}; the plan sends {plan.sigma:.4g}"
    if plan.sample_rate != info.sample_rate:
        return f"declares sample rate {info.sample_rate:.4g}; the plan was calibrated at {plan.sample_rate:.4g}"
    if info.epsilon < plan.epsilon:
        return f"budget epsilon {info.epsilon:g} is below the {plan.epsilon:g} this federation planned"
    if info.delta < plan.delta:
        return f"delta {info.delta:g} is below the {plan.delta:g} this federation planned"
    if info.accountant != plan.accountant:
        return f"accounts with {info.accountant}; the plan uses {plan.accountant}"
    return None


def watch(ledger: ServerLedger, plans: Mapping[str, SitePlan], infos: Mapping[str, SiteInfo],
          cfg: Config) -> list[Event]:
    """Compare what ``infos`` declare with what the ledger holds; store them; return the change events.

    An active site whose declaration no longer fits its plan is marked refused (not asked again); a
    refused site whose declaration changed and fits the plan again is active again (a hospital that
    undoes or fixes its change rejoins; one that changed nothing stays out, so a refusal the
    declaration cannot explain is not retried every round).
    """
    events: list[Event] = []
    statuses: dict[str, tuple[str, str]] = {}
    current = ledger.statuses()
    for site, info in sorted(infos.items()):
        now = declared(info)
        stored = ledger.get_meta(_META + site)
        diff = changes(json.loads(stored), now) if stored is not None else []
        if diff:
            log.warning("site %s changed its policy: %s", site, "; ".join(diff))
            events.append(Event(site=site, kind="policy-changed", code=0, reason="; ".join(diff)))
        if stored is None or diff:
            ledger.set_meta(_META + site, json.dumps(now, sort_keys=True))
        status = current.get(site, ("", ""))[0]
        if site not in plans or status not in ("active", "refused"):
            continue
        conflict = plan_conflict(plans[site], info, cfg)
        if conflict is not None and status == "active":
            log.warning("site %s: its policy no longer fits this federation's plan (%s): not asked again", site,
                        conflict)
            statuses[site] = ("refused", f"its policy changed: {conflict}")
        elif conflict is None and status == "refused" and diff:
            log.info("site %s changed its policy and fits the plan again: it is asked again", site)
            statuses[site] = ("active", "its policy changed and fits the plan again")
    if statuses:
        ledger.set_statuses(statuses)
    return events
