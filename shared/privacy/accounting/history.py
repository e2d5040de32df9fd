"""The durable history of privacy spend: the SQLite plumbing both the site's and the server's ledger keep it in.

A ledger is the memory of P5 (epsilon composed over ALL rounds, never reset)
and P6 (a site's guarantee lives in its own durable file). SQLite in WAL mode
with ``synchronous=FULL`` makes each committed transaction survive a killed
process or a power cut; a process killed inside a transaction leaves nothing
of it behind (the WAL is rolled back on the next open).

Ledgers compose like dp_accounting's: validate first, then mutate, so a
rejected entry never leaves a half-written row.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from fedpose.shared.private_files import narrow_if_present, private_dir, private_file
from fedpose.shared.privacy.accounting.accountant import ACCOUNTANTS, StepRecord

log = logging.getLogger(__name__)

# Seconds a writer waits for another writer's transaction (a site trains inside one).
DEFAULT_BUSY_TIMEOUT = 600.0


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def connect(path: str | Path, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT) -> sqlite3.Connection:
    """Open (creating if needed) a ledger database in WAL mode with full fsync.

    ``isolation_level=None``: no implicit transactions; every write goes
    through ``transaction`` so one round is exactly one transaction.

    Private at rest (it holds the rounds' noise seeds): a folder made for it is 0700, the file 0600 whatever
    the umask, and SQLite gives its -wal and -shm files the file's own mode; one an older fedpose left wider
    is narrowed here (``fedpose.shared.private_files``).
    """
    path = Path(path)
    try:
        private_dir(path.parent)
        private_file(path)
        for companion in ("-wal", "-shm"):
            narrow_if_present(f"{path}{companion}")
    except OSError as err:
        raise ValueError(f"cannot open ledger {path}: {err}") from err
    try:
        conn = sqlite3.connect(str(path), timeout=min(busy_timeout, _LOCK_SLICE), isolation_level=None)
    except sqlite3.Error as err:
        raise ValueError(f"cannot open ledger {path}: {err}") from err
    conn.row_factory = sqlite3.Row
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.DatabaseError as err:
        conn.close()
        raise ValueError(f"ledger {path} is not an SQLite database (corrupt, or another file): {err}") from err
    if str(mode).lower() != "wal":
        conn.close()
        raise ValueError(f"ledger {path}: SQLite refused WAL mode (got {mode}); use a local filesystem")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


class LedgerBusy(ValueError):
    """Another process held the ledger's write lock for longer than the caller would wait."""


# Slice of one lock attempt; a message is logged between attempts.
_LOCK_SLICE = 5.0


@contextmanager
def transaction(conn: sqlite3.Connection, *, what: str = "ledger",
                wait: float = DEFAULT_BUSY_TIMEOUT) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back on any exception.

    IMMEDIATE takes the write lock at the start, so a check made inside the
    transaction (e.g. "does this round fit the budget?") still holds when
    the row is written: two concurrent requests cannot both pass it. While
    another process holds the lock (a site training a round inside its
    transaction), this waits at most ``wait`` seconds, saying so in the log,
    then raises ``LedgerBusy``.
    """
    deadline = time.monotonic() + wait
    conn.execute("PRAGMA busy_timeout = 0")  # first try without blocking, so that a wait is always announced
    announced = False
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            break
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) and "busy" not in str(err):
                raise ValueError(f"{what}: {err}") from err
            left = deadline - time.monotonic()
            if left <= 0:
                raise LedgerBusy(f"{what} is locked by another process (a round in progress?) and stayed locked "
                                 f"for {wait:.0f} s; try again when it is done") from err
            if not announced:
                log.warning("%s is locked by another process; waiting up to %.0f s", what, left)
                announced = True
            conn.execute(f"PRAGMA busy_timeout = {int(1000 * min(_LOCK_SLICE, left))}")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def check_entry(*, sigma: float, sample_rate: float, steps: int, delta: float, accountant: str) -> StepRecord:
    """Validate one spend entry before anything is written; returns its StepRecord."""
    record = StepRecord(sigma=sigma, sample_rate=sample_rate, steps=steps)  # raises on bad values
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1)")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} is not one of {ACCOUNTANTS}")
    return record
