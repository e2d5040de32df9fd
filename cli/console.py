"""``fedpose console``: the read-only web console of a site or of the federation server (served locally).

    fedpose console --policy /opt/fedpose/hospital-a/policy.yaml        # a hospital site
    fedpose console --out /srv/fedpose/run1                              # the federation server's run

It reads the same files as ``fedpose site status`` / ``fedpose server status`` on every request, serves
``/`` (the page), ``/api/status`` (JSON) and ``/metrics`` (Prometheus), bound to 127.0.0.1 unless
``--host`` says otherwise; then a token is required (printed, or given with ``--token``). Without a token
it answers only requests addressed to a loopback name (``Host`` 127.0.0.1, localhost or [::1]), so that a
web page cannot read it by DNS rebinding (``fedpose.shared.console``, the server itself).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_console(args: argparse.Namespace) -> int:
    from fedpose.shared.console import serve_console

    if bool(args.policy) == bool(args.out):
        raise ValueError("console: give --policy (a site's console) or --out (the server's run folder), one of them")
    if args.policy:
        from fedpose.client.status import site_metrics, site_status

        policy = Path(args.policy).expanduser().resolve()
        site_status(policy)  # fail now on an unreadable policy or ledger, not on the first page view

        def status() -> dict[str, Any]:
            return site_status(policy, approved=args.approved, superlink=args.superlink)

        metrics, title = site_metrics, "fedpose site console"
    else:
        from fedpose.server.status import server_metrics, server_status

        out = Path(args.out).expanduser().resolve()
        server_status(out)

        def status() -> dict[str, Any]:
            return server_status(out)

        metrics, title = server_metrics, "fedpose federation console"
    serve_console(title, status, metrics, host=args.host, port=args.port, token=args.token)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("console", help="a read-only web console of a site (--policy) or of the server's run "
                                       "(--out), with Prometheus /metrics")
    p.add_argument("--policy", default=None, help="a site's policy YAML: the site console")
    p.add_argument("--out", default=None, help="the server's run folder: the federation console")
    p.add_argument("--approved", default=None, help="site: approved-apps file (default: the kit's)")
    p.add_argument("--superlink", default=None, help="site: HOST:PORT to check (default: the kit's kit.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs a token)")
    p.add_argument("--port", type=int, default=8480, help="port (default 8480; 0: any free port)")
    p.add_argument("--token", default=None, help="the token to require (default: a random one when not on loopback)")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_console)
