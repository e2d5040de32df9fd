"""The server's SQLite ledger: per site and round, what ran and what it cost (P5).

For every site reply that says what it ran (sigma, q, steps), the server
recomputes the site's cumulative epsilon with its own accountant from the
whole recorded history of that site (never a per-round sum, never reset),
stores it next to the epsilon the site reported for this federation, logs a
mismatch and counts the larger value. Every reply and every refusal carries
the site's own spend (lifetime and this federation's epsilon): those reports
are kept too, so a round the site committed but the server never saw a reply
for (a crash) still counts, and the per-run epsilon the server claims is
never below what any site's ledger says. Two epsilons are named everywhere:
``run`` (this federation) and ``lifetime`` (the site's whole ledger, all
federations). Refusals and rejected replies are recorded as events.

Rows are never deleted. A row whose round was not checkpointed (the server
died between the ledger commit and the checkpoint rename) is kept and marked
``interrupted`` on resume: that spend happened at the site, so it still
counts; the round is then asked again, the site replays its one charge, and the
row of its reply replaces the interrupted one. Resuming (``reconcile``, on
``fedpose server --resume``) also restores the rows the checkpoint holds when
the database lost them.

A site charges a round before it reads a private record (P13), so a request
that got no answer (the node died, or the reply was lost) may have been spent.
It is recorded as ``attempted`` at the planned (sigma, q, steps) and counted,
until the site's next own report (a reply or a refusal, carrying its ledger's
run epsilon, which includes every round it charged) covers it: then it is
``resolved`` and the report counts instead; so does every error reply without
the site's spend (Flower's "ClientApp crashed", ...) and a reply the server
cannot read. Each request is written down (``sent``) before it goes out, so a
server that died after sending counts it on resume. The claim is thus never
below a site's own ledger, even when its last reply was lost.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpose.server.plan import SitePlan
from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent
from fedpose.shared.privacy.accounting.history import check_entry, connect, transaction, utc_now

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2

# Relative difference between server and site epsilon that is reported as a mismatch.
MISMATCH_RTOL = 1e-6

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS sites (
        site TEXT PRIMARY KEY,
        budget REAL NOT NULL,
        delta REAL NOT NULL,
        sigma REAL NOT NULL,
        sample_rate REAL NOT NULL,
        steps_per_round INTEGER NOT NULL,
        rounds INTEGER NOT NULL,
        accountant TEXT NOT NULL,
        site_min_sigma REAL NOT NULL,
        status TEXT NOT NULL DEFAULT 'active',   -- active | refused | finished | exhausted | stopped
        reason TEXT NOT NULL DEFAULT ''
    )""",
    """CREATE TABLE IF NOT EXISTS spend (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        round INTEGER NOT NULL,
        site TEXT NOT NULL REFERENCES sites(site),
        sigma REAL NOT NULL,
        sample_rate REAL NOT NULL,
        steps INTEGER NOT NULL,
        delta REAL NOT NULL,
        epsilon REAL NOT NULL,            -- cumulative over this federation, recomputed by the server
        site_epsilon REAL,                -- the site's lifetime epsilon, as it reported it
        site_run_epsilon REAL,            -- the site's epsilon over this federation, as it reported it
        counted_epsilon REAL NOT NULL,    -- run epsilon that counts: max(server, every site report)
        mismatch INTEGER NOT NULL,
        budget REAL NOT NULL,
        aggregated INTEGER NOT NULL,      -- 1: the weights went into the average
        state TEXT NOT NULL DEFAULT 'completed',  -- completed | interrupted | attempted | resolved
        recorded_at TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        round INTEGER NOT NULL,
        site TEXT NOT NULL,
        kind TEXT NOT NULL,               -- refused | rejected | error | missing | discarded | stopped | ...
        code INTEGER NOT NULL,
        reason TEXT NOT NULL,
        recorded_at TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS reports (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        round INTEGER NOT NULL,
        site TEXT NOT NULL,
        source TEXT NOT NULL,             -- reply | refusal
        site_epsilon REAL NOT NULL,       -- lifetime, from the site's ledger
        run_epsilon REAL NOT NULL,        -- this federation, from the site's ledger
        site_rounds INTEGER NOT NULL,
        recorded_at TEXT NOT NULL
    )""",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # every train request, written before it is sent
    "CREATE TABLE IF NOT EXISTS sent (id INTEGER PRIMARY KEY AUTOINCREMENT, round INTEGER NOT NULL, site TEXT NOT NULL,"
    " recorded_at TEXT NOT NULL)",
]


