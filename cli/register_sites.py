"""``fedpose server register-sites``: register the sites' public keys with the SuperLink
(``fedpose.server.kits.register``; the server kit's ``register-sites.sh`` runs it).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_register_sites(args: argparse.Namespace) -> int:
    from fedpose.server.kits.register import register_sites

    sites = [s for item in args.sites for s in item.split(",") if s]
    return register_sites(sites, Path(args.keys), Path(args.record), args.connection)


def register(ss: argparse._SubParsersAction) -> None:
    rs = ss.add_parser("register-sites", help="register each site's public key with the SuperLink, named as the "
                                              "site; safe to run again; records which node id is which site")
    rs.add_argument("--connection", default="pilot", help="the SuperLink connection in $FLWR_HOME/config.toml "
                                                          "(default pilot)")
    rs.add_argument("--keys", required=True, help="the folder of the sites' public keys, <site>.pub")
    rs.add_argument("--record", required=True, help="the file of site, node id and key (site-nodes.tsv)")
    rs.add_argument("--sites", nargs="+", required=True, help="the sites' names")
    rs.add_argument("--verbose", action="store_true", help="debug logging")
    rs.set_defaults(func=cmd_register_sites)
