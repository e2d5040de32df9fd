"""``fedpose provision``: one kit per site and one for the server of a pilot federation.

Each site's kit holds what its IT engineer needs and nothing of another site's: the CA
certificate, the site's own SuperNode key pair, a policy template with the run's batch size
and local steps filled in (so ``fedpose site-policy --check`` can compute the sigma floor once
the site writes its data paths and its n-derived sample rate), a start script and a systemd
unit for its SuperNode, and a README with the steps. The server's kit holds the CA, the
server certificate, the SuperLink start script and the registration commands (one per site,
with the site's name). Private keys are written with 0600 permissions, and never inside a
git work tree (a kit there is one ``git add`` away from being published).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

POLICY_TEMPLATE = """\
# fedpose site policy for {site}: fill in the FILL-ME values, then run
#   fedpose site-policy --check {policy}
# which validates it, runs the site's own checks and prints the public set's digest to approve
# (or write the whole policy with `fedpose site-policy --out ...`, see the README's deployment guide).
policy_version: 3
site: {site}
epsilon: {epsilon}                 # lifetime budget over this site's whole ledger
delta: {delta}                  # must be < 1/n for the site's n records
lifetime_rounds: {lifetime_rounds}
rounds_per_federation: {rounds}
sample_rate: FILL-ME          # batch size {batch_size} / n (n = the number of records in data_path); n never leaves the site
expected_batch: {batch_size}            # B: the public constant the noisy sum is divided by
steps_per_round: {local_steps}
clip_norm: {clip_norm}
psi: {psi}
psi_min: {psi_min}
augment: {augment}
methods: [{method}]
data_path: FILL-ME            # the site's split directory (annotations.json, images/)
ledger_path: /var/lib/fedpose/{site}/ledger.sqlite
public_path: FILL-ME          # the site's copy of the public split
public_digest: FILL-ME        # printed by `fedpose site-policy --check` for the public set you approve
eval_path: null               # optional: a held-out split; each global model is scored on it here, never sent
accountant: {accountant}
"""

SUPERNODE_SCRIPT = """\
#!/bin/sh
# Start the SuperNode of {site}: it runs only the app bundles approved in approved.txt
# (`fedpose site approve --bundle APP.fab --approved approved.txt` after reviewing the bundle), and is
# started again after an error exit (e.g. refused for about 60 s after a crash) for up to 5 minutes.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec fedpose site start --approved "$here/approved.txt" -- --superlink {address} \\
  --root-certificates "$here/ca.crt" --auth-supernode-private-key "$here/node.key" \\
  --node-config "site-policy='$here/policy.yaml'" --host 127.0.0.1 --port 9094
"""

SYSTEMD_UNIT = """\
[Unit]
Description=fedpose SuperNode of {site}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
# Install the kit at {install} (owned by the service user, keys 0600), or change the paths below.
ExecStart={install}/start-supernode.sh
Restart=on-failure
RestartSec=30

[Install]
WantedBy=multi-user.target
"""

SUPERLINK_SCRIPT = """\
#!/bin/sh
# Start the central SuperLink with TLS and SuperNode authentication.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec flower-superlink --ssl-ca-certfile "$here/ca.crt" --ssl-certfile "$here/server.pem" \\
  --ssl-keyfile "$here/server.key" --enable-supernode-auth --host 0.0.0.0 --port {port} \\
  --database "$here/superlink.db"
