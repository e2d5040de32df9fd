"""``fedpose site keygen | check | approve | start``: a hospital's SuperNode: its own key pair, its own checks,
which app bundles it runs (client/app_trust.py).

``approve`` records the SHA-256 of a reviewed bundle (a ``.fab`` built with
``flwr build`` or the app directory itself) in the site's approved-apps file;
``start`` runs ``flower-supernode`` with the site's gate first on PATH, so
that every ClientApp process checks the submitted bundle against that file
before installing or importing it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any


from fedpose.cli.processes import start_warm, stop_warm  # noqa: E402
from fedpose.cli.supervise import supervise  # noqa: E402,F401  (tests import it from here)


def cmd_approve(args: argparse.Namespace) -> int:
    from fedpose.client.app_trust import fab_digest, parse_approved

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


def cmd_keygen(args: argparse.Namespace) -> int:
    """The site's own SuperNode key pair: the private key never leaves the site; the operator registers the .pub."""
    from fedpose.cli.certs import key_comment, node_key_pair, write_key_file
    from fedpose.cli.provision import _inside_git_tree

    out = Path(args.out).expanduser().resolve()
    repo = _inside_git_tree(out)
    if repo is not None:
        raise ValueError(f"{out} is inside the git work tree {repo}: a private key must never be written there; "
                         "choose the site's own folder (e.g. /etc/fedpose)")
    key, pub = out / args.name, out / f"{args.name}.pub"
    existing = [p.name for p in (key, pub) if p.exists()]
    if existing and not args.force:
        raise ValueError(f"{out} already holds {', '.join(existing)}: a new key pair replaces the one the operator "
                         "registered (use --force, then send the new .pub and ask for the old one to be unregistered)")
    out.mkdir(parents=True, exist_ok=True)
    private, public = node_key_pair(args.comment or key_comment(out, args.name))
    write_key_file(key, private, private=True)
    write_key_file(pub, public, private=False)
    print(f"wrote {key} (private, 0600: it stays here) and {pub}")
    print(f"send {pub.name} to the federation operator; they register it with "
          f"`flwr supernode register {pub.name} <connection>`")
    return 0


def _edit_policy(path: Path, updates: dict[str, Any]) -> None:
    """Write ``updates`` into the policy YAML at ``path`` keeping its comments and order (line by line)."""
    import yaml

    lines = path.read_text(encoding="utf-8").splitlines()
    for key, value in updates.items():
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10_000).strip()
        if text.startswith("{") and text.endswith("}"):
            text = text[1:-1]
        for i, line in enumerate(lines):
            if line.split("#", 1)[0].split(":", 1)[0].strip() == key and not line.startswith((" ", "\t")):
                comment = line.split("#", 1)[1] if "#" in line else ""
                lines[i] = (f"{text:<28}  # {comment.strip()}" if comment else text)  # YAML needs a space before #
                break
        else:
            lines.append(text)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)


def cmd_set_data(args: argparse.Namespace) -> int:
    """Name the site's data in its policy and derive the public sample rate q = B / n from it, once."""
    import yaml

    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.patients import group_by_patient

    path = Path(args.policy).expanduser().resolve()
    data = Path(args.data).expanduser().resolve()
    records = load_split_dir(data, "site data")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    unit = raw.get("unit", "record")
    n = group_by_patient(records, cap=raw.get("max_records_per_patient"))[1].count if unit == "patient" else \
        len(records)
    batch = raw.get("expected_batch")
    if not isinstance(batch, (int, float)) or isinstance(batch, bool) or batch <= 0:
        raise ValueError(f"{path}: expected_batch must be set (the public batch size B the site declares) before "
                         "the sample rate can be derived from it")
    if batch > n:
        raise ValueError(f"{path}: expected_batch {batch:g} is more than the {n} {unit}s at {data}: lower it")
    q = round(batch / n, 4)
    _edit_policy(path, {"data_path": str(data), "sample_rate": q})
    print(f"{path}: data_path {data}; sample_rate {q:g} (= expected batch {batch:g} / {n} {unit}s, computed once here)")
    print(f"the server will see q = {q:g} and B = {batch:g}: together they tell the size of this data today "
          f"(about {n} {unit}s), not which {unit}s it holds")
    return 0


