"""The files of a site's and of the server's kit, as templates: ``fedpose provision`` fills them, and the
deployment guide (docs/how-to/site-install.md) shows the same text (a test compares the two).

One set of names everywhere: ``policy.yaml``, ``approved.txt``, ``node.key`` / ``node.key.pub``,
``ca.crt``, ``kit.json``, ``start-supernode.sh``, ``fedpose-supernode.service``; the site's state
(ledger, the record of its checks, stored replies, Flower's home) in ``/var/lib/fedpose/<site>``.
"""

from __future__ import annotations
from fedpose.shared.configuration.methods import WITH_PUBLIC

INSTALL = "/opt/fedpose"  # where a site unpacks its kit: /opt/fedpose/<site>
VENV = "/opt/fedpose/venv"  # the virtual environment fedpose is installed in
STATE = "/var/lib/fedpose"  # systemd StateDirectory root: /var/lib/fedpose/<site>
USER = "fedpose"  # the service account the SuperNode runs as
CONTROL_PORT = 9093  # the SuperLink's own port on the server, 127.0.0.1 only (the sites dial the front's)

POLICY = """\
# fedpose site policy of {site}. Everything that decides this site's guarantee is pinned here, by the site.
# Three values are left for the site (each line says FILL-ME); fill them with these commands, in this order:
#   fedpose site set-data --policy {install}/{site}/policy.yaml /path/to/your/split     (data_path, sample_rate)
#   fedpose site approve-public --policy {install}/{site}/policy.yaml --digest DIGEST {install}/{site}/public-split
#                                              (public_path, digest: the operator's public split, unpacked here)
#   fedpose site check --policy {install}/{site}/policy.yaml                            (the site's own checks)
policy_version: 3
site: {site}
epsilon: {epsilon}                 # lifetime budget over this site's whole ledger (every federation it joins)
delta: {delta}                  # must be < 1/n for the site's n records
lifetime_rounds: {lifetime_rounds}            # rounds over the ledger's whole life
rounds_per_federation: {rounds}      # rounds in any one federation
expected_batch: {batch_size}            # B: records per step on average; the public constant the noisy sum is divided by
sample_rate: FILL-ME          # q = B / n, written by `fedpose site set-data` (n is counted once, here)
steps_per_round: {local_steps}          # at most this many local steps per round
clip_norm: {clip_norm}                # per-record clip C
psi: {psi}                     # fdp/fpdp: the feature map treated as public
psi_min: {psi_min}                # its minimum strength (a fraction of the image's shorter side)
augment: {augment}
# Methods: dpsgd and proj, record-level DP (what leaves covers each image within epsilon, delta). Feature-DP
# (fdp, fpdp) is opt-in: under it the server can read, exactly, a blurred copy of each image drawn for the public
# term and its pose labels from one reply; over a federation the server sees the blurred copy and labels of every
# record the public term draws, and from the draws it can count them (unless public_records pins a fixed set of
# records the draws come from: then it sees those only, and not how many this site holds). To opt in, set:
release_blurred_images_and_labels: false   # true: the server may read blurred images and their labels (Feature-DP)
public_batch_size: {public_batch_size}          # fdp/fpdp: records drawn (each once) for the public term every step
public_records: null          # fdp/fpdp: draw them from a fixed set of this many records (null: from all records)
augment_multiplicity: {augment_multiplicity}       # augmented copies of each sampled record (a round's cost grows with it)
unit: record                  # record (one image) or patient (all images of one person; needs patient ids)
data_path: FILL-ME            # the site's split directory, written by `fedpose site set-data`
ledger_path: {state}/{site}/ledger.sqlite
public_path: FILL-ME          # the site's copy of the public split, written by `fedpose site approve-public`
public_digest: FILL-ME        # its digest, written by `fedpose site approve-public`
eval_path: null               # optional: a held-out split; each global model is scored on it here, never sent
accountant: {accountant}
chunk_size: 16                # per-record gradients held in memory at a time (the site's, whatever is asked)
chunk_memory: null            # a GPU site: e.g. 0.8 runs the most rows at a time that fit 80 % of the free memory
round_seconds: null           # a reply leaves this long after its request (null: when done; then the time shows)
face_tasks: []                # face tasks this site trains on its face labels (none unless listed)
"""  # noqa: E501 (a policy file: its comments stay aligned)