"""


def _inside_git_tree(path: Path) -> Path | None:
    """The root of the git work tree holding ``path`` (or the nearest existing parent), or None."""
    for parent in [path, *path.parents]:
        if (parent / ".git").exists():
            return parent
    return None


def _write(path: Path, text: str, *, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)


def provision(out: Path, *, sites: list[str], hosts: list[str], port: int, cfg, days: int = 365) -> dict[str, Path]:
    """Write the kits under ``out`` (server/ and one folder per site); returns {kit name: folder}."""
    from cli.certs import make_certs

    out = out.expanduser().resolve()
    repo = _inside_git_tree(out)
    if repo is not None:
        raise ValueError(f"{out} is inside the git work tree {repo}: private keys must never be written there; "
                         "choose a folder outside any repository (e.g. ~/fedpose-kits)")
    if not sites:
        raise ValueError("provision: name at least one site (--sites hospital-a,hospital-b)")
    bad = [s for s in sites if not _NAME.match(s) or s == "server"]
    if bad or len(set(sites)) != len(sites):
        raise ValueError(f"provision: site names must be distinct, 1-64 letters, digits, '.', '_' or '-' and not "
                         f"'server' (got {sites})")
    if not 0 < port < 65536:
        raise ValueError(f"provision: --port {port} is not a TCP port")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: provision into a new folder")
    server = out / "server"
    make_certs(server, nodes=len(sites), hosts=hosts, days=days)
    address = f"{hosts[0]}:{port}"
    kits = {"server": server}
    register = ["#!/bin/sh", "# Register each site's public key with the SuperLink (run once, on the server).",
                "set -eu", 'here=$(cd "$(dirname "$0")" && pwd)']
    for i, site in enumerate(sites, start=1):
        kit = out / site
        kit.mkdir(parents=True)
        shutil.copyfile(server / "ca.crt", kit / "ca.crt")
        shutil.move(str(server / f"node-{i}"), kit / "node.key")
        os.chmod(kit / "node.key", 0o600)
        shutil.copyfile(server / f"node-{i}.pub", kit / "node.key.pub")
        shutil.move(str(server / f"node-{i}.pub"), server / f"{site}.pub")
        policy = kit / "policy.yaml"
        _write(policy, POLICY_TEMPLATE.format(
            site=site, policy=policy, epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta,
            lifetime_rounds=cfg.federation.rounds, rounds=cfg.federation.rounds, batch_size=cfg.train.batch_size,
            local_steps=cfg.federation.local_steps, clip_norm=cfg.privacy.clip_norm, psi=cfg.privacy.psi,
            psi_min=cfg.privacy.psi_param, augment=str(cfg.data.augment).lower(), method=cfg.train.method,
            accountant=cfg.privacy.accountant))
        _write(kit / "start-supernode.sh", SUPERNODE_SCRIPT.format(site=site, address=address), mode=0o755)
        _write(kit / "fedpose-supernode.service", SYSTEMD_UNIT.format(site=site, install=f"/opt/fedpose/{site}"))
        _write(kit / "README.txt", (
            f"fedpose site kit for {site}\n\n"
            f"1. Copy this folder to the site's server (e.g. /opt/fedpose/{site}); keep node.key private (0600).\n"
            f"2. Fill in policy.yaml (data_path, public_path, sample_rate = {cfg.train.batch_size} / n), then run\n"
            f"   fedpose site-policy --check policy.yaml\n"
            f"   and put the printed public_digest into the policy once you approve that public set.\n"
            f"3. Review the app bundle the operator sends (APP.fab), then approve it:\n"
            f"   fedpose site approve --bundle APP.fab --approved approved.txt\n"
            f"   Start the SuperNode: ./start-supernode.sh, or install fedpose-supernode.service (systemd).\n"
            f"4. Send node.key.pub to the federation operator (it is registered as {site}).\n"))
        register.append(f'flwr supernode register "$here/{site}.pub" pilot --name {site}')
    _write(server / "register-sites.sh", "\n".join(register) + "\n", mode=0o755)
    _write(server / "start-superlink.sh", SUPERLINK_SCRIPT.format(port=port), mode=0o755)
    _write(server / "README.txt", (
        "fedpose server kit\n\n"
        "Keep ca.key and server.key private (0600); never copy them to a site.\n"
        "0. Prepare the server's public data and pretrained weights (absolute paths, progress output):\n"
        "   fedpose server prepare --config configs/default.yaml --out /srv/fedpose\n"
        "1. ./start-superlink.sh\n"
        f"2. Add a [superlink.pilot] connection to $FLWR_HOME/config.toml: address = \"{address}\",\n"
        "   root-certificates = the absolute path of ca.crt here.\n"
        "3. ./register-sites.sh (one registration per site, named as the site).\n"
        "4. Send each site its own folder; the sites start their SuperNodes, then run the federation with\n"
        "   flwr run . pilot --stream --run-config \"config='/srv/fedpose/server.yaml' out='/srv/fedpose/run1'\"\n"
        "   After a crash: restart the SuperLink (same database), then resume with only\n"
        "   flwr run . pilot --stream --run-config \"out='/srv/fedpose/run1' resume=true\"\n"))
    for site in sites:
        kits[site] = out / site
    return kits


def cmd_provision(args: argparse.Namespace) -> int:
    from shared.config import load_config

    cfg = load_config(args.config)
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    kits = provision(Path(args.out), sites=sites, hosts=args.host or ["localhost"], port=args.port,
                     cfg=cfg, days=args.days)
    for name, path in kits.items():
        print(f"{name}: {path}")
    print("private keys (server/ca.key, server/server.key, <site>/node.key) are 0600: send each site only its own "
          "folder; see each README.txt")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from cli.main import DEFAULT_CONFIG

    prov = sub.add_parser("provision", help="write a kit per site (CA cert, key pair, policy template, SuperNode "
                                            "start script and systemd unit) and one for the server")
    prov.add_argument("--out", required=True, help="a new folder outside any git repository")
    prov.add_argument("--sites", required=True, help="comma-separated site names, e.g. hospital-a,hospital-b")
    prov.add_argument("--host", action="append", default=None,
                      help="the server's name or IP (repeat; the first is the address sites dial)")
    prov.add_argument("--port", type=int, default=8000)
    prov.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config (batch size, local steps, psi)")
    prov.add_argument("--days", type=int, default=365, help="certificate validity")
    prov.add_argument("--verbose", action="store_true", help="debug logging")
    prov.set_defaults(func=cmd_provision)
