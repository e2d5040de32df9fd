"""How a federation run ends, and what its folder says about it afterwards.

- One server per run folder: ``sole_server`` holds an exclusive lock on ``server.lock`` (with the
  server's pid in it) for the whole run, so ``fedpose server status`` can tell a running server from
  one that died (``held``): a folder no process holds and that has no ``metrics.json`` is ``stopped``.
- A run that cannot go on stops with ``FederationStopped``, one line that says why; ``outcome.json``
  keeps that line (``record_failure``) for ``server status``, the console and ``server run``.
- The sites' labels: ``closing_status`` says, from the server ledger, whether a site that is no
  longer asked finished its planned rounds, spent its budget, or was left when the federation ended.
- A round that is not aggregated still cost every site whose update was accepted:
  ``discarded_events`` names them, with what they spent, in the ledger's events.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpose.server.ledger import Event, ServerLedger
from fedpose.server.plan import SitePlan, can_afford
from fedpose.shared.privacy.accounting.accountant import StepRecord

log = logging.getLogger(__name__)

OUTCOME = "outcome.json"
LOCK = "server.lock"


class FederationStopped(RuntimeError):
    """The federation cannot go on (too few sites can take part); the message is one line that says why."""


@contextmanager
def sole_server(out: Path, wait: float = 300.0) -> Iterator[None]:
    """One server per run folder: a resumed server waits (bounded) for an old one that is still winding down."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK, "a+") as fh:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another server still runs on {out} after {wait:.0f} s: stop it first") from None
                log.info("another server still holds %s: waiting for it to stop", out)
                time.sleep(2.0)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def held(out: Path) -> bool:
    """Whether a server process holds the run folder ``out`` now (its lock is taken)."""
    import fcntl

    try:
        fh = open(out / LOCK)  # noqa: SIM115 - closed below; read-only: status never writes into a run folder
    except OSError:
        return False
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        fh.close()  # releases the shared lock, if taken
    return False


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, (FederationStopped, ValueError)) else f"{type(err).__name__}: {text}"


def record_failure(out: Path, err: BaseException) -> None:
    """Keep why the run ended without finishing in ``out/outcome.json`` (the process's log has the detail)."""
    tmp = out / (OUTCOME + ".tmp")
    tmp.write_text(json.dumps({"state": "failed", "reason": one_line(err),
                               "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    tmp.replace(out / OUTCOME)


def clear_outcome(out: Path) -> None:
    (out / OUTCOME).unlink(missing_ok=True)


def read_outcome(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / OUTCOME).read_text())
    except (OSError, ValueError):
        return None


def closing_status(plan: SitePlan, history: list[StepRecord], epsilon: float, *,
                   unanswered: int = 0) -> tuple[str, str]:
    """A site's label once it is not asked again: ``finished`` (its planned rounds are done), ``exhausted``
    (another round would exceed its budget before that) or ``stopped`` (the federation ended first, or requests
    that got no answer, counted as spent, used up its planned rounds). ``unanswered``: the rows of ``history``
    that are such requests (attempted), which count against the budget but are not rounds done."""
    done = len(history) - unanswered
    spent = f"eps {epsilon:.4f} of {plan.epsilon:g}"
    asked = f", and {unanswered} more asked without an answer (counted as spent)" if unanswered else ""
    if done >= plan.rounds:
        return "finished", f"{done} of {plan.rounds} planned rounds done{asked}; {spent}"
    if len(history) < plan.rounds and not can_afford(plan, history, site_epsilon=epsilon):
        return "exhausted", f"another round would exceed its budget, after {done} of {plan.rounds} planned " \
                            f"rounds{asked}; {spent}"
    return "stopped", f"the federation ended after {done} of its {plan.rounds} planned rounds{asked}; {spent}"


def final_statuses(ledger: ServerLedger, plans: dict[str, SitePlan]) -> dict[str, tuple[str, str]]:
    """The labels of the sites still ``active`` when the federation ends: none stays ``active``."""
    return {site: closing_status(plans[site], ledger.history(site), ledger.counted_epsilon(site),
                                 unanswered=ledger.unanswered(site))
            for site, (status, _) in ledger.statuses().items() if status == "active" and site in plans}


def discarded_events(rnd: int, valid: int, min_sites: int, cost: dict[str, tuple[float, float, float]]) -> list[Event]:
    """One event per site whose accepted update of a round that was not aggregated was thrown away; ``cost``:
    site -> (eps before the round, eps after it, budget)."""
    return [Event(site=site, kind="discarded", code=0,
                  reason=f"round {rnd} was not aggregated ({valid} valid repl{'y' if valid == 1 else 'ies'} < "
                         f"federation.min_sites {min_sites}): the site trained, paid eps {after - before:.4f} "
                         f"(now {after:.4f} of {budget:g}) and its update was thrown away")
            for site, (before, after, budget) in sorted(cost.items())]
