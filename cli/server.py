"""``fedpose server prepare | run | status``: the federation server's steps.

``prepare``: the server's public split, validation split and pretrained weights (server/prepare.py).
``run``: submit the federation to the SuperLink with ``flwr run``, follow it and exit non-zero unless it
finished completed (``flwr run`` itself returns 0 as soon as the run is submitted; server/submit.py).
``status``: the run folder's rounds, per-site spend and events (server/status.py).
``export-public``: the public split as one archive with its digest, for the sites (server/prepare.py).
``build-app``: the Flower app and the bundle the sites approve, from this install (cli/app_bundle.py).
``register-sites``: the sites' public keys, registered again safely (cli/register_sites.py).
``front``: the sites' address, which passes the SuperLink's Fleet API only (server/front.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedpose.server.submit import RUN_FAILED


def cmd_prepare(args: argparse.Namespace) -> int:
    from fedpose.cli.common import load_cli_config
    from fedpose.server.prepare import prepare_server

    prepare_server(load_cli_config(args), Path(args.out), progress=not args.quiet)
    return 0


def cmd_export_public(args: argparse.Namespace) -> int:
    from fedpose.cli.common import load_cli_config
    from fedpose.server.prepare import export_public

    export_public(load_cli_config(args), args.out)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Submit, follow, and say plainly how the run ended (exit 0 only when it finished completed)."""
    from fedpose.server.submit import submit_run

    return submit_run(args.app, args.connection, args.out, config=args.config, resume=args.resume,
                      timeout=args.timeout, poll=args.poll)


def cmd_front(args: argparse.Namespace) -> int:
    import logging
    import signal

    from fedpose.server.front import Limits, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    superlink = list(args.superlink_command or [])
    if superlink[:1] == ["--"]:
        superlink = superlink[1:]
    limits = Limits(max_body_mib=args.max_body_mib, header_timeout=args.header_timeout,
                    max_connections=args.max_connections)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a service manager's stop ends the front cleanly
    try:
        return serve(args.listen, args.superlink, ca=Path(args.ca), cert=Path(args.cert), key=Path(args.key),
                     superlink=superlink or None, limits=limits)
    except KeyboardInterrupt:
        return 0


def cmd_status(args: argparse.Namespace) -> int:
    from fedpose.server.status import server_status

    status = server_status(args.out)
    if args.json:
        print(json.dumps(status, indent=1, default=str))
        return 0
    print(f"federation {status['federation']} in {status['out']}: {status['state']}"
          + (f" ({status['state_reason']})" if status["state_reason"] else "")
          + f", {len(status['rounds'])}/{status['rounds_planned'] or '?'} rounds, {status['resumes']} resume(s)")
    if status["rounds"]:
        print(f"PCKh@0.5: start {status['initial_pckh'] or float('nan'):.2f}, latest {status['latest_pckh']:.2f}, "
              f"best {status['best_pckh']:.2f}")
    for site, s in sorted(status["sites"].items()):
        print(f"  {site}: eps {s['epsilon']:.4f} of {s['budget']:g} (delta {s['delta']:g}), {s['rounds']} rounds"
              + (f" + {s['unanswered']} asked with no answer (counted as spent)" if s["unanswered"] else "")
              + f", {s['status']}" + (f" ({s['reason']})" if s["reason"] else ""))
    for e in status["events"][-10:]:
        print(f"  round {e['round']}: {e['site']} {e['kind']}: {e['reason'][:160]}")
    if status["claim"]:
        print(f"claim: {status['claim']}")
    elif status["guarantee"]:
        print(f"guarantee: {status['guarantee']} (the claim is written when the run finishes)")
    return 0


