"""``fedpose provision``: one kit per site and one for the server of a pilot federation
(``fedpose.server.kits.provision`` writes them; this parses and calls).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedpose.server.kits import templates as kit


def cmd_provision(args: argparse.Namespace) -> int:
    from fedpose.cli.common import load_cli_config
    from fedpose.server.kits.provision import Federation, Install, provision

    cfg = load_cli_config(args)
    federation = Federation(sites=tuple(s.strip() for s in args.sites.split(",") if s.strip()),
                            hosts=tuple(args.host or ["localhost"]), port=args.port, control_port=args.control_port)
    install = Install(install_dir=args.install_dir, state_dir=args.state_dir, venv=args.venv, user=args.user,
                      wheel=args.wheel, constraints=args.constraints)
    kits = provision(Path(args.out), federation, cfg, install=install, days=args.days)
    for name, path in kits.items():
        print(f"{name}: {path}")
    print("private keys (server/ca.key, server/server.key) are 0600 and stay here; send each site only its own "
          "folder: it makes its own key pair and sends back node.key.pub (see each README.txt)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from fedpose.cli.common import add_config

    prov = sub.add_parser("provision", help="write a kit per site (CA cert, policy template, kit.json, SuperNode "
                                            "start script and systemd unit; no private key) and one for the server")
    prov.add_argument("--out", required=True, help="a new folder outside any git repository")
    prov.add_argument("--sites", required=True, help="comma-separated site names, e.g. hospital-a,hospital-b")
    prov.add_argument("--host", action="append", default=None,
                      help="the server's name or IP (repeat; the first is the address sites dial)")
    prov.add_argument("--port", type=int, default=8000, help="the port the sites dial (default 8000): it serves the "
                                                             "SuperLink's Fleet API and nothing else")
    prov.add_argument("--control-port", type=int, default=kit.CONTROL_PORT,
                      help=f"the SuperLink's own port on 127.0.0.1, for the operator's flwr and fedpose server run "
                           f"(default {kit.CONTROL_PORT})")
    add_config(prov, help="the federation's config, a file or a shipped name (default default): its batch size, "
                          "local steps and psi go into the kits")
    prov.add_argument("--days", type=int, default=365, help="certificate validity")
    prov.add_argument("--wheel", default=None, help="the fedpose wheel the kits install from (default: built from "
                                                    "the source checkout fedpose runs from)")
    prov.add_argument("--constraints", default=None, help="the constraints.txt the kits install with (default: the "
                                                          "checkout's)")
    prov.add_argument("--install-dir", default=kit.INSTALL, help=f"where sites unpack their kits (default "
                                                                  f"{kit.INSTALL}/<site>)")
    prov.add_argument("--state-dir", default=kit.STATE, help=f"the sites' state: ledger, checks, replies (default "
                                                              f"{kit.STATE}/<site>)")
    prov.add_argument("--venv", default=kit.VENV,
                      help=f"the virtual environment fedpose runs from (default {kit.VENV})")
    prov.add_argument("--user", default=kit.USER, help=f"the service account of the SuperNode (default {kit.USER})")
    prov.add_argument("--verbose", action="store_true", help="debug logging")
    prov.set_defaults(func=cmd_provision)
