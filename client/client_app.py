"""Flower ClientApp of a hospital site: thin glue around ``fedpose.client.site``.

Deployment (one SuperNode per hospital)::

    flower-supernode --superlink SERVER:PORT --root-certificates ca.crt \\
        --auth-supernode-private-key site.key \\
        --node-config "site-policy='/etc/fedpose/policy.yaml'"

Simulation: each virtual node's policy is derived from its partition id
(see ``fedpose.client.policy_resolve.resolve_policy``).

Messages handled: ``query`` (who are you, what do you accept) and ``train``
(one round of local FP-DP-SGD). A refusal, and any failure, is a typed
``Error`` reply (``fedpose.shared.flower.messages.RefusalCode``) ending with the
site's spend; its text never depends on private data (P10).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from fedpose.client.policy_resolve import resolve_policy
from fedpose.client.site import handle_train
from fedpose.client.data import site_info, spend_so_far
from fedpose.shared.flower.app_logging import setup_app_logging
from fedpose.shared.flower.messages import CONFIG, INFO, Refusal, RefusalCode, spend_suffix

log = logging.getLogger(__name__)

app = ClientApp()


def setup_logging() -> None:
    setup_app_logging("fedpose.client", "fedpose.shared")


def _error(msg: Message, policy: Any, code: int, reason: str, federation: str | None,
           round: int | None = None) -> Message:
    """A typed error reply whose reason ends with the site's spend from its own ledger (when readable); the
    refusal is also kept in the site's own ledger for its operator (``fedpose site status``)."""
    from fedpose.client.ledger import SiteLedger

    try:
        with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
            ledger.record_event(code=code, reason=reason, federation=federation, round=round)
    except (OSError, ValueError) as err:
        log.error("site %s: cannot record the refusal in its ledger: %s", policy.site, err)
    try:
        spend = spend_so_far(policy, federation)
        reason += spend_suffix(site_epsilon=spend["site_epsilon"], run_epsilon=spend["run_epsilon"],
                               site_rounds=int(spend["site_rounds"]))
    except (OSError, ValueError) as err:
        log.error("site %s: cannot read its ledger for the refusal: %s", policy.site, err)
    return Message(Error(code=code, reason=reason), reply_to=msg)


def _field(content: Any, key: str, kind: type) -> Any:
    try:
        value = content[CONFIG][key]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that cannot be read."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _answer(msg: Message, policy: Any, work: Callable[[], RecordDict], content: Any = None) -> Message:
    """Run ``work``; a refusal or any failure becomes a typed error reply that reveals nothing private (P10).

    The site's own log says what each message cost it: the time its process took to start (Python, imports,
    the bundle's install) and the time the message took. Local only, like every log line.
    """
    federation = _field(content, "federation", str) if content is not None else None
    round = _field(content, "round", int) if content is not None else None
    age, started = process_age(), time.monotonic()
    try:
        return Message(work(), reply_to=msg)
    except Refusal as refusal:
        log.warning("site %s refuses: %s", policy.site, refusal)
        return _error(msg, policy, int(refusal.code), refusal.reason, federation, round)
    except Exception:  # noqa: BLE001 - the detail may name private files: it stays in this log
        log.exception("site %s failed while handling a %s message", policy.site, msg.metadata.message_type)
        return _error(msg, policy, int(RefusalCode.SITE_ERROR), "the site failed; the detail is in its own log",
                      federation, round)
    finally:
        log.info("site %s: %s message handled in %.2f s; its process had started %s s before", policy.site,
                 msg.metadata.message_type, time.monotonic() - started, "?" if age is None else f"{age:.2f}")


def on_query(msg: Message, context: Context, run_config: dict | None = None) -> Message:
    """Reply with this site's ``SiteInfo``: its policy's public declarations and its spend so far.

    The query must carry an empty ``config``: nothing the server sends is ever compared with private data
    (a probe field gets the same refusal whatever its value). ``run_config`` replaces
    ``context.run_config`` (empty under ``run_simulation``).
    """
    setup_logging()
    policy = resolve_policy(context.node_config, context.run_config if run_config is None else run_config)

    def work() -> RecordDict:
        proposal = msg.content.config_records.get(CONFIG)
        if proposal is None or len(proposal) or set(msg.content.keys()) != {CONFIG}:
            raise Refusal(RefusalCode.BAD_REQUEST, "a query carries an empty config record and nothing else")
        return RecordDict({INFO: site_info(policy).to_record()})

    return _answer(msg, policy, work)


def on_train(msg: Message, context: Context, run_config: dict | None = None) -> Message:
    """One round of local training, or a typed refusal with nothing trained and nothing spent (P6, P11)."""
    setup_logging()
    policy = resolve_policy(context.node_config, context.run_config if run_config is None else run_config)
    return _answer(msg, policy, lambda: handle_train(msg.content, policy), msg.content)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return on_query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return on_train(msg, context)
