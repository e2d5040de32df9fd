"""``fedpose site approve | start``: which app bundles a hospital's SuperNode runs (client/app_trust.py).

``approve`` records the SHA-256 of a reviewed bundle (a ``.fab`` built with
``flwr build`` or the app directory itself) in the site's approved-apps file;
``start`` runs ``flower-supernode`` with the site's gate first on PATH, so
that every ClientApp process checks the submitted bundle against that file
before installing or importing it.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any


def cmd_approve(args: argparse.Namespace) -> int:
    from client.app_trust import fab_digest, parse_approved

    digest = fab_digest(args.bundle)
    path = Path(args.approved).expanduser()
    known = parse_approved(path.read_text(encoding="utf-8"), origin=str(path)) if path.is_file() else frozenset()
    if digest in known:
        print(f"{digest} is already approved in {path}")
        return 0
    note = " ".join((args.note or Path(args.bundle).name).split())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(f"{digest}  # {note}\n")
    print(f"approved {digest} ({note}) in {path}")
    return 0


def _supernode_args(rest: list[str]) -> list[str]:
    args = rest[1:] if rest and rest[0] == "--" else rest
    for i, arg in enumerate(args):
        if arg == "--isolation" and i + 1 < len(args) and args[i + 1] != "subprocess" or arg.startswith(
                "--isolation=") and arg != "--isolation=subprocess":
            raise ValueError("fedpose site start gates the ClientApp processes the SuperNode starts itself: "
                             "use the default --isolation subprocess (with --isolation process, put the gate "
                             "directory first on the PATH of your own flower-superexec instead)")
    return args


def cmd_start(args: argparse.Namespace) -> int:
    from client.app_trust import gated_env, load_approved, write_shim

    supernode_args = _supernode_args(list(args.supernode_args))
    approved = Path(args.approved).expanduser().resolve()
    digests = load_approved(approved)
    gate_dir = Path(args.gate_dir).expanduser() if args.gate_dir else approved.parent / "gate-bin"
    shim = write_shim(gate_dir, approved=approved)
    exe = shutil.which("flower-supernode")
    if exe is None:
        raise FileNotFoundError("flower-supernode is not on PATH: install fedpose (it depends on flwr) in this "
                                "environment")
    env = gated_env(shim.parent)
    print(f"SuperNode runs only app bundles approved in {approved} ({len(digests)} digest"
          f"{'s' if len(digests) != 1 else ''}); gate {shim}", flush=True)
    os.execve(exe, [exe, *supernode_args], env)  # the SuperNode replaces this process (signals reach it)
    return 0  # pragma: no cover


def register(sub: Any) -> None:
    site = sub.add_parser("site", help="a hospital's SuperNode: approve app bundles, start the gated SuperNode")
    ss = site.add_subparsers(dest="site_command", required=True)

    ap = ss.add_parser("approve", help="add a reviewed bundle's SHA-256 to the site's approved-apps file")
    ap.add_argument("--bundle", required=True, help="the .fab built with `flwr build`, or the app directory")
    ap.add_argument("--approved", required=True, help="the site's approved-apps file (created if missing)")
    ap.add_argument("--note", default=None, help="comment stored beside the digest (default: the bundle name)")
    ap.add_argument("--verbose", action="store_true", help="debug logging")
    ap.set_defaults(func=cmd_approve)

    st = ss.add_parser("start", help="flower-supernode that runs only approved bundles: "
                                     "fedpose site start --approved FILE -- <flower-supernode arguments>")
    st.add_argument("--approved", required=True, help="the site's approved-apps file")
    st.add_argument("--gate-dir", default=None, help="where the gate executable is written "
                                                     "(default: gate-bin beside the approved file)")
    st.add_argument("supernode_args", nargs=argparse.REMAINDER, help="-- then the flower-supernode arguments")
    st.add_argument("--verbose", action="store_true", help="debug logging")
    st.set_defaults(func=cmd_start)
