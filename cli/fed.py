"""``fedpose simulate | ledger | certs | site-policy``: the federation's command line.

Registered by ``fedpose.cli.main``. Handlers import what they need inside, so ``fedpose --help`` stays
instant; ``simulate`` is ``fedpose.cli.local_federation.simulate``. The handlers of ``ledger``
and ``site-policy`` live in ``fedpose.cli.ledger`` and ``fedpose.cli.site_policy``, the key
material of ``certs`` in ``fedpose.server.kits.certs``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedpose.server.kits.certs import LOOPBACK_NAMES, make_certs
from fedpose.cli.ledger import cmd_ledger
from fedpose.cli.site_policy import cmd_site_policy

# ---------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from fedpose.cli.common import emit_json, parse_sets
    from fedpose.cli.local_federation import simulate

    metrics = simulate(args.config, args.out, sets=parse_sets(args.set), rounds=args.rounds, seed=args.seed,
                       resume=args.resume, progress=not args.quiet, quiet=args.quiet or args.json)
    if not emit_json(args, metrics):
        print_summary(metrics, Path(args.out).expanduser().resolve())
    return 0


def print_summary(metrics: dict[str, Any], out: Path) -> None:
    from fedpose.cli.common import data_line
    from fedpose.server.report import read_rounds
    from fedpose.shared.metrics.pose import pckh_table

    print()
    print(pckh_table({f"federated {metrics['method']} ({metrics['rounds']} rounds)": metrics["pckh"]}))
    rounds_file = out / "rounds.jsonl"
    curve = [float(r["pckh_mean"]) for r in read_rounds(rounds_file)] if rounds_file.is_file() else []
    start, final = metrics.get("initial_pckh_mean"), metrics["pckh_mean"]
    if start is not None:
        best = f"; best {max(curve):.2f} at round {1 + curve.index(max(curve))}" if curve else ""
        print(f"PCKh@0.5: start {start:.2f} (the public-pretrained model) -> {final:.2f} after {metrics['rounds']} "
              f"rounds (gain {final - start:+.2f}{best})")
    print(data_line(metrics))
    print("privacy spent per site (accountant " + metrics["accountant"] + "; run = this federation, the max of the "
          "server's recomputation and the site's own reports; lifetime = the site's whole ledger):")
    for site, s in sorted(metrics["sites"].items()):
        print(f"  {site}: run eps = {s['epsilon']:.4f} of {s['budget']:g} (delta {s['delta']:g}), lifetime eps = "
              f"{s['epsilon_lifetime']:.4f}, sigma = {s['sigma']:.4f}, q = {s['sample_rate']:.4f}, "
              f"{s['rounds']} rounds, {s['status']}")
    print(f"claim: {metrics['claim']}")
    print(f"results in {out}: model.pt, metrics.json, report.md, federation.png, rounds.jsonl, ledger.sqlite")


def cmd_certs(args: argparse.Namespace) -> int:
    from fedpose.shared.flower.node_keys import inside_git_tree

    repo = inside_git_tree(Path(args.out).expanduser().resolve())
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


def register(sub: Any) -> None:
    from fedpose.cli.common import add_config, add_json

    sim = sub.add_parser("simulate", help="run the federation in Flower's simulation (one process, Ray)")
    add_config(sim)
    sim.add_argument("--out", required=True, help="results directory (ledgers, rounds.jsonl, report, model)")
    sim.add_argument("--rounds", type=int, default=None, help="override federation.rounds")
    sim.add_argument("--seed", type=int, default=None,
                     help="seed every site's noise and sampling: the run repeats exactly (NOT for production)")
    sim.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    add_json(sim, "the federation's metrics.json (Flower's log is then left out)")
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
    certs.add_argument("--out", required=True, help="folder for the key material (outside any git repository)")
    certs.add_argument("--nodes", type=int, required=True, help="number of SuperNode key pairs")
    certs.add_argument("--host", action="append", default=None,
                       help="server name or IP for the certificate (repeat; default localhost, 127.0.0.1, ::1)")
    certs.add_argument("--days", type=int, default=365, help="certificate validity in days (default 365)")
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
    pol.add_argument("--expected-batch", type=float, default=None,
                     help="B: the expected private batch per step (records, or patients with --unit patient); the "
                          "public constant the noisy sum is divided by")
    pol.add_argument("--sample-rate", type=float, default=None,
                     help="Poisson rate q of the private batch (default: B / n, computed here from the data once)")
    pol.add_argument("--steps-per-round", type=int, default=None, help="most local steps per round")
    pol.add_argument("--clip", dest="clip_norm", type=float, default=1.0, help="per-sample clip C (default 1.0)")
    pol.add_argument("--psi", choices=("blur", "pixelate"), default="blur", help="fdp/fpdp feature map (default blur)")
    pol.add_argument("--psi-min", type=float, default=0.03,
                     help="minimum psi strength, a fraction of min(H, W): blur sigma or pixelate block (default 0.03)")
    pol.add_argument("--no-augment", action="store_true", help="pin augmentation off (default: on)")
    pol.add_argument("--augment-multiplicity", type=int, default=1,
                     help="augmented copies of each sampled record (default 1; a request for another is refused)")
    pol.add_argument("--methods", default=None,
                     help="comma-separated methods the site accepts (default: dpsgd,proj; all four with "
                          "--release-blurred-images-and-labels)")
    pol.add_argument("--release-blurred-images-and-labels", action="store_true",
                     help="opt in to Feature-DP (fdp, fpdp): the server can then read, exactly, a blurred copy of "
                          "each image drawn and its pose labels; over a federation it sees the blurred copy and "
                          "labels of every record the public term draws, and from the draws it can count them")
    pol.add_argument("--public-batch-size", type=int, default=32,
                     help="fdp/fpdp: records drawn (each once) for the public term every step")
    pol.add_argument("--public-records", type=int, default=None,
                     help="fdp/fpdp: draw the public term from a fixed set of this many records, chosen by the "
                          "site's check (default: from all records, whose count the draws then show)")
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
    pol.add_argument("--accountant", choices=("rdp", "prv"), default="rdp", help="privacy accountant (default rdp)")
    pol.add_argument("--verbose", action="store_true", help="debug logging")
    pol.set_defaults(func=cmd_site_policy)
