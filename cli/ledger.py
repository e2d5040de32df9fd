"""``fedpose ledger``: privacy spend per site and round from a server or site ledger, and the reconciliation
of a server ledger against the sites' own (``fedpose.shared.privacy.accounting.inspection``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_ledger(args: argparse.Namespace) -> int:
    if args.reconcile:
        from fedpose.shared.privacy.accounting.inspection import reconcile

        server_db, *site_dbs = args.reconcile
        if not site_dbs:
            raise ValueError("ledger --reconcile: give the server ledger, then one or more site ledgers")
        result = reconcile(server_db, site_dbs)
        print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.lines()))
        return 0 if result.ok else 1
    if not args.db:
        raise ValueError("ledger: give --db FILE, or --reconcile SERVER_DB SITE_DB...")
    from fedpose.shared.privacy.accounting.inspection import ledger_rows, spend_table

    kind, rows = ledger_rows(Path(args.db))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{kind} ledger {args.db}: no spend recorded")
        return 0
    print(f"{kind} ledger {args.db}")
    print("\n".join(spend_table(kind, rows)))
    return 0
