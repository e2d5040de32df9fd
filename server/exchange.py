"""Talking to the sites over Flower's Grid: wait for nodes, ask who they are, send a round's requests
and collect the replies, refresh who is connected and choose who takes part in a round.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fedpose.server.ledger import Event, ServerLedger
from fedpose.server.plan import SitePlan, can_afford
from fedpose.server.policy_watch import watch
from fedpose.server.replies import Reply
from fedpose.shared.configuration.schema import Config
from fedpose.shared.flower.messages import CONFIG, INFO, SiteInfo, parse_spend_suffix, payload_bytes

log = logging.getLogger(__name__)

QUERY_TIMEOUT = 300.0  # seconds for the sites' first answer (includes ClientApp start-up)


def wait_for_nodes(grid: Any, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        ids = sorted(grid.get_node_ids())
        if len(ids) >= count:
            return ids
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ids)} of the {count} sites needed (federation.min_sites) connected "
                               f"within {timeout:.0f} s")
        time.sleep(1.0)


def query_sites(grid: Any, nodes: list[int], cfg: Config) -> dict[str, tuple[int, SiteInfo]]:
    """Ask every node who it is; returns site -> (node id, info). Nodes that fail to answer are left out.

    The query is empty: a site describes itself from its policy and ledger, and checks P2 (its
    private images against the public set its operator approved) itself, never against anything
    the server sends (a server-sent hash would be a membership oracle).
    """
    return ask_sites(grid, nodes, cfg)[0]


# Seconds between two pulls for replies. Flower's own Grid.send_and_receive waits 3 s between pulls, which
# every round paid, 1.5 s on average, after its last reply had arrived; a pull is one small request.
REPLY_POLL = 0.2


def send_and_receive(grid: Any, messages: list[Any], *, timeout: float) -> list[Any]:
    """Push ``messages``, then pull their replies every ``REPLY_POLL`` s until all came or ``timeout`` passed."""
    waiting = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Any] = []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(REPLY_POLL)
    return replies


def ask_sites(grid: Any, nodes: list[int], cfg: Config) -> tuple[dict[str, tuple[int, SiteInfo]], set[int]]:
    """``query_sites``, and the nodes from which no answer came at all.

    A node is silent when the SuperLink answered for it ("Node Unavailable": its heartbeat lapsed)
    or nothing came before the timeout. A node that answered with an error (its site refused, its
    operator did not approve this app) is not silent: asking it again would get the same answer.
    """
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    msgs = [Message(RecordDict({CONFIG: ConfigRecord({})}), dst_node_id=nid, message_type=MessageType.QUERY)
            for nid in nodes]
    sites: dict[str, tuple[int, SiteInfo]] = {}
    answered: set[int] = set()
    for m in send_and_receive(grid, msgs, timeout=min(QUERY_TIMEOUT, cfg.federation.round_timeout)):
        nid = m.metadata.src_node_id
        if nid not in nodes:  # the SuperLink answering for a node it lost ("Node Unavailable")
            log.warning("a node did not describe itself (code %d): %s", m.error.code if m.has_error() else -1,
                        str(m.error.reason)[:300] if m.has_error() else "unexpected sender")
            continue
        answered.add(nid)
        if m.has_error():
            reason, _ = parse_spend_suffix(str(m.error.reason))
            log.warning("node %d did not describe itself (code %d): %s", nid, m.error.code, reason[:300])
            continue
        try:
            info = SiteInfo.from_record(m.content[INFO])
        except (KeyError, ValueError) as err:
            log.warning("node %d sent a malformed site description: %s", nid, err)
            continue
        if info.site in sites:
            log.warning("node %d claims site %s, already held by node %d: ignored", nid, info.site, sites[info.site][0])
            continue
        sites[info.site] = (nid, info)
    log.info("sites: %s", {s: (nid, i.sample_rate) for s, (nid, i) in sorted(sites.items())})
    return sites, set(nodes) - answered


def describe_sites(grid: Any, cfg: Config, *, poll: float = 5.0) -> dict[str, tuple[int, SiteInfo]]:
    """Wait for ``min_sites`` nodes and ask who they are, waiting for the nodes that did not answer at all.

    After a SuperLink restart its database lists every node that was online until that node's
    heartbeat lapses, even one whose SuperNode has not reconnected yet: the query to it comes back
    "Node Unavailable". While fewer than ``min_sites`` sites have described themselves, such silent
    nodes (once online again) and nodes that connect later are asked every ``poll`` seconds, up to
    ``federation.round_timeout``. When every node answered, refusals included, nothing is waited for.
    """
    need = cfg.federation.min_sites
    deadline = time.monotonic() + cfg.federation.round_timeout
    nodes = wait_for_nodes(grid, need, cfg.federation.round_timeout)
    sites, silent = ask_sites(grid, nodes, cfg)
    asked = set(nodes)
    if len(sites) < need and silent:
        log.info("%d of min_sites %d sites described themselves; waiting up to %.0f s for node(s) %s, which did "
                 "not answer (a SuperNode still reconnecting?)", len(sites), need, cfg.federation.round_timeout,
                 sorted(silent))
    while len(sites) < need and silent and time.monotonic() < deadline:
        time.sleep(poll)
        online = set(grid.get_node_ids())
        ask = sorted((online & silent) | (online - asked))
        if not ask:
            continue
        found, still = ask_sites(grid, ask, cfg)
        asked |= set(ask)
        silent = (silent - set(ask)) | still
        for site, entry in found.items():
            log.info("node %d answered: site %s", entry[0], site)
            sites.setdefault(site, entry)
    return sites


def exchange(grid: Any, contents: dict[str, Any], nodes: dict[str, int], round: int, timeout: float) -> list[Reply]:
    """Send each site its RecordDict, collect replies (missing ones become 'missing' errors)."""
    from flwr.app import Message, MessageType
    from flwr.common.constant import ErrorCode

    by_node = {nodes[s]: s for s in contents}
    msgs = [Message(content, dst_node_id=nodes[site], message_type=MessageType.TRAIN, group_id=str(round))
            for site, content in contents.items()]
    replies = []
    t0 = time.monotonic()
    for m in send_and_receive(grid, msgs, timeout=timeout):
        site = by_node.get(m.metadata.src_node_id)
        if site is None:
            continue
        if m.has_error():
            replies.append(Reply(site=site, error_code=int(m.error.code), error_reason=str(m.error.reason),
                                 bytes_up=len(str(m.error.reason))))
        else:
            replies.append(Reply(site=site, content=m.content, bytes_up=payload_bytes(m.content)))
    answered = {r.site for r in replies}
    elapsed = time.monotonic() - t0
    online = set(grid.get_node_ids())
    for site in contents:
        if site not in answered:
            if nodes[site] not in online:
                cause = (f"its SuperNode went offline (no reply after {elapsed:.0f} s); "
                         "it is asked again when it is back")
            elif elapsed < timeout - 1:
                cause = f"no reply after {elapsed:.0f} s: its message expired or the node restarted mid-round"
            else:
                cause = f"no reply within the round timeout of {timeout:.0f} s"
            replies.append(Reply(site=site, error_code=int(ErrorCode.NODE_UNAVAILABLE), error_reason=cause))
    return replies


def refresh_nodes(grid: Any, node_of: dict[str, int], plans: dict[str, SitePlan], cfg: Config,
                  recheck: set[str] | None = None) -> tuple[list[str], dict[str, SiteInfo]]:
    """Map sites to the nodes connected now: a site that came back (same or new node id) is asked again.

    Nodes not seen before are asked who they are, and so are the sites in ``recheck`` (those that
    refused, missed a round or were offline: they may have changed their policy) once their node is
    online; each site that answered is removed from ``recheck``, a site asked that did not describe
    itself stays in it (``unready``: it is not asked to train until it answers). Returns the planned
    sites whose node is offline this round and what every site asked declared.
    """
    recheck = set() if recheck is None else recheck
    online = set(grid.get_node_ids())
    ask = set(online - set(node_of.values()))
    ask |= {node_of[s] for s in recheck if s in node_of and node_of[s] in online}
    infos: dict[str, SiteInfo] = {}
    if ask:
        for site, (nid, info) in query_sites(grid, sorted(ask), cfg).items():
            infos[site] = info
            recheck.discard(site)
            if site in plans:
                if node_of.get(site) != nid:
                    log.info("site %s is back (node %d): it is asked again", site, nid)
                node_of[site] = nid
    offline = sorted(s for s in plans if node_of.get(s) not in online)
    recheck |= set(offline)
    return offline, infos


def unready(plans: dict[str, SitePlan], node_of: dict[str, int], recheck: set[str], offline: list[str]) -> set[str]:
    """Planned sites whose node is online but which did not describe themselves when asked again (after a missed
    round, a refusal or a restart): a node that stopped answering may stay listed until its heartbeat lapses,
    and a train message to it would leave the others training for a round that cannot be aggregated."""
    return {s for s in recheck if s in plans and s in node_of and s not in offline}


def sites_for_round(grid: Any, node_of: dict[str, int], plans: dict[str, SitePlan], ledger: ServerLedger,
                    cfg: Config, rnd: int, *, recheck: set[str] | None = None,
                    poll: float = 5.0) -> tuple[list[str], list[str], list[Event], dict[str, str]]:
    """The sites to ask in round ``rnd``, the planned sites whose SuperNode is offline, policy changes, and why
    each site with budget left cannot take part now.

    Sites in ``recheck`` are asked again what their policy declares (``server/policy_watch.py``):
    a change is an event, and a site whose policy no longer fits its plan is not asked to train; a
    site that does not answer is not asked to train either.

    A site with budget left whose SuperNode is offline (crashed, restarting) or silent is waited for,
    up to ``federation.round_timeout``, when without it fewer than ``min_sites`` could train: no site
    is asked to train for a round that could not be aggregated. A site whose next round would exceed
    its budget or its planned rounds is marked (``fedpose.server.outcome.closing_status``) and never asked again.
    """
    from fedpose.server.outcome import closing_status

    recheck = set() if recheck is None else recheck
    deadline = time.monotonic() + cfg.federation.round_timeout
    events: list[Event] = []
    while True:
        offline, infos = refresh_nodes(grid, node_of, plans, cfg, recheck)
        silent = unready(plans, node_of, recheck, offline)
        events += watch(ledger, plans, infos, cfg)
        statuses = ledger.statuses()
        newly: dict[str, tuple[str, str]] = {}
        active, waiting = [], {}
        for site in sorted(plans):
            if statuses[site][0] != "active":
                continue
            history, spent = ledger.history(site, asking=rnd), ledger.counted_epsilon(site, asking=rnd)
            if not can_afford(plans[site], history, site_epsilon=spent):
                newly[site] = closing_status(plans[site], history, spent,
                                             unanswered=ledger.unanswered(site, asking=rnd))
                log.info("site %s: %s (%s): not sampled again", site, *newly[site])
            elif site in silent:
                waiting[site] = "its SuperNode is listed but did not answer when asked again"
            elif site in node_of and site not in offline:
                active.append(site)
            else:
                waiting[site] = "its SuperNode is offline"
        if newly:
            ledger.set_statuses(newly)
        left = deadline - time.monotonic()
        if len(active) >= cfg.federation.min_sites or not waiting or left <= 0:
            if waiting and len(active) < cfg.federation.min_sites:
                log.warning("round %d: %s still cannot take part after %.0f s", rnd,
                            "; ".join(f"{s}: {why}" for s, why in waiting.items()), cfg.federation.round_timeout)
            return active, offline, events, waiting
        log.info("round %d: waiting for %s (%d of min_sites %d can take part; %.0f s left)", rnd,
                 "; ".join(f"{s}: {why}" for s, why in waiting.items()), len(active), cfg.federation.min_sites, left)
        time.sleep(min(poll, max(left, 0.1)))
