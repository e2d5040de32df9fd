"""``fedpose simulate | ledger | certs | site-policy``: the federation's command line.

Registered by ``cli.main`` when this module exists. Handlers import what they
need inside, so ``fedpose --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("fedpose")

# Every Flower process we start runs offline, installs nothing and keeps Ray on loopback.
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def flower_env(flwr_home: Path) -> None:
    """Set the Flower environment of this process (before flwr or ray is imported)."""
    os.environ.update(FLOWER_ENV)
    os.environ.setdefault("FLWR_HOME", str(flwr_home))
    Path(os.environ["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------


def simulation_apps(run_config: dict[str, Any]) -> tuple[Any, Any]:
    """Server and client apps for ``run_simulation``, which passes no run config: inject ours."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from client import client_app as site_app
    from server import server_app as central_app

    server = ServerApp()
    client = ClientApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = dict(run_config)
        central_app.serve(grid, context)

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        return site_app.on_query(msg, context, dict(run_config))

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        return site_app.on_train(msg, context, dict(run_config))

    return server, client


def prepare_simulation(cfg: Any, out: Path, *, progress: bool) -> Path:
    """Data, pretrained weights, the P2 check, site policies and the run's config file; returns its path."""
    from client.policy import write_policy
    from client.policy_resolve import default_policy
    from shared.config import dump_config
    from shared.data.split import check_disjoint, check_no_duplicates
    from shared.data.mpii import load_split
    from shared.runs import ensure_data, ensure_pretrained

    root = ensure_data(cfg, progress=progress)
    if cfg.train.strategy != "scratch":
        ensure_pretrained(cfg, progress=progress)
    public = load_split(root, cfg.data.public_split)
    for split in cfg.data.train_splits:
        private = load_split(root, split)
        check_disjoint(public, private)  # P2, by image content
        check_no_duplicates(private, what=f"site data {split}")  # one image = one record
    for i, split in enumerate(cfg.data.train_splits):
        path = out / "sites" / split / "policy.yaml"
        if not path.exists():
            write_policy(path, default_policy(cfg, out, i))
    config_path = out / "run-config.yaml"
    dump_config(cfg, config_path)
    return config_path


def cmd_simulate(args: argparse.Namespace) -> int:
    from shared.config import check_simulation_sites, load_config

    out = Path(args.out).expanduser().resolve()
    overrides: dict[str, Any] = {"federation.out": str(out)}
    if args.rounds is not None:
        overrides["federation.rounds"] = args.rounds
    if args.resume:
        previous = out / "run-config.yaml"
        if not previous.is_file():
            raise FileNotFoundError(f"{previous} not found: nothing to resume in {out}")
        cfg = load_config(previous, overrides)
    else:
        if (out / "checkpoint.pt").exists() or (out / "ledger.sqlite").exists():
            raise ValueError(f"{out} already holds a federation: continue it with --resume or choose another --out")
        cfg = load_config(args.config, overrides)
    from server.prepare import absolute_paths

    cfg = absolute_paths(cfg)  # Ray workers may run elsewhere
    check_simulation_sites(cfg)
    out.mkdir(parents=True, exist_ok=True)
    flower_env(out / "flwr-home")
    config_path = prepare_simulation(cfg, out, progress=not args.quiet)
    run_config = {"config": str(config_path), "overrides": "", "out": str(out), "resume": bool(args.resume)}
    sites = len(cfg.data.train_splits)

    from flwr.simulation import run_simulation

    if not args.verbose:
        logging.getLogger("flwr").setLevel(logging.INFO)  # flwr logs its internals at DEBUG
    server, client = simulation_apps(run_config)
    run_simulation(
        server_app=server, client_app=client, num_supernodes=sites,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                        "init_args": {"num_cpus": max(1, min(os.cpu_count() or 1, sites))}},
    )
    metrics_path = out / "metrics.json"
    if not metrics_path.is_file():
        raise RuntimeError(f"the federation ended without writing {metrics_path}; see the log above")
    metrics = json.loads(metrics_path.read_text())
    print_summary(metrics, out)
    return 0


