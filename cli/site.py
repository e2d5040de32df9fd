"""``fedpose site keygen | check | approve | start``: a hospital's SuperNode: its own key pair, its own checks,
which app bundles it runs (client/app_trust.py). The steps on the site's files are client/site_setup.py, the
SuperNode's start and supervision client/supernode.py.

``approve`` records the SHA-256 of a reviewed bundle (a ``.fab`` built with
``flwr build`` or the app directory itself) in the site's approved-apps file;
``start`` runs ``flower-supernode`` with the site's gate first on PATH, so
that every ClientApp process checks the submitted bundle against that file
before installing or importing it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_approve(args: argparse.Namespace) -> int:
    from fedpose.client.site_setup import approve_bundle

    approve_bundle(args.bundle, args.approved, note=args.note)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """The site's own SuperNode key pair: the private key never leaves the site; the operator registers the .pub."""
    from fedpose.client.site_setup import keygen

    keygen(args.out, name=args.name, comment=args.comment, force=args.force)
    return 0


def cmd_set_data(args: argparse.Namespace) -> int:
    """Name the site's data in its policy and derive the public sample rate q = B / n from it, once."""
    from fedpose.client.site_setup import set_data

    set_data(args.policy, args.data)
    return 0


def cmd_approve_public(args: argparse.Namespace) -> int:
    """Show the public set, then write its path and digest into the policy: what the site trusts as public."""
    from fedpose.client.site_setup import approve_public

    approve_public(args.policy, args.public, expected=args.digest)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Everything an operator checks, in one place; exit 0 healthy, 1 not (the reasons are printed)."""
    import json

    from fedpose.client.status import site_status

    status = site_status(args.policy, approved=args.approved, superlink=args.superlink, ca=args.ca)
    if args.json:
        print(json.dumps(status, indent=1, default=str))
        return 0 if status["healthy"] else 1
    print(f"site {status['site'] or '?'}: {'healthy' if status['healthy'] else 'NEEDS ATTENTION'}")
    for problem in status["problems"]:
        print(f"  - {problem}")
    if status["policy"].get("guarantee"):
        print(f"guarantee in force: {status['policy']['guarantee']}")
    if "budget" in status:
        life = status["budget"]["lifetime"]
        print(f"privacy budget: eps {life['spent']:.4f} spent of {life['budget']:g} (left {life['left']:.4f}); "
              f"{life['rounds']} of {life['rounds_max']} lifetime rounds")
        for f in status["budget"]["federations"]:
            print(f"  federation {f['federation']}: eps {f['spent']:.4f}, {f['rounds']} of {f['rounds_max']} rounds")
        checks = status["checks"]
        print(f"checks: {'current' if checks['current'] else 'NOT current'}" +
              (f" ({checks['records']} records kept, {checks['dropped']} left out, {checks['checked_at']})"
               if checks["records"] is not None else ""))
        for alert in checks["alerts"]:
            print(f"  alert: {alert}")
        print(f"approved bundles: {len(status['bundles']['approved'])} ({status['bundles']['path']})")
        link = status["superlink"]
        if link["address"]:
            print(f"SuperLink {link['address']}: {'reachable' if link['reachable'] else 'NOT reachable'}")
        cert = status["certificate"]
        if cert["expires"]:
            print(f"CA certificate: expires {cert['expires']} ({cert['days_left']} days)")
        for row in status["rounds"][-5:]:
            print(f"  round {row['round']} of {row['federation']}: {row['method']}, sigma {row['sigma']:.4f}, "
                  f"q {row['sample_rate']:.4f}, {row['steps']} steps, eps after {row['epsilon']:.4f} ({row['state']})")
        for event in status["refusals"][-5:]:
            print(f"  refused {event['at']}: {event['code_name']}: {event['reason'][:160]}")
    return 0 if status["healthy"] else 1


def cmd_check(args: argparse.Namespace) -> int:
    """The site's own checks of its policy and data, recorded for its SuperNode (run after any change)."""
    from fedpose.client.data import report_check
    from fedpose.client.policy import load_policy

    path = Path(args.policy).expanduser().resolve()
    report_check(load_policy(path), path)
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    from functools import partial

    from fedpose.client.data import report_check
    from fedpose.client.supernode import start_site

    # the worst case is measured by `site check`; each request's is bounded again before its charge
    check = partial(report_check, measure=False)
    return start_site(args.approved, args.supernode_args, policy=args.policy, check=check,
                      gate_dir=args.gate_dir, retry_for=args.retry_for, retry_pause=args.retry_pause, cold=args.cold,
                      poll=args.poll)


