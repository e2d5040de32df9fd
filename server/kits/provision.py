"""One kit per site and one for the server of a pilot federation (``fedpose provision`` parses and calls).

Each site's kit holds what its IT staff need and nothing of another site's: the CA certificate,
a policy template with the federation's mechanism filled in and three values left for the site
(each filled by a command: ``site set-data``, ``site approve-public``), ``kit.json`` (the SuperLink
address and the kit's file names), a start script and a systemd unit, and a README with the steps.
No private key of a site is ever made here: each site makes its own (``fedpose site keygen``) and
sends only the public key, so node authentication tells a site from the operator. The server's kit
holds the CA, the server certificate, the SuperLink start script and ``register-sites.sh``, which
registers the public keys the sites sent (``site-keys/<site>.pub``). The SuperLink listens on 127.0.0.1
only; the sites' address is ``fedpose server front`` (server/front.py), which passes its Fleet API
alone. Private keys are written at 0600, never inside a git work tree (a kit there is one ``git add``
away from being published).
The texts are the templates of ``fedpose.server.kits.templates``, which the deployment guide shows too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fedpose.server.kits import templates as kit
from fedpose.shared.flower.node_keys import inside_git_tree

log = logging.getLogger("fedpose")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Federation:
    """Who takes part and where they dial: the sites' names, the server's names (the first is the address the
    sites dial; all go into its certificate), the port the sites dial and the SuperLink's own port."""

    sites: tuple[str, ...]
    hosts: tuple[str, ...] = ("localhost",)
    port: int = 8000
    control_port: int = kit.CONTROL_PORT


@dataclass(frozen=True)
class Install:
    """Where a site installs its kit and keeps its state, the account its SuperNode runs as, and the fedpose
    wheel and constraints.txt every kit installs from (None: the checkout's)."""

    install_dir: str = kit.INSTALL
    state_dir: str = kit.STATE
    venv: str = kit.VENV
    user: str = kit.USER
    wheel: str | None = None
    constraints: str | None = None


def listen_host(hosts: tuple[str, ...]) -> str:
    """Where the sites' address listens: 127.0.0.1 when every name the sites may dial is this machine's loopback
    (a pilot on one machine), else every interface."""
    loopback = {"127.0.0.1", "localhost", "::1"}
    return "127.0.0.1" if hosts and all(h in loopback for h in hosts) else "0.0.0.0"


def _write(path: Path, text: str, *, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)


def provision(out: Path, federation: Federation, cfg, *, install: Install = Install(),
              days: int = 365) -> dict[str, Path]:
    """Write the kits under ``out`` (server/ and one folder per site); returns {kit name: folder}. Each kit holds
    the fedpose wheel and constraints.txt it installs from (``install.wheel``/``install.constraints``, else the
    checkout's); the server's certificate is valid for ``days``."""
    from fedpose.server.front import body_limit_mib
    from fedpose.server.kits.certs import make_certs
    from fedpose.server.kits.wheel import kit_install_files
    from fedpose.shared.configuration.methods import WITH_PUBLIC
    from fedpose.shared.configuration.schema import dump_config

    out = out.expanduser().resolve()
    sites = list(federation.sites)
    port, control_port = federation.port, federation.control_port
    repo = inside_git_tree(out)
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
    if not 0 < control_port < 65536 or control_port == port:
        raise ValueError(f"provision: --control-port {control_port} must be a TCP port other than --port {port}")
    if install.user == "root":
        raise ValueError("provision: --user root: each site's SuperNode runs as its own unprivileged service account "
                         f"(it reads the site's data and writes its ledger, nothing else); name one, e.g. {kit.USER}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: provision into a new folder")
    whl, lock = kit_install_files(install.wheel, install.constraints)
    server = out / "server"
    make_certs(server, nodes=0, hosts=list(federation.hosts), days=days)
    (server / "site-keys").mkdir()
    address = f"{federation.hosts[0]}:{port}"
    for name, value in (("--install-dir", install.install_dir), ("--state-dir", install.state_dir),
                        ("--venv", install.venv)):
        if not Path(value).is_absolute():
            raise ValueError(f"provision: {name} {value} must be an absolute path (systemd needs one)")
    paths = {"install": install.install_dir.rstrip("/"), "venv": install.venv.rstrip("/"),
             "state": install.state_dir.rstrip("/"), "user": install.user}
    kits = {"server": server}
    for folder in [server, *(out / site for site in sites)]:  # what each kit's holder installs from
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(whl, folder / whl.name)
        shutil.copyfile(lock, folder / "constraints.txt")
    for i, site in enumerate(sites):
        folder = out / site
        shutil.copyfile(server / "ca.crt", folder / "ca.crt")
        _write(folder / "policy.yaml", kit.POLICY.format(
            site=site, epsilon=cfg.privacy.epsilon, delta=cfg.privacy.delta, lifetime_rounds=cfg.federation.rounds,
            rounds=cfg.federation.rounds, batch_size=cfg.train.batch_size, local_steps=cfg.federation.local_steps,
            clip_norm=cfg.privacy.clip_norm, psi=cfg.privacy.psi, psi_min=cfg.privacy.psi_param,
            augment=str(cfg.data.augment).lower(), public_batch_size=cfg.train.public_batch_size,
            augment_multiplicity=cfg.privacy.augment_multiplicity, accountant=cfg.privacy.accountant,
            **paths))
        _write(folder / "kit.json", json.dumps({"site": site, "superlink": address, "ca": "ca.crt",
                                                "approved": "approved.txt", "key": "node.key"}, indent=1) + "\n")
        _write(folder / "start-supernode.sh", kit.START_SCRIPT.format(site=site, address=address,
                                                                     api_port=9094 + 2 * i, health_port=9095 + 2 * i,
                                                                     **paths), mode=0o755)
        _write(folder / "fedpose-supernode.service", kit.SYSTEMD_UNIT.format(site=site, **paths))
        _write(folder / "README.txt",
               f"fedpose site kit for {site}\n\n" + kit.SITE_STEPS.format(site=site, wheel=whl.name, **paths))
        kits[site] = folder
    _write(server / "register-sites.sh", kit.REGISTER_SCRIPT.format(sites=" ".join(sites)), mode=0o755)
    _write(server / "start-superlink.sh", kit.SUPERLINK_SCRIPT.format(port=port, control_port=control_port,
                                                                      max_body_mib=body_limit_mib(cfg),
                                                                      listen=listen_host(federation.hosts)),
           mode=0o755)
    dump_config(cfg, server / "federation.yaml")  # the config the kits were made from, --set included
    _write(server / "README.txt", "fedpose server kit\n\n" + kit.SERVER_STEPS.format(
        address=address, control_port=control_port, wheel=whl.name, venv=paths["venv"],
        method_note=kit.method_note(cfg.train.method)))
    if cfg.train.method in WITH_PUBLIC:
        log.warning("the federation's method %s is Feature-DP: the sites' policies accept dpsgd and proj only, "
                    "unless a site opts in to Feature-DP (release_blurred_images_and_labels: true); for a "
                    "record-level federation provision with the recipe of docs/how-to/server.md "
                    "(--set train.method=proj --set train.images=raw+psi --set train.optimizer=sgd "
                    "--set train.momentum=0.9 --set train.lr=0.003 --set federation.site_optimizer=keep)",
                    cfg.train.method)
    return kits