def register(sub: Any) -> None:
    from fedpose.cli.common import add_config

    server = sub.add_parser("server", help="the federation server: prepare its data and weights, run and follow "
                                           "a federation, its status")
    ss = server.add_subparsers(dest="server_command", required=True)
    prep = ss.add_parser("prepare", help="make or check the public split, the validation split and the public "
                                         "pretrained weights; write a config with absolute paths (server.yaml)")
    add_config(prep, help="the federation's config, a file or a shipped name (default default)")
    prep.add_argument("--out", required=True, help="folder for server.yaml and for what the config's relative "
                                                    "paths name: the data, the weights (e.g. /srv/fedpose)")
    prep.add_argument("--quiet", action="store_true", help="no progress bars")
    prep.add_argument("--verbose", action="store_true", help="debug logging")
    prep.set_defaults(func=cmd_prepare)

    exp = ss.add_parser("export-public", help="write the public split as one archive and print its digest: what "
                                              "each site unpacks and approves (fedpose site approve-public --digest)")
    add_config(exp, help="the config fedpose server prepare wrote (server.yaml)")
    exp.add_argument("--out", required=True, help="the archive to write (e.g. /srv/fedpose/public-split.tar.gz); it "
                                                  "unpacks to public-split/")
    exp.add_argument("--verbose", action="store_true", help="debug logging")
    exp.set_defaults(func=cmd_export_public)

    run = ss.add_parser("run", help="submit the federation with flwr run, follow it, exit 0 only if it finished "
                                    f"completed ({int(RUN_FAILED)}: failed, stopped or not submitted)",
                        description="Submit the federation with flwr run and follow it. Exit 0 only if it finished "
                                    f"completed; {int(RUN_FAILED)}: failed, stopped or not submitted.")
    run.add_argument("--connection", required=True, help="the SuperLink connection in $FLWR_HOME/config.toml "
                                                         "(e.g. pilot)")
    run.add_argument("--out", required=True, help="the run's results folder (on this machine)")
    run.add_argument("--config", default="server.yaml", help="the config `server prepare` wrote (default server.yaml)")
    run.add_argument("--app", default=".", help="the app folder fedpose server build-app wrote, whose bundle the "
                                                "sites approved (default: here)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    run.add_argument("--timeout", type=float, default=24 * 3600.0, help="stop following after this many seconds "
                                                                       "(default one day)")
    run.add_argument("--poll", type=float, default=10.0, help="seconds between two looks at the run (default 10)")
    run.add_argument("--verbose", action="store_true", help="debug logging")
    run.set_defaults(func=cmd_run)

    from fedpose.cli.app_bundle import register as register_build_app
    from fedpose.cli.register_sites import register as register_sites

    register_build_app(ss)
    register_sites(ss)

    front = ss.add_parser("front", help="serve the sites' address: forward the Fleet API (and /health) to the "
                                        "SuperLink on this machine, refuse everything else (its Control API)")
    front.add_argument("--listen", required=True, help="the address the sites dial, HOST:PORT (e.g. 0.0.0.0:8000)")
    front.add_argument("--superlink", required=True,
                       help="the SuperLink's own address, on this machine (e.g. 127.0.0.1:9093)")
    front.add_argument("--ca", required=True, help="the CA certificate (ca.crt): checks the SuperLink's certificate")
    front.add_argument("--cert", required=True, help="the server certificate the sites check (server.pem)")
    front.add_argument("--key", required=True, help="its private key (server.key)")
    from fedpose.server.front import Limits

    defaults = Limits()
    front.add_argument("--max-body-mib", type=int, default=defaults.max_body_mib,
                       help="the largest request body passed on, in MiB; a larger one is answered 413 unread "
                            f"(default {defaults.max_body_mib}; the server kit passes its federation's: the model's "
                            "weights with room to spare)")
    front.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                       help="seconds a connection has to send a complete request's headers, after it opens and "
                            f"after each answer; then it is closed (default {defaults.header_timeout:g})")
    front.add_argument("--max-connections", type=int, default=defaults.max_connections,
                       help="connections held at once; more are closed as they open (default "
                            f"{defaults.max_connections}; a site's SuperNode holds a few)")
    front.add_argument("superlink_command", nargs=argparse.REMAINDER,
                       help="-- then the flower-superlink command: started, and stopped, with the front (left "
                            "out: the front serves a SuperLink started otherwise)")
    front.add_argument("--verbose", action="store_true", help="debug logging")
    front.set_defaults(func=cmd_front)

    st = ss.add_parser("status", help="a run folder's rounds, per-site spend against budget, events")
    st.add_argument("--out", required=True, help="the run's results folder")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.add_argument("--verbose", action="store_true", help="debug logging")
    st.set_defaults(func=cmd_status)