def register(sub: Any) -> None:
    site = sub.add_parser("site", help="a hospital's SuperNode: approve app bundles, start the gated SuperNode")
    ss = site.add_subparsers(dest="site_command", required=True)

    ap = ss.add_parser("approve", help="add a reviewed bundle's SHA-256 to the site's approved-apps file")
    ap.add_argument("--bundle", required=True, help="the .fab built with `flwr build`, or the app directory")
    ap.add_argument("--approved", required=True, help="the site's approved-apps file (created if missing)")
    ap.add_argument("--note", default=None, help="comment stored beside the digest (default: the bundle name)")
    ap.add_argument("--verbose", action="store_true", help="debug logging")
    ap.set_defaults(func=cmd_approve)

    kg = ss.add_parser("keygen", help="make this site's SuperNode key pair (send only the .pub to the operator)")
    kg.add_argument("--out", required=True, help="the site's folder for its key (outside any git repository)")
    kg.add_argument("--name", default="node.key", help="file name of the private key (default node.key; the public "
                                                       "key gets .pub)")
    kg.add_argument("--comment", default=None, help="public key comment (default fedpose-<site> in a kit)")
    kg.add_argument("--force", action="store_true", help="replace an existing key pair")
    kg.add_argument("--verbose", action="store_true", help="debug logging")
    kg.set_defaults(func=cmd_keygen)

    sd = ss.add_parser("set-data", help="name the site's data in its policy and derive the public sample rate "
                                        "q = expected_batch / n from it, once")
    sd.add_argument("--policy", required=True, help="the site's policy YAML (edited in place)")
    sd.add_argument("data", help="the site's split directory (annotations.json, images/)")
    sd.add_argument("--verbose", action="store_true", help="debug logging")
    sd.set_defaults(func=cmd_set_data)

    ap2 = ss.add_parser("approve-public", help="show a public set and approve it in the policy (path and digest)")
    ap2.add_argument("--policy", required=True, help="the site's policy YAML (edited in place)")
    ap2.add_argument("public", help="the site's copy of the public split (the folder the operator's "
                                    "public-split.tar.gz unpacks to)")
    ap2.add_argument("--digest", default=None, help="the digest the operator sent with the public split (fedpose "
                                                    "server export-public prints it): a copy that does not match "
                                                    "is refused")
    ap2.add_argument("--verbose", action="store_true", help="debug logging")
    ap2.set_defaults(func=cmd_approve_public)

    stt = ss.add_parser("status", help="policy, checks, public set, approved bundles, budget spent and left, rounds, "
                                       "refusals, SuperLink, certificate; exit 0 healthy, 1 not")
    stt.add_argument("--policy", required=True, help="the site's policy YAML")
    stt.add_argument("--approved", default=None, help="approved-apps file (default: the kit's, beside the policy)")
    stt.add_argument("--superlink", default=None, help="HOST:PORT to check (default: the kit's kit.json)")
    stt.add_argument("--ca", default=None, help="CA certificate (default: ca.crt beside the policy)")
    stt.add_argument("--json", action="store_true", help="print one JSON object")
    stt.add_argument("--verbose", action="store_true", help="debug logging")
    stt.set_defaults(func=cmd_status)

    ck = ss.add_parser("check", help="run the site's own checks of its policy and data and record them for its "
                                     "SuperNode (after any change to either)")
    ck.add_argument("--policy", required=True, help="the site's policy YAML")
    ck.add_argument("--verbose", action="store_true", help="debug logging")
    ck.set_defaults(func=cmd_check)

    st = ss.add_parser("start", help="flower-supernode that runs only approved bundles: "
                                     "fedpose site start --approved FILE --policy FILE -- <flower-supernode arguments>")
    st.add_argument("--approved", required=True, help="the site's approved-apps file")
    st.add_argument("--policy", default=None,
                    help="the site's policy: its checks run first (once, not per message) and the SuperNode is "
                         "started with it")
    st.add_argument("--gate-dir", default=None, help="where the gate executable is written "
                                                     "(default: gate-bin beside the approved file)")
    st.add_argument("--retry-for", type=float, default=300.0,
                    help="start the SuperNode again after an exit the site did not ask for (a crash, a "
                         "refused activation right after one, giving up on a SuperLink that restarted) until it "
                         "has failed for this many seconds; 0: never (default 300)")
    st.add_argument("--retry-pause", type=float, default=10.0, help="seconds between two starts (default 10)")
    st.add_argument("--cold", action="store_true",
                    help="start every ClientApp as a new Python process (default: fork it from a warm-start server "
                         "that has the libraries imported, which saves their import at every message)")
    st.add_argument("--poll", type=float, default=0.2,
                    help="seconds between two looks of the SuperNode for a new message or a reply (Flower's own "
                         "waits are 3 and 0.5 s; an idle site sends the SuperLink one small request per poll; "
                         "default 0.2, 3 runs Flower's SuperNode unchanged)")
    st.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then the flower-supernode arguments")
    st.add_argument("--verbose", action="store_true", help="debug logging")
    st.set_defaults(func=cmd_start)
