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
its answer kept in ``outcome``): every later request for it gets that answer. So does a round interrupted
after its charge (a stopped run's SIGINT), whether or not its reply was stored: a reply that never left is
withdrawn. Only a round whose process died stays charged, and it starts at most ``MAX_ATTEMPTS`` times in all,
its replays included (``attempts``), so a crash that depends on the private batch is not an oracle the server
may query at will.

Schema 1 ledgers (no method/psi columns) are migrated in place; their old rows read method ``unknown``, so no
record-level claim can be made over them. Schema 3 adds the privacy unit of each row (issue #11); rows of
schema 1 and 2 ledgers read ``record``, which is what every round before the unit existed ran. Schema 4 adds
the charge on attempt (a row's state, its noise seed and data version) and the site's events; schema 5 binds
a charged row to its request (``request_digest``) and keeps the answer of a round that failed (``outcome``);
schema 6 counts the times a charged round started reading private data (``attempts``).
A ledger belongs to one site (``meta.site``): a ledger written by another site is refused.

The file reads top-down: the tables and their migrations, opening a ledger, one charge inside its transaction
(``OpenRound``: the rows so far, to check the budget against, and the round's one row, P12), then
``SiteLedger``: its writes, then its queries (the epsilon recomputed from the rows, P5, the claim they
support, P12, the site's events), none of which changes the file.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpose.shared.configuration.methods import RECORD_LEVEL
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
from fedpose.shared.privacy.accounting.history import DEFAULT_BUSY_TIMEOUT, check_entry, connect, transaction, utc_now

log = logging.getLogger(__name__)

SCHEMA_VERSION = 6

# How many times a charged round may start reading private data: the first run and the replays of the identical
# request after its process died. Each replay is the same release (same seed, data and request), but whether it
# dies again can depend on the realised batch (its memory, its time), so the count is bounded.
MAX_ATTEMPTS = 3

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
        outcome TEXT,                         -- failed rows: the answer every later request for the round gets
        attempts INTEGER NOT NULL DEFAULT 0   -- charged rows: the times the round started reading private data
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
_V5_TO_V6 = [
    "ALTER TABLE spend ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
]
_MIGRATIONS = {0: _SCHEMA, 1: _V1_TO_V2 + _V2_TO_V3 + _V3_TO_V4 + _V4_TO_V5 + _V5_TO_V6,
               2: _V2_TO_V3 + _V3_TO_V4 + _V4_TO_V5 + _V5_TO_V6, 3: _V3_TO_V4 + _V4_TO_V5 + _V5_TO_V6,
               4: _V4_TO_V5 + _V5_TO_V6, 5: _V5_TO_V6}


# A round's answer made final (P16): failed, its seed erased, ``outcome`` kept; from charged, or from done while
# its reply has not left (the caller drops the stored reply).
_FAIL = ("UPDATE spend SET state = 'failed', noise_seed = NULL, outcome = ? "
         "WHERE federation = ? AND round = ? AND state IN ('charged', 'done')")


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


@dataclass(frozen=True, kw_only=True)
class Mechanism:
    """What one round ran, besides (sigma, q, steps): stored on its row (P12)."""

    method: str
    psi: str | None  # e.g. "blur(0.03)"; None for dpsgd/proj
    clip_norm: float
    augment: bool
    unit: str = "record"  # the privacy unit of the round: record or patient


@dataclass
class OpenRound:
    """The state seen inside a round's transaction; ``record`` writes the round's one row."""

    conn: sqlite3.Connection
    rows: list[dict[str, Any]]
    recorded: bool = False

    @property
    def rounds_done(self) -> int:
        return len(self.rows)

    def federation_rounds(self, federation: str) -> int:
        return sum(1 for r in self.rows if r["federation"] == federation)

    def has_round(self, federation: str, round: int) -> bool:
        return any(r["federation"] == federation and r["round"] == round for r in self.rows)

    def epsilon_after(self, record: StepRecord, *, delta: float, accountant: str) -> float:
        return epsilon_spent([*spend_history(self.rows), record], delta=delta, accountant=accountant)

    def epsilon(self, *, delta: float, accountant: str, federation: str | None = None) -> float:
        """Cumulative epsilon of the rows seen so far (of one federation's rows when given)."""
        rows = [r for r in self.rows if federation is None or r["federation"] == federation]
        return epsilon_spent(spend_history(rows), delta=delta, accountant=accountant)

    def record(
        self, *, site: str, federation: str, round: int, sigma: float, sample_rate: float, steps: int,
        delta: float, budget: float, accountant: str, mechanism: Mechanism, state: str = "done",
        noise_seed: int | None = None, data_version: str | None = None, request_digest: str | None = None,
    ) -> float:
        """Insert the round's row (validated first); returns the cumulative epsilon written.

        ``state='charged'`` (the site's rounds): the spend is on disk before any private record is read;
        ``noise_seed``, ``data_version`` and ``request_digest`` let an unfinished round be replayed on the same
        data for the identical request only, never spent twice (P16).
        """
        if state not in ("charged", "done"):
            raise ValueError(f"state={state!r} must be 'charged' or 'done'")
        if (state == "charged") != (noise_seed is not None):
            raise ValueError("a charged row keeps its noise seed until it is done; a done row keeps none")
        if state == "charged" and not request_digest:
            raise ValueError("a charged row is bound to the digest of the request it was charged for (P16)")
        if self.recorded:
            raise ValueError("this round already has its ledger row; one row per round")
        if self.has_round(federation, round):
            raise ValueError(f"federation {federation} round {round} is already in the ledger; never twice")
        entry = check_entry(sigma=sigma, sample_rate=sample_rate, steps=steps, delta=delta, accountant=accountant)
        eps = self.epsilon_after(entry, delta=delta, accountant=accountant)
        values = dict(site=site, federation=federation, round=int(round), sigma=float(sigma),
                      sample_rate=float(sample_rate), steps=int(steps), delta=float(delta), epsilon=eps,
                      budget=float(budget), accountant=accountant, recorded_at=utc_now(), method=mechanism.method,
                      psi=mechanism.psi, clip_norm=float(mechanism.clip_norm), augment=int(mechanism.augment),
                      unit=mechanism.unit, state=state, noise_seed=noise_seed, data_version=data_version,
                      request_digest=request_digest, outcome=None)
        self.conn.execute(f"INSERT INTO spend ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                          tuple(values.values()))
        self.rows.append(values)
        self.recorded = True
        return eps


class SiteLedger:
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

    def start_attempt(self, federation: str, round: int) -> bool:
        """A charged round is about to read private data: count the attempt. False, and the round made ``failed``
        for good, when it already started ``MAX_ATTEMPTS`` times (its process kept dying)."""
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            row = self.conn.execute(
                "SELECT attempts FROM spend WHERE federation = ? AND round = ? AND state = 'charged'",
                (federation, int(round))).fetchone()
            if row is None:
                raise ValueError(f"federation {federation} round {round} is not a charged round of {self.path}")
            if row[0] >= MAX_ATTEMPTS:
                self.conn.execute(_FAIL, (f"its process died {row[0]} times", federation, int(round)))
                return False
            self.conn.execute("UPDATE spend SET attempts = attempts + 1 WHERE federation = ? AND round = ? "
                              "AND state = 'charged'", (federation, int(round)))
        return True

    def fail(self, federation: str, round: int, outcome: str) -> bool:
        """A round failed or was interrupted after its charge, before its answer left: final (P16). Its noise seed
        is erased and ``outcome`` is the answer every later request for the round gets; it stays spent. A round
        already ``done`` (its reply stored, not sent) becomes ``failed`` too: the caller drops the stored reply.
        False when the round is neither charged nor done (it failed already, or was never charged)."""
        with transaction(self.conn, what=f"site ledger {self.path}", wait=self.busy_timeout):
            updated = self.conn.execute(_FAIL, (outcome, federation, int(round))).rowcount
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

    def rows(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM spend ORDER BY id").fetchall()]

    def history(self, federation: str | None = None) -> list[StepRecord]:
        return spend_history([r for r in self.rows() if federation is None or r["federation"] == federation])

    def rounds_done(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM spend").fetchone()[0])

    def epsilon(self, *, delta: float, accountant: str, federation: str | None = None) -> float:
        """Cumulative epsilon of everything recorded (or of one federation's rows), recomputed (P5)."""
        return epsilon_spent(self.history(federation), delta=delta, accountant=accountant)

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