@dataclass(frozen=True, kw_only=True)
class Spend:
    """What one site reports it ran in one round."""

    site: str
    sigma: float
    sample_rate: float
    steps: int
    site_epsilon: float | None
    aggregated: bool
    run_epsilon: float | None = None
    state: str = "completed"  # completed: a reply said what ran; attempted: sent, no answer (may have been spent)


def attempted(plan: SitePlan) -> Spend:
    """A request that may have been spent: counted at the plan until the site's own next report covers it."""
    return Spend(site=plan.site, sigma=plan.sigma, sample_rate=plan.sample_rate, steps=plan.steps_per_round,
                 site_epsilon=None, aggregated=False, state="attempted")


@dataclass(frozen=True, kw_only=True)
class Report:
    """A site's own account of its spend, carried by a reply or a refusal."""

    site: str
    source: str  # reply | refusal
    site_epsilon: float
    run_epsilon: float
    site_rounds: int


@dataclass(frozen=True, kw_only=True)
class Event:
    site: str
    kind: str
    code: int
    reason: str


class ServerLedger:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.conn = connect(self.path)
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise ValueError(f"server ledger {self.path} has schema {version}, this fedpose reads {SCHEMA_VERSION}: "
                             "finish that federation with the fedpose that started it, or start a new --out")
        with transaction(self.conn):  # a ledger of schema 2 written before the ``sent`` table gets it here
            for statement in _SCHEMA:
                self.conn.execute(statement)
            if version == 0:
                self.conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ServerLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ meta / plans

    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with transaction(self.conn):
            self.conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def save_plans(self, plans: list[SitePlan]) -> None:
        with transaction(self.conn):
            for p in plans:
                self.conn.execute(
                    "INSERT INTO sites (site, budget, delta, sigma, sample_rate, steps_per_round, rounds,"
                    " accountant, site_min_sigma) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(site) DO UPDATE SET budget=excluded.budget, delta=excluded.delta,"
                    " sigma=excluded.sigma, sample_rate=excluded.sample_rate,"
                    " steps_per_round=excluded.steps_per_round, rounds=excluded.rounds,"
                    " accountant=excluded.accountant, site_min_sigma=excluded.site_min_sigma",
                    (p.site, p.epsilon, p.delta, p.sigma, p.sample_rate, p.steps_per_round, p.rounds,
                     p.accountant, p.site_min_sigma),
                )

    def plans(self) -> dict[str, SitePlan]:
        out = {}
        for r in self.conn.execute("SELECT * FROM sites ORDER BY site"):
            out[r["site"]] = SitePlan(
                site=r["site"], epsilon=r["budget"], delta=r["delta"], sample_rate=r["sample_rate"],
                steps_per_round=r["steps_per_round"], rounds=r["rounds"], sigma=r["sigma"],
                accountant=r["accountant"], site_min_sigma=r["site_min_sigma"],
            )
        return out

    def set_statuses(self, statuses: dict[str, tuple[str, str]]) -> None:
        with transaction(self.conn):
            for site, (status, reason) in statuses.items():
                self.conn.execute("UPDATE sites SET status = ?, reason = ? WHERE site = ?", (status, reason, site))

    def statuses(self) -> dict[str, tuple[str, str]]:
        rows = self.conn.execute("SELECT site, status, reason FROM sites")
        return {r["site"]: (r["status"], r["reason"]) for r in rows}

    # ------------------------------------------------------------------ spend

    def history(self, site: str, *, asking: int | None = None, reported: int | None = None) -> list[StepRecord]:
        """What the site ran (or may have: attempted rows not yet covered by its own report), in order. A site
        charges a (federation, round) once, so ``asking`` (the round about to be asked again) leaves out the
        attempted and interrupted rows of that round and later ones, and ``reported`` (the round whose row the site's
        own report is about to write) leaves out the attempted rows that report covers and that round's
        interrupted rows, which the new row replaces."""
        return [StepRecord(sigma=r[1], sample_rate=r[2], steps=r[3]) for r in self._counted(site, asking, reported)]

    def unanswered(self, site: str, *, asking: int | None = None) -> int:
        """The site's requests that got no answer and that ``history`` (with the same ``asking``) counts at the plan."""
        return sum(row[0] == "attempted" for row in self._counted(site, asking, None))

    def _counted(self, site: str, asking: int | None, reported: int | None) -> list[tuple]:
        """(state, sigma, sample_rate, steps) of the rows ``history`` counts, in order (its rule, in one place)."""
        return self.conn.execute(
            "SELECT state, sigma, sample_rate, steps FROM spend WHERE site = :site AND state != 'resolved'"
            " AND NOT (state IN ('attempted', 'interrupted') AND round >= :asking)"
            " AND NOT (state = 'attempted' AND round <= :reported)"
            " AND NOT (state = 'interrupted' AND round = :reported) ORDER BY id",
            {"site": site, "asking": math.inf if asking is None else asking,
             "reported": -math.inf if reported is None else reported}).fetchall()

    def server_epsilon(self, site: str, *, asking: int | None = None) -> float:
        plan = self.plans()[site]
        return epsilon_spent(self.history(site, asking=asking), delta=plan.delta, accountant=plan.accountant)

    def _reported(self, site: str, column: str) -> float:
        a = self.conn.execute(f"SELECT MAX({column}) FROM reports WHERE site = ?", (site,)).fetchone()[0]
        spend_column = "site_epsilon" if column == "site_epsilon" else "site_run_epsilon"
        b = self.conn.execute(f"SELECT MAX({spend_column}) FROM spend WHERE site = ?", (site,)).fetchone()[0]
        return max(float(a or 0.0), float(b or 0.0))

    def site_epsilon(self, site: str) -> float:
        """The site's lifetime epsilon (all federations), the largest it ever reported."""
        return self._reported(site, "site_epsilon")

    def site_run_epsilon(self, site: str) -> float:
        """The site's epsilon over this federation, the largest it ever reported (replies and refusals)."""
        return self._reported(site, "run_epsilon")

    def counted_epsilon(self, site: str, *, asking: int | None = None) -> float:
        """This federation's epsilon for the site: the larger of the server's recomputation and the site's reports."""
        return max(self.server_epsilon(site, asking=asking), self.site_run_epsilon(site))

    def record_round(self, round: int, spends: list[Spend], events: list[Event],
                     statuses: dict[str, tuple[str, str]] | None = None,
                     reports: list[Report] | None = None) -> list[dict[str, Any]]:
        """Write one round (spend rows, events, site statuses) in one transaction.

        Everything is validated and every epsilon computed before the first
        write, so a bad entry leaves the ledger untouched.
        """
        plans = self.plans()
        prepared = []
        histories: dict[str, list[StepRecord]] = {}
        # A site's own report from this round covers every earlier request of it that got no answer.
        reporting = {s.site for s in spends if s.state == "completed" and s.run_epsilon is not None}
        reporting |= {r.site for r in reports or []}
        for s in spends:
            if s.site not in plans:
                raise ValueError(f"no plan for site {s.site!r}: record_round needs a planned site")
            if s.state == "attempted" and s.site not in reporting and self.conn.execute(
                    "SELECT 1 FROM spend WHERE site = ? AND round = ? AND state IN ('attempted', 'interrupted')",
                    (s.site, round)).fetchone():
                continue  # asked again for a round already counted: a site charges a round once
            plan = plans[s.site]
            entry = check_entry(sigma=s.sigma, sample_rate=s.sample_rate, steps=s.steps, delta=plan.delta,
                                accountant=plan.accountant)
            # a reporting site's report resolves its attempted rows below, its row this round's interrupted ones
            reported = round if s.site in reporting else None
            history = histories.setdefault(s.site, self.history(s.site, reported=reported))
            history.append(entry)
            eps = epsilon_spent(history, delta=plan.delta, accountant=plan.accountant)
            for value in (s.site_epsilon, s.run_epsilon):
                if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                    raise ValueError(f"site {s.site}: reported epsilon {value!r} is not a finite number")
            run_eps = s.run_epsilon
            mismatch = run_eps is not None and abs(eps - run_eps) > MISMATCH_RTOL * max(1.0, abs(eps))
            if mismatch:
                log.warning("site %s round %d: server run epsilon %.6f != the site's run epsilon %.6f; counting the "
                            "larger", s.site, round, eps, run_eps)
            counted = max(eps, run_eps or 0.0, self.site_run_epsilon(s.site))
            prepared.append((round, s.site, s.sigma, s.sample_rate, s.steps, plan.delta, eps, s.site_epsilon, run_eps,
                             counted, int(mismatch), plan.epsilon, int(s.aggregated), s.state))
        for r in reports or []:
            values = (r.site_epsilon, r.run_epsilon, r.site_rounds)
            if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"site {r.site}: reported spend {values!r} is not finite and >= 0")
        now = utc_now()
        with transaction(self.conn):
            for site in sorted(reporting):
                self.conn.execute("UPDATE spend SET state = 'resolved' WHERE site = ? AND state = 'attempted'"
                                  " AND round <= ?", (site, round))
            for site in sorted(reporting & {s.site for s in spends}):  # a reporting site's spend is never skipped
                self.conn.execute("UPDATE spend SET state = 'resolved' WHERE site = ? AND state = 'interrupted'"
                                  " AND round = ?", (site, round))
            for row in prepared:
                self.conn.execute(
                    "INSERT INTO spend (round, site, sigma, sample_rate, steps, delta, epsilon, site_epsilon,"
                    " site_run_epsilon, counted_epsilon, mismatch, budget, aggregated, state, recorded_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*row, now),
                )
            for r in reports or []:
                self.conn.execute(
                    "INSERT INTO reports (round, site, source, site_epsilon, run_epsilon, site_rounds, recorded_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (round, r.site, r.source, float(r.site_epsilon), float(r.run_epsilon), int(r.site_rounds), now),
                )
            for e in events:
                self.conn.execute(
                    "INSERT INTO events (round, site, kind, code, reason, recorded_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (round, e.site, e.kind, int(e.code), e.reason[:2000], now),
                )
            for site, (status, reason) in (statuses or {}).items():
                self.conn.execute("UPDATE sites SET status = ?, reason = ? WHERE site = ?", (status, reason, site))
        return [dict(zip(("round", "site", "sigma", "sample_rate", "steps", "delta", "epsilon", "site_epsilon",
                          "site_run_epsilon", "counted_epsilon", "mismatch", "budget", "aggregated", "state"), row))
                for row in prepared]

    def record_sent(self, round: int, sites: list[str]) -> None:
        """Write, before sending, that these sites are asked to train ``round``: should the server die before
        their replies, ``reconcile`` counts each at the plan."""
        now = utc_now()
        with transaction(self.conn):
            for site in sites:
                self.conn.execute("INSERT INTO sent (round, site, recorded_at) VALUES (?, ?, ?)", (round, site, now))

    # ------------------------------------------------------------------ views

    def rows(self) -> list[dict[str, Any]]:
        """Spend rows for ``fedpose ledger``: epsilon is cumulative and server-computed."""
        return [dict(r) for r in self.conn.execute(
            "SELECT site, round, sigma, sample_rate, steps, delta, epsilon, site_epsilon, site_run_epsilon,"
            " counted_epsilon, mismatch, budget, aggregated, state, recorded_at FROM spend ORDER BY id")]

    def reports(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM reports ORDER BY id")]

    def events(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.conn.execute("SELECT * FROM events ORDER BY id")]

    def snapshot(self) -> dict[str, Any]:
        """Everything the checkpoint stores to verify/restore the ledger on resume."""
        return {
            "spend": [dict(r) for r in self.conn.execute("SELECT * FROM spend ORDER BY id")],
            "events": self.events(),
            "reports": self.reports(),
            "sites": [dict(r) for r in self.conn.execute("SELECT * FROM sites ORDER BY site")],
            "meta": {r[0]: r[1] for r in self.conn.execute("SELECT key, value FROM meta")},
        }


def unrecorded_requests(conn: Any, *, after_round: int = 0) -> list[tuple[int, str]]:
    """(round, site) of every train request written down as sent (after ``after_round``) whose round has no spend
    row of that site: the server stopped before it recorded the answer, so the site may have charged it (P13)."""
    return [(int(r[0]), str(r[1])) for r in conn.execute(
        "SELECT DISTINCT round, site FROM sent WHERE round > ? AND NOT EXISTS (SELECT 1 FROM spend WHERE"
        " spend.site = sent.site AND spend.round = sent.round) ORDER BY round, site", (after_round,)).fetchall()]


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
    for rnd, site in unrecorded_requests(ledger.conn, after_round=through_round):
        if site in plans:
            log.warning("ledger %s: %s was asked to train round %d before the server stopped: counted at the "
                        "plan until its own report covers it", ledger.path, site, rnd)
            ledger.record_round(rnd, [attempted(plans[site])], [])
    return interrupted
