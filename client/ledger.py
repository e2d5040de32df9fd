"""The site's own durable spend ledger (P6, P12, P13): SQLite, WAL, one transaction per charge.

A round is charged on attempt: its budget check and its row (state
``charged``) are one ``BEGIN IMMEDIATE`` transaction (``SiteLedger.round``),
committed BEFORE the first private record is read. Whatever happens after
(a crash, an out-of-memory error, a bug) the round has been paid for, so a
failure that depends on private data is never free. When the round's reply is
stored the row becomes ``done`` and its noise seed is erased. A charged round
that never finished is replayed when it is asked for again: the same noise
seed (drawn from OS entropy at the charge and kept only in this file until
then) on the same data gives the same release, so the round is never spent
twice; on changed data it is refused (``data_version``), since the same noise
on two different datasets would cancel in their difference.

A charged round is one release (P16): its row keeps the digest of the whole
request it was charged for (``request_digest``: weights, basis, every config
field, the app bundle), and only that identical request replays it. A round
that failed after its charge is ``failed`` for good (its noise seed erased,
its answer kept in ``outcome``): every later request for it gets that answer.

This module is the ledger and its writes; beside it: ``fedpose.client.ledger_schema`` (the file's tables, their
migrations, the site a ledger belongs to), ``fedpose.client.ledger_queries`` (the read side) and
``fedpose.client.ledger_round`` (one charge inside its transaction, and the row it writes, P12).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedpose.client.ledger_queries import LedgerQueries
from fedpose.client.ledger_round import OpenRound
from fedpose.client.ledger_schema import open_schema
from fedpose.shared.privacy.accounting.ledger import DEFAULT_BUSY_TIMEOUT, connect, transaction, utc_now


class SiteLedger(LedgerQueries):
    """Spend of one site over its whole life (all federations, all rounds).

    ``site``: the policy's site name; a ledger that records another site is
    refused (a copied or mixed-up file would otherwise hide earlier spend).
    """

    def __init__(self, path: str | Path, *, site: str | None = None,
                 busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> None:
        self.path = Path(path)
        self.busy_timeout = busy_timeout
        self.conn = connect(self.path, busy_timeout=busy_timeout)
        try:
            open_schema(self.conn, self.path, site=site, busy_timeout=busy_timeout)
        except sqlite3.DatabaseError as err:
            self.conn.close()
            raise ValueError(f"site ledger {self.path} is unreadable or not a fedpose ledger: {err}") from err
        except BaseException:
            self.conn.close()
            raise

    def ledger_id(self) -> str:
        """This ledger's own id (made on first use): a backup restored is the same ledger, a fresh file is not."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchone()
        if row is not None:
            return str(row[0])
        import uuid

        value = uuid.uuid4().hex
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            self.conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('ledger_id', ?)", (value,))
        return str(self.conn.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchone()[0])

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SiteLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self, federation: str, round: int) -> None:
        """The round's reply is stored: mark it done and erase its noise seed (a leaked ledger reveals no noise)."""
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            updated = self.conn.execute(
                "UPDATE spend SET state = 'done', noise_seed = NULL WHERE federation = ? AND round = ? "
                "AND state = 'charged'",
                (federation, int(round))).rowcount
        if updated != 1:
            raise ValueError(f"federation {federation} round {round} is not a charged round of {self.path}")

    def fail(self, federation: str, round: int, outcome: str) -> bool:
        """A charged round failed after its charge: final (P16). Its noise seed is erased and ``outcome`` is the
        answer every later request for the round gets; it stays spent. False when the round is not charged (it
        was finished before the failure, or never charged)."""
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            updated = self.conn.execute(
                "UPDATE spend SET state = 'failed', noise_seed = NULL, outcome = ? "
                "WHERE federation = ? AND round = ? AND state = 'charged'", (outcome, federation, int(round))).rowcount
        return updated == 1

    def record_event(self, *, code: int, reason: str, federation: str | None = None, round: int | None = None) -> None:
        """Keep a refusal or a failure for the site's operator (never sent; the spend tables are not touched)."""
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            self.conn.execute("INSERT INTO events (at, federation, round, code, reason) VALUES (?, ?, ?, ?, ?)",
                              (utc_now(), federation, round, int(code), reason[:2000]))

    @contextmanager
    def round(self) -> Iterator[OpenRound]:
        """One charge = one transaction: check the budget inside, ``record`` once, commit on exit.

        Raising inside (a refusal) rolls back: the ledger is unchanged. The site trains only after
        this commits (charge on attempt, P13); centralized bookkeeping may record a done row directly.
        """
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            rows = [dict(r) for r in self.conn.execute("SELECT * FROM spend ORDER BY id").fetchall()]
            yield OpenRound(conn=self.conn, rows=rows)
