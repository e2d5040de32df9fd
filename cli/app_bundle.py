"""``fedpose server build-app``: the Flower app the sites approve, written from this fedpose install, and its
bundle (``fedpose.server.kits.bundle``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_build_app(args: argparse.Namespace) -> int:
    from fedpose.server.kits.bundle import build_app

    built = build_app(Path(args.out))
    print(f"app: {built.app} (fedpose server run --app {built.app})")
    print(f"bundle: {built.fab}\nsha256: {built.sha256}\nsend the bundle to every site: each approves it with "
          "fedpose site approve --bundle, and can rebuild it from its own install to compare the sha256")
    return 0


def register(ss: argparse._SubParsersAction) -> None:
    ba = ss.add_parser("build-app", help="write the Flower app from this install (for server run --app) and the "
                                         "bundle the sites approve (OUT.fab)")
    ba.add_argument("--out", required=True, help="a new folder for the app, e.g. /srv/fedpose/app (the bundle is "
                                                 "written beside it, /srv/fedpose/app.fab)")
    ba.add_argument("--verbose", action="store_true", help="debug logging")
    ba.set_defaults(func=cmd_build_app)
