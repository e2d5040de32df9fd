"""Flower ClientApp of a hospital site: thin glue around ``client.site``.

Deployment (one SuperNode per hospital)::

    flower-supernode --superlink SERVER:PORT --root-certificates ca.crt \\
        --auth-supernode-private-key site.key \\
        --node-config "site-policy='/etc/fedpose/policy.yaml' data-path='/data/site'"

Simulation: each virtual node's policy is derived from its partition id
(see ``client.site.resolve_policy``).

Messages handled: ``query`` (who are you, what do you accept) and ``train``
(one round of local FP-DP-SGD). A refusal is a typed ``Error`` reply
(``shared.federation_messages.RefusalCode``); only bugs raise.
"""

from __future__ import annotations

import logging

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp

from client.site import handle_train, resolve_policy, site_info
from shared.app_logging import setup_app_logging
from shared.federation_messages import CONFIG, INFO, Refusal

log = logging.getLogger(__name__)

app = ClientApp()


def setup_logging() -> None:
    setup_app_logging("client", "shared")


def on_query(msg: Message, context: Context, run_config: dict | None = None) -> Message:
    """Reply with this site's ``SiteInfo`` for the proposed batch size and local steps.

    ``run_config`` replaces ``context.run_config`` (empty under ``run_simulation``).
    """
    setup_logging()
    policy = resolve_policy(context.node_config, context.run_config if run_config is None else run_config)
    proposal = msg.content[CONFIG]
    try:
        info = site_info(policy, batch_size=int(proposal["batch-size"]), local_steps=int(proposal["local-steps"]),
                         public_hashes=list(proposal.get("public-hashes", [])))
    except Refusal as refusal:
        log.warning("site %s refuses to join: %s", policy.site, refusal)
        return Message(Error(code=int(refusal.code), reason=refusal.reason), reply_to=msg)
    return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)


def on_train(msg: Message, context: Context, run_config: dict | None = None) -> Message:
    """One round of local training, or a typed refusal with nothing trained (P6)."""
    setup_logging()
    policy = resolve_policy(context.node_config, context.run_config if run_config is None else run_config)
    try:
        content = handle_train(msg.content, policy)
    except Refusal as refusal:
        log.warning("site %s refuses: %s", policy.site, refusal)
        return Message(Error(code=int(refusal.code), reason=refusal.reason), reply_to=msg)
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return on_query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return on_train(msg, context)