START_SCRIPT = """\
#!/bin/sh
# Start the SuperNode of {site}: its checks run first (once, never per message), then it runs only the app
# bundles approved in approved.txt, with this site's own key. Started again after an error exit for up to 5 min.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
state=${{STATE_DIRECTORY:-{state}/{site}}}
export FLWR_HOME=${{FLWR_HOME:-$state/flwr}}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec "${{FEDPOSE:-{venv}/bin/fedpose}}" site start --policy "$here/policy.yaml" --approved "$here/approved.txt" \\
  --gate-dir "$state/gate-bin" -- --superlink {address} --root-certificates "$here/ca.crt" \\
  --auth-supernode-private-key "$here/node.key" --host 127.0.0.1 --port {api_port} \\
  --health-server-address 127.0.0.1:{health_port}
"""

SYSTEMD_UNIT = """\
[Unit]
Description=fedpose SuperNode of {site}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={user}
Group={user}
StateDirectory=fedpose/{site}
StateDirectoryMode=0700
WorkingDirectory={install}/{site}
Environment=FEDPOSE={venv}/bin/fedpose
Environment=FLWR_HOME={state}/{site}/flwr
ExecStart={install}/{site}/start-supernode.sh
Restart=on-failure
RestartSec=30
NoNewPrivileges=true
PrivateTmp=true
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths={state}/{site}

[Install]
WantedBy=multi-user.target
"""

SITE_STEPS = """\
On the site's server, as root, in this order:

1. Unpack this kit as {install}/{site} and install fedpose from it (CPU; a GPU site installs its CUDA torch
   first, see the install page):
     cd {install}/{site}
     python3 -m venv {venv}
     {venv}/bin/pip install -c constraints.txt './{wheel}[train]'
     useradd --system --home-dir {state} --shell /usr/sbin/nologin {user}
2. Make the site's own key pair, in this folder (the private key never leaves):
     {venv}/bin/fedpose site keygen --out .
     chown {user}: node.key
   Send node.key.pub to the federation operator; nothing else.
3. Name the data; unpack the public split the operator sends (public-split.tar.gz) here and approve it by the
   digest the operator sends with it (DIGEST; a copy whose images differ is refused); run the site's checks:
     {venv}/bin/fedpose site set-data --policy policy.yaml /path/to/your/split
     tar -xzf /path/to/public-split.tar.gz
     {venv}/bin/fedpose site approve-public --policy policy.yaml --digest DIGEST public-split
     {venv}/bin/fedpose site check --policy policy.yaml
4. Review the app bundle the operator sends (APP.fab), then approve it:
     {venv}/bin/fedpose site approve --bundle APP.fab --approved approved.txt
5. Start the SuperNode as a service, and check it:
     cp fedpose-supernode.service /etc/systemd/system/fedpose-supernode-{site}.service
     systemctl daemon-reload && systemctl enable --now fedpose-supernode-{site}
     {venv}/bin/fedpose site status --policy policy.yaml
     journalctl -u fedpose-supernode-{site} -f
   Stop it with: systemctl stop fedpose-supernode-{site}
   (To try it in a terminal first, without systemd: STATE_DIRECTORY={state}/{site} ./start-supernode.sh)
6. Watch it in a browser (read-only; it listens on this machine only):
     {venv}/bin/fedpose console --policy policy.yaml
"""

