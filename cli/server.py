"""``fedpose server prepare``: the server's public split, validation split and pretrained weights,
as explicit steps with progress output (server/prepare.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_prepare(args: argparse.Namespace) -> int:
    from server.prepare import prepare_server
    from shared.config import load_config

    prepare_server(load_config(args.config), Path(args.out), progress=not args.quiet)
    return 0


def register(sub: Any) -> None:
    from cli.main import DEFAULT_CONFIG

    server = sub.add_parser("server", help="the federation server: prepare its public data and pretrained weights")
    ss = server.add_subparsers(dest="server_command", required=True)
    prep = ss.add_parser("prepare", help="make or check the public split, the validation split and the public "
                                         "pretrained weights; write a config with absolute paths (server.yaml)")
    prep.add_argument("--config", default=DEFAULT_CONFIG, help="the federation's config")
    prep.add_argument("--out", required=True, help="folder for server.yaml (e.g. /srv/fedpose)")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.add_argument("--verbose", action="store_true", help="debug logging")
    prep.set_defaults(func=cmd_prepare)
