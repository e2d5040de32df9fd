"""The site ledger's file format: its tables, its schema versions and their in-place migrations, the site it
belongs to, and what a spend row means to the accountant.

Schema 1 ledgers (no method/psi columns) are migrated in place; their old rows read method ``unknown``, so no
record-level claim can be made over them. Schema 3 adds the privacy unit of each row (issue #11); rows of
schema 1 and 2 ledgers read ``record``, which is what every round before the unit existed ran. Schema 4 adds
the charge on attempt (a row's state, its noise seed and data version) and the site's events; schema 5 binds
a charged row to its request (``request_digest``) and keeps the answer of a round that failed (``outcome``).

A ledger belongs to one site (``meta.site``): a ledger written by another site is refused.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedpose.shared.privacy.accounting.accountant import StepRecord
from fedpose.shared.privacy.accounting.ledger import transaction

log = logging.getLogger(__name__)

SCHEMA_VERSION = 5
STATES = ("charged", "done", "failed")  # paid, not yet released / released / failed after its charge (final)

# What the site refused or failed, with the reason, for its operator (``fedpose site status``, the console).
# Local only: the server already got the same generic answer.
_EVENTS = """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        federation TEXT,
        round INTEGER,
        code INTEGER NOT NULL,
        reason TEXT NOT NULL
    )"""

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS spend (
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
        recorded_at TEXT NOT NULL,
        method TEXT NOT NULL DEFAULT 'unknown',
        psi TEXT,                       -- fdp/fpdp: the feature map treated as public, e.g. blur(0.03)
        clip_norm REAL,
        augment INTEGER,
        unit TEXT NOT NULL DEFAULT 'record', -- the privacy unit: record or patient
        state TEXT NOT NULL DEFAULT 'done',   -- charged (paid, not yet released) or done
        noise_seed INTEGER,                   -- charged rows only: the round's secret seed, erased when done
        data_version TEXT,                    -- the data the round was charged on (a replay needs the same)
        request_digest TEXT,                  -- the whole request the round was charged for (P16)
        outcome TEXT                          -- failed rows: the answer every later request for the round gets
    )""",
    "CREATE INDEX IF NOT EXISTS spend_round ON spend (federation, round)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    _EVENTS,
]
_V1_TO_V2 = [
    "ALTER TABLE spend ADD COLUMN method TEXT NOT NULL DEFAULT 'unknown'",
    "ALTER TABLE spend ADD COLUMN psi TEXT",
    "ALTER TABLE spend ADD COLUMN clip_norm REAL",
    "ALTER TABLE spend ADD COLUMN augment INTEGER",
    "CREATE INDEX IF NOT EXISTS spend_round ON spend (federation, round)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
]
_V2_TO_V3 = [
    "ALTER TABLE spend ADD COLUMN unit TEXT NOT NULL DEFAULT 'record'",
]
_V3_TO_V4 = [
    "ALTER TABLE spend ADD COLUMN state TEXT NOT NULL DEFAULT 'done'",
    "ALTER TABLE spend ADD COLUMN noise_seed INTEGER",
    "ALTER TABLE spend ADD COLUMN data_version TEXT",
    _EVENTS,
]
_V4_TO_V5 = [
    "ALTER TABLE spend ADD COLUMN request_digest TEXT",
    "ALTER TABLE spend ADD COLUMN outcome TEXT",
]
_MIGRATIONS = {0: _SCHEMA, 1: _V1_TO_V2 + _V2_TO_V3 + _V3_TO_V4 + _V4_TO_V5, 2: _V2_TO_V3 + _V3_TO_V4 + _V4_TO_V5,
               3: _V3_TO_V4 + _V4_TO_V5, 4: _V4_TO_V5}


def open_schema(conn: sqlite3.Connection, path: Path, *, site: str | None, busy_timeout: float) -> None:
    """Bring the ledger at ``path`` to ``SCHEMA_VERSION`` (an older one migrated in place) and, with ``site``, bind
    it to that site; refuse a file that is no fedpose site ledger, one of an unknown schema or one of another site.
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if version not in (*_MIGRATIONS, SCHEMA_VERSION):
        raise ValueError(f"site ledger {path} has schema {version}, this fedpose reads 1 to {SCHEMA_VERSION}")
    if version == 0 and tables - {"sqlite_sequence"}:
        raise ValueError(f"{path} is not a fedpose site ledger (it holds tables {sorted(tables)})")
    if version in _MIGRATIONS:
        with transaction(conn, what=f"site ledger {path}", wait=busy_timeout):
            for statement in _MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        if version == 1:
            log.warning("site ledger %s migrated from schema 1: its earlier rows record no method or psi "
                        "(method 'unknown'), so no record-level claim covers them", path)
    columns = {r[1] for r in conn.execute("PRAGMA table_info(spend)")}
    if not {"federation", "round", "sigma", "sample_rate", "steps", "method", "psi", "unit"} <= columns:
        raise ValueError(f"{path} is not a fedpose site ledger (its 'spend' table lacks columns)")
    if site is not None:
        _claim(conn, path, site, busy_timeout=busy_timeout)


def _claim(conn: sqlite3.Connection, path: Path, site: str, *, busy_timeout: float) -> None:
    """Bind the ledger to ``site`` on first use; refuse a ledger of another site."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'site'").fetchone()
    owners = {r[0] for r in conn.execute("SELECT DISTINCT site FROM spend")}
    owner = row[0] if row is not None else (owners.pop() if len(owners) == 1 else None)
    if (owner is not None and owner != site) or owners - {site}:
        raise ValueError(f"site ledger {path} belongs to site {owner or sorted(owners)}, not {site!r}: "
                         "each site keeps its own ledger (check ledger_path in the policy)")
    if row is None:
        with transaction(conn, what=f"site ledger {path}", wait=busy_timeout):
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('site', ?)", (site,))


def spend_history(rows: Iterable[Mapping[str, Any]]) -> list[StepRecord]:
    """The accountant's (sigma, q, steps) history of spend rows, in their order."""
    return [StepRecord(sigma=r["sigma"], sample_rate=r["sample_rate"], steps=r["steps"]) for r in rows]