SERVER_STEPS = """\
On the federation server:

1. Keep ca.key and server.key private (0600); never copy them to a site. Install fedpose from this folder
   where it is not installed yet (then put {venv}/bin on PATH):
     python3 -m venv {venv}
     {venv}/bin/pip install -c constraints.txt './{wheel}[train]'
2. Prepare the public data and pretrained weights (absolute paths, progress output) from the federation's
   config as provisioned (federation.yaml, in this folder). {method_note}:
     fedpose server prepare --config federation.yaml --out /srv/fedpose
   Then export the public split for the sites; it prints its digest. Send each site the archive, and the
   digest by a second channel (a site approves only a copy whose images match it):
     fedpose server export-public --config /srv/fedpose/server.yaml --out /srv/fedpose/public-split.tar.gz
3. Start the SuperLink (in this folder; a service manager can run the same script):
     ./start-superlink.sh
   The sites dial {address}, where only the SuperNodes' API answers; the SuperLink
   itself, and every flwr command, stays on this machine at 127.0.0.1:{control_port}.
4. Add the connection to $FLWR_HOME/config.toml (on this machine):
     [superlink.pilot]
     address = "127.0.0.1:{control_port}"
     root-certificates = "<the absolute path of ca.crt here>"
5. Put each site's public key, as it sent it, in site-keys/<site>.pub, then register them (again after a
   fix is safe; site-nodes.tsv then says which node id is which site):
     ./register-sites.sh
6. Write the app from this install, and the bundle the sites review and approve (/srv/fedpose/app.fab, the
   same bytes every site approves; it prints their SHA-256):
     fedpose server build-app --out /srv/fedpose/app
   Send each site its own folder (never this one) and app.fab. Once the sites run their SuperNodes:
     fedpose server run --connection pilot --app /srv/fedpose/app --config /srv/fedpose/server.yaml --out /srv/fedpose/run1
   It follows the run and exits non-zero unless it finished. After a crash: restart the SuperLink (same
   database), then: fedpose server run --connection pilot --app /srv/fedpose/app --out /srv/fedpose/run1 --resume
7. Its state, rounds and every site's spend, in a terminal or in a browser (read-only, this machine only):
     fedpose server status --out /srv/fedpose/run1
     fedpose console --out /srv/fedpose/run1
"""  # noqa: E501 (commands a reader copies whole)

SUPERLINK_SCRIPT = """\
#!/bin/sh
# Start the central SuperLink (TLS, SuperNode authentication) on this machine only, 127.0.0.1:{control_port},
# where the operator's flwr and fedpose server run reach it; and the sites' address, {listen}:{port}, which
# passes the SuperLink's Fleet API to it and refuses everything else (its Control API, which lists and stops
# runs and registers and unregisters SuperNodes for whoever reaches it, never answers there). A request body
# over {max_body_mib} MiB (the largest a site sends: this federation's model, with room to spare) is refused unread.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
exec "${{FEDPOSE:-fedpose}}" server front --listen {listen}:{port} --superlink 127.0.0.1:{control_port} \\
  --max-body-mib {max_body_mib} --ca "$here/ca.crt" --cert "$here/server.pem" --key "$here/server.key" -- \\
  flower-superlink --ssl-ca-certfile "$here/ca.crt" --ssl-certfile "$here/server.pem" \\
  --ssl-keyfile "$here/server.key" --enable-supernode-auth --host 127.0.0.1 --port {control_port} \\
  --database "$here/superlink.db"
"""

REGISTER_SCRIPT = """\
#!/bin/sh
# Register each site's public key (site-keys/<site>.pub, as the site sent it) with the SuperLink, named as the site.
# Safe to run again: a key already registered is reported and skipped, and every site is tried. Which node id is
# which site (flwr supernode list shows ids only): site-nodes.tsv, printed as a table at the end.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
exec "${{FEDPOSE:-fedpose}}" server register-sites --connection pilot --keys "$here/site-keys" \\
  --record "$here/site-nodes.tsv" --sites {sites}
"""


def method_note(method: str) -> str:
    """What SERVER_STEPS says of the federation's method: the sites' policies are record-level unless they opt in."""
    if method in WITH_PUBLIC:
        return (f"It runs {method}, Feature-DP: a site's policy refuses it\n   unless that site opts in "
                "(release_blurred_images_and_labels: true), after reading what that gives this server")
    return f"It runs {method}, record-level DP,\n   which every site's policy accepts"
