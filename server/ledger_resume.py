"""Resuming the server ledger from a checkpoint (``fedpose server --resume``): the rows the checkpoint holds are
restored if the database lost them, rows of later rounds (committed, never checkpointed) are kept as
``interrupted`` (that spend happened), and requests sent after the checkpoint without an answer count at the plan
as ``attempted`` (``fedpose.server.ledger``)."""

from __future__ import annotations

import logging
from typing import Any

from fedpose.server.ledger import ServerLedger, attempted
from fedpose.shared.privacy.accounting.ledger import transaction

log = logging.getLogger(__name__)


def _put(ledger: ServerLedger, insert: str, row: dict[str, Any]) -> None:
    """``insert`` ("INSERT [OR REPLACE] INTO table") one checkpointed row, its columns named by its keys."""
    ledger.conn.execute(f"{insert} ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))


def reconcile(ledger: ServerLedger, snapshot: dict[str, Any], *, through_round: int) -> int:
    """Make the ledger agree with a checkpoint taken after ``through_round``; returns rows marked interrupted.

    Rows the checkpoint holds must be present and identical; if the
    database lost them (deleted, replaced), they are restored from the
    checkpoint. Rows of later rounds (committed, never checkpointed) are
    kept and marked ``interrupted``: that spend happened.
    """
    stored = {r["id"]: r for r in snapshot["spend"]}
    with transaction(ledger.conn):
        for site in snapshot["sites"]:
            _put(ledger, "INSERT OR REPLACE INTO sites", site)
        for key, value in snapshot["meta"].items():
            ledger.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        restored = 0
        for row_id, row in stored.items():
            have = ledger.conn.execute("SELECT * FROM spend WHERE id = ?", (row_id,)).fetchone()
            if have is None or dict(have) != row:
                _put(ledger, "INSERT OR REPLACE INTO spend", row)
                restored += 1
        if restored:
            log.warning("ledger %s: restored %d spend rows from the checkpoint", ledger.path, restored)
        for report in snapshot.get("reports", []):
            if ledger.conn.execute("SELECT 1 FROM reports WHERE id = ?", (report["id"],)).fetchone() is None:
                _put(ledger, "INSERT INTO reports", report)
        for event in snapshot["events"]:
            if ledger.conn.execute("SELECT 1 FROM events WHERE id = ?", (event["id"],)).fetchone() is None:
                _put(ledger, "INSERT INTO events", event)
        cur = ledger.conn.execute(
            "UPDATE spend SET state = 'interrupted' WHERE round > ? AND state = 'completed'", (through_round,)
        )
        interrupted = cur.rowcount
    if interrupted:
        log.warning("ledger %s: %d spend rows of an interrupted round (> %d) kept as spent",
                    ledger.path, interrupted, through_round)
    plans = ledger.plans()
    unanswered = ledger.conn.execute(  # sent, then the server died: it may have been spent
        "SELECT DISTINCT round, site FROM sent WHERE round > ? AND NOT EXISTS (SELECT 1 FROM spend WHERE"
        " spend.site = sent.site AND spend.round = sent.round) ORDER BY round, site", (through_round,)).fetchall()
    for rnd, site in unanswered:
        if site in plans:
            log.warning("ledger %s: %s was asked to train round %d before the server stopped: counted at the "
                        "plan until its own report covers it", ledger.path, site, rnd)
            ledger.record_round(rnd, [attempted(plans[site])], [])
    return interrupted
