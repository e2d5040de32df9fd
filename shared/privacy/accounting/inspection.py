"""Ledgers read from outside, read-only: a ledger's spend, and a server ledger reconciled with the sites' own.

``fedpose ledger --db FILE`` shows the spend of a server or a site ledger, per site and round, as a table
(``ledger_rows``, ``spend_table``). ``fedpose ledger --reconcile SERVER_DB SITE_DB...``, run by the operator
or by a site checking the server's claim against its own ledger, compares the two kinds, every difference,
and whether the claim under-reports (P5, P6): the server's ledger holds, per
site and round, what the site reported it ran and the epsilon the server counts for
this federation; each site's own ledger holds what it actually spent, in every
federation. For the server's federation (``meta.federation``) this lists rounds a site
spent that the server never recorded (a crash between the site's commit and its reply),
rounds the server recorded that the site does not have, rounds whose (sigma, q, steps)
differ, and compares the epsilon the server counts with the site's own. Only the last
decides ``ok``: the server's claim (eps, delta) must dominate the site's own, i.e. its counted
epsilon at least the site's and its delta at least the site's. The site's epsilon is computed
from its own rows, at its own delta and with its own accountant, never the server's: a server
that plans at a larger delta would otherwise make any spend read small.

Every file is opened read-only; nothing is changed or created.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedpose.shared.privacy.accounting.accountant import StepRecord, epsilon_spent

TOLERANCE = 1e-9

SPEND_COLUMNS = {
    "server": ["site", "round", "sigma", "sample_rate", "steps", "delta", "epsilon", "site_run_epsilon",
               "counted_epsilon", "site_epsilon", "budget", "aggregated", "state"],
    "site": ["site", "federation", "round", "method", "psi", "unit", "sigma", "sample_rate", "steps", "delta",
             "epsilon", "budget"],
}


def ledger_rows(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """("server" | "site", rows) of a fedpose ledger file."""
    if not path.is_file():
        raise FileNotFoundError(f"ledger {path} does not exist")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:
        raise ValueError(f"{path} is not an SQLite ledger: {err}") from err
    try:
        if "sites" in tables:
            rows = [dict(r) for r in conn.execute(
                "SELECT site, round, sigma, sample_rate, steps, delta, epsilon, site_run_epsilon, counted_epsilon,"
                " site_epsilon, budget, aggregated, state FROM spend ORDER BY site, id")]
            return "server", rows
        if "spend" in tables:
            has_unit = "unit" in {r[1] for r in conn.execute("PRAGMA table_info(spend)")}  # schema 3 (issue #11)
            rows = [dict(r) for r in conn.execute(
                "SELECT site, federation, round, method, psi, " + ("unit" if has_unit else "'record' AS unit") +
                ", sigma, sample_rate, steps, delta, epsilon, budget, accountant FROM spend ORDER BY id")]
            return "site", rows
    finally:
        conn.close()
    raise ValueError(f"{path} is not a fedpose ledger (no 'spend' table)")


def spend_table(kind: str, rows: list[dict[str, Any]]) -> list[str]:
    """The lines of a table of ``rows`` of a ``kind`` ledger (``ledger_rows``): a header, a rule, a line a row."""
    columns = SPEND_COLUMNS[kind]
    header = {"epsilon": "run eps (server)" if kind == "server" else "lifetime eps", "site_run_epsilon":
              "run eps (site)", "counted_epsilon": "run eps (counted)", "site_epsilon": "lifetime eps (site)"}

    def fmt(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key in ("sigma", "sample_rate", "epsilon", "site_epsilon", "site_run_epsilon", "counted_epsilon", "budget"):
            return f"{value:.4f}"
        if key == "delta":
            return f"{value:.1e}"
        return str(value)

    table = [[header.get(c, c) for c in columns]] + [[fmt(c, r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def _open(path: Path) -> sqlite3.Connection:
    if not Path(path).is_file():
        raise ValueError(f"ledger {path} does not exist")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        conn.execute("SELECT name FROM sqlite_master").fetchall()
    except sqlite3.DatabaseError as err:
        raise ValueError(f"{path} is not an SQLite ledger: {err}") from err
    return conn


@dataclass
class SiteReconciliation:
    site: str
    site_db: str
    only_at_site: list[int] = field(default_factory=list)  # rounds the site spent, unknown to the server
    only_at_server: list[int] = field(default_factory=list)  # rounds the server recorded, absent at the site
    differing: list[dict[str, Any]] = field(default_factory=list)
    server_counted: float = 0.0
    site_run: float = 0.0  # the site's epsilon over this federation, from its own rows, its delta, its accountant
    site_lifetime: float = 0.0
    server_delta: float = 0.0  # the delta the server's claim for this site is stated at
    site_delta: float = 0.0  # the site's own delta (the smallest its rows record)
    site_accountant: str = "rdp"

    @property
    def delta_too_large(self) -> bool:
        """The server states the site's claim at a larger delta than the site's own: a weaker-looking eps."""
        return self.server_delta > self.site_delta * (1 + TOLERANCE)

    @property
    def under_reported(self) -> bool:
        return (self.server_counted < self.site_run - TOLERANCE * max(1.0, self.site_run)) or self.delta_too_large


@dataclass
class Reconciliation:
    federation: str
    sites: list[SiteReconciliation]

    @property
    def ok(self) -> bool:
        return not any(s.under_reported for s in self.sites)

    def to_dict(self) -> dict[str, Any]:
        return {"federation": self.federation, "ok": self.ok,
                "sites": [{**s.__dict__, "under_reported": s.under_reported} for s in self.sites]}

    def lines(self) -> list[str]:
        out = [f"federation {self.federation}:"]
        for s in self.sites:
            verdict = "UNDER-REPORTED" if s.under_reported else "ok"
            why = (f" (the server states it at delta {s.server_delta:g}, the site's own delta is {s.site_delta:g})"
                   if s.delta_too_large else "")
            out.append(f"  {s.site} ({s.site_db}): server counts run eps {s.server_counted:.4f} at delta "
                       f"{s.server_delta:g}, the site's own run eps {s.site_run:.4f} at delta {s.site_delta:g} "
                       f"({s.site_accountant}), lifetime {s.site_lifetime:.4f}: {verdict}{why}")
            for round in s.only_at_site:
                out.append(f"    round {round}: spent at the site, not in the server ledger (counted only through "
                           "the site's reports)")
            for round in s.only_at_server:
                out.append(f"    round {round}: in the server ledger, not in the site's ledger")
            for d in s.differing:
                out.append(f"    round {d['round']}: server recorded {d['server']}, the site ran {d['site']}")
        out.append("reconciled: the server's claim is never below a site's own ledger" if self.ok else
                   "NOT reconciled: the server's claim is below a site's own ledger for the sites marked above")
        return out


def reconcile(server_db: str | Path, site_dbs: list[str | Path]) -> Reconciliation:
    """Compare ``server_db`` with each of ``site_dbs`` (the sites are named by their own ledgers)."""
    server = _open(Path(server_db))
    try:
        tables = {r[0] for r in server.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "sites" not in tables:
            raise ValueError(f"{server_db} is not a server ledger (no 'sites' table)")
        row = server.execute("SELECT value FROM meta WHERE key = 'federation'").fetchone()
        if row is None:
            raise ValueError(f"{server_db} records no federation id")
        federation = str(row[0])
        plans = {r["site"]: dict(r) for r in server.execute("SELECT * FROM sites")}
        # 'resolved' rows (a request that got no answer, later covered by the site's own report) ran nowhere
        server_rows = [dict(r) for r in server.execute("SELECT * FROM spend ORDER BY id")
                       if dict(r).get("state") != "resolved"]
        reports = [dict(r) for r in server.execute("SELECT * FROM reports ORDER BY id")] if "reports" in tables else []
    finally:
        server.close()
    results = []
    for db in site_dbs:
        conn = _open(Path(db))
        try:
            rows = [dict(r) for r in conn.execute("SELECT * FROM spend ORDER BY id")]
            meta = {r[0]: r[1] for r in conn.execute("SELECT key, value FROM meta")} if "meta" in {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")} else {}
        except sqlite3.DatabaseError as err:
            raise ValueError(f"{db} is not a fedpose site ledger: {err}") from err
        finally:
            conn.close()
        names = {meta["site"]} if "site" in meta else {r["site"] for r in rows}
        if len(names) != 1:
            raise ValueError(f"{db}: cannot tell which site it belongs to ({sorted(names)})")
        site = names.pop()
        if site not in plans:
            raise ValueError(f"{db} belongs to site {site!r}, which is not in the server ledger "
                             f"(sites: {sorted(plans)})")
        plan = plans[site]
        mine = {r["round"]: r for r in rows if r["federation"] == federation}
        theirs = {r["round"]: r for r in server_rows if r["site"] == site}
        result = SiteReconciliation(site=site, site_db=str(db))
        result.only_at_site = sorted(set(mine) - set(theirs))
        result.only_at_server = sorted(set(theirs) - set(mine))
        for round in sorted(set(mine) & set(theirs)):
            a = tuple(theirs[round][k] for k in ("sigma", "sample_rate", "steps"))
            b = tuple(mine[round][k] for k in ("sigma", "sample_rate", "steps"))
            if a != b:
                result.differing.append({"round": round, "server": a, "site": b})

        def eps(records: list[dict[str, Any]], delta: float, accountant: str) -> float:
            history = [StepRecord(sigma=r["sigma"], sample_rate=r["sample_rate"], steps=r["steps"]) for r in records]
            return epsilon_spent(history, delta=delta, accountant=accountant) if history else 0.0

        # The site's own delta and accountant, from its own rows (the smallest delta any row records; its
        # latest accountant): what its guarantee is stated at, whatever the server planned.
        site_delta = min((float(r["delta"]) for r in rows), default=float(plan["delta"]))
        site_accountant = str(rows[-1]["accountant"]) if rows else str(plan["accountant"])
        counted = [r["counted_epsilon"] for r in server_rows if r["site"] == site]
        counted += [r["run_epsilon"] for r in reports if r["site"] == site]
        result.server_counted = max([eps(list(theirs.values()), plan["delta"], plan["accountant"]), *counted],
                                    default=0.0)
        result.server_delta = float(plan["delta"])
        result.site_delta, result.site_accountant = site_delta, site_accountant
        result.site_run = eps(list(mine.values()), site_delta, site_accountant)
        result.site_lifetime = eps(rows, site_delta, site_accountant)
        results.append(result)
    return Reconciliation(federation=federation, sites=results)
