"""``fedpose ledger``: privacy spend per site and round from a server or site ledger, and the
reconciliation of a server ledger against the sites' own.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path
from typing import Any


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


def cmd_ledger(args: argparse.Namespace) -> int:
    if args.reconcile:
        from fedpose.cli.reconcile import reconcile

        server_db, *site_dbs = args.reconcile
        if not site_dbs:
            raise ValueError("ledger --reconcile: give the server ledger, then one or more site ledgers")
        result = reconcile(server_db, site_dbs)
        print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.lines()))
        return 0 if result.ok else 1
    if not args.db:
        raise ValueError("ledger: give --db FILE, or --reconcile SERVER_DB SITE_DB...")
    kind, rows = ledger_rows(Path(args.db))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{kind} ledger {args.db}: no spend recorded")
        return 0
    if kind == "server":
        columns = ["site", "round", "sigma", "sample_rate", "steps", "delta", "epsilon", "site_run_epsilon",
                   "counted_epsilon", "site_epsilon", "budget", "aggregated", "state"]
    else:
        columns = ["site", "federation", "round", "method", "psi", "unit", "sigma", "sample_rate", "steps", "delta",
                   "epsilon", "budget"]
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
    print(f"{kind} ledger {args.db}")
    for j, row in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0