def print_summary(metrics: dict[str, Any], out: Path) -> None:
    from shared.metrics import pckh_table

    print()
    print(pckh_table({f"federated {metrics['method']} ({metrics['rounds']} rounds)": metrics["pckh"]}))
    print("privacy spent per site (accountant " + metrics["accountant"] + "; run = this federation, the max of the "
          "server's recomputation and the site's own reports; lifetime = the site's whole ledger):")
    for site, s in sorted(metrics["sites"].items()):
        print(f"  {site}: run eps = {s['epsilon']:.4f} of {s['budget']:g} (delta {s['delta']:g}), lifetime eps = "
              f"{s['epsilon_lifetime']:.4f}, sigma = {s['sigma']:.4f}, q = {s['sample_rate']:.4f}, {s['rounds']} rounds, "
              f"{s['status']}")
    print(f"claim: {metrics['claim']}")
    print(f"results in {out}: model.pt, metrics.json, report.md, federation.png, rounds.jsonl, ledger.sqlite")


# ---------------------------------------------------------------------------
# ledger
# ---------------------------------------------------------------------------


def ledger_rows(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """("server" | "site", rows) of a fedpose ledger file."""
    if not path.is_file():
        raise FileNotFoundError(f"ledger {path} does not exist")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as err:
        raise ValueError(f"{path} is not an SQLite ledger: {err}") from err
    try:
        if "sites" in tables:
            rows = [dict(r) for r in conn.execute(
                "SELECT site, round, sigma, sample_rate, steps, delta, epsilon, site_run_epsilon, counted_epsilon,"
                " site_epsilon, budget, aggregated, state FROM spend ORDER BY site, id")]
            return "server", rows
        if "spend" in tables:
            has_unit = "unit" in {r[1] for r in conn.execute("PRAGMA table_info(spend)")}  # schema 3 (issue #11)
            rows = [dict(r) for r in conn.execute(
                "SELECT site, federation, round, method, psi, " + ("unit" if has_unit else "'record' AS unit") +
                ", sigma, sample_rate, steps, delta, epsilon, budget, accountant FROM spend ORDER BY id")]
            return "site", rows
    finally:
        conn.close()
    raise ValueError(f"{path} is not a fedpose ledger (no 'spend' table)")


def cmd_ledger(args: argparse.Namespace) -> int:
    if args.reconcile:
        from shared.privacy.reconcile import reconcile

        server_db, *site_dbs = args.reconcile
        if not site_dbs:
            raise ValueError("ledger --reconcile: give the server ledger, then one or more site ledgers")
        result = reconcile(server_db, site_dbs)
        print(json.dumps(result.to_dict(), indent=1) if args.json else "\n".join(result.lines()))
        return 0 if result.ok else 1
    if not args.db:
        raise ValueError("ledger: give --db FILE, or --reconcile SERVER_DB SITE_DB...")
    kind, rows = ledger_rows(Path(args.db))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{kind} ledger {args.db}: no spend recorded")
        return 0
    if kind == "server":
        columns = ["site", "round", "sigma", "sample_rate", "steps", "delta", "epsilon", "site_run_epsilon",
                   "counted_epsilon", "site_epsilon", "budget", "aggregated", "state"]
    else:
        columns = ["site", "federation", "round", "method", "psi", "unit", "sigma", "sample_rate", "steps", "delta",
                   "epsilon", "budget"]
    header = {"epsilon": "run eps (server)" if kind == "server" else "lifetime eps", "site_run_epsilon":
              "run eps (site)", "counted_epsilon": "run eps (counted)", "site_epsilon": "lifetime eps (site)"}

    def fmt(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key in ("sigma", "sample_rate", "epsilon", "site_epsilon", "site_run_epsilon", "counted_epsilon", "budget"):
            return f"{value:.4f}"
        if key == "delta":
            return f"{value:.1e}"
        return str(value)

    table = [[header.get(c, c) for c in columns]] + [[fmt(c, r[c]) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    print(f"{kind} ledger {args.db}")
    for j, row in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    return 0


# ---------------------------------------------------------------------------
# certs
# ---------------------------------------------------------------------------


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def make_certs(out: Path, *, nodes: int, hosts: list[str], days: int, force: bool = False) -> list[Path]:
    """CA, a server certificate for ``hosts`` and the loopback names (SAN) and ``nodes`` ECDSA node key
    pairs (OpenSSH format).

    Files: ca.crt, ca.key, server.pem, server.key, node-<i> (private key) and node-<i>.pub.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if nodes < 0 or days < 1:
        raise ValueError(f"--nodes ({nodes}) must be >= 0 and --days ({days}) >= 1")
    names = ["ca.crt", "ca.key", "server.pem", "server.key"] + [f"node-{i}{s}" for i in range(1, nodes + 1)
                                                               for s in ("", ".pub")]
    out.mkdir(parents=True, exist_ok=True)
    existing = [n for n in names if (out / n).exists()]
    if existing and not force:
        raise ValueError(f"{out} already holds {existing[:3]}: use --force to overwrite or another --out")

    def write(name: str, data: bytes, private: bool) -> Path:
        path = out / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return path

    pem = serialization.Encoding.PEM
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpose CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    # The SuperLink's own SuperExec (which starts every ServerApp) dials it on 127.0.0.1: without the
    # loopback names the handshake fails and every run stays "pending". The first host is the one sites dial.
    for host in dict.fromkeys([*hosts, *LOOPBACK_NAMES]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    no_pw = serialization.NoEncryption()
    written = [
        write("ca.crt", ca_cert.public_bytes(pem), False),
        write("ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pw), True),
        write("server.pem", server_cert.public_bytes(pem), False),
        write("server.key", server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, no_pw), True),
    ]
    for i in range(1, nodes + 1):
        key = ec.generate_private_key(ec.SECP384R1())  # Flower's SuperNode auth: OpenSSH NIST EC keys
        written.append(write(f"node-{i}", key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, no_pw), True))
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        written.append(write(f"node-{i}.pub", pub + f" fedpose-node-{i}\n".encode(), False))
    return written


def cmd_certs(args: argparse.Namespace) -> int:
    from cli.provision import _inside_git_tree

    repo = _inside_git_tree(Path(args.out).expanduser().resolve())
    if repo is not None:
        raise ValueError(f"{args.out} is inside the git work tree {repo}: private keys must never be written there; "
                         "choose a folder outside any repository (or use `fedpose provision`)")
    hosts = args.host or list(LOOPBACK_NAMES)
    written = make_certs(Path(args.out), nodes=args.nodes, hosts=hosts, days=args.days, force=args.force)
    names = ", ".join(dict.fromkeys([*hosts, *LOOPBACK_NAMES]))
    print(f"wrote {len(written)} files to {args.out}: CA (ca.crt, ca.key), server certificate for {names} "
          f"(server.pem, server.key), {args.nodes} node key pairs (node-<i>, node-<i>.pub)")
    print("keep ca.key, server.key and node-<i> private; register each node-<i>.pub with "
          "`flwr supernode register node-<i>.pub <connection>`")
    return 0


# ---------------------------------------------------------------------------
# site-policy
# ---------------------------------------------------------------------------


def cmd_site_policy(args: argparse.Namespace) -> int:
    from client.ledger import SiteLedger
    from client.policy import load_policy, min_sigma_for, policy_from_dict, policy_to_dict, write_policy
    from client.site_data import check_site, load_split_dir, public_digest

    if args.check:
        policy = load_policy(args.check)
    else:
        required = ("out", "site", "epsilon", "delta", "lifetime_rounds", "sample_rate", "steps_per_round",
                    "data_path")
        missing = [f"--{n.replace('_', '-')}" for n in required if getattr(args, n) is None]
        if missing:
            raise ValueError(f"site-policy: give {', '.join(missing)} (or --check FILE)")
        out = Path(args.out).resolve()
        digest = None
        if args.public_path:
            public = Path(args.public_path)
            public = public if public.is_absolute() else (out.parent / public)
            digest = public_digest(load_split_dir(public.resolve(), "public set"))
        policy = policy_from_dict({
            "policy_version": 2, "site": args.site, "epsilon": args.epsilon, "delta": args.delta,
            "lifetime_rounds": args.lifetime_rounds,
            "rounds_per_federation": args.rounds_per_federation or args.lifetime_rounds,
            "sample_rate": args.sample_rate, "steps_per_round": args.steps_per_round, "clip_norm": args.clip_norm,
            "psi": args.psi, "psi_min": args.psi_min, "augment": not args.no_augment,
            "data_path": args.data_path, "ledger_path": args.ledger_path or "ledger.sqlite",
            "public_path": args.public_path, "public_digest": digest, "min_sigma": args.min_sigma,
            "eval_path": args.eval_path, "accountant": args.accountant, "methods": args.methods.split(","),
            "unit": args.unit, "max_records_per_patient": args.max_records_per_patient,
        }, base=out.parent)
        write_policy(out, policy)
        print(f"wrote {out}" + (f" (approving the public set {policy.public_path}, digest {digest})" if digest else ""))
    print(json.dumps(policy_to_dict(policy), indent=1))
    checked = check_site(policy)  # the site's own checks: data, delta < 1/n, duplicates, public digest, P2
    with SiteLedger(policy.ledger_path, site=policy.site) as ledger:
        rounds, spent = ledger.rounds_done(), ledger.epsilon(delta=policy.delta, accountant=policy.accountant)
    print(f"checked: {len(checked.private)} private records, delta < 1/n, no duplicate images"
          + (f", public set {len(checked.public)} records matching digest {policy.public_digest} and disjoint from "
             "the private images (P2)" if checked.public is not None else ", no public set (basis_mode site needs one)"))
    print(f"ledger {policy.ledger_path}: writable, {rounds} rounds recorded, lifetime eps spent {spent:.4f} of "
          f"{policy.epsilon:g}")
    cap = policy.max_records_per_patient
    if policy.unit == "patient":
        print(f"unit: patient ({checked.patients.count} patients; each contributes the clipped mean gradient of "
              f"{'all' if cap is None else f'at most {cap}'} of their records; sample_rate is per patient)")
    else:
        print("unit: record" + (f" (stated cap {cap} records per patient: the claim's group bound)" if cap else
                                " (no cap on records per patient stated: the claim says a patient with k records "
                                "gets only k eps)"))
    print(f"minimum sigma this site accepts: {min_sigma_for(policy):.4f} ({policy.lifetime_rounds} lifetime rounds x "
          f"{policy.steps_per_round} steps at q={policy.sample_rate:g}, eps={policy.epsilon:g}, "
          f"delta={policy.delta:g}, {policy.accountant})")
    return 0


# ---------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------


def register(sub: Any) -> None:
    from cli.main import DEFAULT_CONFIG

    sim = sub.add_parser("simulate", help="run the federation in Flower's simulation (one process, Ray)")
    sim.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    sim.add_argument("--out", required=True, help="results directory (ledgers, rounds.jsonl, report, model)")
    sim.add_argument("--rounds", type=int, default=None, help="override federation.rounds")
    sim.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    sim.add_argument("--quiet", action="store_true", help="no progress bars")
    sim.add_argument("--verbose", action="store_true", help="debug logging")
    sim.set_defaults(func=cmd_simulate)

    led = sub.add_parser("ledger", help="privacy spend per site and round from a server or site ledger")
    led.add_argument("--db", default=None, help="ledger.sqlite (server) or a site's ledger")
    led.add_argument("--reconcile", nargs="+", metavar="DB", default=None,
                     help="SERVER_DB SITE_DB...: print every difference; exit 1 if the server's claim is below a "
                          "site's own ledger")
    led.add_argument("--json", action="store_true", help="print a JSON list of rows")
    led.add_argument("--verbose", action="store_true", help="debug logging")
    led.set_defaults(func=cmd_ledger)

    certs = sub.add_parser("certs", help="CA, server TLS certificate and SuperNode key pairs for a pilot")
    certs.add_argument("--out", required=True)
    certs.add_argument("--nodes", type=int, required=True, help="number of SuperNode key pairs")
    certs.add_argument("--host", action="append", default=None,
                       help="server name or IP for the certificate (repeat; default localhost, 127.0.0.1, ::1)")
    certs.add_argument("--days", type=int, default=365)
    certs.add_argument("--force", action="store_true", help="overwrite existing files")
    certs.add_argument("--verbose", action="store_true", help="debug logging")
    certs.set_defaults(func=cmd_certs)

    pol = sub.add_parser("site-policy", help="write or check a site's privacy policy YAML (everything that decides "
                                             "its guarantee, pinned by the site)")
    pol.add_argument("--check", default=None, help="validate this policy file and run the site's own checks")
    pol.add_argument("--out", default=None, help="policy file to write")
    pol.add_argument("--site", default=None, help="the site's name (used in every log, report and ledger row)")
    pol.add_argument("--epsilon", type=float, default=None, help="lifetime budget over the site's whole ledger")
    pol.add_argument("--delta", type=float, default=None, help="e.g. 1e-5; must be < 1/n")
    pol.add_argument("--lifetime-rounds", type=int, default=None, help="rounds over the ledger's whole life")
    pol.add_argument("--rounds-per-federation", type=int, default=None,
                     help="rounds in any one federation (default: --lifetime-rounds)")
    pol.add_argument("--sample-rate", type=float, default=None,
                     help="Poisson rate q of the private batch, e.g. batch size / n (n never leaves the site)")
    pol.add_argument("--steps-per-round", type=int, default=None, help="most local steps per round")
    pol.add_argument("--clip-norm", type=float, default=1.0, help="per-sample clip C (default 1.0)")
    pol.add_argument("--psi", choices=("blur", "pixelate"), default="blur", help="fdp/fpdp feature map (default blur)")
    pol.add_argument("--psi-min", type=float, default=0.03,
                     help="minimum psi strength, a fraction of min(H, W): blur sigma or pixelate block (default 0.03)")
    pol.add_argument("--no-augment", action="store_true", help="pin augmentation off (default: on)")
    pol.add_argument("--methods", default="dpsgd,proj,fdp,fpdp", help="comma-separated methods the site accepts")
    pol.add_argument("--unit", choices=("record", "patient"), default="record",
                     help="privacy unit (default record); patient needs patient ids (patients.json) and makes "
                          "--sample-rate the rate over patients")
    pol.add_argument("--max-records-per-patient", type=int, default=None,
                     help="patient: records of a patient used (a fixed subset); record: the stated cap of the claim's "
                          "group-privacy bound (checked against the data's patient ids)")
    pol.add_argument("--data-path", default=None, help="the site's split directory (annotations.json, images/)")
    pol.add_argument("--ledger-path", default=None, help="default: ledger.sqlite beside the policy")
    pol.add_argument("--public-path", default=None,
                     help="the site's copy of the public split (basis_mode site); its digest is approved in the policy")
    pol.add_argument("--eval-path", default=None,
                     help="a held-out split (disjoint from --data-path): the site scores every global model it "
                          "receives on it and keeps the numbers (evaluation.jsonl beside the ledger)")
    pol.add_argument("--min-sigma", type=float, default=None, help="default: derived from the budget")
    pol.add_argument("--accountant", choices=("rdp", "prv"), default="rdp")
    pol.add_argument("--verbose", action="store_true", help="debug logging")
    pol.set_defaults(func=cmd_site_policy)


if __name__ == "__main__":  # pragma: no cover
    from cli.main import main

    sys.exit(main())
