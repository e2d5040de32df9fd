"""The site's own durable spend ledger (P6): SQLite, WAL, one transaction per round.

A round is checked, trained and recorded inside ONE ``BEGIN IMMEDIATE``
transaction (``SiteLedger.round``): the budget check sees every committed
round, a concurrent request waits for the lock instead of passing the same
check, and a process killed while training leaves no row (nothing was
released: the reply is sent only after the commit). Spend is therefore
recorded before it can leave the site, never after.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.privacy.accountant import StepRecord
from shared.privacy.ledger import (
    DEFAULT_BUSY_TIMEOUT,
    check_entry,
    connect,
    cumulative_epsilon,
    transaction,
    utc_now,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spend (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    site TEXT NOT NULL,
    federation TEXT NOT NULL,
    round INTEGER NOT NULL,
    sigma REAL NOT NULL,
    sample_rate REAL NOT NULL,
    steps INTEGER NOT NULL,
    delta REAL NOT NULL,
    epsilon REAL NOT NULL,          -- cumulative over the whole ledger after this row
    budget REAL NOT NULL,           -- the site's epsilon budget when the row was written
    accountant TEXT NOT NULL,
    recorded_at TEXT NOT NULL
);
"""


@dataclass
class OpenRound:
    """The state seen inside a round's transaction; ``record`` writes the round's one row."""

    conn: sqlite3.Connection
    history: list[StepRecord]
    rounds_done: int
    recorded: bool = False

    def epsilon_after(self, record: StepRecord, *, delta: float, accountant: str) -> float:
        return cumulative_epsilon([*self.history, record], delta=delta, accountant=accountant)

    def record(
        self, *, site: str, federation: str, round: int, sigma: float, sample_rate: float, steps: int,
        delta: float, budget: float, accountant: str,
    ) -> float:
        """Insert the round's row (validated first); returns the cumulative epsilon written."""
        if self.recorded:
            raise ValueError("this round already has its ledger row; one row per round")
        entry = check_entry(sigma=sigma, sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant)
        eps = self.epsilon_after(entry, delta=delta, accountant=accountant)
        self.conn.execute(
            "INSERT INTO spend (site, federation, round, sigma, sample_rate, steps, delta, epsilon, budget, accountant,"
            " recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (site, federation, int(round), float(sigma), float(sample_rate), int(steps), float(delta), eps,
             float(budget), accountant, utc_now()),
        )
        self.history.append(entry)
        self.recorded = True
        return eps


class SiteLedger:
    """Spend of one site over its whole life (all federations, all rounds)."""

    def __init__(self, path: str | Path, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> None:
        self.path = Path(path)
        self.conn = connect(self.path, busy_timeout=busy_timeout)
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise ValueError(f"site ledger {self.path} has schema {version}, this fedpose reads {SCHEMA_VERSION}")
        if version == 0:
            with transaction(self.conn):
                for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                    self.conn.execute(statement)
                self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        tables = {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "spend" not in tables:
            raise ValueError(f"{self.path} is not a fedpose site ledger (no 'spend' table)")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SiteLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def history(self) -> list[StepRecord]:
        rows = self.conn.execute("SELECT sigma, sample_rate, steps FROM spend ORDER BY id").fetchall()
        return [StepRecord(sigma=r[0], sample_rate=r[1], steps=r[2]) for r in rows]

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM spend ORDER BY id").fetchall()]

    def rounds_done(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM spend").fetchone()[0])

    def epsilon(self, *, delta: float, accountant: str) -> float:
        """Cumulative epsilon of everything recorded, recomputed from the rows (P5)."""
        return cumulative_epsilon(self.history(), delta=delta, accountant=accountant)

    @contextmanager
    def round(self) -> Iterator[OpenRound]:
        """One round = one transaction: check inside, train inside, ``record`` once, commit on exit.

        Raising inside (a refusal, a crash) rolls back: the ledger is unchanged.
        """
        with transaction(self.conn):
            rows = self.conn.execute("SELECT sigma, sample_rate, steps FROM spend ORDER BY id").fetchall()
            history = [StepRecord(sigma=r[0], sample_rate=r[1], steps=r[2]) for r in rows]
            yield OpenRound(conn=self.conn, history=history, rounds_done=len(history))
