"""The read side of the site ledger: its rows, the accountant history they make and the epsilon they spent
(recomputed from the rows, P5), the claim they support (P12) and the site's events.

``SiteLedger`` (``fedpose.client.ledger``) is these queries plus the writes; none of them changes the file.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from fedpose.client.ledger_schema import spend_history
from fedpose.shared.configuration.methods import RECORD_LEVEL
from fedpose.shared.privacy.accounting.accountant import StepRecord
from fedpose.shared.privacy.accounting.ledger import cumulative_epsilon


class LedgerQueries:
    """Queries over an open site ledger's connection ``conn``."""

    conn: sqlite3.Connection

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM spend ORDER BY id").fetchall()]

    def history(self, federation: str | None = None) -> list[StepRecord]:
        return spend_history([r for r in self.rows() if federation is None or r["federation"] == federation])

    def rounds_done(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM spend").fetchone()[0])

    def epsilon(self, *, delta: float, accountant: str, federation: str | None = None) -> float:
        """Cumulative epsilon of everything recorded (or of one federation's rows), recomputed (P5)."""
        return cumulative_epsilon(self.history(federation), delta=delta, accountant=accountant)

    def row_of(self, federation: str, round: int) -> dict[str, Any] | None:
        """The row of (federation, round), or None when that round was never charged here."""
        row = self.conn.execute("SELECT * FROM spend WHERE federation = ? AND round = ?", (federation, int(round)))
        found = row.fetchone()
        return dict(found) if found is not None else None

    def events(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM events ORDER BY id").fetchall()]

    def units(self) -> set[str]:
        """The privacy units of the recorded rounds (P12): the claim is patient level only when this is {patient}."""
        return {r["unit"] for r in self.rows()}

    def record_level(self) -> bool:
        """True when every row ran a record-level method (dpsgd/proj): only then is the claim record-level (P12)."""
        return all(r["method"] in RECORD_LEVEL for r in self.rows())