def cmd_approve_public(args: argparse.Namespace) -> int:
    """Show the public set, then write its path and digest into the policy: what the site trusts as public."""
    from fedpose.client.site_data import load_split_dir
    from fedpose.shared.data.split import manifest_digest as public_digest

    path = Path(args.policy).expanduser().resolve()
    public = Path(args.public).expanduser().resolve()
    records = load_split_dir(public, "public set")
    images = len({r.image for r in records})
    digest = public_digest(records)
    print(f"public set {public}: {len(records)} annotated people in {images} images")
    print(f"digest {digest}")
    print("approving it means: this set is public (no patient of this hospital is in it); the site computes its "
          "projection basis from it, and `fedpose site check` refuses to run if it ever changes")
    _edit_policy(path, {"public_path": str(public), "public_digest": digest})
    print(f"{path}: public_path and public_digest written; now run: fedpose site check --policy {path}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Everything an operator checks, in one place; exit 0 healthy, 1 not (the reasons are printed)."""
    import json

    from fedpose.client.site_status import site_status

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
    from fedpose.cli.site_policy import report_check
    from fedpose.client.policy import load_policy

    path = Path(args.policy).expanduser().resolve()
    report_check(load_policy(path), path)
    return 0


def _with_policy(supernode_args: list[str], policy: Path) -> list[str]:
    """The SuperNode arguments with ``--node-config site-policy=...`` naming ``policy`` (added when absent)."""
    for i, arg in enumerate(supernode_args):
        value = supernode_args[i + 1] if arg == "--node-config" and i + 1 < len(supernode_args) else (
            arg.split("=", 1)[1] if arg.startswith("--node-config=") else None)
        if value is not None and "site-policy" in value:
            named = value.split("site-policy", 1)[1].lstrip(" =").strip("'\"")
            if Path(named).expanduser().resolve() != policy:
                raise ValueError(f"--policy {policy} but the SuperNode's --node-config names {named}: give one")
            return supernode_args
    return [*supernode_args, "--node-config", f"site-policy='{policy}'"]


def cmd_start(args: argparse.Namespace) -> int:
    from fedpose.client.app_trust import gated_env, load_approved, write_shim

    supernode_args = _supernode_args(list(args.supernode_args))
    supernode = supernode_command(poll=args.poll)  # a bad --poll or no Flower: refused before any check runs
    if args.policy:
        from fedpose.cli.site_policy import report_check
        from fedpose.client.policy import load_policy

        policy = Path(args.policy).expanduser().resolve()
        report_check(load_policy(policy), policy)  # the checks that read private data run here, once, not per message
        supernode_args = _with_policy(supernode_args, policy)
    approved = Path(args.approved).expanduser().resolve()
    digests = load_approved(approved)
    gate_dir = Path(args.gate_dir).expanduser() if args.gate_dir else approved.parent / "gate-bin"
    if args.retry_for < 0:
        raise ValueError(f"--retry-for: must be >= 0 seconds, got {args.retry_for}")
    warm = None if args.cold else start_warm(approved)
    try:
        shim = write_shim(gate_dir, approved=approved, warm_socket=warm[1] if warm else None)
        env = gated_env(shim.parent)
        # Flower's SuperExec looks for a new message every second by default; a site answers sooner at 0.1 s.
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
        print(f"SuperNode runs only app bundles approved in {approved} ({len(digests)} digest"
              f"{'s' if len(digests) != 1 else ''}); gate {shim}"
              + ("; ClientApps forked warm" if warm else "; every ClientApp started cold")
              + f"; looks for messages every {args.poll:g} s", flush=True)
        return supervise([*supernode, *supernode_args], env, retry_for=args.retry_for, pause=args.retry_pause,
                         keep=frozenset({warm[0].pid}) if warm else frozenset(), alive=gate_dir / "supernode.alive")
    finally:
        if warm is not None:
            stop_warm(*warm)


def supernode_command(*, poll: float) -> list[str]:
    """The SuperNode's command (its arguments follow): Flower's SuperNode through ``fedpose.cli.supernode_poll`` when
    the site looks for messages more often than Flower's 3 s, else Flower's own ``flower-supernode`` (found beside
    this Python first, then on PATH)."""
    import importlib.util
    import os

    from fedpose.shared.flower.waits import FLOWER_IDLE_WAIT, CappedTime

    CappedTime(poll)  # refuses a poll outside (0, 3] before anything starts
    if poll < FLOWER_IDLE_WAIT:
        if importlib.util.find_spec("flwr.supernode") is None:
            raise FileNotFoundError("Flower's SuperNode is not installed: install fedpose (it depends on flwr) in "
                                    "this environment")
        return [sys.executable, "-m", "fedpose.cli.supernode_poll", "--poll", repr(poll), "--"]
    exe = shutil.which("flower-supernode", path=os.pathsep.join(
        [str(Path(sys.executable).parent), *filter(None, [os.environ.get("PATH")])]))
    if exe is None:
        raise FileNotFoundError("flower-supernode is not beside this Python nor on PATH: install fedpose (it "
                                "depends on flwr) in this environment")
    return [exe]


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
    ap2.add_argument("public", help="the site's copy of the public split")
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
